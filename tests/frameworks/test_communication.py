"""Communication per GPU per optimizer step (memplan/comm.py): each framework's collectives, ring volumes, exact
integers, and which of them cross nodes."""

from __future__ import annotations

from memplan import options
from memplan.comm import communication
from memplan.model import sources
from memplan.request import JobRequest


def _comm(name: str = "llama-3-8b", **kw):
    src = sources.resolve(name)
    inv = sources.build_inventory(src)
    s = options.resolve(inv, JobRequest.of(activations="analytic", **kw)).settings
    return inv, communication(inv, s)


def test_ddp_all_reduces_fp32_gradients_once_per_step():
    inv, c = _comm(gpus=8, strategy="ddp", grad_accum=4)
    psi = inv.num_params
    (x,) = c["collectives"]
    assert (x["op"], x["group_size"], x["dtype_bytes"], x["times_per_step"]) == ("all-reduce", 8, 4, 1)
    assert x["bytes_per_gpu"] == 2 * 7 * 4 * psi // 8 == c["intra_node_bytes"] and c["inter_node_bytes"] == 0


def test_zero2_reduces_every_micro_step_zero1_once():
    inv, z1 = _comm(gpus=16, stage=1, grad_accum=4)
    _, z2 = _comm(gpus=16, stage=2, grad_accum=4)
    psi = inv.num_params
    grad = 2 * 15 * 2 * psi // 16  # DeepSpeed all-reduces each bf16 bucket (use_multi_rank_bucket_allreduce)
    gather = 15 * 2 * psi // 16
    assert z1["total_bytes"] == grad + gather and z1["inter_node_bytes"] == grad + gather  # 16 ranks: 2 nodes
    assert z2["total_bytes"] == 4 * grad + gather


