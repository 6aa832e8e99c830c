"""General ParamInventory builder: instantiate the real module on the meta device (no memory, exact shapes).

Works for any architecture transformers knows (never ``trust_remote_code``) and for a user's factory
``pkg.module:callable``. Imports torch and transformers, so it is only used when the analytic builder does not
know the family, or when asked for (``--builder meta``) and in the tests that compare the two.

Owning block of a parameter = its nearest ancestor module whose class is listed in the model's
``_no_split_modules`` (transformers' declaration of the unit that must stay whole: exactly the decoder layer
that FSDP's transformer auto-wrap policy and DeepSpeed's module hooks treat as one), else the children of the
largest ``nn.ModuleList`` (the layer stack of a plain PyTorch module), else the root.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

from memplan.errors import ConfigError, ModelSourceError
from memplan.inputs import quote
from memplan.model.families import config_dtype, model_dims
from memplan.model.inventory import ROOT_BLOCK, ParamInventory, ParamTensor, classify


def block_modules(model: Any) -> list[Any]:
    """The model's blocks in forward order (named_modules order: an encoder-decoder's encoder blocks, then its
    decoder's), by _block_names' rule: the traced step's, the inventory's and the wrap units' blocks are these."""
    names = _block_names(model)
    return [m for n, m in model.named_modules() if n in names]


def _block_names(model: Any) -> set[str]:
    import torch.nn as nn

    no_split = set(getattr(model, "_no_split_modules", None) or [])
    if no_split:
        names = {n for n, m in model.named_modules() if type(m).__name__ in no_split}
        # the layer stack's: a no-split module outside every ModuleList (BERT's BertEmbeddings, which
        # _no_split_modules lists beside BertLayer) is not a layer; the traced step's blocks are the stack's
        # (tracing/step.py block_index), and the rest is the root
        stacked = {f"{n}.{i}" if n else str(i) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)
                   for i in range(len(m))}
        if names & stacked:
            return names & stacked
        if names:
            return names
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return set()
    best_name, best = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return {f"{best_name}.{i}" if best_name else str(i) for i in range(len(best))}


def _layer_kind(module: Any) -> str:
    """What LoRA can target in a module (memplan/model/lora.py): PEFT's linear classes (nn.Linear and
    transformers' Conv1D: peft/tuners/tuners_utils.py _maybe_include_all_linear_layers) and embeddings."""
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return ""


