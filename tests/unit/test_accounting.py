"""Exact model-state bytes on hand-checkable inventories and the ZeRO paper's identities."""

import pytest

from memplan import accounting as A
from memplan import options
from memplan import layouts
from memplan.errors import SettingsError
from memplan.model.inventory import ParamInventory, ParamTensor, classify
from memplan.precision import get_optimizer, get_recipe
from memplan.strategies import DEFAULT_RECIPE, get_strategy
from memplan.frameworks.zero3 import zero3_schedule
from memplan.timeline import Moment
from memplan.request import JobRequest

M = Moment

DIMS = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 100, "intermediate_size": 128}


def make_inv(shapes_by_block):
    tensors = []
    for block, shapes in shapes_by_block.items():
        for i, shape in enumerate(shapes):
            name = f"{block}.w{i}.weight" if block else f"w{i}.weight"
            tensors.append(ParamTensor(name, shape, "bfloat16", block, classify(name)))
    return ParamInventory(model_name="toy", source="test", builder="test", family="llama",
                          tensors=tuple(tensors), dims=DIMS)


# 4 blocks of 1024x1024 + a root tensor: Psi = 4*1024*1024 + 8*1024, divisible by every N below.
TOY = make_inv({"": [(8, 1024)], **{f"layers.{i}": [(1024, 1024)] for i in range(4)}})
PSI = TOY.num_params


def settings(strategy, gpus, **kw):
    st = get_strategy(strategy)
    recipe = kw.pop("recipe", DEFAULT_RECIPE[st.framework])
    ds = A.DeepSpeedKnobs(**kw.pop("ds", {"param_persistence_threshold": 0}))
    return A.Settings(strategy=st, recipe=get_recipe(recipe), optimizer=get_optimizer(kw.pop("optimizer", "adamw")),
                      cluster=A.Cluster(gpus=gpus, gpus_per_node=kw.pop("gpus_per_node", 8),
                                        blas_workspace_bytes=kw.pop("blas_workspace_bytes", 0)), ds=ds, **kw)


def model_states(plan, phase="backward-end"):
    p = next(p for p in plan.phases if p.name == phase)
    return p.weights_bytes + p.master_weights_bytes + p.grads_bytes + p.optimizer_states_bytes


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


def test_fsdp2_dim0_padding():
    inv = make_inv({"": [(5, 3)], "layers.0": [(10, 7)], "layers.1": [(9,)]})
    plan = A.estimate(inv, settings("fsdp-full", 4))
    shard = 2 * 3 + 3 * 7 + 3  # ceil(5/4)*3 + ceil(10/4)*7 + ceil(9/4)
    assert plan.peak.weights_bytes == 4 * shard  # fp32 sharded params (fsdp-bf16)
    assert plan.peak.optimizer_states_bytes == 8 * shard


def test_zero_redundancy_optimizer_greedy_worst_rank():
    inv = make_inv({"": [(10,)], "layers.0": [(7,)], "layers.1": [(6,)], "layers.2": [(5,)]})
    # sorted: 10 -> r0, 7 -> r1, 6 -> r1 (7 < 10), 5 -> r0 (10 < 13)? sizes r0=10, r1=13 -> 5 to r0 -> 15
    lay = layouts.layout_sizes(inv, "greedy-whole", 2)
    assert lay.optimizer_numel == 15
    plan = A.estimate(inv, settings("zero-optimizer", 2))
    assert plan.peak.optimizer_states_bytes == 8 * 15


def test_ddp_buckets_double_grads_unless_bucket_view():
    plan = A.estimate(TOY, settings("ddp", 2))
    end = next(p for p in plan.phases if p.name == "backward-end")
    assert end.grads_bytes == 4 * PSI and end.buffers_bytes == 4 * PSI
    view = A.estimate(TOY, settings("ddp", 2, torch=A.TorchKnobs(gradient_as_bucket_view=True)))
    assert next(p for p in view.phases if p.name == "backward-end").buffers_bytes == 0


def test_hsdp_one_replica_equals_full_shard():
    full = A.estimate(TOY, settings("fsdp-full", 8))
    hsdp = A.estimate(TOY, settings("hsdp", 8, gpus_per_node=8))
    assert full.phases == hsdp.phases


