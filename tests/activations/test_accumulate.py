"""Gradient accumulation in the traced step as the real autograd engine does it (memplan/activations/tracing/accumulate.py),
the order in which gradients are ready (LiveBytes.ready_order, replay.ready_order) and CUDA autocast's cast
order."""

from __future__ import annotations

import collections

import pytest

from memplan.model import sources
from memplan.model.scaling import scale_config


def _tiny(name: str) -> dict:
    return scale_config(sources.resolve(name).config, layers=2, hidden=256, vocab=1024)[0]


def _accumulations(cfg: dict, fake: bool) -> collections.Counter:
    """(consumer node, in place or new) for every input buffer that got more than one gradient."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from memplan.model.meta_builder import hf_config
    from memplan.activations.tracing.accumulate import Accumulations
    from memplan.activations.tracing.live import LiveBytes, dispatch_mode

    def ident(t):  # noqa: ANN001, ANN202
        return t.untyped_storage()._cdata if fake else t.data_ptr()

    def run():  # noqa: ANN202
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="sdpa")
        x = torch.randint(0, 100, (1, 64))
        loss = m(input_ids=x, labels=x).loss
        incoming = collections.defaultdict(list)
        seen, stack = set(), [loss.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            for i, (n, _) in enumerate(fn.next_functions):
                if n is not None and not hasattr(n, "variable"):
                    incoming[n].append((fn, i))
                    stack.append(n)
        outs, res = {}, collections.Counter()
        for fn in seen:
            def post(gi, go, fn=fn):  # noqa: ANN001, ANN202
                outs[fn] = [ident(g) if g is not None else None for g in gi]

            def pre(go, fn=fn):  # noqa: ANN001, ANN202
                if len(incoming[fn]) > 1 and go[0] is not None:
                    firsts = [outs.get(p, [None] * 99)[i] for p, i in incoming[fn]]
                    res[(tuple(go[0].shape), ident(go[0]) in firsts)] += 1
            fn.register_hook(post)
            fn.register_prehook(pre)
        return loss, res

    if not fake:
        loss, res = run()
        loss.backward()
        return res
    with FakeTensorMode(allow_non_fake_inputs=True):
        acc = Accumulations()
        probe = LiveBytes(512)
        acc.calibrate(dispatch_mode(probe, accumulate=acc), probe)
        loss, res = run()
        live = LiveBytes(512)
        with dispatch_mode(live, accumulate=acc):
            acc.hook(loss, live)
            loss.backward()
    return res


@pytest.mark.parametrize("name", ["llama-7b", "gpt2"])
def test_fake_trace_accumulates_in_place_where_the_real_engine_does(name):
    cfg = _tiny(name)
    real = _accumulations(cfg, fake=False)
    assert any(inplace for (_, inplace) in real), real  # the engine steals first contributions here
    assert _accumulations(cfg, fake=True) == real


def test_ready_order_puts_a_gradient_after_those_made_later_but_ready_first():
    import torch

    from memplan.replay import ready_order
    from memplan.activations.tracing.live import LiveBytes

    live = LiveBytes()
    w, b = torch.zeros(1000), torch.zeros(10)  # a weight's gradient made first, its bias's second
    live.track(w)
    live.track(b)
    live.mark_grad(b, 0)  # the bias's AccumulateGrad runs first
    live.mark_grad(w, 0)
    live.ready_order()
    assert live.events[0] == [4000, 0, 1] and live.events[1] == [40, 0, 0]
    assert ready_order([("w", 4000), ("b", 40), ("x", 8)], {"w": 1}) == [("b", 40), ("w", 4000), ("x", 8)]


def test_cuda_autocast_casts_as_the_kernel_does_right_to_left():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from memplan.activations.substitutes import CudaAutocast

    order = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is torch.ops.aten._to_copy.default:
                order.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8)
    w = torch.randn(16, 8, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    with CudaAutocast("bfloat16"):
        with torch.autocast("cpu", dtype=torch.bfloat16), Casts():
            y = torch.nn.functional.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and order == [(16,), (16, 8), (4, 8)]  # bias, weight, input
