"""FSDP1, FullyShardedDataParallel with one FlatParameter per wrapped block and one for the root
(use_orig_params=False; torch/distributed/fsdp/_flat_param.py and _runtime_utils.py, torch 2.13)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.errors import SettingsError
from memplan.frameworks.common import LOSS, FourBitBase, FrameworkModel, Grads, Job, unreduced_grad_moments
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
    - Frozen parameters (LoRA under PEFT's units: model/wrap_units.py peft_policy): a FlatParameter that does not
      require grad gets no post-backward hook (_runtime_utils.py _register_post_backward_hook returns), only the
      reshard-only hook on its unit's inputs (_register_post_backward_reshard_only_hook): gathered as the others,
      no gradient. The gradient terms follow each block's trainable FlatParameters (its adapters, counted together).
    """
    s, n, g, grads_end = job.s, job.n, job.gathers, grads.end
    if s.torch.fsdp_wrap == "none" or wrap_units.root_only(job.inv):
        return _root_only(job, grads)
    # what gets gradients: each block's trainable FlatParameters, the root's (every parameter where none is frozen)
    tr = job.grad_gathers if job.inv.frozen else g
    tsizes = (g.trainable_block_numels or g.block_numels) or (0,)
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
    tlast, tprev = tsizes[-1], (tsizes[-2] if nblocks >= 2 else 0)
    gb, rb = rc.grad_bytes, rc.reduced_grad_bytes
    cast = rb if rb != gb else 0  # _reduce_grad's .to(reduce_dtype) copy
    lowp = cb != rc.param_bytes  # MixedPrecision param_dtype differs from the sharded parameters' dtype

    def mp(numel: int) -> int:
        return cb * ceil_div(numel, n) if lowp else 0
    head_grads = gb * tr.root_head
    kept = cb * g.total_blocks if raf is False else 0
    shard = rc.reduced_grad_bytes
    last_shard = shard * ceil_div(tlast, n)
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
        # PEFT's units: the prefetch target of a unit's pre-backward is the unit before it in post-forward order
        # (_exec_order_utils.py get_handle_to_backward_prefetch: handles_post_forward_order[index - 1]), which for a
        # block is its own last adapter; the block before is prefetched by the block's first adapter's
        # pre-backward, late in its backward (measured, 2 ranks, bf16, all-linear adapters, full recompute: the
        # block before gathered at q_proj's adapter backward, the peak in the input norm's backward with both
        # gathered). Counted gathered from the block's backward's start, as without adapters: an upper bound by the
        # activations the block frees before that point
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
    moments.append(BufferMoment(max(inside_last + 2 * gb * tlast,
                                    after_last + (gb + cast) * tlast + rb * ceil_div(tlast, n)),
                                0, Moment.PREVIOUS_BLOCK_BACKWARD_BEGINS))
    if nblocks >= 2:
        moments.append(BufferMoment(inside_two, last_shard, Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD))
        # the block before the last, its grads complete: concatenation, then (resharded) the cast
        two_end = max(inside_two + 2 * gb * tprev,
                      inside_two - cb * prev + (gb + cast) * tprev + rb * ceil_div(tprev, n))
        moments.append(BufferMoment(two_end, last_shard, Moment.PREVIOUS_BLOCK_BACKWARD_ENDS))
    if nblocks >= 4:
        # inside the second block's backward (index 1): itself and the first block unsharded (prefetched by its
        # pre-backward, BACKWARD_PRE; or kept since forward), every later block's new shard reduced, one block's
        # activations below it. Where a block's sharded gradients outweigh its activations memory grows through
        # backward and peaks here (the FSDP2 pattern, measured there: frameworks/fsdp2.py _inside_second; no FSDP1
        # harness run yet where it is the peak)
        later = shard * sum(ceil_div(x, n) for x in tsizes[2:])
        moments.append(BufferMoment(root + head_grads + cb * (sizes[0] + sizes[1]), later,
                                    Moment.INSIDE_SECOND_BLOCK_BACKWARD))
        # the second block's backward done (the first's begins): its view gradients and the split's concatenation
        # alive together beside it and the first block, then (resharded) the cast and its new shard; every later
        # block's shard reduced. Where a block's gradients outweigh its activations (recomputation, fp32
        # gradients under torch-amp) the step peaks here (found by the replay, frameworks/fsdp1_replay.py)
        s1, ts1, below = sizes[1], tsizes[1], root + head_grads + cb * sizes[0]
        moments.append(BufferMoment(max(below + cb * s1 + 2 * gb * ts1,
                                        below + (gb + cast) * ts1 + rb * ceil_div(ts1, n)),
                                    later, Moment.FIRST_BLOCK_BACKWARD_BEGINS))
    inside_first, end = _end(s, g, n, root, head_grads, grads_end, tsizes[0], tr.root)
    moments.append(inside_first)
    # the last block's new shard reduced
    moments.append(BufferMoment(after_last + rb * ceil_div(tlast, n), 0, Moment.PREVIOUS_BLOCK_BACKWARD_BEGINS))
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
    _, end = _end(s, replace(g, root=whole, block_numels=()), n, root, 0, grads.end, 0, whole)
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


