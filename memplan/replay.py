"""The machinery of the reserved-peak replay (memplan/reserved.py): the traced step expanded to the model's depth,
a run of PyTorch's caching allocator (memplan/allocator.py) with the live blocks, the model's build on the device,
one traced micro-step and a torch.optim step. Each framework's own setup and step order lives beside its memory
model (memplan/frameworks/*_replay.py). Pure Python, no torch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Any

from memplan.allocator import Allocator, AllocatorConfig
from memplan.settings import optimizer_impl

#: steps replayed at most: the recorded runs stop reserving after the third (bench/allocator_replay.py)
MAX_STEPS = 6
# and at least two, or three for DDP, which rebuilds its buckets in the second step

MiB = 1 << 20

# ---- the traced step, repeated to the model's depth ---------------------------------------------------------


@dataclass(frozen=True)
class _Birth:
    region: int  #: index into the template's regions
    slot: int  #: births before it in its region
    size: tuple[int, int]  #: c0, c1
    grad: int | None  #: block of the parameter whose gradient it is (-1: outside the blocks), else None
    #: a gradient: how many gradients born after it were ready before it (LiveBytes.ready_order); -1: a tied
    #: weight's first gradient contribution (LiveBytes.mark_contribution)
    late: int = 0
    #: a kernel's own scratch: (kind, its arguments as lines in the micro-batch), sized by kernels.kernel_scratch
    kernel: tuple[str, tuple[tuple[int, int], ...]] | None = None


def stream_regions(d: dict[str, Any], n: int) -> list[tuple[str, int, int, int]]:
    """The template's regions in order as (kind, traced block, start, end) event indices: "pre" (embedding),
    "F" per block's forward, "mid" (final norm, head, loss and their backward), "B" per block's backward (last
    block first), "post" (the embedding's backward)."""
    fs, bs, be = d["fs"], d["bs"], d["be"]
    nb = len(fs)
    out = [("pre", -1, 0, fs[0])]
    for i in range(nb):
        end = fs[i + 1] if i + 1 < nb else d["fe"][nb - 1]
        out.append(("F", i, fs[i], end))
    out.append(("mid", -1, d["fe"][nb - 1], bs[nb - 1]))
    for i in range(nb - 1, -1, -1):
        start = bs[i] if i == nb - 1 else be[i + 1]
        out.append(("B", i, start, be[i]))
    out.append(("post", -1, be[0], n))
    return out


def step_events(d: dict[str, Any], layers: int, micro_batch: int) -> list[tuple[Any, ...]]:
    """The traced step's events at the model's depth and ``micro_batch``: ("a", key, bytes, grad block or None),
    ("f", key), and ("m", region kind, block) where each region begins (see _expand)."""
    b = micro_batch
    return [("a", e[1], max(_size(e, b), 1), e[3], e[4]) if e[0] == "a" else e for e in _expand(d, layers)]


def forward_block_line(ev: dict[str, Any]) -> tuple[int, int] | None:
    """What each block adds to the live bytes through the forward, as a line (c0, c1) in the micro-batch: between
    the starts of two middle blocks' forwards of the expanded step (_expand; a block born from the repeated
    template, after one born from it too). Without recomputation, what a block saves for backward; with it, also
    what outlives the block only until the forward ends: torch.autocast's cached casts of its weights
    (autocast_mode.cpp cached_cast: a float32 leaf that requires grad is cast once per autocast region and kept
    until the region exits, under no_grad too), which a checkpointed block does not save. None where the step is
    not repeated to depth (traced at full depth)."""
    nb = len(ev.get("fs") or ())
    if not ev.get("events") or not ev.get("expand") or nb not in (2, 3):
        return None
    depth, k = nb + 2, nb - 1  # blocks k and k + 1 both stand for a middle block
    alive: dict[Any, tuple[int, int]] = {}
    at: list[tuple[int, int]] = []
    for e in _expand(ev, depth):
        if e[0] == "a":
            if e[5] is None:  # a kernel's own scratch never outlives its operation
                alive[e[1]] = e[2]
        elif e[0] == "f":
            alive.pop(e[1], None)
        elif e[1] == "F" and e[2] in (k, k + 1):
            at.append((sum(c0 for c0, _ in alive.values()), sum(c1 for _, c1 in alive.values())))
            if len(at) == 2:
                break
    return at[1][0] - at[0][0], at[1][1] - at[0][1]


def _size(e: tuple[Any, ...], micro_batch: int) -> int:
    """A birth's bytes at ``micro_batch``: its line, or a kernel's scratch evaluated there."""
    if e[5] is None:
        line: tuple[int, int] = e[2]
        return line[0] + line[1] * micro_batch
    from memplan.activations.kernels import kernel_scratch

    kind, lines = e[5]
    return kernel_scratch(kind, tuple(c0 + c1 * micro_batch for c0, c1 in lines))


def ready_order(grads: list[tuple[Any, int]], late: dict[Any, int]) -> list[tuple[Any, int]]:
    """Gradients in the order they were ready, from the order they were made and, per gradient, how many made
    after it were ready before it (``late``, by key; LiveBytes.ready_order): each is placed, from the last made
    to the first, after that many of those already placed."""
    out: list[tuple[Any, int]] = []
    for g in reversed(grads):
        out.insert(min(late.get(g[0], 0), len(out)), g)
    return out


#: expansions already made, by (id of the profile's events, depth): the micro-batch only scales their sizes
_EXPANDED: dict[tuple[int, int], tuple[Any, list[tuple[Any, ...]]]] = {}


def _expand(d: dict[str, Any], layers: int) -> list[tuple[Any, ...]]:
    """The traced step at the model's depth, sizes as (c0, c1) lines in the micro-batch. A profile traced at
    full depth is taken as it is; one traced with two alike blocks stands for L: the first block's forward (births
    and what becomes of them, relative to it) for blocks 0..L-2, the last's for block L-1, and in backward the last
    block's for blocks L-1..1 and the first's for block 0; one traced with three (LoRA: the first block unlike the
    rest, memplan/activations/tracing/fit.py) its first, middle and last block for block 0, blocks 1..L-2 and block L-1. Each
    storage dies where its own template says, relative to its block, after as many of that region's births."""
    hit = _EXPANDED.get((id(d["events"]), layers))
    if hit is not None and hit[0] is d["events"]:
        return hit[1]
    if len(_EXPANDED) > 64:
        _EXPANDED.clear()
    out = _expand_now(d, layers)
    _EXPANDED[(id(d["events"]), layers)] = (d["events"], out)
    return out


def _template_block(k: int, depth: int, nb: int, backward: bool) -> int:
    """The traced block that stands for block ``k`` of ``depth``: a two-block template's first for blocks 0..L-2
    in forward and its last for L-1, in backward its last for L-1..1 and its first for 0; a three-block one's
    first for block 0, its middle for 1..L-2, its last for L-1, both ways."""
    if nb == 3:
        return 0 if k == 0 else 2 if k == depth - 1 else 1
    if backward:
        return 1 if k > 0 else 0
    return 0 if k < depth - 1 else 1


def _full_regions(regions: list[tuple[str, int, int, int]], expand: bool, depth: int) -> list[tuple[str, int, int]]:
    """The regions at the model's depth as (kind, block, template region) (_template_block)."""
    idx = {(k, t): r for r, (k, t, _, _) in enumerate(regions)}
    if not expand:
        return [(k, t, r) for r, (k, t, _, _) in enumerate(regions)]
    nb = sum(1 for k, _, _, _ in regions if k == "F")
    full = [("pre", -1, idx["pre", -1])]
    full += [("F", k, idx["F", _template_block(k, depth, nb, False)]) for k in range(depth)]
    full.append(("mid", -1, idx["mid", -1]))
    full += [("B", k, idx["B", _template_block(k, depth, nb, True)]) for k in range(depth - 1, -1, -1)]
    full.append(("post", -1, idx["post", -1]))
    return full


def blas_guess(d: dict[str, Any], births: list[_Birth], region_of: list[int],
               regions: list[tuple[str, int, int, int]]) -> dict[str, int]:
    """Where a profile traced before the first cuBLAS calls were marked (LiveBytes.blas) has them: the forward's
    where the first block's forward begins; the backward's after the first birth of backward that does not grow
    with the micro-batch and holds at least 1 MiB (the head's weight gradient, a matmul's output: measured on the
    H100, the autograd thread's workspace comes right after it), else at backward's first birth."""
    f0 = next((r for r, (k, t, _, _) in enumerate(regions) if k == "F" and t == 0), None)
    out: dict[str, int] = {}
    fe = d.get("forward_end", 0)
    count = 0
    for i, e in enumerate(d["events"]):
        if not isinstance(e, list):
            continue
        if "f" not in out and region_of[i] == f0:
            out["f"] = count
        if "b" not in out and i >= fe and e[1] == 0 and e[0] >= 1 << 20:
            out["b"] = count + 1
        count += 1
    if "b" not in out:
        out["b"] = min(sum(1 for e in d["events"][:fe] if isinstance(e, list)) + 1, len(births))
    out.setdefault("f", 0)  # no first block: at the step's start
    return out


#: a death's slot past every birth of its region: it is placed where the region ends
END_OF_REGION = 1 << 60


def _expand_now(d: dict[str, Any], layers: int) -> list[tuple[Any, ...]]:
    events = d["events"]
    n = len(events)
    regions = stream_regions(d, n)
    region_of = [0] * n
    for r, (_, _, start, end) in enumerate(regions):
        for i in range(start, min(end, n)):
            region_of[i] = r
    births: list[_Birth] = []
    deaths: dict[int, tuple[int, int, int]] = {}  # sid -> (region, slot, position)
    count = [0] * len(regions)
    for i, e in enumerate(events):
        r = region_of[i]
        if isinstance(e, list):
            if len(e) > 2 and e[2] == "k":
                births.append(_Birth(r, count[r], (e[0], e[1]), None, 0, (e[3], tuple(map(tuple, e[4])))))
            else:
                births.append(_Birth(r, count[r], (e[0], e[1]), e[2] if len(e) > 2 else None,
                                     e[3] if len(e) > 3 else 0))
            count[r] += 1
        elif count[r] == 0 and r > 0:
            # a death before the region's first birth happened where the previous region ended: a block's output
            # dies when the model's loop rebinds its hidden states after the next block returns, just past that
            # block's forward hook. Placed at the end of the previous region, it follows that region's own block
            # when the step is repeated to the model's depth (block k's output after block k + 1, not after the
            # last block, which is the template's second)
            deaths[e] = (r - 1, END_OF_REGION, i)
        else:
            deaths[e] = (r, count[r], i)
    nb = len(d["fs"])
    # a deeper model repeats the template's blocks; a shallower one (a pipeline stage of one block from a two-block
    # template) takes the template's last block's forward and its first block's backward for its only block
    expand = bool(d.get("expand")) and nb in (2, 3) and layers != nb and layers >= 1
    L = layers if expand else nb
    full = _full_regions(regions, expand, L)
    where = {(k, b): j for j, (k, b, _) in enumerate(full)}
    tpl_block = {r: t for r, (_, t, _, _) in enumerate(regions)}

    def instance(birth_block: int, birth_tpl: int, death_region: int) -> int:
        kind, t_d = regions[death_region][0], tpl_block[death_region]
        if kind not in ("F", "B"):
            return where[kind, -1]
        if not expand:
            return where[kind, t_d]
        if birth_block < 0:  # born outside the blocks: the first traced block is block 0, the last block L-1
            k = L - 1 if t_d == nb - 1 else t_d
        else:
            k = birth_block + (t_d - birth_tpl)
        return where[kind, min(max(k, 0), L - 1)]

    # per full region: births in order, and the deaths to place before each birth slot
    out: list[tuple[Any, ...]] = []
    # region -> heap of (slot, template position, key, position in its template region)
    pending: dict[int, list[tuple[int, int, int, int]]] = {}
    by_region: dict[int, list[int]] = {}
    for sid, b in enumerate(births):
        by_region.setdefault(b.region, []).append(sid)
    counter = iter(range(1 << 62))
    # the forward's and the backward's first cuBLAS call, after the births before it: ("m", "ws", thread) there
    # (micro_step makes the thread's workspace at its first; a marker repeated with its block is ignored)
    blas = {**blas_guess(d, births, region_of, regions), **(d.get("blas") or {})}  # traced marks win
    marks = {n - 1: thread for thread, n in blas.items() if n > 0}
    for thread, n in blas.items():
        if n <= 0:
            out.append(("m", "ws", thread))
    # where the model's forward returned (the traced loss in hand, its root module's post-forward hooks run):
    # ("m", "fwd_end", -1) in the "mid" region after its births and deaths before that event
    fe: int | None = d.get("forward_end")
    fe_slot: int | None = None
    if fe is not None:
        mid = next((r for r, (k, _, start, end) in enumerate(regions) if k == "mid" and start <= fe <= end), None)
        if mid is not None:
            fe_slot = sum(1 for i in range(regions[mid][2], fe) if isinstance(events[i], list))
    inner = _inner_marks(d, regions, events)
    for j, (kind, blk, r) in enumerate(full):
        out.append(("m", kind, blk))  # where each region begins, for the framework's own moments
        waiting = pending.setdefault(j, [])  # a heap of (slot, template position, key, position in its region)
        sids = by_region.get(r, [])
        inside = inner.get(r, [])
        for slot in range(len(sids) + 1):
            if kind == "mid" and fe is not None and slot == fe_slot:
                while waiting and (waiting[0][0] < slot or (waiting[0][0] == slot and waiting[0][1] < fe)):
                    out.append(("f", heapq.heappop(waiting)[2]))
                out.append(("m", "fwd_end", -1))
            for mslot, mpos, label in inside:
                if mslot == slot:
                    while waiting and (waiting[0][0] < slot or (waiting[0][0] == slot and waiting[0][3] < mpos)):
                        out.append(("f", heapq.heappop(waiting)[2]))
                    out.append(("m", label, blk))
            while waiting and waiting[0][0] <= slot:
                out.append(("f", heapq.heappop(waiting)[2]))
            if slot == len(sids):
                break
            sid = sids[slot]
            b = births[sid]
            key = next(counter)
            size = b.size
            grad = b.grad if b.grad is None or b.grad < 0 else (blk if expand else b.grad)
            out.append(("a", key, size, grad, b.late, b.kernel))
            if sid in marks:
                out.append(("m", "ws", marks[sid]))
            death = deaths.get(sid)
            if death is None:
                continue  # lives past the step (none in a traced step but what it returns)
            dr, dslot, pos = death
            if expand:
                target = instance(blk if kind in ("F", "B") else -1, tpl_block[r], dr)
            else:
                target = where[regions[dr][0], tpl_block[dr]]
            if target < j or (target == j and dslot <= slot):
                target, dslot = j, slot + 1  # never before its birth
            heapq.heappush(pending.setdefault(target, []), (dslot, pos, key, pos - regions[dr][2]))
        while waiting:
            out.append(("f", heapq.heappop(waiting)[2]))
        del pending[j]
    return out


#: the experts module's marks inside a block's regions (tracing/segments.py EXPERT_MARKS), as the replay's region
#: kinds: in forward, its start and end; in backward, its start, its recomputation's start and end, its end
INNER_MARKS = {"F": (("xfs", "XF"), ("xfe", "XFE")),
               "B": (("xbs", "XB"), ("xrs", "XR"), ("xre", "XRE"), ("xbe", "XBE"))}


def _inner_marks(d: dict[str, Any], regions: list[tuple[str, int, int, int]],
                 events: list[Any]) -> dict[int, list[tuple[int, int, str]]]:
    """Per template region, the marks inside it (INNER_MARKS) as (birth slot, position in the region, kind): the
    births of the region before the mark, and its event index from the region's start (a death at the same slot
    before it in the template comes before it)."""
    out: dict[int, list[tuple[int, int, str]]] = {}
    for r, (kind, t, start, end) in enumerate(regions):
        for key, label in INNER_MARKS.get(kind, ()):
            at = d.get(key)
            if not at or t >= len(at) or at[t] < 0 or not start <= at[t] <= end:
                continue
            slot = sum(1 for i in range(start, at[t]) if isinstance(events[i], list))
            out.setdefault(r, []).append((slot, at[t] - start, label))
    for marks in out.values():
        marks.sort()
    return out


# ---- the run ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reserved:
    """The replay's answer for one configuration."""

    peak_bytes: int  #: predicted torch.cuda.max_memory_reserved
    allocated_bytes: int  #: the replay's allocated peak in its last (steady) step: the engine's, by another road
    model: str  #: which framework sequence was replayed
    #: other release orders the framework allows, name -> reserved peak (peak_bytes is the largest)
    variants: dict[Any, Any]
    config: str  #: the allocator settings replayed (PYTORCH_CUDA_ALLOC_CONF), "" for the defaults
    complete: bool = True  #: False: the replay stopped once it passed a limit (peak_bytes: at least this)
    #: per replayed step of the largest variant: (its allocated peak, the reserved peak so far)
    steps: tuple[Any, ...] = ()

    def moved_to(self, allocated: int) -> Reserved:
        """The same allocator overhead over another allocated peak (a tensor-parallel rank's, whose replay ran its
        share traced as a model: memplan/reserved.py _replayed_profile)."""
        d = allocated - self.allocated_bytes
        return replace(self, peak_bytes=self.peak_bytes + d, allocated_bytes=allocated,
                       variants={k: v + d for k, v in self.variants.items()},
                       steps=tuple((a + d, r + d) for a, r in self.steps))


class OverLimit(Exception):
    pass


class Run:
    """An allocator and the live blocks of one replay."""

    def __init__(self, config: AllocatorConfig, resident: tuple[int, ...] = ()) -> None:
        """``resident``: bytes of each block the job holds from before the model is built to its end (the
        model's buffers, ReplayJob.buffers), allocated first."""
        self.a = Allocator(config, device_limit=Run.device_limit, fraction_limit=Run.fraction_limit)
        if Run.made is not None:
            Run.made.append(self.a)
        self.live: dict[Any, Any] = {}
        self.n = 0
        self.anon = 0  #: keys of what the frameworks allocate (positive; a step's are negative)
        self.steps: list[Any] = []
        self.a.steps = self.steps  # type: ignore[attr-defined]
        self.workspaces: set[str] = set()  #: threads whose cuBLAS workspace is made (_workspace)
        #: kept gradients made before others that were ready first: how many (micro_step; ready_order)
        self.late: dict[Any, int] = {}
        for n in resident:
            self.alloc(n)

    #: set by predict: stop (raise OverLimit) once the reserved bytes pass it
    limit: int | None = None
    #: set by reserved.capped: the replay runs under the card's limits (allocator.Allocator device_limit,
    #: fraction_limit), flushing the cache and retrying as PyTorch does, until it fits or runs out of memory
    device_limit: int | None = None
    fraction_limit: int | None = None
    #: set by reserved.predict at the card's limit: every allocator the replay makes, in order
    made: list[Any] | None = None

    def alloc(self, size: int, key: Any = None, stream: int = 0) -> Any:
        if key is None:
            self.anon += 1
            key = self.anon
        a = self.a
        before = a.reserved
        self.live[key] = a.malloc(max(size, 1), stream)
        if a.reserved != before and Run.limit is not None and a.reserved > Run.limit:
            self.over()
        return key

    def over(self) -> None:
        """Stop the replay: the reserved bytes have passed the limit."""
        a = self.a
        raise OverLimit(Reserved(peak_bytes=a.peak_reserved, allocated_bytes=a.peak_allocated,
                                  model="", variants={}, config="", complete=False))

    def offset(self) -> int:
        """A base for one micro-step's integer keys (a step's storages are numbered from 0)."""
        self.n += 1
        return -(self.n << 40)

    def end_step(self) -> None:
        """Record the step's allocated peak and the reserved peak so far; the next step's peak starts anew."""
        self.steps.append((self.a.peak_allocated, self.a.peak_reserved))
        self.a.step_retries.append(self.a.retries)
        self.a.peak_allocated = self.a.allocated

    def free(self, key: Any) -> None:
        b = self.live.pop(key, None)
        if b is not None:
            self.a.free(b)

    def empty_cache(self) -> None:
        self.a.empty_cache()


def bucket_assignment(sizes: list[int], limits: list[int]) -> list[list[int]]:
    """c10d's compute_bucket_assignment_by_size (torch/csrc/distributed/c10d/reducer.cpp) for tensors of one
    dtype and device: tensors in the given order fill a bucket until its bytes reach the current limit, which
    then steps to the next of ``limits`` (the last one repeats). Returns the buckets as index lists."""
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    li = 0
    for i, n in enumerate(sizes):
        cur.append(i)
        total += n
        if total >= limits[li]:
            out.append(cur)
            cur, total = [], 0
            li = min(li + 1, len(limits) - 1)
    if cur:
        out.append(cur)
    return out


@dataclass(frozen=True)
class ReplayJob:
    """What a replay needs, per rank, from the model, the settings and the traced step."""

    build: tuple[tuple[int, bool], ...]  #: bytes of each parameter as built, and whether it is a tied alias
    numels: tuple[int, ...]  #: elements of each parameter the optimizer steps, module order
    state_bytes: int  #: bytes per optimizer-state element
    optimizer_impl: str  #: foreach | fused | single-tensor
    input_bytes: int  #: the batch's input ids (labels are the same tensor)
    workspace_bytes: int  #: cuBLAS workspace per handle (two handles: forward and autograd's thread)
    #: the traced step at the job's depth (_expand: sizes as (c0, c1) lines in the micro-batch)
    step: Any
    #: bytes of each parameter after the model is converted to the recipe's dtype (None: kept as built)
    converted: tuple[int, ...] | None = None
    grad_accum: int = 1  #: micro-steps per optimizer step (the later ones add into the kept gradients)
    micro_batch: int = 1
    #: the optimizer and recipe, for its state tensors (precision.state_allocations)
    optimizer: Any = None
    recipe: Any = None
    #: the shape of each optimizer tensor (() each: 1-D, as numels)
    shapes: tuple[tuple[int, ...], ...] = ()
    #: a 4-bit base (QLoRA): per quantized weight in module order, (bytes of the compute-dtype copy it is quantized
    #: from, bytes of each piece of its bitsandbytes storage: packed data, then its QuantState's tensors)
    quantized: tuple[tuple[int, tuple[int, ...]], ...] = ()
    #: a 4-bit base packed into a float storage (a parameter at its position in ``build``): position -> (bytes of
    #: the compute-dtype copy it is quantized from, bytes of each of its QuantState's tensors)
    packed: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    #: --optimizer muon: per optimizer tensor (the trainable ones, module order), its [a, b] shape where Muon steps
    #: it, None where AdamW does (precision.muon_tensors)
    muon: tuple[tuple[int, int] | None, ...] = ()
    #: --optimizer adam-mini, apollo-adamw, galore-adamw: its step's events (precision.step_events_of), a later
    #: step's and the first's
    step_events: tuple[Any, ...] = ()
    #: the model's buffers in the recipe's dtype (ParamInventory.buffer_sizes), bytes each: on the device from
    #: the start (Run's resident blocks: each replay's Run makes them before the model), never freed
    buffers: tuple[int, ...] = ()

    def state_allocs(self, numel: int, shape: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The state tensors the optimizer makes for one tensor at its first step, bytes each, in order."""
        from memplan.precision import state_allocations

        return state_allocations(self.optimizer, self.recipe, shape or (numel,), numel)

    def first_states(self, run: Run, states: list[Any]) -> None:
        """bitsandbytes' two quantization maps, moved to the device at its first 8-bit state (init_state)."""
        opt = self.optimizer
        if opt is not None and opt.quant_block and any(n >= opt.min_8bit_numel for n in self.numels):
            states.extend(run.alloc(1024) for _ in range(2))


def replay_job(inv: Any, s: Any, numels: list[int], shapes: list[tuple[int, ...]] | None = None) -> ReplayJob:
    """What a replay needs from the model and the settings, ``numels`` the elements of each optimizer tensor
    (``shapes`` their shapes where they are not 1-D)."""

    d = s.activation_profile.data
    # built in fp32 (transformers' default dtype), module order; a tied alias is the head a CausalLM's __init__
    # makes last (``self.lm_head = nn.Linear(...)`` after ``self.model``), with its own weight until post_init
    # ties it (measured: bench/gpu/traces/q05_z2, sm_z2, g3_z2off and g3_z3 allocate it after every block)
    build = [(t.numel * 4, False) for t in inv.tensors]
    build.extend((t.numel * 4, True) for t in inv.tensors for _ in t.tied_names)
    # a recipe that stores bf16 parameters converts the built model (model.to(torch.bfloat16) before wrapping);
    # LoRA adapters on a half-precision base are upcast to fp32 by PEFT (options.lora_recipe: adapter_bytes)
    rc = s.recipe
    converted = tuple(t.numel * (rc.adapter_bytes if rc.adapter_bytes and (".lora_A." in t.name or ".lora_B." in
                                                                            t.name) else rc.param_bytes)
                      for t in inv.tensors) if rc.param_bytes != 4 else None
    quantized, packed = _quantized_load(inv)
    if quantized or packed:
        # from_pretrained with a BitsAndBytesConfig makes every tensor in its dtype (no fp32 build to convert)
        build = [(n, False) for n in (converted or [t.numel * rc.param_bytes for t in inv.tensors])]
        build.extend((t.numel * rc.param_bytes, True) for t in inv.tensors for _ in t.tied_names)
        converted = None
    step = _expand(d["alloc_events"], d["num_layers"])
    if _runs_zero3_linear(s, d):
        step = zero3_linear_order(step)
    from memplan import frameworks

    if frameworks.model(s.strategy.memory_model).computes_with_views and s.recipe.autocast_weight_copies:
        step = uncached_casts(step)
    muon: tuple[Any, ...] = ()
    if s.optimizer.per_tensor == "muon":
        from memplan.precision import muon_tensors

        muon = tuple(tuple(t.shape) if m else None for t, m in zip(inv.tensors, muon_tensors(inv)) if t.trainable)
    from memplan.precision import step_events_of

    world = s.cluster.gpus
    later = step_events_of(s.optimizer, inv, s.recipe, first=False, world=world)
    step_events: tuple[Any, ...] = () if later is None else \
        (tuple(later), tuple(step_events_of(s.optimizer, inv, s.recipe, first=True, world=world) or ()))
    return ReplayJob(muon=muon, step_events=step_events, build=tuple(build), numels=tuple(numels), state_bytes=4 if s.optimizer.factored else s.recipe.state_bytes,
               converted=converted,
               grad_accum=s.grad_accum,
               optimizer_impl=optimizer_impl(s), input_bytes=s.micro_batch * s.seq_len * 8,
               workspace_bytes=s.cluster.blas_workspace_bytes,
               step=step, micro_batch=s.micro_batch,
               optimizer=s.optimizer, recipe=s.recipe, shapes=tuple(shapes or ()), quantized=quantized,
               packed=packed, buffers=inv.buffer_sizes(rc.half_buffers))


def _quantized_load(inv: Any) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], tuple[tuple[int, int, tuple[int, ...]], ...]]:
    """transformers' 4-bit load (Bnb4BitHfQuantizer.create_quantized_param -> bitsandbytes Params4bit.to(device) ->
    _quantize): each linear weight copied to the device in bf16, quantized into its packed data and QuantState
    (functional.py quantize_4bit; double quantization's fp32 absmax requantized), the copy freed. Its pieces, from
    the inventory's 4-bit storage (model/lora.py quantized_weight: the packed weight [(n + 1) // 2, 1], then its
    quant_state tensors); the weight had 2 x rows elements. Biases cast to the compute dtype and bitsandbytes'
    dynamic map are kept as pieces of no weight. A storage packed into a float dtype is a parameter (``packs``):
    its QuantState's pieces go with its position among the parameters (the second result)."""
    out: list[tuple[int, list[int]]] = []
    at = {t.name: i for i, t in enumerate(inv.tensors) if t.packs}
    packed: dict[int, list[int]] = {}
    for t in getattr(inv, "quantized", ()):
        owner = t.name.partition(".quant_state.")[0] if ".quant_state." in t.name else None
        if owner in at:
            packed.setdefault(at[owner], []).append(t.nbytes)
        elif owner is not None and out:
            out[-1][1].append(t.nbytes)
        elif t.dtype == "uint8" and len(t.shape) == 2 and t.shape[1] == 1:
            out.append((2 * 2 * t.shape[0], [t.nbytes]))
        else:
            out.append((0, [t.nbytes]))
    return (tuple((n, tuple(p)) for n, p in out),
            tuple((i, 2 * inv.tensors[i].packs, tuple(p)) for i, p in sorted(packed.items())))


