"""The command line's rendering: tables and lines on the terminal (rich), JSON on stdout. Only the CLI uses it."""

from __future__ import annotations

import json
import sys
from typing import Any

from memplan.units import fmt_bytes


#: the reserved peak's accuracy on the H100 runs, as docs/accuracy-gpu.md's summary gives it (written by
#: bench/gpu_accuracy.py; tests/plan/test_cli_render_accuracy.py keeps the two equal)
GPU_RESERVED = {"cases": 111, "within_3": 109, "verdict_min_percent": -29.58}


def console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False, soft_wrap=False, emoji=False)
    if not console.is_terminal:
        console.width = max(console.width, 110)  # pipes and CI logs: do not squeeze the tables to 80 columns
    return console


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def table(title: str, columns: list[tuple[str, str]], rows: list[list[str]]):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for header, justify in columns:
        t.add_column(header, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        t.add_row(*r)
    return t


def category_labels() -> tuple[tuple[str, str], ...]:
    from memplan.timeline import CATEGORIES

    return tuple(CATEGORIES.items())


def _render_layout(c: Any, par: dict) -> None:
    """The model-parallel layout and each pipeline rank's share and peak."""
    pipe = (f" · pp {par['pp']} ({par['schedule']}" + (f", {par['virtual_stages']} stages per rank"
                                                       if par["virtual_stages"] > 1 else "")
            + f", {par['micro_batches']} micro-batches)") if par["pp"] > 1 else ""
    c.print(f"{par['layout']} layout: tp {par['tp']}" + (" + sequence parallel" if par["sp"] and par["tp"] > 1 else "")
            + pipe + (f" · cp {par['cp']} (ring attention, seq / {par['cp']} per rank)" if par.get("cp", 1) > 1
                      else "")
            + f" · dp {par['dp']} (the data-parallel strategy runs over " + ("these" if par.get("cp", 1) == 1
                                                                             else "dp x cp") + ")"
            + (f" · ep {par['ep']}: experts over ep x efsdp {par['efsdp']}" if par.get("ep", 1) > 1 else ""))
    if par["pp"] > 1:
        cols = [("pipeline rank", "right"), ("holds", "left"), ("params per TP rank", "right"), ("in flight", "right"),
                ("peak", "right"), ("phase", "left"), ("required", "right")]
        rows = [[("▶ " if r["pipeline_rank"] == par["worst_pipeline_rank"] else "") + str(r["pipeline_rank"]),
                 r["holds"], f"{r['params']:,}", str(r["micro_batches_in_flight"]), fmt_bytes(r["peak_bytes"]),
                 r["peak_phase"], ("" if r.get("required_exact", True) else "≥ ") + fmt_bytes(r["required_bytes"])]
                for r in par["ranks"]]
        c.print(table("Per pipeline rank (▶ the most loaded; the table below is its)", cols, rows))


def render_plan(rep: dict, summary: str | None = None, explained: dict | None = None) -> None:
    c = console()
    m, st, cl, pg = rep["model"], rep["strategy"], rep["cluster"], rep["per_gpu"]
    c.print(f"[bold]{m['name']}[/bold] ({m['num_params']:,} params) · {st['name']} ({st['framework']}) · "
            f"{cl['gpus']} GPU(s), {cl['gpus_per_node']}/node · shard group {st['shard_group']} · "
            f"{st['precision']} · {st['optimizer']}")
    c.print(f"micro-batch {st['micro_batch']} × seq {st['seq_len']}"
            + (f" → target {st['target_len']}" if st.get("target_len") else "")
            + (f" ({st['images']} image(s) each" + (f", {st['image_size'][0]}x{st['image_size'][1]} px"
                                                      if st.get("image_size") else "") + ")"
               if st.get("images") is not None else "") + f", grad-accum {st['grad_accum']}, "
            f"recompute {st['recompute']}, attention {st['attention']}, device {cl['device']}")
    if st.get("lora"):
        lo = st["lora"]
        t = lo["targets"] if isinstance(lo["targets"], str) else ",".join(lo["targets"]) or "PEFT's default"
        q = lo.get("quantize_base")
        base = (f"the base is frozen, {q['quantized_params']:,} of its parameters stored {q['type']} "
                f"({fmt_bytes(q['quantized_bytes'])})" if q else "the base is frozen")
        c.print(f"{'QLoRA' if q else 'LoRA'} r={lo['rank']} on {t}: {lo['adapted_layers']} layers adapted, "
                f"{lo['trainable_params']:,} of {m['num_params']:,} parameters train "
                f"({100 * lo['trainable_params'] / max(m['num_params'], 1):.2f}%); {base} (no gradients, no "
                "optimizer states)")
    if m.get("frozen"):
        c.print(f"frozen: {', '.join(m['frozen'])}; {m['trainable_params']:,} of {m['num_params']:,} parameters "
                f"train ({100 * m['trainable_params'] / max(m['num_params'], 1):.2f}%)")
    par = rep.get("parallel")
    if par:
        _render_layout(c, par)
    phases = rep["phases"]
    cols = [("per GPU (GiB = 2^30 B)", "left")] + [(p["name"] + (" ◀ peak" if p["name"] == pg["peak_phase"] else ""),
                                                    "right") for p in phases]
    rows = [[label] + [fmt_bytes(p[key]) for p in phases] for key, label in category_labels()]
    rows.append(["[bold]total allocated[/bold]"] + [f"[bold]{fmt_bytes(p['total_bytes'])}[/bold]" for p in phases])
    c.print(table("Bytes per GPU by phase (worst rank); buffers = buckets, gathered params, step scratch",
                   cols, rows))
    from memplan.plot import terminal_bar

    seg = {k: pg[k] for k, _ in category_labels()}
    seg["overhead_bytes"] = pg["overhead_bytes"] or 0
    cap = cl["gpu_memory_bytes"]
    c.print(f"[{terminal_bar(seg, cap)}] W weights, M master, G grads, O optimizer, A activations, B buffers, "
            f"+ allocator/CUDA/NCCL" + (", · free, | the GPU's end" if cap else ""), soft_wrap=True,
            markup=False)
    od = rep["overhead_detail"]
    over = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {fmt_bytes(v)}" for k, v in od.items()) or "none"
    c.print(f"peak allocated: [bold]{fmt_bytes(pg['peak_bytes'])}[/bold] ({pg['peak_bytes']:,} B) in "
            f"{pg['peak_phase']}   overheads: {fmt_bytes(pg['overhead_bytes'])} ({over})")
    if summary:
        c.print(summary + ("" if explained else " (--explain itemises it)"), soft_wrap=True)
    if explained:
        render_explain(c, explained)
    res = rep.get("reserved")
    if res and pg.get("reserved_peak_bytes") is not None:
        ratio = pg["reserved_peak_bytes"] / pg["peak_bytes"] if pg["peak_bytes"] else 0
        seq = res.get("framework_sequence") or ""
        how = (("allocator segments, replayed" + (f" ({seq.split(', ', 1)[1]})" if ", " in seq else ""))
               if res["method"] == "replayed" else f"allocated + {res['fragmentation_percent']}%: {res['why']}"
               if res["method"] == "flat" else
               f"at least the allocated peak: the caching allocator is not replayed here ({res['why']})")
        if res["method"] == "replayed" and res["peak_bytes"] < pg["peak_bytes"]:
            # the replay's own allocations (framework sequence x traced step) peak below the engine's allocated peak:
            # reserved is never below allocated, so the allocated peak stands for it
            how = (f"the allocated peak: the replayed allocator reserves {fmt_bytes(res['peak_bytes'])}, below it "
                   "(the replay's allocation sequence misses some of what the engine counts)")
        at_least = "≥ " if res["method"] == "bound" else ""
        c.print(f"peak reserved: [bold]{at_least}{fmt_bytes(pg['reserved_peak_bytes'])}[/bold] ({how}"
                + ("" if at_least else f"; {ratio:.2f}x allocated") + ")"
                + release_orders(res.get("variants") or {}, res.get("peak_bytes") or pg["reserved_peak_bytes"]),
                soft_wrap=True)
    c.print("required per GPU: " + required_line(pg, (res or {}).get("method") == "bound"), soft_wrap=True)
    comm = rep.get("communication")
    if comm and comm["collectives"]:
        big = max(comm["collectives"], key=lambda x: x["bytes_per_gpu"])
        times = f" x{big['times_per_step']}" if big["times_per_step"] > 1 else ""
        c.print(f"communication per GPU per optimizer step: {fmt_bytes(comm['intra_node_bytes'])} intra-node, "
                f"{fmt_bytes(comm['inter_node_bytes'])} inter-node (largest: {big['op']} of {big['what']} over "
                f"{big['group_size']} ranks, {big['dtype_bytes']} B/element{times})", soft_wrap=True)
    if rep["host_bytes_per_node"]:
        per_rank = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {fmt_bytes(v)}"
                             for k, v in rep.get("host_bytes_per_rank_by_category", {}).items())
        h = rep.get("host") or {}
        pinned = (f"; pinned {fmt_bytes(h['pinned_requested_bytes_per_rank'])} per rank takes "
                  f"{fmt_bytes(h['pinned_allocated_bytes_per_rank'])} (powers of two)"
                  if h.get("pinned_requested_bytes_per_rank") else "")
        c.print(f"host RAM per node for offloaded states: {fmt_bytes(h.get('bytes_per_node', rep['host_bytes_per_node']))}"
                + (f" (per rank: {per_rank}{pinned})" if per_rank else ""))
        if h.get("fits") is not None:
            c.print((f"host [green]FITS[/green] in {fmt_bytes(h['host_memory_bytes'])}: headroom "
                     f"{fmt_bytes(h['headroom_bytes'])}") if h["fits"] else
                    (f"host [red]DOES NOT FIT[/red] in {fmt_bytes(h['host_memory_bytes'])}: short by "
                     f"{fmt_bytes(-h['headroom_bytes'])}"))
    bound = (res or {}).get("method") == "bound"
    if rep["fits"] is None and bound and cl["gpu_memory_bytes"]:
        c.print(f"[yellow]MAY FIT[/yellow] on {fmt_bytes(cl['gpu_memory_bytes'])}: headroom at most "
                f"{fmt_bytes(rep['headroom_bytes'])}, what the caching allocator's segments beyond the allocated "
                "bytes must stay within (not replayed for this job; --fragmentation-percent N judges it with your "
                "own allocator overhead)", soft_wrap=True)
    elif rep["fits"] is None:
        c.print("fit: no GPU given (use --gpu NAME or --gpu-memory SIZE)")
    elif rep["fits"]:
        c.print(f"[green]FITS[/green] on {fmt_bytes(cl['gpu_memory_bytes'])}: headroom "
                f"{fmt_bytes(rep['headroom_bytes'])}")
    else:
        c.print(f"[red]DOES NOT FIT[/red] on {fmt_bytes(cl['gpu_memory_bytes'])}: short by "
                + ("at least " if bound else "") + f"{fmt_bytes(-rep['headroom_bytes'])}")
    render_suggestions(c, rep.get("suggestions"))
    from memplan.assumptions import by_topic

    c.print("assumptions (--json has them all):")
    for topic, items in by_topic(rep):
        c.print(f"  {topic:<10} " + "; ".join(items), soft_wrap=True, markup=False)
    for n in rep["notes"]:  # text from the job's files and configs: never rich markup ("[r'.*.attn.*']")
        c.print(f"note: {n}", soft_wrap=True, markup=False)


