"""A traced profile's upper envelopes, rebuilt from its per-operation lines, and a profile at a sequence length
that was not traced, fitted from profiles that were. No torch here: `memplan estimate <preset> --seq-len N` runs
without tracing.

Every number a profile holds at sequence length s is a count of bytes of tensors whose sizes are products of the
config's dimensions, the micro-batch and s: linear in s (b*s*h activations, rotary tables, masks' rows), quadratic
where a kernel keeps s x s tensors (eager attention's scores, a materialised mask), constant otherwise (weight
casts). So each number is a polynomial of degree at most 2 in s, and three traced lengths determine it: the fit
passes through the traced profiles exactly and is exact at any other length where that holds (what the tests and
bench/seq_fit.py check against new traces). The envelopes (the per-operation lines that are the maximum for some
micro-batch) are not numbers of this kind, since which operation peaks changes with s: they are rebuilt from the
fitted per-operation lines ("raw", stored with every profile since PROFILE_VERSION 17)."""

from __future__ import annotations

from typing import Any

from memplan.inputs import quote

#: the gradient widths (bytes per element) a strategy may keep a block's unsharded gradients in
GRAD_WIDTHS = (2, 4)

#: the traced lengths shipped for every preset (tools/ship_activation_profiles.py) and looked for in the cache,
#: with the model's longest (fit_seqs)
FIT_SEQS = (512, 1024, 2048, 4096, 8192)


def fit_seqs(config: dict[str, Any]) -> tuple[int, ...]:
    """The lengths a profile at another length may be fitted from: FIT_SEQS and the model's maximum."""
    def num(k: str) -> int:
        v = config.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) else 0

    longest = next((num(k) for k in ("max_position_embeddings", "n_positions", "seq_length") if num(k)), 0)
    out = set(FIT_SEQS) | ({longest} if longest > FIT_SEQS[-1] else set())
    # a local attention window changes the step's operations from its width on (transformers' masking_utils
    # materialises the sliding-window mask once kv_length >= the window): lengths on both sides of it, so that
    # every length has three around it that run the same operations (all multiples of 256: exact traced sizes)
    for k in ("sliding_window", "attention_chunk_size"):
        w = num(k)
        if 1024 < w and (not longest or w <= longest) and config.get("use_sliding_window") is not False:
            out |= {w - 256, w}
    return tuple(sorted(out))


def envelope(lines: list[tuple[int, ...]]) -> list[list[int]]:
    """The lines (c0 + c1*b, then any payload) that are the maximum for some micro-batch b >= 1 (upper
    envelope)."""
    best: dict[int, tuple[int, ...]] = {}
    for line in lines:
        c0, c1 = line[0], line[1]
        if c1 not in best or best[c1][0] < c0:
            best[c1] = tuple(line)
    keep: list[tuple[int, ...]] = []
    for c1 in sorted(best):  # by slope
        line = best[c1]
        # drop lines below this one for every b >= 1 (smaller slope and smaller value at b=1)
        while keep and keep[-1][0] + keep[-1][1] <= line[0] + line[1]:
            keep.pop()
        keep.append(line)
    return [list(x) for x in keep]


def segment(pts: list[list[int]]) -> dict[str, Any]:
    """One block's backward from its per-operation points [c0, c1, g(, h)]: activations c0 + c1*b, the block's
    gradients so far g elements (h: those whose hook has not run yet, where traced): where it begins and ends,
    and per gradient width w the envelope of [c0, c1, g] ranked by c0 + c1*b + w*g."""
    out: dict[str, Any] = {"start": list(pts[0][:2]), "end": list(pts[-1][:2])}
    for w in GRAD_WIDTHS:
        env = envelope([(c0 + w * g, c1, c0, g) for c0, c1, g, *_ in pts])
        out[str(w)] = [[c0, c1, g] for _, c1, c0, g in env]
    if all(len(p) > 3 for p in pts):
        # the same with only the gradients whose hook has not run yet ("held2", "held4": ZeRO takes each
        # gradient in its hook)
        for w in GRAD_WIDTHS:
            env = envelope([(c0 + w * h, c1, c0, h) for c0, c1, _, h in pts])
            out[f"held{w}"] = [[c0, c1, g] for _, c1, c0, g in env]
    return out


