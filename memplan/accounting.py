"""Accounting: inventory + settings -> Plan. Pure integer arithmetic; no torch, no printing.

Per rank, per phase (forward, loss, backward start/end, optimizer step), the bytes of every category:
weights, master weights, gradients, optimizer states, activations, buffers. The reported peak is the maximum
over phases, with the phase named. Overheads (CUDA context, NCCL, fragmentation) are separate and only enter
the fit verdict. Every framework default used is in ``assumptions``.

Layout-dependent sizes (shard numel per rank, gathered block sizes) are computed once per
(inventory, layout, shard count) and cached, which is what lets the planner evaluate many configurations.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memplan import activations as act
from memplan import layouts
from memplan.errors import SettingsError
from memplan.model.inventory import ParamInventory
from memplan.settings import (  # noqa: F401  (re-exported: the library's names for the settings types)
    BLAS_HANDLES, FALLBACK_FRAGMENTATION, FALLBACK_FRAGMENTATION_PERCENT, Cluster, DeepSpeedKnobs, Overheads,
    Settings, TorchKnobs, default_blas_workspace, fallback_fragmentation, optimizer_impl, shard_group_size, with_gpus)
from memplan.units import ceil_div


CATEGORY_KEYS = ("weights_bytes", "master_weights_bytes", "grads_bytes", "optimizer_states_bytes",
                 "activations_bytes", "buffers_bytes")


@dataclass(frozen=True)
class Phase:
    name: str
    weights_bytes: int
    master_weights_bytes: int
    grads_bytes: int
    optimizer_states_bytes: int
    activations_bytes: int
    buffers_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.master_weights_bytes + self.grads_bytes + self.optimizer_states_bytes
                + self.activations_bytes + self.buffers_bytes)


@dataclass(frozen=True)
class Plan:
    """The per-GPU prediction for one configuration (worst rank)."""

    settings: Settings
    inventory: ParamInventory
    phases: tuple[Phase, ...]
    peak: Phase
    overhead_bytes: int
    overhead_detail: dict[str, int]
    host_bytes_per_node: int
    shard_group: int
    #: bytes held between steps (model states, grads kept across steps, buffers allocated at setup)
    between_steps_bytes: int
    assumptions: dict[str, Any]
    #: per rank, by category: what offload keeps in host memory (sums to host_bytes_per_node / ranks per node)
    host_detail: dict[str, int] = field(default_factory=dict)
    #: the caching allocator replayed (reserved.Reserved), or None with reserved_why saying why not
    reserved: Any = None
    reserved_why: str | None = None

    @property
    def reserved_peak_bytes(self) -> int | None:
        """Predicted torch.cuda.max_memory_reserved: replayed, or with the flat fragmentation term."""
        if self.settings.cluster.device != "cuda":
            return None
        return self.peak_bytes + self.overhead_detail.get("allocator_bytes",
                                                          self.overhead_detail.get("fragmentation_bytes", 0))

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes

    @property
    def required_bytes(self) -> int:
        return self.peak_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool | None:
        mem = self.settings.cluster.gpu_memory_bytes
        return None if mem is None else self.required_bytes <= mem

    @property
    def headroom_bytes(self) -> int | None:
        mem = self.settings.cluster.gpu_memory_bytes
        return None if mem is None else mem - self.required_bytes

    @property
    def host_fits(self) -> bool | None:
        """Whether the offloaded states fit a node's host RAM (--host-memory), pinned buffers rounded as PyTorch
        rounds them (memplan/host.py); None without --host-memory or without offload."""
        from memplan.host import host_report

        rep = host_report(self)
        return None if rep is None else rep["fits"]


def _largest_sub_group(inv: ParamInventory, n: int, sub_group_size: int) -> int:
    """Elements of ZeRO-3's largest optimizer sub-group on a rank (stage3.py _create_fp16_sub_groups): each
    parameter's partition (ceil(numel / n)) in module order, a sub-group closed once it reaches sub_group_size."""
    parts = [ceil_div(t.numel, n) for t in inv.tensors]
    if sub_group_size <= 0 or sub_group_size >= sum(parts):
        return sum(parts)
    best = cur = 0
    for x in parts:
        cur += x
        if cur >= sub_group_size:
            best, cur = max(best, cur), 0
    return max(best, cur)


