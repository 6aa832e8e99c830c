"""FSDP units by size (``--fsdp-wrap size:N``) or by module class (``--fsdp-wrap class:A,B``): which module each
parameter's FlatParameter / fully_shard group belongs to under torch's ``size_based_auto_wrap_policy(
min_num_params=N)`` or ``transformer_auto_wrap_policy`` / ``ModuleWrapPolicy`` (every module of the classes, nested
ones too: the class policy always descends).

The rule is torch 2.13's (torch/distributed/fsdp/wrap.py ``_recursive_wrap`` with ``size_based_auto_wrap_policy``),
walked over the module tree the parameter names spell:

- a module is descended into when the parameters of its subtree (each counted once, as ``module.parameters()``
  does: a tied weight counts in every subtree that holds it, as if nothing were wrapped yet) number at least N;
- on the way back up it is wrapped when the parameters its wrapped descendants did not take (``remainder``)
  number at least N, unless it is a container (``EXCLUDE_WRAP_MODULES``: nn.ModuleList, nn.ModuleDict; a module
  whose children are all numbered is taken for a ModuleList); a leaf is wrapped when its own parameters number
  at least N;
- the root is always a unit (FSDP1 wraps the children with ``only_wrap_children`` and then the root itself);
- units are made children first (post-order), and each takes the parameters of its subtree that no earlier unit
  took (FSDP1's ``_get_orig_params`` skips flattened ones): a tied weight goes to the first unit made around it.

FSDP2 (``fully_shard``) has no auto-wrap policy; ``size:N`` there means ``fully_shard`` applied to the same
modules bottom-up, then to the root (fully_shard's ``_get_managed_states`` likewise skips parameters an inner
unit manages).

This module is pure Python.
"""

from __future__ import annotations

from dataclasses import replace

from memplan.model.inventory import HELD_UNIT, ROOT_BLOCK, ParamInventory

#: the policy's default threshold (size_based_auto_wrap_policy min_num_params=int(1e8))
DEFAULT_MIN_NUM_PARAMS = 100_000_000


class _Node:
    __slots__ = ("path", "children", "own")

    def __init__(self, path: str) -> None:
        self.path = path
        self.children: dict[str, _Node] = {}  # in registration order (the inventory's module order)
        self.own: list[int] = []  # indices of tensors this module holds directly (a tied one in each holder)


def _tree(inv: ParamInventory) -> _Node:
    root = _Node("")
    holders: list[tuple[str, int]] = []
    for i, t in enumerate(inv.tensors):
        holders += [(t.name, i)] + [(n, i) for n in t.tied_names]
    for name, i in holders:  # the first names first: a tied name's modules are made where it first appears
        node = root
        parts = name.split(".")[:-1]
        for k, part in enumerate(parts):
            child = node.children.get(part)
            if child is None:
                child = node.children[part] = _Node(".".join(parts[:k + 1]))
            node = child
        node.own.append(i)
    return root


def _subtree(node: _Node, out: set[int]) -> set[int]:
    out.update(node.own)
    for c in node.children.values():
        _subtree(c, out)
    return out


def _is_container(node: _Node) -> bool:
    return bool(node.children) and not node.own and all(k.isdigit() for k in node.children)


def unit_owners(inv: ParamInventory, policy: int | frozenset[str]) -> tuple[str, ...]:
    """The unit (module path, "" for the root) each tensor of ``inv`` belongs to, in the inventory's order, under a
    size policy (an int: min_num_params) or a module-class policy (the paths of the modules of the wrapped
    classes: transformer_auto_wrap_policy / ModuleWrapPolicy wrap every such module, nested ones too)."""
    return _units(inv, policy)[0]


def split_tied(inv: ParamInventory, policy: int | frozenset[str]) -> tuple[str, str, str] | None:
    """A tied weight whose holders run under different units (its name, its unit, the other holder's unit), or
    None. FSDP has "limited support for shared parameters" (FullyShardedDataParallel's docstring): the unit that
    owns the weight reshards it after its own forward while the other holder still computes with it."""
    owners, paths = _units(inv, policy)
    for t, owner in zip(inv.tensors, owners):
        for alias in t.tied_names:
            module = alias.rpartition(".")[0]
            inner = max((p for p in paths if p == "" or module == p or module.startswith(p + ".")), key=len)
            if inner != owner:
                return t.name, owner or "the root", inner or "the root"
    return None


def _units(inv: ParamInventory, policy: int | frozenset[str]) -> tuple[tuple[str, ...], list[str]]:
    numel = [t.numel for t in inv.tensors]
    units: list[_Node] = []

    def visit(node: _Node, root: bool) -> int:
        members = _subtree(node, set())
        nonwrapped = sum(numel[i] for i in members)
        if nonwrapped < policy:
            return 0
        wrapped = sum(visit(c, False) for c in node.children.values())
        if not root and nonwrapped - wrapped >= policy and not _is_container(node):
            units.append(node)
            return nonwrapped
        return wrapped

    def visit_classes(node: _Node) -> None:  # _recursive_wrap with _module_wrap_policy: always descends
        for c in node.children.values():
            visit_classes(c)
        if node.path in policy:
            units.append(node)

    tree = _tree(inv)
    if isinstance(policy, int):
        visit(tree, True)
    else:
        for c in tree.children.values():
            visit_classes(c)
    units.append(tree)
    owner: list[str | None] = [None] * len(inv.tensors)
    for u in units:
        for i in sorted(_subtree(u, set())):
            if owner[i] is None:
                owner[i] = u.path
    return tuple(o or "" for o in owner), [u.path for u in units]


