"""--explain (memplan/explain.py, memplan/activations/tracing/explain.py): the traced step's storages grouped by module and
operator at the moments the phases peak. The groups are lines in the micro-batch that add up to the profile's own
peak terms; the explanation's items add up to the allocated peak exactly."""

from __future__ import annotations

import pytest

from memplan.model import sources
from memplan.request import JobRequest

pytestmark = pytest.mark.usefixtures("isolated_cache")


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))


def _tiny_llama(vocab: int = 4096) -> dict:
    cfg = dict(sources.resolve("llama-3-8b").config)
    cfg.update(num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=vocab, head_dim=32)
    return cfg


@pytest.fixture(scope="module")
def traced():
    from memplan.activations.tracing import explain as X
    from memplan.activations.tracing import trace_profile

    keep, X.KEEP = X.KEEP, 10_000  # every group kept
    try:
        return trace_profile(_tiny_llama(), seq_len=64, recipe="torch-amp", attention="flash", recompute="none")
    finally:
        X.KEEP = keep


def test_groups_add_up_to_the_profiles_peaks(traced):
    # at every micro-batch, the largest traced point of each moment is the profile's own peak term, and its groups
    # (all of them kept here) add up to it, with what the timeline counts as gradients in backward
    d = traced
    for b in (1, 2, 3, 7):
        for moment, peak in (("forward", d["forward_peak"]), ("backward-start", d["backward_peak"])):
            pts = d["explain"][moment]
            best = max(pts, key=lambda p: p["line"][0] + p["line"][1] * b)
            at = best["line"][0] + best["line"][1] * b
            assert at == max(x[0] + x[1] * b for x in peak)
            rest = best["rest"][0] + best["rest"][1] * b
            assert sum(g["line"][0] + g["line"][1] * b for g in best["groups"]) + rest == at
            if moment == "forward":  # every storage alive in forward is an activation, each in a group
                assert rest == 0


def test_the_loss_tensors_are_named_with_their_bytes(traced):
    # cross-entropy keeps an fp32 log-softmax of the logits for backward: tokens x vocab x 4 B, made by the model's
    # own forward (the loss is computed in LlamaForCausalLM.forward), one line in the micro-batch
    pts = traced["explain"]["forward"]
    groups = max(pts, key=lambda p: p["line"][1])["groups"]
    lsm = [g for g in groups if g["op"] == "_log_softmax"]
    assert len(lsm) == 1 and lsm[0]["module"] == "LlamaForCausalLM" and lsm[0]["saved"]
    assert lsm[0]["line"] == [0, 64 * 4096 * 4] and lsm[0]["dtype"] == "float32"
    # the blocks' tensors are grouped across blocks, the block index as *
    assert any(g["module"] == "model.layers.*.mlp.act_fn" and g["op"] == "silu" for g in groups)


def test_the_explanation_adds_up_to_the_peak_exactly():
    from memplan import accounting, options
    from memplan.explain import explain, summary

    src = sources.resolve("llama-3-8b")
    inv = sources.build_inventory(src)
    for kw in (dict(strategy="zero2", gpus=8), dict(strategy="fsdp-full", gpus=8, micro_batch=2),
               dict(strategy="ddp", gpus=2, recompute="full")):
        r = options.resolve(inv, JobRequest.of(seq_len=256, **kw), config=src.config)
        plan = accounting.estimate(inv, r.settings)
        ex = explain(plan)
        assert sum(it["bytes"] for it in ex["items"]) == plan.peak.total_bytes == ex["peak_bytes"]
        acts = [it for it in ex["items"] if it["kind"] == "activations"]
        assert sum(it["bytes"] for it in acts) == plan.peak.activations_bytes
        if plan.peak.activations_bytes and plan.peak.name in ("forward", "backward-start", "backward"):
            assert ex["traced"] and any("model.layers.*" in it["what"] for it in acts)
        line = summary(ex)
        assert line.startswith(f"peak in {plan.peak.name}: ") and "%" in line
