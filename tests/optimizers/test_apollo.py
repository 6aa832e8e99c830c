"""APOLLO (--optimizer apollo-adamw): apollo-torch's APOLLOAdamW step, its allocations counted on the real step."""

from __future__ import annotations

import pytest

from memplan import options
from memplan.errors import SettingsError
from memplan.model.inventory import ParamTensor
from memplan.precision import APOLLO_RANK, apollo_states, apollo_step, get_recipe, low_rank_tensors, step_events_peak
from memplan.request import JobRequest

torch = pytest.importorskip("torch")

from storage_peak import ListInventory, low_rank_states  # noqa: E402  (after torch: the helpers import it)

H, I, V = 256, 384, 320  # hidden, MLP width, vocabulary


def _model():
    from torch import nn

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.o_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up_proj, self.down_proj = nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn, self.mlp, self.input_layernorm = Attn(), Mlp(), nn.LayerNorm(H, bias=False)

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens, self.layers = nn.Embedding(V, H), nn.ModuleList([Layer(), Layer()])

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.lm_head = Inner(), nn.Linear(H, V, bias=False)

    return Model()


def _inventory(model) -> ListInventory:
    from torch import nn

    kinds = {f"{n}.weight": "linear" if isinstance(m, nn.Linear) else "embedding" if isinstance(m, nn.Embedding)
             else "" for n, m in model.named_modules()}
    return ListInventory([ParamTensor(name=n, shape=tuple(p.shape), dtype="float32", block="b", category="c",
                             layer=kinds.get(n, "")) for n, p in model.named_parameters()])


def _measured_peaks(model, dtype, gap: int) -> list[int]:
    """Three steps' storage peaks (storage_step_peaks), the param groups as transformers' Trainer makes them
    (harness/setup.py apollo_optimizer)."""
    from storage_peak import storage_step_peaks

    from memplan.harness.setup import apollo_optimizer

    model = model.to(dtype)
    opt = apollo_optimizer(model)
    for g in opt.param_groups[1:]:
        g["update_proj_gap"] = gap
    return storage_step_peaks(model, opt)


@pytest.mark.parametrize("dtype,recipe", [("float32", "fp32"), ("bfloat16", "pure-bf16")])
def test_apollo_step_is_apollo_torch_s(dtype, recipe):
    """The first step (states made, the projections drawn), an update step after it (update_proj_gap 1) and a
    plain step: apollo_step's peak equals the real step's, to the byte but for the 1-byte bools Python's max()
    makes of a 0-dim comparison and next_seed's 120-byte host tensor (neither on the device)."""
    pytest.importorskip("apollo_torch")  # in the test extra (pip install -e ".[test]")
    model = _model()
    inv = _inventory(model)
    rc = get_recipe(recipe)
    first, update, plain = (step_events_peak(apollo_step(inv, rc, first=f, update=u))
                            for f, u in ((True, True), (False, True), (False, False)))
    m_update = _measured_peaks(_model(), getattr(torch, dtype), gap=1)
    m_plain = _measured_peaks(_model(), getattr(torch, dtype), gap=1000)
    assert abs(m_update[0] - first) <= 8 and abs(m_plain[0] - first) <= 8
    assert abs(m_update[1] - update) <= 8 and abs(m_update[2] - update) <= 8
    assert abs(m_plain[1] - plain) <= 8 and abs(m_plain[2] - plain) <= 8


def test_apollo_groups_and_states(inventories):
    """The attention and MLP linear weights are projected (rank 128: the projection [r, n] or [m, r] and the
    low-rank moments in the gradient's dtype); the embedding, the head and the norms take plain AdamW states."""
    inv = inventories("llama-7b")
    picked = {t.name for t, a in zip(inv.tensors, low_rank_tensors(inv)) if a}
    assert "model.layers.0.self_attn.q_proj.weight" in picked and "model.layers.3.mlp.down_proj.weight" in picked
    assert "lm_head.weight" not in picked and "model.embed_tokens.weight" not in picked
    s = options.resolve(inv, JobRequest.of(gpus=1, precision="pure-bf16", optimizer="apollo-adamw", activations="analytic")).settings
    # and the limiter's 0-dim norm per matrix (2 bytes)
    assert apollo_states(inv, s.recipe) == low_rank_states(inv, low_rank_tensors(inv), APOLLO_RANK, 2, 2)


def test_apollo_refused_on_sharded_parameters(inventories):
    inv = inventories("llama-7b")
    with pytest.raises(SettingsError, match="APOLLO projects each whole matrix"):
        options.resolve(inv, JobRequest.of(gpus=8, strategy="fsdp-full", optimizer="apollo-adamw", activations="analytic"))
