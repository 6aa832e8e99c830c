"""The traced activation profiles on disk: the shipped set (memplan/presets/activations), the user's cache
(MEMPLAN_CACHE_DIR, else ~/.cache/memplan), their keys and a new trace when neither has one. The format's
version (tracing_keys.PROFILE_VERSION) is part of every key."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from memplan.activations.profile import TracedProfile
from memplan.errors import SettingsError
from memplan.activations.tracing_keys import PROFILE_VERSION, TRACE_REVISION


def cache_dir() -> Path:
    base = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memplan")
    return Path(base) / "activations"


def shipped_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "presets" / "activations"


def profile_key(config: dict, *, seq_len: int, recipe: str, attention: str, recompute: str,
                device: str = "cuda", linear: str = "aten", target: Any = None) -> str:
    """Cache key: the config, the sequence length, the traced dtype recipe, attention, recompute, the target
    device's kernel class (kernels.Target.key: a GPU's SDPA dispatch class, a CPU's instruction set) and the
    linear's autograd where it changes the bytes (tracing_keys.trace_linear; absent for aten's)."""
    from memplan.activations.kernels import host_target
    from memplan.activations.tracing_keys import trace_linear, trace_recipe

    target = target or host_target(device)
    fields = {"config": {k: v for k, v in config.items() if not k.startswith("_")}, "seq": seq_len,
              "recipe": trace_recipe(recipe), "attention": "flash" if attention == "sdpa" else attention,
              "recompute": recompute, "device": target.key, "v": PROFILE_VERSION}
    linear = trace_linear(linear, device=device, recipe=recipe)
    if linear != "aten":
        fields["linear"] = linear
    from memplan.model.tasks import CAUSAL_LM, task_of

    if "factory" not in config and task_of(config) != CAUSAL_LM:
        # a head other than a causal LM's: traced with its own loss since PROFILE_VERSION 20 (the key changes so
        # that a profile traced before, as a causal LM, is not read)
        fields["task"] = task_of(config)
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load_or_trace(config: dict, *, seq_len: int, micro_batch: int, recipe: str, attention: str, recompute: str,
                  allow_trace: bool = True, device: str = "cuda", linear: str = "aten",
                  target: Any = None) -> TracedProfile | None:
    """The traced profile from the shipped set, the disk cache, or a new trace (imports torch); None when
    ``allow_trace`` is False and nothing is cached."""
    from memplan.activations.kernels import host_target

    target = target or host_target(device)
    key = profile_key(config, seq_len=seq_len, recipe=recipe, attention=attention, recompute=recompute,
                      device=device, linear=linear, target=target)
    found = _stored(key)
    if found is not None:
        data, origin = found
        if data.get("fitted_from"):  # a fit made before, kept in the cache
            origin = f"{data.get('fitted_origin', 'traces')}, kept in the cache"
        return TracedProfile(data, micro_batch, origin)
    fitted = _fitted(config, seq_len=seq_len, recipe=recipe, attention=attention, recompute=recompute,
                     device=device, linear=linear, target=target)
    if fitted is not None:
        data, origin = fitted
        # kept: the next estimate at this length reads it (a model traced at full depth takes ~1 s to fit)
        from memplan.activations.profile_fit import pack

        _write_atomic(cache_dir() / f"{key}.json", json.dumps(pack({**data, "fitted_origin": origin,
                                                                    "trace_revision": TRACE_REVISION})))
        return TracedProfile(data, micro_batch, origin)
    if not allow_trace:
        return None
    failed = cache_dir() / f"{key}.failed"
    if failed.is_file():
        # this configuration could not be traced before (same transformers, torch and memplan: the key and the
        # versions recorded in the file); say why again instead of spending seconds failing again
        try:
            record = json.loads(failed.read_text())
            if record.get("versions") == _versions():
                raise SettingsError(record["reason"])
        except (OSError, ValueError, KeyError):
            pass
    from memplan import progress
    from memplan.activations.tracing import trace_profile
    from memplan.activations.tracing.fit import traced_steps
    from memplan.activations.tracing_keys import trace_linear, trace_recipe

    dtypes = recipe if trace_recipe(recipe) == recipe else f"{recipe}, traced in {trace_recipe(recipe)}'s dtypes"
    what = (f"tracing {config.get('model_type') or 'the model'}'s activations at seq {seq_len} "
            f"({dtypes}, recompute {recompute}; once, then cached)")
    args = dict(seq_len=seq_len, recipe=trace_recipe(recipe), attention="flash" if attention == "sdpa" else attention,
                recompute=recompute, device=device, linear=trace_linear(linear, device=device, recipe=recipe),
                target=target)
    try:
        if config.get("factory"):  # the user's own module: traced in a child process (model/factory_child.py)
            from memplan.model import factory_child

            with progress.task(what):
                data = factory_child.run("trace", {"config": config, **args}, config["factory"])
        else:
            with progress.task(what, total=traced_steps(config, recompute)):
                data = trace_profile(config, **args)
    except SettingsError as exc:
        _write_atomic(failed, json.dumps({"reason": str(exc), "versions": _versions()}))
        raise
    from memplan.activations.profile_fit import pack

    _write_atomic(cache_dir() / f"{key}.json", json.dumps(pack({**data, "trace_revision": TRACE_REVISION})))
    return TracedProfile(data, micro_batch, "traced now")


#: profiles read in this process, by key and directory (a search resolves the same configuration many times)
_READ: dict[tuple[str, str], tuple[dict, str]] = {}


def _stored(key: str) -> tuple[dict, str] | None:
    """(profile, origin) from the shipped set or the disk cache; None when neither has it."""
    memo = (key, str(cache_dir()))
    hit = _READ.get(memo)
    if hit is not None:
        return hit
    found = _stored_on_disk(key)
    if found is not None:
        if len(_READ) > 512:
            _READ.clear()
        _READ[memo] = found
    return found


def _stored_on_disk(key: str) -> tuple[dict, str] | None:
    for where, origin in ((shipped_dir(), "shipped"), (cache_dir(), "cache")):
        try:
            data = _read_profile(where, key)
        except (OSError, ValueError, TypeError, EOFError):
            continue
        if data is not None and origin == "cache":
            if data.get("trace_revision") != TRACE_REVISION:
                continue  # traced by an earlier revision of the tracing: traced again
            data = {k: v for k, v in data.items() if k != "trace_revision"}
        if data is not None:
            if "alias" in data:  # the same bytes as another target's profile (tools/ship_activation_...)
                own = {k: v for k, v in data.items() if k != "alias"}
                try:
                    base = _read_profile(where, data["alias"])
                except (OSError, ValueError, TypeError, EOFError):
                    base = None
                if base is None:
                    continue
                data = {**base, **own}
            return data, origin
    return None


def _fitted(config: dict, *, seq_len: int, **kw: Any) -> tuple[dict, str] | None:
    """A profile at ``seq_len`` fitted from the same configuration's profiles at other lengths (shipped at
    profile_fit.fit_seqs for every preset, or cached from earlier traces), without tracing: (profile, origin),
    or None where no three around it are stored or they differ in more than their numbers. Only the profiles a
    fit tries are read."""
    from memplan.activations.profile_fit import fit_profile, fit_seqs

    keys = {s: profile_key(config, seq_len=s, **kw) for s in fit_seqs(config) if s != seq_len}
    present = {s: k for s, k in keys.items() if _exists(k)}
    if len(present) < 3:
        return None
    origins: set[str] = set()
    data = fit_profile(_LazyProfiles(present, {}, origins), seq_len)
    if data is None:
        return None
    src = "shipped" if origins == {"shipped"} else "shipped and cached" if "shipped" in origins else "cached"
    return data, f"{src} traces at seq {', '.join(map(str, data['fitted_from']))}"


class _LazyProfiles(dict):
    """length -> profile, read from disk the first time it is asked for (the keys: the lengths stored)."""

    def __init__(self, present: dict[int, str], loaded: dict[int, dict | None], origins: set[str]) -> None:
        super().__init__()
        self._present, self._loaded, self._origins = present, loaded, origins

    def __iter__(self):  # type: ignore[override]
        return iter(self._present)

    def __len__(self) -> int:
        return len(self._present)

    def __contains__(self, s: object) -> bool:
        return s in self._present

    def keys(self):  # type: ignore[override]
        return self._present.keys()

    def __getitem__(self, s: int) -> dict | None:  # type: ignore[override]
        if s not in self._loaded:
            found = _stored(self._present[s])
            if found is not None:
                self._origins.add(found[1])
            self._loaded[s] = found[0] if found is not None else None
        return self._loaded[s]


def _exists(key: str) -> bool:
    return any((where / f"{key}{ext}").is_file() for where in (shipped_dir(), cache_dir())
               for ext in (".json", ".json.gz"))


def _read_profile(where: Path, key: str) -> dict | None:
    """A profile stored as <key>.json, or gzip-compressed as <key>.json.gz (the shipped ones: their allocation
    events are long); None when neither is there."""
    path = where / f"{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    path = where / f"{key}.json.gz"
    if path.is_file():
        import gzip

        with gzip.open(path, "rt") as f:
            return json.loads(f.read())
    return None


def _versions() -> dict[str, str]:
    """What a trace's outcome depends on besides the key (only called when tracing: torch is imported then)."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trace_revision": TRACE_REVISION}


def _write_atomic(path: Path, text: str) -> None:
    """The cache file through a temporary file beside it and a rename (inputs.write_atomic: never a half-written
    file, never into a FIFO or a device found at its name); a cache that cannot be written is skipped (a read-only
    home: trace again next time)."""
    from memplan.inputs import write_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, "profile cache file")
    except (OSError, SettingsError):
        pass
