"""Trace the activation profiles shipped with memplan (presets x default settings), so that
`memplan estimate <preset>` with default sequence length never imports torch.

Run: python tools/ship_activation_profiles.py  (writes memplan/presets/activations/<key>.json)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memplan import activations as act  # noqa: E402
from memplan.errors import MemplanError  # noqa: E402
from memplan.model import sources  # noqa: E402
from memplan.tracing import trace_profile  # noqa: E402
from memplan.tracing_keys import LINEARS, trace_linear, trace_recipe  # noqa: E402

SEQ = (2048,)
RECIPES = ("deepspeed-bf16", "torch-amp")
RECOMPUTE = ("none", "full")


def linears(recipe: str) -> list[str]:
    """The linear autograds whose profiles differ on a GPU for this recipe (DeepSpeed ZeRO-3's under autocast)."""
    return sorted({trace_linear(lin, device="cuda", recipe=recipe) for lin in LINEARS})


def main() -> None:
    out = act.shipped_dir()
    out.mkdir(parents=True, exist_ok=True)
    wanted = {act.profile_key(sources.resolve(name).config, seq_len=seq, recipe=recipe, attention="flash",
                              recompute=rc, linear=lin)
              for name in sources.preset_names() for seq in SEQ for recipe in RECIPES for rc in RECOMPUTE
              for lin in linears(recipe)}
    for old in out.glob("*.json"):  # profiles under an earlier key or method are never looked up again
        if old.stem not in wanted:
            old.unlink()
    for name in sources.preset_names():
        config = sources.resolve(name).config
        for seq in SEQ:
            for recipe in RECIPES:
                for rc, lin in ((rc, lin) for rc in RECOMPUTE for lin in linears(recipe)):
                    key = act.profile_key(config, seq_len=seq, recipe=recipe, attention="flash", recompute=rc,
                                          linear=lin)
                    path = out / f"{key}.json"
                    if path.exists():
                        continue
                    t = time.perf_counter()
                    try:
                        data = trace_profile(config, seq_len=seq, recipe=trace_recipe(recipe), attention="flash",
                                             recompute=rc, linear=lin)
                    except MemplanError as exc:
                        print(f"{name} {recipe} {rc} {lin}: not traced: {exc}")
                        continue
                    data["model"] = name
                    path.write_text(json.dumps(data, indent=1) + "\n")
                    print(f"{name} seq {seq} {recipe} recompute {rc} linear {lin}: {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
