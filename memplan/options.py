"""Turn user options (CLI or library callers) into Settings: names resolved, defaults applied, conflicts said.

Precedence: command line > --deepspeed file > memplan defaults. ``sources`` records which one won for every
setting the file could set, so the output can say it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from memplan.allocator import AllocatorConfig
from memplan.errors import SettingsError
from memplan.inputs import quote
from memplan.model.inventory import ParamInventory
from memplan.model.sources import gpu_presets
from memplan.precision import get_optimizer, get_recipe
from memplan.request import JobRequest
from memplan.settings import Cluster, DeepSpeedKnobs, Overheads, Settings, TorchKnobs
from memplan.strategies import DEFAULT_RECIPE, REPLICATED, STAGE_TO_STRATEGY, get_strategy
from memplan.units import parse_size


@dataclass(frozen=True)
class Resolved:
    settings: Settings
    sources: dict[str, str]  #: setting -> "command line" | a job file's path | "default"
    notes: tuple[str, ...]
    files: tuple[str, ...] = ()  #: the TrainingArguments and Accelerate files read (jobfiles.merged)


def gpu_memory(gpu: str | None, gpu_memory: str | None) -> tuple[int | None, str | None]:
    """Usable bytes from a GPU preset or an explicit size ("80GB" = 80e9, "80GiB" = 80 * 2^30)."""
    if gpu and gpu_memory:
        raise SettingsError("give --gpu or --gpu-memory, not both")
    if gpu:
        presets = gpu_presets()
        key = gpu.lower()
        if key not in presets:
            raise SettingsError(f"unknown GPU {quote(gpu)}; valid: {', '.join(presets)}")
        g = presets[key]
        cap, how = g.capacity
        if how == "torch":  # what PyTorch reports and its allocator works within (measured)
            return cap, f"{key}: {g.name}, {cap} bytes as torch reports them (nvidia-smi: {g.usable_bytes})"
        return cap, f"{key}: {g.name}, {cap} bytes (nvidia-smi memory.total)"
    if gpu_memory:
        n, how = parse_size(gpu_memory)
        return n, how
    return None, None


class _NotCached(SettingsError):
    """A profile that would have to be traced where tracing is not allowed (``trace`` False)."""


def activation_profile(config: dict[str, Any] | None, s: Settings, mode: str, notes: list[str],
                       trace: bool = True) -> Any:
    """The traced profile for these settings (shipped, cached or traced now), or None for the analytic one.

    ``auto`` traces and falls back to analytic with a note when the model cannot be traced (data-dependent MoE
    routing, a module transformers does not know); ``traced`` makes that an error; ``analytic`` never traces.
    Selective recompute (Korthikanti et al. 2022) recomputes the attention core only, which is what the
    flash kernels keep anyway: it is traced with flash attention and no recompute.
    """
    from memplan import activations as act
    from memplan.activations import profile_cache
    from memplan.activations.tracing_keys import trace_linear

    if mode not in ("auto",) + act.ACTIVATION_SOURCES:
        raise SettingsError(f"--activations must be auto, traced or analytic, got {quote(mode)}")
    if s.attention not in act.ATTENTION:
        raise SettingsError(f"unknown attention {quote(s.attention)}; valid: {', '.join(act.ATTENTION)}")
    act.valid_recompute(s.recompute)
    from memplan.model import tasks

    # an encoder-decoder's analytic refusal is resolve()'s (config_checks); here: it never falls back to one
    no_fallback = tasks.two_stacks(config)
    # a compiled step has no analytic counterpart either, nor a float8 one: its trace's failure is the answer
    no_fallback = no_fallback or s.compile != "none" or s.float8 != "none"
    if s.lora is not None and (mode == "analytic" or config is None):
        notes.append("activations: analytic, as for full training; LoRA's frozen weights save less (an upper bound)")
    if mode == "analytic":
        return None
    if config is None:
        if mode == "traced":
            raise SettingsError("--activations traced needs a model config (preset, config.json or directory)")
        notes.append("activations: analytic (no config.json to trace)")
        return None

    attention = "flash" if s.attention != "eager" or s.recompute == "selective" else "eager"
    recompute = "none" if s.recompute == "selective" else s.recompute
    if s.recompute == "selective":
        notes.append("recompute selective (Korthikanti et al.): the attention core (scores, softmax, dropout) is "
                     "recomputed in the backward, so it keeps what a fused attention kernel keeps; traced with the "
                     "device's SDPA kernel and no recompute" +
                     (" (eager attention's probabilities are not kept)" if s.attention == "eager" else
                      ": the same bytes as --recompute none under --attention sdpa, whose fused kernel already "
                      "recomputes the core"))
    # DeepSpeed ZeRO-3 replaces F.linear with its own autograd function (tracing._deepspeed_zero3_linear)
    linear = "deepspeed-zero3" if s.strategy.zero_stage == 3 and s.ds.memory_efficient_linear else "aten"
    target = kernel_target(s.cluster)
    if s.attention == "flash":
        _check_flash(config, s, target)
    try:
        prof = profile_cache.load_or_trace(config, seq_len=s.seq_len, micro_batch=s.micro_batch, recipe=s.recipe.name,
                                 attention=attention, recompute=recompute, device=s.cluster.device,
                                 linear=linear, target=target, allow_trace=trace)
        if prof is not None and _casts_unit_inputs(s) and "factory" not in config and other_block_inputs(prof):
            # FSDP2's MixedPrecisionPolicy(param_dtype=bf16) casts each unit's floating inputs (cast_forward_inputs,
            # on by default: _fsdp_state.py _cast_forward_inputs), and a block given another dtype (Qwen-VL's vision
            # rotary cos and sin, fp32) holds its own bf16 copies: the step traced with the cast (model/hf.py
            # BLOCK_INPUT_CAST_KEY)
            from memplan.model.hf import BLOCK_INPUT_CAST_KEY

            prof = profile_cache.load_or_trace({**config, BLOCK_INPUT_CAST_KEY: "bfloat16"}, seq_len=s.seq_len,
                                               micro_batch=s.micro_batch, recipe=s.recipe.name, attention=attention,
                                               recompute=recompute, device=s.cluster.device, linear=linear,
                                               target=target, allow_trace=trace)
        if prof is None and not trace:
            raise _NotCached("no cached activation profile for this configuration (not traced here)")
    except _NotCached:
        raise
    except SettingsError as exc:
        if mode == "traced" or config.get("factory") or no_fallback:  # no analytic profile for these
            raise
        notes.append(f"activations: analytic, because {exc}")
        return None
    # the trace picks each SDPA call's kernel as the device does (memplan/activations/kernels.py): the math kernel keeps
    # the attention probabilities, the fused ones an fp32 logsumexp
    from memplan.activations.kernels import BACKENDS

    for backend, why in sorted((prof.data.get("attention_kernels") or {}).items() if prof is not None else ()):
        if backend == "eager":  # the model has no SDPA attention at all (tasks.sdpa_supported)
            notes.append(f"attention: eager, as transformers runs it ({why})")
        elif backend in BACKENDS and not BACKENDS[backend].fused:
            notes.append(f"attention: math kernel on {target.describe()} ({why}): it keeps the probabilities, "
                         "b x heads x seq^2 fp32 per layer")
        else:
            notes.append(f"attention: {backend} on {target.describe()} ({why})")
    if target.device == "cpu":
        from memplan.activations.kernels import describe_cpu_gemm

        notes.append(describe_cpu_gemm(target.cpu_isa) + f" (--cpu-isa {target.cpu_isa})")
    if prof is not None and trace_linear(linear, device=s.cluster.device, recipe=s.recipe.name) != "aten":
        how = ("it saves the fp32 input and weight, not autocast's bf16 copies" if s.recipe.name == "torch-amp" else
               "it makes the input's gradient before the weight's, so a CPU bf16 GEMM's fp32 scratch sits beside it")
        notes.append(f"activations: traced with DeepSpeed ZeRO-3's linear (LinearFunctionForZeroStage3: {how}"
                     + "; zero_optimization.memory_efficient_linear false turns it off)")
    return prof


def config_checks(config: dict[str, Any] | None, request: JobRequest) -> None:
    """The refusals a job gets from its config and command line alone, before its inventory is built (seconds for
    a model transformers builds): the task's sequence and decoder lengths, and what an encoder-decoder cannot ask
    for. resolve() runs it on the merged request; the CLI (cli_estimate.inventory) first, on the command line."""
    from memplan.model import tasks

    from memplan.model.hf import IMAGE_SIZE_KEY

    b = request.batch
    compile_checks(config, request)
    if config is None or "factory" in config:
        if b.target_len is not None:
            raise SettingsError(f"--target-len {b.target_len}: only an encoder-decoder (seq2seq) model's config has "
                                "a decoder input")
        if b.images is not None:
            raise SettingsError(f"--images {b.images}: only a vision-language model's config takes images")
        if b.image_size is not None:
            raise SettingsError(f"--image-size {b.image_size[0]}x{b.image_size[1]}: only a vision-language model's "
                                "config takes images")
        return
    seq = tasks.check_seq_len(config, b.seq_len)
    if b.target_len is not None:
        tasks.check_target_len(config, b.target_len, seq or 2048)
    if tasks.two_stacks(config):
        _two_stack_refusals(config, request)
    size = tasks.check_image_size(config, b.image_size)
    if size is not None:
        config = {**config, IMAGE_SIZE_KEY: list(size)}
    tasks.check_images(config, b.images, seq or 2048)  # after those: a default image size imports transformers


def other_block_inputs(prof: Any) -> bool:
    """Whether the profile's blocks may be given floating tensors other than bf16, which FSDP2 would copy. A
    profile without the record: the shipped ones, traced before it, are of presets whose blocks take bf16 alone
    (tests/model/test_tasks.py traces each preset); one cached before it is not known, and is traced again with the
    cast (which copies nothing where there is nothing to cast)."""
    seen = prof.data.get("block_float_inputs")
    if seen is None:
        return not (prof.origin == "shipped" or prof.origin.startswith("shipped traces"))
    return bool(set(seen) - {"bfloat16"})


def _casts_unit_inputs(s: Settings) -> bool:
    """Whether the job's framework casts each unit's floating inputs to bf16: FSDP2 under the fsdp-bf16 recipe
    (MixedPrecisionPolicy's cast_forward_inputs defaults on; FSDP1's MixedPrecision casts the root's alone)."""
    return s.recipe.name == "fsdp-bf16" and s.strategy.memory_model == "fsdp2"


def _two_stack_refusals(config: dict[str, Any], request: JobRequest) -> None:
    from memplan.model import tasks

    # an encoder-decoder or a vision-language model cannot ask for the analytic activations (a decoder-only
    # stack's formula) nor for model parallelism (memplan's layouts split and stage one stack)
    seq2seq = tasks.task_of(config) == tasks.SEQ2SEQ
    whose = "an encoder-decoder's (seq2seq)" if seq2seq else "a vision-language model's (image-text-to-text)"
    if request.model.activations == "analytic":
        raise SettingsError(f"--activations analytic models a decoder-only stack; {whose} activations are traced "
                            "(--activations auto or traced)")
    p = request.parallel.build()
    if p is not None and p.active:
        what = "an encoder-decoder (seq2seq)" if seq2seq else "a vision-language (image-text-to-text)"
        raise SettingsError(f"--tp/--pp/--cp/--ep with {what} model: not modelled (its two stacks are neither split "
                            "nor staged by memplan's parallel layouts)")


def _recipe(name: str, strat: Any) -> tuple[Any, str]:
    """The precision recipe a --precision name asks for, and its float8 recipe ("none" but for fp8-*): float8
    training computes in bf16 as the strategy does, with FSDP2's MixedPrecisionPolicy(bf16, fp32) under FSDP2 and
    torch.autocast(bf16) on fp32 parameters otherwise (torchtitan: maybe_enable_amp without FSDP), and swaps the
    linears' GEMMs for float8 ones (tracing/float8.py)."""
    from memplan.precision import float8_precision

    float8 = float8_precision(name)
    if float8 is None:
        if name.lower().startswith(("mxfp8", "mx-fp8", "fp8-mx", "nvfp4", "mxfp4")):
            raise SettingsError(f"--precision {name}: torchao's MX formats (MXLinear, Blackwell) are not modelled "
                                "yet; float8 is (fp8-tensorwise, fp8-rowwise, fp8-rowwise-gw-hp)")
        return get_recipe(name), "none"
    # under another framework float8_checks refuses it, with the others
    base = "fsdp-bf16" if strat.framework == "fsdp2" else "torch-amp"
    return get_recipe(base), float8


def _float8(r: JobRequest, recipe: Any, float8: str) -> str:
    """The job's torchao float8 recipe: --precision fp8-RECIPE's, or --float8's on the job's own bf16 recipe."""
    from memplan.precision import FLOAT8_BASES, FLOAT8_KEEP, FLOAT8_RECIPES

    given, keep = r.training.float8, r.training.float8_keep
    if keep not in FLOAT8_KEEP:
        raise SettingsError(f"unknown --float8-keep {quote(keep)}; valid: {', '.join(FLOAT8_KEEP)}")
    if given is None or given == "none":
        if (keep != "output" or r.training.float8_all_gather) and float8 == "none":
            raise SettingsError(f"--float8-{'keep' if keep != 'output' else 'all-gather'} applies to float8 "
                                "training: give --float8 or --precision fp8-RECIPE")
        return float8
    if given not in FLOAT8_RECIPES:
        raise SettingsError(f"unknown --float8 {quote(given)}; valid: none, {', '.join(FLOAT8_RECIPES)}")
    if float8 != "none" and FLOAT8_RECIPES[given] != float8:
        raise SettingsError(f"--float8 {given} and --precision fp8-* ask for two float8 recipes: give one")
    if recipe.name not in FLOAT8_BASES:
        raise SettingsError(f"--float8 {given} on --precision {recipe.name}: float8 training computes in bf16 "
                            f"(torchao's Float8Linear), on one of {', '.join(FLOAT8_BASES)}")
    return FLOAT8_RECIPES[given]


def float8_checks(config: dict[str, Any] | None, s: Settings, parallel: Any, lora: Any,
                  activations: str, inv: ParamInventory) -> dict[str, Any]:
    """Float8 training's refusals, and the config that carries it into the trace (tracing/float8.py)."""
    from memplan.activations.tracing import float8 as f8
    from memplan.activations.tracing_keys import FLOAT8_KEY, float8_key
    from memplan.precision import float8_name, float8_weights
    from memplan.settings import shard_group_size

    arch = kernel_target(s.cluster).arch if s.cluster.device == "cuda" else ""
    why = None
    if s.strategy.framework not in ("torch", "torch-ddp", "fsdp2"):
        why = (f"under {s.strategy.framework}: torchao's float8 training is modelled under one GPU, DDP and FSDP2, "
               "not under DeepSpeed, Horovod or FSDP1")
    elif s.cluster.device == "cuda" and not _fp8_arch(arch):
        why = (f"needs float8 tensor cores (sm89 or newer: L40S, RTX 4090, H100, H200, B200), not {arch}: "
               "torchao refuses float8 training there")
    elif activations == "analytic" or config is None:
        why = "needs the traced activations (a model config, --activations auto or traced): torchao's casts and " \
              "saved tensors are traced"
    elif lora is not None:
        why = "with LoRA is not modelled (PEFT's adapters on torchao's Float8Linear)"
    elif parallel is not None and parallel.active:
        why = "with --tp/--pp/--cp/--ep is not modelled yet (torchao's float8 tensor-parallel styles)"
    elif not float8_weights(inv, s.float8_keep):
        why = ("finds no nn.Linear to swap (torchao's Float8Linear swaps nn.Linear whose dims are multiples of 16, "
               "but those --float8-keep keeps)")
    elif s.float8_all_gather and (s.strategy.framework != "fsdp2" or s.float8 != "tensorwise"
                                  or s.recipe.name != "fsdp-bf16"):
        why = ("with --float8-all-gather is modelled under FSDP2 with tensorwise scaling and fsdp-bf16 (torchao "
               "casts the shards for the all-gather with tensorwise scales only; torchtitan's recipe)")
    elif s.float8_all_gather and shard_group_size(s) < 2:
        why = "with --float8-all-gather needs a shard group of more than one rank (there is no all-gather)"
    elif not f8.available():
        why = f"needs torchao installed ({f8.TORCHAO})"
    if why:
        raise SettingsError(f"float8 training ({float8_name(s.float8)}) {why}")
    return {**config, FLOAT8_KEY: float8_key(s.float8, s.float8_keep, s.float8_all_gather)}


def _fp8_arch(arch: str) -> bool:
    """A CUDA architecture with float8 tensor cores: sm89 (Ada) and newer (torchtitan's has_cuda_capability(8, 9))."""
    import re

    m = re.fullmatch(r"sm(\d+)", arch)
    return m is not None and int(m.group(1)) >= 89


def compile_checks(config: dict[str, Any] | None, request: JobRequest) -> None:
    """--compile's refusals: what memplan does not model under torch.compile (tracing/compiled.py)."""
    from memplan.activations.tracing_keys import COMPILE_MODES

    mode = request.training.compile
    if mode not in COMPILE_MODES:
        raise SettingsError(f"unknown --compile {quote(mode)}; valid: {', '.join(COMPILE_MODES)}")
    if mode == "none":
        return
    why = None
    if request.model.activations == "analytic" or config is None:
        why = "needs the traced activations (a model config, --activations auto or traced): inductor's partitioner " \
              "runs on the traced graph"
    elif (p := request.parallel.build()) is not None and p.active:
        why = "with --tp/--pp/--cp/--ep is not modelled yet"
    elif request.training.recompute == "op-sac":
        why = "with --recompute op-sac (a per-operation policy inside the compiled graph) is not modelled yet"
    elif request.adapters.quantize_base:
        why = "with a 4-bit base (bitsandbytes' kernels inside compiled graphs) is not modelled"
    elif request.training.attention == "eager":
        why = "with --attention eager (inductor's pattern matcher turns it into fused attention) is not modelled"
    if why:
        raise SettingsError(f"--compile {mode} {why}")


def _check_flash(config: dict[str, Any], s: Settings, target: Any) -> None:
    """--attention flash asks for the flash kernel: refuse it where the device cannot run it (sdp_utils.cpp
    can_use_flash_attention: fp16/bf16, sm80 or newer, one head dim up to 256); --attention sdpa takes the
    device's own choice."""
    from memplan.activations.kernels import sdpa_class

    why = None
    if target.device == "cuda" and sdpa_class(target.arch) == "sm70":
        why = f"flash attention needs an sm80 or newer GPU, not {target.arch}"
    elif s.recipe.name == "fp32":
        why = "flash attention needs fp16/bf16 inputs and this recipe computes in fp32"
    else:
        heads = config.get("num_attention_heads") or config.get("n_head")
        hidden = config.get("hidden_size") or config.get("n_embd")
        dq = config.get("head_dim") or (config.get("qk_nope_head_dim", 0) + config.get("qk_rope_head_dim", 0)) or (
            hidden // heads if hidden and heads else None)
        dv = config.get("v_head_dim") or dq
        if dq and dv and (dq != dv or dq > 256):
            why = f"flash attention needs one head dim up to 256 for q, k and v, not {dq}/{dv}"
    if why:
        raise SettingsError(f"--attention flash: {why}; --attention sdpa takes the kernel the device would choose")


#: the environment variables PyTorch reads its allocator settings from, the newer name first
#: (c10/core/AllocatorConfig.cpp: PYTORCH_ALLOC_CONF, then the CUDA-specific PYTORCH_CUDA_ALLOC_CONF)
ALLOC_CONF_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def _allocator_conf(given: str | None, device: str, notes: list[str], sources: dict[str, str]) -> str:
    """The caching allocator's settings: --allocator-conf, else the environment the job would inherit; checked
    as PyTorch checks them (an unknown key or a bad value is an error naming it)."""
    import os

    from memplan.allocator import AllocatorConfig

    if given is not None:
        text, where = given, "command line"
    else:
        env = next((k for k in ALLOC_CONF_ENV if os.environ.get(k)), None)
        text, where = (os.environ[env], env) if env else ("", "default")
    conf = AllocatorConfig.parse(text)
    sources["allocator_conf"] = where
    if conf.text and device == "cuda":
        notes.append(f"caching allocator: {conf.text} (from {where})")
    return conf.text


def kernel_target(c: Cluster) -> Any:
    """The kernels.Target the activations are traced for: the GPU's architecture, or the CPU's instruction set
    (this machine's unless --cpu-isa names another)."""
    from memplan.activations.kernels import Target, host_cpu_isa

    if c.device == "cpu":
        return Target(device="cpu", cpu_isa=c.cpu_isa or host_cpu_isa())
    return Target(device="cuda", arch=c.gpu_arch, sms=c.gpu_multiprocessors,
                  threads_per_sm=c.gpu_threads_per_multiprocessor)


class _Picker:
    """Each setting from the merged request (jobfiles.merged: the command line, else the job's files), else
    memplan's default; ``sources`` says which won."""

    def __init__(self, request: JobRequest) -> None:
        self.request = request
        self.sources: dict[str, str] = {}

    def __call__(self, name: str, default: Any, value: Any = None, field: str | None = None) -> Any:
        """``name``'s value (``value`` when the caller read it itself from ``field``)."""
        field = field or name
        if value is None:
            value = self.request[field]
        if value is not None:
            self.sources[name] = self.request.source(field) or "command line"
            return value
        self.sources[name] = "default"
        return default


def _ds_knobs(pick: _Picker, strat: Any) -> DeepSpeedKnobs:
    """DeepSpeed's knobs, each from the command line, else the job's files (the ds_config), else DeepSpeed's
    default."""
    values: dict[str, Any] = {}
    for name in [f.name for f in fields(DeepSpeedKnobs)]:  # declaration order: the JSON's order is stable
        value = pick(name, None)
        if value is not None:
            values[name] = value
    for key, value in values.items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise SettingsError(f"{key.replace('_', '-')} must not be negative, got {value}")
    ds = DeepSpeedKnobs(**values)
    if ds.offload_param and strat.zero_stage != 3:
        raise SettingsError("parameter offload (offload_param) needs ZeRO stage 3")
    if ds.offload_optimizer and not (strat.framework == "deepspeed" and strat.zero_stage >= 1):
        raise SettingsError(f"optimizer offload (offload_optimizer) is DeepSpeed ZeRO-Offload: it needs ZeRO stage "
                            f"1, 2 or 3, not {strat.name} (FSDP offloads with --cpu-offload)")
    if pick.request.source("leaf_classes") == "command line" and ds.leaf_classes is not None \
            and strat.zero_stage != 3:
        raise SettingsError(f"--z3-leaf-modules is DeepSpeed ZeRO-3's, not for --strategy {strat.name}")
    if ds.hpz_partition_size < 1:
        raise SettingsError(f"zero_hpz_partition_size must be at least 1, got {ds.hpz_partition_size}")
    return ds


def _with_z3_leaves(s: Settings, inv: ParamInventory, config: dict[str, Any] | None, notes: list[str]) -> Settings:
    """ZeRO-3's leaf modules (memplan/model/z3_leaf.py), each fetched and released whole by the coordinator."""
    from memplan.model import z3_leaf

    ds = s.ds
    leaves = z3_leaf.resolve(inv, ds.leaf_classes, ds.leaf_names, ds.leaf_name_suffixes,
                             ds.module_granularity_threshold, config)
    if leaves:
        why = ("DeepSpeed's default leaf classes (the sparse MoE blocks: leaf_module_config.py)"
               if ds.leaf_classes is None and not (ds.leaf_names or ds.leaf_name_suffixes
                                                   or ds.module_granularity_threshold) else "the job's leaf modules")
        notes.append(f"ZeRO-3 leaf modules: {len(leaves)} ({leaves[0]}{', ...' if len(leaves) > 1 else ''}), each "
                     f"fetched and released whole, from {why}")
    return replace(s, z3_leaves=leaves)


def _deepspeed_wrapper(strat: Any, recipe: Any, ds: DeepSpeedKnobs, notes: list[str], piped: bool = False) -> None:
    """DeepSpeed 0.19.8 picks its optimizer wrapper from the parameters' dtype and data_types.grad_accum_dtype
    (engine.py _do_optimizer_sanity_check, the accumulation dtype defaulting to the parameters'). Under ZeRO, bf16
    parameters with fp32 accumulation at stage 1 run BF16_Optimizer (fp32 gradients of the whole model) instead
    of the ZeRO optimizer: not modelled, refused. Without ZeRO (stage 0) the two dtypes must be equal (else its
    NotImplementedError): 16-bit parameters take FP16_Optimizer, fp32 ones the torch optimizer itself, bf16 ones
    under the PipelineEngine (``piped``) BF16_Optimizer (refused). Under ZeRO
    stages 2 and 3 another accumulation dtype than the parameters' keeps a per-parameter accumulator in it: not
    modelled, refused."""
    acc = ds.grad_accum_dtype
    if acc is not None and acc not in ("fp32", "bf16", "fp16"):
        raise SettingsError(f"grad_accum_dtype must be fp32, bf16 or fp16, got {quote(acc)}")
    if strat.framework != "deepspeed":
        if acc is not None or ds.communication_data_type is not None:
            flag = "--grad-accum-dtype" if acc is not None else "--communication-data-type"
            raise SettingsError(f"{flag} is DeepSpeed's, not for {strat.name}")
        return
    model = {"deepspeed-bf16": "bf16", "deepspeed-fp16": "fp16"}.get(recipe.name, "fp32")
    acc = acc or model
    if acc == "fp32" and model == "bf16" and strat.zero_stage == 1 and not ds.offload_optimizer:
        raise SettingsError("data_types.grad_accum_dtype fp32 with bf16 and ZeRO stage 1: DeepSpeed 0.19.8 runs "
                            "BF16_Optimizer there (engine.py _do_optimizer_sanity_check), which memplan does not "
                            "model; use stage 2, or bf16 accumulation")
    if strat.zero_stage and acc != model:
        raise SettingsError(f"data_types.grad_accum_dtype {acc} with {model} parameters under ZeRO stage "
                            f"{strat.zero_stage}: DeepSpeed 0.19.8 then accumulates each gradient in its own {acc} "
                            "copy (stage_1_and_2.py use_grad_accum_attribute; stage3.py gradient_accumulation_dtype), "
                            "which memplan does not model; leave it to the parameters' dtype")
    if strat.zero_stage == 0 and acc != model:
        raise SettingsError(f"stage 0 with {model} parameters and {acc} gradient accumulation: DeepSpeed 0.19.8 "
                            "refuses the mix (engine.py _do_optimizer_sanity_check: NotImplementedError)")
    if strat.zero_stage in (1, 2) and ds.overlap_comm and piped:
        notes.append("overlap_comm under --pp: DeepSpeed turns it off for a PipelineModule (engine.py "
                     "_configure_zero_optimizer: \"Pipeline parallelism does not support overlapped communication, "
                     "will be disabled\"): memplan runs it off")
    if strat.zero_stage == 0 and model == "bf16" and piped:
        raise SettingsError("stage 0 with bf16 under --pp: DeepSpeed 0.19.8's PipelineEngine runs BF16_Optimizer "
                            "there (engine.py _do_optimizer_sanity_check), which memplan does not model; use "
                            "ZeRO stage 1")
    comm = ds.communication_data_type
    if comm is not None and comm not in ("fp32", "bf16", "fp16"):
        raise SettingsError(f"communication_data_type must be fp32, bf16 or fp16, got {quote(comm)}")
    if comm is not None and comm != model and strat.zero_stage:
        notes.append(f"communication_data_type {comm}: ZeRO stage {strat.zero_stage} reduces each bucket through a "
                     f"{comm} copy (stage_1_and_2.py allreduce_bucket / gradient_reduction_w_predivide, stage3.py "
                     "__avg_scatter_grads), a transient of up to reduce_bucket_size elements not counted (measured "
                     "with the harness at small buckets: no change to the peak, docs/accuracy.md)")
    if strat.zero_stage == 0 and model != "fp32":
        notes.append(f"stage 0 with {model}: {model} gradients copied to fp32 for the step (engine.py "
                     "_do_optimizer_sanity_check), by FP16_Optimizer where DeepSpeed builds its FusedAdam (no "
                     "--optimizer-impl, on CUDA) and by FP16_UnfusedOptimizer around a torch optimizer (an "
                     "--optimizer-impl named: torch.optim's; engine.py _configure_fp16_optimizer)")


def _reduce_path_notes(ds: DeepSpeedKnobs, strat: Any) -> list[str]:
    """DeepSpeed ZeRO-1/2's reduce path off its defaults (stage_1_and_2.py average_tensor, 0.19.8). The default
    flattens the bucket's slices into one copy to all-reduce (allreduce_and_scatter -> allreduce_bucket);
    reduce_scatter false all-reduces the bucket in place (gradient_reduction_w_predivide: a copy only to change
    dtype); use_multi_rank_bucket_allreduce false flattens each owner's slices and reduces them to it
    (allreduce_no_retain), one owner at a time. Neither allocates more than the default path, which the figure
    models; measured alike on CPU (docs/accuracy.md session 12)."""
    off = [k for k, v in (("reduce_scatter", ds.reduce_scatter),
                          ("use_multi_rank_bucket_allreduce", ds.multi_rank_bucket_allreduce)) if not v]
    if not off or strat.framework != "deepspeed":
        return []
    if strat.zero_stage not in (1, 2):
        return [f"{' and '.join(off)} false: DeepSpeed reads it in ZeRO stages 1 and 2 only (stage_1_and_2.py); "
                f"no effect under {strat.name}"]
    if not ds.reduce_scatter:
        return ["reduce_scatter false: each gradient bucket is all-reduced in place (no flattened copy, "
                "stage_1_and_2.py gradient_reduction_w_predivide); memory counted as the default path's, which holds "
                "the same or more (measured alike on CPU); communication: an all-reduce, as the default"
                + ("; use_multi_rank_bucket_allreduce has no effect then" if not ds.multi_rank_bucket_allreduce
                   else "")]
    return ["use_multi_rank_bucket_allreduce false: each bucket's slices are reduced to their owner rank, one "
            "flattened copy per owner (stage_1_and_2.py allreduce_no_retain): memory counted as the default path's "
            "one flattened copy of the whole bucket, the same or more (measured alike on CPU); communication: a "
            "reduce-scatter's volume, half the default's all-reduce"]


def _zeropp_notes(ds: DeepSpeedKnobs, strat: Any, gpus: int, per_node: int) -> list[str]:
    """What ZeRO++'s quantized collectives change, and what memplan's figures for them rest on."""
    out = []
    if (ds.quantized_weights or ds.quantized_gradients) and strat.zero_stage != 3:
        out.append("zero_quantized_weights / zero_quantized_gradients act in ZeRO stage 3 only (stage3.py, "
                   "partition_parameters.py); this job does not use them")
        return out
    if ds.quantized_weights:
        out.append("ZeRO++ qwZ: each all-gather moves int8 weights with an fp32 scale per group, dequantizes to "
                   "fp16 and casts each parameter to its dtype (partition_parameters.py, DeepSpeed 0.19.8): the "
                   "gathered parameters hold what they hold without it, plus the int8 buffers, the fp16 copy and "
                   "the casts while a gather is in flight; derived from the source, not measured (its quantizer "
                   "kernels need CUDA); the communication counts int8 weights and their scales")
    if ds.quantized_gradients:
        if gpus // max(per_node, 1) <= 1:
            out.append("ZeRO++ qgZ acts across nodes only (stage3.py __avg_scatter_grads: num_nodes > 1): on one "
                       "node gradients are reduced as without it")
        else:
            out.append("ZeRO++ qgZ: the int4 all-to-all buffers of the largest gradient are added where gradients "
                       "are reduced (coalesced_collectives.py all_to_all_quant_reduce), and the communication counts "
                       "its int4 all-to-alls within and across nodes; derived from the source, not measured (CUDA "
                       "kernels)")
    return out


def _torch_knobs(overrides: dict[str, Any], strat: Any) -> TorchKnobs:
    tk = TorchKnobs(**{k: v for k, v in overrides.items() if v is not None},
                    bucket_cap_default=overrides.get("bucket_cap_mb") is None)
    if tk.hsdp_shard_size is not None and tk.hsdp_shard_size < 1:
        raise SettingsError(f"--hsdp-shard-size must be at least 1, got {tk.hsdp_shard_size}")
    if tk.bucket_cap_mb <= 0:
        raise SettingsError(f"--bucket-cap-mb must be positive, got {tk.bucket_cap_mb}")
    if tk.fsdp_version not in (1, 2):
        raise SettingsError(f"--fsdp-version must be 1 or 2, got {tk.fsdp_version}")
    if tk.fsdp_root_reshard not in ("same", "auto"):
        raise SettingsError(f"--fsdp-root-reshard must be same or auto, got {quote(tk.fsdp_root_reshard)}")
    if tk.fsdp_wrap not in FSDP_WRAPS:
        tk = replace(tk, fsdp_wrap=_class_wrap_text(tk.fsdp_wrap) if str(tk.fsdp_wrap).startswith("class:")
                     else size_wrap(tk.fsdp_wrap))
    fsdp = strat.framework.startswith("fsdp")
    either = tk.fsdp_wrap == "none" or tk.fsdp_wrap.startswith(("size:", "class:"))  # FSDP1 and FSDP2
    if tk.fsdp_wrap != "block" and not (fsdp and (tk.fsdp_version == 2 or either)):
        raise SettingsError(f"--fsdp-wrap {tk.fsdp_wrap} is for "
                            + ("FSDP2 (--strategy fsdp-*, hsdp)" if not either else "FSDP")
                            + f", not {strat.name}" + (" with --fsdp-version 1" if fsdp else ""))
    if tk.cpu_offload and not strat.framework.startswith("fsdp"):
        raise SettingsError(f"--cpu-offload is FSDP's CPUOffloadPolicy, not for {strat.name} (DeepSpeed offloads "
                            "with --offload-optimizer / --offload-param)")
    return tk


def _horovod_knobs(overrides: dict[str, Any], strat: Any, sources: dict[str, str], notes: list[str]) -> Any:
    """Horovod's fusion threshold (command line, else HOROVOD_FUSION_THRESHOLD, else 128 MiB), compression."""
    import os

    from memplan.settings import HorovodKnobs

    given = {k: v for k, v in overrides.items() if v is not None}
    if given and strat.framework != "horovod":
        raise SettingsError(f"--horovod-* options are Horovod's, not for --strategy {strat.name}")
    if strat.framework != "horovod":
        return HorovodKnobs()
    env = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if "fusion_threshold" not in given and env is not None:
        try:
            given["fusion_threshold"] = int(env)  # std::strtol in operations.cc: bytes
        except ValueError:
            raise SettingsError(f"HOROVOD_FUSION_THRESHOLD={quote(env)} is not a byte count") from None
        sources["horovod_fusion_threshold"] = "environment (HOROVOD_FUSION_THRESHOLD)"
        notes.append(f"Horovod fusion threshold {given['fusion_threshold']:,} B from HOROVOD_FUSION_THRESHOLD")
    if given.get("fusion_threshold", 0) < 0:
        raise SettingsError(f"Horovod fusion threshold must not be negative, got {given['fusion_threshold']}")
    if given.get("compression", "none") not in ("none", "fp16"):
        raise SettingsError(f"--horovod-compression must be none or fp16, got {quote(given['compression'])}")
    return HorovodKnobs(**given)


def _overheads(overrides: dict[str, Any]) -> tuple[Overheads, int | None]:
    """The overheads given, and the cuBLAS workspace if given (it goes to the cluster)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    workspace = given.pop("blas_workspace_bytes", None)
    ov = Overheads(**given)
    for k in ("cuda_context_bytes", "nccl_bytes_per_communicator", "fragmentation_percent"):
        if getattr(ov, k) is not None and getattr(ov, k) < 0:
            raise SettingsError(f"{k.replace('_', '-')} must not be negative, got {getattr(ov, k)}")
    return ov, workspace


def _per_node(gpus: int, gpus_per_node: int | None) -> int:
    """GPUs per node: the user's, else 8 (a DGX/HGX node), fewer when the job is smaller."""
    return gpus_per_node if gpus_per_node is not None else min(gpus, 8) or 1


def _cluster(asked: Any, host_memory_size: str | None, workspace: int | None, notes: list[str]) -> Cluster:
    """The cluster the request's (memplan/request.py Cluster) describes."""
    gpus, gpus_per_node, gpu, gpu_memory_size = asked.gpus, asked.gpus_per_node, asked.gpu, asked.gpu_memory
    device, gpu_arch, cpu_isa = asked.device, asked.gpu_arch, asked.cpu_isa
    mem, how = gpu_memory(gpu, gpu_memory_size)
    if how:
        notes.append(f"GPU memory: {how}")
    if workspace is None and gpu:
        workspace = gpu_presets()[gpu.lower()].blas_workspace_bytes
    elif workspace is None and device == "cuda":
        notes.append("cuBLAS workspace: 32 MiB per handle assumed (the sm90 default); --gpu NAME or "
                     "--cublas-workspace SIZE sets it")
    preset = gpu_presets()[gpu.lower()] if gpu else None
    arch = gpu_arch or (preset.arch if preset else "sm90")
    # the preset's own multiprocessors, unless --gpu-arch names another architecture than the preset's
    shape = preset if preset and not gpu_arch else None
    sms, threads = (shape.multiprocessors, shape.max_threads_per_multiprocessor) if shape else (0, 0)
    if device == "cuda" and not gpu and not gpu_arch:
        notes.append("GPU architecture: sm90 assumed (H100-class kernels); --gpu NAME sets it")
    if cpu_isa is not None:
        from memplan.activations.kernels import CPU_ISAS

        if cpu_isa not in CPU_ISAS:
            raise SettingsError(f"--cpu-isa must be one of {', '.join(CPU_ISAS)}, got {quote(cpu_isa)}")
        if device != "cpu":
            raise SettingsError("--cpu-isa applies to --device cpu")
    host_mem = parse_size(host_memory_size)[0] if host_memory_size else None
    return Cluster(gpus=gpus, gpus_per_node=_per_node(gpus, gpus_per_node),
                   gpu_memory_bytes=mem, device=device, gpu_arch=arch, gpu_multiprocessors=sms,
                   gpu_threads_per_multiprocessor=threads, cpu_isa=cpu_isa, host_memory_bytes=host_mem,
                   **({} if workspace is None else {"blas_workspace_bytes": workspace}))


def _dim0_padding_note(inv: ParamInventory, s: Settings, ep: int = 1) -> list[str]:
    """FSDP2 pads each parameter's dim 0 up to a multiple of the shard group (_fsdp_param.py: the padded sharded
    size), so tensors with a short dim 0 (MoE experts stacked as [num_experts, ...], norms) grow on many ranks
    and the per-GPU bytes can rise with the GPU count. Say so where padding is over 5% of the rank's shard."""
    from memplan import layouts
    from memplan.settings import shard_group_size
    from memplan.strategies import PER_PARAM_DIM0

    if s.strategy.layout != PER_PARAM_DIM0:
        return []
    n = shard_group_size(s)
    if n < 2:
        return []
    if ep > 1:
        # the routed experts are sharded over their own group (efsdp), on dim 1 where it outnumbers the local
        # experts (parallel/expert.py): only the rest pads over the shard group
        rest = tuple(t for t in inv.tensors if not (t.category == "experts" and len(t.shape) == 3))
        inv = replace(inv, tensors=rest)
    padded = layouts.layout_sizes(inv, PER_PARAM_DIM0, n).shard_numel
    real = -(-inv.num_params // n)
    if padded * 100 <= real * 105:
        return []
    worst = max((t for t in inv.tensors if t.shape and t.shape[0] % n),
                key=lambda t: (-(-t.shape[0] // n) * n - t.shape[0]) * (t.numel // t.shape[0]), default=None)
    example = (f"; e.g. {worst.name} {list(worst.shape)}: dim 0 = {worst.shape[0]} padded to "
               f"{-(-worst.shape[0] // n) * n}" if worst is not None else "")
    return [f"FSDP2 pads each parameter's dim 0 to a multiple of the shard group ({n}): "
            f"{100 * (padded - real) / padded:.1f}% of each rank's shard is padding{example}; fewer ranks per "
            "shard group (HSDP), or fully_shard(shard_placement_fn=...) sharding those tensors on another dim, "
            "avoids it"]


def _buffers_note(inv: ParamInventory, s: Settings) -> list[str]:
    """The model's buffers where they reach 1 MiB a GPU (a rotary inv_freq's few hundred bytes go unsaid)."""
    size = inv.buffer_bytes(s.recipe.half_buffers)
    if size < 1 << 20:
        return []
    from memplan.units import fmt_bytes

    big = max(inv.buffers, key=lambda t: t.numel)
    return [f"model buffers: {len(inv.buffers)} ({fmt_bytes(size)}; largest {big.name} {list(big.shape)}), whole "
            "on every GPU and counted with the weights: buffers are not parameters, so no strategy shards them"]


def _fsdp1_lora(inv: ParamInventory, s: Settings) -> list[str]:
    """FSDP1 (use_orig_params=False) under PEFT: the HF Trainer wraps with PEFT's fsdp_auto_wrap_policy
    (model/wrap_units.py peft_policy) whatever the job's policy, and a FlatParameter must not mix frozen and
    trainable parameters (_flat_param.py _validate_tensors_to_flatten: "Must flatten tensors with uniform
    requires_grad when use_orig_params=False")."""
    from memplan.model import wrap_units

    if inv.param_adapted:
        # measured (torch 2.13, PEFT 0.21, 2 gloo ranks, Mixtral all-linear): the parametrization PEFT registers
        # each forward writes through the FlatParameter's views: "Output 0 of View is a view and its base ... has
        # been modified inplace"
        raise SettingsError(f"LoRA on {len(inv.param_adapted)} parameters (lora.ParamWrapper: fused MoE experts "
                            "or target_parameters) under FSDP1: the run fails (torch's parametrize on a "
                            "FlatParameter's view is modified in place); --fsdp-version 2 or DeepSpeed run it")
    if s.torch.fsdp_wrap != "block":
        raise SettingsError(f"--fsdp-wrap {s.torch.fsdp_wrap} with LoRA under FSDP1: the HF Trainer replaces the "
                            "auto-wrap policy with PEFT's fsdp_auto_wrap_policy for a PEFT model (each block, and "
                            "each adapter on its own); leave --fsdp-wrap at block")
    if s.recipe.grad_bytes != s.recipe.param_bytes:
        # measured (torch 2.13, PEFT 0.21, 2 gloo ranks): PEFT casts each adapter's input to its lora_A.weight's
        # dtype (tuners_utils.py _cast_input_dtype), which FSDP1 shows as the stored flat parameter's until the
        # unit unshards it in MixedPrecision's param_dtype: "expected m1 and m2 to have the same dtype"
        raise SettingsError(f"--precision {s.recipe.name} with LoRA under FSDP1: PEFT casts each adapter's input "
                            "to the dtype its FlatParameter is stored in, and MixedPrecision then computes in "
                            "another (runs need torch.autocast beside it, as Accelerate adds: not modelled); "
                            "--precision fp32 or pure-bf16 (FSDP-QLoRA: a bf16 model, --quant-storage bfloat16), "
                            "or --fsdp-version 2")
    mixed = wrap_units.mixed_unit(wrap_units.with_units(inv, wrap_units.peft_policy(inv)))
    if mixed is not None:
        unit, frozen, trainable = mixed
        raise SettingsError(f"FSDP1 unit {unit} would flatten frozen {frozen} with trainable {trainable}: "
                            "use_orig_params=False needs uniform requires_grad (a trainable bias, lora bias "
                            "'all' or 'lora_only', on a frozen layer); --fsdp-version 2 (fully_shard) takes it")
    return ["FSDP1 under PEFT: PEFT's fsdp_auto_wrap_policy, as the HF Trainer sets it (each block one frozen "
            "FlatParameter, each lora_A / lora_B its own trainable one). Two upper bounds: a block's adapters are "
            "reduced together at its backward's end (FSDP1 reduces each as its own backward ends), and the block "
            "before is counted gathered through a block's whole backward (FSDP1's backward prefetch reaches it only "
            "at the block's first adapter, late in that backward)"]


def _fsdp1_frozen(units: ParamInventory) -> None:
    """--freeze under FSDP1: each FlatParameter frozen or trainable as a whole (use_orig_params=True would take a
    mixed one, its gradient covering the frozen part too: not modelled)."""
    from memplan.model import wrap_units

    mixed = wrap_units.mixed_unit(units)
    if mixed is not None:
        unit, frozen, trainable = mixed
        raise SettingsError(f"FSDP1 unit {unit} holds frozen {frozen} beside trainable {trainable}: a FlatParameter "
                            "that mixes them is not modelled (use_orig_params=True gives it a gradient of its whole "
                            "size); --fsdp-version 2 (fully_shard) is")


def _with_lora(config: dict[str, Any] | None, inv: ParamInventory, s: Settings, spec: Any,
               notes: list[str]) -> dict[str, Any] | None:
    """LoRA's checks and notes; the config the traced step adds the same adapters from."""
    from memplan import frameworks

    why = frameworks.model(s.strategy.memory_model).frozen_why_not
    if why:
        raise SettingsError(why)
    if not inv.frozen:
        raise SettingsError("internal: a LoRA job needs the adapted inventory (memplan.model.lora.apply)")
    if s.strategy.memory_model == "fsdp1":
        notes.extend(_fsdp1_lora(inv, s))
    notes.extend(spec.notes)
    stored = "4-bit (below)" if spec.quantize else "as the recipe stores parameters"
    notes.append(f"{spec.describe()} ({spec.source}): frozen base weights stored {stored}, "
                 "no gradients or optimizer states for them; adapters train in the recipe's dtypes")
    if spec.quantize:
        notes.extend(_qlora_notes(inv, s, spec))
    if s.recipe.adapter_bytes:
        notes.append("LoRA on a bf16 base: PEFT upcasts the adapters to fp32 (get_peft_model's "
                     "autocast_adapter_dtype=True), so their weights, gradients, reduce buckets and optimizer states "
                     "are fp32 (the other trainable tensors, modules_to_save copies and biases, stay bf16 and are "
                     "counted fp32: an upper bound), and each adapted layer casts its input to fp32 for them")
    elif s.recipe.name == "pure-bf16":
        notes.append("LoRA under pure-bf16: adapters taken in bf16; PEFT's default (autocast_adapter_dtype=True) "
                     "upcasts them to fp32, 2 bytes more per adapter element for weights, grads and each state")
    lora_fields = {**spec.trace_fields(), **({"adapter_dtype": "float32"} if s.recipe.adapter_bytes else {})}
    if spec.quantize and not s.recipe.adapter_bytes:
        # the adapters next to a 4-bit base compute in the dtype their weights have then (the gradients'): fp32
        # as PEFT upcasts them, unless the framework casts them to 16 bits (DeepSpeed's engine casts every
        # parameter, FSDP's MixedPrecision unshards them in its param_dtype) or the job keeps them in bf16
        # (measured: QLoRA under FSDP2 pure-bf16 and ZeRO-2/3, the adapters' outputs and inputs in bf16)
        rc = s.recipe
        lora_fields["adapter_dtype"] = "float32" if rc.grad_bytes == 4 else rc.half_dtype
    return None if config is None else {**config, "lora": lora_fields}


def lora_recipe(recipe: Any, strategy: Any) -> Any:
    """The recipe of a LoRA job: on a half-precision base without a wrapper that casts the module (pure-bf16 under
    DDP or one GPU), PEFT's get_peft_model upcasts the adapters to fp32 (autocast_adapter_dtype=True,
    peft/tuners/tuners_utils.py cast_adapter_dtype: lora_A/lora_B only); torch.optim keeps their states and
    DDP its buckets in their dtype, so the trainable side is fp32. DeepSpeed casts the whole module to its 16-bit
    dtype after PEFT (engine.py), FSDP's MixedPrecisionPolicy casts for compute: they keep the recipe."""
    if recipe.param_bytes != 2 or recipe.master_bytes or strategy.memory_model != "ddp":
        return recipe
    return replace(recipe, grad_bytes=4, reduced_grad_bytes=4, state_bytes=4, adapter_bytes=4,
                   description=recipe.description + "; LoRA adapters fp32 (PEFT's upcast), with fp32 grads and "
                                                    "states")


#: FSDP2's units (--fsdp-wrap): each decoder block then the root; torchtitan's (the input embedding, each block,
#: the final norm with the head, the root); only the root
from memplan.jobfiles import ACCELERATE_FSDP2_WRAP, _Fsdp2ClassWrap, _Fsdp2SizeWrap  # noqa: E402

FSDP_WRAPS = ("block", "block+embeddings", "none")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def _class_wrap_text(text: str) -> str:
    """``class:A,B`` (transformer_auto_wrap_policy / ModuleWrapPolicy over those module classes) in one spelling."""
    names = list(dict.fromkeys(x.strip() for x in str(text)[6:].split(",") if x.strip()))
    if not names:
        raise SettingsError(f"--fsdp-wrap class:NAME[,NAME] needs at least one module class, got {quote(text)}")
    return "class:" + ",".join(names)


def _with_class_wrap(s: Settings, inv: ParamInventory, config: Any, notes: list[str]) -> Settings:
    """Resolve ``--fsdp-wrap class:A,B`` with the model's module tree (transformers' model on the meta device):
    every module of those classes is a unit, nested ones too (torch's transformer_auto_wrap_policy). A class no
    module has is an error naming the classes the model has (Accelerate: "Could not find the transformer layer
    class"); exactly the decoder blocks is --fsdp-wrap block."""
    if not s.torch.fsdp_wrap.startswith("class:"):
        return s
    paths = _class_paths(inv, config, s.torch.fsdp_wrap[6:].split(","))
    if set(paths) == {b.name for b in inv.layer_blocks}:
        notes.append(f"--fsdp-wrap {s.torch.fsdp_wrap}: the decoder blocks, as --fsdp-wrap block")
        return replace(s, torch=replace(s.torch, fsdp_wrap="block"))
    return replace(s, torch=replace(s.torch, fsdp_wrap_modules=paths))


def _class_paths(inv: ParamInventory, config: Any, wanted: list[str]) -> tuple[str, ...]:
    """The paths of the modules of the ``wanted`` classes (transformers' model on the meta device); a class no
    module has is an error naming the classes the model has."""
    from memplan.model import module_tree, z3_leaf

    z3_leaf.needs_config(config, "--fsdp-wrap class:...")
    by_class: dict[str, list[str]] = {}
    for m in module_tree.modules(config):
        if m.path and m.has_params:
            by_class.setdefault(m.cls, []).append(m.path)
    missing = [w for w in wanted if w not in by_class]
    if missing:
        raise SettingsError(f"FSDP wrap class {', '.join(missing)}: no such module in {inv.model_name}; its classes "
                            f"with parameters: {', '.join(sorted(by_class))}")
    return tuple(sorted({p for w in wanted for p in by_class[w]}))


def size_wrap(text: str) -> str:
    """``size:N`` (torch's size_based_auto_wrap_policy, min_num_params=N; model/wrap_units.py) in its one spelling,
    N an integer number of parameters: 100000000, 1e8 or 100M."""
    head, _, num = str(text).partition(":")
    valid = f"one of {', '.join(FSDP_WRAPS)}, size:N (N parameters) or class:NAME[,NAME]"
    if head != "size" or not num:
        raise SettingsError(f"--fsdp-wrap must be {valid}, got {quote(text)}")
    import math
    import re

    low = num.strip().lower()
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]{1,4})?)([a-z]?)", low)  # ASCII digits only
    mult = (_SUFFIX.get(m.group(2)) if m.group(2) else 1) if m else None
    value = float(m.group(1)) * mult if m and mult else math.nan
    if not math.isfinite(value) or value != int(value):
        raise SettingsError(f"--fsdp-wrap size:N needs N a whole number of parameters (100000000, 1e8, 100M), "
                            f"got {quote(text)}")
    if value <= 0:
        raise SettingsError(f"--fsdp-wrap size:N needs N above zero (min_num_params), got {quote(text)}")
    if value > 1e15:
        raise SettingsError(f"--fsdp-wrap size:N: N {quote(num)} is more parameters than any model has (at most "
                            "10^15)")
    return f"size:{int(value)}"


def _size_wrap_notes(inv: ParamInventory, s: Settings) -> list[str]:
    """What --fsdp-wrap size:N / class:... makes of this model, and where the figure is an upper bound
    (docs/accuracy.md)."""
    from memplan.model import wrap_units

    n = wrap_units.policy_of(s)
    if n is None or not s.strategy.framework.startswith("fsdp"):
        return []
    units = wrap_units.units_for(inv, s)
    made = sorted({t.unit.removeprefix(wrap_units.HELD) for t in units.tensors}, key=len)
    head = f"--fsdp-wrap {s.torch.fsdp_wrap}: {len(made)} unit(s) ({', '.join(made[:3])}{', ...' if len(made) > 3 else ''})"
    split = wrap_units.split_tied(inv, n)
    if split:
        return [f"{head}; the tied weight {split[0]} is split between {split[1]} and {split[2]} (FSDP1's limited "
                "shared-parameter support): counted as the root alone (--fsdp-wrap none's timeline), an upper bound"]
    if wrap_units.root_only(units):
        return [f"{head}; no unit inside a decoder block, so every unit is held from the forward to the end of "
                "backward: counted as the root alone (--fsdp-wrap none's timeline)"]
    return [f"{head}; units above the blocks are counted as the root (held from forward to backward's end) and the "
            "units inside a block as the whole block gathered at once: an upper bound where a block holds several"]


def _accelerate_fsdp2_size(inv: ParamInventory, n: int, notes: list[str]) -> str:
    """Accelerate 1.15's FSDP2 SIZE_BASED_WRAP (utils/fsdp_utils.py fsdp2_prepare_auto_wrap_policy and
    fsdp2_prepare_model): fully_shard on every module but the root, bottom up, whose parameters number more than
    min_num_params. That includes the decoder stack's nn.ModuleList as soon as it is that large, and fully_shard
    refuses containers without a forward (torch _fsdp_init.py _validate_module: "fully_shard does not support
    containers that do not implement forward"), so such a job fails in accelerator.prepare. Below that size no
    block is a unit: modelled as the root alone (its embedding and head units counted in the root)."""
    from memplan.model.wrap_units import containers

    big = [(path, numel) for path, numel in containers(inv) if numel > n]
    if big:
        path, numel = big[0]
        raise SettingsError(f"Accelerate FSDP2 SIZE_BASED_WRAP with min_num_params {n:,} fails: it calls fully_shard "
                            f"on {path} (an nn.ModuleList of {numel:,} parameters), which fully_shard refuses "
                            "(containers without forward); use TRANSFORMER_BASED_WRAP, or FSDP1 (fsdp_version 1)")
    notes.append(f"Accelerate FSDP2 SIZE_BASED_WRAP (min_num_params {n:,}): no decoder block is large enough to be a "
                 "unit; modelled as the root alone (--fsdp-wrap none), which counts the modules Accelerate shards "
                 "apart (the embedding, the head) in the root: an upper bound")
    return "none"


def _accelerate_fsdp2_wrap(inv: ParamInventory, notes: list[str]) -> str:
    """Accelerate 1.15's FSDP2 units with TRANSFORMER_BASED_WRAP (utils/fsdp_utils.py fsdp2_prepare_model): each
    decoder layer, the input embedding its own unit resharded after forward, the final norm with the head one unit
    not resharded after forward: --fsdp-wrap block+embeddings. A tied input embedding joins the head's unit,
    which then runs from the embedding's forward to its backward as the root does: --fsdp-wrap block."""
    from memplan.model.inventory import ROOT_BLOCK

    if any(t.tied_names for t in inv.tensors):
        notes.append("Accelerate FSDP2 (TRANSFORMER_BASED_WRAP): the tied input embedding joins the final norm and "
                     "head's unit, unsharded from the embedding's forward to its backward (--fsdp-wrap block)")
        return "block"
    before = []
    for t in inv.tensors:
        if t.block != ROOT_BLOCK:
            break
        before.append(t)
    if len(before) != 1 or before[0].category != "embedding":
        notes.append("Accelerate FSDP2 (TRANSFORMER_BASED_WRAP): parameters before the decoder layers besides the "
                     f"input embedding ({', '.join(t.name for t in before)}) stay in the root; memplan keeps the "
                     "embedding there too (--fsdp-wrap block), over-counting it after forward")
        return "block"
    notes.append("Accelerate FSDP2 (TRANSFORMER_BASED_WRAP): each decoder layer, the input embedding and the final "
                 "norm with the head are fully_shard units (--fsdp-wrap block+embeddings)")
    return "block+embeddings"


def _optimizer_notes(inv: ParamInventory, s: Settings) -> list[str]:
    """What the optimizer's step allocates that memplan does not count (Optimizer.cuda_uncounted); an optimizer
    whose states follow its tensors' shapes (Adafactor, bitsandbytes 8-bit): what the framework hands it, or why it
    cannot step them."""
    from memplan import frameworks

    opt, fw = s.optimizer, frameworks.model(s.strategy.memory_model)
    if opt.cuda_uncounted and s.cluster.device != "cpu":
        return [f"optimizer {opt.name}: {opt.cuda_uncounted}"]
    if not opt.shape_dependent:
        return []
    if fw.shaped_optimizer_why_not:
        raise SettingsError(f"--optimizer {opt.name} under --strategy {s.strategy.name}: "
                            f"{fw.shaped_optimizer_why_not}")
    handed = fw.optimizer_tensors(frameworks.Job.of(inv, s, fw))
    if any(len(shape) > 1 for shape, _ in handed) or not any(len(t.shape) > 1 for t in inv.tensors):
        return []
    what = ("Adafactor cannot factor them: a full fp32 second moment, 4 B per element" if opt.factored else
            "bitsandbytes quantizes each as one tensor (256-element blocks)")
    return [f"{opt.name} under {s.strategy.name}: the optimizer is handed flat 1-D tensors (DeepSpeed's fp32 "
            f"partitions, FSDP1's FlatParameter shards), so {what}"]


def _qlora_notes(inv: ParamInventory, s: Settings, spec: Any) -> list[str]:
    """A 4-bit base (QLoRA): where memplan models it, and what it assumes (the framework's FourBitBase)."""
    from memplan import frameworks

    fb, storage = frameworks.model(s.strategy.memory_model).four_bit, spec.quant_storage
    if storage == "uint8" and fb.uint8_why_not:
        raise SettingsError(f"--quantize-base under --strategy {s.strategy.name} with a uint8 storage: "
                            f"{fb.uint8_why_not}")
    if not inv.quantized:
        raise SettingsError("internal: a QLoRA job needs the quantized inventory (memplan.model.lora.apply)")
    where = fb.uint8
    if storage != "uint8":
        stored = s.recipe.stored_dtype
        if storage != stored:
            raise SettingsError(f"--quant-storage {storage} under --precision {s.recipe.name}: the packed 4-bit "
                                f"weights are parameters like the rest, stored {stored} by this recipe; give "
                                f"--quant-storage {stored}, or the recipe that stores {storage} (bnb_4bit_quant_storage "
                                "is the dtype the model is loaded in: torch_dtype)")
        why = fb.cast_why(s.recipe)
        if why:
            raise SettingsError(f"--quant-storage {storage} under --precision {s.recipe.name}: {why}")
        where = f"packed into {storage} parameters (bnb_4bit_quant_storage), {fb.packed}"
    if fb.loaded_whole:
        where += ("; the model is loaded whole onto every GPU first (transformers' bitsandbytes quantizer: "
                  "device_map {'': current device}, no zero.Init or meta-device load for a quantized model), "
                  "then sharded: the reserved-peak replay includes that load")
    return [f"{spec.quantize} base: bitsandbytes 0.50 Linear4bit storage, blocksize 64"
            f"{', double quantization' if spec.double_quant else ''}, {where}; "
            f"the other parameters (embeddings, norms, head, adapters) in the recipe's dtype ({s.recipe.name}, "
            f"{8 * s.recipe.param_bytes}-bit; peft's prepare_model_for_kbit_training leaves them fp32, as torch-amp "
            "does)",
            f"4-bit layers: bnb_4bit_compute_dtype {spec.compute_dtype} (BitsAndBytesConfig's own default is "
            "float32: --quant-compute-dtype); each casts its input to it, dequantizes its weight into it for its "
            "forward GEMM and again for its backward (bitsandbytes MatMul4Bit), and saves nothing of its input; on CUDA the forward dequantization is counted for any "
            "token count, though bitsandbytes' fused kernel skips it for up to 1,536 tokens on some GPUs (an "
            "upper bound there)"] + ([] if s.recompute != "none" else [
                "QLoRA without recompute: peft's prepare_model_for_kbit_training turns gradient checkpointing on "
                "unless told not to (use_gradient_checkpointing=True); --recompute full models that"])


def resolve(inv: ParamInventory, request: JobRequest, *, config: dict[str, Any] | None = None,
            trace: bool = True) -> Resolved:
    """The job's Settings from the request (memplan/request.py): each option from the command line, the job's
    files or a default (``sources`` says which). ``inv`` already carries the request's LoRA adapter
    (lora.apply), which the traced step adds too. ``config``: the model's config.json, for the trace.
    ``trace`` False: a model-parallel job whose rank profiles are not cached is refused instead of traced (the 'to
    fit' suggestions keep an estimate free of torch)."""
    from memplan import jobfiles

    # the dtype the model's config stores, which transformers 5 loads it in (jobfiles.precision_for)
    model_dtype = inv.tensors[0].dtype if inv.tensors else None
    r, notes, files = jobfiles.merged(request, inv.dims.get("hidden_size"), model_dtype)
    gpus, gpus_per_node, device = r.cluster.gpus, r.cluster.gpus_per_node, r.cluster.device
    stage, strategy, seq_len = r.training.stage, r.training.strategy, r.batch.seq_len
    lora, parallel = r.adapters.spec, r.parallel.build()
    pick = _Picker(r)
    # expert parallelism runs under FSDP2 only (parallel.py _check_ep): without a strategy given, that one
    ep = parallel is not None and parallel.ep > 1
    default = "zero3" if r.files.deepspeed else "fsdp-full" if ep else "single" if gpus == 1 else "ddp"
    strat = get_strategy(pick("strategy", default, STAGE_TO_STRATEGY[stage] if stage is not None else strategy,
                              "stage" if stage is not None else "strategy"))
    if pick.sources["strategy"] == "default" and ep:
        notes.append("strategy: fsdp-full, the one memplan runs expert parallelism under (FSDP2 over the expert-FSDP "
                     "ranks, as torchtitan runs EP); --strategy names it explicitly")
    if pick.sources["strategy"] == "default" and strat.one_gpu:
        notes.append("strategy: one GPU, plain PyTorch (no DDP wrapper, so no reducer buckets); --strategy ddp "
                     "models DDP's buckets")
    if strat.one_gpu and gpus != 1:
        raise SettingsError(f"--strategy {strat.name} runs on one GPU, not {gpus}: give a data-parallel strategy "
                            "(ddp, zero1-3, fsdp-full, hsdp, ...)")
    recipe, float8 = _recipe(pick("precision", DEFAULT_RECIPE[strat.framework]), strat)
    float8 = _float8(r, recipe, float8)
    if recipe.autocast and recipe.param_bytes == 2:  # a 16-bit model trained as loaded, under autocast
        from memplan import frameworks

        why = frameworks.model(strat.memory_model).half_autocast_why_not
        if why:
            raise SettingsError(f"--precision {recipe.name} under {strat.name}: a 16-bit model under autocast is "
                                f"how plain PyTorch and DDP run it; {why}")
    if recipe.name == "pure-bf16" and strat.fp32_master_copy:
        # ZeRO-1/2 (stage_1_and_2.py) and ZeRO-3 keep an fp32 master partition and fp32 Adam states unless the bf16
        # section sets bf16_master_weights_and_grads (and bf16_optimizer_states, which needs it:
        # runtime/base_optimizer.py _configure_master_weights): "everything in bf16" is that setting, not modelled
        raise SettingsError(f"--precision pure-bf16 under {strat.name}: DeepSpeed keeps an fp32 master partition and "
                            "fp32 optimizer states (deepspeed-bf16) unless its bf16 section sets "
                            "bf16_master_weights_and_grads and bf16_optimizer_states, which memplan does not model "
                            "yet; use --precision deepspeed-bf16")
    opt = get_optimizer(pick("optimizer", "adamw"))
    if opt.per_tensor and (strat.layout != REPLICATED or lora is not None):
        why = {"muon": "torch.optim.Muon's Newton-Schulz needs each whole matrix, and its distributed variant's "
                       "gathers are not modelled yet",
               "adam-mini": "Adam-mini's per-head and per-row states",
               "apollo": "APOLLO projects each whole matrix's gradient (its channel scaling reads whole rows)",
               "galore": "GaLore projects each whole matrix's gradient onto its SVD (galore-torch takes the "
                         "gradient's SVD as it is handed)",
               "muon-aux-adam": "MuonWithAuxAdam orthogonalises whole matrices and all-gathers the updated "
                                "parameters over the ranks (DDP's replicas)"}[opt.per_tensor]
        raise SettingsError(f"--optimizer {opt.name} under {strat.name if lora is None else 'LoRA'}: {why}; memplan "
                            "models it on whole tensors only (one GPU, DDP, Horovod)")
    from memplan.precision import LOW_RANK_STEPS, LOW_RANK_TARGETS, low_rank_tensors, muon_aux_adam_why_not

    if opt.per_tensor == "muon":
        from memplan.precision import muon_tensors

        if not any(muon_tensors(inv)):  # torch.optim.Muon: "Muon only supports 2D parameters"
            raise SettingsError("--optimizer muon: the model has no 2-D matrices in its blocks for Muon to "
                                "orthogonalise (embeddings, the head, gains and biases go to AdamW)")
    if opt.per_tensor == "muon-aux-adam":
        if strat.framework == "horovod":
            raise SettingsError("--optimizer muon-with-aux-adam under Horovod: MuonWithAuxAdam all-gathers over "
                                "torch.distributed's process group, which Horovod does not set up")
        why = muon_aux_adam_why_not(inv, gpus, gloo=device == "cpu")
        if why:
            raise SettingsError(f"--optimizer muon-with-aux-adam on {gpus} GPU(s): {why}")

    if opt.per_tensor in LOW_RANK_STEPS and not any(low_rank_tensors(inv)):
        # transformers' _setup_low_rank_optimizer: "No target modules found for apollo_adamw" (galore_adamw)
        raise SettingsError(f"--optimizer {opt.name}: no nn.Linear module of this model matches the target "
                            f"modules {list(LOW_RANK_TARGETS)} (transformers' Trainer raises 'No target modules "
                            "found'; Conv1D and fused expert weights are not nn.Linear)")
    if opt.lazy_states or opt.any_device:
        if strat.framework == "deepspeed":
            # is_zero_supported_optimizer (deepspeed/runtime/zero/utils.py) knows torch's and DeepSpeed's Adams
            raise SettingsError(f"--optimizer {opt.name} under DeepSpeed ZeRO: DeepSpeed refuses an untested "
                                "optimizer (engine.py: add \"zero_allow_untested_optimizer\": true), and memplan "
                                "does not model it on ZeRO's flat partitions yet")
    if opt.paged:
        notes.append(f"{opt.name}: bitsandbytes keeps the states in CUDA unified memory (cudaMallocManaged), outside "
                     "PyTorch's allocator; counted on the GPU, where they stay unless memory runs short (then the "
                     "driver pages them to the host and the step slows): an upper bound on what must fit")
    mb = pick("micro_batch", 1)
    ga = pick("grad_accum", 1)
    seq = pick("seq_len", 2048)
    if config is not None and "factory" not in config:
        from memplan.model import tasks

        # a vision transformer's: its patches and class token; a BERT-style head's: at most its learned positions
        tokens = tasks.check_seq_len(config, seq_len)
        if tokens is not None and seq_len is None:
            seq = tokens
            pick.sources["seq_len"] = ("the image's patches (image_size / patch_size)^2 and class token"
                                       if tasks.task_of(config) == tasks.IMAGE else
                                       "the model's learned positions (max_position_embeddings)")
    config_checks(config, r)  # as the CLI ran them before the inventory, on the merged request
    target = images = image_size = None
    if config is not None and "factory" not in config:
        from memplan.model import tasks

        # an encoder-decoder's decoder length: its labels per sample (the encoder's length unless given)
        asked = r.batch.target_len
        if asked is not None or tasks.task_of(config) == tasks.SEQ2SEQ:  # a source only where the job has one
            asked = pick("target_len", None)
        target = tasks.check_target_len(config, asked, seq)
        if target is not None and pick.sources.get("target_len") == "default":
            pick.sources["target_len"] = "the encoder's length (--seq-len)"
        # a vision-language model's images per sample, their tokens in the sequence
        asked = r.batch.images
        if asked is not None or tasks.task_of(config) == tasks.IMAGE_TEXT:
            asked = pick("images", None)
        # a patch-grid model's image size (--image-size; its processor's default square), before the tokens it makes
        default_size = tasks.check_image_size(config, None)  # None: a model that takes no image size
        asked_size = r.batch.image_size
        if asked_size is not None or default_size is not None:
            asked_size = pick("image_size", None)
        image_size = tasks.check_image_size(config, asked_size)
        if image_size is not None:
            from memplan.model.hf import IMAGE_SIZE_KEY

            if pick.sources.get("image_size") == "default":
                pick.sources["image_size"] = ("default: the largest square transformers' Qwen2VLImageProcessor "
                                              f"makes within its max_pixels {tasks.DEFAULT_MAX_PIXELS:,}")
            if image_size != default_size:  # the default is the traced step's own (no key)
                config = {**config, IMAGE_SIZE_KEY: list(image_size)}
        images = tasks.check_images(config, asked, seq)

    torch_overrides = {k: v for k, v in _values(r.torch).items() if v is not None}
    if r.memory.pin_memory is not None:  # FSDP CPUOffloadPolicy's (DeepSpeed offload's: jobfiles.merged)
        torch_overrides["cpu_offload_pin_memory"] = r.memory.pin_memory
    ds = _ds_knobs(pick, strat)
    notes.extend(_zeropp_notes(ds, strat, gpus, _per_node(gpus, gpus_per_node)))
    notes.extend(_reduce_path_notes(ds, strat))
    piped = parallel is not None and parallel.pp > 1
    _deepspeed_wrapper(strat, recipe, ds, notes, piped)
    if piped and strat.zero_stage in (1, 2) and ds.overlap_comm:
        ds = replace(ds, overlap_comm=False)  # as DeepSpeed runs it (the note _deepspeed_wrapper adds)
    if isinstance(torch_overrides.get("fsdp_wrap"), _Fsdp2ClassWrap):  # Accelerate FSDP2 with named classes
        classes = torch_overrides["fsdp_wrap"].classes
        if set(_class_paths(inv, config, classes)) == {b.name for b in inv.layer_blocks}:
            torch_overrides["fsdp_wrap"] = ACCELERATE_FSDP2_WRAP
        else:
            torch_overrides["fsdp_wrap"] = "class:" + ",".join(classes)
            notes.append("Accelerate FSDP2 TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap "
                         f"{','.join(classes)}: those modules are units; the input embedding and the final norm with "
                         "the head, which Accelerate 1.15 makes units of their own, are counted in the root (an "
                         "upper bound)")
    if torch_overrides.get("fsdp_wrap") is ACCELERATE_FSDP2_WRAP:
        torch_overrides["fsdp_wrap"] = _accelerate_fsdp2_wrap(inv, notes)
    elif isinstance(torch_overrides.get("fsdp_wrap"), _Fsdp2SizeWrap):
        torch_overrides["fsdp_wrap"] = _accelerate_fsdp2_size(inv, torch_overrides["fsdp_wrap"].min_num_params,
                                                              notes)
    tk = _torch_knobs(torch_overrides, strat)
    hv = _horovod_knobs({"fusion_threshold": r.horovod.horovod_fusion_threshold,
                         "compression": r.horovod.horovod_compression}, strat, pick.sources, notes)
    strat = get_strategy(strat.name, tk.fsdp_version, tk.fsdp_wrap)
    notes.extend(_unread(r, strat, parallel, ds, tk))
    m = r.memory
    ov, workspace = _overheads({"cuda_context_bytes": m.cuda_context_bytes, "fragmentation_percent":
                                m.fragmentation_percent, "nccl_bytes_per_communicator": m.nccl_bytes_per_communicator,
                                "blas_workspace_bytes": m.blas_workspace_bytes})
    cluster = _cluster(r.cluster, m.host_memory, workspace, notes)
    conf = _allocator_conf(m.allocator_conf, device, notes, pick.sources)
    mem = cluster.gpu_memory_bytes
    if device == "cuda" and mem is not None and mem <= ov.cuda_context_bytes:
        raise SettingsError(f"the GPU's {mem:,} bytes are not more than the CUDA context alone "
                            f"({ov.cuda_context_bytes:,} bytes): no job runs on it (--gpu-memory is the card's "
                            "total, as torch reports it)")
    if device == "cuda" and mem is None and AllocatorConfig.parse(conf).per_process_memory_fraction < 1.0:
        notes.append("per_process_memory_fraction caps the allocator at a fraction of the card: give the card "
                     "(--gpu NAME or --gpu-memory SIZE) for the verdict to apply it")
    if lora is not None:
        recipe = lora_recipe(recipe, strat)
    from memplan.activations import OP_SAC, valid_recompute

    recompute = valid_recompute(r.training.recompute)
    settings = Settings(strategy=strat, recipe=recipe, optimizer=opt, cluster=cluster,
                        optimizer_impl=r.training.optimizer_impl,
                        micro_batch=mb, seq_len=seq, target_len=target, images=images, image_size=image_size, grad_accum=ga, recompute=recompute,
                        attention=r.training.attention, compile=r.training.compile, float8=float8,
                        float8_keep=r.training.float8_keep, float8_all_gather=r.training.float8_all_gather,
                        ds=ds, torch=tk, horovod=hv, overheads=ov, allocator_conf=conf, lora=lora,
                        frozen=inv.frozen_paths)
    notes.extend(_optimizer_notes(inv, settings))
    from memplan import frameworks

    settings = _with_class_wrap(settings, inv, config, notes)
    why = frameworks.model(strat.memory_model).wrap_why_not(inv, settings)
    if why:
        raise SettingsError(why)
    notes.extend(_size_wrap_notes(inv, settings))
    if strat.zero_stage == 3:
        settings = _with_z3_leaves(settings, inv, config, notes)
    if lora is not None:
        config = _with_lora(config, inv, settings, lora, notes)
    elif inv.frozen_paths and strat.memory_model == "fsdp1":  # --freeze (not the unreached: they require grad)
        _fsdp1_frozen(frameworks.model(strat.memory_model).units(inv, settings))
    notes.extend(_dim0_padding_note(inv, settings, parallel.ep if parallel is not None else 1))
    notes.extend(_buffers_note(inv, settings))
    if any(len(t.shape) >= 4 for t in inv.tensors):  # Conv2d/Conv3d kernels: a small CNN, -10.6% on CPU
        notes.append("convolutions: their kernels' scratch (cuDNN, oneDNN) is not modelled (docs/accuracy.md)")
    if target is not None and config is not None:
        from memplan.model.hf import TARGET_KEY

        config = {**config, TARGET_KEY: target}  # the decoder's length: the traced step's labels
    if settings.frozen and config is not None:
        from memplan.model.hf import FROZEN_KEY

        config = {**config, FROZEN_KEY: list(settings.frozen)}  # the parameters the traced step freezes
    if settings.recipe.name == "fsdp-bf16" and config is not None and "factory" not in config:
        from memplan.model import tasks
        from memplan.model.hf import INPUT_DTYPE_KEY

        if tasks.task_of(config) in (tasks.IMAGE, tasks.IMAGE_TEXT):
            # FSDP's MixedPrecisionPolicy computes in bf16 on fp32 shards: model.dtype, which the Trainer's
            # collator and the harness feed pixels in, is fp32, and the model casts them (Qwen-VL's patch embedding:
            # hidden_states.to(self.proj.weight.dtype), the unsharded bf16 weight's)
            config = {**config, INPUT_DTYPE_KEY: "float32"}
    if images is not None and images != 1 and config is not None:  # one image: the traced step's default
        from memplan.model.hf import IMAGES_KEY

        config = {**config, IMAGES_KEY: images}  # a vision-language model's images per sample: the traced step's
    if settings.compile != "none" and settings.strategy.framework not in ("torch", "torch-ddp", "fsdp2"):
        raise SettingsError(f"--compile {settings.compile} under {settings.strategy.framework} is not modelled yet: a "
                            "compiled block's parameter gradients reach their hooks together, after its backward "
                            "graph, where DeepSpeed, Horovod and FSDP1 take each one in its own hook (modelled: one "
                            "GPU, DDP and FSDP2)")
    if settings.compile != "none" and lora is not None and settings.strategy.framework == "fsdp2" \
            and settings.recompute != "none":
        # the CPU harness's compiled step held more than the trace's here (session 35's note has the run)
        raise SettingsError(f"--compile {settings.compile} with LoRA under FSDP2 and recompute is not modelled yet "
                            "(the trace came out under the CPU harness); without recompute, or under DDP, it is")
    if float8 != "none":
        config = float8_checks(config, settings, parallel, lora, r.model.activations, inv)
    if settings.compile != "none" and config is not None:
        from memplan.activations.tracing_keys import COMPILE_DDP_KEY, COMPILE_KEY

        config = {**config, COMPILE_KEY: settings.compile}  # the traced step compiles (tracing/compiled.py)
        if settings.strategy.framework == "torch-ddp" and settings.cluster.gpus > 1:
            # dynamo splits the compiled graphs at DDP's buckets (DDPOptimizer): DDP's bucket_bytes_cap
            config[COMPILE_DDP_KEY] = int(settings.torch.bucket_cap_mb * 1024 * 1024)
    if parallel is not None and parallel.active:
        settings = _with_parallel(settings, inv, config, parallel, r.model.activations, notes, trace)
    else:
        settings = replace(settings, activation_profile=activation_profile(config, settings, r.model.activations,
                                                                           notes))
    settings = _with_unreached(settings, inv, notes)
    if settings.activation_profile is None and settings.recompute == OP_SAC:
        notes.append("recompute op-sac: the analytic activations do not know which operations torchtitan's policy "
                     "keeps; counted as without recompute (an upper bound)")
    max_pos = inv.dims.get("max_positions")
    if max_pos and seq > max_pos:
        notes.append(f"warning: seq-len {seq} exceeds the model's max_position_embeddings {max_pos}")
    for name, where in r.sources:  # the job files' values (jobfiles.py), named by their file
        if where != "command line":
            pick.sources["strategy" if name == "stage" else name] = where
    return Resolved(settings=settings, sources=pick.sources, notes=tuple(notes), files=tuple(files))


def _with_unreached(s: Settings, inv: ParamInventory, notes: list[str]) -> Settings:
    """The settings with the parameters that require a gradient and get none in the traced step (no loss reads
    them: a decoder's cross-attention with no encoder, Mllama's cross-attention layers without images, an
    indexer behind a top-k, LLaVA's vision layers past its vision_feature_layer, a vision tower and projector with
    --images 0), as the framework then trains them (frameworks.with_unreached), with a note naming their modules."""
    prof = s.activation_profile
    data = getattr(getattr(prof, "inner", prof), "data", None)
    if not isinstance(data, dict) or not data.get("unreached"):
        return s
    from memplan.model.freeze import modules, traced_unreached

    # those the job does not train anyway (--freeze) need nothing more
    trains = {t.name for t in inv.tensors if t.trainable}
    names = tuple(n for n in traced_unreached(inv, data["unreached"], data.get("traced_blocks") or []) if n in trains)
    if not names:
        return s
    from memplan import frameworks

    s = replace(s, unreached=names)
    by = {t.name: t.numel for t in inv.tensors}
    n = sum(by[x] for x in names)
    paths = modules(names, inv)
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    _, then = frameworks.model(s.strategy.memory_model).unreached(s)
    notes.append(f"{n:,} parameters get no gradient in the traced step (no loss reads them: {shown}): {then}")
    return s


#: the jobs a request field's scope (request.Key.scope) names: whether this job reads it, and who does
SCOPES: dict[str, tuple[Any, str]] = {
    "deepspeed": (lambda st, p, ds, tk: st.framework == "deepspeed", "DeepSpeed"),
    "zero12": (lambda st, p, ds, tk: st.framework == "deepspeed" and st.zero_stage in (1, 2),
               "DeepSpeed ZeRO-1/2 (stage_1_and_2.py)"),
    "zero3": (lambda st, p, ds, tk: st.framework == "deepspeed" and st.zero_stage == 3, "DeepSpeed ZeRO-3"),
    "fsdp": (lambda st, p, ds, tk: st.framework in ("fsdp2", "fsdp1"), "FSDP"),
    "fsdp2": (lambda st, p, ds, tk: st.framework == "fsdp2", "FSDP2 (fully_shard)"),
    "hsdp": (lambda st, p, ds, tk: st.name == "hsdp", "HSDP (--strategy hsdp)"),
    "ddp": (lambda st, p, ds, tk: st.framework == "torch-ddp", "DistributedDataParallel (--strategy ddp, "
            "zero-optimizer)"),
    "pp": (lambda st, p, ds, tk: p is not None and p.pp > 1, "pipeline parallelism (--pp above 1)"),
    "tp": (lambda st, p, ds, tk: p is not None and p.tp > 1, "tensor parallelism (--tp above 1)"),
    "offload": (lambda st, p, ds, tk: ds.offload_optimizer or ds.offload_param or tk.cpu_offload,
                "offload (--offload-optimizer, --offload-param, --cpu-offload)"),
}


def _unread(r: JobRequest, strat: Any, parallel: Any, ds: DeepSpeedKnobs, tk: TorchKnobs) -> list[str]:
    """A note for each option given (on the command line or by a job file) that this job does not read: another
    framework's knob, a pipeline schedule without pipeline stages (request.Key.scope)."""
    from memplan.request import PARTS, keys

    out = []
    for part, cls in PARTS.items():
        for name, default, key in keys(cls):
            value = getattr(getattr(r, part), name)
            where = r.source(name)
            if key.scope is None or where is None or value is None or value == default:
                continue
            reads, whose = SCOPES[key.scope]
            if not reads(strat, parallel, ds, tk):
                on, _, off = (key.flag or "").partition("/")
                flag = off if value is False and off else on
                given = flag if where == "command line" and flag else f"{name} ({where})"
                out.append(f"{given} changes nothing for this job ({strat.name}"
                           + (f", pp {parallel.pp}, tp {parallel.tp}" if key.scope in ("pp", "tp") and parallel
                              else "") + f"): only {whose} reads it")
    return out


def _values(part: Any) -> dict[str, Any]:
    return {f.name: getattr(part, f.name) for f in fields(part)}


def _honours_head_dim(model_type: str) -> bool:
    """Whether transformers' modeling code for ``model_type`` takes head_dim from the config (a TP rank's config
    keeps it while its head count shrinks); the others derive it from hidden_size / heads."""
    import importlib.util
    from pathlib import Path

    try:  # the modeling file's text, without importing transformers (seconds) for it
        spec = importlib.util.find_spec("transformers")
        root = Path(next(iter(spec.submodule_search_locations)))  # type: ignore[union-attr, arg-type]
        src = (root / "models" / model_type / f"modeling_{model_type}.py").read_text()
    except (ImportError, OSError, TypeError, ValueError, StopIteration, AttributeError):
        return False
    return 'getattr(config, "head_dim"' in src or "config.head_dim" in src


def _with_parallel(s: Settings, inv: ParamInventory, config: dict[str, Any] | None, p: Any, mode: str,
                   notes: list[str], trace: bool = True) -> Settings:
    """The settings with tensor / pipeline parallelism: the degrees checked, and the activation profiles of a TP
    rank's model with and without the head traced (memplan/parallel/tensor.py rank_config), or analytic."""
    from memplan import parallel as par

    if s.lora is not None:
        raise SettingsError("--tp/--pp with LoRA: not modelled")
    layout = par.check(p, inv, s.strategy, s.cluster.gpus, s.grad_accum)
    if p.ep > 1 and p.pp > 1:
        # torchtitan's apply_fsdp gives the experts units their block's reshard_after_forward, False under
        # pipelining unless given (accounting.Layout; frameworks/fsdp2.py timeline, pipeline_replay.py): what
        # memplan models; a group size of 1 keeps whole parameters too
        raf = s.torch.reshard_after_forward
        if raf is True or raf not in (None, False, 1) or s.torch.fsdp_wrap not in ("block", None, ""):
            raise SettingsError("--ep with --pp: modelled with the blocks and experts kept unsharded after forward "
                                "(torchtitan's default under pipelining, reshard_after_forward False) and "
                                "--fsdp-wrap block")
    if p.cp > 1:
        if s.seq_len % (2 * p.cp):
            raise SettingsError(f"--cp {p.cp} does not divide the sequence: --seq-len {s.seq_len} must be a multiple of "
                                f"2 x cp = {2 * p.cp} (torchtitan's load balancing gives each rank two chunks)")
        if s.attention == "eager":
            raise SettingsError("--cp runs ring attention over SDPA's fused kernels (flash, efficient, cuDNN); "
                                "--attention eager has none")
    s = replace(s, parallel=p)
    profiles = None
    if mode != "analytic" and config is not None:
        wanted = [True] + ([False] if p.pp > 1 else [])
        cfgs = [par.rank_config(config, p, layout, w) for w in wanted]
        why = None
        if any(c is None for c in cfgs):
            why = "the config does not name its heads and MLP features as transformers' decoders do"
        elif p.tp > 1 and not _honours_head_dim(str(config.get("model_type"))):
            why = f"transformers' {config.get('model_type')} derives head_dim from hidden_size, so a TP rank's " \
                  "model cannot be built from its config"
        if why is None:
            got, seen = [], set()
            for c in cfgs:
                own: list[str] = []
                got.append(activation_profile(c, replace(s, lora=None, seq_len=s.seq_len // p.cp), mode, own, trace))
                notes.extend(n for n in own if n not in seen and not seen.add(n))
            if all(g is not None for g in got):
                profiles = (got[0], got[1] if len(got) > 1 else got[0])
        elif mode == "traced":
            raise SettingsError(f"--activations traced with --tp/--pp: {why}")
        else:
            notes.append(f"activations: analytic for each rank's share, because {why}")
    p = replace(p, profiles=profiles)
    notes.append(f"model parallelism: {layout} layout, tp {p.tp} x pp {p.pp} x dp "
                 f"{s.cluster.gpus // p.model_ranks // p.cp}" + (f" x cp {p.cp} (each rank {s.seq_len // p.cp} "
                                                                 "tokens of each sequence, ring attention)"
                                                                 if p.cp > 1 else "")
                 + (f", experts over ep {p.ep} x efsdp {s.cluster.gpus // p.model_ranks * p.tp // p.ep} "
                    "(balanced routing: tokens x top_k rows received)" if p.ep > 1 else "")
                 + (f", schedule {p.schedule}" + (f" with {p.virtual} stages per rank" if p.multi_stage
                                                 else "") + f", {s.grad_accum} micro-batches per step"
                    if p.pp > 1 else "") + (", sequence parallel" if p.sp and p.tp > 1 else "")
                 + "; the plan is the most loaded pipeline rank's (parallel.ranks in the JSON has each)")
    if p.pp > 1 and s.grad_accum < p.pp:
        notes.append(f"pipeline: {s.grad_accum} micro-batches for {p.pp} stages (--grad-accum sets the micro-batches "
                     "per step): most of the step is bubble")
    return replace(s, parallel=p, activation_profile=None)
