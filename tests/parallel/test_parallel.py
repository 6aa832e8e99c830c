"""Tensor and pipeline parallelism (memplan/parallel/): each rank's tensors as the frameworks cut them, the
stage splits as torchtitan and DeepSpeed make them, the micro-batches in flight, and the bad input refused."""

import json
import re
from dataclasses import replace

import pytest

from memplan import accounting, options, parallel as par
from memplan.errors import SettingsError
from memplan.model import sources
from memplan.request import JobRequest, SearchSpace


def _inv(tmp_path, **cfg):
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 96,
            "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 192, "num_hidden_layers": 4,
            "vocab_size": 1000, "max_position_embeddings": 256, "torch_dtype": "float32",
            "tie_word_embeddings": False}
    base.update(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base))
    return sources.build_inventory(sources.resolve(str(path)), builder="analytic"), base


def _dtensor_shapes(config, tp):
    """Each parameter's local shape on TP rank 0 after torch's own parallelize_module with torchtitan's llama plan
    (ColwiseParallel on q/k/v, gate/up and the head; RowwiseParallel on o/down and the embedding), in one process
    over the fake process group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from memplan.model.meta_builder import hf_config

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.float32)
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "lm_head": ColwiseParallel()}
        for i in range(config["num_hidden_layers"]):
            pre = f"model.layers.{i}."
            plan.update({pre + "self_attn.q_proj": ColwiseParallel(), pre + "self_attn.k_proj": ColwiseParallel(),
                         pre + "self_attn.v_proj": ColwiseParallel(), pre + "self_attn.o_proj": RowwiseParallel(),
                         pre + "mlp.gate_proj": ColwiseParallel(), pre + "mlp.up_proj": ColwiseParallel(),
                         pre + "mlp.down_proj": RowwiseParallel()})
        parallelize_module(model, mesh, plan)
        return {n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
                for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cfg,tp", [({"num_key_value_heads": 3}, 3), ({"attention_bias": True, "vocab_size": 1001}, 3),
                                    ({}, 2)])
def test_tp_shapes_are_dtensors(tmp_path, cfg, tp):
    """torchtitan layout: every tensor's shape on the TP rank holding the most is DTensor's own local shape (the
    vocabulary by torch.chunk: ceil(V / tp) rows on rank 0; biases of column-parallel projections split)."""
    inv, config = _inv(tmp_path, **cfg)
    p = par.Parallel(tp=tp)
    got = {t.name: t.shape for t in par.tp_inventory(inv, p, par.TORCHTITAN).tensors}
    want = _dtensor_shapes(config, tp)
    assert got == want


def test_megatron_vocab_padding_and_kv_replication(tmp_path):
    """Megatron pads the vocabulary to a multiple of 128 x tp (_vocab_size_with_padding) and, with fewer key/value
    heads than TP ranks, gives each rank one head (replicated)."""
    inv, _ = _inv(tmp_path, num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    p = par.Parallel(tp=4)
    shapes = {t.name: t.shape for t in par.tp_inventory(inv, p, par.MEGATRON_DEEPSPEED).tensors}
    assert shapes["model.embed_tokens.weight"] == (1024 // 4, 128)  # 1000 -> 1024 = 2 x 512
    assert shapes["lm_head.weight"] == (256, 128)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 128)  # one head of 16
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 128)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (128, 32)
    assert par.padded_vocab(128256, par.Parallel(tp=8), par.MEGATRON_DEEPSPEED) == 16128  # 129024 / 8
    assert par.padded_vocab(128256, par.Parallel(tp=8), par.TORCHTITAN) == 16032
    assert par.padded_vocab(50257, par.Parallel(tp=2), par.MEGATRON_DEEPSPEED) == 25216  # 50432 / 2


def test_torchtitan_stage_split():
    """generate_llm_fqn_per_model_part: the embedding and the head count as one layer each, the first stages
    take the remainder."""
    ch = par.torchtitan_stages(2, 32)
    assert [len(c.layers) for c in ch] == [16, 16] and ch[0].first and ch[1].last
    ch = par.torchtitan_stages(4, 30)
    assert [len(c.layers) for c in ch] == [7, 8, 8, 7]
    assert [c.layers[0] for c in ch] == [0, 7, 15, 23]
    ch = par.torchtitan_stages(8, 6)  # 8 effective layers: the end stages hold only the embedding / the head
    assert ch[0].layers == () and ch[-1].layers == () and sum(len(c.layers) for c in ch) == 6


def test_partition_balanced_is_deepspeeds():
    from deepspeed.runtime.utils import partition_balanced

    for weights, parts in (([5, 3, 3, 3, 3, 7], 2), ([131, 54, 54, 54, 54, 54, 54, 131], 3), ([1] * 10, 4),
                           ([10, 1, 1, 1, 1, 1, 1, 1, 10], 4), ([3, 4], 4)):
        assert par.partition_balanced(weights, parts) == [int(x) for x in partition_balanced(weights, parts)]


@pytest.mark.parametrize("schedule,m,layout,want", [("1f1b", 8, par.TORCHTITAN, [4, 3, 2, 1]),
                                                    ("1f1b", 2, par.MEGATRON_DEEPSPEED, [2, 2, 2, 1]),
                                                    ("gpipe", 8, par.TORCHTITAN, [8, 8, 8, 8]),
                                                    ("looped-bfs", 8, par.TORCHTITAN, [16, 16, 16, 16]),
                                                    ("dualpipev", 8, par.TORCHTITAN, [9, 9, 9, 9])])
def test_in_flight(schedule, m, layout, want):
    p = par.Parallel(pp=4, schedule=schedule)
    assert [par.in_flight(p, layout, r, m) for r in range(4)] == want


def test_schedule_rules_are_torchs():
    """What torch's schedule constructors refuse is one line naming the rule (exit 2 on the command line)."""
    from memplan.parallel import schedules

    with pytest.raises(SettingsError, match="Schedule1F1B needs at least as many micro-batches as stages"):
        schedules.check("1f1b", 4, 2, 1)
    with pytest.raises(SettingsError, match="multiple of its rounds"):
        schedules.check("interleaved", 4, 10 - 1, 2)
    with pytest.raises(SettingsError, match="DualPipeV needs at least as many micro-batches as stages"):
        schedules.check("dualpipev", 4, 7, 2)
    with pytest.raises(SettingsError, match="exactly two"):
        schedules.check("zbv", 4, 8, 3)


