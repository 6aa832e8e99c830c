"""Parameters a job does not train (--freeze): a vision-language model's vision tower, as LLaVA's and Qwen-VL's
fine-tuning scripts freeze it (``model.vision_tower.requires_grad_(False)``), or any module paths. A frozen
parameter gets no gradient and no optimizer state; every framework leaves it out of what it reduces and steps
(DDP buckets only parameters that require grad: torch/nn/parallel/distributed.py _build_params_for_reducer;
DeepSpeed's optimizer takes the param groups it is given; FSDP2 reduces the gradients that exist), and an operator
none of whose inputs requires grad saves nothing for backward (a frozen tower's forward on images that need no
gradient). The traced step and the harness freeze the same parameters (requires_grad_off). No torch at import."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from memplan.errors import ConfigError
from memplan.inputs import quote

#: the vision tower's module path by model_type, as transformers 5 names it (modeling_llava.py LlavaModel,
#: modeling_gemma3.py Gemma3Model: self.vision_tower; the projector beside it trains; modeling_qwen2_5_vl.py
#: Qwen2_5_VLModel: self.visual, its projector, the merger, inside it; modeling_mllama.py MllamaModel:
#: self.vision_model, its projector beside it)
VISION_TOWERS = {"llava": "model.vision_tower", "gemma3": "model.vision_tower", "paligemma": "model.vision_tower",
                 "qwen2_vl": "model.visual", "qwen2_5_vl": "model.visual", "qwen3_vl": "model.visual",
                 "qwen3_vl_moe": "model.visual", "qwen3_5": "model.visual", "qwen3_5_moe": "model.visual",
                 "mllama": "model.vision_model"}
#: what --freeze vision freezes where the projector sits inside the tower: the tower less its mergers, as Qwen's
#: own fine-tuning script does by default (qwen-vl-finetune train_qwen.py: tune_mm_vision off, tune_mm_mlp on:
#: model.visual's parameters frozen, then model.visual.merger's trained again; Qwen3-VL's deepstack mergers are
#: projectors too)
VISION_FROZEN = {"qwen2_vl": ("model.visual.patch_embed", "model.visual.blocks"),
                 "qwen2_5_vl": ("model.visual.patch_embed", "model.visual.blocks"),
                 "qwen3_vl": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks"),
                 "qwen3_vl_moe": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks"),
                 "qwen3_5": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks"),
                 "qwen3_5_moe": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks")}
#: --freeze's name for the vision tower
VISION = "vision"


def paths(spec: str | None, config: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The module paths --freeze names (comma-separated; ``vision``: the config's vision tower), in order, once."""
    if spec is None:
        return ()
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise ConfigError(f"--freeze {quote(spec)}: an empty path")
        if part == VISION:
            mt = str((config or {}).get("model_type"))
            tower = VISION_TOWERS.get(mt)
            from memplan.model import tasks

            if config and "architectures" in config and tasks.task_of(config) != tasks.IMAGE_TEXT:
                tower = None  # the model_type's text-only class (MllamaForCausalLM): no tower
            if tower is None:
                raise ConfigError(f"--freeze vision: a vision-language model's vision tower ({', '.join(VISION_TOWERS)}); "
                                  f"this model has none (give module paths instead)")
            out.extend(p for p in VISION_FROZEN.get(mt, (tower,)) if p not in out)
            continue
        if part not in out:
            out.append(part)
    return tuple(out)


def matches(name: str, frozen: Iterable[str]) -> bool:
    """Whether the parameter ``name`` lies under one of the ``frozen`` module paths (or is one of them)."""
    return any(name == p or name.startswith(p + ".") for p in frozen)


def apply(inv: Any, frozen: tuple[str, ...]) -> Any:
    """The inventory with the parameters under ``frozen`` not trainable (no gradient, no optimizer state), and the
    paths recorded (ParamInventory.frozen_paths). ConfigError for a path that holds no parameter, or when nothing
    would train."""
    if not frozen:
        return inv
    for p in frozen:
        if not any(matches(t.name, (p,)) or any(matches(a, (p,)) for a in t.tied_names) for t in inv.tensors):
            raise ConfigError(f"--freeze {quote(p)}: no parameter of {inv.model_name} lies under it (module paths "
                              "as named_parameters() names them, e.g. model.vision_tower)")
    # a tied parameter is one tensor: freezing it under any of its names freezes it (requires_grad_ on the module
    # that holds it, as requires_grad_off does: a frozen embedding freezes the head tied to it)
    out = tuple(replace(t, trainable=False) if matches(t.name, frozen) or any(matches(a, frozen) for a in t.tied_names)
                else t for t in inv.tensors)
    if not any(t.trainable for t in out):
        raise ConfigError(f"--freeze {','.join(frozen)}: every parameter would be frozen; nothing trains")
    n = sum(t.numel for t in out if not t.trainable)
    note = (f"frozen: {', '.join(frozen)} ({n:,} parameters: no gradients, no optimizer states; an operator whose "
            "inputs need no gradient saves nothing for backward)")
    return replace(inv, tensors=out, frozen_paths=frozen, notes=inv.notes + (note,))


