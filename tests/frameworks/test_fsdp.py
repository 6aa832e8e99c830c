"""FSDP2 and FSDP1 (and HSDP): exact bytes on hand-checkable inventories, buffer lifetimes per phase, units, resharding and dim-0 padding."""

import pytest
from toy import DIMS, PSI, TOY, make_inv, settings

from memplan import accounting as A
from memplan import layouts
from memplan.errors import SettingsError
from memplan.model.inventory import ParamInventory, ParamTensor, classify
from memplan.precision import get_optimizer, get_recipe
from memplan.request import JobRequest
from memplan.strategies import get_strategy
from memplan.timeline import Moment

M = Moment


def test_fsdp2_dim0_padding():
    inv = make_inv({"": [(5, 3)], "layers.0": [(10, 7)], "layers.1": [(9,)]})
    plan = A.estimate(inv, settings("fsdp-full", 4))
    shard = 2 * 3 + 3 * 7 + 3  # ceil(5/4)*3 + ceil(10/4)*7 + ceil(9/4)
    assert plan.peak.weights_bytes == 4 * shard  # fp32 sharded params (fsdp-bf16)
    assert plan.peak.optimizer_states_bytes == 8 * shard


def test_hsdp_one_replica_equals_full_shard():
    full = A.estimate(TOY, settings("fsdp-full", 8))
    hsdp = A.estimate(TOY, settings("hsdp", 8, gpus_per_node=8))
    assert full.phases == hsdp.phases


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
    # under expert parallelism the experts have their own shard group (8 over ep 2 x efsdp 8): nothing else pads
    from memplan import parallel as par

    ep = options.resolve(inv, JobRequest.of(gpus=16, strategy="fsdp-full", activations="analytic",
                                            parallel=par.Parallel(ep=2))).notes
    assert not [n for n in ep if "pads each parameter's dim 0" in n]


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
