"""FSDP1, FullyShardedDataParallel with one FlatParameter per wrapped block and one for the root
(use_orig_params=False; torch/distributed/fsdp/_flat_param.py and _runtime_utils.py, torch 2.13)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.errors import SettingsError
from memplan.frameworks.common import LOSS, FrameworkModel, Grads, Job, unreduced_grad_moments
from memplan.frameworks.fsdp2 import pinned_host as fsdp2_pinned
from memplan.settings import reshard_after_forward
from memplan.timeline import BufferMoment, BufferTimeline, Moment
from memplan.model import wrap_units
from memplan.units import ceil_div


def grads_at_end(job: Job) -> int:
    """Every flat parameter's reduced grad in the reduce dtype, sharded or not (NO_SHARD all-reduces the cast
    full flat grad: measured with the harness)."""
    return job.s.recipe.reduced_grad_bytes * job.lay.optimizer_numel


def buffers(job: Job, grads: Grads) -> BufferTimeline:
    """FSDP1 (FullyShardedDataParallel, one FlatParameter per wrapped block and one for the root,
    use_orig_params=False; torch/distributed/fsdp/_flat_param.py and _runtime_utils.py, torch 2.13), per rank.

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
    s, n, g, grads_end = job.s, job.n, job.gathers, grads.end
    if s.torch.fsdp_wrap == "none" or wrap_units.root_only(job.inv):
        return _root_only(job, grads)
    rc = s.recipe
    # the unsharded flat parameters are in MixedPrecision's param_dtype, as autograd's grads are
    cb = rc.grad_bytes
    moments: list[BufferMoment] = [LOSS]
    raf = reshards_after_forward(s)
    root = cb * g.root
    sizes = g.block_numels or (0,)
    nblocks = len(g.block_numels)
    last, prev = sizes[-1], (sizes[-2] if nblocks >= 2 else 0)
    prev2 = sizes[-3] if nblocks >= 3 else 0
    first = sizes[0]
    gb, rb = rc.grad_bytes, rc.reduced_grad_bytes
    cast = rb if rb != gb else 0  # _reduce_grad's .to(reduce_dtype) copy
    lowp = cb != rc.param_bytes  # MixedPrecision param_dtype differs from the sharded parameters' dtype

    def mp(numel: int) -> int:
        return cb * ceil_div(numel, n) if lowp else 0
    head_grads = gb * g.root_head
    kept = cb * g.total_blocks if raf is False else 0
    shard = rc.reduced_grad_bytes
    last_shard = shard * ceil_div(last, n)
    gather_fwd_end = root + kept
    gather_loss = root + (kept if raf is False else cb * last)  # the root prefetches the last block
    # forward: the root's unshard, the first block's, the last block's (everything before it saved)
    moments.append(BufferMoment(root + mp(g.root), 0, Moment.EMBEDDING_OUTPUT))
    moments.append(BufferMoment(root + cb * first + mp(first) + (kept - cb * first if raf is False else 0), 0,
                                Moment.EMBEDDING_OUTPUT))
    if nblocks >= 2:
        moments.append(BufferMoment(root + (kept if raf is False else cb * last) + mp(last), 0,
                                    Moment.LAST_BLOCK_FORWARD_BEGINS))
    # inside the last block's forward (its activations and temporaries): it is gathered
    moments.append(BufferMoment(root + (kept if raf is False else cb * last), 0,
                                Moment.INSIDE_LAST_BLOCK_FORWARD))
    if raf is False:
        inside_last = root + head_grads + kept
        after_last = root + head_grads + kept - cb * last  # resharded in its post-backward
        inside_two = after_last
    else:
        prefetched = cb * prev
        # the last block's pre-backward: itself, and the prefetch of the next with its _mp_shard
        moments.append(BufferMoment(root + head_grads + cb * last + prefetched + mp(prev), 0,
                                    Moment.LAST_BLOCK_BACKWARD_BEGINS))
        inside_last = root + head_grads + cb * last + prefetched
        after_last = root + head_grads + prefetched
        inside_two = root + head_grads + cb * (prev + prev2)
    # inside the last block's backward (its grads from the profile), the split's concatenation, the cast
    moments.append(BufferMoment(inside_last, 0, Moment.INSIDE_LAST_BLOCK_BACKWARD))
    # the end of its backward: the loss and its own activations gone, as when the next block's backward begins
    moments.append(BufferMoment(max(inside_last + 2 * gb * last,
                                    after_last + (gb + cast) * last + rb * ceil_div(last, n)),
                                0, Moment.PREVIOUS_BLOCK_BACKWARD_BEGINS))
    if nblocks >= 2:
        moments.append(BufferMoment(inside_two, last_shard, Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD))
        # the block before the last, its grads complete: concatenation, then (resharded) the cast
        two_end = max(inside_two + 2 * gb * prev,
                      inside_two - cb * prev + (gb + cast) * prev + rb * ceil_div(prev, n))
        moments.append(BufferMoment(two_end, last_shard, Moment.PREVIOUS_BLOCK_BACKWARD_ENDS))
    if nblocks >= 4:
        # inside the second block's backward (index 1): itself and the first block unsharded (prefetched by its
        # pre-backward, BACKWARD_PRE; or kept since forward), every later block's new shard reduced, one block's
        # activations below it. Where a block's sharded gradients outweigh its activations memory grows through
        # backward and peaks here (the FSDP2 pattern, measured there: frameworks/fsdp2.py _inside_second; no FSDP1
        # harness run yet where it is the peak)
        later = shard * sum(ceil_div(x, n) for x in sizes[2:])
        moments.append(BufferMoment(root + head_grads + cb * (sizes[0] + sizes[1]), later,
                                    Moment.INSIDE_SECOND_BLOCK_BACKWARD))
        # the second block's backward done (the first's begins): its view gradients and the split's concatenation
        # alive together beside it and the first block, then (resharded) the cast and its new shard; every later
        # block's shard reduced. Where a block's gradients outweigh its activations (recomputation, fp32
        # gradients under torch-amp) the step peaks here (found by the replay, frameworks/fsdp1_replay.py)
        s1, below = sizes[1], root + head_grads + cb * sizes[0]
        moments.append(BufferMoment(max(below + cb * s1 + 2 * gb * s1,
                                        below + (gb + cast) * s1 + rb * ceil_div(s1, n)),
                                    later, Moment.FIRST_BLOCK_BACKWARD_BEGINS))
    inside_first, end = _end(s, g, n, root, head_grads, grads_end)
    moments.append(inside_first)
    # the last block's new shard reduced
    moments.append(BufferMoment(after_last + rb * ceil_div(last, n), 0, Moment.PREVIOUS_BLOCK_BACKWARD_BEGINS))
    return BufferTimeline(gathered_forward_end=gather_fwd_end, gathered_loss=gather_loss,
                          end=end, moments=tuple(moments),
                          assumptions={"reshard_after_forward": raf, "largest_gathered_block_numel": g.largest_block})

