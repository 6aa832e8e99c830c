"""Model sources, resolved in one place.

A model argument is, in this order of precedence:
1. a preset name (``memplan presets``), e.g. ``llama-7b``;
2. a path to a config.json file;
3. a model directory holding config.json, and possibly safetensors files (headers read, weights never loaded;
   ``model.safetensors.index.json`` shards included);
4. a Hugging Face repo id (``org/name``) found in the local HF cache — offline only, never the network;
5. a Python factory ``pkg.module:callable`` returning an ``nn.Module`` (built on the meta device).

Nothing here imports torch; only the factory and the meta builder do, lazily.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import struct
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from memplan.errors import ConfigError, ModelSourceError
from memplan.inputs import quote
from memplan.model import families
from memplan.model.config import check_config
from memplan.model.inventory import ParamInventory, ParamTensor
from memplan.units import SAFETENSORS_DTYPES

#: Short names that resolve to a preset file of another name.
PRESET_ALIASES = {"llama-7b": "llama-2-7b", "llama-13b": "llama-2-13b", "llama-70b": "llama-2-70b",
                  "llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b", "llama-405b": "llama-3.1-405b"}

#: safetensors' own parser refuses headers above 100,000,000 bytes (safetensors/src/tensor.rs, MAX_HEADER_SIZE).
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
#: A config.json is a few kilobytes; anything this large is not one.
MAX_CONFIG_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class CheckpointTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: str  #: preset | config | directory | hf-cache | factory
    description: str  #: human-readable origin, shown in output
    config: dict[str, Any] | None = None
    path: Path | None = None
    checkpoint: tuple[CheckpointTensor, ...] = ()
    factory: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def presets_dir() -> Path:
    return Path(str(resources.files("memplan") / "presets"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in (presets_dir() / "models").glob("*.json"))


@dataclass(frozen=True, kw_only=True)
class GpuPreset:
    """A GPU preset (memplan/presets/gpus/NAME.json), checked when it loads: every figure a positive integer with
    the source it was read from."""

    id: str
    name: str
    nominal: str
    usable_bytes: int  #: the driver's memory.total (nvidia-smi)
    source: str
    note: str
    arch: str  #: sm80, sm90, ... (CUDA) or gfx942 (ROCm): the kernels' and the cuBLAS workspace's rules
    blas_workspace_bytes: int  #: PyTorch's default cuBLAS workspace per handle on this architecture
    blas_workspace_source: str
    multiprocessors: int
    max_threads_per_multiprocessor: int
    multiprocessors_source: str
    #: torch.cuda.mem_get_info's total, where measured: the capacity PyTorch's allocator works within
    torch_total_bytes: int | None = None
    torch_total_source: str | None = None

    @classmethod
    def load(cls, path: Path) -> GpuPreset:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ConfigError(f"GPU preset {path.name} must hold a JSON object")
        known = {f for f in cls.__dataclass_fields__ if f != "id"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"GPU preset {path.name}: unknown field(s) {', '.join(unknown)}")
        for f, spec in cls.__dataclass_fields__.items():
            if f == "id" or (f not in data and spec.default is None):
                continue
            v = data.get(f)
            want_int = f.endswith("_bytes") or f in ("multiprocessors", "max_threads_per_multiprocessor")
            if want_int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"GPU preset {path.name}: {f} must be a positive integer, got {quote(v)}")
            if not want_int and (not isinstance(v, str) or not v):
                raise ConfigError(f"GPU preset {path.name}: {f} must be a non-empty string, got {quote(v)}")
        if ("torch_total_bytes" in data) != ("torch_total_source" in data):
            raise ConfigError(f"GPU preset {path.name}: torch_total_bytes and torch_total_source go together")
        if data.get("torch_total_bytes", 0) > data["usable_bytes"]:
            raise ConfigError(f"GPU preset {path.name}: torch_total_bytes is more than usable_bytes")
        if not re.fullmatch(r"sm\d{2,3}|gfx\d+[a-z]?", data["arch"]):
            raise ConfigError(f"GPU preset {path.name}: arch {quote(data['arch'])} is not smNN or gfxNNN")
        return cls(id=path.stem, **data)

    @property
    def capacity(self) -> tuple[int, str]:
        """The capacity verdicts compare with: what torch reports where it was measured, else the driver's
        memory.total; and which of the two it is ("torch" or "nvidia-smi")."""
        if self.torch_total_bytes is not None:
            return self.torch_total_bytes, "torch"
        return self.usable_bytes, "nvidia-smi"

    def to_json(self) -> dict[str, Any]:
        """The preset's fields as its file gives them, with its id (``memplan presets --json``)."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