def inventory_from_module(model: Any, *, model_name: str, source: str, family: str, dtype: str | None = None,
                          dims: Mapping[str, int] | None = None, notes: tuple[str, ...] = ()) -> ParamInventory:
    """Walk ``named_parameters(remove_duplicate=False)``: first occurrence owns the tensor, later ones are ties."""
    blocks = _block_names(model)
    kinds = {name: _layer_kind(m) for name, m in model.named_modules()}
    seen: dict[int, int] = {}
    tensors: list[dict[str, Any]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        key = id(p)
        if key in seen:
            tensors[seen[key]]["tied_names"] += (name,)
            continue
        owner = _owner(name, blocks)
        seen[key] = len(tensors)
        tensors.append({"name": name, "shape": tuple(int(s) for s in p.shape),
                        "dtype": dtype or str(p.dtype).removeprefix("torch."), "block": owner,
                        "category": classify(name), "tied_names": (), "layer": kinds.get(name.rpartition(".")[0], ""),
                        # a parameter the model builds with requires_grad=False (RoFormer's and Marian's sinusoidal
                        # positions: nn.Embedding(_freeze=True)) gets no gradient; torch's optimizers make it no
                        # state, DDP leaves it out of its buckets, DeepSpeed out of its flat groups
                        "trainable": bool(p.requires_grad)})
    fixed = [t for t in tensors if not t["trainable"]]
    if fixed:
        notes = notes + (f"{', '.join(t['name'] for t in fixed[:3])}{' ...' if len(fixed) > 3 else ''} "
                         f"({sum(math.prod(t['shape']) for t in fixed):,} parameters) built with requires_grad=False: "
                         "no gradients, no optimizer states",)
    keep = tuple(sorted(getattr(model, "_keep_in_fp32_modules", None) or ()))
    # floating buffers as a job builds them, in fp32 (transformers' default dtype; from_config here follows the
    # config's torch_dtype), and converted with the parameters by the recipe (ParamInventory.buffer_bytes)
    buffers = tuple(ParamTensor(name, tuple(int(s) for s in b.shape),
                                "float32" if b.is_floating_point() else str(b.dtype).removeprefix("torch."),
                                _owner(name, blocks), classify(name)) for name, b in model.named_buffers())
    return ParamInventory(model_name=model_name, source=source, builder="meta", family=family,
                          tensors=tuple(ParamTensor(**t) for t in tensors), notes=notes, dims=dict(dims or {}),
                          keep_fp32_modules=keep, buffers=buffers)


def _owner(name: str, blocks: set[str]) -> str:
    """The block a parameter or buffer of this name belongs to: its nearest enclosing block, else the root."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in blocks:
            return prefix
    return ROOT_BLOCK


def hf_config(config: Mapping[str, Any], model_name: str = "model") -> Any:
    """The transformers config object for a config.json dict (never remote code); use_cache off (training)."""
    from memplan.model.hf import transformers_config

    cfg = transformers_config(config, model_name)
    from memplan.model import tasks

    if not (config.get("use_cache", True) is not False and tasks.task_of(config) == tasks.SEQ2SEQ):
        # a decoder-only model's cache holds its own k/v views in training (no copy); an encoder-decoder's decoder
        # concatenates each layer's keys and values into its EncoderDecoderCache (copies, alive to that attention's
        # backward), as a Trainer runs it with the config's use_cache (measured: flan-t5 bf16, 2 decoder blocks,
        # +524,288 B in the Trainer's step)
        cfg.use_cache = False
    return cfg


def build_meta_from_config(config: Mapping[str, Any], model_name: str, source: str) -> ParamInventory:
    """Instantiate the transformers model for a config.json dict on the meta device."""
    model = meta_model(config, model_name)
    # a vision-language model's dimensions are its language model's, as its text config fills them in (LLaVA's
    # text_config gives few fields and takes LlamaConfig's defaults for the rest)
    dims = (model_dims({**model.config.get_text_config().to_dict(), "model_type": config["model_type"]})
            if isinstance(config.get("text_config"), Mapping) else model_dims(config))
    return inventory_from_module(model, model_name=model_name, source=source, family=str(config["model_type"]),
                                 dtype=config_dtype(config), dims=dims)


def checkpointing_on(model: Any, recompute: str = "full") -> None:
    """Non-reentrant activation checkpointing as a Trainer turns it on: transformers 5.23's
    activation_checkpointing_enable (gradient_checkpointing_enable, its deprecated alias, warns), or the alias on
    older versions. every:N checkpoints every N-th decoder layer as its every_n_layers does (layer i when
    i % N == 0, the GradientCheckpointingLayer modules counted in module order; modeling_utils.py
    _set_gradient_checkpointing); layer-sac:N, torchtitan's layers N-1, 2N-1, ..., and every:N on a transformers
    without that argument, get the layers' flags set here the same way."""
    import inspect

    from memplan.activations import EVERY, OP_SAC, checkpoint_every, is_checkpointed

    every = checkpoint_every(recompute) or 1
    enable = getattr(model, "activation_checkpointing_enable", None)
    if recompute == OP_SAC:  # torchtitan's per-op policy in each block's checkpoint
        kwargs = {"use_reentrant": False, "context_fn": op_sac_context_fn()}
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    if enable is not None and (every == 1 or (recompute.startswith(EVERY)
                                              and "every_n_layers" in inspect.signature(enable).parameters)):
        enable(activation_checkpointing_kwargs={"use_reentrant": False},
               **({"every_n_layers": every} if every != 1 else {}))
        return
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if every != 1:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        for i, m in enumerate(layers):
            m.gradient_checkpointing = is_checkpointed(recompute, i)


def op_sac_context_fn() -> Any:
    """torchtitan's per-op selective activation checkpointing as a torch.utils.checkpoint context_fn (torchtitan
    54aeddf5, distributed/activation_checkpoint.py _apply_op_sac, with models/llama3/infra/parallelize.py's
    _op_sac_save_list): in each checkpointed block the outputs of aten.mm are kept but every second one (counted
    per block, forward and recompute apart), and those of the fused attention kernels, reduce_scatter and max;
    everything else is recomputed in backward. The trace's stand-in for a CUDA fused attention kernel
    (substitutes_sdpa) marks the allocations that are that kernel's outputs; on a CPU the flash kernel
    (_scaled_dot_product_flash_attention_for_cpu) is not on the list, and the real CPU run recomputes it too."""
    from collections import defaultdict

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from memplan.activations import substitutes_sdpa

    aten = torch.ops.aten
    names = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
             "_scaled_dot_product_fused_attention_overrideable", "max")
    save = {aten.mm.default} | {getattr(aten, n).default for n in names if hasattr(aten, n)}
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        save.add(c10d.reduce_scatter_tensor.default)
    mm = aten.mm.default

    def context_fn() -> Any:
        meta: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == mm:
                meta[mode] += 1
            if substitutes_sdpa.SAC_KERNEL_OUTPUTS["on"]:
                return CheckpointPolicy.MUST_SAVE
            keep = func in save and not (func == mm and meta[mode] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def meta_model(config: Mapping[str, Any], model_name: str = "model") -> Any:
    """The transformers model for a config.json dict, on the meta device."""
    try:
        import torch
        import transformers
        from transformers import AutoModel, AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelSourceError(f"building {model_name} needs torch and transformers ({exc})") from exc
    cfg = hf_config(config, model_name)
    classes = []
    from memplan.model import tasks

    if tasks.task_of(config) == tasks.SEQ2SEQ:
        # the class the job trains (AutoModelForSeq2SeqLM's, as tasks.build makes it for the trace and the
        # harness), not a headless BartModel: its parameters' names and its buffers (final_logits_bias) are the job's
        cls = getattr(transformers, tasks.seq2seq_class(config), None)
        if cls is not None:
            classes.append(cls._from_config)
    for arch in config.get("architectures") or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            classes.append(cls.from_config if hasattr(cls, "from_config") else cls._from_config)
    classes += [AutoModelForCausalLM.from_config, AutoModel.from_config]
    last: Exception | None = None
    for make in classes:
        try:
            with torch.device("meta"):
                model = make(cfg)
            break
        except Exception as exc:  # try the next class
            last = exc
    else:
        raise ConfigError(f"transformers could not build {config.get('model_type')} from this config: {last}")
    return model


#: seconds a factory's import and call may take (MEMPLAN_FACTORY_TIMEOUT): building a module on the meta device
#: takes well under a second for any real model, so a factory still running after this is not returning
FACTORY_TIMEOUT_S = 120.0


class _FactoryTimeout(BaseException):
    """Raised in the factory's code by the time limit (a BaseException, so its own except Exception does not
    swallow it)."""


def _factory_timeout() -> float:
    """MEMPLAN_FACTORY_TIMEOUT, else FACTORY_TIMEOUT_S: a positive number of seconds."""
    import math
    import os

    raw = os.environ.get("MEMPLAN_FACTORY_TIMEOUT", str(FACTORY_TIMEOUT_S))
    try:
        limit = float(raw)
    except ValueError:
        limit = math.nan
    if not math.isfinite(limit) or limit <= 0:
        raise ModelSourceError(f"MEMPLAN_FACTORY_TIMEOUT must be a positive number of seconds, got {quote(raw)}")
    return limit


@contextlib.contextmanager
def _time_limit(spec: str, doing: str, limit: float) -> Iterator[None]:
    """Stop the user's code after ``limit`` seconds with SIGALRM (the main thread on POSIX; elsewhere no limit)."""
    import signal
    import threading

    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_signum: int, _frame: Any) -> None:
        raise _FactoryTimeout(f"factory {quote(spec)} did not finish {doing} within {limit:g} s "
                              "(MEMPLAN_FACTORY_TIMEOUT sets the limit)")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def call_factory(spec: str, device: Any = None) -> tuple[Any, Any]:
    """``pkg.module:callable`` called (under ``device``, a context: torch.device("meta") or a FakeTensorMode):
    (the nn.Module, its input builder or None). The factory returns the module, or (module, input_builder)
    where input_builder(batch, seq) gives the forward's inputs (a tensor, a tuple, or a dict of keyword
    arguments)."""
    import contextlib

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelSourceError(f"factory {quote(spec)} must look like pkg.module:callable")
    try:
        import torch
    except ImportError as exc:  # pragma: no cover
        raise ModelSourceError(f"factory {quote(spec)} needs torch ({exc})") from exc
    def first_line(exc: BaseException) -> str:
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__

    limit = _factory_timeout()
    # the user's code may raise anything, sys.exit included: a factory that ends the process would end a CI gate
    # with its own exit code (0), so every BaseException but Ctrl-C becomes one line and exit 2; and it may never
    # return, so its import and its call run under a time limit
    try:
        with _time_limit(spec, "importing it", limit):
            module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except _FactoryTimeout as exc:
        raise ModelSourceError(str(exc)) from None
    except BaseException as exc:
        raise ModelSourceError(f"factory {quote(spec)}: cannot import {quote(module_name)}: {first_line(exc)}") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ModelSourceError(f"factory {quote(spec)}: {quote(module_name)} has no attribute {quote(attr)}")
    if not callable(fn):
        raise ModelSourceError(f"factory {quote(spec)}: {quote(attr)} is not callable")
    try:
        with _time_limit(spec, "building the model", limit), (device or contextlib.nullcontext()):
            made = fn()
    except KeyboardInterrupt:
        raise
    except _FactoryTimeout as exc:
        raise ModelSourceError(str(exc)) from None
    except BaseException as exc:
        raise ModelSourceError(f"factory {quote(spec)} raised {first_line(exc)}") from None
    model, inputs = (made if isinstance(made, tuple) and len(made) == 2 else (made, None))
    if not isinstance(model, torch.nn.Module):
        raise ModelSourceError(f"factory {quote(spec)} returned {type(model).__name__}, not a torch.nn.Module (or a "
                               "(module, input_builder) pair)")
    if inputs is not None and not callable(inputs):
        raise ModelSourceError(f"factory {quote(spec)}: its input builder is not callable (input_builder(batch, seq))")
    return model, inputs


def build_meta_from_factory(spec: str) -> ParamInventory:
    """``pkg.module:callable`` returning an nn.Module (or (module, input_builder)), called under
    ``torch.device("meta")``."""
    import torch

    model, _ = call_factory(spec, torch.device("meta"))
    if not any(True for _ in model.parameters()):
        raise ModelSourceError(f"factory {quote(spec)} returned a {type(model).__name__} with no parameters: "
                               "nothing to train")
    cfg = getattr(model, "config", None)
    dims = model_dims(cfg.to_dict()) if hasattr(cfg, "to_dict") else {}
    return inventory_from_module(model, model_name=spec, source=f"factory {spec}", family=type(model).__name__,
                                 dims=dims)