def required_line(pg: dict[str, Any], bound: bool = False) -> str:
    """What the verdict compares with the card, and how: the reserved peak with the CUDA context and NCCL, or, where
    the card's limits are reached, the replay under them (cache flushes, an out-of-memory error, a
    per_process_memory_fraction's cap); ``bound``: the reserved peak is only bounded from below."""
    cap = pg.get("capped")
    head = f"[bold]{'≥ ' if bound else ''}{fmt_bytes(pg['required_bytes'])}[/bold]"
    if bound:
        return head + " (the allocated peak + CUDA context + NCCL: a bound from below)"
    if not cap or (cap["flushes"] == 0 and cap["fits"] and cap["fraction_limit_bytes"] is None):
        return head + " (reserved + CUDA context + NCCL)"
    frac = cap["fraction_limit_bytes"]
    cap_text = (f"per_process_memory_fraction caps the allocator at {fmt_bytes(frac)}" if frac is not None and
                frac <= cap["device_limit_bytes"] else
                f"the allocator can hold {fmt_bytes(cap['device_limit_bytes'])} beside the CUDA context and NCCL")
    if not cap["fits"]:
        return (head + f" ({cap_text}; replayed under it, the step runs out of memory after "
                f"{cap['flushes']} cache flush(es): a {fmt_bytes(cap['failed_request_bytes'] or 0)} request finds "
                f"no room; uncapped it reserves {fmt_bytes(pg['reserved_peak_bytes'])})")
    flushes = cap["flushes_per_step"]
    how = (f"with {flushes} cache flush(es) per step (each a synchronising cudaFree of the free segments)"
           if flushes else f"with {cap['flushes']} cache flush(es) while it sets up, none in the steady step"
           if cap["flushes"] else "without a cache flush")
    return (head + f" ({cap_text}; replayed under it the step runs {how}, reserving at most "
            f"{fmt_bytes(cap['reserved_peak_bytes'])}" + (f"; uncapped {fmt_bytes(pg['uncapped_required_bytes'])}"
                                                          if flushes else "") + ")")


