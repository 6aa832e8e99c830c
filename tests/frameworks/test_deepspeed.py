"""DeepSpeed ZeRO-0 to 3: the ZeRO paper's identities, flat-buffer padding, the stage 3 parameter coordinator, offload, ZeRO++ and the start-of-step states real DeepSpeed holds."""

import pytest
from toy import DIMS, PSI, TOY, make_inv, model_states, settings

from memplan import accounting as A
from memplan import layouts
from memplan.frameworks.zero3 import zero3_schedule
from memplan.model.inventory import ParamInventory, ParamTensor, classify
from memplan.request import JobRequest
from memplan.strategies import get_strategy
from memplan.timeline import Moment

M = Moment


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zero_paper_identities(n):
    # Rajbhandari et al. 2020, Figure 1: mixed-precision Adam, K = 12.
    assert model_states(A.estimate(TOY, settings("zero1", n))) == 4 * PSI + 12 * PSI // n
    assert model_states(A.estimate(TOY, settings("zero2", n))) == 2 * PSI + 14 * PSI // n
    assert model_states(A.estimate(TOY, settings("zero3", n))) == 16 * PSI // n


def test_ddp_identity_with_ds_recipe_at_one_gpu():
    assert model_states(A.estimate(TOY, settings("zero1", 1))) == 16 * PSI


def test_deepspeed_flat_padding():
    inv = make_inv({"": [(7,)], "layers.0": [(1001, 3)]})  # 3010 params
    plan = A.estimate(inv, settings("zero1", 4))
    padded = 3016  # round_up(3010, 2 * 4): nccl_start_alignment_factor 2 * dp_size
    assert plan.peak.master_weights_bytes == 4 * padded // 4
    assert plan.peak.optimizer_states_bytes == 8 * padded // 4
    assert plan.peak.weights_bytes == 2 * padded


def test_zero3_per_param_partition_and_persistence():
    inv = make_inv({"": [(5,)], "layers.0": [(1001, 3)], "layers.1": [(10, 10)]})
    plan = A.estimate(inv, settings("zero3", 4, ds={"param_persistence_threshold": 100}))
    part = 2 + 751 + 25  # ceil(5/4) + ceil(3003/4) + ceil(100/4)
    persistent = 5 + 100  # numel <= threshold stay gathered on every rank
    assert plan.peak.weights_bytes == 2 * (part + persistent)
    assert plan.peak.optimizer_states_bytes == 8 * part
    assert plan.peak.master_weights_bytes == 4 * part


def test_hpz_secondary_partition():
    base = A.estimate(TOY, settings("zero3", 8))
    hpz = A.estimate(TOY, settings("zero3", 8, ds={"param_persistence_threshold": 0, "hpz_partition_size": 4}))
    assert hpz.peak.weights_bytes - base.peak.weights_bytes == 2 * PSI // 4


# Real DeepSpeed 0.19.8 on CPU (gloo), 8 bias-free 1024x1024 Linear layers, bf16, AdamW, small buckets:
# bytes per parameter at the start of the step (../shared/reference/anchors.md, measured at the allocator).
DS_START_OF_STEP = {(1, 1): 14, (1, 2): 8, (1, 4): 5, (2, 1): 14, (2, 4): 5, (3, 1): 16, (3, 4): 4}


@pytest.mark.parametrize("stage,n", sorted(DS_START_OF_STEP))
def test_model_states_match_real_deepspeed_start_of_step(stage, n):
    inv = make_inv({f"layers.{i}": [(1024, 1024)] for i in range(8)})
    s = settings(f"zero{stage}", n, ds={"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000,
                                         "prefetch_bucket_size": 10_000, "max_live_parameters": 100_000,
                                         "param_persistence_threshold": 0, "overlap_comm": False})
    fwd = A.estimate(inv, s).phases[0]
    states = fwd.weights_bytes + fwd.master_weights_bytes + fwd.grads_bytes + fwd.optimizer_states_bytes
    assert states == DS_START_OF_STEP[(stage, n)] * inv.num_params


