"""DeepSpeed ZeRO-3 (deepspeed/runtime/zero/stage3.py, partition_parameters.py, partitioned_param_coordinator.py),
DeepSpeed 0.19.8: persistent parameters, ZeRO++'s secondary partition, the coordinator's gathers and prefetch
(layouts.zero3_schedule replays PartitionedParameterCoordinator), gradients until their hook reduces them, the
step by sub-group, and ZeRO-Offload's host buffers."""

from __future__ import annotations

from dataclasses import dataclass

from memplan import layouts
from memplan.errors import SettingsError
from memplan.frameworks.common import LOSS, FourBitBase, FrameworkModel, Grads, Job, OffloadedGrads, StepIn
from memplan.frameworks.zero12 import grads_at_end
from memplan.model.inventory import ROOT_BLOCK, ParamInventory
from memplan.settings import Settings
from memplan.timeline import NO_HOOK_TRANSIENT, BufferMoment, BufferTimeline, HookTransient, Moment
from memplan.units import ceil_div


@dataclass(frozen=True)
class Zero3Schedule:
    """Elements of gathered (unsharded, non-persistent) parameters during a ZeRO-3 step, by phase."""

    forward: int  #: most gathered at once in forward, the coalesced all-gathers' flat buffers included
    forward_end: int  #: gathered while the last module of forward runs (when the loss's activations peak)
    loss: int  #: gathered when the loss backward runs (what the forward kept)
    backward: int  #: most gathered while the last block is in backward (kept + fetched + prefetched)
    end: int  #: most gathered in the rest of backward
    #: most gathered while a block's module runs in backward (the head's, released after its backward, not)
    blocks: int = 0


def zero3_schedule(inv: ParamInventory, n: int, prefetch: int, max_live: int, max_reuse: int,
                   threshold: int, qw: tuple[int, bool] | None = None, leaves: tuple[str, ...] = ()) -> Zero3Schedule:
    """Elements gathered at each point; with ``qw`` (ZeRO++ qwZ: the parameter bytes and whether they are fp16),
    bytes, the int8 buffers and dequantized copies included."""
    return layouts.cached(inv, ("zero3", n, prefetch, max_live, max_reuse, threshold, qw, leaves),
                   lambda: _zero3_schedule(inv, n, prefetch, max_live, max_reuse, threshold, qw, leaves))


