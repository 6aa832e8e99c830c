"""Context parallelism on CPU ranks: torch's ring attention (torch.distributed.tensor.experimental
context_parallel, torch 2.13 _context_parallel/_attention.py) with the CPU flash kernel.

context_parallel() replaces F.scaled_dot_product_attention by one that makes q, k and v DTensors sharded on the
sequence over the CP mesh; DTensor then dispatches the attention op to the ring implementation
(_templated_ring_attention / _templated_ring_attention_backward) through custom handlers registered for CUDA's
flash, efficient and cuDNN ops only. A CPU rank runs aten._scaled_dot_product_flash_attention_for_cpu, which has no
handler (NotImplementedError). This registers one for it and its backward that calls the same ring functions with
the CPU kernel as their op: each rank's local q against every rank's k/v in turn (rotated with the same
collectives), its outputs merged by logsumexp in fp32 (_SDPAMerger), and in backward the fp32 dq/dk/dv
accumulators and the rotated k/v and dk/dv buffers. Checked against unsharded SDPA (outputs and gradients).
Harness only: what the ring allocates is torch's own code; the attention kernel is the CPU's.
"""

from __future__ import annotations

from typing import Any


def enable_cpu_ring_attention(mesh: Any) -> None:
    """Register the CPU flash kernel's ring-attention handlers for the CP ``mesh`` (see the module)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    aten = torch.ops.aten
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def forward_op(q: Any, k: Any, v: Any, is_causal: bool = False, dropout_p: float = 0.0,
                   scale: float | None = None, **_: Any) -> tuple[Any, Any]:
        return fwd(q, k, v, dropout_p, is_causal, scale=scale)

    def backward_op(query: Any, key: Any, value: Any, out: Any, logsumexp: Any, is_causal: bool = False,
                    grad_out: Any = None, dropout_p: float = 0.0, scale: float | None = None, **_: Any) -> Any:
        return bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)

    def local(results: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in results)

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        a, kw = info.local_args, info.local_kwargs
        group = mesh.get_group()
        if op_call == fwd:
            dropout_p = a[3] if len(a) > 3 else kw.get("dropout_p", 0.0)
            is_causal = a[4] if len(a) > 4 else kw.get("is_causal", False)
            out = ring._templated_ring_attention(group, 2, forward_op, a[0], a[1], a[2], is_causal=is_causal,
                                                 dropout_p=dropout_p, scale=kw.get("scale"))
            return local(tuple(out[:2]))
        grad, q, k, v, out, lse, dropout_p, is_causal = a[:8]
        res = ring._templated_ring_attention_backward(group, 2, backward_op, grad_out=grad, grad_out_name="grad_out",
                                                      query=q, key=k, value=v, out=out, logsumexp=lse,
                                                      is_causal=is_causal, dropout_p=dropout_p,
                                                      scale=kw.get("scale"))
        return local(tuple(res[:3]))

    DTensor._op_dispatcher._custom_op_handlers[fwd] = handler
    DTensor._op_dispatcher._custom_op_handlers[bwd] = handler
    _all_gather_in_place(ring)


def _all_gather_in_place(ring: Any) -> None:
    """The ring's k/v all-gather (_AllGatherRotater.exchange_buffers: ft_c.all_gather_single, once per ring) as
    NCCL runs it: one output buffer of cp x the input, here filled by an in-place all-reduce of zero-padded
    contributions. Gloo's all-gather stages through a temporary of the output's size besides it, freed on whichever
    thread drops the work last: the same run measured 27,797,436 and 29,894,588 bytes (cp 4). As
    harness/gloo.py does for FSDP's collectives."""
    import torch
    import torch.distributed as dist

    def exchange_buffers(self: Any, curr_buffer: Any) -> None:
        self._idx += 1
        if self._aggregated_buffer is None:
            size, me = dist.get_world_size(self._pg), dist.get_rank(self._pg)
            flat = curr_buffer.contiguous().view(-1)
            out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
            rows = out.view(size, -1)
            with torch.no_grad():
                for i in range(size):
                    rows[i].copy_(flat) if i == me else rows[i].zero_()
            dist.all_reduce(out, group=self._pg)
            self._aggregated_buffer = out

    ring._AllGatherRotater.exchange_buffers = exchange_buffers
