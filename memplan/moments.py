"""The step evaluated against the activation profile: each phase and named moment of a configuration's fixed part
(model states, gradients, buffers; memplan/accounting.py builds it) with the activations alive then, at any
micro-batch. Integers only; memoised on the profile, which the planner asks about many configurations."""

from __future__ import annotations

from typing import Any

from memplan.plan import Phase
from memplan.timeline import NO_HOOK_TRANSIENT, Moment, StepMoment


class Fixed:
    """The micro-batch-independent part of a Plan (see _fixed)."""

    __slots__ = ("weights", "master", "states", "grads", "buffers", "non_activation", "profile", "host_per_node",
                 "shard_group", "between", "comms", "assumptions", "moments", "grad_width", "_blocks", "host_detail",
                 "grads_held", "hook_transient", "kinds", "per_sample", "first_hook_grads_persist")

    def __init__(self, weights: int, master: int, states: int, grads: tuple[int, ...], buffers: tuple[int, ...],
                 non_activation: tuple[int, ...], profile: Any, host_per_node: int, shard_group: int, between: int,
                 comms: int, assumptions: dict[str, Any], moments: tuple[StepMoment, ...] = (),
                 grad_width: int = 2, host_detail: dict[str, int] | None = None) -> None:
        #: per rank, by category: the bytes offload keeps in host memory (their sum x ranks per node is
        #: host_per_node)
        self.host_detail = host_detail or {}
        #: buffers held through the whole step in proportion to the micro-batch, bytes per sample (a pipeline
        #: rank's receive buffers): added to every phase
        self.per_sample = 0
        #: the step's named moments (timeline.StepMoment): each is evaluated with the activations of its moment;
        #: inside a block's backward the block's own grads are added at ``grad_width`` bytes. Each phase is the
        #: largest of its moments and its base.
        self.moments, self.grad_width = moments, grad_width
        #: the block moments count only the gradients whose hook has not taken them yet (ZeRO-3)
        self.grads_held = False
        #: ROOT_FIRST_HOOK's gradients are inside the persistent ones (BufferTimeline.first_hook_grads_persist)
        self.first_hook_grads_persist = False
        #: (bytes per partition element, partitions) a parameter's gradient hook allocates (BLOCK_GRADIENT_HOOK)
        self.hook_transient = NO_HOOK_TRANSIENT
        self._blocks = any(m.at.inside_block for m in moments)
        self.kinds = tuple(sorted({m.at for m in moments}))
        self.weights, self.master, self.states, self.grads, self.buffers = weights, master, states, grads, buffers
        self.non_activation, self.profile, self.host_per_node = non_activation, profile, host_per_node
        self.shard_group, self.between, self.comms, self.assumptions = shard_group, between, comms, assumptions


def phases(f: Fixed, recompute: str, micro_batch: int) -> list[tuple[int, int, int]]:
    """(grads, activations, buffers) per phase at ``micro_batch``."""
    if f.per_sample:
        return [(g, x, b + f.per_sample * micro_batch) for g, x, b in _phases(f, recompute, micro_batch)]
    return _phases(f, recompute, micro_batch)


def _phases(f: Fixed, recompute: str, micro_batch: int) -> list[tuple[int, int, int]]:
    t = f.profile.terms(recompute, micro_batch)
    out = [(g, x, b) for g, x, b in zip(f.grads, (t.forward, t.backward_start, t.saved_less_block, t.left_at_end, 0),
                                        f.buffers)]
    moments = moments_at(f, micro_batch, t.saved_less_block, t.block, t.left_at_end, t.forward)
    # the most each of the first three phases holds: its own term, or a named moment that falls in it
    best = {Phase.FORWARD: f.non_activation[Phase.FORWARD] + t.forward,
            Phase.BACKWARD_START: -1 if loss_covered(f, moments)
            else f.non_activation[Phase.BACKWARD_START] + t.backward_start,
            Phase.BACKWARD: f.non_activation[Phase.BACKWARD] + t.saved_less_block}
    for m, x, gx in moments:
        phase = Phase.FORWARD if m.at.in_forward else Phase.BACKWARD_START \
            if m.at in (Moment.LOSS_BACKWARD, Moment.ALL_SAVED) else Phase.BACKWARD
        if m.total + x + gx > best[phase]:
            best[phase], out[phase] = m.total + x + gx, (m.grads + gx, x, m.buffers)
    return out