def envelopes(raw: dict[str, Any]) -> dict[str, Any]:
    """The profile's enveloped fields from its per-operation lines (see tracing/fit.py _profile)."""
    blocks = [segment(pts) for pts in raw["blocks"]]
    for blk, h in zip(blocks, raw["hooks"]):
        blk["hooks"] = h
    first = segment(raw["first"]) if raw.get("first") else None
    if first is not None and raw.get("first_hooks") is not None:
        first["hooks"] = raw["first_hooks"]
    second = {"second_block_backward": segment(raw["second"])} if raw.get("second") else {}
    if raw.get("any"):
        second["any_block_backward"] = segment(raw["any"])
    return {**second, "forward_peak": envelope([tuple(x) for x in raw["forward"]]),
            "backward_peak": envelope([tuple(x) for x in raw["backward"]]),
            "block_backward": blocks, "first_block_backward": first, "loss_backward": segment(raw["loss"]),
            "last_block_forward_peak": (envelope([tuple(x) for x in raw["last_block_forward"]])
                                        if raw["last_block_forward"] else [[0, 0]])}


#: fields a fitted profile takes from its own request, not from the traced ones
_OWN = ("seq_len",)
#: fields rebuilt from the fitted per-operation lines
_ENVELOPED = ("forward_peak", "backward_peak", "block_backward", "first_block_backward", "loss_backward",
              "last_block_forward_peak", "second_block_backward", "any_block_backward")


class NotFittable(Exception):
    """The traced profiles differ in more than their numbers (other operations, kernels or groups)."""


def _poly(xs: tuple[int, int, int], s: int) -> tuple[int, int, int, int]:
    """Lagrange weights of the quadratic through xs, at s, over one common denominator: (w0, w1, w2, d) with
    the value sum(wi * yi) / d (integers: exact)."""
    a, b, c = xs
    d = (a - b) * (a - c) * (b - c)
    return ((s - b) * (s - c) * (b - c), -(s - a) * (s - c) * (a - c), (s - a) * (s - b) * (a - b), d)