def release_orders(variants: dict[str, int], verdict: int) -> str:
    """The release orders the replay found besides the verdict's (DDP: the first buckets freed at the rebuild, or
    held by NCCL's watchdog into step 2's backward; which one a run gets is a race), shown under the table so the
    user sees the range and which end the verdict takes; empty where there is one order. ``verdict``: the
    replay's own peak (the largest order's)."""
    if len(variants) < 2:
        return ""
    others = [(k, v) for k, v in sorted(variants.items()) if v != verdict]
    if not others:
        return ""
    taken = next((k for k, v in sorted(variants.items()) if v == verdict), "")
    return (f"; the larger of {len(variants)} release orders ({taken}); "
            + ", ".join(f"{fmt_bytes(v)} with {k}" for k, v in others))


def render_explain(c: Any, ex: dict) -> None:
    """--explain: the peak's bytes by category, its activations by module and operator (memplan/explain.py)."""
    rows = [[it["what"], it.get("detail", ""), fmt_bytes(it["bytes"]), f"{100 * it['share']:.1f}%"]
            for it in ex["items"]]
    c.print(table(f"What the peak holds ({ex['phase']}, micro-batch {ex['micro_batch']}): by category, activations "
                  "by module → operator (blocks as *)", [("what", "left"), ("detail", "left"), ("bytes", "right"),
                                                         ("share", "right")], rows))


