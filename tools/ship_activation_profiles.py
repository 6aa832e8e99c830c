"""Trace the activation profiles shipped with memplan (presets x default settings x the main GPU kernel classes),
so that `memplan estimate <preset>` with default sequence length never imports torch on an H100/H200/B200 or an
A100 (other GPU classes trace on first use).

Run: python tools/ship_activation_profiles.py [PRESET ...]  (writes memplan/presets/activations/<key>.json.gz)

Each preset is traced at the default length and at the lengths a profile at any other length is fitted from
(memplan/activations/profile_fit.py fit_seqs: 512 to 8192 and the model's maximum), so that `--seq-len N` never traces either.

A GPU class whose profile holds the same bytes as another's is stored as {"alias": "<key>", "target": ...,
"attention_kernels": ...}: the first's numbers with its own kernels' names.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memplan.activations import profile_cache  # noqa: E402
from memplan.errors import MemplanError  # noqa: E402
from memplan.activations.kernels import Target  # noqa: E402
from memplan.model import sources  # noqa: E402
from memplan.activations.profile_fit import fit_seqs, pack  # noqa: E402
from memplan.activations.tracing import trace_profile  # noqa: E402
from memplan.activations.tracing_keys import LINEARS, trace_linear, trace_recipe  # noqa: E402

#: the default length, and those a profile at any other length is fitted from (memplan/activations/profile_fit.py fit_seqs)
DEFAULT_SEQ = 2048
RECIPES = ("deepspeed-bf16", "torch-amp")
RECOMPUTE = ("none", "full")


#: the GPU classes shipped: sm90 (H100, H200, B200: the default) and sm80 (A100). Others (sm86: A10G, L40S,
#: RTX 4090; sm70: V100; ROCm) trace on first use and are cached.
SHIPPED_ARCHS = ("sm90", "sm80")


def targets() -> list[Target]:
    """One target per shipped SDPA class, the default (sm90) first."""
    return [Target(device="cuda", arch=a) for a in SHIPPED_ARCHS]


def linears(recipe: str) -> list[str]:
    """The linear autograds whose profiles differ on a GPU for this recipe (DeepSpeed ZeRO-3's under autocast)."""
    return sorted({trace_linear(lin, device="cuda", recipe=recipe) for lin in LINEARS})


def _same(a: dict, b: dict) -> bool:
    """The same bytes everywhere (the kernels' names and the target may differ)."""
    skip = ("target", "model", "attention_kernels")
    return {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def main() -> None:
    out = profile_cache.shipped_dir()
    out.mkdir(parents=True, exist_ok=True)
    names = sources.preset_names()
    only = set(sys.argv[1:])  # trace only these presets (e.g. to run two processes); stale files are kept then
    # the default length first (what `memplan estimate <preset>` reads), then the fitting grid
    seqs = {n: [DEFAULT_SEQ] + sorted(set(fit_seqs(sources.resolve(n).config)) - {DEFAULT_SEQ}) for n in names}
    jobs = [(name, seq, recipe, rc, lin) for name in names for seq in seqs[name] for recipe in RECIPES
            for rc in RECOMPUTE for lin in linears(recipe)]
    key = lambda cfg, seq, recipe, rc, lin, tg: profile_cache.profile_key(  # noqa: E731
        cfg, seq_len=seq, recipe=recipe, attention="flash", recompute=rc, linear=lin, target=tg)
    wanted = {key(sources.resolve(n).config, seq, r, rc, lin, tg) for n, seq, r, rc, lin in jobs for tg in targets()}
    for old in list(out.glob("*.json")) + list(out.glob("*.json.gz")):  # earlier keys are never looked up again
        if old.name.split(".")[0] not in wanted and not only:
            old.unlink()
    for name, seq, recipe, rc, lin in jobs:
        if only and name not in only:
            continue
        config = sources.resolve(name).config
        first: tuple[str, dict] | None = None
        for tg in targets():
            k = key(config, seq, recipe, rc, lin, tg)
            path = out / f"{k}.json"
            packed = out / f"{k}.json.gz"
            if path.exists() or packed.exists():
                data = profile_cache._read_profile(out, k)
                if "alias" not in data and first is None:
                    first = (k, data)
                continue
            t = time.perf_counter()
            try:
                data = trace_profile(config, seq_len=seq, recipe=trace_recipe(recipe), attention="flash",
                                     recompute=rc, linear=lin, target=tg)
            except MemplanError as exc:
                print(f"{name} {recipe} {rc} {lin} {tg.key}: not traced: {exc}")
                continue
            data["model"] = name
            if first is not None and _same(first[1], data):
                path.write_text(json.dumps({"alias": first[0], "target": data["target"],
                                            "attention_kernels": data["attention_kernels"]}) + "\n")
                how = f"same as {first[0]}"
            else:
                # gzip: the allocation events of a model traced at full depth run to megabytes as text
                with gzip.open(packed, "wt", compresslevel=9) as f:
                    f.write(json.dumps(pack(data), separators=(",", ":")))
                first = first or (k, data)
                how = "stored"
            print(f"{name} seq {seq} {recipe} recompute {rc} linear {lin} {tg.key}: {time.perf_counter() - t:.1f} s, "
                  f"{how}", flush=True)


if __name__ == "__main__":
    main()
