"""Expert parallelism (--ep) under FSDP2: each rank's experts, their shards, the bad inputs, and the traffic."""

from __future__ import annotations

import json
import re

import pytest

from memplan import accounting, layouts, options, parallel as par
from memplan import strategies as S
from memplan.accounting import job_communication
from memplan.comm import model_parallel
from memplan.errors import SettingsError
from memplan.model import sources
from memplan.request import JobRequest

MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 448,
           "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024,
           "max_position_embeddings": 512, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def _inv(tmp_path, **cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MIXTRAL, **cfg}))
    return sources.build_inventory(sources.resolve(str(path)), builder="analytic")


def _settings(inv, p, **kw):
    kw.setdefault("strategy", "fsdp-full")
    return options.resolve(inv, JobRequest.of(activations="analytic", device="cpu", parallel=p, **kw)).settings


def _fsdp2_local_shapes(config, dp, ep, tp=1):
    """Each parameter's local shape on rank 0 after transformers' expert-parallel plan (the harness's
    expert_parallelize: MoEParamShard Shard(0) over the EP mesh, AllToAllEP) and FSDP2: the experts fully_shard-ed over the efsdp mesh,
    then each block and the root over dp (transformers' apply_fully_sharded_data_parallelism), in one process over
    the fake process group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from memplan.harness.model_parallel import expert_parallelize
    from memplan.model.meta_builder import hf_config

    from memplan.harness.model_parallel import tensor_parallelize

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * tp)
    try:
        mesh = init_device_mesh("cpu", (1, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        emesh = init_device_mesh("cpu", (1, dp * tp // ep, ep), mesh_dim_names=("pp", "efsdp", "ep"))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.float32)
        experts = expert_parallelize(model, emesh["ep"], mesh["tp"])
        if tp > 1:  # torchtitan's TP plan on the attention (and any dense MLP), the experts left to EP
            tensor_parallelize(model, list(model.model.layers), mesh["tp"], False, whole=True)
        for m in experts:
            fully_shard(m, mesh=emesh["efsdp"])
        for block in model.model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dp,ep", [(4, 2), (4, 4), (2, 2), (8, 2)])
def test_each_tensors_shard_is_fsdp2s(tmp_path, dp, ep):
    """Every parameter's shard on a rank, experts included (E / ep whole experts, dim 0 padded over efsdp =
    dp / ep), is the local tensor torch and transformers give it."""
    inv = _inv(tmp_path)
    s = _settings(inv, par.Parallel(ep=ep), gpus=dp)
    lay = accounting.layout(inv, s)
    _, r_inv, r_s = lay.ranks[0]
    assert [t.shape[0] for t in r_inv.tensors if t.category == "experts"] == [8 // ep] * 4
    sizes = layouts.layout_sizes(r_inv, S.PER_PARAM_DIM0, dp)
    want = _fsdp2_local_shapes({**MIXTRAL, "torch_dtype": "float32"}, dp, ep)
    got = {t.name: shape for t, (shape, _) in zip(r_inv.tensors, sizes.shard_shapes)}
    assert got == want


@pytest.mark.parametrize("dp,tp,ep", [(1, 2, 2), (2, 2, 2), (2, 2, 4)])
def test_tp_by_ep_shards_are_torchs(tmp_path, dp, tp, ep):
    """EP with TP (transformers: ep a multiple of tp): the attention split by TP, the experts whole per EP rank and
    FSDP2-sharded over efsdp = dp x tp / ep: every local tensor as torch makes it."""
    inv = _inv(tmp_path)
    s = _settings(inv, par.Parallel(ep=ep, tp=tp), gpus=dp * tp)
    _, r_inv, _ = accounting.layout(inv, s).ranks[0]
    sizes = layouts.layout_sizes(r_inv, S.PER_PARAM_DIM0, dp)
    got = {t.name: shape for t, (shape, _) in zip(r_inv.tensors, sizes.shard_shapes)}
    assert got == _fsdp2_local_shapes({**MIXTRAL, "torch_dtype": "float32"}, dp, ep, tp)


def test_ep_must_be_a_multiple_of_tp(tmp_path):
    inv = _inv(tmp_path, num_key_value_heads=4)
    with pytest.raises(SettingsError, match="ep must be a multiple of tp"):
        _settings(inv, par.Parallel(ep=2, tp=4), gpus=8)


def test_model_states_equal_the_data_parallel_ones(tmp_path):
    """Without TP, E / ep experts over dp / ep ranks leave each rank the same elements as E over dp
    (ceil((E / ep) / (dp / ep)) = ceil(E / dp) rows), so the model states do not move; the gathered experts do."""
    inv = _inv(tmp_path)
    plain = accounting.estimate(inv, _settings(inv, None, gpus=4))
    ep = accounting.estimate(inv, _settings(inv, par.Parallel(ep=4), gpus=4))
    for k in ("weights_bytes", "optimizer_states_bytes"):
        assert getattr(ep.peak, k) == getattr(plain.peak, k)
    assert ep.phases[-1].grads_bytes == plain.phases[-1].grads_bytes
    # the largest gathered unit: the block with a quarter of its experts
    g_plain = layouts.gather_sizes(inv, S.PER_PARAM_DIM0, 4)
    r_inv = accounting.layout(inv, _settings(inv, par.Parallel(ep=4), gpus=4)).ranks[0][1]
    g_ep = layouts.gather_sizes(r_inv, S.PER_PARAM_DIM0, 4)
    experts = sum(t.numel for t in inv.tensors if t.category == "experts" and t.block == inv.layer_blocks[0].name)
    assert g_plain.largest_block - g_ep.largest_block == experts - experts // 4
    assert g_ep.expert_world == 1 and g_ep.block_experts == (experts // 4,) * 2


@pytest.mark.parametrize("kw,msg", [
    (dict(gpus=4, p=par.Parallel(ep=3)), "--ep 3 does not divide the 8 routed experts"),
    (dict(gpus=2, p=par.Parallel(ep=4)), "does not divide the data-parallel ranks dp x tp = 2"),
    (dict(gpus=4, p=par.Parallel(ep=2), stage=3, strategy=None), "--ep with --strategy zero3"),
    (dict(gpus=4, p=par.Parallel(ep=2), strategy="ddp"), "--ep with --strategy ddp"),
    (dict(gpus=4, p=par.Parallel(ep=0)), "--ep must be at least 1"),
])
def test_bad_expert_layouts(tmp_path, kw, msg):
    inv = _inv(tmp_path)
    p = kw.pop("p")
    with pytest.raises(SettingsError, match=re.escape(msg)):
        _settings(inv, p, **kw)


def test_a_dense_model_has_no_experts_to_split(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MIXTRAL, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    inv = sources.build_inventory(sources.resolve(str(path)), builder="analytic")
    with pytest.raises(SettingsError, match="the model has no routed experts"):
        _settings(inv, par.Parallel(ep=2), gpus=2)


def test_expert_parallel_traffic(tmp_path):
    """AllToAllEP per MoE block and micro-batch: tokens x top_k rows of hidden out and back, forward and backward,
    (ep - 1) / ep of them leaving the rank; the experts' FSDP2 collectives over efsdp, the rest over dp."""
    inv = _inv(tmp_path)
    s = _settings(inv, par.Parallel(ep=2), gpus=4, seq_len=128, micro_batch=2, grad_accum=3)
    lay = accounting.estimate(inv, s).layout
    rows = {x["what"].split(":")[0].split(",")[0]: x for x in job_communication(inv, s)["collectives"]
            + model_parallel(lay, 0)}
    a2a = rows["expert parallel"]
    assert a2a["op"] == "all-to-all" and a2a["group_size"] == 2 and a2a["times_per_step"] == 3 * 4 * 2
    assert a2a["bytes_per_gpu"] == 3 * 4 * 2 * (2 * 128 * 2 * 256 * s.recipe.compute_bytes) // 2
    assert rows["experts"]["group_size"] == 2 and rows["parameters"]["group_size"] == 4