def test_interleaved_in_flight_follows_torch():
    """torch's _get_warmup_ops for Interleaved1F1B: (v - 1) x micro-batches per round + 2 x (pp - 1 - rank), and
    the one after it."""
    p = par.Parallel(pp=4, schedule="interleaved", vpp=2)
    assert [par.in_flight(p, par.TORCHTITAN, r, 8) for r in range(4)] == [11, 9, 7, 5]


def _settings(inv, **kw):
    p = kw.pop("parallel")
    return options.resolve(inv, JobRequest.of(activations="analytic", device="cpu", parallel=p, **kw)).settings


def test_model_states_per_rank(tmp_path):
    """FSDP2 over the dp ranks of a TP x PP job shards each pipeline rank's share: its weights are exactly the
    share's fp32 elements padded per tensor to the dp ranks."""
    inv, _ = _inv(tmp_path)
    s = _settings(inv, gpus=8, strategy="fsdp-full", grad_accum=4, parallel=par.Parallel(tp=2, pp=2))
    plan = accounting.estimate(inv, s)
    lay = plan.layout
    assert lay.dp == 2 and [len(sh.blocks) for sh, _, _ in lay.ranks] == [2, 2]
    for (share, r_inv, _), rp in zip(lay.ranks, lay.plans):
        want = sum(4 * -(-t.shape[0] // 2) * (t.numel // t.shape[0]) for t in r_inv.tensors) + \
            r_inv.buffer_bytes(False)
        assert rp.peak.weights_bytes == want
    rep = accounting.estimate(inv, s)
    assert rep.peak_bytes == max(p.peak_bytes for p in lay.plans)


def test_stages_hold_their_micro_batches_in_flight(tmp_path):
    """1F1B on 4 stages of torchtitan's split of 8 blocks (2, 3, 2, 1 blocks: the embedding and the head count as
    one each): rank r holds 4 - r micro-batches, so rank 1 (3 blocks x 3 in flight) is the most loaded, and each
    rank's activations are its in-flight micro-batches' blocks."""
    inv, _ = _inv(tmp_path, num_hidden_layers=8, vocab_size=64)
    s = _settings(inv, gpus=4, strategy="ddp", grad_accum=8, seq_len=256, parallel=par.Parallel(pp=4))
    plan = accounting.estimate(inv, s)
    lay = plan.layout
    assert [len(sh.blocks) for sh, _, _ in lay.ranks] == [2, 3, 2, 1]
    assert [sh.in_flight for sh, _, _ in lay.ranks] == [4, 3, 2, 1]
    acts = [p.peak.activations_bytes for p in lay.plans]
    assert acts[1] > acts[0] > acts[2] > acts[3] and lay.worst == 1
    assert plan.peak_bytes == lay.plans[1].peak_bytes


def test_sequence_parallel_saves(tmp_path):
    """DTensor's SequenceParallel splits what each RMSNorm keeps over the TP ranks (its fp32 input, its
    normalised input in the residual dtype, its rsqrt): per token, each block's two norms and the final one keep
    1 - 1/tp of that less (measured with the harness: -0.06%, docs/accuracy.md)."""
    inv, _ = _inv(tmp_path)
    base = dict(gpus=2, strategy="fsdp-full", seq_len=256)
    s = _settings(inv, parallel=par.Parallel(tp=2), **base)
    a = accounting.estimate(inv, s)
    b = accounting.estimate(inv, _settings(inv, parallel=par.Parallel(tp=2, sp=True), **base))
    norm = par.norm_saved(96, s.recipe.residual_bytes)
    assert norm == 4 * 96 + s.recipe.residual_bytes * 96 + 4
    per = 2 * norm
    assert a.peak.activations_bytes - b.peak.activations_bytes == 4 * 256 * (per - per // 2) + 256 * (norm - norm // 2)


@pytest.mark.parametrize("kw,msg", [
    (dict(gpus=6, parallel=par.Parallel(tp=4)), "not a multiple of tp(4)"),
    (dict(gpus=4, parallel=par.Parallel(tp=4)), "does not divide the 6 attention heads"),
    (dict(gpus=3, parallel=par.Parallel(tp=3), num_key_value_heads=2), "does not divide the 2 key/value heads"),
    (dict(gpus=8, parallel=par.Parallel(pp=8)), "more stages than blocks + 2"),
    (dict(gpus=2, parallel=par.Parallel(pp=2, schedule="zb")), "unknown pipeline schedule"),
    (dict(gpus=2, parallel=par.Parallel(pp=2, vpp=2)), "needs a schedule that runs several stages per rank"),
    (dict(gpus=2, parallel=par.Parallel(pp=2, schedule="gpipe"), stage=1), "megatron-deepspeed runs 1f1b"),
    (dict(gpus=2, parallel=par.Parallel(pp=2), stage=2), "ZeRO-2 and ZeRO-3 are incompatible"),
    (dict(gpus=2, parallel=par.Parallel(tp=2), strategy="zero-optimizer"), "--strategy zero-optimizer"),
])
def test_bad_layouts(tmp_path, kw, msg):
    kw = dict(kw)
    extra = {k: kw.pop(k) for k in ("num_key_value_heads",) if k in kw}
    if "num_key_value_heads" in extra:
        extra["num_attention_heads"] = 6
    inv, _ = _inv(tmp_path, num_hidden_layers=4, **extra)
    kw.setdefault("strategy", None if "stage" in kw else "fsdp-full")
    with pytest.raises(SettingsError, match=re.escape(msg)):
        _settings(inv, **kw)


def test_interleaved_order_is_torchs():
    """The backwards of an interleaved rank in the order torch's Interleaved1F1B ran them on the harness (pp 2, two
    stages per rank, 4 micro-batches; rank 0's actions: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2
    0B3), each with the micro-batches then in flight per local stage."""
    p = par.Parallel(pp=2, schedule="interleaved")
    assert [(list(h), c) for h, c, _ in par.held_moments(p, 0, 4)] == [
        ([3, 2], 1), ([4, 1], 1), ([4, 1], 0), ([3, 2], 0), ([2, 2], 1), ([2, 1], 1), ([2, 0], 0), ([1, 0], 0)]
    # rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
    assert [c for _, c, _ in par.held_moments(p, 1, 4)] == [1, 1, 0, 0, 1, 1, 0, 0]


def test_model_parallel_communication(tmp_path):
    """Per micro-batch: four all-reduces of [micro-batch, seq, hidden] per block over the TP ranks (ring: 2(n-1)/n
    of the bytes), one more at each end of the model; the pipeline sends each stage's output and input gradient."""
    from memplan.comm import model_parallel

    inv, _ = _inv(tmp_path)
    s = _settings(inv, gpus=4, strategy="fsdp-full", grad_accum=4, seq_len=256, parallel=par.Parallel(tp=2, pp=2))
    plan = accounting.estimate(inv, s)
    act = 1 * 256 * 96 * s.recipe.compute_bytes
    rows = {(x["op"], x["what"].split(":")[1].split()[0]): x for x in model_parallel(plan.layout, 0)}
    blocks = rows[("all-reduce", "blocks'")]
    assert rows[("all-reduce", "the")]["times_per_step"] == 4  # the embedding on this (first) stage
    assert blocks["times_per_step"] == 4 * 4 * 2 and blocks["bytes_per_gpu"] == 32 * act  # 2(n-1)/n = 1 at n=2
    send = rows[("send", "stage")]
    assert send["times_per_step"] == 4 and send["bytes_per_gpu"] == 4 * 256 * 96 * s.recipe.residual_bytes


def test_plan_searches_layouts(inventories):
    """memplan plan --layouts: TP within a node and PP across nodes join the candidates; the recommendation's
    command reproduces its layout."""
    from memplan import planner

    inv = inventories("llama-3-8b")
    found = planner.search(inv, JobRequest.of(gpu_memory="40GiB", activations="analytic"),
                           SearchSpace(strategies=("fsdp-full",), recomputes=("full",), max_gpus=64,
                                               max_micro_batch=4, layouts=True))
    layouts = {(c.tp, c.pp) for c in found.candidates}
    assert (1, 1) in layouts and (8, 1) in layouts and (2, 2) in layouts and (1, 16) in layouts
    assert all(c.min_gpus is None or c.min_gpus % (c.tp * c.pp) == 0 for c in found.candidates)
    pp = next(c for c in found.candidates if c.pp == 4 and c.tp == 1)
    assert pp.settings.grad_accum == 4  # as many micro-batches as stages unless --grad-accum says
    line = planner.command_line("llama-3-8b", replace(found, best=pp, gpus=pp.min_gpus), [])
    assert "--pp 4" in line and "--grad-accum 4" in line
    assert all(c.cp == 1 for c in found.candidates)  # a short sequence: no context parallelism


def test_plan_adds_context_parallelism_for_long_sequences(inventories):
    """From --seq-len 16384 on the layouts add CP within a node (each CP rank at least 4,096 tokens), never with
    DeepSpeed; the recommendation's command carries --cp."""
    from memplan import planner

    inv = inventories("llama-3-8b")
    found = planner.search(inv, JobRequest.of(gpu_memory="80GiB", activations="analytic", seq_len=32768),
                           SearchSpace(strategies=("fsdp-full", "zero1"), recomputes=("full",), max_gpus=64,
                                               max_micro_batch=2, layouts=True))
    cps = {(c.strategy, c.tp, c.cp) for c in found.candidates if c.cp > 1}
    assert ("fsdp-full", 1, 2) in cps and ("fsdp-full", 2, 4) in cps and ("fsdp-full", 1, 8) in cps
    assert not any(st == "zero1" for st, _, _ in cps) and all(tp * cp <= 8 for _, tp, cp in cps)
    assert all(c.min_gpus is None or c.min_gpus % (c.tp * c.pp * c.cp) == 0 for c in found.candidates)
    cp = next(c for c in found.candidates if c.cp == 4 and c.tp == 1 and c.pp == 1)
    assert "--cp 4" in planner.command_line("llama-3-8b", replace(found, best=cp, gpus=cp.min_gpus or 4), [])


@pytest.mark.parametrize("par_kw,strategy", [(dict(tp=2, sp=True), "fsdp-full"), (dict(pp=2), "fsdp-full"),
                                             (dict(pp=2, schedule="gpipe"), "ddp"),
                                             (dict(pp=2, schedule="interleaved"), "fsdp-full"), (dict(pp=2), None)])
def test_every_phase_of_every_rank_is_whole_bytes(tmp_path, par_kw, strategy):
    inv, _ = _inv(tmp_path, num_hidden_layers=6)
    p = par.Parallel(**par_kw)
    kw = dict(strategy=strategy) if strategy else dict(stage=1)
    s = _settings(inv, gpus=4, grad_accum=4, seq_len=128, parallel=p, **kw)
    plan = accounting.estimate(inv, s)
    keys = ("weights_bytes", "master_weights_bytes", "grads_bytes", "optimizer_states_bytes", "activations_bytes",
            "buffers_bytes")
    for rp in plan.layout.plans:
        for ph in rp.phases:
            assert all(type(getattr(ph, k)) is int and getattr(ph, k) >= 0 for k in keys), ph
        assert rp.peak_bytes == max(ph.total_bytes for ph in rp.phases)
    worst = plan.layout.plans[plan.layout.worst]
    assert plan.peak_bytes == worst.peak_bytes and plan.peak == worst.peak
    # the worst rank: the most the card must hold, ties broken by the allocated peak (accounting.estimate)
    assert (plan.required_bytes, plan.peak_bytes) == max((rp.required_bytes, rp.peak_bytes) for rp in plan.layout.plans)


def test_accelerate_parallelism_config(tmp_path):
    """Accelerate's parallelism_config: tp_size runs transformers' tensor parallelism (logits gathered whole),
    dp_replicate_size > 1 is HSDP over dp_shard_size, cp_size runs context parallelism."""
    from memplan import jobfiles
    from memplan.errors import ConfigError

    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 16\nnum_machines: 2\n"
                    "fsdp_config:\n  fsdp_version: 2\nparallelism_config:\n  parallelism_config_tp_size: 2\n"
                    "  parallelism_config_dp_shard_size: 4\n  parallelism_config_dp_replicate_size: 2\n")
    job = jobfiles.read_accelerate(str(path))
    assert job.values["tp"] == 2 and job.values["loss_parallel"] is False
    assert job.values["strategy"] == "hsdp" and job.values["hsdp_shard_size"] == 4
    path.write_text("distributed_type: FSDP\nnum_processes: 8\nparallelism_config:\n  cp_size: 2\n")
    assert jobfiles.read_accelerate(str(path)).values["cp"] == 2
    path.write_text("distributed_type: FSDP\nnum_processes: 8\nparallelism_config:\n  cp_size: zero\n")
    with pytest.raises(ConfigError, match="cp_size"):
        jobfiles.read_accelerate(str(path))


def test_gathered_logits_hold_the_whole_vocabulary(tmp_path):
    """Without loss parallelism the last stage's loss runs on the gathered [tokens, vocab] logits: more than on the
    rank's rows, and the loss-parallel backward's extra tensor is gone."""
    inv, _ = _inv(tmp_path, vocab_size=8192)
    kw = dict(gpus=2, strategy="fsdp-full", seq_len=256)
    split = accounting.estimate(inv, _settings(inv, parallel=par.Parallel(tp=2), **kw))
    whole = accounting.estimate(inv, _settings(inv, parallel=par.Parallel(tp=2, loss_parallel=False), **kw))
    assert whole.peak.activations_bytes > split.peak.activations_bytes
    assert split.peak.weights_bytes == whole.peak.weights_bytes


def test_a_stage_of_a_model_traced_at_full_depth_takes_its_share():
    """A model traced at full depth (blocks that differ) has no per-block line: a pipeline stage of half its blocks
    keeps about half its saved activations (the average block's), not all of them."""
    from memplan.activations import TracedProfile, at_layers

    d = {"num_layers": 10, "traced_layers": 10, "per_layer": [0, 0], "live_after_forward": [1000, 5000],
         "forward_peak": [[1200, 6000]], "backward_peak": [[1300, 6500]]}
    whole = TracedProfile(d, 1, "test").terms("none", 2)
    half = at_layers(TracedProfile(d, 1, "test"), 5).terms("none", 2)
    assert half[2] + half[4] == (whole[2] + whole[4]) - 5 * (11000 // 10)


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 6, 8])
def test_zbv_order_is_torchs(pp, m):
    """ZB-V's input-gradient steps in torch's own order (ScheduleZBVZeroBubble._calculate_single_rank_operations),
    with the micro-batches each local stage holds (forwarded, not yet through their weight-gradient step)."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    sched = ScheduleZBVZeroBubble.__new__(ScheduleZBVZeroBubble)
    sched.pp_group_size, sched._n_microbatches, sched.num_stages = pp, m, 2 * pp
    for rank in range(pp):
        held, want = [0, 0], []
        for a in sched._calculate_single_rank_operations(rank):
            if a is None:
                continue
            c = 0 if a.stage_index == rank else 1
            kind = a.computation_type.value
            if kind == "F":
                held[c] += 1
            elif kind == "W":
                held[c] -= 1
            else:
                want.append((list(held), c))
        got = par.held_moments(par.Parallel(pp=pp, schedule="zbv"), rank, m)
        assert [(list(h), c) for h, c, _ in got] == want


def test_zbv_layout(tmp_path):
    """ZB-V: two stages per rank in a V (rank 0 the first and the last: the embedding and the head), --vpp other
    than 2 refused."""
    inv, _ = _inv(tmp_path, num_hidden_layers=6)
    p = par.Parallel(pp=2, schedule="zbv")
    chunks = par.rank_chunks(p, par.TORCHTITAN, inv)
    assert chunks[0][0].first and chunks[0][1].last and not chunks[1][0].first and not chunks[1][1].last
    with pytest.raises(SettingsError, match="ZBVZeroBubble runs exactly two stages per rank"):
        _settings(inv, gpus=2, strategy="fsdp-full", grad_accum=4, parallel=par.Parallel(pp=2, vpp=3,
                                                                                       schedule="zbv"))


def test_plan_adds_expert_parallelism_for_moe(inventories):
    """For a MoE model the layouts add EP under FSDP2 (ep dividing the experts, a multiple of tp); its command
    carries --ep; a dense model gets none."""
    from memplan import planner

    inv = inventories("mixtral-8x7b")
    found = planner.search(inv, JobRequest.of(gpu_memory="80GiB", activations="analytic"),
                           SearchSpace(strategies=("fsdp-full",), recomputes=("full",), max_gpus=64,
                                               max_micro_batch=2, layouts=True))
    eps = {(c.tp, c.ep) for c in found.candidates if c.ep > 1}
    assert {(1, 2), (1, 8), (2, 2), (4, 8), (8, 8)} <= eps and all(ep % tp == 0 for tp, ep in eps)
    assert all(c.min_gpus is None or c.min_gpus % (c.ep * c.pp) == 0 for c in found.candidates)
    ep = next(c for c in found.candidates if c.ep == 8 and c.tp == 1 and c.pp == 1)
    assert "--ep 8" in planner.command_line("mixtral-8x7b", replace(found, best=ep, gpus=ep.min_gpus or 8), [])
    # the counts the job refuses (24 GPUs: efsdp 3 does not divide an expert's dim 1) are skipped, not taken for
    # "does not fit": the bisection once went past every refused count to the largest
    assert ep.min_gpus == 16
    # with pipeline stages too (EP x PP): each stage's dp x tp ranks a multiple of ep
    both = next(c for c in found.candidates if c.ep == 8 and c.pp == 2 and c.tp == 1)
    assert both.min_gpus is not None and both.min_gpus % 16 == 0
    line = planner.command_line("mixtral-8x7b", replace(found, best=both, gpus=both.min_gpus), [])
    assert "--ep 8" in line and "--pp 2" in line
    dense = planner.search(inventories("llama-3-8b"), JobRequest.of(gpu_memory="80GiB", activations="analytic"),
                           SearchSpace(strategies=("fsdp-full",), recomputes=("full",), max_gpus=16,
                                               max_micro_batch=1, layouts=True))
    assert all(c.ep == 1 for c in dense.candidates)
