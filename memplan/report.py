"""Plain-data reports (dicts for JSON, rows for tables). No rich, no typer, no printing."""

from __future__ import annotations

from typing import Any

from memplan.model.inventory import ParamInventory
from memplan.timeline import CATEGORY_KEYS

SCHEMA_VERSION = 1


def presets_report() -> dict[str, Any]:
    """`memplan presets`: the shipped model presets (their config.json files) and GPU presets."""
    from memplan.model import sources

    models = []
    for name in sources.preset_names():
        src = sources.resolve(name)
        inv = sources.build_inventory(src)
        aliases = sorted(a for a, c in sources.PRESET_ALIASES.items() if c == name)
        models.append({"name": name, "aliases": aliases, "model_type": src.config.get("model_type"),
                       "num_params": inv.num_params, "name_or_path": src.config.get("_name_or_path")})
    gpus = [{**g.to_json(), "capacity_bytes": g.capacity[0], "capacity_as": g.capacity[1]}
            for g in sources.gpu_presets().values()]
    return {"schema_version": 1, "models": models, "gpus": gpus}


def inspect_report(inv: ParamInventory) -> dict[str, Any]:
    lb, lt = inv.largest_layer_block, inv.largest_tensor
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {"name": inv.model_name, "source": inv.source, "family": inv.family, "builder": inv.builder,
                  "num_params": inv.num_params},
        "num_tensors": len(inv.tensors),
        "buffers": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in inv.buffers],
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


def lora_report(spec: Any, inv: Any) -> dict[str, Any]:
    """The LoRA adapter a plan was made for (memplan/model/lora.py), and what it adapted."""
    adapted = sorted({t.name.rsplit(".lora_A.", 1)[0] for t in inv.tensors if ".lora_A." in t.name})
    return {"rank": spec.rank, "alpha": spec.alpha,
            "targets": spec.targets if isinstance(spec.targets, str) else list(spec.targets),
            "dropout": spec.dropout, "bias": spec.bias, "modules_to_save": list(spec.modules_to_save),
            "adapted_layers": len(adapted), "trainable_params": inv.trainable_params, "source": spec.source,
            **({"quantize_base": {"type": spec.quantize, "double_quant": spec.double_quant,
                                  "compute_dtype": spec.compute_dtype, "quant_storage": spec.quant_storage,
                                  "quantized_params": inv.quantized_params,
                                  "quantized_bytes": inv.quantized_storage_bytes}} if spec.quantize else {})}


