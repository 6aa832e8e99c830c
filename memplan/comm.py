"""Communication per GPU per optimizer step: the collectives each framework issues in a step, their groups and
dtypes, and the bytes one GPU sends over them with ring algorithms (all-reduce 2(n-1)/n x S, reduce-scatter and
all-gather (n-1)/n x S for a tensor of S bytes over n ranks). A collective whose group spans nodes goes over the
network (inter-node); one inside a node over NVLink/PCIe (intra-node). Integers; no torch.

What each framework issues (its source):
- DDP (torch/nn/parallel/distributed.py, reducer.cpp): one all-reduce of every gradient, in the gradient's dtype,
  per optimizer step (gradient accumulation under no_sync, as Accelerate's accumulate() does). Horovod
  (horovod/torch/optimizer.py): the same all-reduce, through its fusion buffer, in fp16 with fp16 compression.
- ZeroRedundancyOptimizer: DDP's all-reduce, then each rank broadcasts its updated partition
  (zero_redundancy_optimizer.py _sync_params): an all-gather's volume.
- DeepSpeed ZeRO-1/2 (runtime/zero/stage_1_and_2.py): the gradient buckets are all-reduced in the gradients'
  dtype (average_tensor: with use_multi_rank_bucket_allreduce, the default, each bucket is all-reduced and every
  rank keeps its partition's slices; with it off, reduced to each slice's owner, a reduce-scatter's volume;
  reduce_scatter false all-reduces too). ZeRO-2 reduces in every micro-step's backward
  (partition_gradients), ZeRO-1 at the accumulation boundary only. After the step the updated 16-bit
  partitions are all-gathered (all_gather_dp_groups).
- DeepSpeed ZeRO-3 (stage3.py, partitioned_param_coordinator.py): parameters all-gathered in 16 bits in forward
  and again in backward (with hpZ, zero_hpz_partition_size > 1, the backward gathers within the secondary,
  intra-node group), gradients reduce-scattered in 16 bits every micro-step; persistent parameters (numel <=
  param_persistence_threshold) are never gathered. ZeRO++ (DeepSpeed 0.19.8): qwZ (zero_quantized_weights) gathers
  int8 weights and each fetched module's fp32 group scales, forward and backward (partition_parameters.py
  _all_gather_coalesced, CUDAQuantizer); qgZ (zero_quantized_gradients), across nodes only (stage3.py
  __avg_scatter_grads: num_nodes > 1), replaces the reduce-scatter of each 2-D gradient divisible by 2 x the world
  size with an int4 all-to-all within the node and one of the node's reduced share across nodes, with their fp32
  scales (coalesced_collectives.py all_to_all_quant_reduce); the rest stay on reduce_scatter_coalesced.
- FSDP2 / FSDP1 (torch/distributed/fsdp): unsharded parameters all-gathered in the mixed-precision param dtype
  in forward and, when resharded after forward, again in backward; gradients reduce-scattered in the reduce
  dtype every micro-step (no_sync not assumed); NO_SHARD all-reduces; HSDP reduce-scatters within the shard
  group and all-reduces the shards across replicas.
"""

from __future__ import annotations

from typing import Any

from memplan.parallel import sp_tokens
from memplan.precision import float8_gathered
from memplan.settings import Settings, reshard_after_forward, shard_group_size


def _ring(op: str, n: int, nbytes: int) -> int:
    if n <= 1:
        return 0
    return (2 if op == "all-reduce" else 1) * (n - 1) * nbytes // n  # all-to-all: (n - 1) / n of it leaves


