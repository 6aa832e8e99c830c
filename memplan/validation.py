"""`memplan validate`: predict (the engine), run the job for real on N ranks (memplan/harness, which never imports
the engine), measure, compare."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from memplan import accounting, options
from memplan.errors import SettingsError
from memplan.harness import compare as cmp
from memplan.harness import launch as ln
from memplan.harness import spec as hs
from memplan.model import sources
from memplan.model.scaling import scale_config
from memplan.request import JobRequest
from memplan.settings import default_blas_workspace


@dataclass(frozen=True)
class Validation:
    plan: accounting.Plan
    resolved: options.Resolved
    comparison: cmp.Comparison
    config_changes: tuple[str, ...]
    original_params: int
    spec: dict[str, Any]
    versions: dict[str, str]
    wall_s: float
    ranks: tuple[dict[str, Any], ...] = ()  #: what each rank measured (memplan/harness/run.py)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def local_blas_workspace() -> int:
    """The cuBLAS workspace per handle this process's GPU gets (the rule of Cluster.blas_workspace_bytes):
    CUBLAS_WORKSPACE_CONFIG, else the default for the device's architecture."""
    import os
    import re

    import torch

    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if torch.version.hip:
        return default_blas_workspace(torch.cuda.get_device_properties(0).gcnArchName)
    major, minor = torch.cuda.get_device_capability(0)
    return default_blas_workspace(f"sm{major}{minor}")


def adapted_inventory(inv: Any, request: JobRequest) -> Any:
    """The inventory with the request's LoRA adapters, as PEFT adds them, and its --freeze."""
    from memplan.model import freeze

    spec = request.adapters.spec
    if spec is None:
        return freeze.for_request(inv, request)
    from memplan.model import lora

    return freeze.for_request(lora.apply(inv, spec), request)


def predict(model: str, request: JobRequest, **scale: int | None) -> tuple[accounting.Plan, options.Resolved,
                                                                          dict[str, Any], list[str], int]:
    """The prediction validate compares with: (plan, resolved options, scaled config, its changes, the
    original model's parameter count); ``scale``: layers, hidden, vocab (scale_config). bench/accuracy.py
    --repredict re-evaluates stored runs with it."""
    layers, hidden, vocab = scale.get("layers"), scale.get("hidden"), scale.get("vocab")
    src = sources.with_task(sources.resolve(model), request.model.task)
    if src.kind == "factory":  # the user's own module: run as its factory builds it (no scaling)
        if layers or hidden or vocab:
            raise SettingsError("--layers, --hidden and --vocab scale a config.json; a factory module runs as built")
        inv = adapted_inventory(sources.build_inventory(src), request)
        config = sources.trace_config(src, inv)
        resolved = options.resolve(inv, request, config=config)
        return accounting.estimate(inv, resolved.settings), resolved, config, [], inv.num_params
    if src.config is None:
        raise SettingsError("validate needs a model with a config.json (preset, config file or model directory) "
                            "or a factory module")
    original = sources.build_inventory(src)
    config, changes = scale_config(src.config, layers=layers, hidden=hidden, vocab=vocab)
    scaled = replace(src, config=config, checkpoint=(), description=src.description + (
        f" scaled ({'; '.join(changes)})" if changes else ""))
    inv = adapted_inventory(sources.build_inventory(scaled), request)
    resolved = options.resolve(inv, request, config=config)
    return accounting.estimate(inv, resolved.settings), resolved, config, changes, original.num_params


def validate(model: str, request: JobRequest, *, warmup_steps: int = 2, measured_steps: int = 1,
             timeout_s: float = 600.0, tolerance: float = 0.03, progress: Callable[[str], None] | None = None,
             **scale: int | None) -> Validation:
    """Run ``request`` (its device: cuda or cpu) in the harness, measure every rank and compare with the
    prediction; ``scale``: layers, hidden, vocab."""
    if not math.isfinite(tolerance) or tolerance <= 0:
        raise SettingsError(f"--tolerance must be a positive number, got {tolerance}")
    if not math.isfinite(timeout_s) or timeout_s <= 0:  # nan or inf would switch the hang guard off
        raise SettingsError(f"--timeout must be a positive number of seconds, got {timeout_s}")
    if request.cluster.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SettingsError("--device cuda: no CUDA device here")
        if torch.cuda.device_count() < request.cluster.gpus:
            raise SettingsError(f"--gpus {request.cluster.gpus} but this host has "
                                f"{torch.cuda.device_count()} GPU(s); run the rank entry point under torchrun")
        if not request.cluster.gpu:  # the kernels and the workspace this GPU really gets, unless given
            major, minor = torch.cuda.get_device_capability(0)
            props = torch.cuda.get_device_properties(0)
            if request.cluster.gpu_arch is None:
                request = request.changed(gpu_arch=getattr(props, "gcnArchName", "").split(":")[0]
                                          if torch.version.hip else f"sm{major}{minor}")
            if request.memory.blas_workspace_bytes is None:
                request = request.changed(blas_workspace_bytes=local_blas_workspace())
    plan, resolved, config, changes, original_params = predict(model, request, **scale)
    spec = hs.build_spec(config, resolved.settings, warmup_steps=warmup_steps, measured_steps=measured_steps,
                         layout=plan.layout)
    run = ln.launch(spec, resolved.settings.cluster.gpus, timeout_s=timeout_s, progress=progress)
    comparison = cmp.compare(plan, run.ranks, tolerance)
    return Validation(plan=plan, resolved=resolved, comparison=comparison, config_changes=tuple(changes),
                      original_params=original_params, spec=spec, versions=run.ranks[0].get("versions", {}),
                      wall_s=run.wall_s, ranks=tuple(run.ranks))


def validation_report(v: Validation) -> dict[str, Any]:
    from memplan.report import plan_report

    rep = {"schema_version": 1, "validation": cmp.comparison_report(v.comparison),
           "scaled_from_params": v.original_params, "config_changes": list(v.config_changes),
           "run": {"framework": v.spec["framework"], "device": v.spec["device"],
                   "warmup_steps": v.spec["warmup_steps"], "measured_steps": v.spec["measured_steps"],
                   "versions": v.versions, "wall_s": round(v.wall_s, 1),
                   "initialisation": ("FSDP2 on the meta device, sharded, then to_empty"
                                      if v.spec["framework"] == "fsdp2" else "materialised model")},
           "prediction": plan_report(v.plan, v.resolved.sources, v.resolved.notes)}
    if "ds_config" in v.spec:
        rep["run"]["ds_config"] = v.spec["ds_config"]
    return rep