def test_zero3_schedule_replays_the_parameter_coordinator():
    # TOY: root w0 (8 x 1024) then four blocks of one 1024 x 1024 weight each; modules run w0, L0..L3, then back
    M, r = 1024 * 1024, 8 * 1024
    # no prefetch, no reuse: one module gathered at a time
    z = zero3_schedule(TOY, 2, 0, 10**9, 0, 0)
    assert (z.forward, z.forward_end, z.loss, z.backward) == (M, M, M, M)
    # no prefetch, everything reused within the distance: forward keeps all; backward frees block by block
    z = zero3_schedule(TOY, 2, 0, 10**9, 10**9, 0)
    assert (z.forward, z.forward_end, z.loss) == (4 * M + r,) * 3 and z.end == 3 * M + r
    # one prefetch of everything at the first module: the flat all-gather buffer lives until its last member is
    # fetched, next to the copies made at the first wait; the prefetcher saw every later use, so nothing is
    # released in forward even at reuse distance 0 (partitioned_param_coordinator.py __params_to_release)
    z = zero3_schedule(TOY, 2, 10**9, 10**9, 0, 0)
    assert z.forward == r + 4 * M + 4 * M and z.forward_end == r + 4 * M
    # persistent parameters are never gathered or released
    z = zero3_schedule(TOY, 2, 0, 10**9, 0, r)
    assert z.forward == M


def test_zero1_sets_up_the_ipg_bucket_in_backward():
    # DeepSpeed stage 1 runs DeepSpeedZeroOptimizer: its gradient hooks allocate reduce_bucket_size elements in
    # the grad dtype per backward (twice with overlap_comm), as stage 2 does (measured: docs/accuracy.md)
    for overlap, buckets in ((False, 1), (True, 2)):
        f = A.timeline(TOY, settings("zero1", 2, ds={"overlap_comm": overlap}))
        # not yet at the loss backward's peak: set up at the first gradient hook (the head's: ROOT_FIRST_HOOK,
        # stage_1_and_2.py process_gradients -> setup_buckets), kept from there to the end of backward
        assert f.buffers["backward-start"] == f.buffers["forward"]
        bucket = buckets * 500_000_000 * 2
        moments = [(m.grads, m.buffers - f.buffers["forward"], m.at) for m in f.moments]
        assert f.buffers["optimizer-step"] < 500_000_000 * 2  # the step holds only its scratch, no bucket
        assert f.buffers["backward"] - f.buffers["forward"] == bucket
        if overlap:
            # reduced in the hooks; inside the blocks no grads_in_partition: the toy never fills the bucket
            assert moments == [(0, bucket, k) for k in (M.ROOT_FIRST_HOOK, M.ROOT_LAST_HOOK_BEFORE_BLOCKS,
                                                       M.INSIDE_LAST_BLOCK_BACKWARD,
                                                       M.INSIDE_PREVIOUS_BLOCK_BACKWARD,
                                                       M.INSIDE_FIRST_BLOCK_BACKWARD)] + [
                (0, 0, M.LOSS_BACKWARD)]  # the head's GEMM: none
            assert f.buffers["backward-end"] - f.buffers["forward"] == bucket
        else:
            # nothing reduced in backward (process_gradients): every gradient stays, as under DDP: inside the
            # last block the root's after the blocks (none in the toy), inside the first all blocks' but its own;
            # after backward the reduce allocates grads_in_partition beside them
            g = layouts.gather_sizes(TOY, "flat-aligned", 2)
            assert moments == [(0, bucket, M.ROOT_FIRST_HOOK), (0, bucket, M.ROOT_LAST_HOOK_BEFORE_BLOCKS),
                               (0, bucket, M.INSIDE_LAST_BLOCK_BACKWARD),
                               (2 * 3 * 1024 * 1024, bucket, M.INSIDE_FIRST_BLOCK_BACKWARD),
                               # the whole backward with its gradients, from the profile (none in the toy's)
                               (0, bucket, M.INSIDE_ANY_BLOCK_BACKWARD), (0, 0, M.LOSS_BACKWARD)]
            assert g.root_head == 0
            part = layouts.layout_sizes(TOY, "flat-aligned", 2, 0).partition_params_numel
            assert f.buffers["backward-end"] - f.buffers["forward"] == bucket + 2 * part