def loss_covered(f: Fixed, moments: Any) -> bool:
    """Whether the backward-start phase is the loss moment alone. The profile's backward-start term is the
    most alive anywhere in backward, which with recomputation falls inside a block's backward; paired with what
    is held at the loss (ZeRO-3's gathered head, no bucket yet) it is a moment that never happens (measured:
    ZeRO-3 at 4 ranks, llama-3-8b, full recompute, 2.6 MB over the run at the head's backward). Where the
    strategy evaluates the blocks' own moments (with their buffers) and the profile the loss segment, those
    cover every point of that term."""
    return f._blocks and any(m[0].at == Moment.LOSS_BACKWARD for m in moments)


def moments_at(f: Fixed, micro_batch: int, saved: int, block: int, emb: int,
             fwd: int) -> list[tuple[StepMoment, int, int]]:
    """Each moment of f.moments the profile can evaluate at ``micro_batch``, with its activations and the
    block's own grads (or the hook's transient) in bytes. ``saved`` is the profile's third term: everything saved
    but the last block's activations (timeline.Moment names what each moment holds)."""
    if not f.moments:
        return []
    vals = kind_values_memo(f, micro_batch, saved, block, emb, fwd)
    return [(m, *vals[m.at]) for m in f.moments if m.at in vals]


def kind_values_memo(f: Fixed, micro_batch: int, saved: int, block: int, emb: int,
                      fwd: int) -> dict[int, tuple[int, int]]:
    """_kind_values, memoised on the profile (the planner asks the same micro-batches for many configurations)."""
    key = ("kinds", micro_batch, saved, block, emb, fwd, f.grad_width, f.grads_held, f.hook_transient, f.kinds,
           f.first_hook_grads_persist)
    memo = getattr(f.profile, "_memo", None)
    vals = memo.get(key) if memo is not None else None
    if vals is None:
        vals = kind_values(f, micro_batch, saved, block, emb, fwd)
        if memo is not None:
            memo[key] = vals
    return vals


