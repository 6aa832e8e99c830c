"""Predicted vs measured, per rank: the start of the step, the model-state categories and the step's peak."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.plan import Plan

#: categories measured exactly at the start of a step (storages reachable from the model and the optimizer)
EXACT_CATEGORIES = ("weights_bytes", "master_weights_bytes", "optimizer_states_bytes")


@dataclass(frozen=True)
class Comparison:
    rows: tuple[dict[str, Any], ...]  #: one per rank: measured figures and errors
    worst_rank: int
    predicted_peak_bytes: int
    measured_peak_bytes: int  #: worst rank, worst measured step
    peak_error: float  #: (predicted - measured) / measured
    predicted_start_bytes: int
    measured_start_bytes: int
    start_error: float
    predicted_peak_phase: str
    measured_peak_phase: str
    categories: dict[str, dict[str, int]]  #: name -> {"predicted", "measured"} (worst rank)
    spread: float  #: (max - min) / max of the ranks' peaks
    tolerance: float
    #: on CPU, the offloaded bytes of the plan's host share added to the prediction (one allocator)
    host_added_bytes: int = 0

    @property
    def within_tolerance(self) -> bool:
        return abs(self.peak_error) <= self.tolerance


def _err(pred: int, meas: int) -> float:
    return (pred - meas) / meas if meas else (0.0 if pred == 0 else float("inf"))


#: the plan's phases as the harness names the phase of a measured peak
MEASURED_PHASE = {"forward": "forward", "backward-start": "backward", "backward-end": "backward",
                  "backward": "backward", "optimizer-step": "optimizer-step"}


def measured_host(plan: Plan) -> dict[str, int]:
    """What of the plan's host share the harness measures with the device's: on CPU, device and host memory
    are one allocator, so what offload keeps on the host is measured with the rest (held through the step)."""
    return plan.host_detail if plan.settings.cluster.device == "cpu" else {}


def _rank_plan(plan: Plan, rank: int, world: int) -> Plan:
    """The plan a global rank is predicted by: under pipeline parallelism its pipeline rank's (the mesh [pp, dp,
    tp]: pipeline rank = rank // (dp x tp)); else the plan itself."""
    lay = plan.layout
    if lay is None or len(lay.plans) == 1:
        return plan
    return lay.plans[rank // (world // len(lay.plans))]


def compare(plan: Plan, ranks: tuple[dict[str, Any], ...], tolerance: float) -> Comparison:
    """Each rank against its own prediction (its pipeline rank's under pipeline parallelism); the headline is
    the rank with the largest measured peak against its prediction."""
    host = measured_host(plan)
    world = len(ranks)
    rows = []
    for r in ranks:
        own = _rank_plan(plan, r["rank"], world)
        worst = max(r["steps"], key=lambda m: m["peak_bytes"])
        attr = r["start_attribution"][-1] if r["start_attribution"] else {}
        rows.append({"rank": r["rank"], "peak_bytes": worst["peak_bytes"], "peak_phase": worst["peak_phase"],
                     "start_bytes": max(m["start_bytes"] for m in r["steps"]),
                     "peak_error": _err(own.peak_bytes + sum(host.values()), worst["peak_bytes"]),
                     "predicted_peak_bytes": own.peak_bytes + sum(host.values()),
                     "phase_peaks": worst["phase_peaks"], **{k: attr.get(k, 0) for k in EXACT_CATEGORIES},
                     "buffers_bytes": attr.get("buffers_bytes")})
    worst_row = max(rows, key=lambda x: x["peak_bytes"])
    plan = _rank_plan(plan, worst_row["rank"], world)
    pred_peak = plan.peak_bytes + sum(host.values())
    pred_start = plan.between_steps_bytes + sum(host.values())
    start_phase = plan.phases[0]
    peaks = [x["peak_bytes"] for x in rows]
    cats = {k: {"predicted": getattr(start_phase, k) + host.get(k, 0), "measured": worst_row[k]}
            for k in EXACT_CATEGORIES}
    # the plan's weights hold the model's buffers; a measurement made before the harness counted them
    # (no buffers_bytes in its record) is compared on the parameters alone
    if worst_row["buffers_bytes"] is None:
        from memplan.accounting import device_buffers

        cats["weights_bytes"]["predicted"] -= device_buffers(plan.inventory, plan.settings)
    else:
        cats["weights_bytes"]["measured"] += worst_row["buffers_bytes"]
    measured_start = max(x["start_bytes"] for x in rows if x["rank"] == worst_row["rank"])
    return Comparison(rows=tuple(rows), worst_rank=worst_row["rank"], predicted_peak_bytes=pred_peak,
                      measured_peak_bytes=worst_row["peak_bytes"], peak_error=_err(pred_peak, worst_row["peak_bytes"]),
                      predicted_start_bytes=pred_start, measured_start_bytes=measured_start,
                      start_error=_err(pred_start, measured_start),
                      predicted_peak_phase=MEASURED_PHASE.get(plan.peak.name, plan.peak.name),
                      measured_peak_phase=worst_row["peak_phase"], categories=cats,
                      spread=(max(peaks) - min(peaks)) / max(peaks) if max(peaks) else 0.0, tolerance=tolerance,
                      host_added_bytes=sum(host.values()))


def comparison_report(c: Comparison) -> dict[str, Any]:
    return {"tolerance": c.tolerance, "within_tolerance": c.within_tolerance, "worst_rank": c.worst_rank,
            "host_added_bytes": c.host_added_bytes,
            "peak": {"predicted_bytes": c.predicted_peak_bytes, "measured_bytes": c.measured_peak_bytes,
                     "error": c.peak_error, "predicted_phase": c.predicted_peak_phase,
                     "measured_phase": c.measured_peak_phase, "rank_spread": c.spread},
            "start_of_step": {"predicted_bytes": c.predicted_start_bytes, "measured_bytes": c.measured_start_bytes,
                              "error": c.start_error},
            "categories_at_start": c.categories, "ranks": list(c.rows)}