def test_zero_offload_host_share_by_stage():
    # measured on CPU (one allocator: the harness compares device + host): stage 3 keeps the fp32
    # grad per sub-group and grad_partitions_flat_buffer on the host; stage 1/2 the fp32 grad partition, a bit16
    # copy of the partition and a largest-parameter bit16 buffer, and a second one on the device
    for stage, strat in ((3, "zero3"), (2, "zero2")):
        on = A.estimate(TOY, settings(strat, 4, ds={"param_persistence_threshold": 0, "offload_optimizer": True}))
        off = A.estimate(TOY, settings(strat, 4))
        n = off.phases[0].master_weights_bytes // 4  # this rank's partition (elements)
        largest = 1024 * 1024
        if stage == 3:
            assert on.host_detail == {"master_weights_bytes": 4 * n, "optimizer_states_bytes": 8 * n,
                                      "grads_bytes": 4 * n + 2 * n}
        else:
            assert on.host_detail == {"master_weights_bytes": 4 * n, "optimizer_states_bytes": 8 * n,
                                      "grads_bytes": 4 * n, "buffers_bytes": 2 * n + 2 * largest}
            assert on.between_steps_bytes == off.between_steps_bytes - 12 * n + 2 * largest
        assert on.host_bytes_per_node == 4 * sum(on.host_detail.values())
        end = next(p for p in on.phases if p.name == "backward-end")
        assert end.grads_bytes == 0 and end.master_weights_bytes == 0 and end.optimizer_states_bytes == 0


def test_zero2_grads_in_partition_inside_the_blocks():
    # stage_1_and_2.py copy_grads_in_partition: once a bucket is reduced, grads_in_partition holds the whole
    # parameters overlapping the rank's partition (grad dtype); 4 blocks of 1024 x 1024 plus an 8 x 1024 root
    # tensor first, 4 ranks: partition 1,050,624 elements; rank 0 overlaps the root tensor and block 0, ranks
    # 1-3 overlap two blocks each
    f = A.timeline(TOY, settings("zero2", 4, ds={"reduce_bucket_size": 100_000}))
    inside = [(m.grads, m.at) for m in f.moments if m.at.inside_block]
    assert inside == [(2 * 2 * 1024 * 1024, k) for k in (0, 1, 2)]


def test_zero3_on_one_rank_gathers_nothing():
    # partition_parameters.py all_gather_coalesced -> _no_gather_coalesced: with a partition group of one each
    # parameter points at its partition (measured with the harness: forward 19.2 MB above the step's start at 1 rank,
    # the activations alone); a GPU with offloaded parameters copies them from the host
    one = A.timeline(TOY, settings("zero3", 1))
    assert one.assumptions["zero3_gathered_numel"]["forward_end"] > 0  # the schedule runs; nothing is copied
    # the reduce bucket alone; in the step, the largest sub-group's flat bf16 copy beside it (stage3.py
    # _prepare_fp32_grad_for_sub_group, measured on the H100: bench/gpu)
    step = one.buffers["optimizer-step"] - one.buffers["forward"]
    assert step == 2 * one.assumptions["zero3_largest_sub_group_numel"] == 2 * TOY.num_params
    offp = A.timeline(TOY, settings("zero3", 1, ds={"param_persistence_threshold": 0, "offload_param": True}))
    assert offp.buffers["forward"] - one.buffers["forward"] == 2 * one.assumptions["zero3_gathered_numel"]["forward_end"]