def _runs_zero3_linear(s: Any, d: dict[str, Any]) -> bool:
    """The job runs DeepSpeed ZeRO-3's LinearFunctionForZeroStage3 (zero_optimization.memory_efficient_linear, its
    default) but its step was traced with aten's linear (tracing_keys.trace_linear: the two hold the same peak on
    the GPU, so they share one trace)."""
    from memplan.activations.tracing_keys import trace_linear

    if s.strategy.zero_stage != 3 or not s.ds.memory_efficient_linear:
        return False
    return trace_linear("deepspeed-zero3", device=s.cluster.device, recipe=s.recipe.name) == "aten"


#: uncached_casts applied to steps already made, by the id of the cached one
_UNCACHED: dict[int, tuple[Any, list[tuple[Any, ...]]]] = {}


def uncached_casts(step: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A step traced with autocast's weight casts cached, as a framework that computes with views of its flat
    parameters runs it (FSDP1, use_orig_params=False: split() views are not leaves, so autocast_mode.cpp
    cached_cast casts them anew at every use and never caches them). A cached cast that autograd did not save (a
    recomputed block's forward) lives until the autocast region exits as the model's forward returns: its death
    is the one a block's forward birth has among the deaths right before the ("m", "fwd_end") mark. Without
    the cache it dies as soon as its op has made its output: here, after the next birth that follows it. A cast
    autograd saved dies in backward either way and is left as it is."""
    hit = _UNCACHED.get(id(step))
    if hit is not None and hit[0] is step:
        return hit[1]
    end = next((i for i, e in enumerate(step) if e[0] == "m" and e[1] == "fwd_end"), None)
    out = list(step)
    if end is not None:
        region, born = "", {}
        for i, e in enumerate(step[:end]):
            if e[0] == "m" and e[1] != "ws":
                region = e[1]
            elif e[0] == "a" and region == "F":
                born[e[1]] = i
        moved: dict[int, list[tuple[Any, ...]]] = {}  # position of the birth after which a death now comes -> deaths
        drop = set()
        for i in range(end - 1, -1, -1):
            e = step[i]
            if e[0] == "a":
                break
            if e[0] == "f" and e[1] in born:
                j = born[e[1]] + 1
                while j < end and step[j][0] != "a":
                    j += 1
                moved.setdefault(j, []).append(e)
                drop.add(i)
        if moved:
            out = []
            for i, e in enumerate(step):
                if i not in drop:
                    out.append(e)
                out.extend(moved.get(i, ()))
    if len(_UNCACHED) > 16:
        _UNCACHED.clear()
    _UNCACHED[id(step)] = (step, out)
    return out


#: ZeRO-3's linear order applied to steps already made, by the id of aten's
_ZERO3_ORDERED: dict[int, tuple[Any, list[tuple[Any, ...]]]] = {}


def zero3_linear_order(step: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A step traced with aten's linear, in the order DeepSpeed ZeRO-3's linear allocates its backward:
    LinearFunctionForZeroStage3.backward (deepspeed/runtime/zero/linear.py) makes the input's gradient
    (grad_output.matmul(weight)) before the weight's, where aten's MmBackward0 makes the weight's first. Each
    parameter's gradient (a birth that does not grow with the micro-batch; a tied weight's first contribution,
    the head's, too: LiveBytes.mark_contribution) followed by an activation's gradient
    (one that does), nothing else made between but a cuBLAS workspace mark, is swapped with it; the mark stays
    after the first of the two (a thread's workspace comes right after its first GEMM's output; recorded on the
    H200: bench/gpu/traces/q7_z3mb1, the head's input gradient, the autograd thread's 32 MiB workspace, then the
    head's weight gradient)."""
    hit = _ZERO3_ORDERED.get(id(step))
    if hit is not None and hit[0] is step:
        return hit[1]
    out = list(step)
    i, n = 0, len(out)
    while i < n:
        e = out[i]
        if e[0] == "a" and (e[3] is not None or (len(e) > 4 and e[4] == -1)) and e[2][1] == 0:
            j = i + 1
            while j < n and out[j][0] == "m" and out[j][1] == "ws":
                j += 1
            x = out[j] if j < n else None
            if x is not None and x[0] == "a" and x[3] is None and x[2][1] > 0:
                out[i:j + 1] = [x, *out[i + 1:j], e]
                i = j + 1
                continue
        i += 1
    if len(_ZERO3_ORDERED) > 16:
        _ZERO3_ORDERED.clear()
    _ZERO3_ORDERED[id(step)] = (step, out)
    return out


def build_model(run: Run, job: ReplayJob) -> list[Any]:
    """The model built on the device: each parameter in module order; a tied alias (transformers' lm_head built
    with its own weight, then tied) allocated last and freed when the weights are tied; then, where the recipe
    stores another dtype, Module._apply's conversion, parameter by parameter (the new tensor, then the old one
    freed)."""
    keys: list[Any] = []
    aliases: list[Any] = []
    states: list[Any] = []
    packed = {i: (copy, pieces) for i, copy, pieces in job.packed}
    for n, alias in job.build:
        if not alias and len(keys) in packed:  # a 4-bit weight packed into a float parameter, from its bf16 copy
            copy, pieces = packed[len(keys)]
            c = run.alloc(copy)
            keys.append(run.alloc(n))
            states.extend(run.alloc(p) for p in pieces)
            run.free(c)
            continue
        (aliases if alias else keys).append(run.alloc(n))
    keys.extend(states)
    for k in aliases:
        run.free(k)
    for copy, pieces in job.quantized:  # a 4-bit base: each weight quantized from its bf16 copy on the device
        c = run.alloc(copy) if copy else None
        keys.extend(run.alloc(n) for n in pieces)
        if c is not None:
            run.free(c)
    if job.converted:
        for i, n in enumerate(job.converted):
            new = run.alloc(n)
            run.free(keys[i])
            keys[i] = new
    return keys


def _adam_foreach_temporaries(run: Run, sizes: list[int]) -> None:
    """torch.optim's _multi_tensor_adam(w): ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` makes
    one state-sized tensor per parameter, freed (the list's items in reverse) when the step returns."""
    keys = [run.alloc(n) for n in sizes]
    for k in reversed(keys):
        run.free(k)


def micro_step(run: Run, job: ReplayJob, keep_grads: bool, at: Any = None,
               on_grad: Any = None, on_forward_end: Any = None, events: Any = None,
               off: int | None = None) -> list[tuple[Any, int]]:
    """One traced micro-step; the gradients it makes are kept (their traced death skipped) when ``keep_grads``.
    ``at(kind, block)`` is called where each region begins, ``on_grad(bytes, key, block)`` for each gradient as
    it is made (a true answer: the framework keeps that gradient past its traced death and frees it itself),
    ``on_forward_end()`` where the model's forward returned (its root's post-forward, then backward's start).
    ``events``: a part of the step only (a pipeline stage's forward, or its backward), its storages keyed from
    ``off`` (the same for both parts of one micro-batch, from Run.offset()).
    Returns the kept gradients (key, bytes) in the order they were made."""
    grads: list[tuple[Any, int]] = []
    kept: set[Any] = set()
    off = run.offset() if off is None else off
    a = run.a
    live, afree = run.live, a.free
    malloc = a._malloc_plain if a._plain else a.malloc  # the default configuration's path, one call fewer
    limit = Run.limit if Run.limit is not None else 1 << 62
    mb = job.micro_batch
    for e in (job.step if events is None else events):
        kind = e[0]
        if kind == "a":
            key = off + e[1]
            if e[5] is not None:  # a kernel's own scratch: none at this micro-batch, nothing allocated
                size = _size(e, mb)
                if size:
                    live[key] = malloc(size)
                    if a.reserved > limit:
                        run.over()
                continue
            size = e[2][0] + e[2][1] * mb
            live[key] = malloc(size if size > 0 else 1)
            if a.reserved > limit:
                run.over()
            if e[3] is not None:
                if on_grad is not None and on_grad(size, key, e[3]):
                    kept.add(key)  # the framework keeps this gradient's storage and frees it itself
                if len(e) > 4 and e[4]:
                    run.late[key] = e[4]
                if keep_grads:
                    kept.add(key)
                    grads.append((key, size))
        elif kind == "f":
            key = off + e[1]
            if key not in kept:
                b = live.pop(key, None)
                if b is not None:
                    afree(b)
        elif e[1] == "ws":
            _workspace(run, job, e[2])
        elif e[1] == "fwd_end":
            if on_forward_end is not None:
                on_forward_end()
        elif at is not None:
            at(e[1], e[2])
    return grads


def _workspace(run: Run, job: ReplayJob, thread: str) -> None:
    """A thread's cuBLAS workspace (the forward's "f", autograd's "b"), at its first cuBLAS call, kept for the
    run: at::cuda::getCurrentCUDABlasHandle gives each thread its handle and, at its first use on a stream, a
    workspace from the caching allocator (CUDABlas / CublasHandlePool.cpp), which lands in whatever block fits
    at that moment (where the step marks a thread's first call: ("m", "ws", thread); blas_guess for a profile
    traced before the calls were marked)."""
    if thread not in run.workspaces:
        run.workspaces.add(thread)
        run.alloc(job.workspace_bytes)


def optimizer_step(run: Run, job: ReplayJob, first: bool, states: list[Any]) -> None:
    sizes = [n * job.state_bytes for n in job.numels]
    opt = job.optimizer
    if job.muon:
        _muon_then_adamw(run, job, first, states)
        return
    if job.step_events:
        keys: list[Any] = []
        for kind, x in job.step_events[1 if first else 0]:
            if kind == "f":
                run.free(keys[x])
                keys.append(None)
            else:
                keys.append(run.alloc(x))
                if kind == "s":
                    states.append(keys[-1])
        return
    if opt is not None and opt.scratch == "in-call":
        # lion-pytorch: per tensor, its state at the first step (made in the loop), then update_fn's clone of the
        # state and the sum made from it, both freed when update_fn returns
        for i, n in enumerate(job.numels):
            if first:
                for b in job.state_allocs(n, job.shapes[i] if job.shapes else ()):
                    states.append(run.alloc(b))
            a = run.alloc(sizes[i])
            b = run.alloc(sizes[i])
            run.free(a)
            run.free(b)
        return
    if first:
        job.first_states(run, states)
        for i, n in enumerate(job.numels):  # _init_group: zeros_like per state, parameter by parameter
            for b in job.state_allocs(n, job.shapes[i] if job.shapes else ()):
                states.append(run.alloc(b))
    if job.optimizer_impl == "foreach":
        _adam_foreach_temporaries(run, sizes)
    elif job.optimizer_impl == "single-tensor":
        # exp_avg_sq.sqrt() / bias_correction2_sqrt: two temporaries per tensor, the second (``denom``) bound to
        # the loop's local until the next tensor's replaces it (torch/optim/adam.py _single_tensor_adam);
        # Adafactor's fp32 copies of a 16-bit parameter and its gradient first (precision.step_temporaries:
        # max over i of n[i-1] + k n[i])
        upcast = job.optimizer is not None and job.optimizer.upcasts_half and job.converted is not None
        _single_tensor_temporaries(run, sizes, upcast)


def _single_tensor_temporaries(run: Run, sizes: list[int], upcast: bool = False) -> None:
    """torch.optim's single-tensor Adam loop: per tensor two temporaries, the second bound to the loop's local until
    the next tensor's replaces it (``upcast``: Adafactor's fp32 copies of the parameter and its gradient first)."""
    prev = None
    for n in sizes:
        copies = [run.alloc(n), run.alloc(n)] if upcast else []
        a = run.alloc(n)
        b = run.alloc(n)
        run.free(a)
        for c in copies:
            run.free(c)
        if prev is not None:
            run.free(prev)
        prev = b
    if prev is not None:
        run.free(prev)


def _muon_then_adamw(run: Run, job: ReplayJob, first: bool, states: list[Any]) -> None:
    """torch.optim.Muon's step on its matrices, then torch.optim.AdamW's on the rest (precision.muon_step_scratch):
    Muon's _init_group makes every momentum buffer first (zeros_like(p.grad)); per matrix the Nesterov update
    (the gradient's dtype), its bf16 copy, and five Newton-Schulz steps, each making gram, gram_update and the next
    iterate while the last ones are bound; the result stays bound until the next matrix's update replaces it."""
    gb = job.recipe.grad_bytes if job.recipe is not None else 4
    mu = [i for i, sh in enumerate(job.muon) if sh]
    if first:
        for i in mu:
            states.append(run.alloc(job.numels[i] * gb))
    prev = None
    for i in mu:
        pair = job.muon[i]
        assert pair is not None  # mu holds the Muon-stepped parameters only
        a, b = pair
        k, ab = min(a, b), a * b
        u = run.alloc(gb * ab)  # grad.lerp(buf, momentum)
        if prev is not None:
            run.free(prev)
        x = run.alloc(2 * ab) if gb != 2 else u  # .bfloat16()
        gram = gu = None
        for _ in range(5):
            new = run.alloc(2 * k * k)
            if gram is not None:
                run.free(gram)
            gram = new
            new = run.alloc(2 * k * k)
            if gu is not None:
                run.free(gu)
            gu = new
            new = run.alloc(2 * ab)
            if x is not u:
                run.free(x)
            x = new
        run.free(gram)
        run.free(gu)
        run.free(u)
        prev = x
    if prev is not None:
        run.free(prev)
    rest = [job.numels[i] * job.state_bytes for i, sh in enumerate(job.muon) if not sh]
    if first:
        for n in rest:
            states.extend((run.alloc(n), run.alloc(n)))
    if job.optimizer_impl == "foreach":
        _adam_foreach_temporaries(run, rest)
    elif job.optimizer_impl == "single-tensor":
        _single_tensor_temporaries(run, rest)
