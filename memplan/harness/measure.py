"""Measurement inside one rank: the allocator's running total from the profiler, and tensor attribution.

CPU (gloo): ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` is started before the model is
built; every ``[memory]`` event of the exported trace carries the CPU allocator's running "Total Allocated"
(c10 ProfiledCPUMemoryReporter). Its maximum between the ``memplan:step`` markers is the step's peak, the CPU
counterpart of ``torch.cuda.max_memory_allocated``.

The reporter only books a block while memory profiling is on for the calling thread (a thread-local check), so
a block freed on a gloo worker thread (the last reference dropped by a finished collective) was never taken off
the total, and the error drifted run to run by up to 6%. :func:`follow_all_threads` sets c10's
``FLAGS_caffe2_report_cpu_memory_usage``, under which the reporter books every allocation and free of every
thread in one global, mutex-guarded total (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter::New/Delete);
the events, still emitted only on the profiled threads, then carry that global figure. Where the flag cannot be
set (a torch build without the exported symbol), the total is rebuilt from the events' addresses instead
(:func:`live_totals` with ``global_totals=False``).

GPU (NCCL): ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the start of the step.

Attribution at the start of a step walks the tensors reachable from the model and the optimizer and counts each
storage once (storages, not tensors: DeepSpeed's params are views of flat buffers, FSDP2's are DTensor shards).
Whatever the allocator holds beyond them is reported as "other" (buckets, flat buffers, caches).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from memplan.activations.tracing.live import plain_tensors

STEP_PREFIX = "memplan:step"
PHASE_PREFIX = "memplan:"
PHASES = ("forward", "backward", "optimizer-step")


@dataclass
class StepMeasure:
    step: int
    start_bytes: int  #: allocator total when the step began
    peak_bytes: int  #: allocator maximum inside the step
    peak_phase: str  #: forward | backward | optimizer-step | between (zero_grad, bookkeeping)
    phase_peaks: dict[str, int] = field(default_factory=dict)


def _storage_key(t: Any) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
    except Exception:
        return None
    if st.nbytes() == 0 or t.device.type == "meta":
        return None
    return (st.data_ptr(), st.nbytes())


def local_tensor(t: Any) -> Any:
    """The local shard of a DTensor, DeepSpeed's ds_tensor partition, or the tensor itself."""
    if hasattr(t, "ds_tensor") and t.ds_tensor is not None:
        return t.ds_tensor
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        return to_local()
    return t