def quant_groups(numel: int) -> int:
    """CUDAQuantizer.quantize's group count for a tensor of ``numel`` elements (DeepSpeed 0.19.8
    runtime/zero/partition_parameters.py, target_group_size 8000): one fp32 scale per group. Its loop counts up
    from ceil(numel / 8000) to the first count g with numel % (8 g) == 0, then doubles g while numel % (16 g) == 0
    and numel / g > 8000; the first count is the smallest divisor of numel / 8 at least ceil(numel / 8000), found
    here from the divisors (DeepSpeed's loop, run as written, takes minutes on a large partition that is not a
    multiple of 8). DeepSpeed then asserts numel % (8 g) == 0, numel / g < 16000 and numel > g: a partition that
    fails them is refused (SettingsError), as the run would stop there."""
    start = ceil_div(numel, 8000)
    groups = None
    if numel % 8 == 0:
        m = numel // 8
        i = 1
        while i * i <= m:
            if m % i == 0:
                for d in (i, m // i):
                    if d >= start and (groups is None or d < groups):
                        groups = d
            i += 1
    if groups is None:
        groups = max(start, numel)  # the loop ran to numel (or never ran)
    while numel % (8 * groups * 2) == 0 and numel / groups > 8000:
        groups *= 2
    if numel % (8 * groups) or numel / groups >= 16000 or numel <= groups:
        raise SettingsError(f"ZeRO++ qwZ: a gathered partition of {numel:,} elements cannot be quantized "
                            "(DeepSpeed's CUDAQuantizer asserts it is a multiple of 8 split into groups under 16k "
                            "elements); choose a GPU count that divides the model's sizes, or drop "
                            "--zero-quantized-weights")
    return groups


def _zero3_schedule(inv: ParamInventory, n: int, prefetch: int, max_live: int, max_reuse: int,
                    threshold: int, qw: tuple[int, bool] | None = None, leaves: tuple[str, ...] = ()) -> Zero3Schedule:
    """Replays DeepSpeed's PartitionedParameterCoordinator (deepspeed/runtime/zero/partitioned_param_coordinator.py,
    0.19) over the module trace of one step, once the trace is complete (every step after the first):

    - the trace is the modules in execution order, forward then backward (reversed); a tied weight's second
      module (lm_head) runs at the end of forward. Modules are the inventory's tensors grouped by owner, in
      order.
    - fetch_sub_module: gather the module's parameters that are not available; pop them from the parameter
      queue; then prefetch from the queue up to min(stage3_max_live_parameters - available, prefetch bucket)
      elements (a param popped while available is marked as used again at that later step).
    - release_sub_module / __params_to_release: release the module's parameters except the persistent ones
      (numel <= stage3_param_persistence_threshold), those the prefetcher saw reused later, and those used
      again by a module within stage3_max_reuse_distance elements of traversal after this one.
    - all_gather_coalesced (partition_parameters.py, _all_gather_dtype + AllGatherCoalescedHandle.wait) gathers
      a group into one flat buffer, then copies each parameter out of it (torch.cat): while a group of more
      than one parameter is waited on, its flat buffer and the copies coexist.
    - stage3.py step() releases everything (partition_all_parameters), and reset_step() zeroes the available
      count at the next forward.
    """
    if qw is None:
        # the coordinator's decisions count unpadded elements, so they are the same at every n: its run is kept
        # per inventory and knobs (a search asks at every GPU count), and each n prices the flat buffers it held
        c = layouts.cached(inv, ("zero3 run", prefetch, max_live, max_reuse, threshold, leaves),
                           lambda: _Coordinator(inv, 1, prefetch, max_live, max_reuse, threshold, None, leaves,
                                                record=True).run())
        at, settled, after_release = c.priced(n)
    else:
        c = _Coordinator(inv, n, prefetch, max_live, max_reuse, threshold, qw, leaves).run()
        at, settled, after_release = c.at_step, c.settled, c.after_release
    nf, block_of = c.nf, c.block_of
    # the backward phase the engine names "backward" runs until the last block's modules are done
    last_block = next((b for b in reversed(block_of) if b != ROOT_BLOCK), ROOT_BLOCK)
    cut = max((k for k in range(nf, 2 * nf) if block_of[2 * nf - 1 - k] == last_block), default=2 * nf - 1)
    return Zero3Schedule(forward=max(at[:nf], default=0), forward_end=settled[nf - 1] if nf else 0,
                         loss=max(after_release[nf - 1], at[nf]) if nf else 0,
                         backward=max((at[k] for k in range(nf, cut + 1)), default=0),
                         end=max((at[k] for k in range(cut + 1, 2 * nf)), default=0),
                         blocks=max((at[k] for k in range(nf, 2 * nf) if block_of[2 * nf - 1 - k] != ROOT_BLOCK),
                                    default=0))


class _Coordinator:
    """PartitionedParameterCoordinator's state over the trace (see _zero3_schedule): what is available, the
    unsharded copies, the coalesced groups' flat buffers, the prefetch queue; elements gathered after each
    module (at_step: the most while it ran; settled: after its waits and prefetch; after_release)."""

    def __init__(self, inv: ParamInventory, n: int, prefetch: int, max_live: int, max_reuse: int,
                 threshold: int, qw: tuple[int, bool] | None = None, leaves: tuple[str, ...] = (),
                 record: bool = False) -> None:
        """``record`` (without qwZ): keep, at each of a module's three points, the unsharded copies' elements and
        the coalesced groups whose flat buffers live (priced: the figures at any n)."""
        from collections import deque

        # ZeRO++ qwZ: count bytes (pb per unsharded element) instead of elements; fp16 parameters skip the casts
        self.pb, self.fp16 = qw if qw else (1, False)
        self.qw = qw is not None
        self.transient = 0  # the most a gather or a wait holds for a moment beyond what stays (bytes, qwZ)
        self.deq: dict[int, int] = {}  # qwZ: coalesced group -> bytes of its dequantized fp16 flat copy
        tensors = inv.tensors
        self.n, self.prefetch, self.max_live, self.max_reuse = n, prefetch, max_live, max_reuse
        self.numel = [t.numel for t in tensors]
        self.persist = [t.numel <= threshold for t in tensors]
        modules: dict[str, list[int]] = {}

        def owner(name: str) -> str:
            """The module whose hooks fetch this tensor: its own, or the ZeRO-3 leaf module around it."""
            path = name.rsplit(".", 1)[0]
            for leaf in leaves:
                if path == leaf or path.startswith(leaf + "."):
                    return leaf
            return path

        for i, t in enumerate(tensors):
            modules.setdefault(owner(t.name), []).append(i)
        for i, t in enumerate(tensors):
            for alias in t.tied_names:
                modules.setdefault("tied:" + alias.rsplit(".", 1)[0], []).append(i)
        fwd = list(modules.values())
        self.block_of = [tensors[m[0]].block for m in fwd]
        self.trace = fwd + fwd[::-1]
        self.nf = len(fwd)
        self.prefix = [0]
        for m in self.trace:
            self.prefix.append(self.prefix[-1] + sum(self.numel[p] for p in m))
        # next use of each parameter after each step
        self.next_use: list[dict[int, int]] = [{} for _ in self.trace]
        last: dict[int, int] = {}
        for k in range(len(self.trace) - 1, -1, -1):
            for p in self.trace[k]:
                self.next_use[k][p] = last.get(p, 1 << 62)
            for p in self.trace[k]:
                last[p] = k
        self.queue = deque((p, k) for k, m in enumerate(self.trace) for p in sorted(m))
        self.most_recent: dict[int, int] = {}
        self.avail: set[int] = set()  # AVAILABLE or INFLIGHT (what DeepSpeed counts in __n_available_params)
        self.copied: set[int] = set()  # the parameter's own unsharded tensor exists
        self.n_avail = 0
        self.copies = 0  # elements of unsharded parameter tensors
        self.flats: dict[int, int] = {}  # coalesced group -> elements of its flat all-gather buffer
        self.held = 0  # the flat buffers' and the dequantized copies' sum (total() less the copies)
        self.members: dict[int, set[int]] = {}  # coalesced group -> params still in the in-flight registry
        self.group_of: dict[int, int] = {}
        self.waited: set[int] = set()
        self.at_step: list[int] = []
        self.settled: list[int] = []  # after the waits' flat buffers are freed and the prefetch is issued
        self.after_release: list[int] = []
        self.points: list[tuple[int, tuple[int, ...]]] | None = [] if record else None
        self.params_of: dict[int, list[int]] = {}  # coalesced group -> its parameters (recorded runs)

    def run(self) -> _Coordinator:
        """The whole trace: every module's fetch, wait, prefetch and release."""
        for k in range(len(self.trace)):
            self.run_module(k)
        return self

    def priced(self, n: int) -> tuple[list[int], list[int], list[int]]:
        """A recorded run's at_step, settled and after_release at a partition group of n: each flat buffer
        holds its parameters' partitions padded to n ranks (gather)."""
        assert self.points is not None
        flat = {g: sum(ceil_div(self.numel[p], n) for p in ps) * n for g, ps in self.params_of.items()}
        sizes = [copies + sum(flat[g] for g in groups) for copies, groups in self.points]
        peak, settled, after = sizes[0::3], sizes[1::3], sizes[2::3]
        return [max(a, b) for a, b in zip(peak, settled)], settled, after

    def gather(self, ps: list[int], gid: int) -> None:
        """One all_gather_coalesced call: a single parameter is gathered straight into its own (padded) buffer;
        several go through one flat buffer that lives while any of them is still in the in-flight registry."""
        self.avail.update(ps)
        self.n_avail += sum(self.numel[p] for p in ps)
        if self.qw:
            self._gather_quantized(ps, gid)
            return
        if len(ps) == 1:
            self.copied.add(ps[0])
            self.copies += self.numel[ps[0]]
            return
        self.flats[gid] = flat = sum(ceil_div(self.numel[p], self.n) for p in ps) * self.n
        self.held += flat
        if self.points is not None:
            self.params_of[gid] = ps
        self.members[gid] = set(ps)
        for p in ps:
            self.group_of[p] = gid

    def _gather_quantized(self, ps: list[int], gid: int) -> None:
        """qwZ's all-gather (partition_parameters.py _all_gather_coalesced / _all_gather_sequential with
        quantize): the rank's partitions concatenated (torch.cat, parameter dtype; one parameter: its partition
        itself), cast to fp16 (CUDAQuantizer.quantize: param.to(torch.half)), quantized to int8 with one fp32
        scale per group; the int8 output buffer over every rank and the gathered scales (fp32) stay with the
        handle, the int8 input with the collective, until the group's last member is waited on."""
        part = sum(ceil_div(self.numel[p], self.n) for p in ps)
        groups = quant_groups(part)
        cat = self.pb * part if len(ps) > 1 else 0
        half = 0 if self.fp16 else 2 * part
        held = part * self.n + 4 * groups * self.n + part + 4 * groups
        self.transient = max(self.transient, self.total() + cat + half + held)
        self.flats[gid] = held
        self.held += held
        self.members[gid] = set(ps)
        for p in ps:
            self.group_of[p] = gid

    def total(self) -> int:
        return self.copies + self.held

    def wait(self, params: list[int]) -> None:
        """The first wait on a group copies every member out of its flat buffer."""
        for p in params:
            gid = self.group_of.pop(p, None)
            if gid is None:
                continue
            if gid not in self.waited:
                self.waited.add(gid)
                fresh_copies = [q for q in self.members[gid] | {p} if q in self.avail and q not in self.copied]
                if self.qw:
                    self._dequantize(gid, sorted(self.members[gid] | {p}), fresh_copies)
                else:
                    self.copies += sum(self.numel[q] for q in fresh_copies)
                self.copied.update(fresh_copies)
            self.members[gid].discard(p)

    def _dequantize(self, gid: int, members: list[int], fresh: list[int]) -> None:
        """qwZ's wait (AllGatherCoalescedHandle.wait / AllGatherHandle.wait): the int8 buffer dequantized into
        an fp16 flat copy (held by the handle's partitions), then each parameter in ds_id order torch.cat out of
        it (fp16) and cast to its own dtype (.to(ds_tensor.dtype): a second tensor unless fp16); one parameter
        is dequantized straight into an fp16 tensor and cast."""
        flat = sum(ceil_div(self.numel[p], self.n) for p in members) * self.n
        if len(members) > 1:
            self.held += 2 * flat - self.deq.get(gid, 0)
            self.deq[gid] = 2 * flat
        base = self.total()
        for q in members:
            if q not in fresh:
                continue
            cast = 0 if self.fp16 else self.pb * self.numel[q]
            self.transient = max(self.transient, base + 2 * self.numel[q] + cast)
            base += self.pb * self.numel[q] if not self.fp16 else 2 * self.numel[q]
            self.copies += self.pb * self.numel[q]

    def prefetch_after(self, k: int, params: list[int]) -> None:
        fresh = {p for p in params if self.most_recent.get(p, -1 << 62) < k}
        for _ in range(len(fresh)):
            if not self.queue:
                break
            p, step = self.queue.popleft()
            self.most_recent[p] = step
        if self.prefetch <= 0:
            return
        budget = min(self.max_live - self.n_avail, self.prefetch)
        picked: list[int] = []
        got = 0
        while self.queue and got < budget:
            p, step = self.queue.popleft()
            self.most_recent[p] = max(self.most_recent.get(p, -1 << 62), step)
            if not self.persist[p] and p not in self.avail and p not in picked:
                picked.append(p)
                got += self.numel[p]
        if picked:
            self.gather(picked, 2 * k + 1)

    def release_after(self, k: int, params: list[int]) -> None:
        """After the module ran (step_id is now k + 1)."""
        import bisect

        end = (bisect.bisect_left(self.prefix, self.prefix[k + 1] + self.max_reuse, lo=k + 1)
               if self.max_reuse > 0 else k + 1)
        for p in set(params):
            if (self.persist[p] or p not in self.avail or self.most_recent.get(p, -1 << 62) > k + 1
                    or self.next_use[k][p] < end):
                continue
            self.avail.discard(p)
            self.n_avail -= self.numel[p]
            if p in self.copied:
                self.copied.discard(p)
                self.copies -= self.pb * self.numel[p] if self.qw else self.numel[p]

    def run_module(self, k: int) -> None:
        params = self.trace[k]
        to_fetch = [p for p in dict.fromkeys(params) if not self.persist[p] and p not in self.avail]
        self.transient = 0
        if to_fetch:
            self.gather(to_fetch, 2 * k)
        self.wait(params)
        peak = self.total()
        points = self.points
        if points is not None:
            points.append((self.copies, tuple(self.flats)))
        for gid in [g for g, m in self.members.items() if not m]:
            self.held -= self.flats.pop(gid) + self.deq.pop(gid, 0)
            del self.members[gid]
        self.prefetch_after(k, params)
        if points is not None:
            points.append((self.copies, tuple(self.flats)))
        self.settled.append(self.total())
        self.at_step.append(max(peak, self.settled[-1], self.transient))
        self.release_after(k, params)
        self.after_release.append(self.total())
        if points is not None:
            points.append((self.copies, tuple(self.flats)))


def weights(job: Job) -> int:
    """The rank's partitions, and each persistent parameter (numel under param_persistence_threshold) whole
    beside its partition. At one rank its gathered copy is the partition itself (partition_parameters.py
    _no_gather_coalesced -> NoGatherHandle: param.data = ds_tensor.data.to(device), the same tensor on its own
    device; measured with the harness: gpt2 ZeRO-3 defaults at 1 rank, weights 4,732,928 B = 2 B x every element,
    where counting a copy gave +276,480 B, the 138,240 persistent elements). ZeRO++ hpZ keeps a secondary
    partition over zero_hpz_partition_size ranks too."""
    s, lay, n, rc = job.s, job.lay, job.n, job.s.recipe
    persistent = lay.persistent_numel if n > 1 else 0
    # a 4-bit base packed into a float storage (QLoRA): its packed parameters partitioned as the rest, each
    # QuantState (Params4bit.quant_state, not a parameter) whole on every rank
    out = rc.param_bytes * (lay.shard_numel + persistent) + job.inv.quantized_bytes
    hpz = s.ds.hpz_partition_size
    if hpz > 1:
        if n % hpz:
            raise SettingsError(f"shard group({n}) is not a multiple of zero_hpz_partition_size({hpz})")
        # (qwZ leaves the secondary partition in the parameter dtype: _partition_param_sec quantizes it only for
        # frozen parameters under zero_quantized_nontrainable_weights)
        out += rc.param_bytes * layouts.layout_sizes(job.inv, s.strategy.layout, hpz,
                                                     s.ds.param_persistence_threshold).shard_numel
    return out


def qgz_transient(job: Job) -> int:
    """ZeRO++ qgZ's buffers for the largest gradient it reduces (coalesced_collectives.py all_to_all_quant_reduce,
    DeepSpeed 0.19.8; derived from the source, not measured: its kernels need CUDA): only across nodes
    (stage3.py uses it when num_nodes > 1) and for 2-D gradients whose size divides by 2 x the world size (others
    take reduce_scatter_coalesced). Per gradient of N elements with G = max(rows, cols, world) groups and L GPUs
    per node: the int4 swizzled copy and the intra-node all-to-all output (N / 2 bytes and G fp32 scales each),
    the intra-node reduction and the inter-node all-to-all output (N / 2L bytes and G / L scales each), and the
    dequantized fp16 result (2N / L bytes), all alive until the loop moves to the next gradient."""
    c = job.s.cluster
    world, local = c.gpus, c.gpus_per_node
    if world // max(local, 1) <= 1:
        return 0
    best = 0
    for t in job.inv.tensors:
        if not t.trainable or len(t.shape) != 2 or t.numel % (2 * world):
            continue
        n_el, groups = t.numel, max(t.shape[0], t.shape[1], world)
        best = max(best, 2 * (n_el // 2 + 4 * groups) + 2 * (n_el // (2 * local) + 4 * ceil_div(groups, local))
                   + 2 * n_el // local)
    return best


def offload(job: Job, grads: Grads, host_by: dict[str, int]) -> OffloadedGrads:
    """ZeRO-Offload (stage3.py): grad_partitions_flat_buffer (accumulation dtype) on self.device = "cpu", and each
    sub-group's fp32 gradient (initialize_optimizer_states: subgroup_gradient_buffer)."""
    rc = job.s.recipe
    host_by["grads_bytes"] += 4 * job.lay.optimizer_numel + grads.persist
    if not rc.loss_scaling:
        return OffloadedGrads()
    # the step begins with the overflow check on the flat grad buffer, which is on the host here (stage3.py
    # has_overflow: torch.isinf(grad_partitions_flat_buffer), composite abs() == inf: a grad-dtype abs and a bool
    # result; then isnan's bool). Measured with the harness: 26,746,368 B at 1 rank (llama-3-8b, fp16), the step's
    # peak. Without offload the fp32 grads the step makes afterwards are larger (4 bytes against 3). On CPU the
    # host is the device's allocator.
    check = (rc.grad_bytes + 1) * job.lay.optimizer_numel
    if job.s.cluster.device == "cpu":
        return OffloadedGrads(step_scratch=check)
    host_by["buffers_bytes"] += check
    return OffloadedGrads()


#: stage3.py _constant_buffered_norm2's buffer_size: a gradient partition's fp64 norm, this many elements at a time
NORM_CHUNK = 250_000_000


def buffers(job: Job, grads: Grads) -> BufferTimeline:
    s, rc, n, ds = job.s, job.s.recipe, job.n, job.s.ds
    # the ipg bucket buffer, allocated at init (overlap_comm does not double it in stage 3)
    persistent = ds.reduce_bucket_size * rc.grad_bytes if s.strategy.ds_ipg_buckets and ds.contiguous_gradients else 0
    g = job.gathers
    cb = rc.param_bytes
    # ZeRO++ qwZ: the schedule counts bytes (int8 buffers, fp16 dequantized copies, the parameters' own copies)
    qw = (rc.param_bytes, s.recipe.name == "deepspeed-fp16") if ds.quantized_weights and n > 1 else None
    z = zero3_schedule(job.inv, n, ds.prefetch_bucket_size, ds.max_live_parameters, ds.max_reuse_distance,
                       ds.param_persistence_threshold, qw, s.z3_leaves)
    if qw:
        cb = 1
    if n == 1 and not (ds.offload_param and s.cluster.device != "cpu"):
        # a partition group of one gathers nothing: each parameter is pointed at its partition
        # (partition_parameters.py all_gather_coalesced -> _no_gather_coalesced, NoGatherHandle: param.data =
        # ds_tensor.data.to(device), a copy only from a host partition to a GPU). Measured: llama-3-8b at 1 rank,
        # forward 19.2 MB above the step's start, the activations alone (harness).
        cb = 0
    # a module's grads before its hook takes them (reduce_ready_partitions_and_remove_grads): with
    # contiguous_gradients each is copied into the ipg bucket (counted above) and freed, or reduced at once when
    # larger than the bucket, so one parameter's; without, the bucket's parameters keep their grads until it is
    # reduced (measured: the whole block's, assumed before, was +1..+3% over)
    gg = job.grad_gathers  # what gets gradients (the trainable parameters under LoRA)
    unreduced = (gg.largest_tensor if ds.contiguous_gradients
                 else min(gg.largest_block, max(ds.reduce_bucket_size, gg.largest_tensor)))
    # inside the last block's forward: the most gathered in forward, with a coalesced prefetch's flat buffer and
    # its copies both alive (AllGatherCoalescedHandle keeps the flat buffer until every member is waited on;
    # measured with the harness: at DeepSpeed's default buckets, 4 ranks, one 17.3 MB flat buffer held from the first
    # block to the end of the last one, the peak of the step)
    moments = [LOSS, BufferMoment(cb * z.forward, 0, Moment.INSIDE_LAST_BLOCK_FORWARD)]
    # inside a block's backward (a recomputed block is the peak there): the block and what is prefetched
    # gathered, and of its grads only those whose hook has not yet taken them: ZeRO-3 reduces (or moves into its
    # contiguous bucket) each parameter's grad in the hook on its AccumulateGrad
    # (stage3.py reduce_ready_partitions_and_remove_grads) and frees it. Measured with the harness: gpt2 at 4 ranks
    # with full recompute peaks at the last block's weight-gradient GEMM during its recomputed backward, 1.58 MB
    # above the loss (-6.63% without these moments). A tied weight's first contribution (the head's) waits for
    # the embedding's: its hook runs last.
    tied_bytes = rc.grad_bytes * gg.tied
    for at in (Moment.INSIDE_LAST_BLOCK_BACKWARD, Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD,
               Moment.INSIDE_FIRST_BLOCK_BACKWARD):
        moments.append(BufferMoment(cb * z.blocks, grads.persist + tied_bytes, at))
    # ZeRO++ qgZ: across nodes stage3.py __avg_scatter_grads reduces each gradient through
    # coalesced_collectives.py all_to_all_quant_reduce instead of reduce_scatter_coalesced
    qgz = qgz_transient(job) if ds.quantized_gradients else 0
    unreduced_bytes = rc.grad_bytes * unreduced + qgz
    gathered_end = cb * z.end + unreduced_bytes
    hook_transient = NO_HOOK_TRANSIENT
    if job.offload_optimizer:
        # at the gradient-accumulation boundary, per reduced parameter (stage3.py partition_grads ->
        # _offload_grad_partition_at_boundary): grad_buffer.to(device) copies the host partition back to a GPU (a
        # no-op on CPU), then _constant_buffered_norm2 takes its norm in fp64 250M elements at a time
        # (``part.to(get_norm_dtype())`` per split), freed before the fp32 copy for the host
        # (``grad_buffer.to(fp32)``, 4 bytes; none where the gradients are fp32); the reduce's output partition
        # exists beside them, and a gradient larger than reduce_bucket_size is not moved into the contiguous
        # bucket but kept whole to its reduce (__add_grad_to_ipg_bucket). Measured with the harness: llama-3-8b at
        # 1 rank peaks at the head's, 10,485,760 B for its 1,048,576 elements; the replay (zero3_replay.py
        # ipg_bucket, measured on the H100: ../shared/gpu/traces/zero3_offload) has the same sequence.
        # The bucket's reduce comes at the hook that would overflow it, so its gradients' copies come there, the
        # bucket's torch.cat beside them (bucket_flushes); the head's (untied, the final norm's with it) are in
        # the bucket as the blocks' backward begins, unless larger than it (reduced alone at the final norm's
        # hook).
        gb, bucket = rc.grad_bytes, ds.reduce_bucket_size
        head = gg.head_largest_tensor
        lead = max(gg.root_head - gg.tied, 0)
        lead, lead_largest = (lead - head, 0) if head > bucket else (lead, head)
        t = HookTransient(per=gb if s.cluster.device != "cpu" else 0, parts=n, chunk=NORM_CHUNK, chunk_per=8,
                          after_per=4 if gb != 4 else 0, apart_over=bucket, apart_per=gb, bucket=bucket,
                          cat_per=gb, lead=lead, lead_largest=lead_largest,
                          depth=len(job.inv.layer_blocks), own_per=gb)
        # The head's at the root's last hook before the blocks (the final norm's: ZeRO-3 reduces a bucket at the
        # hook of the parameter that would overflow it, stage3.py reduce_independent_p_g_buckets_and_remove_grads;
        # measured with the harness: llama-3-8b at 1 rank, small buckets, the head's fp64 copy inside the final norm's
        # weight hook) (a tied head's hook runs at the embedding's backward, after every block); each block
        # parameter's at its own hook, with the activations of that moment (profile.block_hooks); the
        # embedding's at backward's end.
        moments.append(BufferMoment(cb * z.loss + (t.bytes(head) if head > bucket else 0),
                                    grads.persist + tied_bytes, Moment.ROOT_LAST_HOOK_BEFORE_BLOCKS))
        hook_transient = t
        moments.append(BufferMoment(cb * z.blocks, grads.persist + tied_bytes, Moment.BLOCK_GRADIENT_HOOK))
        gathered_end += t.tail([x.numel for x in reversed(job.inv.trainable_inventory.tensors)])
    return BufferTimeline(
        persistent=persistent, gathered_forward_most=cb * z.forward, gathered_forward_end=cb * z.forward_end,
        gathered_loss=cb * z.loss, gathered_backward=cb * z.backward + unreduced_bytes,
        gathered_end=gathered_end, moments=tuple(moments), grads_held=True, hook_transient=hook_transient,
        assumptions={"zero3_unreduced_grad_numel": unreduced,
                     ("zero3_gathered_bytes" if qw else "zero3_gathered_numel"): {"forward": z.forward, "forward_end": z.forward_end, "loss": z.loss,
                                              "backward": z.backward, "end": z.end, "blocks": z.blocks},
                     "largest_gathered_block_numel": g.largest_block})


def sub_groups(parts: list[int], size: int) -> list[int]:
    """The optimizer's sub-groups, elements each (stage3.py _create_fp16_sub_groups: partitions in module order,
    a group closed once it reaches sub_group_size)."""
    groups, cur = [], 0
    for x in parts:
        cur += x
        if cur >= size:
            groups.append(cur)
            cur = 0
    if cur:
        groups.append(cur)
    return groups


def pinned_host(inv: ParamInventory, s: Settings, n: int) -> list[int]:
    """ZeRO-Offload with pin_memory: per sub-group the fp32 partition and its fp32 gradient, and the flat gradient
    buffer (offload_optimizer); each non-persistent parameter's partition (offload_param), and its hpZ secondary
    partition."""
    rc, parts = s.recipe, [ceil_div(t.numel, n) for t in inv.trainable_inventory.tensors]
    out: list[int] = []
    if s.ds.offload_optimizer and s.ds.offload_pin_memory:
        out += [4 * g for g in sub_groups(parts, s.ds.sub_group_size)] * 2
        out.append(rc.grad_bytes * sum(parts))  # grad_partitions_flat_buffer
    if s.ds.offload_param and s.ds.offload_pin_memory:
        threshold = s.ds.param_persistence_threshold
        out += [rc.param_bytes * ceil_div(t.numel, n) for t in inv.tensors if t.numel > threshold]
        hpz = s.ds.hpz_partition_size
        if hpz > 1 and n > 1:
            # ZeRO++ hpZ: each secondary partition pinned on the host too (_partition_param_sec: torch.empty on
            # remote_device, then pin_memory)
            out += [rc.param_bytes * ceil_div(t.numel, hpz) for t in inv.tensors if t.numel > threshold]
    return out


def _largest_sub_group(job: Job) -> int:
    """Elements of the largest optimizer sub-group on a rank (stage3.py _create_fp16_sub_groups): each parameter's
    partition (ceil(numel / n)) in module order, a sub-group closed once it reaches sub_group_size."""
    parts = [ceil_div(t.numel, job.n) for t in job.inv.trainable_inventory.tensors]
    size = job.s.ds.sub_group_size
    if size <= 0 or size >= sum(parts):
        return sum(parts)
    best = cur = 0
    for x in parts:
        cur += x
        if cur >= size:
            best, cur = max(best, cur), 0
    return max(best, cur)


def step(job: Job, s: StepIn) -> tuple[int, int, dict[str, int]]:
    """The step (stage3.py step) works one sub-group at a time (_create_fp16_sub_groups: parameters in order until
    sub_group_size elements are reached): _prepare_fp32_grad_for_sub_group flattens the sub-group's gradients into
    a copy in the grad dtype and casts it to fp32 beside grad_partitions_flat_buffer; the copy is freed, the
    optimizer steps on the fp32 grad, and _release_sub_group drops it. Measured on the H100 (bench/gpu, ZeRO-3 at
    1 rank): olmoe 2 blocks one sub-group of 1.045 B elements, +2.09 GB copy +4.18 GB fp32 at the peak;
    qwen2.5-7b 4 blocks two sub-groups, the larger 1.01 B elements (+2.02 GB, +4.04 GB)."""
    rc = job.s.recipe
    if not (s.master_bytes and not job.offload_optimizer):
        return s.grads, s.buffers, {}
    sg = _largest_sub_group(job)
    grads = s.grads_persist + rc.reduced_grad_bytes * sg
    sg_scratch = rc.state_bytes * sg if s.impl == "foreach" else (
        s.scratch * sg // max(job.lay.optimizer_numel, 1) if s.impl == "single-tensor" else 0)
    # the flat copy beside its fp32 cast (the cast is the copy itself when the grads are fp32)
    flat = rc.grad_bytes * sg if rc.grad_bytes != rc.reduced_grad_bytes else 0
    return grads, s.persistent + max(flat, sg_scratch), {"zero3_largest_sub_group_numel": sg}


def optimizer_tensors(job: Job) -> tuple[tuple[tuple[int, ...], int], ...]:
    """What the optimizer steps: one flat fp32 partition per sub-group (stage3.py _create_fp32_partitions:
    fp32_partitioned_groups_flat, 1-D), so Adafactor keeps a full second moment and bitsandbytes quantizes
    each sub-group as one tensor."""
    return tuple(((g,), g) for g in sub_groups([n for _, n in job.lay.shard_shapes], job.s.ds.sub_group_size))


MODEL = FrameworkModel(name="zero3", replay="memplan.frameworks.zero3_replay", buffers=buffers, weights=weights,
                       half_autocast_why_not="DeepSpeed casts the module to its own 16-bit dtype with an fp32 master partition "
                                             "(engine.py): the Trainer's bf16 there is deepspeed-bf16",
                       
                       grads_at_end=grads_at_end, offload=offload, step=step, zero_offload=True,
                       pinned_host=pinned_host, optimizer_tensors=optimizer_tensors, four_bit=FourBitBase(
                           uint8_why_not="DeepSpeed partitions every parameter, and a uint8 Params4bit cannot be "
                                         "partitioned and gathered as the others; give --quant-storage bfloat16 "
                                         "(bnb_4bit_quant_storage, as HF's ZeRO-3 QLoRA recipe sets it)",
                           packed="which ZeRO-3 partitions like the other frozen weights (gathered with their "
                                  "module), each QuantState (a Params4bit attribute, not a parameter) kept whole on "
                                  "every GPU",
                           shards_packed=True, loaded_whole=True))