def test_zero3_gathers_twice_and_hpz_keeps_the_backward_gather_in_the_node():
    from memplan import layouts

    inv, c = _comm(gpus=16, stage=3)
    persistent = layouts.layout_sizes(inv, "per-param-numel", 16, 100_000).persistent_numel
    gathered = 15 * 2 * (inv.num_params - persistent) // 16
    assert [x["bytes_per_gpu"] for x in c["collectives"]] == [gathered, gathered, 15 * 2 * inv.num_params // 16]
    _, h = _comm(gpus=16, stage=3, hpz_partition_size=8)
    back = h["collectives"][1]
    assert back["group_size"] == 8 and back["network"] == "intra-node"
    assert back["bytes_per_gpu"] == 7 * 2 * (inv.num_params - persistent) // 8


def test_qwz_groups_follow_cuda_quantizer():
    """partition_parameters.py CUDAQuantizer.quantize: ceil(n / 8000) up to a count whose 8 x count divides n, then
    doubled while groups stay above 8,000 elements."""
    from memplan.comm import qwz_groups

    assert qwz_groups(1_048_576) == 256  # 4096 x 4096 over 16: 132 up to 256, the first whose 8 x divides
    assert qwz_groups(8000) == 1 and qwz_groups(7) == 0 and qwz_groups(0) == 0
    n = 14_336 * 4096 // 16
    g = qwz_groups(n)
    assert n % (8 * g) == 0 and n / g <= 16_000


def test_qwz_gathers_int8_with_group_scales_and_qgz_splits_the_reduce_across_nodes():
    from memplan import layouts

    inv, c = _comm(gpus=16, stage=3, quantized_weights=True)
    persistent = layouts.layout_sizes(inv, "per-param-numel", 16, 100_000).persistent_numel
    ops = [(x["what"], x["dtype_bytes"], x["bytes_per_gpu"]) for x in c["collectives"]]
    int8 = 15 * (inv.num_params - persistent) // 16
    assert ops[0] == ("parameters, forward (qwZ int8)", 1, int8) and ops[2][2] == int8
    assert 0 < ops[1][2] < int8 // 1000  # fp32 scales: one per 4,000-16,000 elements
    assert ops[-1] == ("gradients", 2, 15 * 2 * inv.num_params // 16)
    # qgZ: one node reduces as without it (stage3.py: num_nodes > 1 only)
    _, one = _comm(gpus=8, stage=3, quantized_gradients=True)
    assert [x["what"] for x in one["collectives"]][-1] == "gradients"
    _, g = _comm(gpus=16, stage=3, quantized_gradients=True)
    q = [t for t in inv.tensors if len(t.shape) == 2 and t.numel % 32 == 0]
    qn = sum(t.numel for t in q)
    by = {x["what"]: x for x in g["collectives"]}
    intra = by["gradients, qgZ int4 (two per byte) within each node"]
    assert (intra["group_size"], intra["network"], intra["bytes_per_gpu"]) == (8, "intra-node", 7 * (qn // 2) // 8)
    inter = by["gradients, qgZ int4 (two per byte) across nodes, each node's reduced share"]
    assert (inter["group_size"], inter["network"], inter["bytes_per_gpu"]) == (2, "inter-node", (qn // 16) // 2)
    rest = g["collectives"][-1]
    assert rest["bytes_per_gpu"] == 15 * 2 * (inv.num_params - qn) // 16
    # the network carries a sixteenth of the bf16 reduce-scatter's gradient bytes
    assert inter["bytes_per_gpu"] < 15 * 2 * inv.num_params // 16 // 16


def test_fsdp_gathers_in_bf16_and_reduces_in_fp32_hsdp_across_replicas():
    inv, c = _comm(gpus=8, strategy="fsdp-full")
    psi = inv.num_params
    assert [(x["op"], x["dtype_bytes"]) for x in c["collectives"]] == [
        ("all-gather", 2), ("all-gather", 2), ("reduce-scatter", 4)]
    _, g = _comm(gpus=8, strategy="fsdp-grad-op")
    assert [x["what"] for x in g["collectives"]] == ["parameters, forward", "gradients"]
    _, h = _comm(gpus=32, strategy="hsdp")
    last = h["collectives"][-1]
    assert (last["op"], last["group_size"], last["network"]) == ("all-reduce", 4, "inter-node")
    assert last["bytes_per_gpu"] == 2 * 3 * 4 * (-(-psi // 8)) // 4
    assert h["inter_node_bytes"] == last["bytes_per_gpu"]  # the shard group stays in the node


def test_one_gpu_sends_nothing():
    _, c = _comm(gpus=1)
    assert c == {"intra_node_bytes": 0, "inter_node_bytes": 0, "total_bytes": 0, "collectives": []}


def test_zero12_reduce_paths():
    # stage_1_and_2.py average_tensor: use_multi_rank_bucket_allreduce false reduces each slice to its owner (a
    # reduce-scatter's volume); reduce_scatter false all-reduces in place (an all-reduce, as the default)
    inv, base = _comm(gpus=8, stage=2)
    psi = inv.num_params
    _, per_rank = _comm(gpus=8, stage=2, multi_rank_bucket_allreduce=False)
    _, in_place = _comm(gpus=8, stage=2, reduce_scatter=False)
    _, both = _comm(gpus=8, stage=2, reduce_scatter=False, multi_rank_bucket_allreduce=False)
    grads = [x for x in per_rank["collectives"] if x["what"].startswith("gradients")]
    assert grads[0]["op"] == "reduce-scatter" and grads[0]["bytes_per_gpu"] == 7 * 2 * psi // 8
    assert in_place == base == both
    # notes say what the memory figure assumes, and that stage 3 does not read the keys
    r = options.resolve(inv, JobRequest.of(activations="analytic", gpus=8, stage=2, reduce_scatter=False))
    assert any(n.startswith("reduce_scatter false") for n in r.notes)
    r = options.resolve(inv, JobRequest.of(activations="analytic", gpus=8, stage=3, multi_rank_bucket_allreduce=False))
    assert any("stages 1 and 2 only" in n for n in r.notes)