def render_suggestions(c: Any, sug: dict | None) -> None:
    """The 'to fit' changes (memplan/advice.py), cheapest first."""
    if not sug:
        return
    if not sug["changes"]:
        combo = sug.get("combination")
        if combo:
            c.print(f"to fit ({sug['reason']}): no single change fits; the cheapest combination that does: "
                    f"[bold]{' '.join(combo['flags'])}[/bold] ({combo['change']}): required "
                    f"{fmt_bytes(combo['required_bytes'])}, headroom {fmt_bytes(combo['headroom_bytes'])}; cost: "
                    f"{combo['cost']}", soft_wrap=True)
        else:
            c.print(f"to fit: no single change of the {sug['tried']} tried fits, nor a combination of two or three "
                    f"({sug['reason']}); use a larger GPU", soft_wrap=True)
        return
    target = "" if sug["reason"] == "does not fit" else f" with {sug['headroom_target_fraction']:.0%} free"
    rows = [[" ".join(x["flags"]), fmt_bytes(x["required_bytes"]), fmt_bytes(x["headroom_bytes"]),
             fmt_bytes(x["saves_bytes"]), x["cost"]] for x in sug["changes"]]
    c.print(table(f"To fit{target} ({sug['reason']}): each change alone, estimated; cheapest first",
                  [("add", "left"), ("required", "right"), ("headroom", "right"), ("saves", "right"),
                   ("cost", "left")], rows))


