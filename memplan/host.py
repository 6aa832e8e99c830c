"""Host memory for offloaded states: what a node's RAM must hold, with pinned memory as PyTorch allocates it.

The accounting (memplan/accounting.py) says how many bytes each rank offloads, by category. Where the framework
pins them, the bytes come from PyTorch's pinned-host caching allocator, which rounds every allocation up to the
next power of two before cudaHostAlloc (ATen/core/CachingHostAllocator.h: ``size_t roundSize =
c10::llvm::PowerOf2Ceil(size)``), so a 5 GiB pinned buffer takes 8 GiB. The tensors each framework pins:

- DeepSpeed ZeRO-Offload with ``offload_optimizer.pin_memory`` (default false): ZeRO-1/2 pin the fp32 master
  partition, its fp32 gradient (initialize_optimizer_states: ``get_accelerator().pin_memory(single_grad_
  partition)``), the bit16 copy of the partition and the largest-parameter gradient buffer
  (stage_1_and_2.py); ZeRO-3 pins each optimizer sub-group's fp32 partition and gradient and the flat gradient
  buffer (stage3.py). The Adam states (zeros_like of the partition) are pageable.
- DeepSpeed ``offload_param.pin_memory``: each parameter's partition (partition_parameters.py).
- FSDP2 CPUOffloadPolicy (``pin_memory=True`` by default): each sharded parameter and its sharded gradient.

Pure Python; no torch.
"""

from __future__ import annotations

from typing import Any



def pinned_size(n: int) -> int:
    """What the pinned-host caching allocator takes for a request of n bytes (the next power of two)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def host_bytes_per_rank(plan: Any) -> tuple[int, int, int]:
    """(pageable bytes, pinned bytes as requested, pinned bytes as allocated) that one rank keeps on the host."""
    s, inv = plan.settings, plan.inventory
    total = sum(plan.host_detail.values())
    if not total:
        return 0, 0, 0
    from memplan import frameworks

    pinned = frameworks.model(s.strategy.memory_model).pinned_host(inv, s, plan.shard_group)
    requested = min(sum(pinned), total)
    return total - requested, requested, sum(pinned_size(x) for x in pinned)


def host_report(plan: Any) -> dict[str, Any] | None:
    """The node's host memory for offloaded states and, with --host-memory, whether it fits."""
    pageable, requested, allocated = host_bytes_per_rank(plan)
    if not (pageable or requested):
        return None
    ranks = plan.settings.cluster.ranks_per_node
    need = (pageable + allocated) * ranks
    mem = plan.settings.cluster.host_memory_bytes
    return {"bytes_per_node": need, "pageable_bytes_per_rank": pageable,
            "pinned_requested_bytes_per_rank": requested, "pinned_allocated_bytes_per_rank": allocated,
            "ranks_per_node": ranks, "host_memory_bytes": mem,
            "fits": None if mem is None else need <= mem,
            "headroom_bytes": None if mem is None else mem - need}
