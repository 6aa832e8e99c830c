"""Tensor- and pipeline-parallel ranks replayed through the caching allocator, action by action, against the harness's allocations."""

from __future__ import annotations

import pytest
from replayed import harness_replay, harness_row

from memplan import accounting, options
from memplan.model.sources import build_inventory, resolve
from memplan.request import JobRequest


def test_tensor_parallel_ranks_are_replayed() -> None:
    # a TP rank without pipelining runs its own share traced as a model (HeldProfile.inner) under the data-parallel
    # framework's replay, and the allocator's overhead over that replay stands on the rank's own allocated peak
    # (loss_parallel raises it, sequence parallelism lowers it)
    from memplan.parallel import Parallel

    src = resolve("llama-3-8b")
    inv = build_inventory(src)
    for strategy, sp in (("fsdp-full", False), ("fsdp-full", True), ("ddp", False)):
        s = options.resolve(inv, JobRequest.of(gpus=8, gpus_per_node=8, gpu="h100-80g", device="cuda", strategy=strategy, micro_batch=1, seq_len=2048, parallel=Parallel(tp=2, pp=1, sp=sp)), config=src.config).settings
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and plan.reserved_why is None and r.allocated_bytes == plan.peak_bytes
        assert plan.reserved_peak_bytes == r.peak_bytes > r.allocated_bytes


def test_pipeline_ranks_are_replayed_action_by_action() -> None:
    # an FSDP2 or DDP pipeline rank walks its schedule's action list (frameworks/pipeline_replay.py); the
    # allocator's overhead stands on the rank's allocated peak as a TP rank's does; DeepSpeed's PipelineEngine
    # walks TrainSchedule. What is not replayed says why and is only a bound from below: FSDP2's CPU offload,
    # other wraps, a reshard group size
    from memplan.parallel import Parallel

    src = resolve("llama-3-8b")
    inv = build_inventory(src)

    def plan_of(p: Parallel, **kw: object) -> accounting.Plan:
        kw = {"strategy": "fsdp-full", **kw}
        return accounting.estimate(inv, options.resolve(inv, JobRequest.of(gpus=8, gpus_per_node=8, gpu="h100-80g", device="cuda", micro_batch=1, seq_len=2048, grad_accum=4, parallel=p, **kw), config=src.config).settings)

    for p in (Parallel(tp=2, pp=2), Parallel(pp=2, schedule="gpipe"), Parallel(pp=2, schedule="interleaved"),
              Parallel(pp=2, schedule="zbv"), Parallel(pp=2, schedule="dualpipev")):
        plan = plan_of(p)
        assert plan.reserved is not None and plan.reserved_why is None, p
        assert plan.reserved.model.startswith("FSDP2 under ")
        assert plan.reserved_peak_bytes > plan.peak_bytes == plan.reserved.allocated_bytes
        assert plan.capped is not None
    plan = plan_of(Parallel(tp=2, pp=2, sp=True))  # SP: the TP share's step, said in the replay's name
    assert plan.reserved is not None and plan.reserved.model.endswith("without SP's split")
    for view in (False, True):
        plan = plan_of(Parallel(pp=2), strategy="ddp", gradient_as_bucket_view=view)
        assert plan.reserved is not None and plan.reserved_why is None
        assert plan.reserved.model == ("DDP, gradients as bucket views, under 1F1B" if view else "DDP under 1F1B")
        assert sorted(plan.reserved.variants) == ["buckets held into the next backward",
                                                  "buckets released at the rebuild"]
        assert plan.reserved_peak_bytes > plan.peak_bytes == plan.reserved.allocated_bytes
    for strategy, p, kw, name in (("zero1", Parallel(pp=2), {}, "ZeRO-1"),
                                  ("zero1", Parallel(pp=2, tp=2), {}, "ZeRO-1"),  # its activations partitioned
                                  ("zero1", Parallel(pp=2), {"offload_optimizer": True}, "ZeRO-1 Offload"),
                                  ("zero0", Parallel(pp=2), {"precision": "deepspeed-fp16"},
                                   "DeepSpeed stage 0 (FP16_Optimizer)")):
        plan = plan_of(p, strategy=strategy, **kw)  # DeepSpeed's PipelineEngine, TrainSchedule's 1F1B
        assert plan.reserved is not None and plan.reserved_why is None, plan.reserved_why
        assert plan.reserved.model == name + " under DeepSpeed's PipelineEngine (1F1B)"
        assert plan.reserved_peak_bytes > plan.peak_bytes == plan.reserved.allocated_bytes
    for p, kw, why in ((Parallel(pp=2), {"cpu_offload": True}, "CPU offload under pipelining"),
                       (Parallel(pp=2), {"fsdp_wrap": "size:100000000"}, "under pipelining is not replayed")):
        plan = plan_of(p, **kw)
        assert plan.reserved is None and plan.reserved_why.startswith("pipeline parallelism") and why in \
            plan.reserved_why, plan.reserved_why
        # issue 42: no flat percentage: the reserved peak is bounded by the allocated one, the verdict open
        assert plan.reserved_peak_bytes == plan.peak_bytes and plan.bounded.endswith(plan.reserved_why)
        assert plan.required_bytes == plan.peak_bytes + plan.overhead_bytes and "allocator_bytes" not in \
            plan.overhead_detail and plan.fits is None