def plan_report(plan: Any, sources: dict[str, str] | None = None, notes: tuple[str, ...] = ()) -> dict[str, Any]:
    """The schema-v1 JSON object of an estimate (DESIGN.md, Contracts)."""
    from dataclasses import asdict

    from memplan.accounting import device_buffers

    s, inv, peak = plan.settings, plan.inventory, plan.peak
    st = s.strategy
    strategy: dict[str, Any] = {"name": st.name, "framework": st.framework, "description": st.description,
                                "zero_stage": st.zero_stage, "shard_group": plan.shard_group,
                                "precision": s.recipe.name, "optimizer": s.optimizer.name,
                                "micro_batch": s.micro_batch, "seq_len": s.seq_len,
                                # the job's micro-batches per step (a pipeline rank's worst moment is evaluated as a
                                # step of its own: accounting.Layout._at_rank)
                                "grad_accum": plan.layout.settings.grad_accum if plan.layout is not None
                                else s.grad_accum,
                                "recompute": s.recompute, "attention": s.attention}
    if s.compile != "none":
        strategy["compile"] = s.compile
    if s.float8 != "none":
        strategy["float8"] = s.float8
        strategy["float8_keep"] = s.float8_keep
        strategy["float8_all_gather"] = s.float8_all_gather
    if s.target_len is not None:
        strategy["target_len"] = s.target_len
    if s.images is not None:
        strategy["images"] = s.images
    if s.image_size is not None:
        strategy["image_size"] = list(s.image_size)
    if st.framework == "deepspeed":
        # each value once, as used: overlap_comm as DeepSpeed resolves its default (True for stage 3)
        knobs = {k: v for k, v in asdict(s.ds).items() if not k.startswith("leaf_")}  # the leaves: their paths below
        # data_types.grad_accum_dtype and communication_data_type as DeepSpeed resolves them: the parameters' dtype
        own = {"deepspeed-bf16": "bf16", "deepspeed-fp16": "fp16"}.get(s.recipe.name, "fp32")
        strategy["deepspeed"] = dict(knobs, overlap_comm=plan.assumptions.get("overlap_comm", s.ds.overlap_comm),
                                     grad_accum_dtype=s.ds.grad_accum_dtype or own,
                                     communication_data_type=s.ds.communication_data_type or own)
        if s.z3_leaves:
            strategy["zero3_leaf_modules"] = list(s.z3_leaves)
    elif st.framework == "horovod":
        strategy["horovod"] = asdict(s.horovod)
    else:
        strategy["torch"] = {k: v for k, v in asdict(s.torch).items() if k not in ("fsdp_wrap_modules",
                                                                                 "bucket_cap_default")}
    per_gpu = {k: getattr(peak, k) for k in CATEGORY_KEYS}
    per_gpu.update(overhead_bytes=plan.overhead_bytes, peak_bytes=plan.peak_bytes, peak_phase=peak.name,
                   reserved_peak_bytes=plan.reserved_peak_bytes, required_bytes=plan.required_bytes,
                   uncapped_required_bytes=plan.uncapped_required_bytes if s.cluster.device == "cuda" else None,
                   capped=capped_report(plan))
    assumptions = dict(plan.assumptions)
    assumptions.update(recipe=s.recipe.description, optimizer=s.optimizer.description,
                       overheads=asdict(s.overheads) if s.cluster.device == "cuda" else "none (device cpu)",
                       device=s.cluster.device, builder=inv.builder)
    if sources:
        assumptions["setting_sources"] = sources
    cluster = s.cluster
    if plan.layout is not None:  # the most loaded rank's plan: the model and the cluster as the job gives them
        inv, cluster = plan.layout.inventory, plan.layout.settings.cluster
        strategy["seq_len"] = plan.layout.settings.seq_len  # the job's (a CP rank computes 1/cp of it)
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {"name": inv.model_name, "source": inv.source, "num_params": inv.model_params,
                  "family": inv.family, "task": inv.task,
                  **({"trainable_params": inv.trainable_params} if inv.frozen else {}),
                  **({"frozen": list(inv.frozen_paths)} if inv.frozen_paths else {}),
                  "buffers_bytes": device_buffers(inv, s)},
        "strategy": {**strategy, **({"lora": lora_report(s.lora, inv)} if s.lora is not None else {})},
        "cluster": {"gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node,
                    "gpu_memory_bytes": cluster.gpu_memory_bytes, "device": cluster.device},
        "per_gpu": per_gpu,
        **({"parallel": plan.layout.report()} if plan.layout is not None else {}),
        "phases": [{"name": p.name, **{k: getattr(p, k) for k in per_gpu if k.endswith("_bytes")
                                       and hasattr(p, k)}, "total_bytes": p.total_bytes} for p in plan.phases],
        "overhead_detail": plan.overhead_detail,
        "reserved": reserved_report(plan),
        "host_bytes_per_node": plan.host_bytes_per_node,
        "host_bytes_per_rank_by_category": plan.host_detail,
        "host": plan.host,
        "communication": plan.communication,
        "fits": plan.fits,
        "headroom_bytes": plan.headroom_bytes,
        "assumptions": assumptions,
        "notes": list(inv.notes) + list(notes),
    }