def attribute(model: Any, optimizer: Any) -> dict[str, int]:
    """Bytes of unique storages by category: weights, grads, master weights, optimizer states."""
    seen: set[tuple[int, int]] = set()
    out = {"weights_bytes": 0, "grads_bytes": 0, "master_weights_bytes": 0, "optimizer_states_bytes": 0}

    def add(category: str, t: Any) -> None:
        if t is None:
            return
        # a tensor subclass (torchao's float8 weight shard) holds its bytes in its inner tensors
        for x in plain_tensors(local_tensor(t)):
            key = _storage_key(x)
            if key is not None and key not in seen:
                seen.add(key)
                out[category] += key[1]

    params = list(model.parameters())
    for p in params:
        add("weights_bytes", p)
        if hasattr(p, "ds_tensor"):  # ZeRO-3: the partition above, and the whole tensor of a persistent param
            add("weights_bytes", p.data)
        qs = getattr(p, "quant_state", None)  # a bitsandbytes 4-bit weight: its quantisation state is weights too
        for q in (qs, getattr(qs, "state2", None)):
            for attr in ("absmax", "code", "offset"):
                add("weights_bytes", getattr(q, attr, None))
    # the model's buffers (persistent or not): weights in the plan (accounting.device_buffers), each in whole
    # 512-byte blocks on CUDA as the caching allocator gives them (parameters stay counted by their storage bytes)
    out["buffers_bytes"] = 0
    for b in model.buffers():
        key = _storage_key(b)
        if key is not None and key not in seen:
            seen.add(key)
            out["buffers_bytes"] += -(-key[1] // 512) * 512 if b.is_cuda else key[1]
    # under FSDP2 the sharded parameter has lost its quant_state; Linear4bit keeps it (module.quant_state, set by
    # Params4bit(module=...) at quantization), and its forward restores it after the all-gather
    states = [getattr(m, "quant_state", None) for m in model.modules()]
    for qs in states:
        for q in (qs, getattr(qs, "state2", None)):
            for attr in ("absmax", "code", "offset"):
                add("weights_bytes", getattr(q, attr, None))
    if any(getattr(getattr(p, "quant_state", None), "state2", None) is not None for p in params) or \
            any(getattr(qs, "state2", None) is not None for qs in states):
        import bitsandbytes.functional as bnbf  # double quantization's shared dynamic map

        add("weights_bytes", bnbf.name2qmap.get("dynamic"))
    for p in params:
        add("grads_bytes", getattr(p, "grad", None))
    inner = optimizer
    for attr in ("optimizer", "optim"):  # DeepSpeed wrappers and ZeroRedundancyOptimizer hold the torch optimizer
        while hasattr(inner, attr) and inner is not getattr(inner, attr):
            inner = getattr(inner, attr)
    # DeepSpeed's fp32 partitions; ZeRO-3 empties the torch optimizer's param groups between sub-group steps
    # (stage3.py _optimizer_step), so read them from the wrapper (stage3 / stage_1_and_2 / bf16_optimizer).
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        for t in getattr(optimizer, attr, None) or ():
            add("master_weights_bytes", t)
    for group in getattr(inner, "param_groups", []):
        for p in group["params"]:
            add("master_weights_bytes", p)
            add("grads_bytes", getattr(p, "grad", None))
    for state in getattr(inner, "state", {}).values():
        for v in state.values() if isinstance(state, dict) else ():
            if hasattr(v, "untyped_storage") and v.dim() > 0:
                add("optimizer_states_bytes", v)
    return out


def follow_all_threads() -> bool:
    """Make the CPU allocator's reporter book allocations and frees of every thread (see the module docstring).

    True when the flag was set. Call it just before the profiler starts: blocks allocated earlier are unknown to
    the reporter and their frees are ignored, so the total starts from zero there, like the profiler's.
    """
    import ctypes
    import os

    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (OSError, ValueError):
        return False
    return True


def live_totals(events: list[dict[str, Any]], global_totals: bool = True) -> list[tuple[float, int]]:
    """(time, bytes live) after every CPU allocator event.

    With ``global_totals`` (the reporter books every thread, :func:`follow_all_threads`), each event's
    "Total Allocated" is the figure. Without it, the reporter's total never goes down for a block freed on a
    thread the profiler does not follow, so the total is rebuilt from the events' addresses: a block is dropped
    when its free is seen, or when the allocator hands its address out again (which proves it was freed).
    """
    mem = sorted((float(e["ts"]), int(e["args"].get("Ev Idx", 0)), e["args"]) for e in events
                 if e.get("name") == "[memory]" and int(e["args"].get("Device Type", 0)) == 0)
    if global_totals:
        return [(ts, int(args["Total Allocated"])) for ts, _, args in mem]
    live: dict[int, int] = {}
    total = 0
    out: list[tuple[float, int]] = []
    for ts, _, args in mem:
        addr, nbytes = int(args.get("Addr", 0)), int(args["Bytes"])
        if nbytes > 0:
            total += nbytes - live.get(addr, 0)
            live[addr] = nbytes
        elif addr in live:
            total -= live.pop(addr)
        out.append((ts, total))
    return out


def steps_from_trace(path: str, global_totals: bool = True) -> list[StepMeasure]:
    """Per measured step: start, peak and phase of the peak, from an exported chrome trace."""
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    mem = live_totals(events, global_totals)
    times = [ts for ts, _ in mem]
    marks = [(e["name"][len(PHASE_PREFIX):], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
             for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(PHASE_PREFIX)]
    steps = sorted((int(n[len("step"):]), a, b) for n, a, b in marks if n.startswith("step"))
    phases = [(n, a, b) for n, a, b in marks if n in PHASES]
    out: list[StepMeasure] = []
    for idx, (step, a, b) in enumerate(steps):
        i = bisect.bisect_left(times, a)
        start = mem[i - 1][1] if i else 0
        inside = [(ts, v) for ts, v in mem if a <= ts <= b]
        peak_ts, peak = max(inside, key=lambda tv: tv[1]) if inside else (a, start)
        if peak < start:
            peak_ts, peak = a, start
        phase = "between"
        per_phase: dict[str, int] = {}
        for name, pa, pb in phases:
            if a <= pa and pb <= b:
                j = bisect.bisect_left(times, pa)
                vals = ([mem[j - 1][1]] if j else []) + [v for ts, v in inside if pa <= ts <= pb]
                if vals:
                    per_phase[name] = max(per_phase.get(name, 0), max(vals))
                if pa <= peak_ts <= pb:
                    phase = name
        out.append(StepMeasure(step=step, start_bytes=start, peak_bytes=peak, peak_phase=phase,
                               phase_peaks=per_phase))
    return out


def as_dict(m: StepMeasure) -> dict[str, Any]:
    return asdict(m)
