"""The shipped module trees (memplan/presets/modules) are transformers' own: --fsdp-wrap class:NAME and
--z3-leaf-modules NAME resolve a preset's classes without building the model, with the same answer."""

from __future__ import annotations

import pytest

from memplan.model import module_tree, sources


@pytest.mark.parametrize("preset", ["gpt2", "mixtral-8x7b", "llama-3-8b"])
def test_the_shipped_tree_is_the_models(preset):
    from memplan.model.meta_builder import meta_model

    config = sources.resolve(preset).config
    shipped = module_tree.shipped_dir() / f"{module_tree.digest(config)}.json.gz"
    assert shipped.is_file(), "run tools/ship_module_trees.py"
    assert module_tree.modules(config) == module_tree.from_model(meta_model(config))


def test_every_preset_has_a_shipped_tree():
    for name in sources.preset_names():
        config = sources.resolve(name).config
        assert (module_tree.shipped_dir() / f"{module_tree.digest(config)}.json.gz").is_file(), name