def test_every_moment_is_whole_bytes_and_the_peak_is_below_one_unit_per_block(tmp_path):
    """The experts as their own unit never hold more than the block as one unit with the same experts would."""
    inv = _inv(tmp_path, num_hidden_layers=4)
    s = _settings(inv, par.Parallel(ep=2), gpus=4)
    plan = accounting.estimate(inv, s)
    assert all(isinstance(v, int) and v >= 0 for ph in plan.phases for v in vars(ph).values() if isinstance(v, int))
    assert plan.assumptions.get("experts_shard_group") == 2


def test_experts_shard_on_dim_1_when_the_expert_fsdp_ranks_outnumber_them(tmp_path):
    """torchtitan's apply_fsdp shards the experts on dim 1 once efsdp x ep > num_experts (more expert-FSDP ranks than
    a rank's local experts): each rank holds 1/efsdp of every local expert, not one padded row of dim 0; FSDP2
    shards dim 1 only evenly, so an uneven one is refused."""
    inv = _inv(tmp_path)
    s = _settings(inv, par.Parallel(ep=2), gpus=16)  # efsdp 8 > 4 local experts
    r_inv = accounting.layout(inv, s).ranks[0][1]
    sizes = layouts.layout_sizes(r_inv, S.PER_PARAM_DIM0, 16)
    experts = [t for t in r_inv.tensors if t.shard_split > 1]
    assert experts and all(layouts.shard_dim(t, 8) == 1 for t in experts)
    others = sum(-(-t.shape[0] // 16) * (t.numel // t.shape[0]) if t.shape else 1
                 for t in r_inv.tensors if t.shard_split == 1)
    assert sizes.shard_numel == others + sum(t.numel // 8 for t in experts)
    # the copy-out's chunk-cat temporaries (_fsdp_collectives.py) follow the placement: only on dim 1
    assert layouts.gather_sizes(r_inv, S.PER_PARAM_DIM0, 16).experts_on_dim1
    small = accounting.layout(inv, _settings(inv, par.Parallel(ep=2), gpus=4)).ranks[0][1]
    assert not layouts.gather_sizes(small, S.PER_PARAM_DIM0, 4).experts_on_dim1
    with pytest.raises(SettingsError, match="FSDP2 shards dim 1 only evenly"):
        _settings(inv, par.Parallel(ep=2), gpus=12, gpus_per_node=12)  # efsdp 6: 896 rows of gate_up_proj


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_traced_step_marks_each_experts_module(recompute):
    """An EP rank's traced step marks where each block's experts module runs (tracing/step.py install_experts):
    its forward inside the block's forward, its backward inside the block's backward, its end after its start, and
    with recompute its recomputation inside the block's backward (its end only where the recomputation ran past
    the module); the replay's FSDP2 units act there (frameworks/fsdp2_replay.py
    experts_at)."""
    pytest.importorskip("transformers")
    from memplan.activations.kernels import Target
    from memplan.activations.tracing.segments import alloc_events
    from memplan.activations.tracing.step import one_step

    cfg = {**MIXTRAL, par.EP_KEY: 2}
    a, b = (one_step(cfg, mb, 64, "fsdp-bf16", "sdpa", recompute, Target(device="cuda", arch="sm90")) for mb in (2, 4))
    ev = alloc_events(a, b, expand=True)
    assert ev is not None
    for i in range(2):
        assert ev["fs"][i] <= ev["xfs"][i] < ev["xfe"][i] <= ev["fe"][i]
        assert ev["bs"][i] <= ev["xbs"][i] < ev["xbe"][i] <= ev["be"][i]
        if recompute == "full":
            # torch.utils.checkpoint stops recomputing once the saved tensors are back (set_checkpoint_early_stop,
            # on by default): a module it stops inside never returns, so its post-forward never runs (-1)
            # it runs where the block's backward first unpacks a saved tensor: here inside the experts' backward
            assert ev["bs"][i] <= ev["xrs"][i] < ev["be"][i]
            assert ev["xre"][i] == -1 or ev["xrs"][i] < ev["xre"][i] <= ev["be"][i]
        else:
            assert ev["xrs"][i] == ev["xre"][i] == -1


def test_expert_parallel_under_pipelining(tmp_path):
    """EP x PP as torchtitan lays it out: each pipeline rank holds its own blocks' experts, E / ep of them, FSDP2-
    sharded over efsdp = dp x tp / ep of the stage's ranks (ParamTensor.shard_split); the experts units keep their
    block's reshard_after_forward, False under pipelining (llama4/infra/parallelize.py apply_fsdp); asked to
    reshard after forward, the job is refused with the reason."""
    inv = _inv(tmp_path, num_hidden_layers=4)
    s = _settings(inv, par.Parallel(ep=2, pp=2), gpus=8, grad_accum=4)
    lay = accounting.layout(inv, s)
    assert len(lay.ranks) == 2
    for share, r_inv, _ in lay.ranks:
        experts = [t for t in r_inv.tensors if t.category == "experts"]
        assert {t.shape[0] for t in experts} == {4} and {t.shard_split for t in experts} == {2}
        names = {b.name for b in r_inv.layer_blocks}
        assert {t.block for t in experts} <= names and len({t.block for t in experts}) == len(share.blocks)
    plan = accounting.estimate(inv, s)
    assert plan.layout is not None and plan.layout.report()["efsdp"] == 2
    assert all(isinstance(v, int) and v > 0 for v in (plan.peak_bytes, plan.required_bytes))
    with pytest.raises(SettingsError, match=re.escape("--ep with --pp: modelled with the blocks and experts kept")):
        accounting.estimate(inv, _settings(inv, par.Parallel(ep=2, pp=2), gpus=8, grad_accum=4,
                                           reshard_after_forward=True))
