"""PyTorch DDP and ZeroRedundancyOptimizer: exact model-state bytes on hand-checkable inventories (DDP's gradient buckets, ZeRO-1's greedy partition)."""

from toy import PSI, TOY, make_inv, settings

from memplan import accounting as A
from memplan import layouts


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


def test_gradient_as_bucket_view_keeps_the_buckets_as_the_gradients():
    # the Reducer's buckets are allocated at construction and kept; with gradient_as_bucket_view they are the
    # gradients (each gradient autograd makes copied into its view and freed): the whole step holds them, forward
    # included, and nothing beside them at backward's end (frameworks/ddp.py whole_step_grads)
    plain = A.estimate(TOY, settings("ddp", 2))
    view = A.estimate(TOY, settings("ddp", 2, torch=A.TorchKnobs(gradient_as_bucket_view=True)))
    for a, b in zip(plain.phases, view.phases):
        assert b.grads_bytes == 4 * PSI, b.name
        assert b.grads_bytes + b.buffers_bytes <= a.grads_bytes + a.buffers_bytes, b.name
    assert view.phases[0].total_bytes == plain.phases[0].total_bytes  # forward: the buckets either way
    assert view.peak_bytes <= plain.peak_bytes


def test_gradient_as_bucket_view_replay_walks_the_harness_s_allocations():
    # the replay with the gradients as bucket views (ddp_replay.replay_ddp as_view) against the harness: at 2
    # micro-batches of 16 tokens the kept gradients are the buckets, 10.5 MB under DDP's own (docs/accuracy.jsonl)
    import pytest

    pytest.importorskip("transformers")
    from replayed import harness_replay

    name, peak, measured = harness_replay("ddp gradient_as_bucket_view, seq 16, 2 micro-batches", 2, 2, seq_len=16,
                                           strategy="ddp", grad_accum=2, gradient_as_bucket_view=True,
                                           fsdp_root_reshard="auto")
    assert name == "DDP, gradients as bucket views"
    _, plain, plain_measured = harness_replay("ddp, seq 16, 2 micro-batches", 2, 2, seq_len=16, strategy="ddp",
                                              grad_accum=2, fsdp_root_reshard="auto")
    # both peak at the head's weight-gradient GEMM of the second micro-step, whose CPU scratch (kernels.py
    # cpu_gemm_scratch) is a point of the traced timeline, not an allocation the replay makes: the two replays
    # read under by it alike, and what the views save is the harness's to the byte (10,523,648 B)
    assert plain - peak == plain_measured - measured == 10_523_648, (plain, peak, plain_measured, measured)
    assert abs(peak - measured) <= measured * 25 // 1_000, (peak, measured)
