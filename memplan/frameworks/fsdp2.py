"""FSDP2, torch.distributed.fsdp.fully_shard (torch/distributed/fsdp/_fully_shard, torch 2.13), and its NO_SHARD
and HSDP rows: the root kept unsharded, each block's all-gather output, copies and prefetch, the reduce-scatter
input, and the reshard after forward (True, False or a group size)."""

from __future__ import annotations

from memplan import layouts
from memplan.errors import SettingsError
from memplan.frameworks.common import LOSS, FrameworkModel, Grads, Job
from memplan.settings import reshard_after_forward as requested_reshard_after_forward
from memplan.timeline import BufferMoment, BufferTimeline, Moment
from memplan.units import ceil_div


def reshard_after_forward(job: Job) -> bool | int:
    """reshard_after_forward as FSDP2 applies it: the strategy's default unless given; False without sharding;
    a group size of 1 keeps whole parameters (False), the shard group's size reshards fully (True)
    (_fsdp_init.py _get_post_forward_mesh_info)."""
    st, n = job.s.strategy, job.n
    raf = requested_reshard_after_forward(job.s)
    if not st.shard_params:
        return False
    if not isinstance(raf, bool):
        if raf < 1 or n % raf:
            raise SettingsError(f"reshard_after_forward={raf} must divide the shard group({n})")
        return False if raf == 1 else True if raf == n else raf
    return raf


def buffers(job: Job, grads: Grads) -> BufferTimeline:
    """Per rank, with B the largest block:
    - the root group (embeddings, final norm, head) is not resharded after forward (fully_shard's
      reshard_after_forward=None means False for the root), so it stays unsharded until its backward;
    - forward: a block's all-gather output is kept (FSDPCommContext.all_gather_state) until the next
      block's copy-out, and the last one until the root's post-forward, i.e. through the loss when the
      model computes it; so mid-forward two blocks are unsharded (copy + all-gather output);
    - backward: a block's pre-backward prefetches the next block's all-gather; its post-backward
      reshards it, frees the previous block's reduce-scatter input (reduce_scatter_max_input_buffers
      = 1), copies its unsharded grads into a reduce-dtype reduce-scatter input (foreach_reduce) and
      frees them; the head's grads (and a tied embedding's) wait for the root's reduce at the end.
    With a shard group of one (NO_SHARD) the unsharded copies have nothing to
    reshard to and stay until the block's backward. Each term was checked against the harness's
    allocator timeline (fsdp-full, 2 and 4 blocks; session 4; docs/accuracy.md).
    """
    s, rc, n = job.s, job.s.recipe, job.n
    g = job.gathers
    # FSDP2 unshards into MixedPrecisionPolicy.param_dtype (else the parameters' dtype), and autograd's unsharded
    # grads come out in that same dtype: the recipe's grad_bytes (fsdp-bf16: bf16; torch-amp, fp32: fp32, with
    # autocast making its own bf16 copies from the unsharded fp32 weights). With a shard group of one (NO_SHARD)
    # FSDP2 still copies each parameter into its unsharded buffer, in any dtype (wait_for_unshard's world_size ==
    # 1 path: alloc_storage + copy_), measured with fsdp-bf16 and torch-amp (docs/accuracy.md).
    cb = rc.grad_bytes
    grads_end = grads.end
    raf = reshard_after_forward(job)
    moments: list[BufferMoment] = [LOSS]
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
    moments.append(BufferMoment(fwd_first, 0, Moment.EMBEDDING_OUTPUT))
    if nblocks >= 2:
        moments.append(BufferMoment(fwd_last, 0, Moment.LAST_BLOCK_FORWARD_BEGINS))
    # inside the last block's forward: its copies and its all-gather output (held to the root's
    # post-forward); with raf False every block before it unsharded too
    moments.append(BufferMoment(root + kept - share_last + (cb * last if flat else 0)
                        + (cb * last if raf is not False else 0), 0, Moment.INSIDE_LAST_BLOCK_FORWARD))
    if unshard_last:
        moments.append(BufferMoment(unshard_last, 0, Moment.LAST_BLOCK_BACKWARD_BEGINS))
    # the last block's reduce: its activations and the loss's gone, as when the next block's begins
    moments.append(BufferMoment(gather_bwd, 0, Moment.PREVIOUS_BLOCK_BACKWARD_BEGINS))
    # inside a block's backward its unsharded grads grow while its activations are freed: the profile
    # follows both (block_moments); the grads are counted at the unsharded grad dtype
    moments.append(BufferMoment(inside_last, 0, Moment.INSIDE_LAST_BLOCK_BACKWARD))
    if nblocks >= 2:
        # and the last block's reduced grad shard
        last_shard = rc.reduced_grad_bytes * ceil_div(last, n)
        if unshard_prev:
            moments.append(BufferMoment(unshard_prev, last_shard, Moment.PREVIOUS_BLOCK_BACKWARD_BEGINS))
        # the block before, its grads complete
        moments.append(BufferMoment(inside_two + gb * prev, last_shard, Moment.PREVIOUS_BLOCK_BACKWARD_ENDS))
        if chunk_tmp:
            # then resharded, the last block's input freed, its own input filled: the CPU temporary
            # (SHARD_GRAD_OP: both blocks resharded after their backward, the rest still unsharded;
            # measured, session 7: llama-3-8b fsdp-bf16 was +1.25..+2.86% counting them unsharded)
            after_two = (kept - cb * (last + prev) if raf is False
                         else kept - share_last - share_prev + pf * cb * prev2)
            moments.append(BufferMoment(root + head_grads + after_two + (gb + rb) * prev + chunk_tmp, last_shard,
                                        Moment.PREVIOUS_BLOCK_BACKWARD_ENDS))
        moments.append(BufferMoment(inside_two, last_shard, Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD))
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
    fsdp_end = max(first_block, first_fill, root_reduce, key=lambda m: m[0] - m[1])
    # inside the first block's backward: itself unsharded, the second block's reduce-scatter input
    moments.append(BufferMoment(root + head_grads + cb * first + (rb * second if nblocks >= 2 else 0),
                        grads_end - first_block[1], Moment.INSIDE_FIRST_BLOCK_BACKWARD))
    return BufferTimeline(gathered_forward_end=gather_fwd_end, gathered_loss=gather_loss, end=fsdp_end,
                          moments=tuple(moments),
                          assumptions={"reshard_after_forward": raf, "largest_gathered_block_numel": g.largest_block})


MODEL = FrameworkModel(name="fsdp2", replay="memplan.frameworks.fsdp2_replay", buffers=buffers,
                       cpu_offload_policy=True)