def _fixed(inv: ParamInventory, s: Settings) -> _Fixed:
    """Everything in a Plan that does not depend on the micro-batch: model states, grads, buffers, overheads."""
    st, rc, opt, c = s.strategy, s.recipe, s.optimizer, s.cluster
    n = shard_group_size(s)
    lay = layouts.layout_sizes(inv, st.layout, n, s.ds.param_persistence_threshold)
    psi = inv.num_params
    ds_offload_opt = st.framework == "deepspeed" and s.ds.offload_optimizer
    ds_offload_param = st.zero_stage == 3 and s.ds.offload_param
    fsdp_offload = st.framework.startswith("fsdp") and s.torch.cpu_offload
    a: dict[str, Any] = {"shard_group": n, "layout": st.layout}

    # ---- model states (per rank, between steps) ----
    shard_numel = lay.shard_numel  # elements of parameters this rank stores
    opt_numel = lay.optimizer_numel  # elements this rank's optimizer updates (worst rank)
    if st.framework == "deepspeed" and st.shard_params:
        # a persistent parameter (numel under param_persistence_threshold) stays gathered beside its partition;
        # at one rank its gathered copy is the partition itself (partition_parameters.py _no_gather_coalesced ->
        # NoGatherHandle: param.data = ds_tensor.data.to(device), the same tensor on its own device; measured,
        # session 9: gpt2 ZeRO-3 defaults at 1 rank, weights 4,732,928 B = 2 B x every element, where counting a
        # copy gave +276,480 B, the 138,240 persistent elements)
        persistent = lay.persistent_numel if n > 1 else 0
        weights = rc.param_bytes * (shard_numel + persistent)
        if s.ds.hpz_partition_size > 1:
            if n % s.ds.hpz_partition_size:
                raise SettingsError(f"shard group({n}) is not a multiple of zero_hpz_partition_size"
                                    f"({s.ds.hpz_partition_size})")
            weights += rc.param_bytes * layouts.layout_sizes(
                inv, st.layout, s.ds.hpz_partition_size, s.ds.param_persistence_threshold).shard_numel
    else:
        weights = rc.param_bytes * shard_numel
    master_bytes = 4 if st.fp32_master_copy else rc.master_bytes
    master = master_bytes * opt_numel
    states = layouts.optimizer_state_bytes(inv, opt, rc, lay, st.shard_optimizer)
    #: per rank, by category: what offload keeps in host memory
    host_by = {"weights_bytes": 0, "master_weights_bytes": 0, "grads_bytes": 0, "optimizer_states_bytes": 0,
               "buffers_bytes": 0}
    if ds_offload_param:
        # the partitioned parameters live on the host (offload_param.device "cpu"); persistent ones stay
        host_by["weights_bytes"] += weights - rc.param_bytes * lay.persistent_numel
        weights = rc.param_bytes * lay.persistent_numel
    if ds_offload_opt or fsdp_offload:
        host_by["master_weights_bytes"] += master
        host_by["optimizer_states_bytes"] += states
        master = states = 0
    if fsdp_offload:
        host_by["weights_bytes"] += weights
        weights = 0

    # ---- gradients ----
    # grads_end: alive at the end of backward, per rank; grads_persist: kept between steps.
    if st.framework == "fsdp1":
        # FSDP1 keeps every flat parameter's reduced grad in the reduce dtype, sharded or not (NO_SHARD
        # all-reduces the cast full flat grad: measured, session 5)
        grads_end = rc.reduced_grad_bytes * opt_numel
    elif st.full_grads_in_backward:
        grads_end = rc.grad_bytes * (psi if not st.shard_params else shard_numel)
    else:
        # sharded grads: DeepSpeed ZeRO-2 keeps the real (unpadded) elements of the rank's partition in the grad
        # dtype (stage_1_and_2.py grads_in_partition: sum of numel of params_in_partition; rank 0 is full);
        # FSDP keeps padded shards in the reduce dtype.
        if st.framework == "deepspeed":
            grads_end = rc.grad_bytes * min(opt_numel, psi)
        else:
            grads_end = rc.reduced_grad_bytes * opt_numel
    grads_persist = 0
    if st.fp32_grad_accumulation:
        grads_persist = rc.reduced_grad_bytes * opt_numel  # BF16_Optimizer's fp32_groups_gradients_flat
    elif st.persistent_grads:
        grads_persist = rc.grad_bytes * opt_numel  # ZeRO-3 grad_partitions_flat_buffer (accumulation dtype)
        grads_end = grads_persist
    if s.grad_accum > 1:
        grads_persist = max(grads_persist, grads_end)  # grads live across micro-steps
    if fsdp_offload:
        host_by["grads_bytes"] += grads_end
        grads_end = grads_persist = 0
    offload_gpu_buffer = offload_step_scratch = 0
    if ds_offload_opt:
        # ZeRO-Offload keeps the optimizer's fp32 gradient partition on the host too (measured on CPU, where
        # device and host share the allocator: session 6). Stage 1/2 (stage_1_and_2.py, self.device = "cpu"):
        # initialize_optimizer_states' single_grad_partition (fp32, the partition), the bit16 copy of the
        # partition for the copy back (param_buffer_of_bit16_for_cpu_offload_groups) and
        # temp_grad_buffer_for_cpu_offload (the largest parameter, bit16); temp_grad_buffer_for_gpu_offload (the
        # same size) stays on the device; gradients go from the reduce bucket straight to the host. Stage 3
        # (stage3.py): grad_partitions_flat_buffer (accumulation dtype) on self.device = "cpu", and each
        # sub-group's fp32 gradient (initialize_optimizer_states: subgroup_gradient_buffer).
        fp32 = 4
        host_by["grads_bytes"] += fp32 * opt_numel
        if st.zero_stage == 3:
            host_by["grads_bytes"] += grads_persist
            if rc.loss_scaling:
                # the step begins with the overflow check on the flat grad buffer, which is on the host here
                # (stage3.py has_overflow: torch.isinf(grad_partitions_flat_buffer), composite abs() == inf:
                # a grad-dtype abs and a bool result; then isnan's bool). Measured, session 7: 26,746,368 B at
                # 1 rank (llama-3-8b, fp16), the step's peak. Without offload the fp32 grads the step makes
                # afterwards are larger (4 bytes against 3). On CPU the host is the device's allocator.
                check = (rc.grad_bytes + 1) * opt_numel
                if c.device == "cpu":
                    offload_step_scratch = check
                else:
                    host_by["buffers_bytes"] += check
        else:
            largest = max((t.numel for t in inv.tensors), default=0)
            host_by["buffers_bytes"] += rc.param_bytes * opt_numel + rc.grad_bytes * largest
            offload_gpu_buffer = rc.grad_bytes * largest
        grads_end = grads_persist = 0
    host = sum(host_by.values())

    # ---- buffers ----
    buf_persist = 0
    buf_bwd = 0
    overlap = s.ds.overlap_comm if s.ds.overlap_comm is not None else st.zero_stage == 3
    if st.ddp_buckets and not s.torch.gradient_as_bucket_view:
        # DDP's Reducer allocates a flat bucket tensor for every bucket at construction, covering all grads.
        buf_persist += rc.grad_bytes * psi
    if st.ds_ipg_buckets and s.ds.contiguous_gradients:
        ipg = (2 if overlap and st.zero_stage != 3 else 1) * s.ds.reduce_bucket_size * rc.grad_bytes
        if st.zero_stage == 3:
            buf_persist += ipg  # stage3.py allocates the ipg bucket buffer at init
        else:
            # stage_1_and_2.py setup_buckets(): allocated in every backward, at the first gradient hook (the
            # head's or the final norm's), so not yet at the loss backward's peak (measured: the backward-start
            # phase was over by exactly the bucket, +0.45% to +0.76%); from the last block's backward on
            buf_bwd += ipg
    a["overlap_comm"] = overlap
    buf_persist += offload_gpu_buffer
    if c.device == "cuda":
        # one cuBLAS handle per thread that runs GEMMs: forward (and the optimizer) on the main thread, backward
        # (recomputation too) on the autograd engine's device thread; each gets its own workspace on the stream
        # and keeps it (thread-local handle pool windows, workspaces keyed by (handle, stream))
        buf_persist += BLAS_HANDLES * c.blas_workspace_bytes
        a["blas_workspace"] = f"{BLAS_HANDLES} x {c.blas_workspace_bytes} B (cuBLAS, forward and autograd threads)"

    # gather_fwd_end: gathered when forward ends (the loss); gather_turn: the most gathered in forward, counted
    # with every block's saved activations (conservative: the moment falls before the last blocks ran)
    gather_bwd = gather_turn = gather_loss = gather_end = gather_fwd_end = 0
    #: further moments, reported in the "backward" phase: (buffers, grads, activations) with activations -4
    #: for "everything saved but the last block", -1 "but the last two", -2 everything saved, -3 the
    #: embedding's output only, or k >= 0
    #: inside a block's backward (the profile's block_moments: 0 the last block, 1 the one before it, 2 the
    #: first; the block's own grads added there). FSDP2's forward copy-outs are among them: the phase is the
    #: step's worst moment outside the forward's end, the loss and backward's end.
    bwd_moments: list[tuple[int, int, int]] = []
    #: ZeRO-1 without overlap_comm: grads_in_partition beside every gradient after backward, where the reduce
    #: begins (a buffer of the reduce at backward's end: the model states stay the ZeRO paper's)
    zero1_epilogue = 0
    if buf_bwd:
        # ZeRO-1/2's bucket, set up at the first gradient hook (the head's), beside what is alive at the root's
        # last hook before the blocks (the final norm's)
        bwd_moments.append((0, 0, -12))
        # inside the blocks' backward (a recomputed block is the peak there): once a bucket has been reduced,
        # grads_in_partition (the whole parameters overlapping the rank's partition, in the grad dtype) exists,
        # and a tied weight's first contribution waits for the embedding's (measured, session 6: gpt2 ZeRO-2 at
        # 4 ranks with full recompute was -13% without these)
        if st.zero_stage in (1, 2) and not ds_offload_opt and (st.shard_grads or overlap):
            tied = layouts.gather_sizes(inv, st.layout, n).tied
            in_part = lay.partition_params_numel if s.ds.reduce_bucket_size < psi else 0
            for k in (0, 1, 2):
                bwd_moments.append((0, rc.grad_bytes * (in_part + tied), k))
        elif st.zero_stage == 1 and not ds_offload_opt:
            # ZeRO-1 without overlap_comm reduces nothing in its gradient hooks (stage_1_and_2.py
            # process_gradients: only with partition_gradients or overlap_comm; the hook just sets up the bucket):
            # every gradient stays as autograd made it until reduce_gradients after backward, as under DDP.
            # After backward, the first bucket's reduce allocates grads_in_partition beside all of them
            # (copy_grads_in_partition). Measured, session 8: gpt2, fp32, 2 ranks: +8.24% before.
            bwd_moments += _unreduced_grad_moments(layouts.gather_sizes(inv, st.layout, n), rc.grad_bytes, psi)
            if s.ds.contiguous_gradients:
                zero1_epilogue = rc.grad_bytes * lay.partition_params_numel
    # the loss's and the head's backward with the head's gradient as autograd makes it (a new tensor from the
    # weight-gradient GEMM, before any hook has taken it): what is gathered at the loss, no reduce bucket yet
    # (ZeRO-1/2 set theirs up in the first gradient hook). Measured, session 7: ZeRO-3 at 1 rank peaks at the
    # head's weight-gradient GEMM, 1.31 MB above the loss's own peak (llama-3-8b, 2 blocks).
    bwd_moments.append((0, 0, -10))
    #: FSDP2: (buffers, grads not yet reduced) at backward's end
    fsdp_end: tuple[int, int] | None = None
    # FSDP2 unshards into MixedPrecisionPolicy.param_dtype (else the parameters' dtype), and autograd's unsharded
    # grads come out in that same dtype: the recipe's grad_bytes (fsdp-bf16: bf16; torch-amp, fp32: fp32, with
    # autocast making its own bf16 copies from the unsharded fp32 weights). With a shard group of one (NO_SHARD)
    # FSDP2 still copies each parameter into its unsharded buffer, in any dtype (wait_for_unshard's world_size == 1
    # path: alloc_storage + copy_), measured with fsdp-bf16 and torch-amp (docs/accuracy.md).
    fsdp_copies = st.framework.startswith("fsdp") and not st.shard_params
    zero3_blocks = False  #: the block moments count only hook-pending grads (ZeRO-3)
    #: bytes per element of a parameter's partition that its gradient hook allocates, and the partition count
    hook_transient = (0, 1)
    if st.shard_params or fsdp_copies:
        g = layouts.gather_sizes(inv, st.layout, n)
        cb = rc.grad_bytes if st.framework.startswith("fsdp") else rc.param_bytes
        if st.framework == "deepspeed":
            # ZeRO-3 gathers module by module, prefetches from its recorded trace, and keeps what will be reused
            # within stage3_max_reuse_distance: layouts.zero3_schedule replays PartitionedParameterCoordinator.
            # In backward, a parameter's full grad exists until its hook reduces it into its partition.
            z = layouts.zero3_schedule(inv, n, s.ds.prefetch_bucket_size, s.ds.max_live_parameters,
                                       s.ds.max_reuse_distance, s.ds.param_persistence_threshold)
            if n == 1 and not (s.ds.offload_param and c.device != "cpu"):
                # a partition group of one gathers nothing: each parameter is pointed at its partition
                # (partition_parameters.py all_gather_coalesced -> _no_gather_coalesced, NoGatherHandle:
                # param.data = ds_tensor.data.to(device), a copy only from a host partition to a GPU). Measured:
                # llama-3-8b at 1 rank, forward 19.2 MB above the step's start, the activations alone (session 7).
                cb = 0
            gather_turn = cb * z.forward
            gather_fwd_end = cb * z.forward_end
            gather_loss = cb * z.loss
            # a module's grads before its hook takes them (reduce_ready_partitions_and_remove_grads): with
            # contiguous_gradients each is copied into the ipg bucket (counted above) and freed, or reduced at
            # once when larger than the bucket, so one parameter's; without, the bucket's parameters keep their
            # grads until it is reduced (session 7: the whole block's, assumed before, was +1..+3% over)
            unreduced = (g.largest_tensor if s.ds.contiguous_gradients
                         else min(g.largest_block, max(s.ds.reduce_bucket_size, g.largest_tensor)))
            a["zero3_unreduced_grad_numel"] = unreduced
            gather_bwd = cb * z.backward + rc.grad_bytes * unreduced
            gather_end = cb * z.end + rc.grad_bytes * unreduced
            # inside a block's backward (a recomputed block is the peak there): the block and what is prefetched
            # gathered, and of its grads only those whose hook has not yet taken them: ZeRO-3 reduces (or moves
            # into its contiguous bucket) each parameter's grad in the hook on its AccumulateGrad
            # (stage3.py reduce_ready_partitions_and_remove_grads) and frees it. Measured, session 7: gpt2 at 4
            # ranks with full recompute peaks at the last block's weight-gradient GEMM during its recomputed
            # backward, 1.58 MB above the loss (-6.63% without these moments).
            # A tied weight's first contribution (the head's) waits for the embedding's: its hook runs last.
            # inside the last block's forward: the most gathered in forward, with a coalesced prefetch's flat
            # buffer and its copies both alive (AllGatherCoalescedHandle keeps the flat buffer until every member
            # is waited on; measured, session 7: at DeepSpeed's default buckets, 4 ranks, one 17.3 MB flat
            # buffer held from the first block to the end of the last one, the peak of the step)
            bwd_moments.append((cb * z.forward, 0, -8))
            zero3_blocks = True
            tied = g.tied
            for k in (0, 1, 2):
                bwd_moments.append((cb * z.blocks, grads_persist + rc.grad_bytes * tied, k))
            if ds_offload_opt:
                # ZeRO-Offload at the gradient-accumulation boundary, per reduced parameter (stage3.py
                # partition_grads -> _offload_grad_partition_at_boundary): grad_buffer.to(device) copies the
                # host partition back to a GPU (a no-op on CPU), then _constant_buffered_norm2 takes its norm
                # in fp64 (part.to(get_norm_dtype()): fp64 wherever the accelerator has it), freed before the
                # fp32 copy to the host (4 bytes); the reduce's output partition exists beside them. Measured,
                # session 7: llama-3-8b at 1 rank peaks at the head's, 10,485,760 B for its 1,048,576 elements.
                per = rc.grad_bytes + 8 + (rc.grad_bytes if c.device != "cpu" else 0)
                # The head's at the root's last hook before the blocks (the final norm's: ZeRO-3 reduces a bucket
                # at the hook of the parameter that would overflow it, stage3.py
                # reduce_independent_p_g_buckets_and_remove_grads; measured, session 9: llama-3-8b at 1 rank,
                # small buckets, the head's fp64 copy inside the final norm's weight hook) (a tied head's hook
                # runs at the embedding's backward, after every block); each block parameter's at its own hook,
                # with the activations of that moment (profile.block_hooks: the -11 moment); the embedding's at
                # backward's end.
                tied_bytes = rc.grad_bytes * tied
                bwd_moments.append((cb * z.loss + per * ceil_div(g.head_largest_tensor, n), grads_persist + tied_bytes,
                                    -12))
                hook_transient = (per, n)
                bwd_moments.append((cb * z.blocks, grads_persist + tied_bytes, -11))
                gather_end += per * ceil_div(g.root_largest_tensor, n)
            a["zero3_gathered_numel"] = {"forward": z.forward, "forward_end": z.forward_end, "loss": z.loss,
                                         "backward": z.backward, "end": z.end, "blocks": z.blocks}
        elif st.framework == "fsdp1":
            gather_fwd_end, gather_loss, gather_bwd, fsdp_end = _fsdp1_buffers(
                s, g, n, cb, grads_end, bwd_moments, a)
            gather_end = 0
        else:
            # FSDP2 (torch/distributed/fsdp/_fully_shard, torch 2.13), per rank, with B the largest block:
            # - the root group (embeddings, final norm, head) is not resharded after forward (fully_shard's
            #   reshard_after_forward=None means False for the root), so it stays unsharded until its backward;
            # - forward: a block's all-gather output is kept (FSDPCommContext.all_gather_state) until the next
            #   block's copy-out, and the last one until the root's post-forward, i.e. through the loss when the
            #   model computes it; so mid-forward two blocks are unsharded (copy + all-gather output);
            # - backward: a block's pre-backward prefetches the next block's all-gather; its post-backward
            #   reshards it, frees the previous block's reduce-scatter input (reduce_scatter_max_input_buffers
            #   = 1), copies its unsharded grads into a reduce-dtype reduce-scatter input (foreach_reduce) and
            #   frees them; the head's grads (and a tied embedding's) wait for the root's reduce at the end.
            # With a shard group of one (NO_SHARD) the unsharded copies (fsdp_copies above) have nothing to
            # reshard to and stay until the block's backward. Each term was checked against the harness's
            # allocator timeline (fsdp-full, 2 and 4 blocks; session 4; docs/accuracy.md).
            raf = s.torch.reshard_after_forward
            raf = st.reshard_after_forward if raf is None else raf
            if not st.shard_params:
                raf = False
            elif not isinstance(raf, bool):
                if raf < 1 or n % raf:
                    raise SettingsError(f"reshard_after_forward={raf} must divide the shard group({n})")
                # _fsdp_init.py _get_post_forward_mesh_info: a group of 1 keeps whole parameters (False), a group
                # of the shard group's size reshards fully (True)
                raf = False if raf == 1 else True if raf == n else raf
            root = cb * g.root
            sizes = g.block_numels or (0,)
            nblocks = len(g.block_numels)
            # blocks by position (a model's blocks may differ: dense then MoE): the last, the one before it,
            # the one before that; the first and the second
            last, prev = sizes[-1], (sizes[-2] if nblocks >= 2 else 0)
            prev2 = sizes[-3] if nblocks >= 3 else 0
            first, second = sizes[0], (sizes[1] if nblocks >= 2 else 0)
            gb, rb = rc.grad_bytes, rc.reduced_grad_bytes
            head_grads = gb * g.root_head  # from the head's backward to the root's reduce
            # all-gathers with more than one rank go through a flat output buffer. In forward the output is kept
            # (FSDPCommContext.all_gather_state) until the next block's wait_for_unshard returns: the local
            # `prev_all_gather_state` holds it through that block's copy-out, so at a copy-out three are live:
            # the previous output, this one and its copies; the last one is held to the root's post-forward, so
            # through the loss. In backward a block's output is freed right after its own copy-out.
            # (_fsdp_param_group.py wait_for_unshard; measured: MoE blocks, session 5, docs/accuracy.md)
            flat = n > 1
            ag_held = cb * last if flat else 0
            # a prefetch (unshard) allocates only where there is an all-gather: with a shard group of one,
            # unshard() records an empty result and wait_for_unshard() allocates and copies when the block runs
            # (_fsdp_param_group.py, world_size == 1; measured, session 7: gpt2 at 1 rank was +5.35%)
            pf = 1 if flat else 0
            # foreach_reduce copies the unsharded grads into the reduce-scatter input with torch._chunk_cat; CUDA
            # has a fused kernel, the CPU composite pads each grad into a temporary in the grad dtype first
            # (measured: DeepSeek's 9,437,184-element expert weight, an 18,874,368-byte temporary, session 5)
            # (only when the reduce dtype differs: an fp32 grad is copied straight into the fp32 input; measured
            # with mixtral's fp32 recipe)
            cpu_chunk = s.cluster.device == "cpu" and gb != rb
            chunk_tmp = gb * g.largest_tensor if cpu_chunk else 0
            root_chunk_tmp = gb * g.root_largest_tensor if cpu_chunk else 0
            if raf is False:
                kept = cb * g.total_blocks  # every block stays unsharded until its backward
                share_last = share_prev = 0
                gather_fwd_end = root + kept + ag_held
                gather_loss = root + kept
                # inside the last block's backward: all blocks unsharded
                inside_last = root + head_grads + kept
                # the last block: all blocks unsharded and its grads; then (resharded) its reduce-scatter input
                gather_bwd = root + head_grads + kept + gb * last + max(0, rb - cb) * last + chunk_tmp
                # the block before it: one block fewer unsharded, the last block's reduce-scatter input
                inside_two = root + head_grads + kept - cb * last + rb * last
                # the last block's copy-out in forward: every block before it unsharded and its all-gather output
                fwd_last = root + kept + cb * (prev + last) if flat else 0
                unshard_last = unshard_prev = 0  # nothing is gathered in backward
            else:
                if raf is True:
                    kept = share_last = share_prev = 0
                else:
                    # every block keeps a 1/raf share after forward (to_sharded_post_forward clones it); a block's
                    # share is freed when backward unshards it, after the copy-out (_fsdp_param.py to_unsharded)
                    kept = cb * layouts.ceil_sum(g.block_numels, raf)
                    share_last, share_prev = cb * ceil_div(last, raf), cb * ceil_div(prev, raf)
                gather_fwd_end = root + kept + ag_held
                # the loss backward: the root's pre-backward has prefetched the last block's all-gather
                gather_loss = root + pf * cb * last + kept
                prefetched = pf * cb * prev
                # the last block's copy-out in forward: the previous block's all-gather output, its own, its copies
                fwd_last = root + kept - share_last + cb * (prev + 2 * last) if flat else 0
                # the last block's copy-out in backward (its all-gather prefetched at the loss): output and copies
                unshard_last = root + head_grads + kept + (2 if flat else 1) * cb * last
                # inside the last block's backward: itself, the next block prefetched by its pre-backward
                inside_last = root + head_grads + kept - share_last + prefetched + cb * last
                # the last block at the end of its backward: that, and its grads; then resharded, its
                # reduce-scatter input
                gather_bwd = (root + head_grads + kept - share_last + prefetched + gb * last + max(cb, rb) * last
                              + chunk_tmp)
                # the block before it, copied out of its prefetched all-gather: the last block's reduce-scatter
                # input still held (reduce_scatter_max_input_buffers = 1) and the next block prefetched after
                unshard_prev = (root + head_grads + kept - share_last + (2 if flat else 1) * cb * prev
                                + rb * last)
                # inside the block before it: itself, the next prefetched (if any), the last block's input
                inside_two = (root + head_grads + kept - share_last - share_prev + cb * (prev + pf * prev2)
                              + rb * last)
            # the first block's copy-out in forward: the root's all-gather output is held through it (the root
            # stays unsharded: fully_shard's default for the root), with block 0's output and copies
            fwd_first = root + (root if flat else 0) + (2 if flat else 1) * cb * first
            bwd_moments.append((fwd_first, 0, -3))
            if nblocks >= 2:
                bwd_moments.append((fwd_last, 0, -7))
            # inside the last block's forward: its copies and its all-gather output (held to the root's
            # post-forward); with raf False every block before it unsharded too
            bwd_moments.append((root + kept - share_last + (cb * last if flat else 0)
                                + (cb * last if raf is not False else 0), 0, -8))
            if unshard_last:
                bwd_moments.append((unshard_last, 0, -5))
            # the last block's reduce: its activations and the loss's gone, as when the next block's begins
            bwd_moments.append((gather_bwd, 0, -6))
            gather_bwd = 0
            # inside a block's backward its unsharded grads grow while its activations are freed: the profile
            # follows both (block_moments); the grads are counted at the unsharded grad dtype
            bwd_moments.append((inside_last, 0, 0))
            if nblocks >= 2:
                # and the last block's reduced grad shard
                last_shard = rc.reduced_grad_bytes * ceil_div(last, n)
                if unshard_prev:
                    bwd_moments.append((unshard_prev, last_shard, -6))
                bwd_moments.append((inside_two + gb * prev, last_shard, -9))  # the block before, grads complete
                if chunk_tmp:
                    # then resharded, the last block's input freed, its own input filled: the CPU temporary
                    # (SHARD_GRAD_OP: both blocks resharded after their backward, the rest still unsharded;
                    # measured, session 7: llama-3-8b fsdp-bf16 was +1.25..+2.86% counting them unsharded)
                    after_two = (kept - cb * (last + prev) if raf is False
                                 else kept - share_last - share_prev + pf * cb * prev2)
                    bwd_moments.append((root + head_grads + after_two + (gb + rb) * prev + chunk_tmp, last_shard,
                                        -9))
                bwd_moments.append((inside_two, last_shard, 1))
            # backward's end, the larger of: the first block at the end of its backward (itself, its grads, the
            # next block's reduce-scatter input; the reduced shards of all blocks but it and the root), and the
            # root's reduce (its grads, and either its unsharded params with the first block's reduce-scatter
            # input or, resharded, its own reduce-scatter input; every block's shard reduced)
            shard = rc.reduced_grad_bytes
            first_block = (root + head_grads + (cb + gb) * first
                           + (rb * second if nblocks >= 2 else max(0, rb - cb) * first),
                           shard * (ceil_div(g.root, n) + ceil_div(first, n)))
            # then resharded, its own reduce-scatter input filled (on CPU through the chunk_cat temporary)
            first_fill = (root + head_grads + (gb + rb) * first + chunk_tmp, first_block[1])
            root_reduce = (gb * g.root + max(root + rb * first, rb * g.root) + root_chunk_tmp,
                           shard * ceil_div(g.root, n))
            gather_end = 0
            fsdp_end = max(first_block, first_fill, root_reduce, key=lambda m: m[0] - m[1])
            # inside the first block's backward: itself unsharded, the second block's reduce-scatter input
            bwd_moments.append((root + head_grads + cb * first + (rb * second if nblocks >= 2 else 0),
                                grads_end - first_block[1], 2))
            a["reshard_after_forward"] = raf
        a["largest_gathered_block_numel"] = g.largest_block
    elif st.framework == "torch-ddp" and not fsdp_offload:
        # DDP (and DDP + ZeroRedundancyOptimizer): every parameter's grad is allocated by autograd when produced
        # and kept to the step (the Reducer copies buckets back into them), so inside a block's backward the
        # grads of everything after it exist: the head's inside the last block, all but the embedding's and the
        # first block's inside the first block
        bwd_moments += _unreduced_grad_moments(layouts.gather_sizes(inv, st.layout, n), rc.grad_bytes, psi)

    # ---- optimizer step transients ----
    impl = optimizer_impl(s)
    scratch = 0
    if not (ds_offload_opt or fsdp_offload):
        state_dtype_numel = lay.optimizer_numel if impl == "foreach" else (
            lay.single_step_scratch if impl == "single-tensor" else 0)
        scratch = rc.state_bytes * state_dtype_numel
    scratch = max(scratch, offload_step_scratch)
    # DeepSpeed (and ZeRO-1/2 here): the bf16 grads are copied into an fp32 partition for the step
    # (single_partition_of_fp32_groups[i].grad), after which the bf16 grads are freed.
    step_grads = grads_end
    if master_bytes and not st.fp32_grad_accumulation and not ds_offload_opt:
        step_grads = rc.reduced_grad_bytes * opt_numel + grads_persist
    step_buffers = buf_persist + scratch
    if st.shard_params and st.framework == "deepspeed" and master_bytes and not st.fp32_grad_accumulation \
            and not ds_offload_opt:
        # ZeRO-3's step (deepspeed/runtime/zero/stage3.py step, 0.19.8) works one sub-group at a time
        # (_create_fp16_sub_groups: parameters in order until sub_group_size elements are reached):
        # _prepare_fp32_grad_for_sub_group flattens the sub-group's gradients into a copy in the grad dtype and
        # casts it to fp32 beside grad_partitions_flat_buffer; the copy is freed, the optimizer steps on the fp32
        # grad, and _release_sub_group drops it. Measured on the H100 (bench/gpu, ZeRO-3 at 1 rank): olmoe 2 blocks
        # one sub-group of 1.045 B elements, +2.09 GB copy +4.18 GB fp32 at the peak; qwen2.5-7b 4 blocks two
        # sub-groups, the larger 1.01 B elements (+2.02 GB, +4.04 GB).
        sg = _largest_sub_group(inv, n, s.ds.sub_group_size)
        step_grads = grads_persist + rc.reduced_grad_bytes * sg
        sg_scratch = rc.state_bytes * sg if impl == "foreach" else (
            scratch * sg // max(opt_numel, 1) if impl == "single-tensor" else 0)
        # the flat copy beside its fp32 cast (the cast is the copy itself when the grads are fp32)
        flat = rc.grad_bytes * sg if rc.grad_bytes != rc.reduced_grad_bytes else 0
        step_buffers = buf_persist + max(flat, sg_scratch)
        a["zero3_largest_sub_group_numel"] = sg
    if st.ds_ipg_buckets and st.zero_stage in (1, 2) and master_bytes and not st.fp32_grad_accumulation \
            and not ds_offload_opt:
        # ZeRO-1/2's step (deepspeed/runtime/zero/stage_1_and_2.py step, 0.19.8): the partition's gradients
        # (averaged_gradients: views of the grads of params_in_partition, the others freed just before) are
        # flattened into a copy in the grad dtype (flatten_dense_tensors_aligned, padded to the partition) and
        # cast to fp32 (single_grad_partition); only then are the copy and the grads freed and the optimizer
        # run. Measured on the H100: mixtral-8x7b with one block under ZeRO-2 peaks there, a 6.85 GB fp32
        # partition beside the 3.43 GB flat copy and the 3.43 GB grads (-11.9% without this moment).
        # (grads already fp32, as under torch.autocast: the cast returns the flat copy itself)
        cast = rc.reduced_grad_bytes * opt_numel if rc.grad_bytes != rc.reduced_grad_bytes else 0
        flat_grads = rc.grad_bytes * lay.partition_params_numel + cast
        flat_buffers = buf_persist + rc.grad_bytes * opt_numel
        if flat_grads + flat_buffers > step_grads + step_buffers:
            step_grads, step_buffers = flat_grads, flat_buffers
    a["optimizer_impl"] = impl

    # ---- activations: the profile for one micro-batch; the terms follow the micro-batch exactly ----
    prof = s.activation_profile
    if prof is None:
        gated = bool(inv.dims.get("gated_mlp", 1))
        prof = act.cached_profile(tuple(sorted(inv.dims.items())), 1, s.seq_len, rc.compute_bytes,
                                  rc.residual_bytes, s.attention, s.recompute, gated)
    a["activations"] = prof.source
    # torch-amp: autocast's bf16 copies of the fp32 weights are saved for backward by every matmul (the traced
    # profile measures them; the analytic one does not).
    amp_copies = 0
    if rc.autocast_weight_copies and not prof.includes_autocast_copies:
        amp_copies = rc.compute_bytes * lay.matmul_numel

    # Per phase, everything but activations:
    #   forward:        the end of forward, loss included
    #   backward-start: the loss backward; every activation alive, plus the loss's backward transients
    #   backward:       the last block's grads complete and being reduced: its own activations freed, the loss
    #                   freed; gathered blocks, the block's unsharded grads and reduce buffers
    #   backward-end:   every gradient produced, the root's reduce
    #   optimizer-step: the step's scratch
    end_grads, end_buffers = max(grads_end, grads_persist), max(gather_bwd, gather_end) + zero1_epilogue
    if fsdp_end is not None:
        end_buffers, end_grads = fsdp_end[0], max(grads_end - fsdp_end[1], grads_persist)
    grads = (grads_persist, grads_persist, grads_persist, end_grads, step_grads)
    buffers = (buf_persist + gather_fwd_end + amp_copies,
               buf_persist + gather_loss + amp_copies,
               buf_persist + buf_bwd + max(gather_turn, gather_bwd) + amp_copies,
               buf_persist + buf_bwd + end_buffers,
               step_buffers)
    states_total = weights + master + states
    comms = 0
    if c.device == "cuda":
        comms = (1 + (1 if st.shard_within_node else 0) + (1 if s.ds.hpz_partition_size > 1 else 0)) \
            if c.gpus > 1 else 0
        a["nccl_communicators"] = comms
    moments = []
    for m_buffers, m_grads, kind in bwd_moments:
        if kind == -10:
            m_buffers += gather_loss - buf_bwd
        m_buffers += buf_persist + buf_bwd + amp_copies
        m_grads = max(m_grads, grads_persist)  # grads kept across micro-steps include those of the moment
        moments.append((m_grads, m_buffers, states_total + m_grads + m_buffers, kind))
    f = _Fixed(weights, master, states, grads, buffers,
               tuple(states_total + g + b for g, b in zip(grads, buffers)), prof, host * c.ranks_per_node, n,
               weights + master + states + grads_persist + buf_persist, comms, a, tuple(moments),
               rc.grad_bytes, {k: v for k, v in host_by.items() if v})
    f.grads_held = zero3_blocks
    f.hook_transient = hook_transient
    return f


def _unreduced_grad_moments(g: Any, grad_bytes: int, psi: int) -> list[tuple[int, int, int]]:
    """Block moments where every gradient stays as autograd made it until after backward (DDP; ZeRO-1 without
    overlap_comm): inside the last block the head's grads exist, inside the first all but the embedding's and
    the first block's (each block's own grads are added by the profile's block moments)."""
    if not g.block_numels:
        return []
    return [(0, grad_bytes * g.root_head, 0),
            (0, grad_bytes * (psi - (g.root - g.root_head) - g.block_numels[0]), 2)]


def _fsdp1_buffers(s: Settings, g: Any, n: int, cb: int, grads_end: int, moments: list[tuple[int, int, int]],
                   a: dict[str, Any]) -> tuple[int, int, int, tuple[int, int]]:
    """FSDP1 (FullyShardedDataParallel, one FlatParameter per wrapped block and one for the root,
    use_orig_params=False; torch/distributed/fsdp/_flat_param.py and _runtime_utils.py, torch 2.13), per rank.

    Returns (gathered at forward's end, at the loss, after the last block's post-backward, backward's end as
    (buffers, grads not yet reduced)) and appends the step's further moments to ``moments``.
    - Unshard: with a low-precision param_dtype, the fp32 shard is first cast into a shard-sized _mp_shard;
      the all-gather writes straight into the block's padded unsharded flat buffer (no separate output, no
      copy-out), then the _mp_shard is freed. One buffer per block: B elements at the unshard dtype.
    - Forward: the root is not resharded after forward (_post_forward_reshard skips the root); FULL_SHARD
      reshards each block in its post-forward, SHARD_GRAD_OP keeps it until its backward. Without
      forward_prefetch one block is gathered at a time.
    - Backward (BACKWARD_PRE): a block's pre-backward unshards it (prefetched at the previous one) and
      prefetches the next; the root's pre-backward prefetches the last block.
    - Grads: the parameters are split() views of the flat parameter; their grads live apart until the split's
      backward concatenates them into the flat grad (both exist for that moment), then the post-backward hook
      reshards, casts the flat grad to reduce_dtype (a new tensor) and reduce-scatters it into a new shard. The
      root's views take grads from the head's backward on; the root is reduced after the embedding's backward.
    """
    st, rc = s.strategy, s.recipe
    raf = s.torch.reshard_after_forward
    raf = st.reshard_after_forward if raf is None else raf
    if not isinstance(raf, bool):
        raise SettingsError("FSDP1 takes reshard_after_forward true (FULL_SHARD) or false (SHARD_GRAD_OP), "
                            f"not a group size ({raf}); group sizes are FSDP2's")
    if not st.shard_params:
        raf = False
    root = cb * g.root
    sizes = g.block_numels or (0,)
    nblocks = len(g.block_numels)
    last, prev = sizes[-1], (sizes[-2] if nblocks >= 2 else 0)
    prev2 = sizes[-3] if nblocks >= 3 else 0
    first = sizes[0]
    gb, rb = rc.grad_bytes, rc.reduced_grad_bytes
    cast = rb if rb != gb else 0  # _reduce_grad's .to(reduce_dtype) copy
    lowp = cb != rc.param_bytes  # MixedPrecision param_dtype differs from the sharded parameters' dtype
    mp = (lambda numel: cb * ceil_div(numel, n)) if lowp else (lambda numel: 0)  # noqa: E731
    head_grads = gb * g.root_head
    kept = cb * g.total_blocks if raf is False else 0
    shard = rc.reduced_grad_bytes
    last_shard = shard * ceil_div(last, n)
    gather_fwd_end = root + kept
    gather_loss = root + (kept if raf is False else cb * last)  # the root prefetches the last block
    # forward: the root's unshard, the first block's, the last block's (everything before it saved)
    moments.append((root + mp(g.root), 0, -3))
    moments.append((root + cb * first + mp(first) + (kept - cb * first if raf is False else 0), 0, -3))
    if nblocks >= 2:
        moments.append((root + (kept if raf is False else cb * last) + mp(last), 0, -7))
    # inside the last block's forward (its activations and temporaries): it is gathered
    moments.append((root + (kept if raf is False else cb * last), 0, -8))
    if raf is False:
        inside_last = root + head_grads + kept
        after_last = root + head_grads + kept - cb * last  # resharded in its post-backward
        inside_two = after_last
    else:
        prefetched = cb * prev
        # the last block's pre-backward: itself, and the prefetch of the next with its _mp_shard
        moments.append((root + head_grads + cb * last + prefetched + mp(prev), 0, -5))
        inside_last = root + head_grads + cb * last + prefetched
        after_last = root + head_grads + prefetched
        inside_two = root + head_grads + cb * (prev + prev2)
    # inside the last block's backward (its grads from the profile), the split's concatenation, the cast
    moments.append((inside_last, 0, 0))
    # the end of its backward: the loss and its own activations gone, as when the next block's backward begins
    moments.append((max(inside_last + 2 * gb * last, after_last + (gb + cast) * last + rb * ceil_div(last, n)),
                    0, -6))
    if nblocks >= 2:
        moments.append((inside_two, last_shard, 1))
        # the block before the last, its grads complete: concatenation, then (resharded) the cast
        two_end = max(inside_two + 2 * gb * prev,
                      inside_two - cb * prev + (gb + cast) * prev + rb * ceil_div(prev, n))
        moments.append((two_end, last_shard, -9))
    # the first block: inside its backward, then its grads complete; the root's reduce at the end
    not_reduced = shard * (ceil_div(g.root, n) + ceil_div(first, n))
    first_in = root + head_grads + cb * first
    moments.append((first_in, grads_end - not_reduced, 2))
    first_end = (max(first_in + 2 * gb * first,
                     first_in - cb * first + (gb + cast) * first + rb * ceil_div(first, n)), not_reduced)
    # the root: its views' grads concatenated, the root resharded, the cast and the new shard
    root_end = (max(root + 2 * gb * g.root, (gb + cast) * g.root + rb * ceil_div(g.root, n)),
                shard * ceil_div(g.root, n))
    a["reshard_after_forward"] = raf
    moments.append((after_last + rb * ceil_div(last, n), 0, -6))  # its new shard reduced
    return gather_fwd_end, gather_loss, 0, max(first_end, root_end, key=lambda m: m[0] - m[1])


class _Fixed:
    """The micro-batch-independent part of a Plan (see _fixed)."""

    __slots__ = ("weights", "master", "states", "grads", "buffers", "non_activation", "profile", "host_per_node",
                 "shard_group", "between", "comms", "assumptions", "moments", "grad_width", "_blocks", "host_detail",
                 "grads_held", "hook_transient", "kinds")

    def __init__(self, weights: int, master: int, states: int, grads: tuple[int, ...], buffers: tuple[int, ...],
                 non_activation: tuple[int, ...], profile: Any, host_per_node: int, shard_group: int, between: int,
                 comms: int, assumptions: dict[str, Any], moments: tuple[tuple[int, int, int, int], ...] = (),
                 grad_width: int = 2, host_detail: dict[str, int] | None = None) -> None:
        #: per rank, by category: the bytes offload keeps in host memory (their sum x ranks per node is
        #: host_per_node)
        self.host_detail = host_detail or {}
        #: further backward moments (grads, buffers, non-activation total, activations kind): kind -1 counts
        #: everything saved but one block; kind k >= 0 is inside a block's backward (profile.block_moments:
        #: 0 the last block, 1 the one before it, 2 the first block), the block's own grads at ``grad_width``
        #: bytes added. The "backward" phase is
        #: the largest of these and the base moment.
        self.moments, self.grad_width = moments, grad_width
        #: the block moments count only the gradients whose hook has not taken them yet (ZeRO-3)
        self.grads_held = False
        #: (bytes per partition element, partitions) a parameter's gradient hook allocates (the -11 moment)
        self.hook_transient = (0, 1)
        self._blocks = any(m[3] >= 0 for m in moments)
        self.kinds = tuple(sorted({m[3] for m in moments}))
        self.weights, self.master, self.states, self.grads, self.buffers = weights, master, states, grads, buffers
        self.non_activation, self.profile, self.host_per_node = non_activation, profile, host_per_node
        self.shard_group, self.between, self.comms, self.assumptions = shard_group, between, comms, assumptions


PHASE_NAMES = ("forward", "backward-start", "backward", "backward-end", "optimizer-step")


def _phases(f: _Fixed, recompute: str, micro_batch: int) -> list[tuple[int, int, int]]:
    """(grads, activations, buffers) per phase at ``micro_batch``."""
    fwd, bwd, saved, emb, block = f.profile.terms(recompute, micro_batch)
    out = [(g, x, b) for g, x, b in zip(f.grads, (fwd, bwd, saved, emb, 0), f.buffers)]
    moments = _moments(f, micro_batch, saved, block, emb, fwd)
    best = {0: f.non_activation[0] + fwd, 1: -1 if _loss_covered(f, moments) else f.non_activation[1] + bwd,
            2: f.non_activation[2] + saved}
    for (grads, buffers, total, kind), x, gx in moments:
        phase = 0 if kind in FORWARD_MOMENTS else 1 if kind == LOSS_MOMENT else 2
        if total + x + gx > best[phase]:
            best[phase], out[phase] = total + x + gx, (grads + gx, x, buffers)
    return out


#: moment kinds that fall in the forward (an all-gather's copy-out, inside the last block's forward)
FORWARD_MOMENTS = (-3, -7, -8)
#: the loss's and the head's backward (profile.loss_moment): the backward-start phase
LOSS_MOMENT = -10


def _loss_covered(f: _Fixed, moments: Any) -> bool:
    """Whether the backward-start phase is the loss moment alone. The profile's backward-start term is the
    most alive anywhere in backward, which with recomputation falls inside a block's backward; paired with what
    is held at the loss (ZeRO-3's gathered head, no bucket yet) it is a moment that never happens (measured:
    ZeRO-3 at 4 ranks, llama-3-8b, full recompute, 2.6 MB over the run at the head's backward). Where the
    strategy evaluates the blocks' own moments (with their buffers) and the profile the loss segment, those
    cover every point of that term."""
    return f._blocks and any(m[0][3] == LOSS_MOMENT for m in moments)


def _moments(f: _Fixed, micro_batch: int, saved: int, block: int, emb: int,
             fwd: int) -> list[tuple[tuple[int, int, int, int], int, int]]:
    """Each moment of f.moments the profile can evaluate at ``micro_batch``, with its activations and the
    block's own grads in bytes. ``saved`` is the profile's third term: everything saved but the last block's
    activations. Activation kinds: -4 that, -1 everything saved but the last two blocks', -2 everything saved,
    -3 the embedding's output only; read off the profile's timeline (profile.moment_activations; without one,
    the bound that contains the moment): -5 when the last block's backward begins, -6 when the one before it
    begins, -7 when the last block's forward begins, -8 the most inside the last block's forward, -9 when the
    block before the last has finished its backward (-6 less one block), -12 at the last hook of a parameter
    outside the blocks before them (the final norm's), -10 the loss's and the head's backward
    with the root's gradients so far at grad_width (profile.loss_moment), -11 at a block parameter's gradient
    hook with the hook's transient (profile.block_hooks, f.hook_transient); k >= 0 inside a block's backward
    (profile.block_moments)."""
    if not f.moments:
        return []
    vals = _kind_values_memo(f, micro_batch, saved, block, emb, fwd)
    return [(m, *vals[m[3]]) for m in f.moments if m[3] in vals]


def _kind_values_memo(f: _Fixed, micro_batch: int, saved: int, block: int, emb: int,
                      fwd: int) -> dict[int, tuple[int, int]]:
    """_kind_values, memoised on the profile (the planner asks the same micro-batches for many configurations)."""
    key = ("kinds", micro_batch, saved, block, emb, fwd, f.grad_width, f.grads_held, f.hook_transient, f.kinds)
    memo = getattr(f.profile, "_memo", None)
    vals = memo.get(key) if memo is not None else None
    if vals is None:
        vals = _kind_values(f, micro_batch, saved, block, emb, fwd)
        if memo is not None:
            memo[key] = vals
    return vals


def _kind_values(f: _Fixed, micro_batch: int, saved: int, block: int, emb: int,
                 fwd: int) -> dict[int, tuple[int, int]]:
    """kind -> (activation bytes, the moment's own grads or transient in bytes) for each kind of f.moments the
    profile can evaluate (see _moments)."""
    prof = f.profile
    blocks = prof.block_moments(micro_batch, f.grad_width, f.grads_held) if f._blocks else ()
    named = prof.moment_activations(micro_batch)
    acts = {-1: saved - block, -2: saved + block, -3: emb, -4: saved, -5: saved + block, -6: saved, -7: saved,
            -8: fwd, -9: saved - block, -12: saved + block}
    if -6 in named and -9 not in named:
        acts[-9] = named[-6] - block
    acts.update(named)
    out: dict[int, tuple[int, int]] = {}
    for kind in f.kinds:
        if kind == -10:
            head = prof.loss_moment(micro_batch, f.grad_width)
            if head is not None:
                out[kind] = (head[0], f.grad_width * head[1])
        elif kind == -11:
            per, parts = f.hook_transient
            hooks = [h for blk in prof.block_hooks(micro_batch) for h in blk]
            if hooks:
                x, numel = max(hooks, key=lambda h: h[0] + per * ceil_div(h[1], parts))
                out[kind] = (x, per * ceil_div(numel, parts))
        elif kind < 0:
            out[kind] = (acts[kind], 0)
        elif kind < len(blocks):
            x, g = blocks[kind]
            out[kind] = (x, f.grad_width * g)
    return out


def _overheads(s: Settings, f: _Fixed, peak: int, reserved: Any) -> dict[str, int]:
    """What the fit verdict adds to the allocated peak: the CUDA context, NCCL's buffers, and the caching
    allocator's segments beyond the allocated bytes (the replayed reserved peak less the allocated one), or the
    flat fragmentation percentage where it is given or the replay cannot run."""
    if s.cluster.device != "cuda":
        return {}
    o = s.overheads
    out = {"cuda_context_bytes": o.cuda_context_bytes, "nccl_bytes": f.comms * o.nccl_bytes_per_communicator}
    if o.fragmentation_percent is None and reserved is not None:
        out["allocator_bytes"] = max(reserved.peak_bytes - peak, 0)
    else:
        pct = fallback_fragmentation(s) if o.fragmentation_percent is None else o.fragmentation_percent
        out["fragmentation_bytes"] = peak * pct // 100
    return out


def _reserved(inv: ParamInventory, s: Settings, limit: int | None = None) -> tuple[Any, str | None]:
    """The caching allocator's replay for these settings, or (None, why not); ``limit``: stop once the reserved
    bytes pass it (a search only asks whether they do)."""
    if s.cluster.device != "cuda":
        return None, None
    from memplan import reserved

    why = reserved.why_not(s)
    if why is not None:
        return None, why
    return reserved.predict(inv, s, limit=limit), None


def estimate(inv: ParamInventory, s: Settings, reserved_limit: int | None = None) -> Plan:
    """The Plan for one configuration. ``reserved_limit``: the replay may stop once the reserved bytes pass it,
    and the Plan then holds a reserved peak that is only known to be above it (enough to say it does not fit)."""
    f = _fixed(inv, s)
    phases = tuple(Phase(name, weights_bytes=f.weights, master_weights_bytes=f.master, grads_bytes=g,
                         optimizer_states_bytes=f.states, activations_bytes=x, buffers_bytes=b)
                   for name, (g, x, b) in zip(PHASE_NAMES, _phases(f, s.recompute, s.micro_batch)))
    totals = [p.total_bytes for p in phases]
    peak = phases[totals.index(max(totals))]
    res, why = (_reserved(inv, s, reserved_limit) if s.overheads.fragmentation_percent is None
                else (None, "fragmentation given"))
    detail = _overheads(s, f, peak.total_bytes, res)
    return Plan(settings=s, inventory=inv, phases=phases, peak=peak, overhead_bytes=sum(detail.values()),
                overhead_detail=detail, host_bytes_per_node=f.host_per_node, host_detail=f.host_detail,
                shard_group=f.shard_group,
                between_steps_bytes=f.between, assumptions=dict(f.assumptions), reserved=res, reserved_why=why)


def required_bytes(inv: ParamInventory, s: Settings, micro_batches: Any,
                   lower_bound: bool = False, budget: int | None = None) -> list[tuple[int, int]]:
    """(peak_bytes, required_bytes) for each micro-batch, the other settings fixed: the batched evaluator.

    The micro-batch-independent part is computed once; each micro-batch then costs a few integer operations
    and gives exactly what ``estimate(inv, replace(s, micro_batch=b))`` gives (tested). Where the caching
    allocator is replayed (memplan/reserved.py) each micro-batch is an estimate; ``lower_bound`` leaves the
    allocator's term out instead (the reserved peak is never below the allocated one), the fast bound a search
    narrows with before it replays; ``budget``: a replay may stop once the required bytes pass it (the
    figure returned is then only known to be above it).
    """
    f = _fixed(inv, s)
    base, prof, rec = f.non_activation, f.profile, s.recompute
    o = s.overheads
    fixed_over = (o.cuda_context_bytes + f.comms * o.nccl_bytes_per_communicator) if s.cluster.device == "cuda" else 0
    frag = 0
    if s.cluster.device == "cuda":
        if o.fragmentation_percent is not None:
            frag = o.fragmentation_percent
        elif lower_bound:
            from memplan.reserved import why_not

            frag = 0 if why_not(s) is None else fallback_fragmentation(s)
        else:
            from memplan.reserved import why_not

            if why_not(s) is None:  # the replay, one micro-batch at a time
                limit = None if budget is None else budget - fixed_over
                return [(p, r) for p, r in ((e.peak_bytes, e.required_bytes) for e in
                                            (estimate(inv, replace(s, micro_batch=b), limit)
                                             for b in micro_batches))]
            frag = fallback_fragmentation(s)
    # a moment's activations depend only on its kind: keep the largest non-activation total per kind
    best: dict[int, int] = {}
    for m in f.moments:
        if m[2] > best.get(m[3], -1):
            best[m[3]] = m[2]
    out = []
    for b in micro_batches:
        fwd, bwd, saved, emb, block = prof.terms(rec, b)
        vals = _kind_values_memo(f, b, saved, block, emb, fwd) if best else {}
        # as _phases: the loss moment replaces the backward-start term where the blocks' moments are evaluated
        start = -1 if f._blocks and LOSS_MOMENT in vals else base[1] + bwd
        peak = max(base[0] + fwd, start, base[2] + saved, base[3] + emb, base[4])
        for kind, (x, gx) in vals.items():
            peak = max(peak, best[kind] + x + gx)
        out.append((peak, peak + fixed_over + peak * frag // 100))
    return out


def host_fits(inv: ParamInventory, s: Settings) -> bool | None:
    """The host verdict alone (no activations, no replay): whether a node's RAM holds the offloaded states."""
    from types import SimpleNamespace

    from memplan.host import host_report

    f = _fixed(inv, s)
    rep = host_report(SimpleNamespace(settings=s, inventory=inv, host_detail=f.host_detail, shard_group=f.shard_group))
    return None if rep is None else rep["fits"]