def render_search(rep: dict) -> None:
    c = console()
    m, se, rec = rep["model"], rep["search"], rep["recommendation"]
    c.print(f"[bold]{m['name']}[/bold] ({m['num_params']:,} params) on {fmt_bytes(se['gpu_memory_bytes'])} GPUs, "
            f"{se['gpus_per_node']}/node, up to {se['max_gpus']} GPUs, micro-batch "
            f"{se['micro_batches'][0]}-{se['micro_batches'][1]}")
    n = rec["gpus"] if rec else None
    rows = []
    for cand in rep["candidates"]:
        at = cand["at_recommended_gpus"]
        mark = " ◀ best" if rec and cand["label"] == rec["label"] and cand["recompute"] == rec["recompute"] else ""
        bound = not cand.get("exact", True)
        rows.append([cand["label"] + mark, cand["recompute"], cand["precision"],
                     "-" if cand["min_gpus"] is None else ("≥" if bound else "") + str(cand["min_gpus"]),
                     "-" if at is None else ("≤" if bound else "") + str(at["micro_batch"]),
                     "-" if at is None else fmt_bytes(at["peak_bytes"]),
                     "-" if at is None else ("≥" if bound else "") + fmt_bytes(at["required_bytes"]),
                     "-" if at is None else ("≤" if bound else "") + fmt_bytes(at["headroom_bytes"])])
    at_n = f" @{n}" if n else ""
    c.print(table(f"Candidates: fewest GPUs at micro-batch {se['micro_batches'][0]}; at {n or '-'} GPUs the largest "
                   "micro-batch and its bytes (GiB = 2^30 B; required = reserved peak + CUDA context + NCCL; ≤/≥: "
                   "bounds from the allocated peak for a candidate that could not be the best, not replayed)",
                   [("strategy", "left"), ("recompute", "left"), ("precision", "left"), ("min GPUs", "right"),
                    (f"mb{at_n}", "right"), ("peak", "right"), ("required", "right"), ("headroom", "right")], rows))
    margin = se.get("min_headroom_bytes") or 0
    if rec is None:
        c.print(f"[red]NOTHING FITS[/red] within {se['max_gpus']} GPUs"
                + (f" leaving {fmt_bytes(margin)} free" if margin else "") + ": " + _untried(rep), soft_wrap=True)
    elif not rec.get("exact", True):
        c.print(f"[yellow]PLAN (MAY FIT)[/yellow]: [bold]{rec['strategy']}[/bold]"
                f"{' (' + rec['label'] + ')' if rec['label'] != rec['strategy'] else ''} on "
                f"[bold]{rec['gpus']} GPU(s)[/bold] ({rec['nodes']} node(s)), micro-batch {rec['micro_batch']}, "
                f"recompute {rec['recompute']}, {rec['precision']}: peak {fmt_bytes(rec['peak_bytes'])}, required "
                f"≥ {fmt_bytes(rec['required_bytes'])}, headroom ≤ {fmt_bytes(rec['headroom_bytes'])}")
        c.print("bounds: no candidate's caching allocator could be replayed (its estimate says why), so its reserved "
                "peak is only bounded by the allocated one; --fragmentation-percent N judges with your own allocator "
                "overhead", soft_wrap=True)
        c.print(f"details: {rec['command']}", soft_wrap=True)
    else:
        c.print(f"[green]PLAN[/green]: [bold]{rec['strategy']}[/bold]{' (' + rec['label'] + ')' if rec['label'] != rec['strategy'] else ''} on "
                f"[bold]{rec['gpus']} GPU(s)[/bold] ({rec['nodes']} node(s)), micro-batch {rec['micro_batch']}, "
                f"recompute {rec['recompute']}, {rec['precision']}: peak {fmt_bytes(rec['peak_bytes'])}, required "
                f"{fmt_bytes(rec['required_bytes'])}, headroom {fmt_bytes(rec['headroom_bytes'])}")
        flat = ((rep.get("estimate") or {}).get("reserved") or {}).get("method") == "flat"
        if flat:
            c.print(f"headroom: the GPU's {fmt_bytes(se['gpu_memory_bytes'])} less the required bytes (the allocated "
                    "peak and your --fragmentation-percent, plus CUDA context and NCCL)", soft_wrap=True)
        else:
            c.print(f"headroom: the GPU's {fmt_bytes(se['gpu_memory_bytes'])} less the required bytes (the caching "
                    "allocator's reserved peak, replayed, plus CUDA context and NCCL); the replay was within 3% of the "
                    f"measured reserved peak on {GPU_RESERVED['within_3']} of {GPU_RESERVED['cases']} H100 and H200 "
                    f"runs, and the figure the verdict uses {-GPU_RESERVED['verdict_min_percent']:.2f}% under at "
                    "worst (docs/accuracy-gpu.md)"
                    + (f"; every candidate was asked to leave {fmt_bytes(margin)} free (--min-headroom)" if margin
                       else "; --min-headroom SIZE|FRACTION keeps a margin"), soft_wrap=True)
        c.print(f"details: {rec['command']}", soft_wrap=True)
    c.print(f"ranking: {se['ranking']}; {se['evaluations']:,} configurations evaluated", soft_wrap=True)
    for note in rep["notes"]:
        c.print(f"note: {note}", soft_wrap=True, markup=False)


