"""Size-based FSDP units (memplan/model/wrap_units.py, --fsdp-wrap size:N): the same units torch's own
size_based_auto_wrap_policy walk makes on the real modules, and what they do to the per-rank sizes."""

import functools
from dataclasses import replace

import pytest

from memplan import layouts, options, strategies
from memplan.errors import SettingsError
from memplan.model import sources, wrap_units
from memplan.model.inventory import ROOT_BLOCK
from memplan.model.scaling import scale_config


def _torch_units(src, policy):
    """Each parameter's unit as FSDP1 makes them: torch's _recursive_wrap (only_wrap_children, as
    FullyShardedDataParallel's _auto_wrap calls it) recording the modules it wraps, children first, then the root;
    each unit takes the parameters of its subtree not taken before (FlatParamHandle skips flattened ones).
    ``policy(model)``: the auto-wrap policy for the built model. Returns (owner by parameter name, wrapped paths)."""
    import torch
    from torch.distributed.fsdp.wrap import _recursive_wrap
    from transformers import AutoModelForCausalLM

    from memplan.model.meta_builder import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(src.config), dtype=torch.float32)
    made = []

    def record(module, **_):
        made.append(module)
        return module

    _recursive_wrap(model, policy(model), wrapper_cls=record, ignored_modules=set(), ignored_params=set(),
                    only_wrap_children=True)
    names = {m: n for n, m in model.named_modules()}
    first = {p: n for n, p in model.named_parameters()}
    owner = {}
    for m in made + [model]:
        for p in m.parameters():
            owner.setdefault(first[p], names[m])
    return owner, frozenset(names[m] for m in made)


def _source(name, **scale):
    cfg, _ = scale_config(sources.resolve(name).config, **scale)
    return replace(sources.resolve(name), config=cfg, checkpoint=())


@pytest.mark.parametrize("name,scale,sizes", [
    ("llama-3-8b", {"layers": 2, "hidden": 512, "vocab": 2048}, (10**5, 10**6, 2 * 10**6, 5 * 10**6, 10**8)),
    ("gpt2", {"layers": 2, "hidden": 128, "vocab": 512}, (10**4, 5 * 10**4, 2 * 10**5, 10**6)),
    ("mixtral-8x7b", {"layers": 2, "hidden": 256, "vocab": 1024}, (10**4, 10**5, 10**6, 4 * 10**6)),
])
def test_units_are_torchs(name, scale, sizes):
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    src = _source(name, **scale)
    inv = sources.build_inventory(src)
    for n in sizes:
        want, _ = _torch_units(src, lambda _: functools.partial(size_based_auto_wrap_policy, min_num_params=n))
        got = dict(zip((t.name for t in inv.tensors), wrap_units.unit_owners(inv, n)))
        assert got == want, n


@pytest.mark.parametrize("classes", [("LlamaMLP",), ("LlamaAttention", "LlamaMLP"), ("LlamaDecoderLayer", "LlamaMLP")])
def test_class_units_are_torchs(classes):
    # transformer_auto_wrap_policy / ModuleWrapPolicy: every module of the classes, nested ones too, then the root
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    src = _source("llama-3-8b", layers=2, hidden=512, vocab=2048)
    inv = sources.build_inventory(src)
    want, paths = _torch_units(src, lambda model: ModuleWrapPolicy(
        {type(m) for m in model.modules() if type(m).__name__ in classes}))
    got = dict(zip((t.name for t in inv.tensors), wrap_units.unit_owners(inv, paths)))
    assert got == want


def test_llama_units_at_1e8():
    # llama-3-8b at torch's default min_num_params: each MLP (176M) is a unit; an attention (42M) is too small and
    # its block's remainder too, so every attention and norm goes to the decoder stack's parent (model); the
    # embedding and the head are units of their own
    inv = sources.build_inventory(sources.resolve("llama-3-8b"))
    units = wrap_units.unit_owners(inv, wrap_units.DEFAULT_MIN_NUM_PARAMS)
    by = {}
    for t, u in zip(inv.tensors, units):
        by[u] = by.get(u, 0) + t.numel
    assert by["model"] == 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 2 * 4096) + 4096
    assert by["model.layers.0.mlp"] == 3 * 4096 * 14336
    assert by["model.embed_tokens"] == by["lm_head"] == 128256 * 4096
    assert "" not in by  # the root keeps nothing
    reunit = wrap_units.with_units(inv, wrap_units.DEFAULT_MIN_NUM_PARAMS)
    g = layouts.gather_sizes(reunit, strategies.FLAT_PER_BLOCK, 8)
    # gathered per block: its MLP only; the attention of every block is gathered with the root group
    assert g.block_numels == (3 * 4096 * 14336,) * 32
    assert g.root == by["model"] + 2 * 128256 * 4096
    # FSDP1: one FlatParameter per unit, each padded to the shard group
    lay = layouts.layout_sizes(reunit, strategies.FLAT_PER_BLOCK, 3)
    assert lay.shard_numel == sum(-(-v // 3) for v in by.values())


def test_size_argument():
    assert options.size_wrap("size:1e8") == "size:100000000"
    assert options.size_wrap("size:100M") == "size:100000000"
    assert options.size_wrap("size:2500") == "size:2500"
    for bad in ("size:0", "size:-5", "size:1.5", "size:abc", "size:", "sized:5", "size:10x"):
        with pytest.raises(SettingsError):
            options.size_wrap(bad)


def test_no_units_keeps_the_inventory():
    inv = sources.build_inventory(sources.resolve("gpt2"))
    assert all(t.group == t.block for t in wrap_units.with_units(inv, 10**12).tensors
               if t.block == ROOT_BLOCK)