def gpu_presets() -> dict[str, GpuPreset]:
    """Every GPU preset by id (cached: read once per process)."""
    global _GPU_PRESETS
    if _GPU_PRESETS is None:
        _GPU_PRESETS = {p.stem: GpuPreset.load(p) for p in sorted((presets_dir() / "gpus").glob("*.json"))}
    return _GPU_PRESETS


_GPU_PRESETS: dict[str, GpuPreset] | None = None


def read_config(path: Path) -> dict[str, Any]:
    """Read and check a config.json: exists, not empty, a JSON object with a model_type."""
    from memplan.inputs import load_json, read_text

    text = read_text(path, "config", MAX_CONFIG_BYTES)
    if not text:
        raise ConfigError(f"{path} is empty")
    data = load_json(text, path, "config.json")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(data).__name__}")
    if "model_type" not in data:
        raise ConfigError(f"{path} has no 'model_type' field (required to know the architecture)")
    return data


def read_safetensors_header(path: Path) -> list[CheckpointTensor]:
    """Tensor names, shapes and dtypes from a .safetensors header; the weights are never read.

    Format: 8-byte little-endian header length N, then N bytes of JSON. N is checked against the file size and
    a hard cap before anything is read.
    """
    import stat as _stat

    try:
        st = path.stat()
        if not _stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path} is not a regular file")
        size = st.st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"{path} is too short to be a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            # the length is the file's own bytes: it is checked, never echoed (the file may not be a checkpoint)
            if n > MAX_SAFETENSORS_HEADER_BYTES:
                raise ConfigError(f"{path}: not a safetensors file (its header length exceeds the "
                                  f"{MAX_SAFETENSORS_HEADER_BYTES}-byte limit)")
            if n > size - 8:
                raise ConfigError(f"{path}: not a safetensors file (its header length is larger than the file)")
            raw = f.read(n)
    except OSError as exc:
        raise ModelSourceError(f"cannot read {path}: {exc.strerror or exc}") from exc
    from memplan.inputs import load_json

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: safetensors header is not valid JSON (not UTF-8)") from None
    header = load_json(text, f"{path}: safetensors header", "safetensors header")
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: safetensors header is not a JSON object")
    return _header_tensors(header, path, size - 8 - n)