def test_ddp_pipeline_replay_walks_the_harness_s_allocations() -> None:
    # DDP per stage under torch.distributed.pipelining (frameworks/pipeline_replay.py _DdpStage: the Reducer's
    # buckets, .grad kept from the step's first backward, autocast's casts cached over the schedule step) against
    # the worst rank the harness measured (docs/accuracy.jsonl): 63,019,600 B, the replay's sequence -0.00%
    from memplan.parallel import Parallel

    name, peak, measured = harness_replay("ddp pp 2 1f1b, torch-amp, 4 micro-batches", 4, 2, strategy="ddp",
                                           grad_accum=4, parallel=Parallel(pp=2), fsdp_root_reshard="auto")
    assert name == "DDP under 1F1B"
    assert abs(peak - measured) <= measured // 2_000, (peak, measured)


@pytest.mark.parametrize("label,buckets", [("zero1 pp 2 (PipelineEngine), 4 micro-batches", {}),
                                           ("zero1 pp 2 (PipelineEngine) small buckets, 4 micro-batches",
                                            {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000})])
def test_pipeline_engine_replay_walks_the_harness_s_allocations(label: str, buckets: dict) -> None:
    # DeepSpeed's PipelineEngine with ZeRO-1 (frameworks/pipe_engine_replay.py: TrainSchedule's slots, the ipg
    # bucket made at the first hook and one more at reduce_gradients, the last stage's outputs and the inputs
    # their graphs keep) against the worst rank the harness measured: the default buckets' 2,036,469,800 B read
    # 2,036,463,106 (-0.00%). The small buckets' peak is the CPU harness's optimizer step, where DeepSpeed
    # built without its ops steps torch's AdamW with two partition-sized temporaries that CUDA's FusedAdam does
    # not make (bench/replay_harness.py's known differences): its rank's backward peak, 49,458,548 B measured
    # (docs/accuracy.jsonl's run, the trace read with MEMPLAN_TRACE_DIR), reads 49,386,314 (-0.15%)
    from memplan.parallel import Parallel

    name, peak, measured = harness_replay(label, 4, 2, stage=1, grad_accum=4, parallel=Parallel(pp=2), **buckets)
    assert name == "ZeRO-1 under DeepSpeed's PipelineEngine (1F1B)"
    if not buckets:
        assert abs(peak - measured) <= measured // 100_000, (peak, measured)
    else:
        assert peak == 49_386_314 and measured == 57_536_060