def _root_only(job: Job, grads: Grads) -> BufferTimeline:
    """No auto-wrap policy (--fsdp-wrap none): one FlatParameter, the root's, padded to the shard group. Its
    unshard (the _mp_shard cast beside the flat buffer) comes at the root's pre-forward and it is not resharded
    after forward (the root never is); every parameter's gradient stays a separate view gradient until the
    split's backward concatenates them into the flat gradient at backward's end (both alive), after which the
    root reshards, casts the flat gradient to reduce_dtype and reduce-scatters it into the new shard (_end's root
    reduce with the whole model as the root). Measured with the harness (docs/accuracy.md): -19.38% with the
    block-wise timeline."""
    s, n, g = job.s, job.n, job.gathers
    rc = s.recipe
    cb = gb = rc.grad_bytes
    whole = job.lay.shard_numel * n  # the flat parameter, padded
    root = cb * whole
    mp = cb * job.lay.shard_numel if cb != rc.param_bytes else 0
    moments = [LOSS, BufferMoment(root + mp, 0, Moment.EMBEDDING_OUTPUT),
               BufferMoment(root, 0, Moment.INSIDE_LAST_BLOCK_FORWARD)]
    # inside the blocks' backward: every view gradient made so far (the head's, the later blocks')
    moments += [BufferMoment(root, m.grads, m.at) for m in unreduced_grad_moments(g, gb, job.psi)]
    if len(g.block_numels) >= 2:
        moments.append(BufferMoment(root, gb * (g.root_head + g.grad_block_numels[-1]),
                                    Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD))
    _, end = _end(s, replace(g, root=whole, block_numels=()), n, root, 0, grads.end)
    return BufferTimeline(gathered_forward_end=root, gathered_loss=root, end=end, moments=tuple(moments),
                          assumptions={"reshard_after_forward": False, "fsdp_wrap": job.s.torch.fsdp_wrap,
                                       "largest_gathered_block_numel": whole})


