"""The traced timeline read at the moments a strategy acts: each block's backward with its own gradients, each
gradient hook, the loss's backward, and the storages in order for the caching allocator's replay."""

from __future__ import annotations

from typing import Any


def block_segments(timeline: list[int], grads: list[tuple[int, int, int]], forward_end: int,
                    ends: dict[int, int] | None = None, hooked: list[int] | None = None,
                    starts: dict[int, int] | None = None) -> list[list[list[int]]]:
    """Each block's backward, last block first: the points [activation bytes, the block's parameter-gradient
    elements created so far, those of them whose post-accumulate hook has not run yet (``hooked``: per entry of
    ``grads``, the index from which it has; without it, none counted)], from the end of the previous block's
    backward (or of the loss and head's: when the gradient of its output is complete, ``starts``: block ->
    timeline index, or without that, after the last gradient of what ran before it) to the end of its own: when
    the gradient of its input is complete (``ends``: block -> timeline index), or without that, the creation of
    its last parameter gradient. The recomputation of a checkpointed block falls inside its segment. A strategy
    that keeps a block's unsharded gradients until the block's backward ends (FSDP) adds them at its own
    gradient dtype; activations alone miss the moment where the two together peak."""
    ends, starts = ends or {}, starts or {}
    by_block: dict[int, list[tuple[int, int]]] = {}
    pending: dict[int, list[tuple[int, int, int]]] = {}
    for i, (born, blk, numel) in enumerate(grads):
        if blk >= 0:
            by_block.setdefault(blk, []).append((born, numel))
            if hooked is not None:
                pending.setdefault(blk, []).append((born, hooked[i], numel))
    segments = []
    start = forward_end
    for blk in sorted(by_block, reverse=True):
        events = sorted(by_block[blk])
        first, end = events[0][0], max(events[-1][0], ends.get(blk, 0))
        # the segment starts after the last gradient of anything that ran before this block in backward
        before = [born for born, b, _ in grads if born < first and b != blk]
        start = max([start] + [x + 1 for x in before])
        if blk in starts and start <= starts[blk] <= first:
            start = starts[blk]
        points, done, k = [], 0, 0
        held = pending.get(blk, [])
        for t in range(start, end + 1):
            while k < len(events) and events[k][0] <= t:
                done += events[k][1]
                k += 1
            points.append([timeline[t], done, sum(n for b, h, n in held if b <= t < h)])
        segments.append(points)
        # the next block's backward begins where this one's ends (the input's gradient is its output's)
        start = end if blk in ends else end + 1
    return segments


def block_hooks(timeline: list[int], grads: list[tuple[int, int, int]],
                 points: list[int]) -> list[list[list[int]]]:
    """Per block, last first (as _block_segments): [activation bytes at the parameter's post-accumulate hook,
    its gradient's elements] for each of its parameters, in backward order. A strategy that works on each
    gradient in that hook (DeepSpeed's offload: a reduced partition and its fp64 copy for the norm) adds its
    transient to the activations of that moment."""
    by_block: dict[int, list[list[int]]] = {}
    for (born, blk, numel), at in zip(grads, points):
        if blk >= 0:
            by_block.setdefault(blk, []).append([timeline[at], numel])
    return [by_block[b] for b in sorted(by_block, reverse=True)]


def root_hooks_done(timeline: list[int], grads: list[tuple[int, int, int]], points: list[int], forward_end: int,
                     starts: dict[int, int] | None = None) -> int | None:
    """Activations at the hook of the last parameter outside the blocks whose gradient is made before the last
    block's backward (the final norm's, after the head's), or None. A gradient hook is where DeepSpeed works:
    ZeRO-1/2 set up their reduce bucket at the first (the head's), and ZeRO-3 reduces a bucket that the next
    parameter's gradient would overflow at that parameter's hook, so a head larger than the bucket is reduced,
    with ZeRO-Offload's transient, at the final norm's."""
    start = segment_start(grads, forward_end, starts)
    before = [at for (born, blk, _), at in zip(grads, points) if blk < 0 and born < start]
    return timeline[max(before)] if before else None


def root_first_hook(timeline: list[int], grads: list[tuple[int, int, int]], points: list[int],
                    firsts: list[tuple[int, int]], forward_end: int,
                    starts: dict[int, int] | None = None) -> tuple[int, int] | None:
    """(activations, gradient elements outside the blocks made so far) at the backward's first gradient hook, or
    None where no parameter outside the blocks has a hook before them. DeepSpeed ZeRO-1/2 set their reduce bucket
    up in it (stage_1_and_2.py process_gradients -> setup_buckets), before that gradient is copied into the bucket
    and its own storage freed: the head's weight gradient (and a tied weight's first contribution) are alive
    beside the new bucket. Measured: phi3-mini-4l ZeRO-2 offload at micro-batch 1 peaks there
    (bench/gpu/traces/phi3_z2off1: the 1,000,000,000-byte bucket beside the head's 197,001,216-byte gradient)."""
    start = segment_start(grads, forward_end, starts)
    roots = [at for (born, blk, _), at in zip(grads, points) if blk < 0 and born < start]
    if not roots:
        return None
    at = min(roots)
    made = sum(numel for born, blk, numel in grads if blk < 0 and born <= at)
    return timeline[at], made + sum(numel for born, numel in firsts if born <= at)