def _inside(unit: str, block: str) -> bool:
    return block != ROOT_BLOCK and (unit == block or unit.startswith(block + "."))


HELD = HELD_UNIT


def root_only(inv: ParamInventory) -> bool:
    """The job's units are modelled as the root alone (with_units held=True)."""
    return bool(inv.tensors) and inv.tensors[0].unit.startswith(HELD)


def with_units(inv: ParamInventory, policy: int | frozenset[str], held: bool = False) -> ParamInventory:
    """``inv`` with each tensor's FSDP unit set (ParamTensor.unit) under ``policy`` (unit_owners): a unit inside a
    decoder block is gathered within that block; a unit above the blocks (the decoder stack's parent, or the root)
    holds its parameters across all of them, so those tensors join the root group (ParamTensor.group). ``held``: the
    FSDP models take the job as the root alone (--fsdp-wrap none's timeline), each unit still its own
    FlatParameter."""
    units = unit_owners(inv, policy)
    tensors = tuple(replace(t, unit=(HELD + (u or "<root>")) if held else u if _inside(u, t.block)
                            else (u or "<root>")) for t, u in zip(inv.tensors, units))
    return replace(inv, tensors=tensors)


_cache: dict[tuple, tuple[ParamInventory, ParamInventory]] = {}


def policy_of(s) -> int | frozenset[str] | None:
    """The wrap policy of ``--fsdp-wrap``: size:N's min_num_params, class:...'s module paths (resolved with the
    model: TorchKnobs.fsdp_wrap_modules), or None where the blocks and the root are the units."""
    wrap = s.torch.fsdp_wrap
    if wrap.startswith("size:"):
        return int(wrap[5:])
    if wrap.startswith("class:"):
        return frozenset(s.torch.fsdp_wrap_modules)
    return None


def peft_policy(inv: ParamInventory) -> frozenset[str]:
    """The units of PEFT's fsdp_auto_wrap_policy (peft/utils/other.py), which the HF Trainer puts in place of the
    job's auto-wrap policy for a PEFT model (transformers/distributed/fsdp.py update_fsdp_plugin_peft): the
    transformer blocks (the model's _no_split_modules classes), and every leaf module whose ``weight`` requires grad
    (each LoRA lora_A / lora_B, a modules_to_save copy) as a unit of its own, so that no FlatParameter mixes frozen
    and trainable parameters (FSDP1 with use_orig_params=False requires that)."""
    blocks = {t.block for t in inv.tensors if t.block != ROOT_BLOCK}
    leaves = {t.module for t in inv.tensors if t.trainable and t.name.endswith(".weight")}
    return frozenset(blocks | leaves)


def mixed_unit(inv: ParamInventory) -> tuple[str, str, str] | None:
    """A unit of ``inv`` (its units set) holding both frozen and trainable parameters: (unit, a frozen tensor, a
    trainable one), or None."""
    seen: dict[str, list[str]] = {}
    for t in inv.tensors:
        row = seen.setdefault(t.unit or t.block, ["", ""])
        row[1 if t.trainable else 0] = row[1 if t.trainable else 0] or t.name
    for unit, (frozen, trainable) in seen.items():
        if frozen and trainable:
            return unit.removesuffix("<root>") or "the root", frozen, trainable
    return None


def units_for(inv: ParamInventory, s) -> ParamInventory:
    """FrameworkModel.units for FSDP1 and FSDP2: the units of ``--fsdp-wrap size:N`` or ``class:...``, else ``inv``
    (the blocks and the root are the units); under FSDP1, a LoRA model gets PEFT's units
    (peft_policy). Cached per inventory: the planner asks for every configuration."""
    policy = policy_of(s)
    if policy is None and s.torch.fsdp_version == 1 and inv.adapter_params:
        policy = peft_policy(inv)
    if policy is None:
        return inv
    key = (id(inv), policy, s.torch.fsdp_version)
    hit = _cache.get(key)
    if hit is not None and hit[0] is inv:
        return hit[1]
    if len(_cache) > 64:
        _cache.clear()
    # no unit inside a block, or (FSDP1) a tied weight split between units: counted as the root alone (options.py
    # says so; measured: docs/accuracy.md)
    out = with_units(inv, policy)
    if not any(t.group != ROOT_BLOCK for t in out.tensors) or (
            s.torch.fsdp_version == 1 and split_tied(inv, policy) is not None):
        out = with_units(inv, policy, held=True)
    _cache[key] = (inv, out)
    return out


def containers(inv: ParamInventory) -> list[tuple[str, int]]:
    """The module containers (a module whose children are all numbered: nn.ModuleList) with the parameters of
    their subtree, outermost first."""
    out: list[tuple[str, int]] = []
    numel = [t.numel for t in inv.tensors]

    def walk(node: _Node) -> None:
        if _is_container(node):
            out.append((node.path, sum(numel[i] for i in _subtree(node, set()))))
        for c in node.children.values():
            walk(c)

    walk(_tree(inv))
    return out