@pytest.mark.parametrize("label,layers,gpus,pp,schedule,m", [
    ("fsdp-full pp 2 1f1b, 4 micro-batches", 4, 2, 2, "1f1b", 4),
    ("fsdp-full pp 2 gpipe, 4 micro-batches", 4, 2, 2, "gpipe", 4),
    ("fsdp-full pp 2 interleaved, 4 micro-batches", 10, 2, 2, "interleaved", 4),
    ("fsdp-full pp 2 looped-bfs, 4 micro-batches", 10, 2, 2, "looped-bfs", 4),
    ("fsdp-full pp 4 1f1b, 8 micro-batches", 10, 4, 4, "1f1b", 8),
    ("fsdp-full pp 4 1f1b, 4 micro-batches", 8, 4, 4, "1f1b", 4),  # the last stage of one block
    ("fsdp-full pp 2 zbv (zero bubble), 4 micro-batches", 10, 2, 2, "zbv", 4),
    ("fsdp-full pp 2 dualpipev, 6 micro-batches", 10, 2, 2, "dualpipev", 6),
])
def test_pipeline_replay_walks_the_harness_s_allocations(label: str, layers: int, gpus: int, pp: int, schedule: str,
                                                          m: int) -> None:
    # the pipeline replay's sequence, counted as the CPU harness counts it, against the worst rank the harness
    # measured on torch.distributed.pipelining (docs/accuracy.jsonl, bench/replay_harness.py): within 0.6%, and
    # 3% for the zero-bubble schedules' split backward (which of the graph's tensors only the input gradient
    # needed is not known from the traced step: -2.89% there)
    from memplan.parallel import Parallel

    name, peak, measured = harness_replay(label, layers, gpus, strategy="fsdp-full", grad_accum=m,
                                           parallel=Parallel(pp=pp, schedule=schedule),
                                           fsdp_root_reshard="auto")
    assert name.startswith("FSDP2 under ")
    assert abs(peak - measured) <= measured * (30 if schedule in ("zbv", "dualpipev") else 6) // 1000, \
        (peak, measured)




@pytest.mark.parametrize("label,layers,schedule,m,within", [
    ("fsdp-full pp 2 interleaved, 4 micro-batches", 10, "interleaved", 4, 0.5),
    ("fsdp-full pp 2 looped-bfs, 4 micro-batches", 10, "looped-bfs", 4, 2.0),
    ("fsdp-full pp 2 dualpipev, 6 micro-batches", 10, "dualpipev", 6, 1.5),
])
def test_a_rank_of_several_stages_is_its_own_schedule_s(label: str, layers: int, schedule: str, m: int,
                                                        within: float) -> None:
    # each held micro-batch keeps its own stage's output, the stages' accumulators come with their first backward,
    # and the current micro-batch's activations are its own stage's (accounting.Layout): the worst rank's allocated
    # peak against the harness's (it was +4.59%, +15.35% and +6.72% with every stage accumulated, the last
    # stage's logits on every micro-batch and the rank's every block in the current one)
    from memplan import validation
    from memplan.parallel import Parallel

    row = harness_row(label, f"llama-7b, {layers} blocks", "none")
    job = JobRequest.of(device="cpu", cpu_isa=row[10], gpus=2, gpus_per_node=2, micro_batch=2, seq_len=128,
                        strategy="fsdp-full", grad_accum=m, parallel=Parallel(pp=2, schedule=schedule),
                        fsdp_root_reshard="auto")
    plan = validation.predict("llama-7b", job, layers=layers, hidden=256, vocab=2048)[0]
    error = 100 * (plan.peak_bytes - row[4]) / row[4]
    assert -0.5 <= error <= within, error


