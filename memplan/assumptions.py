"""The assumptions of an estimate as a person reads them: a short list by topic (framework knobs, precision,
kernels, overheads), each value with where it came from (default, ds_config, command line, or derived by memplan).
Pure: reads the schema-v1 report (memplan/report.py plan_report); the JSON keeps the full machine form."""

from __future__ import annotations

from typing import Any

from memplan.units import fmt_bytes

TOPICS = ("framework", "precision", "kernels", "overheads")

#: engine-derived assumption keys, by how a person names them (the rest are shown by their own key)
_DERIVED = {"shard_group": "shard group", "layout": "parameter layout", "optimizer_impl": "optimizer kernel",
            "nccl_communicators": "NCCL communicators", "reshard_after_forward": "reshard after forward",
            "largest_gathered_block_numel": "largest gathered unit (params)",
            "zero3_largest_sub_group_numel": "largest optimizer sub-group (params)",
            "zero3_unreduced_grad_numel": "unreduced gradient buffer (params)"}
#: shown elsewhere or only in the JSON
_SKIP = {"recipe", "optimizer", "overheads", "device", "builder", "setting_sources", "activations", "blas_workspace",
         "overlap_comm", "zero3_gathered_numel", "strategy", "horovod_fusion_buffer"}
#: knobs shown even at their default (the ones that size the largest buffers)
_ALWAYS = {"reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "prefetch_bucket_size", "bucket_cap_mb",
           "offload_optimizer", "offload_param", "cpu_offload", "fsdp_version", "fusion_threshold", "compression"}
#: knobs whose value is a byte count or an element count (shown with thousands separators)
_COUNTS = ("_size", "_numel", "_parameters", "_distance", "_threshold")


def _value(key: str, v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "on", False: "off", None: "framework default"}[v]
    if isinstance(v, int):
        if key == "bucket_cap_mb":
            return f"{v} MiB"
        return f"{v:,}" if v >= 10_000 or key.endswith(_COUNTS) else str(v)
    if isinstance(v, dict):
        return ", ".join(f"{k} {_value(k, x)}" for k, x in v.items())
    return str(v)


#: PyTorch's knobs, by the strategies they act in (the JSON lists them all)
_TORCH_KNOB_STRATEGIES = {"bucket_cap_mb": ("ddp",), "gradient_as_bucket_view": ("ddp",),
                          "hsdp_shard_size": ("hsdp",)}
_FSDP = ("fsdp-full", "fsdp-grad-op", "fsdp-no-shard", "hsdp")


def _applies(knob: str, strategy: str) -> bool:
    if knob in _TORCH_KNOB_STRATEGIES:
        return strategy in _TORCH_KNOB_STRATEGIES[knob]
    if knob in ("fsdp_version", "reshard_after_forward", "cpu_offload", "cpu_offload_pin_memory"):
        return strategy in _FSDP
    return True


def _item(name: str, value: str, source: str | None) -> str:
    return f"{name} {value}" + (f" ({source})" if source else "")


def by_topic(rep: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """[(topic, ["name value (source)", ...])] for the table; every figure is the report's own."""
    a, st = rep["assumptions"], rep["strategy"]
    src = a.get("setting_sources") or {}
    knobs = st.get("deepspeed") or st.get("torch") or st.get("horovod") or {}
    framework = [_item("strategy", f"{st['name']} ({st['framework']})", src.get("strategy", "default"))]
    defaults = 0
    for k, v in knobs.items():
        if not _applies(k, st["name"]):
            continue
        where = src.get(k, "default")
        if where == "default" and k not in _ALWAYS:
            defaults += 1  # the framework's own default: listed in the JSON
            continue
        framework.append(_item(k.replace("_", " "), _value(k, v), where))
    for k, v in a.items():
        if k in _SKIP or k in knobs:
            continue
        framework.append(_item(_DERIVED.get(k, k.replace("_", " ")), _value(k, v), "derived"))
    if defaults:
        framework.append(f"{defaults} more {st['framework']} knobs at their defaults")
    precision = [_item("recipe", f"{st['precision']}: {a['recipe']}", src.get("precision", "default")),
                 *([_item("float8", f"torchao Float8Linear, {st['float8']} scaling; bf16 stay "
                                    + ("the first and last linears (Accelerate's torchao backend)"
                                       if st.get("float8_keep") == "first-last" else
                                       "the output projection (torchtitan's converter)")
                                    + " and those with a dim not a multiple of 16"
                                    + ("; FSDP2 all-gathers the float8 weights in float8" if st.get("float8_all_gather")
                                       else ""),
                          src.get("float8", src.get("precision")))] if st.get("float8") else []),
                 _item("optimizer", str(a["optimizer"]), src.get("optimizer", "default")),
                 _item("micro-batch", f"{st['micro_batch']} x seq {st['seq_len']}"
                       + (f" (encoder) -> target {st['target_len']} (decoder, {src.get('target_len', 'default')})"
                          if st.get("target_len") else "")
                       + (f" ({st['images']} image(s) per sample, their tokens in the sequence; "
                          f"{src.get('images', 'default')})" if st.get("images") is not None else "")
                       + (f" (images {st['image_size'][0]}x{st['image_size'][1]} px; "
                          f"{src.get('image_size', 'default')})" if st.get("image_size") else "")
                       + f", grad-accum {st['grad_accum']}", None)]
    kernels = [_item("attention", str(st["attention"]), src.get("attention")),
               _item("recompute", str(st["recompute"]), src.get("recompute")),
               *([_item("torch.compile", str(st["compile"]), src.get("compile"))]
                 if st.get("compile", "none") != "none" else []),
               _item("activations", str(a.get("activations", "?")), None)]
    if "blas_workspace" in a:
        kernels.append(_item("cuBLAS workspace", str(a["blas_workspace"]), src.get("cublas_workspace", "default")))
    overheads: list[str] = []
    o = a.get("overheads")
    if isinstance(o, dict):
        overheads.append(_item("CUDA context", fmt_bytes(o["cuda_context_bytes"]), src.get("cuda_context", "default")))
        overheads.append(_item("NCCL", f"{fmt_bytes(o['nccl_bytes_per_communicator'])} per communicator",
                               src.get("nccl_per_communicator", "default")))
        res = rep.get("reserved") or {}
        if res.get("method") == "replayed":
            conf = res.get("allocator_conf") or "PyTorch defaults"
            overheads.append(_item("allocator", f"caching allocator replayed ({conf})",
                                   src.get("allocator_conf", "default")))
        elif res.get("method") == "flat":
            overheads.append(_item("allocator", f"allocated + {res.get('fragmentation_percent')}% "
                                   f"({res.get('why')})", None))
        elif res:
            overheads.append(_item("allocator", f"not replayed ({res.get('why')}): the reserved and required "
                                   "figures are bounds from below", None))
    else:
        overheads.append("none (device cpu)")
    return list(zip(TOPICS, (framework, precision, kernels, overheads)))
