"""Expert parallelism (EP): each MoE layer's routed experts split over ep of the data-parallel ranks, as torchtitan
and transformers' native FSDP2 + EP lay it out."""

from __future__ import annotations

from typing import Any

from memplan.errors import SettingsError
from memplan.model.inventory import ParamInventory
from memplan.parallel.degrees import Parallel, TORCHTITAN


def routed_experts(inv: ParamInventory) -> int:
    """The routed experts of each MoE layer (0 for a dense model): dim 0 of the fused expert weights."""
    return max((t.shape[0] for t in inv.tensors if t.category == "experts" and len(t.shape) == 3), default=0)


def _check_ep(p: Parallel, inv: ParamInventory, strategy: Any, dp: int, layout: str) -> None:
    """Expert parallelism as torchtitan and transformers' native FSDP2 + EP lay it out (see Parallel.ep)."""
    experts = routed_experts(inv)
    if not experts:
        raise SettingsError(f"--ep {p.ep}: the model has no routed experts (fused [experts, out, in] weights); expert "
                            "parallelism splits MoE layers")
    if experts % p.ep:
        raise SettingsError(f"--ep {p.ep} does not divide the {experts} routed experts of each MoE layer")
    if layout != TORCHTITAN or strategy.name != "fsdp-full":
        raise SettingsError(f"--ep with --strategy {strategy.name}: memplan models expert parallelism under FSDP2 "
                            "fsdp-full, as torchtitan and transformers' DistributedConfig(ep_size) run it; "
                            "DeepSpeed's needs its own MoE layer (deepspeed.moe), which transformers' models do not "
                            "use")
    if p.ep % p.tp:
        raise SettingsError(f"--ep {p.ep} with --tp {p.tp}: ep must be a multiple of tp (transformers' "
                            "DistributedConfig: each EP group holds whole TP groups, which share their batch)")
    if (dp * p.tp) % p.ep:
        raise SettingsError(f"--ep {p.ep} does not divide the data-parallel ranks dp x tp = {dp * p.tp} it borrows "
                            "from (each expert's FSDP group is dp x tp / ep ranks)")
    efsdp = dp * p.tp // p.ep
    if efsdp > experts // p.ep:
        # more expert-FSDP ranks than local experts: torchtitan shards each expert on dim 1 (layouts.shard_dim),
        # which FSDP2 shards only evenly (_fsdp_param.py: "FSDP does not support uneven sharding on dim 1")
        for t in inv.tensors:
            if t.category == "experts" and len(t.shape) == 3 and t.shape[1] % efsdp:
                raise SettingsError(f"--ep {p.ep} over {dp * p.tp} data-parallel ranks: each expert is sharded on "
                                    f"dim 1 over efsdp = {efsdp} ranks (more than the {experts // p.ep} local "
                                    f"experts), and FSDP2 shards dim 1 only evenly: {t.name} has {t.shape[1]} rows")
