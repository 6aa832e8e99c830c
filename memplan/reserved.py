"""The reserved peak: the caching allocator (memplan/allocator.py) replayed over the run's allocations.

A job runs out of memory when PyTorch's caching allocator cannot reserve a new segment, so the fit verdict needs
``torch.cuda.max_memory_reserved``, which the allocated peak does not give. This module writes down the order
in which a run allocates and frees, as the frameworks do it, and replays it:

1. the model is built on the device, one parameter after another in module order (``from_config`` under
   ``torch.device("cuda")``, or ``model.to("cuda")``: Module._apply moves them in that order);
2. the framework's setup (``_setup_*``): DDP's broadcast of the module states and its Reducer buckets, FSDP2's
   sharded parameters, DeepSpeed's flat groups, master partitions and buffers;
3. training steps: the traced step's storages (tracing._alloc_events: every storage the micro-step creates and
   when it dies, repeated to the model's depth), with the framework's own moments around it (gradients kept,
   reduced or freed; gathers), then the optimizer step (states created at the first step, the foreach
   implementation's temporaries) and ``zero_grad``.

Steps repeat until one reserves nothing new (a run's reserved memory only grows without ``empty_cache``);
``max_memory_reserved`` is the largest reserved total seen. Pure Python, no torch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Iterator

from memplan.allocator import Allocator, AllocatorConfig
from memplan.settings import optimizer_impl, shard_group_size

#: steps replayed at most: the recorded runs stop reserving after the third (bench/allocator_replay.py)
MAX_STEPS = 6
# and at least two, or three for DDP, which rebuilds its buckets in the second step

# ---- the traced step, repeated to the model's depth ---------------------------------------------------------


@dataclass(frozen=True)
class _Birth:
    region: int  #: index into the template's regions
    slot: int  #: births before it in its region
    size: tuple[int, int]  #: c0, c1
    grad: int | None  #: block of the parameter whose gradient it is (-1: outside the blocks), else None


def _regions(d: dict[str, Any], n: int) -> list[tuple[str, int, int, int]]:
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


def step_events(d: dict[str, Any], layers: int, micro_batch: int) -> list[tuple]:
    """The traced step's events at the model's depth and ``micro_batch``: ("a", key, bytes, grad block or None),
    ("f", key), and ("m", region kind, block) where each region begins (see _expand)."""
    b = micro_batch
    return [("a", e[1], max(e[2][0] + e[2][1] * b, 1), e[3]) if e[0] == "a" else e for e in _expand(d, layers)]


#: expansions already made, by (id of the profile's events, depth): the micro-batch only scales their sizes
_EXPANDED: dict[tuple[int, int], tuple[Any, list[tuple]]] = {}


def _expand(d: dict[str, Any], layers: int) -> list[tuple]:
    """The traced step at the model's depth, sizes as (c0, c1) lines in the micro-batch. A profile traced at
    full depth is taken as it is; one traced with two alike blocks stands for L: the first block's forward (births and what becomes of them, relative to it) for blocks 0..L-2, the
    last's for block L-1, and in backward the last block's for blocks L-1..1 and the first's for block 0. Each
    storage dies where its own template says, relative to its block, after as many of that region's births."""
    hit = _EXPANDED.get((id(d["events"]), layers))
    if hit is not None and hit[0] is d["events"]:
        return hit[1]
    if len(_EXPANDED) > 64:
        _EXPANDED.clear()
    out = _expand_now(d, layers)
    _EXPANDED[(id(d["events"]), layers)] = (d["events"], out)
    return out


def _expand_now(d: dict[str, Any], layers: int) -> list[tuple]:
    events = d["events"]
    n = len(events)
    regions = _regions(d, n)
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
            births.append(_Birth(r, count[r], (e[0], e[1]), e[2] if len(e) > 2 else None))
            count[r] += 1
        else:
            deaths[e] = (r, count[r], i)
    nb = len(d["fs"])
    expand = d.get("expand") and nb == 2 and layers > 2
    L = layers if expand else nb
    # full-depth regions: (kind, block, template region)
    idx = {(k, t): r for r, (k, t, _, _) in enumerate(regions)}
    if expand:
        full = [("pre", -1, idx["pre", -1])]
        full += [("F", k, idx["F", 0 if k < L - 1 else 1]) for k in range(L)]
        full.append(("mid", -1, idx["mid", -1]))
        full += [("B", k, idx["B", 1 if k > 0 else 0]) for k in range(L - 1, -1, -1)]
        full.append(("post", -1, idx["post", -1]))
    else:
        full = [(k, t, r) for r, (k, t, _, _) in enumerate(regions)]
    where = {(k, b): j for j, (k, b, _) in enumerate(full)}
    tpl_block = {r: t for r, (_, t, _, _) in enumerate(regions)}

    def instance(birth_block: int, birth_tpl: int, death_region: int) -> int:
        kind, t_d = regions[death_region][0], tpl_block[death_region]
        if kind not in ("F", "B"):
            return where[kind, -1]
        if not expand:
            return where[kind, t_d]
        if birth_block < 0:  # born outside the blocks: the first traced block is block 0, the last block L-1
            k = 0 if t_d == 0 else L - 1
        else:
            k = birth_block + (t_d - birth_tpl)
        return where[kind, min(max(k, 0), L - 1)]

    # per full region: births in order, and the deaths to place before each birth slot
    out: list[tuple] = []
    pending: dict[int, list[tuple[int, int, tuple]]] = {}
    by_region: dict[int, list[int]] = {}
    for sid, b in enumerate(births):
        by_region.setdefault(b.region, []).append(sid)
    counter = iter(range(1 << 62))
    for j, (kind, blk, r) in enumerate(full):
        out.append(("m", kind, blk))  # where each region begins, for the framework's own moments
        waiting = pending.setdefault(j, [])  # a heap of (slot, template position, key)
        sids = by_region.get(r, [])
        for slot in range(len(sids) + 1):
            while waiting and waiting[0][0] <= slot:
                out.append(("f", heapq.heappop(waiting)[2]))
            if slot == len(sids):
                break
            sid = sids[slot]
            b = births[sid]
            key = next(counter)
            size = b.size
            grad = b.grad if b.grad is None or b.grad < 0 else (blk if expand else b.grad)
            out.append(("a", key, size, grad))
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
            heapq.heappush(pending.setdefault(target, []), (dslot, pos, key))
        while waiting:
            out.append(("f", heapq.heappop(waiting)[2]))
        del pending[j]
    return out