def _header_tensors(header: dict[str, Any], path: Path, data_bytes: int) -> list[CheckpointTensor]:
    """The header's tensors, validated as the safetensors library validates them (safetensors/src/tensor.rs
    Metadata::validate): a known dtype, a shape of non-negative integers, data_offsets [begin, end] that tile the
    data buffer in order without gaps or overlaps and hold exactly shape x dtype bytes, inside the file. A file
    cut after its header (a header-only copy of a checkpoint, which is all memplan reads) is accepted."""
    from memplan.units import dtype_bytes

    out, spans = [], []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or "shape" not in info or "dtype" not in info:
            raise ConfigError(f"{path}: safetensors entry {quote(name)} lacks shape/dtype")
        raw_dtype = info["dtype"]
        dtype = SAFETENSORS_DTYPES.get(raw_dtype) if isinstance(raw_dtype, str) else None
        if dtype is None:
            raise ConfigError(f"{path}: tensor {quote(name)} has an unknown dtype {quote(str(raw_dtype)[:40])}")
        shape = info["shape"]
        if (not isinstance(shape, list) or len(shape) > 64
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in shape)):
            raise ConfigError(f"{path}: tensor {quote(name)} has an invalid shape {str(shape)[:60]}")
        nbytes = dtype_bytes(dtype)
        for x in shape:
            nbytes *= x
        offsets = info.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)):
            raise ConfigError(f"{path}: tensor {quote(name)} has invalid data_offsets")
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != nbytes or (data_bytes and end > data_bytes):
            raise ConfigError(f"{path}: tensor {quote(name)}: data_offsets [{begin}, {end}] do not hold its "
                              f"{nbytes:,} bytes inside the file's {data_bytes:,}-byte data")
        spans.append((begin, end, name))
        out.append(CheckpointTensor(name, tuple(shape), dtype, path.name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ConfigError(f"{path}: tensor {quote(name)} {'overlaps another' if begin < at else 'leaves a gap'} "
                              "in the data buffer (data_offsets must tile it)")
        at = end
    return out


def _read_checkpoint(directory: Path) -> tuple[CheckpointTensor, ...]:
    index = directory / "model.safetensors.index.json"
    files: list[Path]
    if index.exists() or index.is_symlink():  # read_text refuses a FIFO or a device before it is opened
        try:
            from memplan.inputs import load_json, read_text

            weight_map = load_json(read_text(index, "safetensors index", MAX_CONFIG_BYTES), index,
                                   "safetensors index")["weight_map"]
            names = set(weight_map.values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ConfigError(f"{index} is not a valid safetensors index (needs a 'weight_map' object)") from exc
        for f in names:
            # shards are files of this directory: a name that is absolute or climbs out of it is refused before
            # anything is opened (a symlinked shard, as in the Hugging Face cache, is fine)
            if not isinstance(f, str) or not f or Path(f).is_absolute() or ".." in Path(f).parts:
                raise ConfigError(f"{index}: shard {quote(str(f)[:80])} is not a file inside {directory}")
        files = sorted(directory / f for f in names)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelSourceError(f"{index} names shards that are missing: {', '.join(missing[:3])}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    tensors: list[CheckpointTensor] = []
    for f in files:
        tensors.extend(read_safetensors_header(f))
    return tuple(tensors)


def _hf_cache_dirs() -> list[Path]:
    dirs = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]))
    home = os.environ.get("HF_HOME")
    dirs.append(Path(home) / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


#: a repo id as the Hugging Face hub takes it (huggingface_hub validate_repo_id: letters, digits, "-", "_", "."; no
#: "--" or ".."; neither part starts or ends with "-" or "."; at most 96 characters each), owner/name
_REPO_ID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?/[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")


def _inside(path: Path, root: Path) -> bool:
    """``path``, every link followed, lies inside ``root`` (also resolved)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return False


def _find_in_hf_cache(repo_id: str) -> Path | None:
    """The snapshot directory of ``repo_id`` in the local cache (refs/main first, else the newest). Everything
    memplan reads there resolves inside the cache: a ref naming another directory (``../../outside``), or a
    config.json or weight file linked outside it, is refused."""
    from memplan.inputs import read_text

    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id:
        raise ModelSourceError(f"{quote(repo_id)} is not a Hugging Face repo id (owner/name: letters, digits, '-', "
                               "'_', '.')")
    folder = "models--" + repo_id.replace("/", "--")
    for cache in _hf_cache_dirs():
        repo = cache / folder
        snaps = repo / "snapshots"
        if not snaps.is_dir():
            continue
        snap = None
        ref = repo / "refs" / "main"
        if ref.exists() or ref.is_symlink():  # read_text refuses a FIFO or a device
            name = read_text(ref, "Hugging Face cache ref", 4096).strip()
            if not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
                raise ModelSourceError(f"{ref} names {quote(name)}, not a snapshot of {repo_id} (a commit hash)")
            if (snaps / name / "config.json").is_file():
                snap = snaps / name
        if snap is None:
            candidates = sorted((p for p in snaps.iterdir() if (p / "config.json").is_file()),
                                key=lambda p: p.stat().st_mtime, reverse=True)
            snap = candidates[0] if candidates else None
        if snap is None:
            continue
        files = [snap, snap / "config.json", *snap.glob("*.safetensors"), *snap.glob("*.safetensors.index.json")]
        outside = next((f for f in files if not _inside(f, cache)), None)
        if outside is not None:
            raise ModelSourceError(f"{outside} lies outside the Hugging Face cache {cache}: refused")
        return snap
    return None


def _from_directory(directory: Path, name: str, kind: str, description: str) -> ModelSource:
    cfg_path = directory / "config.json"
    if not cfg_path.exists() and not cfg_path.is_symlink():
        raise ModelSourceError(f"{directory} has no config.json")
    return ModelSource(name=name, kind=kind, description=description, config=read_config(cfg_path),
                       path=directory, checkpoint=_read_checkpoint(directory))


def resolve(model: str) -> ModelSource:
    """Turn a model argument into a ModelSource, or raise a one-line ModelSourceError."""
    if not model or not model.strip():
        raise ModelSourceError("model name is empty")
    key = model.strip()
    presets = preset_names()
    canonical = PRESET_ALIASES.get(key.lower(), key.lower())
    if canonical in presets:
        path = presets_dir() / "models" / f"{canonical}.json"
        label = canonical if canonical == key else f"{canonical} (alias {key})"
        return ModelSource(name=canonical, kind="preset", description=f"preset {label}", config=read_config(path),
                           path=path)
    path = Path(key).expanduser()
    if path.is_file():
        if path.suffix == ".safetensors":
            return _from_directory(path.parent, path.parent.name, "directory", f"directory {path.parent}")
        return ModelSource(name=path.parent.name if path.name == "config.json" else path.stem, kind="config",
                           description=f"config {path}", config=read_config(path), path=path)
    if path.is_dir():
        return _from_directory(path, path.resolve().name, "directory", f"directory {path}")
    if path.exists():  # a FIFO, a device, a socket: reading it could block or never end
        raise ModelSourceError(f"{key} is not a regular file or a directory")
    if ":" in key and not key.startswith((".", "/")):
        return ModelSource(name=key, kind="factory", description=f"factory {key}", factory=key)
    if key.count("/") == 1 and not key.startswith((".", "/")) and not key.endswith(".json"):
        snap = _find_in_hf_cache(key)
        if snap is not None:
            return _from_directory(snap, key, "hf-cache", f"hf cache {key} ({snap})")
        raise ModelSourceError(f"{quote(key)} is not a preset, a path, or a repo in the local Hugging Face cache "
                               "(memplan never downloads; put its config.json in a directory and pass the path)")
    if key.endswith(".json") or os.sep in key:
        raise ModelSourceError(f"no such file or directory: {key}")
    close = difflib.get_close_matches(key.lower(), presets + list(PRESET_ALIASES), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see `memplan presets`"
    raise ModelSourceError(f"unknown preset {quote(key)}{hint}")


def with_task(source: ModelSource, task: str | None) -> ModelSource:
    """The source as the job builds it: its config's head set for ``task`` (--task; model/tasks.py with_task),
    and a composite config whose causal-LM class is built on its text sub-config flattened to that text config
    (model/tasks.py language_model: what transformers' AutoModelForCausalLM builds), with a note."""
    if task and (source.kind == "factory" or source.config is None):
        raise ConfigError("--task applies to a transformers config, not to a factory module")
    if source.kind == "factory" or source.config is None:
        return source
    from memplan.model import tasks

    config = tasks.with_task(source.config, task) if task else source.config
    flat = tasks.language_model(config)
    if flat is None:
        return source if config is source.config else replace(source, config=config)
    text, note = flat
    return replace(source, config=text, extra={**source.extra, "notes": [*source.extra.get("notes", ()), note]})


def build_inventory(source: ModelSource, builder: str = "auto") -> ParamInventory:
    """Inventory for a source: analytic when the family is known (no torch), else the meta-device builder.

    ``builder`` is ``auto`` | ``analytic`` | ``meta``.
    """
    if builder not in ("auto", "analytic", "meta"):
        raise ConfigError(f"unknown builder {quote(builder)}; use auto, analytic or meta")
    notes: list[str] = list(source.extra.get("notes", ()))
    if source.kind == "factory":
        if builder == "analytic":
            raise ConfigError("a factory module can only be built on the meta device (--builder meta)")
        return _factory_inventory(source.factory or "")
    config = source.config or {}
    check_config(config, families.BUILDERS)
    from memplan.model import tasks

    task = tasks.task_of(config)  # a head memplan does not model is refused here, by name
    tasks.check_labels(config)
    notes.extend(families.defaults_note(config))
    if task == tasks.CAUSAL_LM and (builder == "analytic" or (builder == "auto" and families.supports(config))):
        inv = families.build_analytic(config, source.name, source.description)
    else:
        drop = tasks.layerdrop_note(config)
        if drop:
            notes.append(drop)
        if task == tasks.SEQ2SEQ:
            built = tasks.seq2seq_class(config)
            arch = tasks.architecture(config)
            notes.append(f"task {task} ({arch}" + (f": trained as {built}, the class AutoModelForSeq2SeqLM builds"
                                                   if built != arch else "")
                         + "): encoder and decoder blocks, its LM head and loss traced with transformers; the "
                         "decoder's labels are --target-len tokens")
        elif task != tasks.CAUSAL_LM:
            notes.append(f"task {task} ({tasks.architecture(config)}): its head built on the meta device with "
                         "transformers, its loss traced with it")
        elif builder == "auto":
            notes.append(f"model_type {quote(config.get('model_type'))} has no analytic builder; "
                         "built on the meta device with transformers")
        from memplan.model.meta_builder import build_meta_from_config

        inv = build_meta_from_config(config, source.name, source.description)
    if source.checkpoint:
        inv = _apply_checkpoint(inv, source.checkpoint, notes)
    if task != tasks.CAUSAL_LM:
        inv = replace(inv, task=task)
    return replace(inv, notes=tuple(notes) + inv.notes) if notes else inv


def _apply_checkpoint(inv: ParamInventory, ckpt: tuple[CheckpointTensor, ...], notes: list[str]) -> ParamInventory:
    """Take stored dtypes from the checkpoint headers; report tensors present on one side only.

    Checkpoint names may lack the model's top prefix (GPT-2's ``h.0...`` for ``transformer.h.0...``) or use an
    older name, so they are matched by exact name first, then by suffix with the same shape.
    """
    by_name = {t.name: t for t in ckpt}
    by_suffix: dict[str, CheckpointTensor] = {}
    for t in ckpt:
        parts = t.name.split(".")
        for i in range(1, len(parts)):
            by_suffix.setdefault(".".join(parts[i:]), t)
    matched: set[str] = set()
    tensors: list[ParamTensor] = []
    unmatched_model = 0
    for t in inv.tensors:
        hit = None
        for name in (t.name, *t.tied_names):
            hit = by_name.get(name)
            if hit is None:
                parts = name.split(".")
                for i in range(1, len(parts)):
                    cand = by_suffix.get(".".join(parts[i:])) or by_name.get(".".join(parts[i:]))
                    if cand is not None and cand.shape == t.shape:
                        hit = cand
                        break
            if hit is not None:
                break
        if hit is None:
            unmatched_model += 1
            tensors.append(t)
            continue
        matched.add(hit.name)
        if hit.shape != t.shape:
            notes.append(f"checkpoint shape {hit.shape} of {hit.name} differs from the model's {t.shape}")
        tensors.append(replace(t, dtype=hit.dtype))
    extra = [t for t in ckpt if t.name not in matched]
    extra_params = sum(_numel(t.shape) for t in extra)
    dtypes = sorted({t.dtype for t in ckpt})
    notes.append(f"checkpoint: {len(ckpt)} tensors in safetensors headers, stored as {', '.join(dtypes)}")
    if extra:
        notes.append(f"checkpoint has {len(extra)} tensors ({extra_params:,} elements) the model does not use, "
                     f"e.g. {extra[0].name}")
    if unmatched_model:
        notes.append(f"{unmatched_model} model parameters not found in the checkpoint (dtype from config)")
    return replace(inv, tensors=tuple(tensors))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


#: inventories of factories built in this process, by (factory, its file's digest, sys.path): a search or a
#: command's suggestions ask for the same module many times, and each build is a child process
_FACTORY_INVENTORIES: dict[tuple[str, str, tuple[str, ...]], ParamInventory] = {}


def _factory_inventory(spec: str) -> ParamInventory:
    """The factory's module, built on the meta device in a child process (memplan/model/factory_child.py: the
    user's code never runs in memplan's own)."""
    import sys

    from memplan.model import factory_child

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelSourceError(f"factory {quote(spec)} must look like pkg.module:callable")
    key = (spec, factory_child.digest(spec), tuple(sys.path))
    hit = _FACTORY_INVENTORIES.get(key)
    if hit is None:
        hit = _FACTORY_INVENTORIES[key] = factory_child.run("inventory", {}, spec)
    return hit


def trace_config(source: ModelSource, inv: ParamInventory) -> dict[str, Any] | None:
    """The config the activation trace is keyed by and built from: the model's config.json, or for a factory
    (the user's own module) its name, a digest of its source file (an edit traces again; found without importing
    it) and its block count."""
    if source.kind != "factory":
        return source.config
    from memplan.model import factory_child

    return {"factory": source.factory, "factory_source_sha256": factory_child.digest(source.factory or ""),
            "model_type": inv.family, "num_hidden_layers": max(len(inv.layer_blocks), 1)}
