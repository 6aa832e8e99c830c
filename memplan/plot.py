"""Pictures of the bytes: stacked bars of per-GPU bytes by category (model states, activations, buffers, and what
the caching allocator, CUDA and NCCL add on top) across GPU counts for one job (`estimate --plot`), or across the
candidates of a search (`plan --plot`), with the card's capacity as a line; and the compact bar of one estimate
for the terminal. matplotlib is an optional extra (pip install 'memplan[plot]'), imported only to draw."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.errors import SettingsError
from memplan.inputs import quote
from memplan.timeline import CATEGORIES

#: the stacked segments, bottom up: the peak phase's categories, then what the fit verdict adds
SEGMENTS = tuple(CATEGORIES.items()) + (("overhead_bytes", "allocator, CUDA context, NCCL"),)
COLORS = ("#4C72B0", "#8172B2", "#C44E52", "#DD8452", "#55A868", "#937860", "#BBBBBB")
FORMATS = (".svg", ".png")


def bars_across_gpus(inv: Any, s: Any, counts: tuple[int, ...] | None = None) -> list[tuple[str, dict[str, int]]]:
    """(label, {segment: bytes}) of the job at each GPU count it can run at (powers of two from 1 to 8x the job's
    own count, the job's own included); each one the full estimate (the allocator replayed)."""
    from memplan import accounting
    from memplan.settings import MAX_GPUS, with_gpus

    own = s.cluster.gpus
    if counts is None:
        counts = tuple(sorted({1 << k for k in range(0, 17) if (1 << k) <= min(8 * own, MAX_GPUS)} | {own}))
    out = []
    for n in counts:
        try:
            t = with_gpus(s, n)
            if n < t.cluster.ranks_per_node:
                t = replace(t, cluster=replace(t.cluster, gpus_per_node=n))
            plan = accounting.estimate(inv, t)
        except SettingsError:
            continue  # a count the strategy cannot run at (one GPU only, an HSDP shard size that does not divide)
        out.append((f"{n}" + (" (this job)" if n == own else ""), segments(plan)))
    return out


def bars_across_candidates(inv: Any, found: Any) -> list[tuple[str, dict[str, int]]]:
    """(label, {segment: bytes}) of each candidate of a search at the recommended GPU count (or the largest
    searched when nothing fits), at its largest fitting micro-batch (1 where none fits)."""
    from memplan import accounting
    from memplan.settings import with_gpus

    n = found.gpus or found.max_gpus
    out = []
    for c in found.candidates:
        mb = c.micro_batch or 1
        try:
            plan = accounting.estimate(inv, replace(with_gpus(c.settings, n), micro_batch=mb))
        except SettingsError:
            continue
        out.append((f"{c.label}, {c.recompute}, mb {mb}", segments(plan)))
    return out


def segments(plan: Any) -> dict[str, int]:
    seg = {k: getattr(plan.peak, k) for k, _ in CATEGORIES.items()}
    seg["overhead_bytes"] = plan.overhead_bytes
    return seg


def check_path(path: str) -> None:
    """--plot's file, checked before any work: it ends in .svg or .png, its directory exists, and it is not a
    special file (a FIFO or a device is refused, never opened); "-" is refused (stdout carries the table or the
    JSON). matplotlib must be installed."""
    import os

    from memplan.inputs import check_regular

    if path == "-":
        raise SettingsError("--plot -: give a file ending in .svg or .png (stdout carries the table or the JSON)")
    if not path.lower().endswith(FORMATS):
        raise SettingsError(f"--plot {quote(path)}: the file must end in .svg or .png")
    check_regular(path, "--plot")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise SettingsError(f"--plot {quote(path)}: no directory {quote(parent)} to write it in")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SettingsError("--plot needs matplotlib: pip install 'memplan[plot]'") from None


def draw(path: str, bars: list[tuple[str, dict[str, int]]], capacity: int | None, title: str, xlabel: str) -> None:
    """Stacked bars (GiB) to ``path`` (.svg or .png), the capacity as a dashed line when given; written to a
    temporary file beside it, then renamed (inputs.write_atomic)."""
    import io

    from memplan.inputs import write_atomic

    check_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SettingsError("--plot needs matplotlib: pip install 'memplan[plot]'") from None
    gib = 2 ** 30
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(bars) + 3), 4.5))
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for (key, label), color in zip(SEGMENTS, COLORS):
        vals = [b[1].get(key, 0) / gib for b in bars]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=color, label=label, width=0.7)
            bottom = [x + v for x, v in zip(bottom, vals)]
    if capacity:
        ax.axhline(capacity / gib, color="black", linestyle="--", linewidth=1)
        ax.text(len(bars) - 0.5, capacity / gib, f" GPU {capacity / gib:.2f} GiB", va="bottom", ha="right",
                fontsize=8)
    ax.set_xticks(list(xs), [b[0] for b in bars], rotation=30 if len(bars) > 6 else 0, ha="right" if len(bars) > 6
                  else "center", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("bytes per GPU (GiB = 2^30 B)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format=path.lower().rsplit(".", 1)[1])
    finally:
        plt.close(fig)
    write_atomic(path, buf.getvalue(), "--plot")


#: the terminal bar's characters per segment (the free part is "·")
BAR_CHARS = {"weights_bytes": "W", "master_weights_bytes": "M", "grads_bytes": "G", "optimizer_states_bytes": "O",
             "activations_bytes": "A", "buffers_bytes": "B", "overhead_bytes": "+"}


def terminal_bar(seg: dict[str, int], capacity: int | None, width: int = 60) -> str:
    """One line of ``width`` cells: each segment's share as repeated letters (W weights, M master weights,
    G gradients, O optimizer states, A activations, B buffers, + allocator/CUDA/NCCL), the GPU's free part as
    dots; a job larger than the GPU is drawn to its own size with '|' where the GPU ends."""
    total = sum(seg.values())
    scale = max(capacity or 0, total) or 1
    cells, acc, drawn = [], 0, 0
    for key, _ in SEGMENTS:
        acc += seg.get(key, 0)
        upto = round(width * acc / scale)
        cells.append(BAR_CHARS[key] * max(upto - drawn, 0))
        drawn = max(drawn, upto)
    bar = "".join(cells)
    if capacity:
        if total > capacity:
            at = round(width * capacity / scale)
            bar = bar[:at] + "|" + bar[at:]
        else:
            bar += "·" * (width - len(bar))
    return bar


def draw_estimate(path: str, est: Any) -> None:
    """`memplan estimate --plot`: the job as given (cli_estimate.Estimated) at each GPU count its layout runs at."""
    s, inv, lay = est.plan.settings, est.plan.inventory, ""
    if est.plan.layout is not None:  # the most loaded rank's job
        s, inv = est.plan.layout.settings, est.plan.layout.inventory
        lay = f" tp {s.parallel.tp} x pp {s.parallel.pp}" + (f" x cp {s.parallel.cp}" if s.parallel.cp > 1 else "") \
            + " (the most loaded rank),"
    draw(path, bars_across_gpus(inv, s), s.cluster.gpu_memory_bytes,
         f"{est.report['model']['name']}: {s.strategy.name},{lay} micro-batch {s.micro_batch} x seq "
         f"{s.seq_len}, {s.recipe.name}, recompute {s.recompute}", "GPUs")