# ---- the run ------------------------------------------------------------------------------------------------


class _Run:
    """An allocator and the live blocks of one replay."""

    def __init__(self, config: AllocatorConfig) -> None:
        self.a = Allocator(config)
        self.live: dict[Any, Any] = {}
        self.n = 0
        self.anon = 0  #: keys of what the frameworks allocate (positive; a step's are negative)
        self.a.steps = self.steps = []  # type: ignore[attr-defined]

    #: set by predict: stop (raise _OverLimit) once the reserved bytes pass it
    limit: int | None = None

    def alloc(self, size: int, key: Any = None, stream: int = 0) -> Any:
        if key is None:
            self.anon += 1
            key = self.anon
        a = self.a
        before = a.reserved
        self.live[key] = a.malloc(max(size, 1), stream)
        if a.reserved != before and _Run.limit is not None and a.reserved > _Run.limit:
            self.over()
        return key

    def over(self) -> None:
        """Stop the replay: the reserved bytes have passed the limit."""
        a = self.a
        raise _OverLimit(Reserved(peak_bytes=a.peak_reserved, allocated_bytes=a.peak_allocated,
                                  model="", variants={}, config="", complete=False))

    def offset(self) -> int:
        """A base for one micro-step's integer keys (a step's storages are numbered from 0)."""
        self.n += 1
        return -(self.n << 40)

    def end_step(self) -> None:
        """Record the step's allocated peak and the reserved peak so far; the next step's peak starts anew."""
        self.steps.append((self.a.peak_allocated, self.a.peak_reserved))
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


MiB = 1 << 20
#: DDP's broadcast of the module states at construction: buffers of 250 MiB (distributed.py
#: _sync_module_states(..., broadcast_bucket_size=int(250 * 1024 * 1024)))
DDP_BROADCAST_BUCKET = 250 * MiB
#: c10d's _DEFAULT_FIRST_BUCKET_BYTES: the first bucket of a rebuilt Reducer
DDP_FIRST_BUCKET = 1 * MiB


def _build(run: _Run, job: Job) -> list[Any]:
    """The model built on the device: each parameter in module order; a tied alias (transformers' lm_head built
    with its own weight, then tied) allocated last and freed when the weights are tied; then, where the recipe
    stores another dtype, Module._apply's conversion, parameter by parameter (the new tensor, then the old one
    freed)."""
    keys, aliases = [], []
    for n, alias in job.build:
        (aliases if alias else keys).append(run.alloc(n))
    for k in aliases:
        run.free(k)
    if job.converted:
        for i, n in enumerate(job.converted):
            new = run.alloc(n)
            run.free(keys[i])
            keys[i] = new
    return keys


def _broadcast_coalesced(run: _Run, sizes: list[int], bucket: int) -> None:
    """c10d broadcast_coalesced (torch/csrc/distributed/c10d/comm.cpp): buckets of ``bucket`` bytes, each
    flattened into one buffer (a bucket of one tensor is a view of it), at most two in flight."""
    in_flight: list[Any] = []
    for idx in bucket_assignment(sizes, [bucket]):
        if len(in_flight) >= 2:
            k = in_flight.pop(0)
            if k is not None:
                run.free(k)
        in_flight.append(run.alloc(sum(sizes[i] for i in idx)) if len(idx) > 1 else None)
    for k in in_flight:
        if k is not None:
            run.free(k)


def _adam_foreach_temporaries(run: _Run, sizes: list[int]) -> None:
    """torch.optim's _multi_tensor_adam(w): ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` makes
    one state-sized tensor per parameter, freed (the list's items in reverse) when the step returns."""
    keys = [run.alloc(n) for n in sizes]
    for k in reversed(keys):
        run.free(k)


@dataclass(frozen=True)
class Job:
    """What a replay needs, per rank, from the model, the settings and the traced step."""

    build: tuple[tuple[int, bool], ...]  #: bytes of each parameter as built, and whether it is a tied alias
    numels: tuple[int, ...]  #: elements of each parameter the optimizer steps, module order
    state_bytes: int  #: bytes per optimizer-state element
    states_per_param: int
    optimizer_impl: str  #: foreach | fused | single-tensor
    input_bytes: int  #: the batch's input ids (labels are the same tensor)
    workspace_bytes: int  #: cuBLAS workspace per handle (two handles: forward and autograd's thread)
    #: the traced step at the job's depth (_expand: sizes as (c0, c1) lines in the micro-batch)
    step: Any
    #: bytes of each parameter after the model is converted to the recipe's dtype (None: kept as built)
    converted: tuple[int, ...] | None = None
    grad_accum: int = 1  #: micro-steps per optimizer step (the later ones add into the kept gradients)
    micro_batch: int = 1


