"""Where the traced step's activations come from (--explain): every storage the step creates is labelled with the
module running when it was made (global forward hooks; in backward, the autograd node running) and the operator
that made it; at the moments the engine's phases peak, the storages alive are grouped by (module path with the
block index as *, operator, dtype, saved for backward or not), each group a line c0 + c1*b in the micro-batch."""

from __future__ import annotations

import re
from typing import Any

#: groups kept per moment (the largest; the rest are summed by the engine as "other")
KEEP = 40
#: the moments explained: the engine's phase -> which point of the traced step
MOMENTS = ("forward", "backward-start", "backward")


class ModuleStack:
    """The dotted path of the module whose forward is running (the innermost), for LiveBytes.labeler; outside
    every forward (the autograd engine running backward), the name of the autograd node running."""

    def __init__(self, model: Any) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        self.root = type(model).__name__
        self.stack: list[str] = []
        self.handles: list[Any] = []

    def install(self) -> None:
        import torch.nn.modules.module as mm

        from torch.compiler import is_compiling

        # inside a compiled region (tracing/compiled.py) dynamo would trace these hooks' side effects: they stay
        # out of it, and the region's storages take the label of the module that called it
        def pre(mod: Any, _args: Any) -> None:
            if is_compiling():
                return
            self.stack.append(self.names.get(id(mod), type(mod).__name__))

        def post(_mod: Any, _args: Any, _out: Any) -> None:
            if is_compiling():
                return
            if self.stack:
                self.stack.pop()

        self.handles = [mm.register_module_forward_pre_hook(pre), mm.register_module_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def label(self) -> str:
        if self.stack:
            return self.stack[-1] or self.root
        import torch

        node = torch._C._current_autograd_node()
        return f"backward: {node.name()}" if node is not None else self.root


def block_pattern(block_names: list[str]) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A regex matching a path inside one of the blocks, and block path -> index."""
    if not block_names:
        return None, {}
    prefixes = sorted(set(re.sub(r"\d+$", "", n) for n in block_names))
    pat = re.compile("^(" + "|".join(re.escape(p) for p in prefixes) + r")(\d+)(\..*)?$")
    return pat, {n: i for i, n in enumerate(block_names)}


def composition(origins: list[list[Any]], skip: set[int], saved: set[int], tick: int,
                block_names: list[str]) -> dict[tuple, list[int]]:
    """The storages alive at timeline index ``tick`` (born <= tick < died), gradients (``skip``) left out, grouped:
    (path with the block index as *, op, dtype, saved) -> [bytes, bytes in the first block, storages, shape...]."""
    pat, index = block_pattern(block_names)
    out: dict[tuple, list[Any]] = {}
    seen: dict[tuple[str, str], int] = {}
    for sid, (module, op, dtype, shape, born, died, n) in enumerate(origins):
        # the k-th storage this module's op made: the same storage in the trace at another micro-batch
        k = seen[(module, op)] = seen.get((module, op), -1) + 1
        if sid in skip or born > tick or (died is not None and died <= tick):
            continue
        blk = None
        if pat is not None:
            m = pat.match(module)
            if m is not None:
                blk = index.get(m.group(1) + m.group(2))
                module = f"{m.group(1)}*{m.group(3) or ''}"
        key = (module, op, dtype, sid in saved, k)
        g = out.setdefault(key, [0, 0, 0, shape])
        g[0] += n
        g[1] += n if blk == 0 else 0
        g[2] += 1
    return out


def moment_ticks(t2: list[int], t4: list[int], forward_end: int,
                 last_backward_start: int | None) -> dict[str, list[int]]:
    """The timeline indices of each explained moment, from the step traced at micro-batch 2 (``t2``) and 4
    (``t4``): the points on the upper envelope (over micro-batches b >= 1) of the forward (the loss included) and of
    the backward (the profile's forward and backward peaks: whichever is largest at the job's micro-batch is the
    one explained), and the point where the last block's backward begins."""
    from memplan.activations.profile_fit import envelope

    def env(lo: int, hi: int) -> list[int]:
        pts = [(2 * t2[i] - t4[i], (t4[i] - t2[i]) // 2, i) for i in range(lo, hi)]
        return [x[2] for x in envelope(pts)] if pts else [lo]

    lo = max(forward_end - 1, 0)
    bwd = env(lo, len(t4))
    end = last_backward_start if last_backward_start is not None else max(bwd, key=lambda i: t4[i])
    return {"forward": env(0, max(forward_end, 1)), "backward-start": bwd, "backward": [end]}


def lines(a: dict[tuple, list[Any]], b: dict[tuple, list[Any]]) -> list[dict[str, Any]]:
    """Groups of the step traced at micro-batch 2 (``a``) and 4 (``b``) as lines in the micro-batch, the largest
    at micro-batch 4 first (KEEP of them). A group in one trace only counts as 0 in the other."""
    merged: dict[tuple, dict[str, Any]] = {}
    for key in set(a) | set(b):
        x, y = a.get(key, [0, 0, 0, None]), b.get(key, [0, 0, 0, None])
        shape_a, shape_b = x[3] or y[3], y[3] or x[3]
        batch = [int(p != q) for p, q in zip(shape_a, shape_b)] if len(shape_a) == len(shape_b) else []
        module, op, dtype, saved, _k = key
        # storages of one module's op with the same shape are one group (the same tensor in each block, or
        # repeated calls)
        g = merged.setdefault((module, op, dtype, saved, tuple(shape_b), tuple(batch)), {
            "module": module, "op": op, "dtype": dtype, "saved": saved, "shape": shape_b, "batch_dims": batch,
            "count": 0, "at": [0, 0], "block0": [0, 0]})
        g["count"] += y[2]
        g["at"][0] += x[0]
        g["at"][1] += y[0]
        g["block0"][0] += x[1]
        g["block0"][1] += y[1]
    out = []
    for g in merged.values():
        (x, y), (bx, by) = g.pop("at"), g["block0"]
        g["line"] = [2 * x - y, (y - x) // 2]  # through b = 2 and b = 4
        g["block0"] = [2 * bx - by, (by - bx) // 2]
        g["_at4"] = y
        out.append(g)
    out.sort(key=lambda g: (-g["_at4"], g["module"], g["op"]))
    for g in out:
        del g["_at4"]
    return out[:KEEP]
