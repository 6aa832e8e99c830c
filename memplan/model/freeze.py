"""Parameters a job does not train (--freeze): a vision-language model's vision tower, as LLaVA's and Qwen-VL's
fine-tuning scripts freeze it (``model.vision_tower.requires_grad_(False)``), or any module paths. A frozen
parameter gets no gradient and no optimizer state; every framework leaves it out of what it reduces and steps
(DDP buckets only parameters that require grad: torch/nn/parallel/distributed.py _build_params_for_reducer;
DeepSpeed's optimizer takes the param groups it is given; FSDP2 reduces the gradients that exist), and an operator
none of whose inputs requires grad saves nothing for backward (a frozen tower's forward on images that need no
gradient). The traced step and the harness freeze the same parameters (requires_grad_off). No torch at import."""

from __future__ import annotations

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
                 "qwen3_vl_moe": "model.visual", "mllama": "model.vision_model"}
#: what --freeze vision freezes where the projector sits inside the tower: the tower less its mergers, as Qwen's
#: own fine-tuning script does by default (qwen-vl-finetune train_qwen.py: tune_mm_vision off, tune_mm_mlp on:
#: model.visual's parameters frozen, then model.visual.merger's trained again; Qwen3-VL's deepstack mergers are
#: projectors too)
VISION_FROZEN = {"qwen2_vl": ("model.visual.patch_embed", "model.visual.blocks"),
                 "qwen2_5_vl": ("model.visual.patch_embed", "model.visual.blocks"),
                 "qwen3_vl": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks"),
                 "qwen3_vl_moe": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks")}
#: the projector's module path where it is beside the tower
PROJECTORS = {"llava": "model.multi_modal_projector", "gemma3": "model.multi_modal_projector",
              "paligemma": "model.multi_modal_projector", "mllama": "model.multi_modal_projector"}
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
    every base parameter already)."""
    spec = request.model.freeze
    if request.batch.images == 0 and inv.family in VISION_TOWERS:  # text alone: the vision side never runs
        inv = mark_unread(inv, unread_paths(None, {"model_type": inv.family}, 0), "--images 0")
    if spec is None:
        return inv
    if request.adapters.spec is not None:
        raise ConfigError("--freeze with LoRA: PEFT already freezes every base parameter (modules_to_save trains "
                          "whole modules beside the adapters)")
    return apply(inv, paths(spec, {"model_type": inv.family}))


def unread_reason(hf_config: Any) -> str:
    """Why unread_paths' parameters get no gradient, for the inventory's note: LLaVA's vision_feature_layer, or
    the pooling head a SigLIP tower builds under vision_use_head (Gemma 3, PaliGemma read its last_hidden_state)."""
    k = getattr(hf_config, "vision_feature_layer", None)
    return f"vision_feature_layer {k}" if k is not None else "the vision tower's pooling head (vision_use_head)"


def unread_paths(model: Any, config: Mapping[str, Any], images: int | None = None) -> tuple[str, ...]:
    """The module paths of a built model whose parameters no loss reads, so that they never get a gradient:
    LLaVA takes its features from the vision tower's hidden_states[vision_feature_layer] (modeling_llava.py
    get_image_features: -2 by default, the output of the second-to-last layer), so the layers after it and the
    tower's post_layernorm (and a SigLIP tower's pooling head) run but feed nothing; a vision-language step without
    images (``images`` 0) never runs the vision tower or the projector."""
    from memplan.model import tasks

    mt = str(config.get("model_type"))
    tower = VISION_TOWERS.get(mt)
    # a vision-language model_type's text-only class (MllamaForCausalLM, Gemma3ForCausalLM) has no tower
    if tower is None or ("architectures" in config and tasks.task_of(config) != tasks.IMAGE_TEXT):
        return ()
    if images == 0:
        return (tower,) + ((PROJECTORS[mt],) if mt in PROJECTORS else ())
    t = model.get_submodule(tower)
    if mt != "llava":  # the tower's last_hidden_state is read (Gemma 3, PaliGemma): a SigLIP pooling head is not
        return (f"{tower}.head",) if hasattr(t, "head") else ()
    import torch.nn as nn

    lists = [(n, m) for n, m in t.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return ()
    name, layers = max(lists, key=lambda nm: len(nm[1]))
    k = model.config.vision_feature_layer
    n = len(layers)
    # hidden_states: the embeddings' output, then each layer's (n + 1); hidden_states[i] is layer i - 1's output
    first = max((x if x >= 0 else n + 1 + x) for x in (k if isinstance(k, (list, tuple)) else [k]))
    out = [f"{tower}.{name}.{i}" for i in range(first, n)]
    out += [f"{tower}.{leaf}" for leaf in ("post_layernorm", "head") if hasattr(t, leaf)]
    return tuple(out)


def mark_unread(inv: Any, unread: tuple[str, ...], why: str) -> Any:
    """The inventory with the parameters under ``unread`` (unread_paths) counted as the frozen are: they get no
    gradient (their .grad stays None), so torch's optimizers make them no state. Under DDP they need
    find_unused_parameters=True and are still bucketed, and DeepSpeed ZeRO keeps states for them in its flat
    partitions: neither is counted (the note says so)."""
    if not unread:
        return inv
    out = tuple(replace(t, trainable=False) if matches(t.name, unread) else t for t in inv.tensors)
    n = sum(a.numel for a, b in zip(inv.tensors, out) if a.trainable and not b.trainable)
    if not n:
        return inv
    note = (f"{why}: {', '.join(_short(unread))} ({n:,} parameters) feed no loss: no gradients, no optimizer states "
            "(DDP needs find_unused_parameters=True and still buckets them; DeepSpeed ZeRO keeps their states in its "
            "flat partitions: neither counted)")
    return replace(inv, tensors=out, notes=inv.notes + (note,))


def _short(paths: tuple[str, ...]) -> list[str]:
    """Consecutive layers of one stack as one range (model.vision_tower.encoder.layers.22-23)."""
    out: list[str] = []
    for p in paths:
        stem, _, idx = p.rpartition(".")
        if out and idx.isdigit() and out[-1].rpartition(".")[0] == stem:
            first = out[-1].rpartition(".")[2].split("-")[0]
            if first.isdigit():
                out[-1] = f"{stem}.{first}-{idx}"
                continue
        out.append(p)
    return out


def traced_unreached(inv: Any, traced: list[str], traced_blocks: list[str]) -> tuple[str, ...]:
    """The inventory's parameters (by their first names) that the traced step's ``traced`` ones (parameters that
    require a gradient and got none: tracing/step.py one_step) stand for. Traced at the model's own depth, by name;
    traced with fewer blocks (the blocks alike), a parameter of a block stands for the same parameter of every block
    of its stack where it got no gradient in every traced block of that stack. Names the inventory does not hold
    (an adapter's, under LoRA) are left out."""
    first = {n: t.name for t in inv.tensors for n in (t.name, *t.tied_names)}
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
