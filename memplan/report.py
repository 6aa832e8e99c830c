"""Plain-data reports (dicts for JSON, rows for tables). No rich, no typer, no printing."""

from __future__ import annotations

from typing import Any

from memplan.model.inventory import ParamInventory

SCHEMA_VERSION = 1


def inspect_report(inv: ParamInventory) -> dict[str, Any]:
    lb, lt = inv.largest_layer_block, inv.largest_tensor
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {"name": inv.model_name, "source": inv.source, "family": inv.family, "builder": inv.builder,
                  "num_params": inv.num_params},
        "num_tensors": len(inv.tensors),
        "bytes_by_dtype": inv.bytes_by_dtype,
        "params_by_category": inv.numel_by_category,
        "num_blocks": len(inv.layer_blocks),
        "root_block_params": inv.blocks[0].numel,
        "largest_block": None if lb is None else {"name": lb.name, "num_params": lb.numel,
                                                   "num_tensors": lb.num_tensors},
        "largest_tensor": {"name": lt.name, "shape": list(lt.shape), "num_params": lt.numel, "dtype": lt.dtype},
        "tied": [{"name": n, "aliases": list(a)} for n, a in inv.tied],
        "dims": inv.dims,
        "notes": list(inv.notes),
    }