def _untried(rep: dict) -> str:
    """What the search did not try, the things to change when nothing fits."""
    se, cands = rep["search"], rep["candidates"]
    tips = []
    if se["max_gpus"] < 1024:
        tips.append("a larger --max-gpus")
    if "full" not in {c["recompute"] for c in cands}:
        tips.append("--recompute none,full")
    if not any(c["offload"] for c in cands):
        tips.append("--allow-offload")
    if se.get("min_headroom_bytes"):
        tips.append("a smaller --min-headroom")
    if se["micro_batches"][0] > 1:
        tips.append("a smaller --micro-batch")
    tips += ["a shorter --seq-len", "a larger GPU"]
    return "try " + ", ".join(tips)


def pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def render_validation(rep: dict) -> None:
    c = console()
    val, run, pred = rep["validation"], rep["run"], rep["prediction"]
    m, st = pred["model"], pred["strategy"]
    c.print(f"[bold]{m['name']}[/bold] ({m['num_params']:,} params run; {rep['scaled_from_params']:,} in the "
            f"original) · {st['name']} · {pred['cluster']['gpus']} rank(s) · {st['precision']} · {run['device']} "
            f"· {run['initialisation']}")
    for ch in rep["config_changes"]:
        c.print(f"scaled: {ch}")
    rows = []
    for r in val["ranks"]:
        mark = " ◀ worst" if r["rank"] == val["worst_rank"] else ""
        rows.append([f"{r['rank']}{mark}", fmt_bytes(r["start_bytes"]), fmt_bytes(r["peak_bytes"]), r["peak_phase"],
                     pct(r["peak_error"])])
    c.print(table("Measured per rank (allocator; GiB = 2^30 B)", [("rank", "left"), ("start of step", "right"),
                                                                   ("peak", "right"), ("phase", "left"),
                                                                   ("prediction error", "right")], rows))
    if val.get("host_added_bytes"):
        c.print(f"offload on CPU: the plan's host share ({val['host_added_bytes']:,} B per rank) is in the "
                "predictions below, since device and host are one allocator here")
    pk, ss = val["peak"], val["start_of_step"]
    cat_rows = [[k.removesuffix("_bytes").replace("_", " "), f"{v['predicted']:,}", f"{v['measured']:,}",
                 "exact" if v["predicted"] == v["measured"] else f"{v['predicted'] - v['measured']:+,}"]
                for k, v in val["categories_at_start"].items()]
    cat_rows.append(["start of step (all)", f"{ss['predicted_bytes']:,}", f"{ss['measured_bytes']:,}",
                     pct(ss["error"])])
    cat_rows.append([f"peak (predicted {pk['predicted_phase']}, measured {pk['measured_phase']})",
                     f"{pk['predicted_bytes']:,}", f"{pk['measured_bytes']:,}", pct(pk["error"])])
    c.print(table("Predicted vs measured (worst rank, bytes)", [("", "left"), ("predicted", "right"),
                                                                ("measured", "right"), ("error", "right")], cat_rows))
    verdict = "[green]WITHIN[/green]" if val["within_tolerance"] else "[red]OUTSIDE[/red]"
    c.print(f"{verdict} tolerance ±{100 * val['tolerance']:g}% on the peak; rank spread "
            f"{100 * pk['rank_spread']:.2f}%; {run['wall_s']} s; " +
            ", ".join(f"{k} {v}" for k, v in run["versions"].items()))