def _end(s: Any, g: Any, n: int, root: int, head_grads: int, grads_end: int, tfirst: int,
         troot: int) -> tuple[BufferMoment, tuple[int, int]]:
    """The first block: inside its backward, then its grads complete; the root's reduce at the end: its views'
    grads concatenated, the root resharded, the cast and the new shard. ``tfirst``, ``troot``: the first block's
    and the root's elements that get gradients. Returns the moment inside the first block and backward's end as
    (buffers, grads not yet reduced)."""
    rc = s.recipe
    cb, gb, rb = rc.grad_bytes, rc.grad_bytes, rc.reduced_grad_bytes
    cast = rb if rb != gb else 0
    first = (g.block_numels or (0,))[0]
    not_reduced = rb * (ceil_div(troot, n) + ceil_div(tfirst, n))
    first_in = root + head_grads + cb * first
    first_end = (max(first_in + 2 * gb * tfirst,
                     first_in - cb * first + (gb + cast) * tfirst + rb * ceil_div(tfirst, n)), not_reduced)
    # the root's reduce (a frozen root is resharded only: root is its gathered copy, freed)
    root_end = (max(root + 2 * gb * troot, (gb + cast) * troot + rb * ceil_div(troot, n)),
                rb * ceil_div(troot, n))
    inside = BufferMoment(first_in, grads_end - not_reduced, Moment.INSIDE_FIRST_BLOCK_BACKWARD)
    return inside, max(first_end, root_end, key=lambda m: m[0] - m[1])


def _casts_packed(rc: Any) -> str | None:
    """A MixedPrecision param_dtype other than the stored dtype casts each unit's shard into _mp_shard before the
    all-gather (_flat_param.py _use_low_precision_shard), the packed 4-bit codes too."""
    if rc.grad_bytes == rc.param_bytes:
        return None
    return ("FSDP1's MixedPrecision(param_dtype=bf16) would cast the packed 4-bit codes as numbers before the "
            "all-gather; FSDP-QLoRA loads the model in bf16 with --quant-storage bfloat16 and the HF Trainer sets the "
            "mixed precision to that dtype (transformers/distributed/fsdp.py update_fsdp_plugin_peft): --precision "
            "pure-bf16")


MODEL = FrameworkModel(name="fsdp1", replay="memplan.frameworks.fsdp1_replay", buffers=buffers,
                       half_autocast_why_not="Accelerate's FSDP preparation upcasts a half-precision model to fp32 for its "
                                             "MixedPrecisionPolicy (fsdp2_prepare_model): the Trainer's bf16 there is "
                                             "fsdp-bf16",
                       
                       grads_at_end=grads_at_end, cpu_offload_policy=True, computes_with_views=True,
                       units=wrap_units.units_for,
                       # a unit's FlatParameter is one autograd leaf (torch/distributed/fsdp/_flat_param.py): it
                       # gets a gradient where any of its parameters is read (the others' part zeros), none where
                       # none is, and the optimizer then no state for it
                       unreached=lambda s: ("unit", "no gradient and no optimizer state where a whole unit is "
                                                    "unread; a unit's FlatParameter that holds some of them gets a "
                                                    "gradient and states for all its parameters"),
                       pinned_host=fsdp2_pinned, four_bit=FourBitBase(
                           # _flat_param.py _validate_tensors_to_flatten: one dtype per FlatParameter
                           uint8_why_not="FSDP1 flattens each unit's parameters into one FlatParameter of one dtype, "
                                         "and a uint8 storage sits beside float weights (norms, biases) in every "
                                         "block; FSDP-QLoRA packs the codes into the model's dtype: --quant-storage "
                                         "bfloat16 with --precision pure-bf16",
                           packed="which FSDP1 flattens into their block's FlatParameter and shards like the other "
                                  "frozen weights, each QuantState (absmax, code) kept whole on every GPU (Linear4bit "
                                  "restores it from the module after the all-gather: "
                                  "fix_4bit_weight_quant_state_from_module)",
                           shards_packed=True, loaded_whole=True, cast_why=_casts_packed))