def reshards_after_forward(s: Any) -> bool:
    """FULL_SHARD (True) or SHARD_GRAD_OP (False); NO_SHARD keeps every block whole."""
    raf = reshard_after_forward(s)
    if not isinstance(raf, bool):
        raise SettingsError("FSDP1 takes reshard_after_forward true (FULL_SHARD) or false (SHARD_GRAD_OP), "
                            f"not a group size ({raf}); group sizes are FSDP2's")
    return raf if s.strategy.shard_params else False


def _end(s: Any, g: Any, n: int, root: int, head_grads: int, grads_end: int) -> tuple[BufferMoment, tuple[int, int]]:
    """The first block: inside its backward, then its grads complete; the root's reduce at the end: its views'
    grads concatenated, the root resharded, the cast and the new shard. Returns the moment inside the first
    block and backward's end as (buffers, grads not yet reduced)."""
    rc = s.recipe
    cb, gb, rb = rc.grad_bytes, rc.grad_bytes, rc.reduced_grad_bytes
    cast = rb if rb != gb else 0
    first = (g.block_numels or (0,))[0]
    not_reduced = rb * (ceil_div(g.root, n) + ceil_div(first, n))
    first_in = root + head_grads + cb * first
    first_end = (max(first_in + 2 * gb * first,
                     first_in - cb * first + (gb + cast) * first + rb * ceil_div(first, n)), not_reduced)
    root_end = (max(root + 2 * gb * g.root, (gb + cast) * g.root + rb * ceil_div(g.root, n)),
                rb * ceil_div(g.root, n))
    inside = BufferMoment(first_in, grads_end - not_reduced, Moment.INSIDE_FIRST_BLOCK_BACKWARD)
    return inside, max(first_end, root_end, key=lambda m: m[0] - m[1])


MODEL = FrameworkModel(name="fsdp1", replay="memplan.frameworks.fsdp1_replay", buffers=buffers,
                       half_autocast_why_not="Accelerate's FSDP preparation upcasts a half-precision model to fp32 for its "
                                             "MixedPrecisionPolicy (fsdp2_prepare_model): the Trainer's bf16 there is "
                                             "fsdp-bf16",
                       
                       grads_at_end=grads_at_end, cpu_offload_policy=True, computes_with_views=True,
                       units=wrap_units.units_for,
                       # with use_orig_params=True a FlatParameter mixes frozen and trainable parameters and its
                       # gradient covers all of them (frozen parts zero-filled): not modelled
                       frozen_why_not="FSDP1 with frozen parameters (use_orig_params=True FlatParameters) is not "
                                      "modelled; --fsdp-version 2 (fully_shard) is",
                       pinned_host=fsdp2_pinned)