def test_offload_moves_states_to_host():
    plan = A.estimate(TOY, settings("zero3", 8, ds={"param_persistence_threshold": 0, "offload_optimizer": True}))
    assert plan.peak.optimizer_states_bytes == 0 and plan.peak.master_weights_bytes == 0
    # master + Adam states (12 bytes) and the fp32 + bf16 grad partitions (6 bytes) per element, 8 ranks a node
    assert plan.host_bytes_per_node == 8 * (18 * PSI // 8)


def test_hpz_secondary_partition():
    base = A.estimate(TOY, settings("zero3", 8))
    hpz = A.estimate(TOY, settings("zero3", 8, ds={"param_persistence_threshold": 0, "hpz_partition_size": 4}))
    assert hpz.peak.weights_bytes - base.peak.weights_bytes == 2 * PSI // 4


def test_adafactor_and_8bit_states():
    inv = make_inv({"layers.0": [(100, 50)], "": [(8000,)]})
    ada = A.estimate(inv, settings("ddp", 1, optimizer="adafactor"))
    assert ada.peak.optimizer_states_bytes == 4 * (100 + 50) + 4 * 8000
    b8 = A.estimate(inv, settings("ddp", 1, optimizer="adam8bit"))
    # 5000 >= 4096 -> 8-bit with an fp32 absmax per 256-element block (bitsandbytes 0.50 init_state); 8000
    # too; the two shared 256-entry fp32 quantization maps once
    assert b8.peak.optimizer_states_bytes == 2 * (5000 + 4 * 20) + 2 * (8000 + 4 * 32) + 2 * 1024


def test_shape_dependent_optimizers_see_what_the_framework_hands_them():
    """DeepSpeed hands its flat fp32 partition (Adafactor cannot factor it: 4 B per element, as measured with
    transformers' Adafactor under ZeRO-2), ZeRO-3 one flat tensor per sub-group, FSDP1 its FlatParameter shards;
    FSDP2's DTensors are refused."""
    from memplan.units import round_up

    from dataclasses import replace

    inv = TOY
    fsdp1 = replace(settings("ddp", 4, optimizer="adafactor", recipe="fsdp-bf16"),
                    strategy=get_strategy("fsdp-full", 1))
    for st in (settings("zero1", 4, optimizer="adafactor"), settings("zero2", 4, optimizer="adafactor"),
               settings("zero3", 4, optimizer="adafactor"), fsdp1):
        opt_numel = A.layouts.layout_sizes(inv, st.strategy.layout, 4).optimizer_numel
        assert A.estimate(inv, st).peak.optimizer_states_bytes == 4 * opt_numel, st.strategy.name
    z2 = A.layouts.layout_sizes(inv, "flat-aligned", 4).optimizer_numel
    assert z2 == round_up(PSI, 2 * 4) // 4
    # ZeRO-3 sub-groups: 8-bit states quantized per sub-group (blocks rounded per group)
    z3 = A.estimate(inv, settings("zero3", 4, optimizer="adam8bit",
                                  ds={"param_persistence_threshold": 0, "sub_group_size": 300_000}))
    parts = [-(-t.numel // 4) for t in inv.tensors]
    from memplan.frameworks.zero3 import sub_groups

    groups = sub_groups(parts, 300_000)
    assert len(groups) > 1
    assert z3.peak.optimizer_states_bytes == sum(2 * (g + 4 * -(-g // 256)) for g in groups) + 2 * 1024
    # DDP keeps shapes: factored
    ddp = A.estimate(inv, settings("ddp", 4, optimizer="adafactor"))
    assert ddp.peak.optimizer_states_bytes == 4 * (8 + 1024) + 4 * 4 * (1024 + 1024)
    with pytest.raises(SettingsError, match="DTensor"):
        options.resolve(inv, JobRequest.of(gpus=4, strategy="fsdp-full", optimizer="adafactor", activations="analytic"))
    with pytest.raises(SettingsError, match="DTensor"):
        options.resolve(inv, JobRequest.of(gpus=4, strategy="hsdp", optimizer="adam8bit", activations="analytic"))


def test_overheads_separate_and_cpu_has_none():
    gpu = A.estimate(TOY, settings("zero2", 8))
    assert gpu.overhead_bytes > 0 and gpu.required_bytes == gpu.peak_bytes + gpu.overhead_bytes
    cpu = A.estimate(TOY, A.Settings(**{**settings("zero2", 8).__dict__,
                                          "cluster": A.Cluster(gpus=8, gpus_per_node=8, device="cpu")}))
    assert cpu.overhead_bytes == 0


@pytest.mark.parametrize("kw,match", [({"gpus": 0}, "at least 1"), ({"gpus": 12, "gpus_per_node": 8}, "multiple"),
                                      ({"gpus": 2, "device": "tpu"}, "cuda or cpu")])
def test_bad_cluster(kw, match):
    with pytest.raises(SettingsError, match=match):
        A.Cluster(**kw)


def test_bad_sizes():
    with pytest.raises(SettingsError, match="micro-batch"):
        settings("ddp", 1, micro_batch=0)


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


def test_fsdp2_buffer_lifetimes_per_phase():
    # FSDP2 (fsdp-bf16: bf16 compute copies and grads, fp32 reduce-scatter), 4 ranks, 4 equal blocks of B
    # elements; the root holds an embedding before the blocks and a head after them (its grads live through the
    # blocks' backward). Buffer terms follow _fsdp_param_group.py, as measured by the harness (docs/accuracy.md).
    inv = make_inv({"": [(8, 1024)], **{f"layers.{i}": [(1024, 1024)] for i in range(4)}})
    head = ParamTensor("lm_head.weight", (8, 1024), "bfloat16", "", classify("lm_head.weight"))
    inv = ParamInventory(model_name="toy", source="test", builder="test", family="llama",
                         tensors=inv.tensors + (head,), dims=DIMS)
    b, root, hd = 1024 * 1024, 2 * 16 * 1024, 8 * 1024
    f = A.timeline(inv, settings("fsdp-full", 4))
    forward, loss, backward, end, _ = f.buffers.values()
    assert forward == root + 2 * b  # root unsharded + the last block's all-gather output, held to the loss
    assert loss == root + 2 * b  # the last block prefetched for its backward
    # every backward moment is evaluated with its own activations (f.moments); the base phase holds no buffer
    assert backward == 0
    # one block further: itself, the next, its grads and the last block's reduce-scatter input still held,
    # with the last block's fp32 grad shard reduced
    # every further moment: (grads, buffers, activations kind)
    moments = [(m.grads, m.buffers, m.at) for m in f.moments]
    assert moments == [
        # the head's weight-gradient GEMM in the loss's backward: what is gathered at the loss (its grads from the
        # profile's loss segment)
        (0, root + 2 * b, M.LOSS_BACKWARD),
        # block 0's copy-out in forward: the root, the root's all-gather output held through it, block 0's output
        # and copies; only the embedding's output saved so far
        (0, 2 * root + 4 * b, M.EMBEDDING_OUTPUT),
        # the last block's copy-out in forward: the previous block's output, its own, its copies
        (0, root + 6 * b, M.LAST_BLOCK_FORWARD_BEGINS),
        # inside the last block's forward: its copies and its all-gather output, held to the root's post-forward
        (0, root + 4 * b, M.INSIDE_LAST_BLOCK_FORWARD),
        # the last block's copy-out in backward: its prefetched output and its copies; everything saved
        (0, root + 2 * hd + 4 * b, M.LAST_BLOCK_BACKWARD_BEGINS),
        # then its prefetch of the block before: itself, that block's all-gather output and the flat bf16 cast
        # of this rank's fp32 shard, the all-gather's copy-in source (_get_param_all_gather_inputs)
        (0, root + 2 * hd + 2 * b + 2 * b + 2 * b // 4, M.LAST_BLOCK_BACKWARD_BEGINS),
        # the last block's reduce: the next one prefetched, its grads, and itself (2B) or, once resharded, its
        # fp32 reduce-scatter input (4B); activations as when the next block's backward begins
        (0, root + 2 * hd + 2 * b + 2 * b + max(2 * b, 4 * b), M.PREVIOUS_BLOCK_BACKWARD_BEGINS),
        # inside the last block's backward: itself, the next prefetched (its own grads come from the profile)
        (0, root + 2 * hd + 4 * b, M.INSIDE_LAST_BLOCK_BACKWARD),
        # the block before, copied out: the last block's fp32 reduce-scatter input held, its grad shard reduced
        (b, root + 2 * hd + 8 * b, M.PREVIOUS_BLOCK_BACKWARD_BEGINS),
        # and its prefetch of the next: itself, that one's output and cast copy-in, the last block's input
        (b, root + 2 * hd + 2 * b + 2 * b + 2 * b // 4 + 4 * b, M.PREVIOUS_BLOCK_BACKWARD_BEGINS),
        # one block further with its grads complete: itself, the next, its grads, the last block's input
        (b, root + 2 * hd + 4 * b + 2 * b + 4 * b, M.PREVIOUS_BLOCK_BACKWARD_ENDS),
        # inside it
        (b, root + 2 * hd + 8 * b, M.INSIDE_PREVIOUS_BLOCK_BACKWARD),
        # inside the second block (of four or more): itself, the first prefetched, the third's reduce-scatter
        # input; the third's and the last's shards reduced
        (2 * b, root + 2 * hd + 4 * b + 4 * b, M.INSIDE_SECOND_BLOCK_BACKWARD),
        # inside the first block: itself, the second block's reduce-scatter input; the other blocks' shards
        # reduced (the root's grads wait for its reduce at the very end)
        (3 * b, root + 2 * hd + 2 * b + 4 * b, M.INSIDE_FIRST_BLOCK_BACKWARD),
        # the root's pre-backward, with everything forward left alive: the last block's prefetch, its output and
        # the cast copy-in of this rank's shard
        (0, root + 2 * b + 2 * b // 4, M.ALL_SAVED),
        # the root, resharded at its post-forward (fully_shard(model) given reshard_after_forward=True, the
        # default --fsdp-root-reshard same), unsharded again at backward's first hook: its all-gather output,
        # its copies and the cast copy-in of this rank's shard
        (0, 2 * root + 2 * (16 * 1024) // 4, M.ALL_SAVED),
    ]
    assert f.grad_width == 2
    # the first block's end: itself, its grads, the second block's reduce-scatter input
    assert end == root + 2 * hd + (2 + 2 + 4) * b


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
                               (2 * 3 * 1024 * 1024, bucket, M.INSIDE_FIRST_BLOCK_BACKWARD), (0, 0, M.LOSS_BACKWARD)]
            assert g.root_head == 0
            part = layouts.layout_sizes(TOY, "flat-aligned", 2, 0).partition_params_numel
            assert f.buffers["backward-end"] - f.buffers["forward"] == bucket + 2 * part


def test_fsdp2_reshard_group_sizes_as_fsdp2_reads_them():
    # _fsdp_init.py _get_post_forward_mesh_info: a group of 1 keeps whole parameters (False), the shard group's
    # size is True; a group of 2 of 4 keeps a half share of every block after forward
    def plan(raf):
        return A.estimate(TOY, settings("fsdp-full", 4, torch=A.TorchKnobs(reshard_after_forward=raf)))

    assert plan(1).phases == plan(False).phases and plan(4).phases == plan(True).phases
    b, root = 1024 * 1024, 2 * 8 * 1024
    f = A.timeline(TOY, settings("fsdp-full", 4, torch=A.TorchKnobs(reshard_after_forward=2)))
    assert f.buffers["forward"] == root + 2 * 4 * (b // 2) + 2 * b  # the shares, and the last all-gather output held
    with pytest.raises(SettingsError, match="must divide"):
        A.timeline(TOY, settings("fsdp-full", 4, torch=A.TorchKnobs(reshard_after_forward=3)))


def test_fsdp1_buffer_lifetimes_per_phase():
    # FSDP1 (fsdp-bf16: fp32 flat shards, bf16 unsharded flat buffers and grads, fp32 reduce), 4 ranks, 4 equal
    # blocks of B elements; the root holds an embedding and a head (memplan/frameworks/fsdp1.py)
    inv = make_inv({"": [(8, 1024)], **{f"layers.{i}": [(1024, 1024)] for i in range(4)}})
    head = ParamTensor("lm_head.weight", (8, 1024), "bfloat16", "", classify("lm_head.weight"))
    inv = ParamInventory(model_name="toy", source="test", builder="test", family="llama",
                         tensors=inv.tensors + (head,), dims=DIMS)
    st = get_strategy("fsdp-full", fsdp_version=1)
    s = A.Settings(strategy=st, recipe=get_recipe("fsdp-bf16"), optimizer=get_optimizer("adamw"),
                   cluster=A.Cluster(gpus=4, gpus_per_node=8, blas_workspace_bytes=0))
    f = A.timeline(inv, s)
    b, root, hd = 1024 * 1024, 2 * 16 * 1024, 8 * 1024
    forward, loss, _, end, _ = f.buffers.values()
    assert forward == root  # one block gathered at a time, resharded in its post-forward; the root kept
    assert loss == root + 2 * b  # the root's pre-backward prefetches the last block
    assert [(m.grads, m.buffers, m.at) for m in f.moments] == [
        (0, root + 2 * b, M.LOSS_BACKWARD),  # the head's weight-gradient GEMM: what is gathered at the loss
        (0, root + 2 * 4096, M.EMBEDDING_OUTPUT),  # the root's unshard: its bf16 _mp_shard beside the flat buffer
        (0, root + 2 * b + b // 2, M.EMBEDDING_OUTPUT),  # the first block's: flat buffer (no separate all-gather output) + _mp_shard
        (0, root + 2 * b + b // 2, M.LAST_BLOCK_FORWARD_BEGINS),  # the last block's, everything before it saved
        (0, root + 2 * b, M.INSIDE_LAST_BLOCK_FORWARD),  # inside the last block's forward
        (0, root + 2 * hd + 4 * b + b // 2, M.LAST_BLOCK_BACKWARD_BEGINS),  # its pre-backward: itself, the next prefetched with its _mp_shard
        (0, root + 2 * hd + 4 * b, M.INSIDE_LAST_BLOCK_BACKWARD),  # inside its backward (its grads from the profile)
        # its end: the split grads concatenated (2B + 2B), or resharded, the fp32 cast (4B) and a new shard (B)
        (0, root + 2 * hd + 2 * b + max(2 * b + 4 * b, 2 * b + 4 * b + b), M.PREVIOUS_BLOCK_BACKWARD_BEGINS),
        (b, root + 2 * hd + 4 * b, M.INSIDE_PREVIOUS_BLOCK_BACKWARD),  # inside the block before (the last block's fp32 shard reduced)
        (b, root + 2 * hd + 2 * b + 7 * b, M.PREVIOUS_BLOCK_BACKWARD_ENDS),  # the block before, its grads complete
        (2 * b, root + 2 * hd + 4 * b, M.INSIDE_SECOND_BLOCK_BACKWARD),  # inside the second: itself, the first prefetched
        # the second's end, the first prefetched: its concatenation (2B + 2B) or, resharded, the cast (4B) and shard
        (2 * b, root + 2 * hd + 2 * b + max(2 * b + 4 * b, 2 * b + 4 * b + b), M.FIRST_BLOCK_BACKWARD_BEGINS),
        (3 * b, root + 2 * hd + 2 * b, M.INSIDE_FIRST_BLOCK_BACKWARD),  # inside the first block: the other blocks' shards reduced
        (0, root + 2 * hd + 2 * b + b, M.PREVIOUS_BLOCK_BACKWARD_BEGINS),  # after the last block's reduce: the prefetched block and its shard
    ]
    assert end == root + 2 * hd + 7 * b  # the first block resharded, its bf16 grad, fp32 cast and new shard


def test_single_tensor_adam_scratch_counts_the_previous_denominator():
    # _single_tensor_adam: sqrt and division of this tensor while the previous one's denominator is still bound
    b = 1024 * 1024
    assert layouts.layout_sizes(TOY, "replicated", 1).single_step_scratch == 3 * b  # two equal neighbours
    from memplan.strategies import FLAT_PER_BLOCK

    assert layouts.layout_sizes(TOY, FLAT_PER_BLOCK, 2).single_step_scratch == b // 2 + b  # half-block shards


def test_cublas_workspaces_are_inside_the_peak_on_cuda_only():
    # two handles (forward thread, autograd thread), each with its workspace from the caching allocator, kept
    ws = 32 * 1024 * 1024
    base = A.estimate(TOY, settings("fsdp-full", 4))
    cuda = A.estimate(TOY, settings("fsdp-full", 4, blas_workspace_bytes=ws))
    assert [c.buffers_bytes - b.buffers_bytes for b, c in zip(base.phases, cuda.phases)] == [2 * ws] * 5
    assert cuda.between_steps_bytes - base.between_steps_bytes == 2 * ws
    cpu = A.Settings(strategy=get_strategy("fsdp-full"), recipe=get_recipe("fsdp-bf16"),
                     optimizer=get_optimizer("adamw"), cluster=A.Cluster(gpus=4, device="cpu"))
    assert "blas_workspace" not in A.estimate(TOY, cpu).assumptions


def test_gpu_presets_carry_pytorchs_default_cublas_workspace():
    from memplan.model.sources import gpu_presets

    for name, g in gpu_presets().items():
        assert g.blas_workspace_bytes == A.default_blas_workspace(g.arch), name
    assert A.default_blas_workspace("sm90") == 32 * 1024 * 1024
    assert A.default_blas_workspace("sm80") == 8 * 1024 * 1024 + 128 * 1024
    assert A.default_blas_workspace("gfx942") == 128 * 1024 * 1024


def test_cublas_workspace_from_the_gpu_preset_or_the_option():
    from memplan import options

    inv = TOY
    h100 = options.resolve(inv, JobRequest.of(gpus=8, stage=3, gpu="h100-80g")).settings.cluster.blas_workspace_bytes
    a100 = options.resolve(inv, JobRequest.of(gpus=8, stage=3, gpu="a100-80g")).settings.cluster.blas_workspace_bytes
    assert (h100, a100) == (32 * 1024 * 1024, 4096 * 1024 * 2 + 16 * 1024 * 8)
    given = options.resolve(inv, JobRequest.of(gpus=8, stage=3, gpu="h100-80g", blas_workspace_bytes=4096 * 1024))
    assert given.settings.cluster.blas_workspace_bytes == 4096 * 1024
    bare = options.resolve(inv, JobRequest.of(gpus=8, stage=3))
    assert bare.settings.cluster.blas_workspace_bytes == 32 * 1024 * 1024
    assert any("cuBLAS workspace" in n for n in bare.notes)


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


class _StubProfile:
    """An activation profile with chosen numbers at each named moment (activations.TracedProfile's interface)."""

    source = "stub"
    includes_autocast_copies = True

    def __init__(self):
        self._memo = {}

    def terms(self, recompute, b):
        from memplan.activations import Terms

        return Terms(forward=10 * b, backward_start=1000 * b, saved_less_block=50 * b, left_at_end=0, block=5 * b)

    def block_moments(self, b, width, held):
        return ((100 * b, 10), (50 * b, 10), (20 * b, 10))

    def moment_activations(self, b):
        return {-5: 7 * b, -12: 3 * b}

    def loss_moment(self, b, width):
        return (300 * b, 40)

    def block_hooks(self, b):
        return (((5 * b, 64), (9 * b, 16)), ((1, 8),), ())


def test_moment_kinds_read_the_profile_exactly():
    # each named moment on a stub profile: the head's GEMM at the recipe's grad width, the offload hook at the
    # hook that tops activations + per-element transient x partition, block moments with their grads, named
    # moments as read
    from dataclasses import replace

    M = Moment
    s = replace(settings("zero3", 4, ds={"param_persistence_threshold": 0, "offload_optimizer": True,
                                         "reduce_bucket_size": 70}),
                activation_profile=_StubProfile(), micro_batch=2)
    vals = {e.moment.at: (e.activations, e.own_bytes) for e in A.evaluate_moments(TOY, s)}
    assert vals[M.LOSS_BACKWARD] == (600, 2 * 40)
    # the bucket (70 elements) takes the 64-element gradient, the 16-element one overflows it: its reduce at that
    # hook (activations 18, its own 16-element gradient beside), the 64-element gradient's partition copied back
    # on the GPU (2) and in fp64 (8)
    assert vals[M.BLOCK_GRADIENT_HOOK] == (18, 2 * 16 + (2 + 8) * (64 // 4))
    assert vals[M.ROOT_LAST_HOOK_BEFORE_BLOCKS] == (6, 0)
    assert vals[M.INSIDE_LAST_BLOCK_BACKWARD] == (200, 20) and vals[M.INSIDE_FIRST_BLOCK_BACKWARD] == (40, 20)
    assert [e.moment for e in A.evaluate_moments(TOY, s)] == list(A.timeline(TOY, s).moments)


def test_backward_start_is_the_loss_moment_where_block_moments_are_evaluated():
    # the profile's backward-start term is the most alive anywhere in backward (with recompute: inside a block);
    # where the blocks' own moments are evaluated, the loss moment alone is the backward-start phase
    from dataclasses import replace

    class Stub(_StubProfile):
        def block_moments(self, b, width, held):
            return ((900 * b, 10), (800 * b, 10), (700 * b, 10))

        def moment_activations(self, b):
            return {}

        def block_hooks(self, b):
            return ()

    for strategy, covered in (("zero3", True), ("ddp", True), ("zero0", True)):
        s = replace(settings(strategy, 4), activation_profile=Stub(), recompute="full", micro_batch=2,
                    cluster=A.Cluster(gpus=4, device="cpu"))
        start = A.estimate(TOY, s).phases[1]
        assert start.name == "backward-start"
        if covered:
            grads = A.timeline(TOY, s).grads["backward-start"]
            assert start.activations_bytes == 600 and start.grads_bytes == grads + s.recipe.grad_bytes * 40
        else:
            assert start.activations_bytes == 2000  # stage 0 evaluates no block moments: the whole term stays


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


def test_fsdp2_dim0_padding_is_noted():
    # FSDP2 pads dim 0 to the shard group: mixtral's experts [8, ...] on 16 ranks double (the note names the
    # padded share and the remedy); at 8 ranks nothing is padded
    from memplan import options
    from memplan.model import sources

    inv = sources.build_inventory(sources.resolve("mixtral-8x7b"))
    note = lambda g: [n for n in options.resolve(inv, JobRequest.of(gpus=g, strategy="fsdp-full", activations="analytic")).notes  # noqa: E731
                      if "pads each parameter's dim 0" in n]
    assert note(8) == []
    (n16,) = note(16)
    assert "shard group (16): 49.1% of each rank's shard is padding" in n16 and "shard_placement_fn" in n16


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


def test_fsdp2_block_and_embeddings_units():
    """--fsdp-wrap block+embeddings (torchtitan's units): the input embedding resharded after its forward, the
    final norm with the head unsharded from its forward to its post-backward, its reduce right after its own
    backward (docs/accuracy.md session 15: within 0.01% on ten harness runs)."""
    v, h, blk = 4096, 1024, 1024 * 1024
    tensors = [ParamTensor("model.embed_tokens.weight", (v, h), "bfloat16", "", "embedding")]
    tensors += [ParamTensor(f"model.layers.{i}.w.weight", (1024, 1024), "bfloat16", f"model.layers.{i}", "mlp")
                for i in range(4)]
    tensors += [ParamTensor("model.norm.weight", (h,), "bfloat16", "", "norm"),
                ParamTensor("lm_head.weight", (v, h), "bfloat16", "", "head")]
    inv = ParamInventory(model_name="toy", source="test", builder="test", family="llama", tensors=tuple(tensors),
                         dims=DIMS)
    base = settings("fsdp-full", 4)
    be = A.Settings(**{**base.__dict__, "torch": A.TorchKnobs(fsdp_wrap="block+embeddings")})
    f_block, f_be = A.timeline(inv, base), A.timeline(inv, be)
    head = 2 * (v * h + h)  # the norm + head unit unsharded, bf16
    # forward's end: the head unit and its all-gather output (the last block's output freed at its copy-out);
    # the block layout holds the whole root and the last block's output instead
    assert f_be.buffers["forward"] == 2 * head
    assert f_block.buffers["forward"] == 2 * (2 * v * h + h) + 2 * blk
    # at the head's reduce: its grads (bf16) and fp32 reduce-scatter input beside the prefetched last block
    reduce = [m for m in f_be.moments if m.at == Moment.LAST_BLOCK_BACKWARD_BEGINS][0]
    assert reduce.buffers == 2 * blk + (2 + 4) * (v * h + h)
    assert reduce.grads == 4 * (v * h + h) // 4  # its reduced shard
    assert any(m.at == Moment.FIRST_BLOCK_BACKWARD_BEGINS for m in f_be.moments)
    assert not any(m.at == Moment.FIRST_BLOCK_BACKWARD_BEGINS for m in f_block.moments)
    # mid-backward nothing of the root is held: below the block layout at every block moment
    for at in (Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD, Moment.INSIDE_FIRST_BLOCK_BACKWARD):
        b = max(m.buffers for m in f_block.moments if m.at == at)
        e = max(m.buffers for m in f_be.moments if m.at == at)
        assert e < b


def test_fsdp1_without_wrapping_is_one_flat_parameter():
    # --fsdp-version 1 --fsdp-wrap none: one FlatParameter padded to the shard group; at backward's end the view
    # grads are concatenated (both alive with the unsharded parameter), then resharded, cast to fp32 and
    # reduce-scattered into the new shard (docs/accuracy.md session 15: -0.00% on eight harness runs)
    from dataclasses import replace

    s = settings("fsdp-full", 3, recipe="fsdp-bf16")
    s = replace(s, strategy=get_strategy("fsdp-full", 1, "none"), torch=A.TorchKnobs(fsdp_version=1, fsdp_wrap="none"))
    lay = layouts.layout_sizes(TOY, s.strategy.layout, 3)
    whole = -(-PSI // 3) * 3
    assert lay.shard_numel == lay.optimizer_numel == whole // 3 and lay.shard_shapes == (((whole // 3,), whole // 3),)
    f = A.timeline(TOY, s)
    # unsharded bf16 forward on (the _mp_shard cast beside it at the unshard); at the end the bf16 flat grad, its
    # fp32 cast and the fp32 shard reduce-scattered into (6 B + 4 B / 3 per element)
    assert f.buffers["forward"] == 2 * whole
    assert f.buffers["backward-end"] == (2 + 4) * whole + 4 * (whole // 3)


def test_fsdp2_root_only_holds_everything():
    # --fsdp-wrap none (_fully_shard.py: the root's reshard_after_forward=None is False): the whole model unsharded
    # (bf16) with its flat all-gather output held to the root's post-forward, then at the root's post-backward every
    # grad unsharded with, once resharded, the fp32 reduce-scatter input (docs/accuracy.md session 14: -0.00%)
    s = settings("fsdp-full", 4)
    s = A.Settings(**{**s.__dict__, "torch": A.TorchKnobs(fsdp_wrap="none")})
    f = A.timeline(TOY, s)
    forward, loss, backward, end, _ = f.buffers.values()
    assert forward == 2 * 2 * PSI and loss == 2 * PSI
    assert end == 2 * PSI + max(2 * PSI, 4 * PSI)


def test_lion_and_schedule_free_adamw_states_and_step_scratch(inventories):
    """lion-pytorch's Lion: one state (exp_avg, the parameter's dtype), update_fn's clone and sum of it (two
    temporaries of the tensor stepped, freed when it returns); schedulefree's AdamWScheduleFree: z and exp_avg_sq,
    then one foreach temporary per tensor (its default on any device). Measured on the CPU harness within 0.01%
    (docs/accuracy.md, session 28)."""
    from memplan.precision import step_temporaries

    inv = inventories("llama-7b")
    lion = options.resolve(inv, JobRequest.of(gpus=1, optimizer="lion", activations="analytic")).settings
    adamw = options.resolve(inv, JobRequest.of(gpus=1, optimizer="adamw", activations="analytic")).settings
    sf = options.resolve(inv, JobRequest.of(gpus=1, optimizer="schedulefree", activations="analytic")).settings
    assert sf.optimizer.name == "adamw-schedulefree"
    pl, pa, ps = (A.estimate(inv, s) for s in (lion, adamw, sf))
    assert pl.phases[-1].optimizer_states_bytes * 2 == pa.phases[-1].optimizer_states_bytes
    assert ps.phases[-1].optimizer_states_bytes == pa.phases[-1].optimizer_states_bytes
    assert ps.assumptions["optimizer_impl"] == "foreach" and pl.assumptions["optimizer_impl"] == "single-tensor"
    largest = max(t.numel for t in inv.tensors)
    rc = get_recipe("pure-bf16")
    assert step_temporaries(get_optimizer("lion"), "single-tensor", 2, rc, [3, largest, 5]) == \
        rc.state_bytes * 2 * largest