def _step(run: _Run, job: Job, n: int, keep_grads: bool, at: Any = None, on_grad: Any = None) -> list[tuple[Any, int]]:
    """One traced micro-step; the gradients it makes are kept (their traced death skipped) when
    ``keep_grads``. Returns the kept gradients (key, bytes) in the order they were made."""
    grads: list[tuple[Any, int]] = []
    kept: set[Any] = set()
    off = run.offset()
    a = run.a
    live, malloc, afree = run.live, a.malloc, a.free
    limit = _Run.limit if _Run.limit is not None else 1 << 62
    mb = job.micro_batch
    for e in job.step:
        kind = e[0]
        if kind == "a":
            key = off + e[1]
            size = e[2][0] + e[2][1] * mb
            live[key] = malloc(size if size > 0 else 1)
            if a.reserved > limit:
                run.over()
            if e[3] is not None:
                if on_grad is not None:
                    on_grad(size)
                if keep_grads:
                    kept.add(key)
                    grads.append((key, size))
        elif kind == "f":
            key = off + e[1]
            if key not in kept:
                b = live.pop(key, None)
                if b is not None:
                    afree(b)
        elif at is not None:
            at(e[1], e[2])
    return grads


def _optimizer_step(run: _Run, job: Job, first: bool, states: list[Any]) -> None:
    sizes = [n * job.state_bytes for n in job.numels]
    if first:
        for n in sizes:  # _init_group: zeros_like per state, parameter by parameter
            for _ in range(job.states_per_param):
                states.append(run.alloc(n))
    if job.optimizer_impl == "foreach":
        _adam_foreach_temporaries(run, sizes)
    elif job.optimizer_impl == "single-tensor":
        big = max(sizes, default=0)  # exp_avg_sq.sqrt() / bias_correction2_sqrt: two temporaries per tensor
        for n in sizes:
            a = run.alloc(n)
            b = run.alloc(n)
            run.free(a)
            run.free(b)
        del big


def replay_ddp(job: Job, config: AllocatorConfig | None = None, release: str = "pre") -> Allocator:
    """DistributedDataParallel (torch/nn/parallel/distributed.py, c10d reducer.cpp) with a torch.optim optimizer:
    the module states broadcast in 250 MiB buffers; the Reducer's first bucket assignment is one bucket for all
    parameters (no find_unused_parameters: bucket_size_limits = [sys.maxsize]), rebuilt at the second
    forward (_rebuild_buckets: the old buckets freed, then one buffer per bucket of the order the gradients
    became ready, limits [1 MiB, 25 MiB]); gradients stay until zero_grad(set_to_none=True).

    ``release``: where the old buckets' memory returns. The Reducer drops them at the rebuild ("pre"), but the
    last all-reduce of step 1 also holds its bucket (ProcessGroupNCCL stashes a collective's tensors until its
    watchdog sees the work complete, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp), so in a short step the
    memory comes back only in step 2's backward ("grad": at its first gradient). Measured on the H100: 24 of 32
    DDP runs released at the rebuild, 8 in backward (their step 2 peaks by the buckets' size), and one
    configuration (gpt2) did each in one of two runs."""
    run = _Run(config or AllocatorConfig())
    _build(run, job)
    sizes = list(job.converted or [n for n, alias in job.build if not alias])
    _broadcast_coalesced(run, sizes, DDP_BROADCAST_BUCKET)
    buckets = [run.alloc(sum(sizes))]
    old: list[Any] = []
    states: list[Any] = []
    first_grads: list[tuple[Any, int]] = []
    forwards = 0
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        grads: list[tuple[Any, int]] = []
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            if forwards == 0:
                run.alloc(job.workspace_bytes)
                run.alloc(job.workspace_bytes)
            if forwards == 1:
                old = buckets
                ready = [size for _, size in first_grads]
                buckets = [run.alloc(sum(ready[i] for i in idx))
                           for idx in bucket_assignment(ready, [DDP_FIRST_BUCKET, 25 * MiB])]
            rebuilt = forwards == 1

            def at(kind: str, blk: int, rebuilt: bool = rebuilt) -> None:
                if rebuilt and kind == release:
                    for k in old:
                        run.free(k)
                    old.clear()
            # later micro-steps add into the kept gradients (AccumulateGrad in place; theirs die at once)
            grads += _step(run, job, (n, m), keep_grads=m == 0, at=at, on_grad=lambda _n: at("grad", 0))
            at("end", 0)
            if forwards == 0:
                first_grads = list(grads)
            forwards += 1
            run.free(ids)
        _optimizer_step(run, job, n == 0, states)
        for k, _ in reversed(grads):
            run.free(k)
        run.end_step()
        if n >= 2 and run.a.peak_reserved == before:
            break
    return run.a


