"""The activation profile: a config traced at two depths and two micro-batches, each timeline point a line
c0 + c1*b in the micro-batch, the upper envelopes kept."""

from __future__ import annotations

import json
from typing import Any

from memplan.activations import kernels as K
from memplan.errors import SettingsError
from memplan.activations.kernels import Target
from memplan.activations.profile_fit import envelopes
from memplan.activations.tracing.segments import alloc_events
from memplan.activations.tracing.step import one_step
from memplan.activations.tracing_keys import COMPILE_KEY, FLOAT8_KEY, PROFILE_VERSION, trace_dtypes




_HETEROGENEOUS_KEYS = ("first_k_dense_replace", "layer_types", "mlp_only_layers", "decoder_sparse_step",
                       "moe_layer_freq", "sliding_window_pattern")


def _line(a: int, b: int) -> list[int]:
    """The line c0 + c1*b through a value at micro-batch 2 and one at 4."""
    slope = (b - a) // 2
    if slope * 2 != b - a:
        raise SettingsError("traced activation bytes are not linear in the micro-batch; "
                            "use --activations analytic")
    return [a - 2 * slope, slope]


def _two_batches(config: dict[str, Any], depth: int | None, seq_len: int, recipe: str, attention: str,
                 recompute: str, target: Target, linear: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The step traced at micro-batch 2 and 4, at ``depth`` blocks (None: the config's own)."""
    from memplan.model.scaling import scale_config

    from memplan import progress

    cfg = scale_config(config, layers=depth)[0] if depth else config
    where = f"{depth} block(s)" if depth else "every block"
    progress.doing(f"micro-batch 2 at {where}")
    a = one_step(cfg, 2, seq_len, recipe, attention, recompute, target, linear)
    progress.step()
    progress.doing(f"micro-batch 4 at {where}")
    b = one_step(cfg, 4, seq_len, recipe, attention, recompute, target, linear)
    progress.step()
    if len(a["forward"]) != len(b["forward"]) or len(a["backward"]) != len(b["backward"]):
        raise SettingsError("the traced step runs different operations at micro-batch 2 and 4; "
                            "use --activations analytic")
    return a, b


def _block_points(seg_a: list[list[int]], seg_b: list[list[int]]) -> list[list[int]]:
    """One block's backward as per-operation points [c0, c1, g(, h)]: activations c0 + c1*b, the block's
    gradients so far g elements, and h those whose hook has not run yet where the trace records it
    (profile_fit.segment builds the envelopes from them)."""
    if len(seg_a) != len(seg_b) or any(x[1] != y[1] for x, y in zip(seg_a, seg_b)):
        raise SettingsError("the traced backward runs different operations at micro-batch 2 and 4; "
                            "use --activations analytic")
    pts = [_line(x[0], y[0]) + [x[1]] for x, y in zip(seg_a, seg_b)]
    if all(len(x) > 2 for x in seg_a):
        pts = [p + [x[2]] for p, x in zip(pts, seg_a)]
    return pts


def _first_hook(a: list[int] | None, b: list[int] | None) -> list[int] | None:
    """The first gradient hook's [c0, c1, gradient elements] from its two traced points (None where either has
    none, or where the hook's parameter differs between them)."""
    if a is None or b is None or a[1] != b[1]:
        return None
    return [*_line(a[0], b[0]), a[1]]


def _most(a: Any, b: Any) -> Any:
    """The larger of two counts, element by element (None where either is)."""
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            raise SettingsError("the traced step runs different operations at micro-batch 2 and 4; "
                                "use --activations analytic")
        return [_most(x, y) for x, y in zip(a, b)]
    return None if a is None or b is None else max(a, b)


def _hooks(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    if len(a) != len(b) or any(x[1] != y[1] for x, y in zip(a, b)):
        raise SettingsError("the traced backward runs different operations at micro-batch 2 and 4; "
                            "use --activations analytic")
    return [_line(x[0], y[0]) + [x[1]] for x, y in zip(a, b)]


def _layers(config: dict[str, Any]) -> int | None:
    """The config's blocks: a model of two stacks' together (an encoder-decoder's, a vision-language model's vision
    tower and language model: traced at full depth)."""
    if _two_stacks(config):
        from memplan.model.tasks import stacks

        return stacks(config)
    from memplan.model.config import layer_count

    return layer_count(config)


def _two_stacks(config: dict[str, Any]) -> bool:
    """Two stacks of blocks (model/tasks.py two_stacks): traced at full depth, no analytic counterpart."""
    from memplan.model.tasks import two_stacks

    return two_stacks(config)


def _heterogeneous(config: dict[str, Any], layers: int, recompute: str = "none") -> bool:
    """Blocks that differ are traced at full depth; a one-block model too (there is no second depth to
    subtract); and every:N / layer-sac:N recompute, whose checkpointed blocks alternate with kept ones."""
    from memplan.activations.profile import checkpoint_every

    if (checkpoint_every(recompute) or 1) > 1:
        return True
    # the user's own module (a factory) has no config to scale: traced at its own depth
    # LoRA on some layers only (layers_to_transform) makes the blocks differ
    lora_layers = bool((config.get("lora") or {}).get("layers_to_transform"))
    # two stacks' blocks are of two kinds (an encoder-decoder's decoder attends to the encoder's output too)
    from memplan.model.scaling import layer_index_keys, per_layer_keys, varied_index_keys

    # a per-layer list whose entries differ (mlp_layer_types: dense then sparse; a hybrid's attention kinds)
    varied = any(len({json.dumps(x, sort_keys=True) for x in config[k]}) > 1 for k in per_layer_keys(config, layers))
    # a list of the layers built otherwise (Mllama's cross-attention layers, Llama 4's MoE layers), some not all;
    # Llama 4's moe_layers made from interleave_moe_layer_step where the config gives none (configuration_llama4.py)
    varied = varied or bool(layer_index_keys(config)) or bool(varied_index_keys(config, layers)) or (
        config.get("moe_layers") is None and isinstance(config.get("interleave_moe_layer_step"), int)
        and config["interleave_moe_layer_step"] > 1)
    # decoder_sparse_step 1: every block sparse ((layer_idx + 1) % 1 == 0 in Qwen2-MoE, Qwen3-MoE, Qwen3-VL-MoE
    # and their kin; Switch's ``sparse_step == 1``), the blocks alike unless mlp_only_layers names some
    keys = [k for k in _HETEROGENEOUS_KEYS if config.get(k) and not (k == "decoder_sparse_step" and config[k] == 1)]
    return layers < 2 or bool(config.get("factory")) or lora_layers or _two_stacks(config) or varied or bool(keys)


def traced_steps(config: dict[str, Any], recompute: str = "none") -> int:
    """How many micro-steps trace_profile runs: two micro-batches at one depth, or at two."""
    layers = _layers(config)
    return 2 if layers is None or _heterogeneous(config, layers, recompute) else 4


def trace_profile(config: dict[str, Any], *, seq_len: int, recipe: str, attention: str,
                  recompute: str, device: str = "cuda", linear: str = "aten",
                  target: Target | None = None) -> dict[str, Any]:
    """The activation profile of one micro-step at ``seq_len``, as lines c0 + c1*b in the micro-batch b.

    Traced with 1 and 2 blocks (all blocks alike) or at full depth (blocks that differ: dense then MoE,
    sliding then global attention), each for b = 2 and b = 4 (b = 1 takes shortcuts such as squeezes, so its
    timeline has other operations). Every timeline point is a line in b; what does not scale with the batch
    (autocast's weight copies, a tied embedding's partial gradient) lands in c0. A model of L blocks adds
    (L - traced) x the per-block bytes to every peak: exact when the peak falls while every block's activations
    are alive (forward end, loss, early backward), an upper bound when it falls late in backward.
    """
    from memplan import progress

    progress.doing("importing torch and transformers")
    import transformers

    if trace_dtypes(recipe) is None:
        raise SettingsError(f"cannot trace activations for precision {recipe}")
    target = target or K.host_target(device)
    layers = _layers(config)
    if layers is None:
        raise SettingsError("the config has no layer count" + ("" if _two_stacks(config) else
                                                                 "; use --activations analytic"))
    heterogeneous = _heterogeneous(config, layers, recompute)
    compiled = config.get(COMPILE_KEY, "none") != "none"
    # a compiled or float8 step has no analytic counterpart to suggest
    no_analytic = compiled or bool(config.get(FLOAT8_KEY))

    try:
        run = (lambda depth: _two_batches(config, depth, seq_len, recipe, attention, recompute, target, linear))
        third = None
        if heterogeneous:
            top = run(None)
            low = None
        else:
            low, top = run(1), run(2)
            if config.get("lora") and layers > 2:
                # the first block's input needs no gradient when the embedding is frozen, so its forward saves
                # less than the others' (autograd records nothing on it before the adapters): its allocations
                # cannot stand for the blocks after it. Three traced blocks give the reserved-peak replay a first,
                # a middle and a last one (memplan/replay.py repeats the middle)
                third = run(3)
    except SettingsError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise SettingsError(f"tracing activations failed ({type(exc).__name__}: {first[:200]})"
                            + ("" if _two_stacks(config) or no_analytic else "; use --activations analytic")) from None

    out = _profile(top, low, seq_len=seq_len, recipe=recipe, attention=attention, recompute=recompute,
                   device=device, target=target, layers=layers, heterogeneous=heterogeneous,
                   transformers_version=transformers.__version__, third=third)
    if compiled:
        out["compile"] = config[COMPILE_KEY]  # torch.compile's mode (tracing/compiled.py)
    if config.get(FLOAT8_KEY):
        out["float8"] = config[FLOAT8_KEY]  # torchao's float8 recipe (tracing/float8.py)
    return out


def _profile(top: tuple[dict[str, Any], dict[str, Any]], low: tuple[dict[str, Any], dict[str, Any]] | None, *,
             seq_len: int, recipe: str, attention: str, recompute: str, device: str, target: Target, layers: int,
             heterogeneous: bool, transformers_version: str,
             third: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The profile from the step traced at micro-batch 2 and 4 (``top``; ``low``: one block fewer, or None;
    ``third``: three blocks, for the allocation events where the first block is unlike the others)."""
    def lines(key: str) -> list[list[int]]:
        return [_line(a, b) for a, b in zip(top[0][key], top[1][key])]

    live = _line(top[0]["live"], top[1]["live"])
    per_layer = [0, 0] if low is None else [x - y for x, y in zip(live, _line(low[0]["live"], low[1]["live"]))]

    segs = [_block_points(x, y) for x, y in zip(top[0]["blocks"], top[1]["blocks"])]
    hk = [_hooks(x, y) for x, y in zip(top[0]["hooks"], top[1]["hooks"])]
    # each timeline point as a line in the micro-batch: the envelopes below are rebuilt from these, at this
    # length or at another one fitted from several (memplan/activations/profile_fit.py)
    raw = {"forward": lines("forward"), "backward": lines("backward"),
           "last_block_forward": lines("last_block_forward") if top[0]["last_block_forward"] else [],
           "blocks": segs[:2], "hooks": hk[:2], "first": segs[-1] if segs else None,
           # traced at full depth, the second block (index 1) apart: FSDP's moment inside its backward
           # (frameworks/fsdp2.py _inside_second); two alike traced blocks give it from the one before the last
           **({"second": segs[-2]} if heterogeneous and len(segs) >= 4 else {}),
           # traced at full depth, every point of the backward with the gradients made by then (step.backward_grads):
           # where blocks differ (a vision tower's and a language model's, an encoder's and a decoder's) the most
           # alive need not fall inside the last, the one before it, the first or the second block
           **({"any": _block_points(top[0]["backward_grads"], top[1]["backward_grads"])}
              if heterogeneous and len(segs) >= 4 else {}),
           "first_hooks": hk[-1] if segs and hk else None,
           "loss": _block_points(top[0]["loss_backward"], top[1]["loss_backward"])}
    # how many storages each point's bytes are made of (the larger of the two runs'): a profile fitted at another
    # length bounds the allocator's 512-byte rounding with it (profile_fit._round_up_margin)
    ca, cb = top[0]["counts"], top[1]["counts"]
    n = {k: _most(ca[k], cb[k]) for k in ("saved", "live", "root_hooks_done", "last_block_forward_start")}
    n["root_first_hook"] = _most(*((x or [None])[0] for x in (ca["root_first_hook"], cb["root_first_hook"])))
    n.update(forward=_most(ca["forward"], cb["forward"]), backward=_most(ca["backward"], cb["backward"]),
             last_block_forward=(_most(ca["last_block_forward"], cb["last_block_forward"])
                                 if raw["last_block_forward"] else []),
             blocks=[_most(x, y) for x, y in zip(ca["blocks"], cb["blocks"])][:2],
             first=_most(ca["blocks"][-1], cb["blocks"][-1]) if ca["blocks"] else None,
             **({"second": _most(ca["blocks"][-2], cb["blocks"][-2])} if "second" in raw else {}),
             **({"any": _most(ca["backward_grads"], cb["backward_grads"])} if "any" in raw else {}),
             hooks=[_most(x, y) for x, y in zip(ca["hooks"], cb["hooks"])][:2],
             first_hooks=_most(ca["hooks"][-1], cb["hooks"][-1]) if ca["blocks"] and ca["hooks"] else None,
             loss=_most(ca["loss_backward"], cb["loss_backward"]),
             per_layer=0 if low is None else max(0, _most(ca["live"], cb["live"]) - min(low[0]["counts"]["live"],
                                                                                        low[1]["counts"]["live"])))
    raw["n"] = n
    env = envelopes(raw)
    return {
        "version": PROFILE_VERSION,
        "seq_len": seq_len, "recipe": recipe, "attention": attention, "recompute": recompute, "device": device,
        "target": target.key,
        "num_layers": layers, "traced_layers": layers if heterogeneous else 2,
        "live_after_forward": live,  #: at the traced depth
        "per_layer": per_layer,  #: one more block (zero when traced at full depth)
        "saved_for_backward": _line(top[0]["saved"], top[1]["saved"]),
        "forward_peak": env["forward_peak"],
        "backward_peak": env["backward_peak"],
        #: the last and the one-before-last block's backward with their own gradients (see _block_segments)
        "block_backward": env["block_backward"],
        #: the first block's backward (the last to run), with no block below it
        "first_block_backward": env["first_block_backward"],
        **({"second_block_backward": env["second_block_backward"]} if "second_block_backward" in env else {}),
        #: traced at full depth: every point of the backward with the gradients made by then (step.backward_grads)
        **({"any_block_backward": env["any_block_backward"]} if "any_block_backward" in env else {}),
        #: the loss's and the head's backward with the gradients of the parameters outside the blocks (see
        #: _loss_segment), every block's saved activations below it
        "loss_backward": env["loss_backward"],
        #: live bytes at the last hook of a parameter outside the blocks before them (see _root_hooks_done)
        "root_hooks_done": (_line(top[0]["root_hooks_done"], top[1]["root_hooks_done"])
                            if top[0]["root_hooks_done"] is not None and top[1]["root_hooks_done"] is not None
                            else None),
        #: [c0, c1, g] at the backward's first gradient hook: live bytes c0 + c1 * micro-batch, and g gradient
        #: elements of parameters outside the blocks made by then (see segments.root_first_hook)
        "root_first_hook": _first_hook(top[0]["root_first_hook"], top[1]["root_first_hook"]),
        #: live bytes when the last block's forward begins (everything before it saved, nothing of the loss)
        "last_block_forward_start": _line(top[0]["last_block_forward_start"], top[1]["last_block_forward_start"]),
        #: the most live during the last block's forward (its own activations and temporaries)
        "last_block_forward_peak": env["last_block_forward_peak"],
        #: the SDPA kernels the step ran ("fused", "math") and why the math one
        "attention_kernels": top[0]["attention_kernels"],
        #: the dtypes of the floating-point tensors the blocks were given: FSDP2's cast of each unit's inputs to
        #: bf16 copies nothing where bfloat16 is all there is (options._activations)
        "block_float_inputs": sorted(set(top[0]["block_float_inputs"]) | set(top[1]["block_float_inputs"])),
        #: the parameters that require a gradient and got none in the traced step (step.one_step), named in the
        #: traced model, and its blocks' names: model/freeze.py traced_unreached maps them onto the whole model
        "unreached": sorted(set(top[0]["unreached"]) | set(top[1]["unreached"])),
        "traced_blocks": top[0]["origins"]["blocks"],
        #: the step's storages in order, for the caching allocator (see _alloc_events; None: not linear in b)
        "alloc_events": alloc_events(*(third or top), expand=not heterogeneous),
        #: what is alive at the moments the phases peak, grouped by module and operator (--explain)
        "explain": _explain(top),
        #: the per-operation lines the envelopes are made of (memplan/activations/profile_fit.py)
        "raw": raw,
        "transformers": transformers_version,
    }


def _explain(top: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    """Per explained moment (memplan/activations/tracing/explain.py), the groups alive then as lines in the micro-batch; the
    moments are picked on the micro-batch 4 trace (both traces run the same operations, so an index is the same
    point of the step in each)."""
    from memplan.activations.tracing import explain as X

    o2, o4 = top[0]["origins"], top[1]["origins"]
    t2, t4 = o2["timeline"], o4["timeline"]
    ticks = X.moment_ticks(t2, t4, len(top[1]["forward"]), o4["last_backward_start"])
    out: dict[str, Any] = {}
    for moment in X.MOMENTS:
        points = []
        for t in ticks[moment]:
            a, b = (X.composition(o["origins"], o["grads"], o["saved"], t, o["blocks"]) for o in (o2, o4))
            groups = X.lines(a, b)
            line = _line(t2[t], t4[t])
            # what the kept groups leave out of the point: smaller groups (past X.KEEP), and bytes the timeline
            # counts as gradients from a moment other than their storage's birth (a parameter's gradient
            # contributions, see step.first_contributions)
            rest = [line[0] - sum(g["line"][0] for g in groups), line[1] - sum(g["line"][1] for g in groups)]
            points.append({"line": line, "groups": groups, "rest": rest})
        out[moment] = points
    return out
