"""Every ds_config key memplan reads, and every one it ignores with its reason (issue 22 item 6): the lists in
memplan/dsconfig.py are exactly the ones docs/deepspeed-config.md documents, and they cover DeepSpeed 0.19.8's
zero_optimization keys."""

import json
import re
from pathlib import Path

import pytest

from memplan import dsconfig
from memplan.request import JobRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "deepspeed-config.md"


def _table(section: str) -> dict[str, list[str]]:
    text = DOC.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split(" | ")]
    return rows


def test_the_documented_lists_are_the_code_s():
    read = set(dsconfig.READ_TOP) | {f"zero_optimization.{k}" for k in set(dsconfig.ZERO_KEYS)
                                     | dsconfig.ZERO_READ_ELSEWHERE}
    assert set(_table("Read")) == read
    ignored = {k: ("yes" if m else "no", why) for k, (m, why) in dsconfig.IGNORED_TOP.items()}
    ignored.update({f"zero_optimization.{k}": ("yes" if m else "no", why)
                    for k, (m, why) in dsconfig.ZERO_IGNORED.items()})
    assert {k: tuple(v) for k, v in _table("Ignored").items()} == ignored
    assert not set(dsconfig.READ_TOP) & set(dsconfig.IGNORED_TOP)
    assert not (set(dsconfig.ZERO_KEYS) | dsconfig.ZERO_READ_ELSEWHERE) & set(dsconfig.ZERO_IGNORED)


def test_every_zero_key_of_deepspeed_is_read_or_ignored():
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:  # pragma: no cover - DeepSpeed is a test dependency
        pytest.skip("deepspeed not installed")
    known = set(dsconfig.ZERO_KEYS) | dsconfig.ZERO_READ_ELSEWHERE | set(dsconfig.ZERO_IGNORED) \
        | set(dsconfig.REMOVED_ZERO)
    for name, f in DeepSpeedZeroConfig.model_fields.items():
        assert name in known or (f.alias and f.alias in known), name


def test_ignored_keys_are_said_with_their_reason(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"scheduler": {"type": "WarmupLR"}, "torch_autocast": {"enabled": True},
                             "zero_optimization": {"stage": 2, "round_robin_gradients": True,
                                                   "stage3_model_persistence_threshold": 10},
                             "made_up": 1}))
    d = dsconfig.load(str(p))
    assert d.unknown_keys == ("made_up",)
    assert any(n.startswith("torch_autocast not modelled: DeepSpeed's torch.autocast") for n in d.notes)
    assert any(n.startswith("zero_optimization.stage3_model_persistence_threshold not modelled") for n in d.notes)
    quiet = [n for n in d.notes if n.startswith("ds_config keys without a memory effect")]
    assert len(quiet) == 1 and "scheduler (the learning-rate" in quiet[0] and "round_robin_gradients" in quiet[0]


def test_grad_accum_dtype(tmp_path):
    from memplan import options
    from memplan.errors import SettingsError
    from memplan.model import sources

    inv = sources.build_inventory(sources.resolve("llama-3-8b"))
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                             "zero_optimization": {"stage": 1}}))
    assert dsconfig.load(str(p)).knobs["grad_accum_dtype"] == "fp32"
    # engine.py _do_optimizer_sanity_check: bf16 with fp32 accumulation at stage 1 runs BF16_Optimizer (refused);
    # at stage 0 it is DeepSpeed's own NotImplementedError (measured: "unsupported mix of model_dtype"); stages 2
    # and 3 keep an fp32 accumulator per parameter (use_grad_accum_attribute): not modelled, refused
    with pytest.raises(SettingsError, match="BF16_Optimizer"):
        options.resolve(inv, JobRequest.of(gpus=8, deepspeed=str(p), activations="analytic"))
    with pytest.raises(SettingsError, match="NotImplementedError"):
        options.resolve(inv, JobRequest.of(gpus=8, deepspeed=str(p), stage=0, activations="analytic"))
    for stage in (2, 3):
        with pytest.raises(SettingsError, match="use_grad_accum_attribute"):
            options.resolve(inv, JobRequest.of(gpus=8, deepspeed=str(p), stage=stage, activations="analytic"))
    p.write_text(json.dumps({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}))
    options.resolve(inv, JobRequest.of(gpus=8, deepspeed=str(p), stage=2, activations="analytic"))
    r = options.resolve(inv, JobRequest.of(gpus=8, stage=0, activations="analytic"))
    assert any("FP16_Optimizer" in n for n in r.notes)
    with pytest.raises(SettingsError, match="not for ddp"):
        options.resolve(inv, JobRequest.of(gpus=8, strategy="ddp", grad_accum_dtype="fp32", activations="analytic"))
    p.write_text(json.dumps({"data_types": {"grad_accum_dtype": "int8"}}))
    with pytest.raises(Exception, match="grad_accum_dtype"):
        dsconfig.load(str(p))