def requires_grad_off(model: Any, frozen: Iterable[str] | None) -> None:
    """Freeze a built torch model's parameters under ``frozen`` (the traced step's and the harness's)."""
    frozen = tuple(frozen or ())
    if not frozen:
        return
    for name, p in model.named_parameters(remove_duplicate=False):
        if matches(name, frozen):
            p.requires_grad_(False)


def for_request(inv: Any, request: Any) -> Any:
    """The inventory with the request's --freeze applied (after its LoRA adapters: refused together, PEFT freezing
    every base parameter already). Parameters that require a gradient and get none (LLaVA's vision layers past its
    vision_feature_layer, a vision tower with ``--images 0``) are the traced step's to find (traced_unreached)."""
    spec = request.model.freeze
    if spec is None:
        return inv
    if request.adapters.spec is not None:
        raise ConfigError("--freeze with LoRA: PEFT already freezes every base parameter (modules_to_save trains "
                          "whole modules beside the adapters)")
    return apply(inv, paths(spec, {"model_type": inv.family}))


def modules(names: Iterable[str], inv: Any) -> list[str]:
    """The fewest module paths that hold exactly the trainable parameters ``names`` (by the inventory's first
    names): a module all of whose trainable parameters are named stands for them, and consecutive layers of one
    stack are one range (model.vision_tower.encoder.layers.22-23)."""
    chosen = set(names)
    total: dict[str, int] = {}
    named: dict[str, int] = {}
    for t in inv.tensors:
        if not t.trainable:
            continue
        parts = t.name.split(".")
        for k in range(1, len(parts)):
            prefix = ".".join(parts[:k])
            total[prefix] = total.get(prefix, 0) + 1
            named[prefix] = named.get(prefix, 0) + (t.name in chosen)
    out: list[str] = []
    for t in inv.tensors:
        if t.name not in chosen:
            continue
        parts = t.name.split(".")
        top = t.name
        for k in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:k])
            if named[prefix] != total[prefix]:
                break
            top = prefix
        if top not in out:
            out.append(top)
    return _short(tuple(out))


def _short(paths: tuple[str, ...]) -> list[str]:
    """Consecutive layers of one stack as one range (model.vision_tower.encoder.layers.22-23)."""
    out: list[str] = []
    for p in paths:
        stem, _, idx = p.rpartition(".")
        if out and idx.isdigit() and out[-1].rpartition(".")[0] == stem:
            first, _, last = out[-1].rpartition(".")[2].partition("-")
            if first.isdigit() and int(last or first) + 1 == int(idx):
                out[-1] = f"{stem}.{first}-{idx}"
                continue
        out.append(p)
    return out


def traced_unreached(inv: Any, traced: list[str], traced_blocks: list[str]) -> tuple[str, ...]:
    """The inventory's parameters (by their first names) that the traced step's ``traced`` ones (parameters that
    require a gradient and got none: tracing/step.py one_step) stand for. Traced at the model's own depth, by name;
    traced with fewer blocks (the blocks alike), a parameter of a block stands for the same parameter of every block
    of its stack where it got no gradient in every traced block of that stack. A LoRA adapter is named as the
    traced step names it (_as_traced)."""
    first = {_as_traced(n): t.name for t in inv.tensors for n in (t.name, *t.tied_names)}
    if not traced:
        return ()
    full = [b.name for b in inv.layer_blocks]
    if set(traced_blocks) == set(full):
        return tuple(sorted({first[n] for n in traced if n in first}))
    out: set[str] = set()
    roles: dict[tuple[str, str], int] = {}
    per_stack: dict[str, int] = {}
    for b in traced_blocks:
        per_stack[b.rpartition(".")[0]] = per_stack.get(b.rpartition(".")[0], 0) + 1
    for n in traced:
        blk = next((b for b in traced_blocks if n.startswith(b + ".")), None)
        if blk is None:
            if n in first:
                out.add(first[n])
            continue
        key = (blk.rpartition(".")[0], n[len(blk) + 1:])
        roles[key] = roles.get(key, 0) + 1
    for (stack, role), count in roles.items():
        if count == per_stack[stack]:
            out.update(first[f"{b}.{role}"] for b in full
                       if b.rpartition(".")[0] == stack and f"{b}.{role}" in first)
    return tuple(sorted(out))


def _as_traced(name: str) -> str:
    """An inventory parameter's name as the traced step names it: PEFT keeps each adapter in a ModuleDict by its
    name (``lora_A.default.weight``, ``modules_to_save.default.weight``: peft/tuners/lora/layer.py,
    peft/utils/other.py ModulesToSaveWrapper), the traced step's adapters are the modules themselves
    (activations/tracing/lora.py: ``lora_A.weight``) and it trains a module to save in place."""
    return re.sub(r"\.(lora_[AB])\.default\.", r".\1.", name).replace(".modules_to_save.default.", ".")
