"""Which layout a data-parallel strategy runs model parallelism with, and the degrees checked against the
model and the GPU count."""

from __future__ import annotations

from typing import Any

from memplan.errors import SettingsError
from memplan.inputs import quote
from memplan.model.inventory import ParamInventory
from memplan.parallel import schedules
from memplan.parallel.degrees import LAYOUT_SCHEDULES, MEGATRON_DEEPSPEED, Parallel, SCHEDULES, TORCHTITAN
from memplan.parallel.expert import _check_ep


def layout_of(strategy: Any, pp: int) -> str:
    """The layout a data-parallel strategy runs model parallelism with; SettingsError for those none does."""
    if strategy.framework == "deepspeed":
        if pp > 1 and (strategy.zero_stage or 0) >= 2:
            raise SettingsError(f"--pp {pp} with ZeRO stage {strategy.zero_stage}: DeepSpeed's PipelineEngine takes "
                                "ZeRO stage 0 or 1 only (deepspeed/runtime/pipe/engine.py: \"ZeRO-2 and ZeRO-3 are "
                                "incompatible with pipeline parallelism\")")
        return MEGATRON_DEEPSPEED
    if strategy.framework == "fsdp2" or strategy.name == "ddp":
        return TORCHTITAN
    raise SettingsError(f"--tp/--pp/--cp/--ep with --strategy {strategy.name}: memplan models model parallelism "
                        "under FSDP2, HSDP and DDP (torchtitan's DTensor layout) and DeepSpeed ZeRO "
                        "(Megatron-DeepSpeed)")


def check(p: Parallel, inv: ParamInventory, strategy: Any, gpus: int, grad_accum: int) -> str:
    """The layout after checking the degrees against the model and the GPU count (SettingsError naming the
    numbers otherwise)."""
    for name in ("tp", "pp", "ep", "cp"):
        if getattr(p, name) < 1:
            raise SettingsError(f"--{name} must be at least 1, got {getattr(p, name)}")
    if p.vpp is not None and p.vpp < 1:
        raise SettingsError(f"--vpp must be at least 1, got {p.vpp}")
    if p.schedule not in SCHEDULES:
        raise SettingsError(f"unknown pipeline schedule {quote(p.schedule)}; valid: {', '.join(SCHEDULES)}")
    if gpus % (p.model_ranks * p.cp):
        if p.cp > 1:
            raise SettingsError(f"--gpus {gpus} is not a multiple of tp({p.tp}) x pp({p.pp}) x cp({p.cp}) = "
                                f"{p.model_ranks * p.cp}: the data-parallel size gpus / (tp x pp x cp) must be whole")
        raise SettingsError(f"--gpus {gpus} is not a multiple of tp({p.tp}) x pp({p.pp}) = {p.model_ranks}: the "
                            "data-parallel size gpus / (tp x pp) must be whole")
    layout = layout_of(strategy, p.pp)
    if p.cp > 1 and layout != TORCHTITAN:
        raise SettingsError(f"--cp with --strategy {strategy.name}: memplan models context parallelism as torchtitan "
                            "runs it (torch's ring attention, FSDP2, HSDP or DDP); DeepSpeed's Ulysses sequence "
                            "parallelism is another scheme")
    if p.pp > 1 and p.schedule not in LAYOUT_SCHEDULES[layout]:
        raise SettingsError(f"--schedule {p.schedule}: {layout} runs {', '.join(LAYOUT_SCHEDULES[layout])}")
    if p.schedule in schedules.V_SHAPED and p.vpp not in (None, 2):
        raise SettingsError(f"--vpp {p.vpp} with --schedule {p.schedule}: {schedules.TORCH_NAMES[p.schedule]} runs "
                            "exactly two stages per rank")
    if p.vpp not in (None, 1) and not p.multi_stage:
        raise SettingsError(f"--vpp {p.vpp} needs a schedule that runs several stages per rank (--schedule "
                            f"{' | '.join(s for s in SCHEDULES if s in schedules.MULTI_STAGE)}); {p.schedule} runs one")
    if p.multi_stage and p.pp > 1 and p.virtual < 2:
        raise SettingsError(f"--schedule {p.schedule} needs at least 2 virtual stages per rank (--vpp)")
    d = inv.dims
    layers = len(inv.layer_blocks)
    if p.pp > 1:
        if not layers:
            raise SettingsError("--pp needs a model of repeated blocks; this one has none")
        stages = p.pp * (p.virtual if p.multi_stage else 1)
        effective = layers + (2 if layout == TORCHTITAN else 0)
        if stages > effective or (layout == MEGATRON_DEEPSPEED and p.pp > layers):
            raise SettingsError(f"--pp {p.pp}" + (f" x --vpp {p.virtual}" if stages != p.pp else "")
                                + f" = {stages} stages for {layers} blocks: more stages than "
                                + ("blocks" if layout == MEGATRON_DEEPSPEED else
                                   "blocks + 2 (torchtitan counts the embedding and the head as one block each)"))
    if p.tp > 1:
        heads, kv = d.get("num_heads"), d.get("num_kv_heads", d.get("num_heads"))
        inter = d.get("intermediate_size")
        if not heads:
            raise SettingsError("--tp needs the model's attention head count; this model does not declare it")
        if heads % p.tp:
            raise SettingsError(f"--tp {p.tp} does not divide the {heads} attention heads")
        if kv and kv % p.tp:
            if layout == TORCHTITAN or p.tp % kv:
                raise SettingsError(f"--tp {p.tp} does not divide the {kv} key/value heads" + (
                    " (Megatron replicates them only when tp is a multiple of their count)"
                    if layout != TORCHTITAN else " (DTensor's ColwiseParallel would split a head)"))
        if inter and inter % p.tp:
            raise SettingsError(f"--tp {p.tp} does not divide the MLP's {inter} intermediate features")
    if p.ep > 1:
        _check_ep(p, inv, strategy, gpus // p.model_ranks, layout)
    if p.pp > 1 and layout == TORCHTITAN:  # what torch's schedule constructors refuse
        schedules.check(p.schedule, p.pp, grad_accum, p.virtual if p.multi_stage else 1)
    return layout
