"""DeepSpeed ZeRO-3 leaf modules: modules fetched and released as one unit, with no hooks on their children
(deepspeed/utils/z3_leaf_module.py, runtime/zero/parameter_offload.py _register_deepspeed_module: registration stops
at a leaf; partitioned_param_coordinator.py fetches iter_params(leaf, recurse=True)). DeepSpeed 0.19.8 marks them
from the ds_config's zero_optimization.leaf_module (classes, names, name_suffixes; its default classes are the
Mixtral, Qwen2-MoE and Qwen3-MoE sparse MoE blocks, runtime/zero/leaf_module_config.py, applied by the engine to
every model: engine.py _configure_distributed_model) and from stage3_module_granularity_threshold
(parameter_offload.py _set_z3_leaf_modules_by_threshold). This module turns those into module paths.

The default classes resolve without torch (the MoE block is the module holding a layer's ``experts``); other
classes and the granularity threshold instantiate the model on the meta device to read its module tree.
"""

from __future__ import annotations

from typing import Any, Mapping

from memplan.errors import SettingsError
from memplan.model.inventory import ParamInventory

#: runtime/zero/leaf_module_config.py DEFAULT_LEAF_MODULE_CLASSES
DEFAULT_CLASSES = ("transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                   "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                   "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock")
#: the sparse MoE block class of each family transformers builds one for (what the default classes match)
MOE_BLOCK = {"mixtral": "MixtralSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
             "qwen3_moe": "Qwen3MoeSparseMoeBlock"}
#: parameter_offload.py _get_granularity_recursively: no leaf larger than this
Z3_MAX_LEAF_SIZE = 10**9
_CONTAINERS = ("Container", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict")


def _short(cls: str) -> str:
    return cls.rsplit(".", 1)[-1]


def moe_block_paths(inv: ParamInventory) -> list[str]:
    """The modules that hold a layer's experts (the sparse MoE blocks), in order."""
    out: list[str] = []
    for t in inv.tensors:
        if ".experts." in t.name:
            path = t.name.split(".experts.", 1)[0]
            if path not in out:
                out.append(path)
    return out


def _module_paths(inv: ParamInventory) -> set[str]:
    out: set[str] = set()
    for t in inv.tensors:
        parts = t.name.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            out.add(".".join(parts[:i]))
    return out


def resolve(inv: ParamInventory, classes: tuple[str, ...] | None, names: tuple[str, ...],
            suffixes: tuple[str, ...], threshold: int, config: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The leaf modules' paths, outermost only (a leaf's children get no hooks of their own). ``classes`` None:
    DeepSpeed's default classes."""
    classes = DEFAULT_CLASSES if classes is None else classes
    paths: list[str] = []
    model = None
    if classes:
        fam = MOE_BLOCK.get(inv.family)
        wanted = {_short(c) for c in classes}
        known = {_short(c) for c in DEFAULT_CLASSES}
        if wanted <= known:  # only MoE block classes: the family's own, if any
            if fam in wanted:
                paths += moe_block_paths(inv)
        else:
            from memplan.model import module_tree

            needs_config(config, "--z3-leaf-modules (classes other than the sparse MoE blocks)")
            paths += [m.path for m in module_tree.modules(config)  # type: ignore[arg-type]
                      if m.cls in wanted or m.qualified in classes]
            if not paths:
                raise SettingsError(f"ZeRO-3 leaf modules: no module of class {', '.join(sorted(wanted))} in "
                                    f"{inv.model_name}")
    if names or suffixes:
        known_paths = _module_paths(inv)
        missing = [n for n in names if n not in known_paths]
        if missing:
            raise SettingsError(f"ZeRO-3 leaf module names not in {inv.model_name}: {', '.join(missing)}")
        paths += [n for n in names]
        paths += sorted(p for p in known_paths if any(p.endswith(s) for s in suffixes))
    if threshold > 0:
        model = model or _model(config, "stage3_module_granularity_threshold")
        paths += _by_granularity(model, threshold)
    out: list[str] = []
    for p in sorted(set(paths), key=lambda x: (x.count("."), x)):
        if not any(p == q or p.startswith(q + ".") for q in out):
            out.append(p)
    return tuple(sorted(out))


def needs_config(config: Mapping[str, Any] | None, why: str) -> None:
    if config is None or config.get("factory"):
        raise SettingsError(f"{why} needs the model's config.json (a preset, a config file or a directory) to read "
                            "its module tree")


def _model(config: Mapping[str, Any] | None, why: str) -> Any:
    needs_config(config, why)
    assert config is not None
    from memplan.model.meta_builder import meta_model

    return meta_model(config)


def _by_granularity(model: Any, threshold: int) -> list[str]:
    """parameter_offload.py _get_granularity_recursively and _set_leaf_by_threshold_preorder: a module's granularity
    is its parameters over its layers (itself plus the torch leaf modules under it; containers and modules without
    parameters are never leaves); the first modules in preorder at or under the threshold become leaves."""
    import sys

    gran: dict[int, int] = {}

    def walk(m: Any) -> tuple[int, int]:
        if not any(True for _ in m.parameters()):
            gran[id(m)] = sys.maxsize
            return 0, 0
        params = sum(p.numel() for p in m.parameters(recurse=False))
        layers = 0
        children = list(m.children())
        if not children:
            gran[id(m)] = sys.maxsize
            return 1, params
        for c in children:
            cl, cp = walk(c)
            layers += cl
            params += cp
        if type(m).__name__ in _CONTAINERS:
            gran[id(m)] = sys.maxsize
            return layers, params
        layers += 1
        gran[id(m)] = params // layers if params <= Z3_MAX_LEAF_SIZE else sys.maxsize
        return layers, params

    walk(model)
    out: list[str] = []

    def mark(name: str, m: Any) -> None:
        if not any(True for _ in m.parameters()):
            return
        if gran[id(m)] <= threshold:
            out.append(name)
            return
        for cname, c in m.named_children():
            mark(f"{name}.{cname}" if name else cname, c)

    mark("", model)
    if "" in out:
        raise SettingsError("stage3_module_granularity_threshold makes the whole model one ZeRO-3 leaf module")
    return out
