"""Model sources: presets, config files, directories with safetensors headers, the HF cache, factories."""

import json
import struct

import pytest

from memplan.errors import ConfigError, ModelSourceError
from memplan.model import sources


def _write_safetensors(path, tensors, header_len=None):
    # a header-only copy of a checkpoint (all memplan reads): offsets tile the data buffer the file leaves out
    sizes = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I8": 1, "U8": 1, "BOOL": 1}
    header, at = {}, 0
    for name, (dt, shape) in tensors.items():
        n = sizes[dt]
        for x in shape:
            n *= x
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw)


def test_alias_and_suggestion():
    assert sources.resolve("llama-7b").name == "llama-2-7b"
    with pytest.raises(ModelSourceError, match="did you mean llama-7b"):
        sources.resolve("lama-7b")


@pytest.mark.parametrize("content,match", [("", "is empty"), ("{not json", "not valid JSON"),
                                           ("[1, 2]", "JSON object"), ('{"hidden_size": 4}', "model_type")])
def test_bad_config_files(tmp_path, content, match):
    p = tmp_path / "config.json"
    p.write_text(content)
    with pytest.raises(ConfigError, match=match):
        sources.resolve(str(p))


def test_missing_required_field(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": "big"}))
    with pytest.raises(ConfigError, match="hidden_size"):
        sources.build_inventory(sources.resolve(str(p)))


def test_directory_with_sharded_safetensors(tmp_path):
    cfg = json.loads((sources.presets_dir() / "models" / "gpt2.json").read_text())
    cfg.update(n_layer=1, torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _write_safetensors(tmp_path / "a.safetensors", {"h.0.attn.c_attn.weight": ("BF16", (768, 2304)),
                                                    "wte.weight": ("BF16", (50257, 768))})
    _write_safetensors(tmp_path / "b.safetensors", {"h.0.attn.bias": ("F32", (1, 1, 1024, 1024))})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"h.0.attn.c_attn.weight": "a.safetensors", "wte.weight": "a.safetensors",
                        "h.0.attn.bias": "b.safetensors"}}))
    inv = sources.build_inventory(sources.resolve(str(tmp_path)))
    dtypes = {t.name: t.dtype for t in inv.tensors}
    assert dtypes["transformer.h.0.attn.c_attn.weight"] == "bfloat16"
    assert dtypes["transformer.wte.weight"] == "bfloat16"
    assert dtypes["transformer.h.0.ln_1.weight"] == "float32"  # not in the checkpoint: config dtype
    assert any("does not use" in n for n in inv.notes)


def test_safetensors_header_larger_than_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    _write_safetensors(tmp_path / "model.safetensors", {"x": ("F32", (2,))}, header_len=10_000)
    with pytest.raises(ConfigError, match="larger than the file"):
        sources.resolve(str(tmp_path))


def test_safetensors_absurd_header_refused_before_reading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(ConfigError, match="exceeds"):
        sources.resolve(str(tmp_path))


def test_hf_cache_offline(tmp_path, monkeypatch):
    snap = tmp_path / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                  "intermediate_size": 128, "num_hidden_layers": 2,
                                                  "num_attention_heads": 4, "vocab_size": 100}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    src = sources.resolve("acme/tiny")
    assert src.kind == "hf-cache"
    assert sources.build_inventory(src).num_params == 2 * 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 128) + 64
    with pytest.raises(ModelSourceError, match="never downloads"):
        sources.resolve("acme/absent")


def test_factory(tmp_path, monkeypatch):
    (tmp_path / "mymods.py").write_text(
        "import torch.nn as nn\n"
        "def good():\n    return nn.Sequential(nn.Linear(4, 8), nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]))\n"
        "def bad():\n    raise RuntimeError('boom')\n"
        "def notmod():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    inv = sources.build_inventory(sources.resolve("mymods:good"))
    assert inv.num_params == 4 * 8 + 8 + 2 * (64 + 8)
    assert inv.builder == "meta"
    with pytest.raises(ModelSourceError, match="raised RuntimeError: boom"):
        sources.build_inventory(sources.resolve("mymods:bad"))
    with pytest.raises(ModelSourceError, match="not a torch.nn.Module"):
        sources.build_inventory(sources.resolve("mymods:notmod"))
    with pytest.raises(ModelSourceError, match="cannot import"):
        sources.build_inventory(sources.resolve("no_such_module_xyz:fn"))


def test_every_gpu_preset_loads_typed_with_its_capacity():
    presets = sources.gpu_presets()
    assert {"a100-80g", "h100-80g", "h200-141g"} <= set(presets)
    h100 = presets["h100-80g"]
    assert h100.capacity == (85_017_493_504, "torch") and h100.arch == "sm90"
    assert presets["a100-80g"].capacity == (85_899_345_920, "nvidia-smi")
    assert all(g.id == k and g.to_json()["id"] == k for k, g in presets.items())


@pytest.mark.parametrize("change,match", [
    ({"usable_bytes": "80GB"}, "usable_bytes must be a positive integer"),
    ({"multiprocessors": 0}, "multiprocessors must be a positive integer"),
    ({"arch": "hopper"}, "arch 'hopper' is not smNN"),
    ({"torch_total_bytes": 1}, "torch_total_bytes and torch_total_source go together"),
    ({"torch_total_bytes": 10 ** 12, "torch_total_source": "x"}, "more than usable_bytes"),
    ({"name": ""}, "name must be a non-empty string"),
    ({"colour": "green"}, "unknown field"),
])
def test_a_broken_gpu_preset_is_named_when_it_loads(tmp_path, change, match):
    good = json.loads((sources.presets_dir() / "gpus" / "a100-80g.json").read_text())
    path = tmp_path / "x100-1g.json"
    path.write_text(json.dumps({**good, **change}))
    with pytest.raises(ConfigError, match=match):
        sources.GpuPreset.load(path)
