"""Ship each preset's module tree (memplan/model/module_tree.py): transformers' model on the meta device, its
modules' paths and classes, to memplan/presets/modules/<config digest>.json.gz.

    python tools/ship_module_trees.py
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from memplan.model import module_tree, sources
    from memplan.model.meta_builder import meta_model

    out = module_tree.shipped_dir()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json.gz"):
        old.unlink()
    for name in sources.preset_names():
        config = sources.resolve(name).config
        tree = module_tree.from_model(meta_model(config, name))
        path = out / f"{module_tree.digest(config)}.json.gz"
        raw = json.dumps(module_tree.pack(tree), separators=(",", ":")).encode()
        with open(path, "wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=9, mtime=0) as gz:
            gz.write(raw)  # mtime 0: the same bytes every run
        print(f"{name}: {len(tree)} modules -> {path.name}")


if __name__ == "__main__":
    main()