def loss_segment(timeline: list[int], grads: list[tuple[int, int, int]], firsts: list[tuple[int, int]],
                  forward_end: int, blocks: list[list[list[int]]],
                  starts: dict[int, int] | None = None) -> list[list[int]]:
    """The loss's and the head's backward, up to the last block's backward: the points [activation bytes, the
    gradient elements of parameters outside the blocks created so far (the head's; a tied weight's from its
    first contribution)]. Autograd makes each weight gradient as a new tensor (the head's GEMM writes it), so
    every strategy holds it on top of what it keeps, at least until its hook has taken it: the moment of the
    head's weight-gradient GEMM (its output and, on CPU, the GEMM's fp32 scratch) can top the loss's own."""
    # the blocks' segments run back to back from the end of this one (see _block_segments). A tied weight's
    # own gradient entry is born at the embedding's backward, after every block: past this segment.
    end = segment_start(grads, forward_end, starts) - 1 if blocks else len(timeline) - 1
    events = sorted([(born, numel) for born, blk, numel in grads if blk < 0] + list(firsts))
    points, done, k = [], 0, 0
    for t in range(forward_end - 1, max(end, forward_end - 1) + 1):
        while k < len(events) and events[k][0] <= t:
            done += events[k][1]
            k += 1
        points.append([timeline[t], done])
    return points


def segment_start(grads: list[tuple[int, int, int]], forward_end: int,
                   starts: dict[int, int] | None = None) -> int:
    """Where the last block's backward segment begins (as _block_segments places it)."""
    blks = [blk for _, blk, _ in grads if blk >= 0]
    if not blks:
        return forward_end
    last = max(blks)
    first = min(born for born, blk, _ in grads if blk == last)
    before = [born for born, b, _ in grads if born < first and b != last]
    start = max([forward_end] + [x + 1 for x in before])
    at = (starts or {}).get(last)
    return at if at is not None and start <= at <= first else start


def alloc_events(a: dict[str, Any], b: dict[str, Any], *, expand: bool) -> dict[str, Any] | None:
    """The traced step as the caching allocator sees it, from its runs at micro-batch 2 and 4: "events" in order,
    a storage's birth [c0, c1] (c0 + c1*b bytes at micro-batch b; a third item, the block of the parameter whose
    gradient it is, -1 outside the blocks) or a death (the id of the storage: the number of births before its
    own). "fs", "fe", "bs", "be": per traced block, the event index at which its forward starts and ends and its
    backward starts and ends (the gradient of its output, then of its input, complete); "expand": the blocks
    are alike and memplan/reserved.py repeats them to the model's depth; "blas": {"f": n, "b": n}, the births
    before the forward's and the backward's first cuBLAS call (where its thread's workspace is allocated). None
    where the two runs differ."""
    ea, eb = a["events"], b["events"]
    if len(ea) != len(eb) or a["regions"] != b["regions"]:
        return None
    eb = deaths_as_in(ea, eb)
    if eb is None:
        return None
    out: list[Any] = []
    for x, y in zip(ea, eb):
        if isinstance(x, list) and len(x) > 1 and x[1] == "k":
            # a kernel's own scratch: its arguments as lines in the micro-batch (kernels.kernel_scratch)
            if not isinstance(y, list) or y[1:3] != x[1:3] or len(y[3]) != len(x[3]) or \
                    any((q - p) % 2 for p, q in zip(x[3], y[3])):
                return None
            lines = [[p - 2 * ((q - p) // 2), (q - p) // 2] for p, q in zip(x[3], y[3])]
            out.append([x[0], 0, "k", x[2], lines])
            continue
        if isinstance(x, list):
            if not isinstance(y, list) or x[1:] != y[1:]:
                return None
            slope = (y[0] - x[0]) // 2
            out.append([x[0] - 2 * slope, slope] + x[1:])
        elif x != y:
            return None
        else:
            out.append(x)
    r = a["regions"]
    n = len(r["fs"])
    if any(sorted(r[k]) != list(range(n)) for k in ("fs", "fe", "bs", "be")):
        return None
    # births before the forward's and the backward's first cuBLAS call (LiveBytes.blas), where both runs agree
    blas = a.get("blas") or {}
    blas = {k: v for k, v in blas.items() if (b.get("blas") or {}).get(k) == v}
    # an expert-parallel rank's experts modules, per block (-1: a block without one): where each runs
    # (tracing/step.py _BlockMoments.install_experts)
    experts = {k: [r[k].get(i, -1) for i in range(n)] for k in EXPERT_MARKS if k in r}
    return {"events": out, "expand": expand, "forward_end": r["forward_end"],
            **({"blas": blas} if blas else {}), **experts,
            **{k: [r[k][i] for i in range(n)] for k in ("fs", "fe", "bs", "be")}}


#: the event indices of each block's experts module, where it is its own FSDP2 unit (expert parallelism): its
#: forward's start and end, its backward's start and end, its recomputation's start and end
EXPERT_MARKS = ("xfs", "xfe", "xbs", "xbe", "xrs", "xre")


def deaths_as_in(ea: list[Any], eb: list[Any]) -> list[Any] | None:
    """``eb`` with each run of consecutive deaths in ``ea``'s order where the two runs free the same storages: the
    order in which storages that die together are released can differ run to run (seen with bitsandbytes' 4-bit
    layers on the CPU: two of a layer's temporaries freed in either order), which the caching allocator's blocks
    barely notice; a different set is a different step (None)."""
    out = list(eb)
    i, n = 0, len(ea)
    while i < n:
        if isinstance(ea[i], list):
            i += 1
            continue
        j = i
        while j < n and not isinstance(ea[j], list):
            j += 1
        if ea[i:j] != eb[i:j]:
            if any(isinstance(y, list) for y in eb[i:j]) or sorted(ea[i:j]) != sorted(eb[i:j]):
                return None
            out[i:j] = ea[i:j]
        i = j
    return out
