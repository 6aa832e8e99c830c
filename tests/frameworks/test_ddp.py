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