def _fit(values: tuple[Any, Any, Any], w: tuple[int, int, int, int]) -> Any:
    a = values[0]
    if isinstance(a, bool) or a is None or isinstance(a, str):
        if any(v != a for v in values[1:]):
            raise NotFittable(f"{quote(a)} differs")
        return a
    if isinstance(a, int):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise NotFittable("types differ")
        if values[0] == values[1] == values[2]:
            return a
        x = w[0] * values[0] + w[1] * values[1] + w[2] * values[2]
        # a value that is not a polynomial of degree 2 in s gives a fraction: rounded up, never under
        d = w[3]
        if d < 0:
            x, d = -x, -d
        return -((-x) // d)
    if isinstance(a, float):
        return a if all(v == a for v in values) else \
            (w[0] * values[0] + w[1] * values[1] + w[2] * values[2]) / w[3]
    if isinstance(a, list):
        if any(not isinstance(v, list) or len(v) != len(a) for v in values):
            raise NotFittable("lengths differ")
        return _fit_list(values, w)
    if isinstance(a, dict):
        if any(not isinstance(v, dict) or v.keys() != a.keys() for v in values):
            raise NotFittable("keys differ")
        return {k: _fit(tuple(v[k] for v in values), w) for k in a}
    raise NotFittable(f"unexpected {type(a).__name__}")


def _fit_list(values: tuple[Any, Any, Any], w: tuple[int, int, int, int]) -> list[Any]:
    """_fit over three lists of the same length, with a fast path for their integers and lists of integers (the
    timelines and allocation events, tens of thousands of numbers for a model traced at full depth)."""
    w0, w1, w2, d = w
    if d < 0:
        w0, w1, w2, d = -w0, -w1, -w2, -d
    out: list[Any] = []
    for x, y, z in zip(*values):
        tx = type(x)
        if tx is int and type(y) is int and type(z) is int:
            out.append(x if x == y == z else -((-(w0 * x + w1 * y + w2 * z)) // d))
        elif tx is list and type(y) is list and type(z) is list and len(x) == len(y) == len(z) and x and \
                all(type(v) is int for v in x) and all(type(v) is int for v in y) and \
                all(type(v) is int for v in z):
            try:  # a line [c0, c1, ...] of integers (a kernel's scratch birth, with its kind: the general path)
                out.append([p if p == q == r else -((-(w0 * p + w1 * q + w2 * r)) // d)
                            for p, q, r in zip(x, y, z)])
            except TypeError:
                out.append(_fit((x, y, z), w))
        else:
            out.append(_fit((x, y, z), w))
    return out


def _group_key(g: dict[str, Any]) -> tuple:
    return (g.get("module"), g.get("op"), g.get("dtype"), g.get("saved"), tuple(g.get("batch_dims") or ()))


def _fit_explain(values: tuple[Any, Any, Any], w: tuple[int, int, int, int]) -> dict[str, Any]:
    """The --explain groups, matched by what they are (module, operator, dtype, saved) rather than by their
    rank, which changes with s; a group not among the largest at every traced length joins the rest."""
    out: dict[str, Any] = {}
    for moment in values[0]:
        pts = [v.get(moment) for v in values]
        if any(p is None or len(p) != len(pts[0]) for p in pts):
            raise NotFittable("explained moments differ")
        fitted = []
        for trio in zip(*pts):
            line = _fit(tuple(p["line"] for p in trio), w)
            common = [k for k in (_group_key(g) for g in trio[0]["groups"])
                      if all(any(_group_key(g) == k for g in p["groups"]) for p in trio[1:])]
            groups = []
            for k in common:
                gs = tuple(next(g for g in p["groups"] if _group_key(g) == k) for p in trio)
                groups.append(_fit(gs, w))
            rest = [line[0] - sum(g["line"][0] for g in groups), line[1] - sum(g["line"][1] for g in groups)]
            fitted.append({"line": line, "groups": groups, "rest": rest})
        out[moment] = fitted
    return out


def fit_profile(traced: dict[int, dict[str, Any]], seq_len: int) -> dict[str, Any] | None:
    """The profile at ``seq_len`` from profiles traced at other lengths (``traced``: length -> profile, the same
    configuration otherwise): three of them around it, each number fitted as a quadratic in s. None when no
    three around it carry their per-operation lines and run the same operations."""
    usable = sorted(traced)  # a mapping that may read each profile only when asked (profile_cache._fitted)
    # never extrapolated: a length past the traced ones may cross a model's own threshold (a sliding window
    # materialises its mask from its width on: measured with mistral-7b, other operations from 4096 on), which a
    # polynomial through shorter lengths cannot see; three lengths around it, the nearest first, whose traces
    # run the same operations (the same structure)
    triples = [(a, b, c) for i, a in enumerate(usable) for j, b in enumerate(usable[i + 1:], i + 1)
               for c in usable[j + 1:] if a <= seq_len <= c]
    for xs in sorted(triples, key=lambda t: (t[2] - t[0], t)):
        out = _fit_at(tuple(traced[s] for s in xs), xs, seq_len)  # type: ignore[arg-type]
        if out is not None:
            return out
    return None


#: raw's timelines, stored as differences from the point before (packed): neighbouring points of a timeline
#: differ by one storage, so they compress three times better (deepseek-v3 at full depth: 351 kB -> 108 kB gzip)
_TIMELINES = ("forward", "backward", "last_block_forward", "loss")


def _delta(points: list[Any], sign: int) -> list[Any]:
    out, prev = [], None
    for x in points:
        if sign > 0:  # pack: each point minus the one before
            out.append(x if prev is None else ([a - b for a, b in zip(x, prev)] if isinstance(x, list) else x - prev))
            prev = x
        else:  # unpack: each stored difference plus the point before
            prev = x if prev is None else ([a + b for a, b in zip(x, prev)] if isinstance(x, list) else x + prev)
            out.append(prev)
    return out


def _code(raw: dict[str, Any], sign: int) -> dict[str, Any]:
    out = dict(raw)
    for k in _TIMELINES:
        out[k] = _delta(raw[k], sign)
    out["blocks"] = [_delta(seg, sign) for seg in raw["blocks"]]
    out["first"] = _delta(raw["first"], sign) if raw.get("first") else raw.get("first")
    for k in ("second", "any"):
        if raw.get(k):
            out[k] = _delta(raw[k], sign)
    n = dict(raw["n"])
    for k in _TIMELINES:
        n[k] = _delta(n[k], sign) if n.get(k) else n.get(k)
    n["blocks"] = [_delta(seg, sign) for seg in n["blocks"]]
    n["first"] = _delta(n["first"], sign) if n.get("first") else n.get("first")
    for k in ("second", "any"):
        if n.get(k):
            n[k] = _delta(n[k], sign)
    out["n"] = n
    return out


def pack(profile: dict[str, Any]) -> dict[str, Any]:
    """The profile as stored: its raw timelines as differences (see _TIMELINES)."""
    raw = profile.get("raw")
    if not isinstance(raw, dict) or raw.get("packed"):
        return profile
    return {**profile, "raw": {**_code(raw, 1), "packed": 1}}


def unpack(raw: dict[str, Any]) -> dict[str, Any]:
    """raw as traced, from raw as stored."""
    if not raw.get("packed"):
        return raw
    return {k: v for k, v in _code(raw, -1).items() if k != "packed"}


def _fit_at(profs: tuple[dict[str, Any] | None, ...], xs: tuple[int, int, int],
            seq_len: int) -> dict[str, Any] | None:
    if any(p is None or not isinstance(p.get("raw"), dict) for p in profs):
        return None  # unreadable, or traced before the per-operation lines were kept
    profs = tuple({**p, "raw": unpack(p["raw"])} for p in profs)  # type: ignore[union-attr]
    w = _poly(xs, seq_len)
    try:
        if any(p.keys() != profs[0].keys() for p in profs):
            raise NotFittable("fields differ")
        out: dict[str, Any] = {}
        for k in profs[0]:
            if k in _OWN or k in _ENVELOPED:
                continue
            vals = tuple(p[k] for p in profs)
            out[k] = _fit_explain(vals, w) if k == "explain" else _fit(vals, w)  # type: ignore[arg-type]
    except NotFittable:
        return None
    out["seq_len"] = seq_len
    if seq_len not in xs:
        _round_up_margin(out)
    out.update(envelopes(out["raw"]))
    out["fitted_from"] = list(xs)
    return out


#: the traced sizes are rounded up to the caching allocator's 512-byte blocks (tracing/step.py), a step a
#: polynomial does not take: at a length where a tensor's bytes are not a multiple of 512 its traced size is up
#: to 511 bytes above the fitted one (measured: gpt2 at seq 700, the input ids' 5,600 bytes traced as 5,632)
ROUNDING = 512


def _round_up_margin(p: dict[str, Any]) -> None:
    """Raise every fitted line of live bytes by one allocator block per storage alive at that point (counted by
    the trace, raw["n"]): never below a trace at that length. Allocation events keep their own sizes (the
    replay rounds each one as the allocator does); the --explain groups are left as fitted."""
    raw, n = p["raw"], p["raw"]["n"]

    def lift(line: list[int] | None, count: int | None) -> None:
        if line and count:
            line[0] += ROUNDING * count

    lift(p.get("live_after_forward"), n["live"])
    lift(p.get("per_layer"), n["per_layer"])
    lift(p.get("saved_for_backward"), n["saved"])
    lift(p.get("root_hooks_done"), n["root_hooks_done"])
    lift(p.get("root_first_hook"), n.get("root_first_hook"))
    lift(p.get("last_block_forward_start"), n["last_block_forward_start"])
    for k in ("forward", "backward", "last_block_forward", "loss"):
        for line, count in zip(raw[k], n[k] or ()):
            lift(line, count)
    for k in ("blocks", "hooks"):
        for seg, counts in zip(raw[k], n[k]):
            for line, count in zip(seg, counts):
                lift(line, count)
    for k in ("first", "first_hooks", "second", "any"):
        for line, count in zip(raw.get(k) or (), n.get(k) or ()):
            lift(line, count)


def engine_values(profile: dict[str, Any], recompute: str, micro_batch: int) -> list[int]:
    """Every value the engine reads off a profile at ``micro_batch``: its terms, named moments, block moments and
    the head's backward (what tests and bench/seq_fit.py compare a fit with a trace on)."""
    from memplan.activations.profile import TracedProfile

    tp = TracedProfile(profile, 1, "compare")
    out = list(tp.terms(recompute, micro_batch)) + list(tp.moment_activations(micro_batch).values())
    out += [x for pair in tp.block_moments(micro_batch, 2, False) for x in pair]
    head = tp.loss_moment(micro_batch, 2)
    return out + (list(head) if head else [])
