"""What the allocator-replay tests share: the measured H100 cases' settings, the CPU harness's recorded rows and their
replayed peaks, a tiny traced step's events."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest

from memplan import options
from memplan.activations import TracedProfile
from memplan.model.sources import build_inventory, resolve
from memplan.request import JobRequest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "torch_dtype": "bfloat16"}


def measured_settings(tmp_path: Path, profile: str, micro_batch: int, **kw):  # noqa: ANN003, ANN202
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_1B))
    inv = build_inventory(resolve(str(cfg)))
    data = json.loads(gzip.open(DATA / profile, "rt").read())
    r = options.resolve(inv, JobRequest.of(activations="analytic", micro_batch=micro_batch, seq_len=data["seq_len"], recompute=data["recompute"], gpu="h100-80g", allocator_conf="", **kw))
    return inv, replace(r.settings, activation_profile=TracedProfile(data, micro_batch, "test"))


def tiny_events(depth: int, recipe: str, lora_fields: dict | None = None) -> dict | None:
    """A tiny llama's traced step at ``depth`` blocks as the caching allocator sees it (tracing's alloc_events)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from memplan.activations.kernels import Target
    from memplan.activations.tracing.segments import alloc_events
    from memplan.activations.tracing.step import one_step
    from memplan.model.scaling import scale_config

    tiny = dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=256, max_position_embeddings=512)
    cfg = dict(scale_config(tiny, layers=depth)[0], **({"lora": lora_fields} if lora_fields else {}))
    a, b = (one_step(cfg, mb, 64, recipe, "sdpa", "none", Target(device="cuda", arch="sm90")) for mb in (2, 4))
    return alloc_events(a, b, expand=True)


def live_curve(events: list) -> tuple[list[int], list[int]]:
    """Live bytes after each allocation or free of a replayed step, and its allocations' sizes, sorted."""
    live, cur, out, sizes = {}, 0, [], []
    for e in events:
        if e[0] == "a":
            live[e[1]] = e[2]
            cur += e[2]
            sizes.append(e[2])
        elif e[0] == "f":
            cur -= live.pop(e[1])
        if e[0] in "af":
            out.append(cur)
    assert not live
    return out, sorted(sizes)


def harness_replay(label: str, layers: int, gpus: int, model: str = "llama-7b", recompute: str = "none",
                   seq_len: int = 128, **kw: object) -> tuple[str, int, int]:
    """(the replay's name, its sequence's peak counted as the CPU harness counts it: bench/replay_harness.py, the
    worst rank's measured peak) for a kept harness row of ``model`` scaled to ``layers`` blocks."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from replay_harness import replayed_peak

    from memplan import validation

    row = harness_row(label, f"{model}, {layers} blocks", recompute)
    inventories = []
    wrapped = validation.adapted_inventory
    try:
        validation.adapted_inventory = lambda inv, kw: inventories.append(wrapped(inv, kw)) or inventories[-1]
        job = JobRequest.of(device="cpu", cpu_isa=row[10] if len(row) > 10 else "avx512", gpus=gpus,
                            gpus_per_node=gpus, micro_batch=2, seq_len=seq_len, recompute=recompute, **kw)
        _, resolved, *_ = validation.predict(model, job, layers=layers, hidden=256, vocab=2048)
    finally:
        validation.adapted_inventory = wrapped
    name, peak = replayed_peak(inventories[-1], resolved.settings)
    return name, peak, row[4]


def harness_row(label: str, shown: str, recompute: str, log: str = "accuracy.jsonl") -> list:
    for line in (ROOT / "docs" / log).read_text().splitlines():
        row = json.loads(line)
        if row[:3] == [label, shown, recompute]:
            return row
    raise AssertionError(f"no kept measurement for {label}")
