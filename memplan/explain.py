"""What the peak is made of, in the model's own terms (--explain): the peak phase's bytes by category, and its
activations by where they come from, from the trace (memplan/activations/tracing/explain.py): the module path and operator
that made each group of tensors alive at that moment, its dtype and shape at the job's micro-batch, how many there
are (one per block, the untraced blocks counted as the traced first one), and its share of the peak.

Pure integers from the Plan and its profile; no torch. The groups plus "other" add up to the phase's activations
exactly; the categories add up to the allocated peak.
"""

from __future__ import annotations

from typing import Any

from memplan.timeline import CATEGORIES
from memplan.units import fmt_bytes

#: activation groups listed by --explain (the rest are "other activations")
TOP = 12

#: what each framework's buffers are at a step's peak (memplan/frameworks/*)
BUFFERS = {"ddp": "DDP reducer buckets (bucket_cap_mb) and cuBLAS workspaces",
           "zero12": "ZeRO-1/2 gradient buckets (reduce_bucket_size), the optimizer step's scratch and cuBLAS "
                     "workspaces",
           "zero3": "ZeRO-3 gathered parameters (prefetch, live parameters), reduce buckets and cuBLAS workspaces",
           "fsdp2": "FSDP unsharded parameters and gradients of the current and prefetched units, reduce-scatter "
                    "buffers and cuBLAS workspaces",
           "fsdp1": "FSDP unsharded flat parameters and gradients of the current and prefetched units, "
                    "reduce-scatter buffers and cuBLAS workspaces"}

#: what an operator's output is, said plainly (else the operator's own name)
_OPS = {"_to_copy": "cast", "mm": "matmul", "addmm": "matmul", "bmm": "batched matmul", "_log_softmax": "log-softmax",
        "_softmax": "softmax", "silu": "SiLU", "gelu": "GELU", "mul": "product", "add": "sum",
        "embedding": "embedding lookup", "_scaled_dot_product_flash_attention": "flash attention (out, logsumexp)",
        "_scaled_dot_product_efficient_attention": "memory-efficient attention (out, logsumexp)",
        "_scaled_dot_product_cudnn_attention": "cuDNN attention (out, stats)",
        "nll_loss_backward": "gradient of the loss", "_log_softmax_backward_data": "gradient of the log-softmax"}


def _groups(profile: Any, phase: str, b: int) -> list[dict[str, Any]] | None:
    """The traced groups alive at ``phase``'s moment at micro-batch ``b`` (the moment whose line is largest at
    b, as the profile's peak term), the untraced blocks added; None without a trace that recorded them."""
    data = getattr(profile, "data", None)
    points = ((data or {}).get("explain") or {}).get(phase)
    if not points:
        return None
    point = max(points, key=lambda p: p["line"][0] + p["line"][1] * b)
    extra_blocks = data["num_layers"] - data["traced_layers"]
    out = []
    for g in point["groups"]:
        per_block = g["block0"][0] + g["block0"][1] * b
        n = g["line"][0] + g["line"][1] * b + extra_blocks * per_block
        if n <= 0:
            continue
        shape = [d * b // 4 if batch else d for d, batch in zip(g["shape"], g["batch_dims"] or [0] * len(g["shape"]))]
        blocks = "*" in g["module"]
        count = g["count"] + (extra_blocks * g["count"] // max(data["traced_layers"], 1) if blocks and per_block
                              else 0)
        out.append({"module": g["module"], "op": g["op"], "dtype": g["dtype"], "saved": g["saved"], "shape": shape,
                    "count": count, "bytes": n})
    out.sort(key=lambda x: -x["bytes"])
    return out


def _label(g: dict[str, Any]) -> str:
    what = _OPS.get(g["op"], g["op"])
    return f"{g['module']} → {what}"


def _detail(g: dict[str, Any]) -> str:
    shape = " × ".join(str(d) for d in g["shape"]) or "scalar"
    kept = "saved for backward" if g["saved"] else "alive"
    each = g["bytes"] // g["count"] if g["count"] else g["bytes"]
    many = f"{g['count']} × {fmt_bytes(each)}, " if g["count"] > 1 else ""
    return f"{g['dtype']} [{shape}], {many}{kept}"


def _buffers(s: Any, phase: str) -> str:
    """What the peak's buffers are: the framework's (BUFFERS), DDP's reducer buckets only where the job has them
    (not plain PyTorch on one GPU, nor Horovod), and the optimizer step's scratch where the peak is the step."""
    detail = BUFFERS.get(s.strategy.memory_model, "")
    if s.strategy.memory_model == "ddp" and not s.strategy.ddp_buckets:
        detail = "cuBLAS workspaces" + (" and Horovod's fusion buffer" if s.strategy.fusion_buffer else "")
    if phase == "optimizer-step" and "step's scratch" not in detail:
        detail = "the optimizer step's scratch (its kernel's temporaries), " + detail
    return detail


def explain(plan: Any, top: int = TOP) -> dict[str, Any]:
    """The peak by category, and its activations by module and operator (when traced)."""
    s, peak = plan.settings, plan.peak
    total = peak.total_bytes
    items: list[dict[str, Any]] = []
    for key, label in CATEGORIES.items():
        n = getattr(peak, key)
        if key == "activations_bytes" or not n:
            continue
        detail = _buffers(s, peak.name) if key == "buffers_bytes" else ""
        items.append({"kind": key.removesuffix("_bytes"), "what": label, "detail": detail, "bytes": n})
    acts = peak.activations_bytes
    groups = _groups(s.activation_profile, peak.name, s.micro_batch) if acts else None
    if groups is not None:
        listed = groups[:top]
        for g in listed:
            items.append({"kind": "activations", "what": _label(g), "detail": _detail(g), "bytes": g["bytes"],
                          "module": g["module"], "op": g["op"]})
        rest = acts - sum(g["bytes"] for g in listed)
        if rest:
            items.append({"kind": "activations", "what": "other activations",
                          "detail": f"{max(len(groups) - top, 0)} more groups and what the phase's moment holds "
                                    "beyond the traced point" if rest > 0 else
                                    "the phase's moment holds less than the traced point listed", "bytes": rest})
    elif acts:
        items.append({"kind": "activations", "what": "activations", "bytes": acts,
                      "detail": "not itemised: " + ("analytic profile" if not hasattr(s.activation_profile, "data")
                                                    else "this phase's moment is not traced by operator")})
    for it in items:
        it["share"] = round(it["bytes"] / total, 4) if total else 0.0
    return {"phase": peak.name, "peak_bytes": total, "micro_batch": s.micro_batch, "items": items,
            "activations_bytes": acts, "traced": groups is not None}


def summary(ex: dict[str, Any]) -> str:
    """One line: the peak phase and the largest shares, the largest activation group named."""
    by_kind: dict[str, int] = {}
    for it in ex["items"]:
        by_kind[it["kind"]] = by_kind.get(it["kind"], 0) + it["bytes"]
    total = ex["peak_bytes"] or 1
    names = {k.removesuffix("_bytes"): v for k, v in CATEGORIES.items()}
    parts = []
    for kind, n in sorted(by_kind.items(), key=lambda kv: -kv[1])[:3]:
        part = f"{names.get(kind, kind)} {100 * n / total:.0f}%"
        if kind == "activations":
            biggest = max((it for it in ex["items"] if it["kind"] == "activations" and it.get("module")),
                          key=lambda it: it["bytes"], default=None)
            if biggest is not None:
                part += f" (largest: {biggest['what']} {100 * biggest['bytes'] / total:.0f}%)"
        parts.append(part)
    return f"peak in {ex['phase']}: " + ", ".join(parts)