def render_presets(rep: dict) -> None:
    """`memplan presets`: the model presets and the GPU presets."""
    c = console()
    c.print(table("Model presets (real config.json files)", [("preset", "left"), ("aliases", "left"),
                                                           ("model_type", "left"), ("parameters", "right")],
                  [[m["name"], ", ".join(m["aliases"]), m["model_type"], f"{m['num_params']:,}"]
                   for m in rep["models"]]))
    c.print(table("GPU presets (capacity: what the verdict compares with, as torch reports it where measured, "
                  "else the driver's memory.total)",
                  [("gpu", "left"), ("device", "left"), ("capacity", "right"), ("bytes", "right"), ("as", "left"),
                   ("driver's total", "right")],
                  [[g["id"], f"{g['name']} ({g['nominal']})", fmt_bytes(g["capacity_bytes"]),
                    f"{g['capacity_bytes']:,}", g["capacity_as"], f"{g['usable_bytes']:,}"] for g in rep["gpus"]]))


def render_inspect(rep: dict) -> None:
    """`memplan inspect`: a model's parameters by dtype and category, its blocks and ties."""
    c = console()
    m = rep["model"]
    c.print(f"[bold]{m['name']}[/bold]  {m['num_params']:,} parameters  ({m['family']}, {m['source']}, "
            f"builder: {m['builder']})")
    c.print(table("Stored bytes by dtype", [("dtype", "left"), ("bytes", "right"), ("size", "right")],
                  [[d, f"{b:,}", fmt_bytes(b)] for d, b in rep["bytes_by_dtype"].items()]))
    total = m["num_params"]
    c.print(table("Parameters by category", [("category", "left"), ("parameters", "right"), ("share", "right")],
                  [[k, f"{v:,}", f"{100 * v / total:.2f}%"] for k, v in rep["params_by_category"].items()]))
    lb, lt = rep["largest_block"], rep["largest_tensor"]
    c.print(f"blocks (wrapped units): {rep['num_blocks']}; root (outside blocks): {rep['root_block_params']:,} params")
    if lb:
        c.print(f"largest block: {lb['name']} ({lb['num_params']:,} params, {lb['num_tensors']} tensors)")
    c.print(f"largest tensor: {lt['name']} {tuple(lt['shape'])} ({lt['num_params']:,} params)")
    for t in rep["tied"]:
        c.print(f"tied: {t['name']} = {', '.join(t['aliases'])} (counted once)")
    for n in rep["notes"]:
        c.print(f"note: {n}", markup=False)
