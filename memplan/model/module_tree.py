"""A model's module tree by class, what ``--fsdp-wrap class:NAME`` and ``--z3-leaf-modules NAME`` look up: each
module's path, its class (short and qualified) and whether it holds parameters, in ``named_modules()`` order.

For the shipped presets the tree is shipped (memplan/presets/modules/<config digest>.json.gz, written by
tools/ship_module_trees.py from transformers' own model on the meta device, and checked against it by
tests/activations/test_module_tree.py), so the lookup, and a refused class name, takes milliseconds and no transformers
import; for any other config.json the model is built on the meta device (model/meta_builder.py meta_model).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple


class Module(NamedTuple):
    path: str  #: "" for the root
    cls: str  #: type(m).__name__
    qualified: str  #: f"{type(m).__module__}.{type(m).__qualname__}"
    has_params: bool  #: any parameter in its subtree


def digest(config: Mapping[str, Any]) -> str:
    """The shipped tree's key: the config.json's fields, as JSON with sorted keys (private "_" fields left out)."""
    blob = json.dumps({k: v for k, v in config.items() if not str(k).startswith("_")}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def shipped_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "presets" / "modules"


def from_model(model: Any) -> list[Module]:
    """The tree of an nn.Module (transformers' on the meta device, or any other)."""
    return [Module(name, type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}",
                   any(True for _ in m.parameters(recurse=True))) for name, m in model.named_modules()]


def modules(config: Mapping[str, Any]) -> list[Module]:
    """The model's module tree: shipped for a preset's config, else built from the config on the meta device."""
    path = shipped_dir() / f"{digest(config)}.json.gz"
    if path.is_file():
        with gzip.open(path, "rt") as fh:
            data = json.load(fh)
        classes = data["classes"]
        return [Module(p, classes[c][0], classes[c][1], bool(h)) for p, c, h in data["modules"]]
    from memplan.model.meta_builder import meta_model

    return from_model(meta_model(config))


def pack(tree: list[Module]) -> dict[str, Any]:
    """The shipped form: the classes once, each module as [path, class index, has parameters]."""
    classes: list[list[str]] = []
    index: dict[tuple[str, str], int] = {}
    rows = []
    for m in tree:
        k = (m.cls, m.qualified)
        if k not in index:
            index[k] = len(classes)
            classes.append([m.cls, m.qualified])
        rows.append([m.path, index[k], int(m.has_params)])
    return {"classes": classes, "modules": rows}