def capped_report(plan: Any) -> dict[str, Any] | None:
    """The replay under the card's limits (reserved.Capped), where a card is given and the allocator replayed:
    whether it runs through, its reserved peak, the cache flushes a step takes, and the limits."""
    c = plan.capped
    if c is None:
        return None
    return {"fits": c.fits, "reserved_peak_bytes": c.peak_bytes, "flushes_per_step": c.flushes_per_step,
            "flushes": c.flushes, "limit_bytes": c.limit_bytes, "device_limit_bytes": c.device_limit_bytes,
            "fraction_limit_bytes": c.fraction_limit_bytes, "failed_request_bytes": c.failed_request_bytes}


def reserved_report(plan: Any) -> dict[str, Any] | None:
    """How the reserved peak was found: the caching allocator replayed (memplan/reserved.py), the user's flat
    fragmentation percentage, or not at all (a bound from below: the allocated peak), and why. ``exact``: false
    where the figure, and the required bytes and verdict built on it, are only a bound (``bound``: then ``fits``
    is null unless even the bound is over the card)."""
    s = plan.settings
    if s.cluster.device != "cuda":
        return None
    r = plan.reserved
    if r is not None and plan.bounded is None:
        return {"method": "replayed", "exact": True, "peak_bytes": r.peak_bytes, "framework_sequence": r.model,
                "replay_allocated_peak_bytes": r.allocated_bytes, "allocator_conf": r.config,
                "variants": dict(sorted(r.variants.items()))}
    if plan.fragmentation_percent is not None:
        return {"method": "flat", "exact": False, "peak_bytes": plan.reserved_peak_bytes,
                "fragmentation_percent": plan.fragmentation_percent, "why": "--fragmentation-percent given"}
    return {"method": "bound", "exact": False, "peak_bytes": plan.reserved_peak_bytes, "why": plan.bounded}


def search_report(found: Any, inv: ParamInventory, best_plan: Any, command: Any,
                  sources: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON object of `memplan plan` (schema_version 1): the search, every candidate (an exact one with the
    command that reproduces its row), the recommendation with its full estimate. ``command(candidate)``: that
    command (planner.command_line)."""
    from memplan.planner import RANKING

    def cand(c: Any) -> dict[str, Any]:
        return {"label": c.label, "strategy": c.strategy, "recompute": c.recompute, "offload": c.offload,
                "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep,
                "precision": c.settings.recipe.name, "min_gpus": c.min_gpus,
                # False: min_gpus, micro_batch and headroom are bounds from the allocated peak (the true ones are
                # at least / at most these); the caching allocator was replayed only where it could change the best
                "exact": c.exact,
                "at_recommended_gpus": None if c.micro_batch is None else {
                    "micro_batch": c.micro_batch, "peak_bytes": c.peak_bytes, "required_bytes": c.required_bytes,
                    "headroom_bytes": c.headroom_bytes,
                    "communication_bytes": None if c.comm is None else {"inter_node": c.comm[0], "total": c.comm[1]},
                    "command": command(c)}}

    b = found.best
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {"name": inv.model_name, "source": inv.source, "num_params": inv.model_params, "family": inv.family,
                  "task": inv.task},
        "search": {"gpu_memory_bytes": found.gpu_memory_bytes, "gpus_per_node": found.gpus_per_node,
                   "max_gpus": found.max_gpus, "micro_batches": [min(found.micro_batches), max(found.micro_batches)],
                   "min_headroom_bytes": found.min_headroom_bytes,
                   "ranking": RANKING, "evaluations": found.evaluations},
        # null: the best is only a bound (no candidate's caching allocator could be replayed): it may fit
        "fits": (b is not None) if b is None or b.exact else None,
        "recommendation": None if b is None else {
            "strategy": b.strategy, "label": b.label, "gpus": found.gpus, "nodes": -(-found.gpus // found.gpus_per_node),
            "micro_batch": b.micro_batch, "recompute": b.recompute, "precision": b.settings.recipe.name,
            "peak_bytes": b.peak_bytes, "required_bytes": b.required_bytes, "headroom_bytes": b.headroom_bytes,
            "exact": b.exact, "command": command(None)},
        "candidates": [cand(c) for c in found.candidates],
        "estimate": None if best_plan is None else plan_report(best_plan, sources),
        "notes": list(found.notes),
    }
