"""torch.optim.Muon (--optimizer muon): its Newton-Schulz step's allocations, counted on torch's own function."""

from __future__ import annotations

import pytest

from memplan import accounting as A
from memplan import options
from memplan.errors import SettingsError
from memplan.precision import muon_state_bytes, muon_tensors, newton_schulz_peak
from memplan.request import JobRequest

torch = pytest.importorskip("torch")


def _peak_of_torch_muon_update(shape: tuple[int, int], dtype) -> int:
    """The most live storage bytes while torch 2.13's Muon makes one matrix's update (``grad.lerp(buf)`` then
    _zeropower_via_newtonschulz), every storage an op makes counted until it dies."""
    from torch.optim._muon import (
        DEFAULT_A,
        DEFAULT_B,
        DEFAULT_C,
        _zeropower_via_newtonschulz,
    )
    from storage_peak import storage_peak

    count = storage_peak()
    grad = torch.randn(*shape, dtype=dtype)
    buf = torch.zeros_like(grad)
    with count:
        update = grad.lerp(buf, 0.95)
        update = _zeropower_via_newtonschulz(update, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7)
    del update
    return count.peak


@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (64, 64)])
@pytest.mark.parametrize("dtype,grad_bytes", [("float32", 4), ("bfloat16", 2)])
def test_newton_schulz_peak_is_torch_s(shape, dtype, grad_bytes):
    assert newton_schulz_peak(shape, grad_bytes) == _peak_of_torch_muon_update(shape, getattr(torch, dtype))


def test_muon_takes_the_blocks_matrices(inventories):
    inv = inventories("llama-7b")
    roles = muon_tensors(inv)
    muon = [t for t, m in zip(inv.tensors, roles) if m]
    from memplan.model.inventory import ROOT_BLOCK

    assert muon and all(len(t.shape) == 2 and t.block != ROOT_BLOCK for t in muon)
    assert not any(t.category in ("embedding", "head") for t in muon)
    s = options.resolve(inv, JobRequest.of(gpus=1, optimizer="muon", activations="analytic")).settings
    plan = A.estimate(inv, s)
    assert plan.phases[-1].optimizer_states_bytes == muon_state_bytes(inv, s.recipe)
    with pytest.raises(SettingsError, match="Newton-Schulz needs each whole matrix"):
        options.resolve(inv, JobRequest.of(gpus=8, strategy="fsdp-full", optimizer="muon", activations="analytic"))


def test_adam_mini_branches_and_states(inventories):
    """Adam_mini (adam-mini 1.1.1) picks its branch by the parameter's name: queries and keys per head, embedding,
    head, values, output projection and MLP per row, biases whole (Adam), the rest (norms) one element; m for all."""
    from memplan.precision import (
        adam_mini_kind,
        adam_mini_states,
        adam_mini_step,
        adam_mini_step_scratch,
    )

    assert adam_mini_kind("model.layers.0.self_attn.q_proj.weight") == "heads"
    assert adam_mini_kind("model.layers.0.self_attn.v_proj.weight") == "rows"
    assert adam_mini_kind("model.layers.0.mlp.down_proj.weight") == "rows"
    assert adam_mini_kind("model.embed_tokens.weight") == "rows"
    assert adam_mini_kind("lm_head.weight") == "rows"
    assert adam_mini_kind("model.layers.0.input_layernorm.weight") == "block"
    assert adam_mini_kind("model.layers.0.self_attn.q_proj.bias") == "bias"
    inv = inventories("llama-7b")
    s = options.resolve(inv, JobRequest.of(gpus=1, optimizer="adam-mini", activations="analytic")).settings
    rc = s.recipe
    heads = inv.dims["num_heads"]
    # m everywhere, v: heads for q and k, rows elsewhere, one per norm
    want = 0
    for t in inv.tensors:
        kind = adam_mini_kind(t.name)
        want += t.numel * 4 + 4 * {"heads": heads, "rows": t.shape[0], "block": 1}[kind]
    assert adam_mini_states(inv, rc) == want
    assert A.estimate(inv, s).phases[-1].optimizer_states_bytes == want
    # every temporary freed by the step's end; the first step keeps exactly the states
    for first in (False, True):
        ev = adam_mini_step(inv, rc, first=first)
        freed = {x for k, x in ev if k == "f"}
        made = {i for i, (k, _) in enumerate(ev) if k == "a"}
        assert made == freed
        assert sum(x for k, x in ev if k == "s") == (want if first else 0)
    # the worst moment: a matrix's update and its negation beside the step's smaller locals
    largest = max(t.numel for t in inv.tensors)
    assert 2 * 4 * largest <= adam_mini_step_scratch(inv, rc) < 3 * 4 * largest
