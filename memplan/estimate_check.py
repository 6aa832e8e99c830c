"""`memplan check`'s verdict: the estimate's required bytes per GPU against a fraction of the GPU, in one line
for a CI log (the cheapest change that would fit named when it fails) and as JSON for an artifact."""

from __future__ import annotations

from typing import Any

from memplan.units import fmt_bytes


def verdict(est: Any, max_fraction: float) -> dict[str, Any]:
    plan, rep = est.plan, est.report
    s = plan.settings
    cap = s.cluster.gpu_memory_bytes
    limit = int(cap * max_fraction)
    need = plan.required_bytes
    host_ok = plan.host_fits is not False
    # a bound from below (the caching allocator not replayed for this job): under the limit it proves nothing
    unknown = plan.bounded is not None and need <= limit
    ok = need <= limit and host_ok and not unknown
    st = rep["strategy"]
    layout = ""
    if plan.layout is not None:  # the most loaded rank's plan: the job's GPUs and layout
        p = plan.layout.settings.parallel
        s = plan.layout.settings
        layout = f" (tp {p.tp} x pp {p.pp} x dp {plan.layout.dp})"
    what = (f"{st['name']} on {s.cluster.gpus} GPU(s){layout}, micro-batch {s.micro_batch} x seq {s.seq_len}, "
            f"grad-accum {s.grad_accum}, recompute {s.recompute}, {st['precision']}")
    files = f" [{', '.join(est.files)}]" if est.files else ""
    share = f"{100 * need / cap:.1f}%" if cap else "-"
    lim = f"limit {100 * max_fraction:g}% = {fmt_bytes(limit)}" if max_fraction < 1 else f"limit {fmt_bytes(limit)}"
    if ok:
        line = (f"PASS {rep['model']['name']}: needs {fmt_bytes(need)} per GPU, {share} of {fmt_bytes(cap)} "
                f"({lim}); {what}{files}")
    elif unknown and host_ok:
        line = (f"UNKNOWN {rep['model']['name']}: needs at least {fmt_bytes(need)} per GPU, {share} of "
                f"{fmt_bytes(cap)} ({lim}), plus the caching allocator's segments, not replayed for this job "
                f"({plan.bounded}); --fragmentation-percent N judges it with your own allocator overhead; "
                f"{what}{files}")
    else:
        at_least = "at least " if plan.bounded is not None else ""
        why = (f"needs {at_least}{fmt_bytes(need)} per GPU, {share} of {fmt_bytes(cap)} ({lim})" if need > limit
               else "the host RAM does not hold the offloaded states")
        fix = ""
        sug = (rep.get("suggestions") or {}).get("changes") or []
        fitting = [c for c in sug if c["required_bytes"] <= limit]
        if fitting:
            c = fitting[0]
            fix = f"; cheapest change that fits: {' '.join(c['flags'])} ({fmt_bytes(c['required_bytes'])}, {c['cost']})"
        line = f"FAIL {rep['model']['name']}: {why}; {what}{files}{fix}"
    return {"pass": ok, "verdict": "pass" if ok else "unknown" if unknown and host_ok else "fail",
            "required_exact": plan.bounded is None, "required_bytes": need, "limit_bytes": limit, "gpu_memory_bytes": cap,
            "max_fraction": max_fraction, "host_fits": plan.host_fits, "files": est.files, "line": line}