def kind_values(f: Fixed, micro_batch: int, saved: int, block: int, emb: int,
                 fwd: int) -> dict[int, tuple[int, int]]:
    """kind -> (activation bytes, the moment's own grads or transient in bytes) for each kind of f.moments the
    profile can evaluate (see _moments)."""
    prof = f.profile
    blocks = prof.block_moments(micro_batch, f.grad_width, f.grads_held) if f._blocks else ()
    named = prof.moment_activations(micro_batch)
    M = Moment
    # without a traced timeline (or for a moment it has not recorded), the bound that contains the moment
    acts = {M.SAVED_BUT_LAST_TWO: saved - block, M.ALL_SAVED: saved + block, M.EMBEDDING_OUTPUT: emb,
            M.SAVED_BUT_LAST: saved, M.LAST_BLOCK_BACKWARD_BEGINS: saved + block,
            M.PREVIOUS_BLOCK_BACKWARD_BEGINS: saved, M.LAST_BLOCK_FORWARD_BEGINS: saved,
            M.INSIDE_LAST_BLOCK_FORWARD: fwd, M.PREVIOUS_BLOCK_BACKWARD_ENDS: saved - block,
            M.ROOT_LAST_HOOK_BEFORE_BLOCKS: saved + block, M.FIRST_BLOCK_BACKWARD_BEGINS: saved}
    if M.PREVIOUS_BLOCK_BACKWARD_BEGINS in named and M.PREVIOUS_BLOCK_BACKWARD_ENDS not in named:
        acts[M.PREVIOUS_BLOCK_BACKWARD_ENDS] = named[M.PREVIOUS_BLOCK_BACKWARD_BEGINS] - block
    acts.update(named)
    out: dict[int, tuple[int, int]] = {}
    for kind in f.kinds:
        if kind == M.LOSS_BACKWARD:
            head = prof.loss_moment(micro_batch, f.grad_width)
            if head is not None:
                out[kind] = (head[0], f.grad_width * head[1])
        elif kind == M.ROOT_FIRST_HOOK:
            # not evaluated where the step has no such hook (every parameter outside the blocks frozen, as under
            # LoRA: the first hook is a block's, which the blocks' moments hold) or the profile predates it
            hook = prof.root_first_hook(micro_batch)
            if hook is not None:
                out[kind] = (hook[0], 0 if f.first_hook_grads_persist else f.grad_width * hook[1])
        elif kind == M.BLOCK_GRADIENT_HOOK:
            t = f.hook_transient
            per_block = prof.block_hooks(micro_batch)
            if per_block and t.bucket:
                flush = bucket_flushes(t, per_block, t.depth or len(per_block))
                if flush is not None:
                    out[kind] = flush
                continue
            hooks = [h for blk in per_block for h in blk]
            if hooks:
                x, numel = max(hooks, key=lambda h: h[0] + t.bytes(h[1]))
                out[kind] = (x, t.bytes(numel))
        elif not kind.inside_block:
            out[kind] = (acts[kind], 0)
        elif kind < len(blocks):
            x, g = blocks[kind]
            out[kind] = (x, f.grad_width * g)
    return out


def bucket_flushes(t: Any, blocks: tuple[tuple[tuple[int, int], ...], ...],
                   depth: int) -> tuple[int, int] | None:
    """The gradient hooks of the blocks' backward in order (the last block's, the one before it's for every
    middle block, the first's: profile.block_hooks), with the reduce bucket filling as DeepSpeed fills it
    (stage_1_and_2.py / stage3.py reduce_independent_p_g_buckets_and_remove_grads: a gradient that would overflow
    the bucket reduces it first). Returns (activations, transient) at the reduce that holds the most: the
    activations at the hook that triggers it with that hook's own gradient, the bucket's concatenation and its
    largest gradient's copies (HookTransient.bytes); None where no reduce falls inside the blocks. The middle
    blocks are alike, so once the bucket's state at a block's start repeats, the rest repeat that cycle."""
    sizes: dict[int, int] = {}

    def size(numel: int) -> int:
        b = sizes.get(numel)
        if b is None:
            b = sizes[numel] = t.bytes(numel)
        return b
    best: tuple[int, int] | None = None
    state = (t.lead, 1 if t.lead else 0, size(t.lead_largest) if t.lead else 0)

    def run(blk: tuple[tuple[int, int], ...], state: tuple[int, int, int]) -> tuple[int, int, int]:
        nonlocal best
        elems, count, largest = state
        for x, numel in blk:
            if elems + numel > t.bucket and elems > 0:
                tr = (t.cat_per * elems if count > 1 else 0) + largest + t.own_per * numel
                if best is None or x + tr > best[0] + best[1]:
                    best = (x, tr)
                elems, count, largest = 0, 0, 0
            elems += numel
            count += 1
            largest = max(largest, size(numel))
        return elems, count, largest
    state = run(blocks[0], state)
    middle = max(depth - 2, 0)
    seen: dict[tuple[int, int, int], int] = {}
    history: list[tuple[int, int, int]] = []
    for i in range(middle):
        if state in seen:  # a cycle of i - seen[state] blocks: where the remaining ones leave the bucket
            j = seen[state]
            state = history[j + (middle - i) % (i - j)]
            break
        seen[state] = i
        history.append(state)
        state = run(blocks[1], state)
    if depth >= 2:
        run(blocks[-1], state)
    return best