def qwz_groups(numel: int) -> int:
    """CUDAQuantizer.quantize's group count for a partition of ``numel`` int8 elements (partition_parameters.py,
    DeepSpeed 0.19.8): from ceil(numel / 8000) up to the first count whose 8 x count divides numel, then doubled
    while the groups stay above 8,000 elements; 0 where no count divides (DeepSpeed's assert)."""
    if numel <= 0:
        return 0
    groups = -(-numel // 8000)
    while groups < numel and numel % (8 * groups):
        groups += 1
    if numel % (8 * groups):
        return 0
    while numel % (16 * groups) == 0 and numel / groups > 8000:
        groups *= 2
    return groups


def _qwz_scales(inv: Any, n: int, threshold: int) -> int:
    """The fp32 scales one rank contributes to qwZ's all-gathers of every gathered parameter once: each module's
    parameters are fetched and quantized together (partitioned_param_coordinator.py fetch_sub_module, one
    coalesced all-gather per module: the concatenation of its partitions, ceil(numel / n) each)."""
    parts: dict[str, int] = {}
    for t in inv.tensors:
        if t.numel <= threshold:  # persistent: never gathered
            continue
        mod = t.name.rsplit(".", 1)[0]
        parts[mod] = parts.get(mod, 0) + -(-t.numel // n)
    return sum(qwz_groups(v) for v in parts.values())


def communication(inv: Any, s: Settings) -> dict[str, Any]:
    """Per GPU, per optimizer step: each collective (op, what, group size, dtype bytes, times per step, bytes
    sent, network) and the totals intra- and inter-node."""
    from memplan import layouts

    st, rc, c = s.strategy, s.recipe, s.cluster
    persistent_numel = 0
    if st.memory_model == "zero3":
        persistent_numel = layouts.layout_sizes(inv, st.layout, shard_group_size(s),
                                                s.ds.param_persistence_threshold).persistent_numel
    # gradients are reduced for the trainable parameters only; all-gathers move every parameter (frozen too)
    psi, every, ga = inv.trainable_params, inv.num_params, s.grad_accum
    out: list[dict[str, Any]] = []

    def add(op: str, what: str, group: int, width: int, numel: int, times: int, within_node: bool = False,
            across_nodes: bool = False) -> None:
        """``within_node``: the group is one node's ranks; ``across_nodes``: one rank per node (HSDP replicas);
        else ranks in order, spanning nodes once the group is larger than a node."""
        if group <= 1 or times <= 0 or numel <= 0:
            return
        per = _ring(op, group, width * numel)
        inter = across_nodes or (not within_node and group > c.ranks_per_node)
        out.append({"op": op, "what": what, "group_size": group, "dtype_bytes": width, "times_per_step": times,
                    "bytes_per_gpu": per * times, "network": "inter-node" if inter else "intra-node"})

    n_all = c.gpus
    mm = st.memory_model
    if st.one_gpu or n_all <= 1:
        pass
    elif mm == "ddp" and st.fusion_buffer:  # in place through the fusion buffer, fp16 if compressed
        width = 2 if s.horovod.compression == "fp16" else rc.grad_bytes
        add("all-reduce", "gradients (Horovod fusion buffer)", n_all, width, psi, 1)
    elif mm == "ddp":
        # the buckets hold the parameters no loss reads too (zeros: ParamTensor.unused)
        add("all-reduce", "gradients (DDP buckets)", n_all, rc.grad_bytes, psi + inv.unused_params, 1)
        if st.shard_optimizer:  # ZeroRedundancyOptimizer's parameter broadcast
            add("all-gather", "updated parameters (partition broadcast)", n_all, rc.param_bytes, psi, 1)
    elif mm == "zero12":
        times = ga if st.shard_grads else 1
        if st.zero_stage in (1, 2) and s.ds.reduce_scatter and not s.ds.multi_rank_bucket_allreduce:
            # average_tensor: each bucket's slices go to their owner with dist.reduce (allreduce_no_retain)
            add("reduce-scatter", "gradients (ZeRO buckets, each slice reduced to its owner rank)", n_all,
                rc.grad_bytes, psi, times)
        else:
            add("all-reduce", "gradients (ZeRO buckets)", n_all, rc.grad_bytes, psi, times)
        if st.shard_optimizer:
            add("all-gather", "updated 16-bit partitions", n_all, rc.param_bytes, psi, 1)
    elif mm == "zero3":
        gathered = every - persistent_numel
        hpz = s.ds.hpz_partition_size
        if s.ds.quantized_weights:  # qwZ: int8 weights and each module's fp32 group scales
            scales = _qwz_scales(inv, n_all, s.ds.param_persistence_threshold)
            add("all-gather", "parameters, forward (qwZ int8)", n_all, 1, gathered, ga)
            add("all-gather", "qwZ fp32 group scales, forward", n_all, 4, n_all * scales, ga)
            if hpz > 1:
                add("all-gather", "parameters, backward (qwZ int8, hpZ secondary group)", hpz, 1, gathered, ga,
                    within_node=True)
                add("all-gather", "qwZ fp32 group scales, backward (hpZ secondary group)", hpz, 4,
                    hpz * _qwz_scales(inv, hpz, s.ds.param_persistence_threshold), ga, within_node=True)
            else:
                add("all-gather", "parameters, backward (qwZ int8)", n_all, 1, gathered, ga)
                add("all-gather", "qwZ fp32 group scales, backward", n_all, 4, n_all * scales, ga)
        else:
            add("all-gather", "parameters, forward", n_all, rc.param_bytes, gathered, ga)
            if hpz > 1:
                add("all-gather", "parameters, backward (hpZ secondary group)", hpz, rc.param_bytes, gathered, ga,
                    within_node=True)
            else:
                add("all-gather", "parameters, backward", n_all, rc.param_bytes, gathered, ga)
        nodes = n_all // max(c.gpus_per_node, 1)
        if s.ds.quantized_gradients and nodes > 1:
            local = c.gpus_per_node
            quant = [t for t in inv.tensors if t.trainable and len(t.shape) == 2 and t.numel % (2 * n_all) == 0]
            q_numel = sum(t.numel for t in quant)
            q_groups = sum(max(t.shape[0], t.shape[1], n_all) for t in quant)
            add("all-to-all", "gradients, qgZ int4 (two per byte) within each node", local, 1, q_numel // 2, ga,
                within_node=True)
            add("all-to-all", "qgZ fp32 scales within each node", local, 4, q_groups, ga, within_node=True)
            add("all-to-all", "gradients, qgZ int4 (two per byte) across nodes, each node's reduced share", nodes, 1,
                q_numel // (2 * local), ga, across_nodes=True)
            add("all-to-all", "qgZ fp32 scales across nodes", nodes, 4, q_groups // local, ga, across_nodes=True)
            add("reduce-scatter", "gradients qgZ leaves to reduce_scatter_coalesced (1-D, or not divisible by 2 x "
                "the world size)", n_all, rc.grad_bytes, psi - q_numel, ga)
        else:
            add("reduce-scatter", "gradients", n_all, rc.grad_bytes, psi, ga)
    else:  # fsdp2 / fsdp1
        n = shard_group_size(s)
        within = st.shard_within_node
        # a pipeline stage: gradients accumulate unsharded and are reduced once per step, and parameters stay
        # unsharded after each backward (torch.distributed.pipelining's no-sync backwards)
        reduces = 1 if s.rank.pipeline_stage else ga
        if not st.shard_params:  # NO_SHARD
            add("all-reduce", "gradients", n_all, rc.reduced_grad_bytes, psi, reduces)
        else:
            raf = reshard_after_forward(s)
            gathers = (1 if raf is False else ga + 1) if s.rank.pipeline_stage else ga
            # expert parallelism: the experts' FSDP2 unit gathers and reduces over its own group (efsdp)
            experts = sum(t.numel for t in inv.tensors if t.shard_split > 1)
            if experts:
                e = max(1, n // next(t.shard_split for t in inv.tensors if t.shard_split > 1))
                # its ranks are ep apart (the expert mesh [efsdp, ep], ep innermost): across nodes once the
                # data-parallel group is
                across = n > c.ranks_per_node
                add("all-gather", "experts, forward and backward (efsdp group)", e, rc.compute_bytes, experts,
                    2 * ga, within, across)
                add("reduce-scatter", "experts' gradients (efsdp group)", e, rc.reduced_grad_bytes, experts, ga,
                    within, across)
                every, psi = every - experts, psi - experts
            # FSDP2's float8 all-gather: the float8 weights travel one byte an element (precision.float8_gathered)
            f8 = float8_gathered(inv, s) if st.framework == "fsdp2" else frozenset()
            f8_numel = sum(t.numel for t in inv.tensors if t.name in f8)
            parts = [("parameters", rc.compute_bytes, every - f8_numel)] + (
                [("float8 weights (float8)", 1, f8_numel)] if f8_numel else [])
            for what, size, count in parts:
                add("all-gather", f"{what}, forward", n, size, count, 1 if s.rank.pipeline_stage else ga, within)
                if raf is True:
                    add("all-gather", f"{what}, backward", n, size, count, gathers - 1 if
                        s.rank.pipeline_stage else ga, within)
                elif raf not in (False, None, 1):
                    add("all-gather", f"{what}, backward (from groups of {raf})", int(raf), size, count,
                        gathers - 1 if s.rank.pipeline_stage else ga, True)
            add("reduce-scatter", "gradients", n, rc.reduced_grad_bytes, psi, reduces, within)
            if n_all > n:  # HSDP: the reduced shards all-reduced across replicas
                add("all-reduce", "gradient shards across replicas", n_all // n, rc.reduced_grad_bytes,
                    -(-psi // n), ga, across_nodes=n >= c.ranks_per_node)
    totals = {"intra_node_bytes": sum(x["bytes_per_gpu"] for x in out if x["network"] == "intra-node"),
              "inter_node_bytes": sum(x["bytes_per_gpu"] for x in out if x["network"] == "inter-node")}
    return {**totals, "total_bytes": totals["intra_node_bytes"] + totals["inter_node_bytes"], "collectives": out}


def model_parallel(layout: Any, rank: int) -> list[dict[str, Any]]:
    """A pipeline rank's tensor- and pipeline-parallel traffic per optimizer step (accounting.Layout), as the
    collectives above: per micro-batch, each block's two forward and two backward all-reduces of its [micro-batch,
    seq, hidden] activations in the compute dtype over the TP group (Megatron's ColumnParallel/RowParallel
    linears, DTensor's Colwise/Rowwise: with sequence parallelism an all-gather and a reduce-scatter each, the same
    bytes), two more in forward under full recompute; the vocabulary-parallel embedding's forward all-reduce on the
    first stage, the head's backward all-reduce on the last; and the pipeline's sends, each stage's output forward
    and its input's gradient backward, point to point (the bytes sent)."""
    from memplan.activations import checkpointed_blocks

    s = layout.settings
    p, c, rc = s.parallel, s.cluster, s.recipe
    share = layout.ranks[rank][0]
    h = layout.inventory.dims.get("hidden_size", 0)
    m = s.grad_accum
    act = s.micro_batch * (s.seq_len // p.cp) * h  # a CP rank's tokens
    out: list[dict[str, Any]] = []
    tp_inter = p.tp > c.ranks_per_node

    def add(op: str, what: str, group: int, nbytes: int, times: int, inter: bool) -> None:
        if group <= 1 or times <= 0 or nbytes <= 0:
            return
        per = nbytes if op == "send" else _ring(op, group, nbytes)
        out.append({"op": op, "what": what, "group_size": group, "dtype_bytes": rc.compute_bytes if op != "send"
                    else rc.residual_bytes, "times_per_step": times, "bytes_per_gpu": per * times,
                    "network": "inter-node" if inter else "intra-node"})

    if p.tp > 1:
        blocks = len(share.blocks)
        again = checkpointed_blocks(s.recompute, blocks)
        add("all-reduce", "tensor parallel: blocks' activations and their gradients (2 forward, 2 backward each"
            + (", 2 more where recomputed" if again else "") + ")", p.tp, rc.compute_bytes * act,
            m * (4 * blocks + 2 * again), tp_inter)
        ends = (1 if share.first else 0) + (1 if share.last else 0)
        add("all-reduce", "tensor parallel: the vocabulary-parallel embedding's output and the head's input gradient",
            p.tp, rc.compute_bytes * act, m * ends, tp_inter)
    if p.cp > 1:
        # ring attention (torch's context_parallel, its defaults): per attention layer and micro-batch the local
        # k and v all-gathered over the CP ranks in forward, again in backward (and in a recomputed forward), and
        # the fp32 dk, dv passed on at each of the cp steps of backward (the all-to-all rotation's permute)
        d = share.inventory.dims
        heads = d.get("num_heads") or 1
        hd = d.get("head_dim") or h // heads
        kv = s.micro_batch * (s.seq_len // p.cp) * (d.get("num_kv_heads") or heads) * hd
        blocks = len(share.blocks)
        again = checkpointed_blocks(s.recompute, blocks)
        inter = p.cp * p.tp > c.ranks_per_node
        add("all-gather", "context parallel: each attention's k and v over the CP ranks (forward, backward"
            + (", recomputed forward" if again else "") + ")", p.cp, p.cp * 2 * kv * rc.compute_bytes,
            m * (2 * blocks + again), inter)
        add("send", "context parallel: each attention's fp32 dk, dv passed on at each ring step (backward)", 2,
            2 * kv * 4, m * blocks * p.cp, inter)
    if p.ep > 1:
        # AllToAllEP: per MoE block and micro-batch, the routed (token, expert) rows out and the experts' outputs
        # back, in forward and again (their gradients) in backward; each rank keeps 1/ep of what it exchanges
        moe = len({t.block for t in share.inventory.tensors if t.shard_split > 1})
        rows = s.micro_batch * s.seq_len * layout.inventory.dims.get("experts_per_token", 1)
        inter = layout.dp * p.tp > c.ranks_per_node and p.ep > c.ranks_per_node
        add("all-to-all", "expert parallel: routed tokens to the experts and their outputs back (2 forward, 2 "
            "backward per MoE block)", p.ep, rc.compute_bytes * rows * h, m * 4 * moe, inter)
    if p.pp > 1:
        sends = sum((0 if ch.last else 1) + (0 if ch.first else 1) for ch in share.chunks)
        # consecutive stages are dp x tp ranks apart (the mesh [pp, dp, tp])
        inter = layout.dp * p.tp >= c.ranks_per_node and c.gpus > c.ranks_per_node
        # each the TP rank's share of the sequence under sequence parallelism (memplan/parallel/sequence.py sp_tokens)
        sent = s.micro_batch * sp_tokens(s.seq_len // p.cp, p) * h
        add("send", "pipeline: stage outputs forward, input gradients backward", 2, rc.residual_bytes * sent,
            m * sends, inter)
    return out