@dataclass(frozen=True)
class FsdpGroup:
    """One fully_shard unit (a block, or the root with what no block holds), per rank."""

    params: tuple[int, ...]  #: its parameters' positions in module order
    shard: tuple[int, ...]  #: bytes of each sharded parameter (dim 0 padded to the shard count), stored dtype
    unsharded: tuple[int, ...]  #: bytes of each unsharded parameter in the compute dtype
    cast: bool  #: the all-gather input is a cast of the shard (MixedPrecisionPolicy param_dtype differs)
    reduce_in: int  #: the reduce-scatter input: every padded gradient in the reduce dtype
    reduce_out: int  #: its output: this rank's sharded gradients, which the .grad views keep


#: the allocator's stream for FSDP2's reduce-scatter outputs (its own pool; any id but the default's)
RS_STREAM = 2
AG_STREAM = 1


def _unshard(run: _Run, g: FsdpGroup, world: int) -> list[Any]:
    """FSDPParamGroup.unshard + wait_for_unshard with one rank: no all-gather (unshard() records an empty
    result); each unsharded parameter is made from its shard when the block runs, each cast (when the compute
    dtype differs) freed after the next one is made (measured: ../shared/gpu/traces/fsdp_full_rc)."""
    keys = []
    prev = None
    for n in g.unsharded:
        cast = run.alloc(n) if g.cast else None
        if prev is not None:
            run.free(prev)
        keys.append(run.alloc(n))
        prev = cast
    if prev is not None:
        run.free(prev)
    return keys


