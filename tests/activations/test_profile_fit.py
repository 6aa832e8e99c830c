"""A profile at an untraced sequence length, fitted from traced ones (memplan/activations/profile_fit.py): exact at the traced
lengths, never below a trace at another length and within its rounding bound, never extrapolated, refused where the
traces run different operations; shipped presets fit any length without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from memplan.activations import profile_cache
from memplan.model import sources
from memplan.model.scaling import scale_config
from memplan.activations.profile_fit import ROUNDING, engine_values, envelopes, fit_profile, fit_seqs
from memplan.activations.tracing import trace_profile

ROOT = Path(__file__).resolve().parents[2]


def tiny(name: str) -> dict:
    return scale_config(sources.resolve(name).config, layers=3, hidden=256, vocab=1024)[0]


def trace(cfg: dict, seq: int, recompute: str = "none", attention: str = "flash") -> dict:
    return trace_profile(cfg, seq_len=seq, recipe="deepspeed-bf16", attention=attention, recompute=recompute)


def test_envelopes_rebuild_the_traced_ones():
    p = trace(tiny("llama-7b"), 256)
    rebuilt = envelopes(p["raw"])
    for k, v in rebuilt.items():
        assert p[k] == v, k


@pytest.mark.parametrize("name,recompute,attention", [("llama-7b", "none", "flash"), ("gpt2", "full", "flash"),
                                                      ("qwen2.5-7b", "none", "eager")])
def test_fit_at_an_untraced_length(name, recompute, attention):
    cfg = tiny(name)
    traced = {s: trace(cfg, s, recompute, attention) for s in (256, 512, 1024)}
    # at a traced length the fit is that trace
    at = fit_profile({s: p for s, p in traced.items()} | {768: trace(cfg, 768, recompute, attention)}, 512)
    assert at is not None and engine_values(at, recompute, 3) == engine_values(traced[512], recompute, 3)
    for s in (384, 700, 1000):  # 700: a length whose per-token tensors are not whole 512-byte blocks
        fitted = fit_profile(traced, s)
        assert fitted is not None and fitted["fitted_from"] == [256, 512, 1024]
        direct = trace(cfg, s, recompute, attention)
        # the fit's own bound: one 512-byte block per storage alive, at most the most alive anywhere in the traced
        # step, for each traced depth the model is scaled by (measured: at most 35,840 B here, 70 blocks)
        n = fitted["raw"]["n"]
        depth = -(-fitted["num_layers"] // fitted["traced_layers"])
        bound = ROUNDING * max(n["forward"] + n["backward"]) * (depth + 1)
        for b in (1, 4):
            f, d = engine_values(fitted, recompute, b), engine_values(direct, recompute, b)
            assert all(x >= y for x, y in zip(f, d)), (s, b)  # never under a trace at that length
            assert all(x - y <= bound for x, y in zip(f, d)), (s, b, bound)
    assert fit_profile(traced, 2048) is None  # not extrapolated
    assert fit_profile({256: traced[256], 512: traced[512]}, 384) is None  # three needed


def test_traces_that_run_other_operations_are_not_fitted():
    cfg = tiny("llama-7b")
    traced = {s: trace(cfg, s) for s in (256, 512, 1024)}
    other = trace(cfg, 1024, "full")  # recompute: other operations, so another structure
    assert fit_profile({256: traced[256], 512: traced[512], 1024: other}, 700) is None


def test_sliding_window_lengths_on_both_sides():
    # mistral materialises its sliding-window mask from kv_length >= window on: lengths on both sides
    seqs = fit_seqs(sources.resolve("mistral-7b").config)
    assert {3840, 4096, 32768} <= set(seqs) and 512 in seqs
    assert fit_seqs(sources.resolve("qwen2.5-7b").config)[-1] == 131072  # its window is off (use_sliding_window)


def test_shipped_presets_fit_without_tracing():
    for name, seq in (("llama-3-8b", 3000), ("mistral-7b", 3000), ("mistral-7b", 6000), ("gpt2", 700)):
        p = profile_cache.load_or_trace(sources.resolve(name).config, seq_len=seq, micro_batch=1,
                                        recipe="deepspeed-bf16", attention="flash", recompute="none",
                                        allow_trace=False)
        assert p is not None and p.origin.startswith("shipped traces at seq"), (name, seq)
        assert "fitted from" in p.source
        assert p.data["seq_len"] == seq


def test_estimate_at_a_new_length_does_not_import_torch():
    argv = ["estimate", "mistral-7b", "--gpus", "8", "--strategy", "fsdp-full", "--seq-len", "3000", "--json"]
    code = ("import sys, json, io, contextlib; from memplan.cli import main\n"
            "buf = io.StringIO()\n"
            f"with contextlib.redirect_stdout(buf):\n    try:\n        main({argv!r})\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n"
            "d = json.loads(buf.getvalue())\n"
            "assert 'fitted' in d['assumptions']['activations'], d['assumptions']['activations']\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
