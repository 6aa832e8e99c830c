"""Collectives gloo lacks, for FSDP on CPU: all-gather and reduce-scatter into the caller's tensors (as NCCL's
in-place variants do), so the harness measures on CPU what the framework allocates on a GPU."""

from __future__ import annotations

from typing import Any


def _all_gather_in_place(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:  # noqa: A002
    """all_gather_into_tensor as an all-reduce of zero-padded contributions, written into ``output`` only."""
    import torch
    import torch.distributed as dist

    rows = output.view(dist.get_world_size(group), -1)
    me = dist.get_rank(group)
    with torch.no_grad():
        # FSDP2 passes its all-gather input as this rank's slice of the output (in place, as NCCL takes it:
        # _fsdp_collectives.py foreach_all_gather), so that slice is not zeroed; the others are
        if input.data_ptr() != rows[me].data_ptr():
            rows[me].copy_(input.view(-1))
        for i in range(rows.shape[0]):
            if i != me:
                rows[i].zero_()
    return dist.all_reduce(output, group=group, async_op=async_op)


def _reduce_scatter_in_place(output: Any, input: Any, op: Any = None, group: Any = None,  # noqa: A002
                             async_op: bool = False) -> None:
    """reduce_scatter_tensor as an in-place all-reduce of ``input`` (the framework only frees that buffer
    afterwards) and a copy of this rank's chunk into ``output``."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(input, op=dist.ReduceOp.SUM if op is None else op, group=group)
    with torch.no_grad():
        output.view(-1).copy_(input.view(dist.get_world_size(group), -1)[dist.get_rank(group)])
    return None


def collectives_in_place(model: Any) -> None:
    """FSDP2 on gloo: run its all-gather and reduce-scatter as in-place all-reduces of FSDP2's own buffers.

    NCCL's all_gather_into_tensor and reduce_scatter_tensor write straight into FSDP2's output buffers. Gloo's
    (ProcessGroupGloo) stage through torch-allocated temporaries instead: a flat output on the worker thread for
    the all-gather, a clone of the whole input for the reduce-scatter. They are freed when the finished work is
    dropped, on whichever thread drops it last, so the measured peak moved from run to run by up to 9% (session
    3, docs/accuracy.md) and included bytes a GPU run never allocates. The same results without temporaries: the
    all-gather as a sum of zero-padded contributions into the output, the reduce-scatter as a sum over the input
    (FSDP2 keeps that buffer only to free it later) and a copy of this rank's chunk. Bytes from FSDP2's own
    allocations, timing and buffer lifetimes are unchanged (set_custom_all_gather / set_custom_reduce_scatter,
    torch/distributed/fsdp/_fully_shard/_fsdp_api.py).
    """
    import torch
    from torch.distributed.fsdp import FSDPModule

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:  # an older torch: keep gloo's own collectives
        return

    class _AllGather(AllGather):
        def allocate(self, size, *, dtype, device):  # noqa: ANN001, ANN201
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001, ANN201
            return _all_gather_in_place(output_tensor, input_tensor, group, async_op)

    class _ReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):  # noqa: ANN001, ANN201
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN201
            return _reduce_scatter_in_place(output_tensor, input_tensor, op, group)

    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_custom_all_gather(_AllGather())
            mod.set_custom_reduce_scatter(_ReduceScatter())


def flat_collectives_in_place() -> None:
    """FSDP1 on gloo: its all_gather_into_tensor and reduce_scatter_tensor as in-place all-reduces (see
    _gloo_collectives_in_place: gloo stages both through temporaries NCCL never allocates). FSDP1 calls them
    through the torch.distributed module (_flat_param.py, _runtime_utils.py: all_gather_single,
    reduce_scatter_single), so this rank process's module attributes are replaced; results are identical."""
    import torch
    import torch.distributed as dist

    def all_gather(tensor_list, tensor, group=None, async_op=False):  # noqa: ANN001, ANN202
        # FSDP1 gathers CPU flat parameters into chunks of its unsharded buffer with the list form
        rank = dist.get_rank(group)
        with torch.no_grad():
            for i, out in enumerate(tensor_list):
                out.copy_(tensor) if i == rank else out.zero_()
        for out in tensor_list:
            dist.all_reduce(out, group=group)
        return None

    dist.all_gather = all_gather
    # torch 2.13's FSDP1 calls the *_single names (aliases of *_into_tensor / *_tensor); older ones the others
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            setattr(dist, name, _all_gather_in_place)
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, _reduce_scatter_in_place)