def _all_gather(run: _Run, g: FsdpGroup, world: int) -> Any:
    """FSDPParamGroup.unshard with more ranks (_fsdp_collectives.py foreach_all_gather): every shard cast on the
    copy-in stream into one flat all-gather output; the output is returned, the casts freed."""
    casts = [run.alloc(-(-n // world), stream=AG_STREAM) for n in g.unsharded] if g.cast else []
    flat = run.alloc(sum(-(-n // world) for n in g.unsharded) * world, stream=AG_STREAM)
    for k in casts:
        run.free(k)
    return flat


def _copy_out(run: _Run, g: FsdpGroup) -> list[Any]:
    """wait_for_unshard's foreach_all_gather_copy_out: each unsharded parameter, on the default stream."""
    return [run.alloc(n) for n in g.unsharded]


def replay_fsdp2(job: Job, groups: tuple[FsdpGroup, ...], world: int, reshard_after_forward: bool,
                 config: AllocatorConfig | None = None) -> Allocator:
    """FSDP2 (torch/distributed/fsdp/_fully_shard): fully_shard on each block then the root. Setup replaces each
    parameter by its padded shard, a group's new shards made before its old parameters go (_fsdp_param.py
    _init_sharded_param). In a step the root unshards at the forward's start and stays unsharded; each block
    unshards before its forward and, resharding after forward, again before its backward; after a block's
    backward (post_backward) its gradients go into one reduce-scatter input in the reduce dtype, then the
    unsharded gradients are freed and the output (on the reduce-scatter stream) is allocated, whose views
    are the sharded .grad until zero_grad; the optimizer steps the shards. ``groups``: the blocks in order,
    the root last."""
    run = _Run(config or AllocatorConfig())
    if world == 1:
        # one rank: built on the device, then each group's shards made and its parameters freed (measured)
        built = _build(run, job)
        for g in groups:
            for n in g.shard:
                run.alloc(n)
            for i in g.params:
                run.free(built[i])
    else:
        # more ranks: the full model never fits one device at the sizes FSDP is for; it is built on the meta
        # device, sharded, then materialized shard by shard (to_empty + init, torchtitan's recipe)
        for g in groups:
            for n in g.shard:
                run.alloc(n)
    blocks, root = groups[:-1], groups[-1]
    states: list[Any] = []
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        outputs: list[Any] = []
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            if n == 0 and m == 0:
                run.alloc(job.workspace_bytes)
            _fsdp_micro_step(run, job, (n, m), blocks, root, world, reshard_after_forward, outputs,
                             first=n == 0 and m == 0, keep=m == 0)
            run.free(ids)
        _optimizer_step(run, job, n == 0, states)
        for k in outputs:
            run.free(k)
        run.end_step()
        if n >= 1 and run.a.peak_reserved == before:
            break
    return run.a


def _fsdp_micro_step(run: _Run, job: Job, n: Any, blocks: tuple[FsdpGroup, ...], root: FsdpGroup, world: int,
                     reshard_after_forward: bool, outputs: list[Any], first: bool, keep: bool) -> None:
    """One micro-step under FSDP2; the reduce-scatter outputs go to ``outputs`` (``keep``), or, in a later
    micro-step, are added into the sharded gradients and freed. With more than one rank (accounting.py's FSDP2
    notes, each checked on the harness): in forward a block's all-gather output is held until the next block's
    copy-out (FSDPCommContext.all_gather_state), the last one to the root's post-forward; in backward the root's
    pre-backward prefetches the last block, a block's pre-backward copies out of its prefetched output (then
    frees it) and prefetches the next; a post-backward frees the previous reduce-scatter input
    (reduce_scatter_max_input_buffers = 1)."""
    flat = world > 1
    unsharded: dict[int, list[Any]] = {}
    gathered: dict[int, Any] = {}  # prefetched all-gather outputs, by block
    held: list[Any] = []  # forward: the last all-gather output; backward: the last reduce-scatter input
    grads_of: dict[int, list[Any]] = {}
    state: dict[str, Any] = {"bwd": None}

    def unshard(i: int, hold: bool) -> None:
        g = root if i < 0 else blocks[i]
        if not flat:
            unsharded[i] = _unshard(run, g, world)
            return
        out = gathered.pop(i, None) or _all_gather(run, g, world)
        unsharded[i] = _copy_out(run, g)
        if hold:  # forward: free the previous output now, keep this one
            for k in held:
                run.free(k)
            held[:] = [out]
        else:
            run.free(out)

    def prefetch(i: int) -> None:
        if flat and 0 <= i < len(blocks) and i not in unsharded and i not in gathered:
            gathered[i] = _all_gather(run, blocks[i], world)

    def post_backward(i: int) -> None:
        g = root if i < 0 else blocks[i]
        for k in unsharded.pop(i, []):  # reshard
            run.free(k)
        for k in held:
            run.free(k)
        held.clear()
        rs_in = run.alloc(g.reduce_in)
        for k in grads_of.pop(i, []):
            run.free(k)
        out = run.alloc(g.reduce_out, stream=RS_STREAM)
        if flat:
            held.append(rs_in)
        else:
            run.free(rs_in)
        if keep:
            outputs.append(out)
        else:
            run.free(out)

    unshard(-1, hold=True)

    def at(kind: str, blk: int) -> None:
        if kind == "F" and blk < len(blocks) and blk not in unsharded:
            unshard(blk, hold=True)
        elif kind == "mid":
            for k in held:  # the root's post-forward
                run.free(k)
            held.clear()
            if first:
                run.alloc(job.workspace_bytes)  # autograd's thread's cuBLAS handle
            prefetch(len(blocks) - 1)
        if kind in ("B", "post") and state["bwd"] is not None:
            post_backward(state["bwd"])
            state["bwd"] = None
        if kind == "B" and blk < len(blocks):
            if blk not in unsharded:
                unshard(blk, hold=False)
            prefetch(blk - 1)
            state["bwd"] = blk

    def on_forward_end(blk: int) -> None:
        if reshard_after_forward and blk in unsharded:
            for k in unsharded.pop(blk):
                run.free(k)

    _fsdp_step(run, job, n, at, on_forward_end, grads_of)
    post_backward(-1)
    for k in held:
        run.free(k)


def _fsdp_step(run: _Run, job: Job, n: int, at: Any, on_forward_end: Any, grads_of: dict[int, list[Any]]) -> None:
    """The traced step with FSDP's moments: a block's forward ends where the next region begins; each gradient
    is kept, by block, for its post-backward."""
    current_forward = None
    kept: set[Any] = set()
    off = run.offset()
    a = run.a
    live, malloc, afree = run.live, a.malloc, a.free
    limit = _Run.limit if _Run.limit is not None else 1 << 62
    mb = job.micro_batch
    for e in job.step:
        kind = e[0]
        if kind == "a":
            key = off + e[1]
            size = e[2][0] + e[2][1] * mb
            live[key] = malloc(size if size > 0 else 1)
            if a.reserved > limit:
                run.over()
            if e[3] is not None:
                grads_of.setdefault(e[3], []).append(key)
                kept.add(key)
        elif kind == "f":
            key = off + e[1]
            if key not in kept:
                b = live.pop(key, None)
                if b is not None:
                    afree(b)
        else:
            if current_forward is not None:
                on_forward_end(current_forward)
                current_forward = None
            at(e[1], e[2])
            if e[1] == "F":
                current_forward = e[2]


# ---- from the settings ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reserved:
    """The replay's answer for one configuration."""

    peak_bytes: int  #: predicted torch.cuda.max_memory_reserved
    allocated_bytes: int  #: the replay's allocated peak in its last (steady) step: the engine's, by another road
    model: str  #: which framework sequence was replayed
    #: other release orders the framework allows, name -> reserved peak (peak_bytes is the largest)
    variants: dict
    config: str  #: the allocator settings replayed (PYTORCH_CUDA_ALLOC_CONF), "" for the defaults
    complete: bool = True  #: False: the replay stopped once it passed a limit (peak_bytes: at least this)
    #: per replayed step of the largest variant: (its allocated peak, the reserved peak so far)
    steps: tuple = ()


#: frameworks whose setup and step this module writes down
MODELLED = ("torch-ddp", "fsdp2", "deepspeed")


def why_not(s: Any) -> str | None:
    """Why the reserved peak cannot be replayed for these settings (None: it can)."""
    if s.cluster.device != "cuda":
        return "device cpu (no caching allocator)"
    prof = s.activation_profile
    data = getattr(prof, "data", None)
    if not data or not data.get("alloc_events"):
        return "no traced step (analytic activations, or a profile traced before allocations were recorded)"
    st = s.strategy
    if st.framework not in MODELLED:
        return f"{st.framework} setup not modelled yet"
    if st.name == "zero-optimizer":
        return "ZeroRedundancyOptimizer not modelled yet"
    if st.framework == "deepspeed" and (st.zero_stage not in (1, 2, 3) or s.ds.offload_optimizer
                                        or s.ds.offload_param or s.ds.hpz_partition_size > 1):
        what = "ZeRO-Offload" if s.ds.offload_optimizer or s.ds.offload_param else (
            "ZeRO++ hpZ" if s.ds.hpz_partition_size > 1 else f"stage {st.zero_stage}")
        return f"DeepSpeed {what} not modelled yet"
    if st.framework == "fsdp2" and (not st.shard_params or s.torch.cpu_offload):
        return "FSDP2 without sharding or with CPU offload not modelled yet"
    return None


def _job(inv: Any, s: Any, numels: list[int]) -> Job:

    d = s.activation_profile.data
    build = []
    for t in inv.tensors:
        build.append((t.numel * 4, False))  # built in fp32 (transformers' default dtype), module order
        build.extend((t.numel * 4, True) for _ in t.tied_names)
    # a recipe that stores bf16 parameters converts the built model (model.to(torch.bfloat16) before wrapping)
    converted = tuple(t.numel * s.recipe.param_bytes for t in inv.tensors) if s.recipe.param_bytes != 4 else None
    return Job(build=tuple(build), numels=tuple(numels), state_bytes=s.recipe.state_bytes, converted=converted,
               grad_accum=s.grad_accum,
               states_per_param=s.optimizer.states_per_param if not s.optimizer.factored else 1,
               optimizer_impl=optimizer_impl(s), input_bytes=s.micro_batch * s.seq_len * 8,
               workspace_bytes=s.cluster.blas_workspace_bytes,
               step=_expand(d["alloc_events"], d["num_layers"]), micro_batch=s.micro_batch)


def _partition_params(inv: Any, n: int) -> tuple[int, ...]:
    """Elements of each parameter (module order) that overlaps the largest rank's part of the flat group: the
    gradients that rank's norm reads (stage_1_and_2.py params_in_partition). The last rank's part holds the
    padding, so the first rank is taken."""
    from memplan.units import ceil_div

    psi = sum(t.numel for t in inv.tensors)
    part = ceil_div(ceil_div(psi, 2 * n) * 2 * n, n)
    out, start = [], 0
    for t in inv.tensors:
        if start < part:
            out.append(t.numel)
        start += t.numel
    return tuple(out)


#: replays already made in this process, by what they depend on (the planner asks some twice)
_CACHE: dict[tuple, Reserved] = {}


class _OverLimit(Exception):
    pass


def predict(inv: Any, s: Any, config: AllocatorConfig | None = None, limit: int | None = None) -> Reserved | None:
    """The reserved peak of one configuration, or None where why_not(s) says why not. ``limit``: stop once the
    reserved bytes pass it; the answer's peak is then only a bound from below (``complete`` False)."""
    if why_not(s) is not None:
        return None
    from dataclasses import replace

    key = (id(inv), id(s.activation_profile.data), repr(replace(s, activation_profile=None)), repr(config))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    partial = _PARTIAL.get(key)
    if partial is not None and limit is not None and partial.peak_bytes > limit:
        return partial
    if len(_CACHE) > 256:
        _CACHE.clear()
        _PARTIAL.clear()
    _Run.limit = limit
    try:
        hit = _CACHE[key] = _predict(inv, s, config)
    except _OverLimit as over:
        _PARTIAL[key] = over.args[0]
        return over.args[0]
    finally:
        _Run.limit = None
    return hit


#: replays stopped at a limit, by the same key: their peak is only known to be above it
_PARTIAL: dict[tuple, Reserved] = {}


def _predict(inv: Any, s: Any, config: AllocatorConfig | None) -> Reserved:
    config = config or AllocatorConfig.parse(s.allocator_conf)
    st = s.strategy
    if st.framework == "torch-ddp":
        job = _job(inv, s, [t.numel for t in inv.tensors])
        variants = {"buckets released at the rebuild": replay_ddp(job, config, "pre"),
                    "buckets held into step 2's backward": replay_ddp(job, config, "grad")}
        model = "DDP"
    elif st.framework == "deepspeed":
        from memplan.units import ceil_div

        n = shard_group_size(s)
        psi = sum(t.numel for t in inv.tensors)
        if st.zero_stage == 3:
            parts = tuple(ceil_div(t.numel, n) for t in inv.tensors)
            groups, cur = [], 0
            for x in parts:  # stage3.py _create_fp16_sub_groups: closed once a group reaches sub_group_size
                cur += x
                if cur >= s.ds.sub_group_size:
                    groups.append(cur)
                    cur = 0
            if cur:
                groups.append(cur)
            blocks = tuple(b.numel for b in inv.layer_blocks)
            job = _job(inv, s, [sum(parts)])
            a = replay_zero3(job, n, parts, tuple(groups), blocks, s.ds.reduce_bucket_size, s.recipe.param_bytes,
                             config)
            return Reserved(peak_bytes=a.peak_reserved, allocated_bytes=a.steps[-1][0], model="ZeRO-3",
                            variants={"": a.peak_reserved}, config=config.text, steps=tuple(a.steps))
        flat = ceil_div(psi, 2 * n) * 2 * n  # flatten_dense_tensors_aligned(..., 2 * dp_size)
        part = flat // n
        job = _job(inv, s, [part])
        overlap = bool(s.ds.overlap_comm)
        a = replay_zero12(job, st.zero_stage, part, flat, s.ds.reduce_bucket_size, 2 if overlap else 1,
                          _partition_params(inv, n), s.recipe.param_bytes, config)
        variants = {"": a}
        model = f"ZeRO-{st.zero_stage}"
    else:
        from memplan.units import ceil_div

        n = shard_group_size(s)
        r = s.recipe
        groups = []
        numels = []
        position = {t.name: i for i, t in enumerate(inv.tensors)}
        for block in [b.name for b in inv.layer_blocks] + [inv.blocks[0].name]:
            ts = inv.block_tensors(block)
            padded = [ceil_div(t.shape[0], n) * (t.numel // t.shape[0]) * n if t.shape and t.shape[0] else t.numel
                      for t in ts]
            numels += [p // n for p in padded]
            groups.append(FsdpGroup(params=tuple(position[t.name] for t in ts),
                                    shard=tuple(p // n * r.param_bytes for p in padded),
                                    unsharded=tuple(t.numel * r.compute_bytes for t in ts),
                                    cast=r.param_bytes != r.compute_bytes,
                                    reduce_in=sum(padded) * r.reduced_grad_bytes,
                                    reduce_out=sum(padded) // n * r.reduced_grad_bytes))
        job = _job(inv, s, numels)
        raf = s.torch.reshard_after_forward
        raf = st.reshard_after_forward if raf is None else raf
        variants = {"": replay_fsdp2(job, tuple(groups), n, bool(raf), config)}
        model = "FSDP2"
    best = max(variants.values(), key=lambda a: a.peak_reserved)
    return Reserved(peak_bytes=best.peak_reserved, allocated_bytes=best.steps[-1][0], model=model,
                    variants={k: a.peak_reserved for k, a in variants.items()}, config=config.text,
                    steps=tuple(best.steps))


def replay_zero12(job: Job, stage: int, partition: int, flat: int, bucket: int, buffers: int,
                  norms: tuple[int, ...], half: int = 2, config: AllocatorConfig | None = None) -> Allocator:
    """DeepSpeed ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer) with a fused Adam,
    per rank, in its elements: ``flat`` (the aligned flat bit16 group), ``partition`` (this rank's), ``bucket``
    (reduce_bucket_size), ``buffers`` (2 with overlap_comm), ``norms`` (the elements of each parameter whose
    gradient the rank's norm reads, in order).

    Setup, as recorded on the H100 (../shared/gpu/traces/zero2): the engine converts the built model to the
    half dtype parameter by parameter and empties the cache; the optimizer flattens the group into one buffer
    (flatten_dense_tensors_aligned) and the parameters become views of it; the fp32 master partition is the
    bit16 partition's .clone().float(); initialize_optimizer_states makes and drops an fp32 gradient partition.
    A step: at the first gradient hook the ipg bucket buffer(s) (contiguous_gradients) are made; ZeRO-2 (and
    overlap_comm) takes each gradient into them as it is made, ZeRO-1 keeps its gradients to the end of backward
    and takes them then; the first reduce (a full bucket, or the last) makes grads_in_partition; the bucket goes
    at the end of backward; the norm takes each gradient in fp64 (get_grad_norm_direct:
    vector_norm(g.data.to(get_norm_dtype()))); the step flattens the partition's gradients again and converts them to fp32
    (single_grad_partition), Adam makes its states at the first step, and the fp32 gradient goes."""
    run = _Run(config or AllocatorConfig())
    keys = _build(run, job)
    run.empty_cache()
    run.alloc(flat * half)  # bit16_groups_flat; the parameters become views of it
    for k in keys:
        run.free(k)
    clone = run.alloc(partition * half)
    run.alloc(partition * 4)  # single_partition_of_fp32_groups
    run.free(clone)
    run.free(run.alloc(partition * 4))  # initialize_optimizer_states' zero gradient
    states: list[Any] = []
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        grads_flat = None
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            if n == 0 and m == 0:
                run.alloc(job.workspace_bytes)
            ipg: list[Any] = []
            in_bucket = [0]
            # process_gradients: every hook sets up the bucket buffer(s); ZeRO-2 (partition_gradients) and
            # overlap_comm reduce in the hooks, ZeRO-1 without it keeps the gradients until reduce_gradients
            # takes them one by one at the end of backward (stage_1_and_2.py process_gradients)
            in_hooks = stage == 2 or buffers > 1

            def reduce(nbytes: int) -> None:
                """reduce_independent_p_g_buckets_and_remove_grads: a gradient that would overflow the bucket
                reduces it first, and the first reduce makes grads_in_partition (copy_grads_in_partition)."""
                nonlocal grads_flat
                numel = nbytes // half
                if in_bucket[0] + numel > bucket:
                    in_bucket[0] = 0
                    if grads_flat is None:
                        grads_flat = run.alloc(partition * half)
                in_bucket[0] += numel

            def on_grad(nbytes: int) -> None:
                if not ipg:
                    ipg.extend(run.alloc(bucket * half) for _ in range(buffers))
                if in_hooks:
                    reduce(nbytes)
            first = n == 0 and m == 0

            def at(kind: str, blk: int, first: bool = first) -> None:
                if kind == "mid" and first:
                    run.alloc(job.workspace_bytes)  # autograd's thread's cuBLAS handle
            kept = _step(run, job, (n, m), keep_grads=not in_hooks, at=at, on_grad=on_grad)
            for key, nbytes in reversed(kept):  # reduce_gradients, in the group's (module) order
                reduce(nbytes)
                run.free(key)  # copied into the bucket: the gradient is a view of it now
            if grads_flat is None:  # the epilogue's reduce
                grads_flat = run.alloc(partition * half)
            for k in ipg:
                run.free(k)
            run.free(ids)
        for numel in norms:  # get_grad_norm_direct: each gradient .to(float64), one after another
            run.free(run.alloc(numel * 8))
        copy = run.alloc(partition * half)
        fp32_grad = run.alloc(partition * 4)
        run.free(copy)
        if grads_flat is not None:
            run.free(grads_flat)
        if n == 0:
            states += [run.alloc(partition * job.state_bytes) for _ in range(job.states_per_param)]
        run.free(fp32_grad)
        run.end_step()
        if n >= 1 and run.a.peak_reserved == before:
            break
    return run.a


def replay_zero3(job: Job, world: int, partitions: tuple[int, ...], sub_groups: tuple[int, ...],
                 blocks: tuple[int, ...], bucket: int, half: int = 2,
                 config: AllocatorConfig | None = None) -> Allocator:
    """DeepSpeed ZeRO-3 (deepspeed/runtime/zero/stage3.py, partition_parameters.py) with a fused Adam, per rank:
    ``partitions`` (each parameter's partition, elements, module order), ``sub_groups`` (the optimizer's
    sub-groups, elements), ``blocks`` (each block's gathered elements, with more than one rank), ``bucket``
    (reduce_bucket_size).

    Setup: with one rank the model is built on the device and each parameter replaced by its bit16 partition
    (as the H100 stream zero3_offload shows); with more, zero.Init makes the partitions directly. The optimizer
    defragments them into one flat buffer (_create_fp16_partitions_with_defragmentation: through the host, with an
    empty_cache between, zero/utils.py defragment), makes each sub-group's
    fp32 partition (.clone().float()) and a zero fp32 gradient it drops (initialize_optimizer_states; the Adam
    states come at the first step), then the ipg bucket buffer and the flat gradient partition buffer (grad_partitions_flat_buffer),
    A step: with one rank nothing is gathered (NoGatherHandle: the parameter points at its
    partition); with more, each block is gathered into one coalesced buffer before its forward (the next one
    prefetched) and freed after it, and again in backward. Each gradient goes into the bucket in its hook and is
    freed; full buckets are reduced into the flat gradient buffer. The optimizer, sub-group by sub-group,
    flattens the gradients (bit16), converts them to fp32, steps and frees them; the norm reads each gradient in
    fp64 first."""
    run = _Run(config or AllocatorConfig())
    total = sum(partitions)
    if world == 1:
        keys = []
        for n, alias in job.build:
            keys.append(run.alloc(n))
        # tied aliases were built and freed with the model (_build); here the partitions replace the parameters
        params = [k for k, (_, alias) in zip(keys, job.build) if not alias]
        for k, (_, alias) in zip(keys, job.build):
            if alias:
                run.free(k)
        parts = []
        for k, p in zip(params, partitions):
            parts.append(run.alloc(p * half))
            run.free(k)
    else:
        parts = [run.alloc(p * half) for p in partitions]
    # _create_fp16_partitions_with_defragmentation -> zero/utils.py defragment: each partition copied to one
    # host buffer and freed, empty_cache, then the flat buffer back on the device
    for k in parts:
        run.free(k)
    run.empty_cache()
    run.alloc(total * half)  # fp16_partitioned_groups_flat; the partitions are views of it
    for g in sub_groups:  # _create_fp32_partitions
        clone = run.alloc(g * half)
        run.alloc(g * 4)
        run.free(clone)
    for g in sub_groups:  # initialize_optimizer_states: a zero fp32 gradient per sub-group, dropped (the fused
        run.free(run.alloc(g * 4))  # Adam makes its states at the first real step: measured, step 1's peak)
    run.alloc(bucket * half)  # the ipg bucket buffer
    run.alloc(total * half)  # grad_partitions_flat_buffer
    for n in range(MAX_STEPS):
        before = run.a.peak_reserved
        for m in range(job.grad_accum):
            ids = run.alloc(job.input_bytes)
            if n == 0 and m == 0:
                run.alloc(job.workspace_bytes)
            gathered: dict[int, Any] = {}

            def gather(i: int) -> None:
                if world > 1 and 0 <= i < len(blocks) and i not in gathered:
                    gathered[i] = run.alloc(blocks[i] * half)

            def release(i: int) -> None:
                k = gathered.pop(i, None)
                if k is not None:
                    run.free(k)

            state: dict[str, Any] = {"f": None, "b": None}

            def at(kind: str, blk: int) -> None:
                for key in ("f", "b"):
                    if state[key] is not None:
                        release(state[key])
                        state[key] = None
                if kind == "F" and blk >= 0:
                    gather(blk)
                    gather(blk + 1)  # prefetched
                    state["f"] = blk
                elif kind == "B" and blk >= 0:
                    gather(blk)
                    gather(blk - 1)
                    state["b"] = blk
                if kind == "mid" and n == 0 and m == 0:
                    run.alloc(job.workspace_bytes)
            _step(run, job, (n, m), keep_grads=False, at=at)
            for i in list(gathered):
                release(i)
            run.free(ids)
        for numel in partitions:  # the norm: each gradient partition in fp64, one after another
            run.free(run.alloc(numel * 8))
        for g in sub_groups:
            copy = run.alloc(g * half)  # flatten(averaged_gradients)
            fp32 = run.alloc(g * 4)
            run.free(copy)
            if n == 0:  # the optimizer's states, made at its first step
                for _ in range(job.states_per_param):
                    run.alloc(g * job.state_bytes)
            run.free(fp32)  # after the sub-group's step
        run.end_step()
        if n >= 1 and run.a.peak_reserved == before:
            break
    return run.a