@pytest.mark.parametrize("label,gpus,ep,recompute", [
    ("fsdp-full ep 2", 2, 2, "none"),
    ("fsdp-full ep 2", 2, 2, "full"),
    pytest.param("fsdp-full ep 2 x efsdp 2, 4 ranks", 4, 2, "none", marks=pytest.mark.slow),
])
def test_expert_parallel_replay_walks_the_harness_s_allocations(label: str, gpus: int, ep: int,
                                                                recompute: str) -> None:
    # each block's experts module its own FSDP2 unit, acting where the traced step marks the module (its forward,
    # its backward, a recomputation's forward): the replay's sequence, counted as the CPU harness counts it,
    # against transformers' EP run on the harness (docs/accuracy.jsonl; bench/replay_harness.py): mixtral at 2
    # blocks, within 0.05% (the engine's moments, an upper bound inside a block, read +1.16% and +3.22%)
    from memplan.parallel import Parallel

    name, peak, measured = harness_replay(label, 2, gpus, model="mixtral-8x7b", recompute=recompute,
                                           strategy="fsdp-full", parallel=Parallel(ep=ep),
                                           fsdp_root_reshard="auto")
    assert name == "FSDP2"
    assert abs(peak - measured) <= measured // 2_000, (peak, measured)


@pytest.mark.parametrize("label,layers,schedule", [
    ("fsdp-full ep 2 x pp 2 1f1b, 4 micro-batches", 4, "1f1b"),
    pytest.param("fsdp-full ep 2 x pp 2 gpipe, 4 micro-batches", 4, "gpipe", marks=pytest.mark.slow),
    pytest.param("fsdp-full ep 2 x pp 2 interleaved, 4 micro-batches", 6, "interleaved", marks=pytest.mark.slow),
])
def test_expert_and_pipeline_parallel_replay_walks_the_harness_s_allocations(label: str, layers: int,
                                                                            schedule: str) -> None:
    # EP x PP (torchtitan): each stage's experts units kept unsharded from their first forward to REDUCE_GRAD
    # (their block's reshard_after_forward, False under pipelining), reduced in all_states order; each later
    # micro-batch's gradients added into the fp32 accumulators in module order, through the CPU's promoting
    # temporary: against the worst rank the harness measured (docs/accuracy.jsonl, session 47), within 0.5%
    # (-0.09%, -0.09%, -0.31% when written)
    from memplan.parallel import Parallel

    name, peak, measured = harness_replay(label, layers, 4, model="mixtral-8x7b", strategy="fsdp-full",
                                           grad_accum=4, parallel=Parallel(ep=2, pp=2, schedule=schedule),
                                           fsdp_root_reshard="auto")
    assert name.startswith("FSDP2 under ")
    assert abs(peak - measured) <= measured * 5 // 1000, (peak, measured)


def test_expert_parallel_ranks_are_replayed() -> None:
    # no flat allocator term under expert parallelism: the reserved peak is the replay's, above its allocated peak,
    # which is within 3% of the engine's (its moments inside a block an upper bound on the CPU harness)
    from memplan.parallel import Parallel

    src = resolve("mixtral-8x7b")
    inv = build_inventory(src)
    for gpus, ep, pp, rc in ((16, 8, 1, "none"), (16, 2, 1, "full"), (64, 8, 1, "none"), (32, 8, 2, "full")):
        # with pp 2: each pipeline rank's action list, its stages' experts units kept unsharded to REDUCE_GRAD
        s = options.resolve(inv, JobRequest.of(gpus=gpus, gpus_per_node=8, gpu="h100-80g", device="cuda",
                                               strategy="fsdp-full", micro_batch=1, seq_len=2048, recompute=rc,
                                               grad_accum=4 if pp > 1 else 1, parallel=Parallel(ep=ep, pp=pp)),
                            config=src.config).settings
        plan = accounting.estimate(inv, s)
        r = plan.reserved
        assert r is not None and plan.reserved_why is None, plan.reserved_why
        assert plan.reserved_peak_bytes == r.peak_bytes > r.allocated_bytes
        assert abs(r.allocated_bytes - plan.peak_bytes) <= plan.peak_bytes * 3 // 100
        assert plan.capped is not None
