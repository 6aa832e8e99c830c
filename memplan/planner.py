"""Search: the fewest GPUs, then the largest micro-batch, then the best strategy, for a model and a GPU size.

For every candidate (strategy x recompute, and the offload variants when allowed) the planner finds the fewest
GPUs at which the job fits with the smallest micro-batch it considers, by bisection over the GPU counts a
cluster can have (powers of two inside a node, then whole nodes). Memory per GPU never grows with more GPUs
(sharded states shrink, the rest stays), which is what makes bisection valid; the GPU count just below the
answer is checked too, so padding effects cannot hide a smaller answer.

At the fewest GPUs any candidate needs, every candidate that fits there gets its largest micro-batch from the
batched evaluator (accounting.required_bytes), and the candidates are ranked:
  1. no recompute before selective before full (recompute costs a forward pass),
  2. the largest micro-batch,
  3. offload last, then the least communication per GPU per step (memplan/comm.py: the bytes that cross nodes,
     then all of them, from each framework's collectives at that GPU count), then the simpler strategy,
  4. the most headroom.
Pure: no torch import when the activation profiles are shipped or cached; no printing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, overload

from memplan import accounting, options
from memplan.errors import SettingsError
from memplan.inputs import quote
from memplan.model.inventory import ParamInventory
from memplan.request import JobRequest, SearchSpace
from memplan.settings import MAX_GPUS, Settings, with_gpus
from memplan.strategies import STRATEGIES

RECOMPUTE_ORDER = ("none", "selective", "full")
#: Offload variants considered with allow_offload (DeepSpeed ZeRO-Offload): label -> (strategy, ds knobs)
OFFLOAD_VARIANTS = {
    "zero2+offload-opt": ("zero2", {"offload_optimizer": True}),
    "zero3+offload-opt": ("zero3", {"offload_optimizer": True}),
    "zero3+offload-all": ("zero3", {"offload_optimizer": True, "offload_param": True}),
}
RANKING = ("the fewest GPUs first; at that count no recompute before full recompute, then the largest micro-batch, "
           "offload last, then the least communication per GPU per step (inter-node bytes, then all bytes: "
           "memplan/comm.py), then the simpler strategy, then the most headroom")


#: the strategies a layout search combines with tensor and pipeline parallelism (memplan/parallel/layout.py layout_of):
#: torchtitan's layout under FSDP2 and DDP, Megatron-DeepSpeed's under ZeRO-1
LAYOUT_STRATEGIES = ("fsdp-full", "ddp", "zero1")
#: the pipeline stages a layout search tries (torchtitan's and Megatron's largest published runs use up to 16)
LAYOUT_STAGES = (1, 2, 4, 8, 16)
#: the sequence length from which a layout search adds context parallelism
LAYOUT_CP_FROM = 16384


@dataclass(frozen=True)
class Candidate:
    label: str  #: strategy name, or an offload variant's label
    strategy: str
    recompute: str
    settings: Settings  #: at the cluster's gpus_per_node, micro-batch 1 (or the fixed one)
    offload: bool
    min_gpus: int | None = None  #: fewest GPUs at which it fits (None: not within max_gpus)
    micro_batch: int | None = None  #: largest micro-batch at the recommended GPU count (None: does not fit)
    peak_bytes: int | None = None
    required_bytes: int | None = None
    headroom_bytes: int | None = None
    #: False: min_gpus and micro_batch are bounds from the allocated peak (the caching allocator's segments left
    #: out: the true micro-batch is at most this one) - a candidate the search did not need to replay
    exact: bool = True
    #: (inter-node, all) bytes per GPU per optimizer step at the recommended count (memplan/comm.py)
    comm: tuple[int, int] | None = None
    tp: int = 1  #: tensor-parallel degree (a layout search's candidates)
    cp: int = 1  #: context-parallel degree (a layout search's candidates, for long sequences)
    ep: int = 1  #: expert-parallel degree (a layout search's candidates, for MoE models)
    pp: int = 1  #: pipeline stages


@dataclass(frozen=True)
class Search:
    gpu_memory_bytes: int
    gpus_per_node: int
    max_gpus: int
    micro_batches: tuple[int, ...]
    candidates: tuple[Candidate, ...]
    best: Candidate | None
    gpus: int | None  #: the recommended GPU count
    notes: tuple[str, ...]
    evaluations: int
    #: what the recommendation must leave free (--min-headroom): candidates fit gpu_memory_bytes less this
    min_headroom_bytes: int = 0


class GpuCounts(Sequence[int]):
    """The GPU counts a job can be given, ascending: powers of two up to a node, then whole nodes up to the most
    (every ``step``-th node count only: the multiples of a layout's ranks), as a sequence computed on demand, so
    bisection over a million GPUs costs what it costs over eight."""

    def __init__(self, gpus_per_node: int, max_gpus: int, multiple: int = 1, above_node: bool = False) -> None:
        from math import gcd

        self.gpn, self.max_gpus = gpus_per_node, max_gpus
        small = [] if above_node else [g for g in _powers_below(gpus_per_node, max_gpus) if g % multiple == 0]
        self.step = multiple // gcd(multiple, gpus_per_node)  # node counts k with k * gpn a multiple of ``multiple``
        first = 2 if above_node else 1
        first = -(-first // self.step) * self.step
        self.first = first
        nodes = max_gpus // gpus_per_node
        self.n_nodes = (nodes - first) // self.step + 1 if nodes >= first else 0
        self.small = small  # all below one node, so before every node count

    def __len__(self) -> int:
        return len(self.small) + self.n_nodes

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i < len(self.small):
            return self.small[i]
        return (self.first + (i - len(self.small)) * self.step) * self.gpn

    def index_at_least(self, g: int) -> int:
        """The index of the first count at least ``g`` (len(self) when none is)."""
        lo, hi = 0, len(self)
        while lo < hi:
            mid = (lo + hi) // 2
            if self[mid] < g:
                lo = mid + 1
            else:
                hi = mid
        return lo


def _powers_below(gpus_per_node: int, max_gpus: int) -> list[int]:
    out, g = [], 1
    while g < gpus_per_node and g <= max_gpus:
        out.append(g)
        g *= 2
    return out


def gpu_counts(gpus_per_node: int, max_gpus: int) -> GpuCounts:
    """Powers of two up to a node, then whole nodes: the GPU counts a job can be given."""
    return GpuCounts(gpus_per_node, max_gpus)


def _layout_candidates(inv: ParamInventory, config: dict | None, strategies: tuple[str, ...],
                       recomputes: tuple[str, ...], base: JobRequest) -> list[Candidate]:
    """Tensor parallelism within a node (powers of two up to its GPUs), pipeline stages across nodes (powers of two
    up to the blocks), with each strategy that runs them; a layout the model refuses (tp not dividing its heads,
    ...) is left out. Under PP the micro-batches per step are --grad-accum, else as many as stages."""
    gpus_per_node = base.cluster.gpus_per_node
    blocks = len(inv.layer_blocks)
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= gpus_per_node]
    pps = [q for q in LAYOUT_STAGES if q <= max(blocks // 2, 1)]  # two blocks a stage at the least
    seq = base.batch.seq_len or 0
    # context parallelism for long sequences (LAYOUT_CP_FROM tokens on): within a node with the TP ranks, each CP
    # rank at least 4,096 tokens, torchtitan's layouts only (its ring attention)
    cps = [1] + [c for c in (2, 4, 8) if seq >= LAYOUT_CP_FROM and seq % (2 * c) == 0 and seq // c >= 4096]
    # expert parallelism for MoE models under FSDP2, with or without pipeline stages: ep dividing the routed
    # experts, within a node (its all-to-alls), a multiple of tp
    from memplan.parallel import routed_experts

    experts = routed_experts(inv)
    eps = [e for e in (2, 4, 8) if experts and experts % e == 0 and e <= gpus_per_node]
    out: list[Candidate] = []

    def add(label: str, name: str, rec: str, gpus: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> None:
        """The layout's candidate at its fewest GPUs, or nothing where the model refuses it (tp not dividing
        its heads, ...). Under PP the micro-batches per step are --grad-accum, else as many as stages."""
        degrees = {k: v for k, v in (("cp", cp), ("ep", ep)) if v > 1}  # the others as the base has them
        job = base.changed(gpus=gpus, strategy=name, recompute=rec, tp=tp, pp=pp, **degrees)
        if pp > 1:
            job = job.changed(grad_accum=base.batch.grad_accum or pp)
        try:
            r = options.resolve(inv, job, config=config)
        except SettingsError:
            return
        out.append(Candidate(label=label, strategy=name, recompute=rec, settings=r.settings, offload=False,
                             tp=tp, pp=pp, cp=cp, ep=ep))

    for name in ("fsdp-full",) if "fsdp-full" in strategies else ():
        for tp in tps:
            for ep in eps:
                if ep % tp:
                    continue
                for pp in (1, *(q for q in pps if q > 1)):
                    for rec in recomputes:
                        add(f"{name} tp{tp}" + (f" pp{pp}" if pp > 1 else "") + f" ep{ep}", name, rec, ep * pp,
                            tp, pp, ep=ep)
    for name in (n for n in strategies if n in LAYOUT_STRATEGIES):
        for tp in tps:
            for pp in pps:
                for cp in cps:
                    if tp * pp * cp == 1 or tp * cp > gpus_per_node or (cp > 1 and name == "zero1"):
                        continue
                    for rec in recomputes:
                        add(f"{name} tp{tp} pp{pp}" + (f" cp{cp}" if cp > 1 else ""), name, rec, tp * pp * cp,
                            tp, pp, cp=cp)
    return out


def _candidates(inv: ParamInventory, config: dict | None, base: JobRequest, space: SearchSpace,
                notes: list[str]) -> list[Candidate]:
    from memplan.activations import valid_recompute

    strategies, recomputes, gpus_per_node = space.strategies, space.recomputes, base.cluster.gpus_per_node
    recomputes = tuple(dict.fromkeys(valid_recompute(r) for r in recomputes))
    labels: list[tuple[str, str, dict[str, Any]]] = []
    for name in strategies:
        if name not in STRATEGIES:
            raise SettingsError(f"unknown strategy {quote(name)}; valid: {', '.join(STRATEGIES)}")
        labels.append((name, name, {}))
    if space.allow_offload:
        labels += [(label, st, knobs) for label, (st, knobs) in OFFLOAD_VARIANTS.items()]
    out = _layout_candidates(inv, config, strategies, recomputes, base) if space.layouts else []
    seen_notes: set[str] = set()
    refused: dict[str, SettingsError] = {}
    for label, st, knobs in labels:
        for rec in recomputes:
            gpus = 1 if STRATEGIES[st].one_gpu else gpus_per_node  # a one-GPU strategy is resolved at its one GPU
            try:
                r = options.resolve(inv, base.changed(gpus=gpus, strategy=st, recompute=rec, **knobs), config=config)
            except SettingsError as exc:  # a strategy this job cannot run (QLoRA under FSDP/ZeRO-3, ...)
                refused.setdefault(label, exc)
                continue
            for n in r.notes:
                if n not in seen_notes and not n.startswith("GPU memory"):
                    seen_notes.add(n)
                    notes.append(n)
            out.append(Candidate(label=label, strategy=st, recompute=rec, settings=r.settings, offload=bool(knobs)))
    if not out and refused:
        raise next(iter(refused.values()))
    for label, exc in refused.items():
        notes.append(f"plan: {label} not considered: {exc}")
    return out


def _fits_state(inv: ParamInventory, s: Settings, gpus: int, mb: int, budget: int) -> bool | None:
    """_fits_at, with None where the job refuses ``gpus`` (SettingsError)."""
    try:
        s2 = with_gpus(s, gpus)
        (_, req), = accounting.required_bytes(inv, s2, (mb,), lower_bound=True)
        if req <= budget and accounting.host_fits(inv, s2) is False:  # --host-memory: offload must fit too
            return False
    except SettingsError:  # e.g. an expert's dim 1 that efsdp does not divide, an HSDP shard size
        return None
    return req <= budget


def _fits_at(inv: ParamInventory, s: Settings, gpus: int, mb: int, budget: int,
             lower_bound: bool = True) -> bool:
    try:
        s2 = with_gpus(s, gpus)
        (_, req), = accounting.required_bytes(inv, s2, (mb,), lower_bound=lower_bound)
        if req <= budget and accounting.host_fits(inv, s2) is False:  # --host-memory: offload must fit too
            return False
    except SettingsError:  # e.g. HSDP shard size that does not divide this count
        return False
    return req <= budget


def _exact_largest(inv: ParamInventory, s: Settings, mbs: tuple[int, ...], budget: int,
                   bound: list[tuple[int, int]], hi: int) -> tuple[int | None, int]:
    """The index of the largest micro-batch whose replayed reserved peak fits (memplan/reserved.py), at most
    ``hi`` (the bound's answer: the reserved peak is never below the allocated one), and the replays it took:
    a guess, then bisection on the side it falls (usually two replays: the answer, and the next one up)."""
    exact: dict[int, int] = {}

    def required(i: int) -> int:
        if i not in exact:
            # the replay may stop once past the budget: only "does it fit" is asked
            exact[i] = accounting.required_bytes(inv, s, (mbs[i],), budget=budget)[0][1]
        return exact[i]

    # the first guess takes the allocator's segments as SHARE_GUESS of the allocated peak (their median share
    # in the H100 runs' replays, docs/accuracy-gpu.md); the answer lies in [lo, top): fits(lo) (lo = -1:
    # nothing fits), not fits(top)
    guess = max((i for i in range(hi + 1) if bound[i][1] + SHARE_GUESS * bound[i][0] <= budget), default=0)
    if required(guess) <= budget:
        if guess == hi or required(guess + 1) > budget:
            return guess, len(exact)
        lo, top = guess + 1, hi + 1
    else:
        lo, top = -1, guess
    while top - lo > 1:
        mid = (lo + top) // 2
        if required(mid) <= budget:
            lo = mid
        else:
            top = mid
    return (lo if lo >= 0 else None), len(exact)


#: the caching allocator's share of the allocated peak a search guesses first (then replays to check)
SHARE_GUESS = 0.12


#: the largest micro-batch plan searches (refused above: the search enumerates them; the GPU count's bound is
#: settings.MAX_GPUS, which every command shares)
MAX_MICRO_BATCH = 4096


def _check_bounds(gpus_per_node: int, max_gpus: int, micro_batch: int | None, max_micro_batch: int) -> None:
    if gpus_per_node < 1:
        raise SettingsError(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
    if max_gpus < 1:
        raise SettingsError(f"--max-gpus must be at least 1, got {max_gpus}")
    if micro_batch is not None and micro_batch < 1:
        raise SettingsError(f"micro-batch must be at least 1, got {micro_batch}")
    if max_micro_batch < 1:
        raise SettingsError(f"--max-micro-batch must be at least 1, got {max_micro_batch}")
    # bounds past any cluster or batch a job runs with are refused (the search lists every count and micro-batch)
    if max_gpus > MAX_GPUS:
        raise SettingsError(f"--max-gpus {max_gpus} is more than the {MAX_GPUS:,} GPUs memplan plans for")
    if max_micro_batch > MAX_MICRO_BATCH or (micro_batch is not None and micro_batch > MAX_MICRO_BATCH):
        raise SettingsError(f"micro-batch bound {max(max_micro_batch, micro_batch or 0)} is more than the "
                            f"{MAX_MICRO_BATCH:,} memplan plans for")


def _fewest_gpus(inv: ParamInventory, c: Candidate, counts: GpuCounts, gpus_per_node: int, mb: int,
                 budget: int) -> tuple[int | None, int]:
    """(the fewest GPUs the candidate fits at micro-batch ``mb`` by the bound from below, evaluations): bisection
    over the counts (memory never grows with GPUs), the counts the job refuses skipped, then a look below (padding
    can make it non-monotone)."""
    from math import gcd

    # HSDP within one node is FSDP full shard
    st = c.settings.strategy
    multiple = c.tp * c.pp * c.cp  # whole data-parallel groups of the layout
    if c.ep > 1:  # ep divides each stage's dp x tp ranks
        per_stage = c.tp * c.cp
        multiple = c.pp * (per_stage * c.ep // gcd(per_stage, c.ep))
    if st.one_gpu:
        usable: Any = [1]
    else:
        usable = GpuCounts(gpus_per_node, counts.max_gpus, multiple,
                           above_node=st.shard_within_node)
    evaluations = 0
    state: dict[int, bool | None] = {}

    def accepted(i: int) -> bool | None:
        """Whether the candidate fits at usable[i]; None where the job refuses that count (an expert's dim 1 that
        efsdp does not divide, an HSDP shard size, ...)."""
        nonlocal evaluations
        if i not in state:
            evaluations += 1
            state[i] = _fits_state(inv, c.settings, usable[i], mb, budget)
        return state[i]

    def probe(i: int) -> tuple[int, bool]:
        """(the first count from index i the job accepts, whether it fits there): monotone in i where the fits
        of the accepted counts are, whatever counts between them are refused."""
        while i < len(usable):
            fits = accepted(i)
            if fits is not None:
                return i, fits
            i += 1
        return i, False

    lo, hi = 0, len(usable)
    while lo < hi:
        mid = (lo + hi) // 2
        if probe(mid)[1]:
            hi = mid
        else:
            lo = mid + 1
    lo, ok = probe(lo)
    found = usable[lo] if ok else None
    k = lo - 1
    while found is not None and k >= 0:
        fits = accepted(k)
        if fits is False:
            break
        if fits:
            lo, found = k, usable[k]
        k -= 1
    return found, evaluations


def recompute_rank(recompute: str) -> tuple[int, int]:
    """Less recompute first: none, selective, op-sac, every:N (the larger N, the fewer blocks recomputed), full."""
    from memplan.activations import OP_SAC, checkpoint_every

    if recompute == OP_SAC:
        return (1, 1)
    if recompute in RECOMPUTE_ORDER:
        return (RECOMPUTE_ORDER.index(recompute) + (recompute == "full"), 0)
    return (2, -(checkpoint_every(recompute) or 0))


def _rank(c: Candidate) -> tuple:
    """No recompute before full, the largest micro-batch, no offload, the least communication, the most headroom."""
    # equal bytes (one GPU: none at all) prefer the simpler strategy (Strategy.comm_volume: plain PyTorch, then
    # DDP / ZeRO-1/2, then the fully sharded ones)
    return (recompute_rank(c.recompute), -(c.micro_batch or 0), c.offload, c.comm or (0, 0),
            c.settings.strategy.comm_volume,
            -(c.headroom_bytes or 0))


def _volume(inv: ParamInventory, s: Settings) -> dict[str, Any]:
    from memplan.accounting import job_communication

    return job_communication(inv, s)


def _at_count(inv: ParamInventory, with_min: list[Candidate], gpus: int, mbs: tuple[int, ...],
              budget: int) -> tuple[list[Candidate], Candidate | None, int]:
    """At ``gpus``: each candidate's largest micro-batch by the allocated bound; then, in the order the bounds rank
    them, the replayed reserved peak (memplan/reserved.py) for each that could still be the best: a bound ranks
    no worse than the truth, so the first whose bound ranks behind the best replayed one ends it."""
    evaluations = 0
    done: list[Candidate] = []
    bounds: dict[int, tuple] = {}
    for c in with_min:
        if c.min_gpus is None or c.min_gpus > gpus:
            done.append(c)
            continue
        try:
            s = with_gpus(c.settings, gpus)
        except SettingsError:
            done.append(c)
            continue
        bound = accounting.required_bytes(inv, s, mbs, lower_bound=True)
        evaluations += len(mbs)
        hi = max((i for i, (_, req) in enumerate(bound) if req <= budget), default=None)
        if hi is None:
            done.append(replace(c, exact=False))
            continue
        peak, req = bound[hi]
        volume = _volume(inv, s)
        done.append(replace(c, micro_batch=mbs[hi], peak_bytes=peak, required_bytes=req, headroom_bytes=budget - req,
                            exact=False, comm=(volume["inter_node_bytes"], volume["total_bytes"])))
        bounds[id(done[-1])] = (s, bound, hi)
    best: Candidate | None = None
    bound_best: Candidate | None = None  #: the best whose figure is only a bound (the allocator not replayed)
    for c in sorted((c for c in done if c.micro_batch is not None), key=_rank):
        if best is not None and _rank(c) >= _rank(best):
            break
        s, bound, hi = bounds[id(c)]
        i, n_eval = _exact_largest(inv, s, mbs, budget, bound, hi)
        evaluations += n_eval
        if i is None:
            new = replace(c, micro_batch=None, peak_bytes=None, required_bytes=None, headroom_bytes=None, exact=False)
        else:
            (peak, req), = accounting.required_bytes(inv, s, (mbs[i],))
            # where the caching allocator is not replayed (and no --fragmentation-percent), the figure stays a
            # bound from below, and so does the micro-batch
            new = replace(c, micro_batch=mbs[i], peak_bytes=peak, required_bytes=req, headroom_bytes=budget - req,
                          exact=accounting.allocator_modelled(inv, s))
            # an exact candidate before any bound; a bound is recommended only where no candidate is exact (its
            # estimate then says it may fit)
            if new.exact and (best is None or _rank(new) < _rank(best)):
                best = new
            elif not new.exact and (bound_best is None or _rank(new) < _rank(bound_best)):
                bound_best = new
        done[next(j for j, x in enumerate(done) if x is c)] = new
    return done, best or bound_best, evaluations


def search(inv: ParamInventory, base: JobRequest, space: SearchSpace = SearchSpace(),
           config: dict | None = None) -> Search:
    """The search described in the module docstring over ``space``, each candidate the ``base`` request (the job's
    fixed options: the GPU, the sequence, the precision, ...) with its strategy, recompute and GPU count."""
    if base.cluster.gpus_per_node is None:
        base = base.changed(gpus_per_node=8)
    gpus_per_node, max_gpus = base.cluster.gpus_per_node, space.max_gpus
    _check_bounds(gpus_per_node, max_gpus, space.micro_batch, space.max_micro_batch)
    capacity, how = options.gpu_memory(base.cluster.gpu, base.cluster.gpu_memory)
    if capacity is None:
        raise SettingsError("plan needs the GPU: --gpu NAME (memplan presets) or --gpu-memory SIZE (80GB, 80GiB)")
    notes: list[str] = [f"GPU memory: {how}"]
    margin = parse_headroom(space.min_headroom, capacity)
    if margin:
        notes.append(f"--min-headroom {space.min_headroom}: every candidate leaves {margin:,} B free")
    if space.layouts:
        notes.append("layouts: tensor parallelism within a node, pipeline stages across nodes (context parallelism "
                     f"within a node too from --seq-len {LAYOUT_CP_FROM} on; expert parallelism for MoE models, with or without stages), with "
                     + ", ".join(n for n in space.strategies if n in LAYOUT_STRATEGIES)
                     + "; under PP the micro-batches per step are --grad-accum, else as many as stages")
    found = _search(inv, capacity - margin, config, base, space, notes)
    # headroom is against the whole GPU; the search fitted each candidate into it less the margin
    more = lambda c: c if c.headroom_bytes is None else replace(c, headroom_bytes=c.headroom_bytes + margin)  # noqa
    return replace(found, gpu_memory_bytes=capacity, min_headroom_bytes=margin,
                   candidates=tuple(more(c) for c in found.candidates),
                   best=None if found.best is None else more(found.best))


def parse_headroom(text: str | None, capacity: int) -> int:
    """--min-headroom: a size (8GiB, 8GB) or a fraction of the GPU (0.1, 10%), in bytes."""
    import math

    from memplan.units import parse_size

    if text is None or str(text).strip() in ("", "0"):
        return 0
    t = str(text).strip()
    frac = None
    try:
        frac = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        frac = None
    if frac is not None:
        if not math.isfinite(frac) or not 0 <= frac < 1:
            raise SettingsError(f"--min-headroom {quote(text)}: a fraction of the GPU is between 0 and 1 (or 0% to "
                                "99%); a size needs a unit (8GiB, 8GB)")
        return int(capacity * frac)
    n, _ = parse_size(t)
    if n >= capacity:
        raise SettingsError(f"--min-headroom {quote(text)} is not less than the GPU's {capacity:,} bytes")
    return n


def _search(inv: ParamInventory, budget: int, config: dict | None, base: JobRequest, space: SearchSpace,
            notes: list[str]) -> Search:
    cands = _candidates(inv, config, base, space, notes)
    gpus_per_node, max_gpus = base.cluster.gpus_per_node, space.max_gpus
    micro_batch, max_micro_batch = space.micro_batch, space.max_micro_batch
    counts = gpu_counts(gpus_per_node, max_gpus)
    mbs = (micro_batch,) if micro_batch is not None else tuple(range(1, max_micro_batch + 1))
    evaluations = 0
    # 1. the fewest GPUs per candidate, by the bound from below (the caching allocator's segments left out; step 2
    #    replays them)
    with_min = []
    for c in cands:
        found, n = _fewest_gpus(inv, c, counts, gpus_per_node, mbs[0], budget)
        evaluations += n
        with_min.append(replace(c, min_gpus=found, exact=found is None))
    fitting = [c.min_gpus for c in with_min if c.min_gpus is not None]
    if not fitting:
        return Search(budget, gpus_per_node, max_gpus, mbs, tuple(with_min), None, None, tuple(notes), evaluations)
    # 2. at the fewest GPUs any candidate needs, the best candidate by its replayed reserved peak; where the
    #    allocator's segments leave none fitting, the next GPU count
    best, done, gpus = None, with_min, None
    for i in range(counts.index_at_least(min(fitting)), len(counts)):
        gpus = counts[i]
        done, best, n = _at_count(inv, with_min, gpus, mbs, budget)
        evaluations += n
        if best is not None:
            break
    if best is None:
        return Search(budget, gpus_per_node, max_gpus, mbs, tuple(done), None, None, tuple(notes), evaluations)
    ordered = sorted(done, key=lambda c: (c.micro_batch is None, _rank(c) if c.micro_batch else (),
                                          c.min_gpus or 1 << 60, c.label, recompute_rank(c.recompute)))
    return Search(budget, gpus_per_node, max_gpus, mbs, tuple(ordered), best, gpus, tuple(notes), evaluations)


def best_settings(found: Search) -> Settings | None:
    """The recommended configuration's Settings (its estimate is the plan's detail)."""
    if found.best is None or found.gpus is None:
        return None
    return replace(with_gpus(found.best.settings, found.gpus), micro_batch=found.best.micro_batch)


def command_line(model: str, found: Search, extra: list[str], candidate: Candidate | None = None) -> str | None:
    """The `memplan estimate` command that reproduces the recommendation (or ``candidate``'s row at the
    recommended GPU count: only an exact row has one, a bound's figures are not an estimate's)."""
    b = found.best if candidate is None else candidate
    if b is None or candidate is not None and (found.gpus is None or b.micro_batch is None or not b.exact):
        return None
    parts = ["memplan estimate", model, f"--gpus {found.gpus}", f"--gpus-per-node {found.gpus_per_node}",
             f"--strategy {b.strategy}", f"--micro-batch {b.micro_batch}"]
    if b.recompute != "none":
        parts.append(f"--recompute {b.recompute}")
    for k, v in OFFLOAD_VARIANTS.get(b.label, ("", {}))[1].items():
        parts.append(f"--{k.replace('_', '-')}" if v else f"--no-{k.replace('_', '-')}")
    if b.tp > 1:
        parts.append(f"--tp {b.tp}")
    if b.cp > 1:
        parts.append(f"--cp {b.cp}")
    if b.ep > 1:
        parts.append(f"--ep {b.ep}")
    if b.pp > 1:
        parts.append(f"--pp {b.pp}")
        if not any(x.startswith("--grad-accum") for x in extra):
            parts.append(f"--grad-accum {b.settings.grad_accum}")
    return " ".join(parts + extra)
