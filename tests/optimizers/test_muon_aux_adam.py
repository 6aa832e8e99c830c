"""Keller Jordan's Muon (--optimizer muon-with-aux-adam): muon-optimizer's SingleDeviceMuonWithAuxAdam step, its
allocations counted on the real step; MuonWithAuxAdam's ranks and gathers on the harness (bench/accuracy.py)."""

from __future__ import annotations

import pytest

from memplan import options
from memplan.errors import SettingsError
from memplan.model.inventory import ParamTensor
from memplan.precision import (get_recipe, muon_aux_adam_groups, muon_aux_adam_sorted, muon_aux_adam_states,
                               muon_aux_adam_step, muon_aux_adam_why_not, step_events_peak)
from memplan.request import JobRequest

torch = pytest.importorskip("torch")

from storage_peak import ListInventory  # noqa: E402

H, I, V = 128, 192, 160  # hidden, MLP width, vocabulary


def _model():
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.up_proj = nn.Linear(H, H, bias=False), nn.Linear(H, I, bias=False)
            self.down_proj, self.norm = nn.Linear(I, H, bias=False), nn.LayerNorm(H, bias=False)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens, self.layers = nn.Embedding(V, H), nn.ModuleList([Layer(), Layer()])
            self.final_norm, self.lm_head = nn.LayerNorm(H, bias=False), nn.Linear(H, V, bias=False)

        def get_output_embeddings(self):  # noqa: ANN201
            return self.lm_head

    m = Model()
    m._no_split_modules = ["Layer"]
    return m


def _inventory(model) -> ListInventory:
    return ListInventory([ParamTensor(name=n, shape=tuple(p.shape), dtype="float32", category="head" if n.startswith("lm_head")
                             else "c", block=".".join(n.split(".")[:2]) if n.startswith("layers.") else "",
                             layer="") for n, p in model.named_parameters()])


def _measured_peaks(dtype) -> list[int]:
    """Three steps' storage peaks (storage_step_peaks: every storage an op makes, counted until it dies; a CPU
    bf16 GEMM's oneDNN scratch is not an op's output, and memplan takes it from kernels.cpu_gemm_scratch, measured
    on the harness)."""
    from storage_peak import storage_step_peaks

    from memplan.harness.setup import muon_aux_adam_optimizer

    model = _model().to(dtype)
    return storage_step_peaks(model, muon_aux_adam_optimizer(model))


@pytest.mark.parametrize("dtype,recipe", [("float32", "fp32"), ("bfloat16", "pure-bf16")])
def test_single_device_step_is_muon_optimizer_s(dtype, recipe):
    """The first step (states made in the loop) and two later ones: muon_aux_adam_step's peak equals the real
    step's, but for the 0-dim scalars a CPU bf16 op makes of a Python number (a few bytes)."""
    pytest.importorskip("muon")  # muon-optimizer, in the test extra
    inv = _inventory(_model())
    rc = get_recipe(recipe)
    first, later = (step_events_peak(muon_aux_adam_step(inv, rc, first=f)) for f in (True, False))
    m = _measured_peaks(getattr(torch, dtype))
    assert 0 <= m[0] - first < 32 and 0 <= m[1] - later < 32 and 0 <= m[2] - later < 32


def test_groups_order_and_ranks():
    """The docstring example's groups: head, embeddings, the rest to AdamW; the blocks' matrices to Muon, sorted
    by shape (largest first) across ranks, rank 0 stepping every world-th: the largest of each."""
    inv = _inventory(_model())
    adam, mats = muon_aux_adam_groups(inv)
    assert [t.name for t in adam] == ["lm_head.weight", "embed_tokens.weight", "layers.0.norm.weight",
                                      "layers.1.norm.weight", "final_norm.weight"]
    order = [tuple(t.shape) for t in muon_aux_adam_sorted(mats)]
    assert order == [(I, H)] * 2 + [(H, I)] * 2 + [(H, H)] * 2
    rc = get_recipe("fp32")
    adam_states = sum(2 * 4 * t.numel for t in adam)
    assert muon_aux_adam_states(inv, rc, 1) == adam_states + 4 * sum(t.numel for t in mats)
    assert muon_aux_adam_states(inv, rc, 2) == adam_states + 4 * (I * H + H * I + H * H)
    # two ranks: each gather of two matrices of one shape flattens both into one buffer, made and freed
    flat = [x for kind, x in muon_aux_adam_step(inv, rc, world=2) if kind == "a" and x == 2 * 4 * I * H]
    assert len(flat) == 2  # the (I, H) pair and the (H, I) pair; the (H, H) pair's is 2 x 4 x H x H


def test_refusals(inventories):
    inv = _inventory(_model())  # 6 matrices: 4 ranks pad 2, which a multiple of 4 is; 5 ranks pad 1: fails
    assert muon_aux_adam_why_not(inv, 4) is None
    assert "fewer tensors than ranks" in muon_aux_adam_why_not(inv, 5)
    with pytest.raises(SettingsError, match="MuonWithAuxAdam orthogonalises whole matrices"):
        options.resolve(inventories("llama-7b"), JobRequest.of(gpus=8, strategy="fsdp-full",
                                                               optimizer="muon-with-aux-adam", activations="analytic"))
    with pytest.raises(SettingsError, match="fewer tensors than ranks"):
        options.resolve(inventories("llama-7b"), JobRequest.of(gpus=3, strategy="ddp", optimizer="muon-with-aux-adam",
                                                               activations="analytic"))