def test_zero3_offload_norms_each_partition_in_fp64():
    # stage3.py _offload_grad_partition_at_boundary: the reduced partition (grad dtype), on a GPU its copy back
    # from the host, and its fp64 copy for the norm; the head's when the last block's backward begins
    head = ParamTensor("lm_head.weight", (16, 1024), "bfloat16", "", classify("lm_head.weight"))
    inv = ParamInventory(model_name="toy", source="test", builder="test", family="llama",
                         tensors=TOY.tensors + (head,), dims=DIMS)
    for device, per in (("cpu", 8), ("cuda", 2 + 8)):
        s = settings("zero3", 4, ds={"param_persistence_threshold": 0, "offload_optimizer": True,
                                      "reduce_bucket_size": 1000})
        s = A.Settings(**{**s.__dict__, "cluster": A.Cluster(gpus=4, device=device, blas_workspace_bytes=0)})
        f = A.timeline(inv, s)
        z = f.assumptions["zero3_gathered_numel"]
        ipg = 2 * 1000
        # the head's (16 x 1024, after the blocks), larger than the bucket: kept whole (not moved into the bucket)
        # and reduced at the next hook, the final norm's, the root's last before the blocks, its partition copied
        head_hook = (0, ipg + 2 * z["loss"] + 2 * 16 * 1024 + per * (16 * 1024 // 4),
                     M.ROOT_LAST_HOOK_BEFORE_BLOCKS)
        assert head_hook in [(m.grads, m.buffers, m.at) for m in f.moments]


def test_zero3_grads_wait_for_their_hook_only():
    # stage3.py reduce_ready_partitions_and_remove_grads: with contiguous_gradients a parameter's grad is moved
    # into the ipg bucket (or reduced at once when larger) in its hook, so one parameter's grad is unreduced at a
    # time; without, the bucket's parameters keep theirs until it is reduced
    on = A.timeline(TOY, settings("zero3", 4, ds={"param_persistence_threshold": 0}))
    assert on.assumptions["zero3_unreduced_grad_numel"] == 1024 * 1024
    off = A.timeline(TOY, settings("zero3", 4, ds={"param_persistence_threshold": 0, "contiguous_gradients": False,
                                                 "reduce_bucket_size": 3 * 1024 * 1024}))
    assert off.assumptions["zero3_unreduced_grad_numel"] == 1024 * 1024  # a block is one 1024 x 1024 tensor
    assert on.grads_held and not A.timeline(TOY, settings("zero2", 4)).grads_held
    # inside the blocks: what is gathered there (no head after the blocks here: all of it)
    z = on.assumptions["zero3_gathered_numel"]
    assert [(m.buffers, m.at) for m in on.moments if m.at.inside_block] == [
        (2 * z["blocks"] + 2 * 500_000_000, k) for k in (Moment.INSIDE_LAST_BLOCK_BACKWARD,
                                                          Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD,
                                                          Moment.INSIDE_FIRST_BLOCK_BACKWARD)]
    # inside the last block's forward: the most gathered in forward (a coalesced prefetch's flat buffer and copies)
    assert (2 * z["forward"] + 2 * 500_000_000, Moment.INSIDE_LAST_BLOCK_FORWARD) in [(m.buffers, m.at)
                                                                                 for m in on.moments]


def test_zero3_schedule_releases_the_head_before_the_blocks_backward():
    head = ParamTensor("lm_head.weight", (16, 1024), "bfloat16", "", classify("lm_head.weight"))
    inv = ParamInventory(model_name="toy", source="test", builder="test", family="llama",
                         tensors=TOY.tensors + (head,), dims=DIMS)
    z = zero3_schedule(inv, 2, 0, 10**9, 0, 0)
    # reuse distance 0: each module is released after it runs; the head is gathered for its backward, then
    # released before the last block's
    assert z.backward >= 16 * 1024 and z.blocks == 1024 * 1024


def test_zero3_offload_hook_transient_at_each_hook():
    f = A.timeline(TOY, settings("zero3", 4, ds={"param_persistence_threshold": 0, "offload_optimizer": True}))
    # on a GPU, per partition element: its copy back from the host, its fp64 copy
    assert f.hook_transient.bytes(4000) == (2 + 8) * 1000
    # the fp64 norm 250M elements at a time, the fp32 copy after it; a gradient larger than the bucket kept whole
    big = 4 * 300_000_000
    assert f.hook_transient.bytes(big) == 2 * 300_000_000 + 8 * 250_000_000 + 2 * big
    # the copies come at the reduce of the bucket, at the hook that would overflow it, beside its torch.cat
    assert f.hook_transient.bucket == 500_000_000 and f.hook_transient.cat_per == 2
    assert any(m.at == Moment.BLOCK_GRADIENT_HOOK for m in f.moments)
    assert A.timeline(TOY, settings("zero3", 4)).hook_transient.bytes(4000) == 0


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("recipe", ["torch-amp", "fp32"])
def test_deepspeed_keeps_its_fp32_master_copy_of_fp32_params(strategy, recipe):
    # the ZeRO optimizers clone their partition to fp32 whatever the parameters' dtype (measured: ZeRO-3,
    # torch-amp, 2 ranks, 17,830,912 B = 4 x the partition); torch's optimizers step the fp32 parameters
    f = A.timeline(TOY, settings(strategy, 2, recipe=recipe))
    assert f.master_weights == 4 * (PSI // 2)
    assert A.timeline(TOY, settings("fsdp-full", 2, recipe=recipe)).master_weights == 0


def test_zero3_persistent_params_cost_nothing_extra_at_one_rank():
    # a persistent parameter stays gathered beside its partition; at one rank DeepSpeed gathers nothing
    # (NoGatherHandle: param.data is ds_tensor's data), so the gathered copy is the partition. Measured with the harness:
    # gpt2 ZeRO-3 defaults at 1 rank, weights exactly 2 B x every element
    ds = {"param_persistence_threshold": 10_000}  # the toy's 8 x 1024 root tensor is persistent
    one = A.timeline(TOY, settings("zero3", 1, ds=ds))
    assert one.weights == 2 * PSI
    two = A.timeline(TOY, settings("zero3", 2, ds=ds))
    lay = layouts.layout_sizes(TOY, get_strategy("zero3").layout, 2, 10_000)
    assert lay.persistent_numel == 8 * 1024
    assert two.weights == 2 * (lay.shard_numel + 8 * 1024)


def test_quant_groups_is_deepspeeds_loop():
    # CUDAQuantizer.quantize (DeepSpeed 0.19.8 partition_parameters.py), its loop as written, and its asserts:
    # memplan finds the same count from the divisors, and refuses what DeepSpeed asserts on
    import math

    from memplan.errors import SettingsError
    from memplan.frameworks.zero3 import quant_groups

    def loop(numel):
        groups = math.ceil(numel / 8000)
        while groups < numel:
            if numel % (8 * groups) == 0:
                break
            groups += 1
        while numel % (8 * groups * 2) == 0 and numel / groups > 8000:
            groups *= 2
        ok = numel % (8 * groups) == 0 and numel / groups < 16000 and numel > groups
        return groups if ok else None

    for numel in [*range(1, 400), 8000, 16000, 16008, 24000, 96_008, 4096 * 11008 // 8 * 8, 8 * 104_729]:
        try:
            got = quant_groups(numel)
        except SettingsError:
            got = None
        assert got == loop(numel), numel
    with pytest.raises(SettingsError, match="43,690,667 elements cannot be quantized"):
        quant_groups(43_690_667)  # llama-7b's embedding over 3 ranks: DeepSpeed's loop would run 43M times


def test_zero3_quantized_weights_gather_in_bytes():
    # ZeRO++ qwZ (partition_parameters.py, DeepSpeed 0.19.8; derived from the source): one module of two
    # 10,000-element bf16 parameters, 2 ranks, no prefetch. The gather: the partitions concatenated (2 x 10,000
    # bytes) and cast to fp16 (20,000), quantized (10,000 int8 + 2 fp32 scales: CUDAQuantizer's groups for
    # 10,000 elements), into an int8 buffer over both ranks (20,000) with their scales (16); the wait: an fp16
    # dequantized flat copy (40,000), then each parameter torch.cat out of it in fp16 and cast to bf16.
    from memplan.frameworks.zero3 import quant_groups

    t = (ParamTensor("layers.0.lin.weight", (100, 100), "bfloat16", "layers.0", "mlp"),
         ParamTensor("layers.0.lin.bias", (10000,), "bfloat16", "layers.0", "mlp"))
    inv = ParamInventory(model_name="toy", source="test", builder="test", family="llama", tensors=t, dims=DIMS)
    assert quant_groups(10000) == 2
    held = 2 * 10000 + 4 * 2 * 2 + 10000 + 4 * 2
    assert held == 30024
    z = zero3_schedule(inv, 2, 0, 10**9, 0, 0, (2, False))
    # the second parameter's cast: the int8 buffers, the fp16 flat, the first parameter's bf16 copy, the second's
    # fp16 cat and its bf16 cast
    assert z.forward == held + 40000 + 20000 + 20000 + 20000 == 130024
    plain = zero3_schedule(inv, 2, 0, 10**9, 0, 0)
    assert plain.forward == 2 * 20000  # elements: the flat buffer and the copies out of it
    # fp16 parameters: no cast on the way in or out
    assert zero3_schedule(inv, 2, 0, 10**9, 0, 0, (2, True)).forward == max(
        0 + 2 * 10000 + held, held + 40000 + 20000 + 20000)


def test_zero_quantized_gradients_act_across_nodes_only(inventories):
    # stage3.py __avg_scatter_grads takes all_to_all_quant_reduce only when num_nodes > 1
    from memplan import options

    inv = inventories("llama-3-8b")
    plain = options.resolve(inv, JobRequest.of(gpus=16, gpus_per_node=8, stage=3, activations="analytic"))
    one_node = options.resolve(inv, JobRequest.of(gpus=8, stage=3, activations="analytic", quantized_gradients=True))
    two_nodes = options.resolve(inv, JobRequest.of(gpus=16, gpus_per_node=8, stage=3, activations="analytic", quantized_gradients=True))
    assert any("across nodes only" in n for n in one_node.notes)
    base = A.estimate(inv, plain.settings)
    q = A.estimate(inv, two_nodes.settings)
    # the head (128256 x 4096) is the largest 2-D gradient: its int4 copies (N/2 each, with 128256 fp32 scales),
    # the intra-node reduction and inter-node outputs (N/16 each, scales / 8) and the fp16 result (2N/8)
    n_el, g = 128256 * 4096, 128256
    extra = 2 * (n_el // 2 + 4 * g) + 2 * (n_el // 16 + 4 * -(-g // 8)) + 2 * n_el // 8
    assert q.phases[3].buffers_bytes - base.phases[3].buffers_bytes == extra


def test_zero12_under_gradient_accumulation():
    # DeepSpeed 0.19.8 stage_1_and_2.py under grad-accum 2 (measured: docs/accuracy.md "grad-accum" rows, within
    # 0.01%): ZeRO-1 keeps every gradient whole and its bucket across the micro-steps (setup_buckets at the first
    # micro-step's first hook, released by the boundary's epilogue), ZeRO-2 its accumulated grads_in_partition
    # (the whole parameters overlapping the partition) beside the next micro-step's; the step as one micro-step's
    bucket = 100_000
    for strat in ("zero1", "zero2"):
        one = A.timeline(TOY, settings(strat, 4, ds={"reduce_bucket_size": bucket, "param_persistence_threshold": 0}))
        two = A.timeline(TOY, settings(strat, 4, ds={"reduce_bucket_size": bucket, "param_persistence_threshold": 0},
                                       grad_accum=2))
        part = layouts.layout_sizes(TOY, "flat-aligned", 4, 0).partition_params_numel
        assert two.buffers["optimizer-step"] == one.buffers["optimizer-step"]
        assert two.grads["optimizer-step"] == one.grads["optimizer-step"]
        if strat == "zero1":
            assert two.grads["forward"] == 2 * PSI  # every gradient whole, in bf16
            assert two.buffers["forward"] == one.buffers["forward"] + 2 * bucket
            assert two.buffers["backward-start"] == one.buffers["backward-start"] + 2 * bucket
            assert two.buffers["backward"] == one.buffers["backward"]  # the bucket is the same one
        else:
            assert two.grads["forward"] == 2 * part
            inside = [m.grads for m in two.moments if m.at.inside_block]
            assert inside == [g + 2 * part for g in (m.grads for m in one.moments if m.at.inside_block)]


def test_zero_offload_under_gradient_accumulation():
    # ZeRO-1 with offload keeps param.grad on the device until the boundary; ZeRO-2 accumulates each partition
    # gradient in a host buffer of the whole overlapping parameters (accumulated_grads_in_cpu). Measured:
    # docs/accuracy.md "offload optimizer, small buckets, grad-accum 2" rows, -0.00%
    ds = {"param_persistence_threshold": 0, "offload_optimizer": True}
    part = layouts.layout_sizes(TOY, "flat-aligned", 4, 0).partition_params_numel
    for strat in ("zero1", "zero2"):
        one = A.estimate(TOY, settings(strat, 4, ds=ds))
        two = A.estimate(TOY, settings(strat, 4, ds=ds, grad_accum=2))
        fwd_one, fwd_two = (next(p for p in x.phases if p.name == "forward") for x in (one, two))
        if strat == "zero1":
            assert fwd_two.grads_bytes - fwd_one.grads_bytes == 2 * PSI
            assert two.host_detail == one.host_detail
        else:
            assert fwd_two.grads_bytes == fwd_one.grads_bytes == 0
            assert two.host_detail["grads_bytes"] - one.host_detail["grads_bytes"] == 2 * part
