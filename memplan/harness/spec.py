"""What a validation run does, as plain data: the (scaled) model config and the framework settings.

Built from the same Settings the estimate uses, so the prediction and the run describe one job. No torch here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memplan.activations.tracing_keys import float8_key
from memplan.errors import SettingsError

from memplan.precision import LOW_RANK_STEPS
from memplan.settings import Settings
from memplan.strategies import GREEDY_WHOLE

def ds_config(s: Settings) -> dict[str, Any]:
    """The ds_config a DeepSpeed run of these settings uses (DeepSpeed's key names)."""
    st, ds = s.strategy, s.ds
    zero: dict[str, Any] = {
        "stage": st.zero_stage or 0,
        "reduce_bucket_size": ds.reduce_bucket_size,
        "allgather_bucket_size": ds.allgather_bucket_size,
        "contiguous_gradients": ds.contiguous_gradients,
        "sub_group_size": ds.sub_group_size,
    }
    if ds.overlap_comm is not None:
        zero["overlap_comm"] = ds.overlap_comm
    if not ds.reduce_scatter:
        zero["reduce_scatter"] = False
    if not ds.multi_rank_bucket_allreduce:
        zero["use_multi_rank_bucket_allreduce"] = False
    if st.zero_stage == 3:
        zero.update({"stage3_prefetch_bucket_size": ds.prefetch_bucket_size,
                     "stage3_param_persistence_threshold": ds.param_persistence_threshold,
                     "stage3_max_live_parameters": ds.max_live_parameters,
                     "stage3_max_reuse_distance": ds.max_reuse_distance,
                     "memory_efficient_linear": ds.memory_efficient_linear})
        if ds.hpz_partition_size > 1:
            zero["zero_hpz_partition_size"] = ds.hpz_partition_size
        leaf = {k: list(v) for k, v in (("classes", ds.leaf_classes), ("names", ds.leaf_names),
                                         ("name_suffixes", ds.leaf_name_suffixes)) if v is not None and (v or k == "classes")}
        if leaf:
            zero["leaf_module"] = leaf
        if ds.module_granularity_threshold:
            zero["stage3_module_granularity_threshold"] = ds.module_granularity_threshold
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    extra: dict[str, Any] = {"data_types": {"grad_accum_dtype": ds.grad_accum_dtype}} if ds.grad_accum_dtype else {}
    if ds.communication_data_type:
        extra["communication_data_type"] = ds.communication_data_type
    return {
        **extra,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": s.grad_accum,
        "train_batch_size": s.micro_batch * s.grad_accum * s.cluster.gpus,
        "bf16": {"enabled": s.recipe.name == "deepspeed-bf16"},
        # dynamic loss scaling (DeepSpeed's default) from a scale of 1, so that no measured step is skipped for
        # an overflow (a skipped step runs no optimizer step); the scale does not change any allocation
        "fp16": ({"enabled": True, "loss_scale": 0, "initial_scale_power": 0}
                 if s.recipe.name == "deepspeed-fp16" else {"enabled": False}),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


#: what each framework runs in the harness
#: DeepSpeed under torch-amp: fp32 parameters, the engine run inside torch.autocast (the harness's step loop)
_HARNESS_RECIPES = {"deepspeed": ("deepspeed-bf16", "deepspeed-fp16", "torch-amp", "fp32"),
                    "torch-ddp": ("torch-amp", "fp32", "pure-bf16", "bf16-autocast", "fp16-bf16-autocast"),
                    "torch": ("torch-amp", "fp32", "pure-bf16", "bf16-autocast", "fp16-bf16-autocast"),
                    "fsdp2": ("fsdp-bf16", "torch-amp", "fp32", "pure-bf16"), "fsdp1": ("fsdp-bf16", "torch-amp", "fp32", "pure-bf16")}


#: torch.optim's, transformers' Adafactor, bitsandbytes' AdamW8bit (harness/setup.py _torch_optimizer)
HARNESS_OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "adam8bit", "lion", "adamw-schedulefree", "muon",
                      "adam-mini", "apollo-adamw", "galore-adamw", "muon-with-aux-adam")


def build_spec(config: dict[str, Any], s: Settings, *, warmup_steps: int = 2, measured_steps: int = 1,
               attn_implementation: str = "sdpa", layout: Any = None) -> dict[str, Any]:
    """The rank's instructions for this job. Raises SettingsError for what the harness cannot run. ``layout``:
    the plan's model-parallel layout (accounting.Layout), whose stage split the ranks build."""
    if layout is not None:
        return _parallel_spec(config, s, layout, warmup_steps, measured_steps, attn_implementation)
    st, c = s.strategy, s.cluster
    fw = st.framework
    if fw not in _HARNESS_RECIPES:
        raise SettingsError(f"the harness does not run {st.name} ({fw}) yet; it runs DeepSpeed ZeRO 0-3, DDP, "
                            "DDP + ZeroRedundancyOptimizer and FSDP2 / FSDP1 (fsdp-full, fsdp-grad-op, "
                            "fsdp-no-shard, hsdp)")
    if s.recipe.name not in _HARNESS_RECIPES[fw]:
        raise SettingsError(f"the harness runs {st.name} with precision {', '.join(_HARNESS_RECIPES[fw])}, "
                            f"not {s.recipe.name}")
    if s.optimizer.name not in HARNESS_OPTIMIZERS:
        raise SettingsError(f"the harness runs {', '.join(HARNESS_OPTIMIZERS)}, not {s.optimizer.name}"
                            + (" (paged optimizers need CUDA unified memory)" if s.optimizer.paged else ""))
    if st.zero_stage == 3 and (s.ds.quantized_weights or s.ds.quantized_gradients):
        raise SettingsError("the harness does not run ZeRO++ qwZ/qgZ: DeepSpeed's quantizer kernels need CUDA "
                            "and a DeepSpeed build with its ops")
    # DeepSpeed's offload runs on CPU (DeepSpeedCPUAdam, JIT-built): device and host memory are one allocator
    # there, so the comparison adds what the plan keeps on the host (harness/compare.py). FSDP's CPUOffloadPolicy
    # needs a device other than the host.
    if c.device == "cpu" and s.torch.cpu_offload:
        raise SettingsError("FSDP CPU offload cannot be measured on CPU: its parameters would be offloaded to "
                            "the device they are on (run validate on a GPU machine)")
    if c.device == "cpu" and s.float8 == "rowwise_with_gw_hp" and s.recipe.autocast:
        # Float8Linear casts its input to CUDA's autocast dtype only (float8_linear.py forward reads
        # torch.is_autocast_enabled()); under CPU autocast the input stays fp32 and this recipe's high-precision
        # weight-gradient GEMM gets a bf16 and an fp32 operand
        raise SettingsError("the CPU harness cannot run fp8-rowwise-gw-hp under autocast (torchao's Float8Linear "
                            "casts its input for CUDA's autocast only): run it under FSDP2 (fsdp-bf16)")
    if s.recompute == "selective":
        raise SettingsError("the harness runs --recompute none, full, op-sac, every:N or layer-sac:N (transformers "
                            "has no selective recompute)")
    if warmup_steps < 1 or measured_steps < 1:
        raise SettingsError("warm-up and measured steps must be at least 1")
    from memplan.settings import reshard_after_forward, shard_group_size

    n = shard_group_size(s)
    raf = reshard_after_forward(s)
    if fw in ("fsdp2", "fsdp1") and not st.shard_params:
        n = 1  # NO_SHARD: a (world, 1) mesh, replicate only
    if s.target_len is not None:  # an encoder-decoder's decoder length: its labels (model/tasks.py step_inputs)
        from memplan.model.hf import TARGET_KEY

        config = {**config, TARGET_KEY: s.target_len}
    if s.frozen:  # the parameters that do not train (model/freeze.py)
        from memplan.model.hf import FROZEN_KEY

        config = {**config, FROZEN_KEY: list(s.frozen)}
    if s.images is not None:  # a vision-language model's images per sample (model/tasks.py step_inputs)
        from memplan.model.hf import IMAGES_KEY

        config = {**config, IMAGES_KEY: s.images}
    if s.image_size is not None:  # a patch-grid model's image (model/tasks.py _patch_grid_inputs)
        from memplan.model.hf import IMAGE_SIZE_KEY

        config = {**config, IMAGE_SIZE_KEY: list(s.image_size)}
    spec: dict[str, Any] = {
        "config": config, "framework": fw, "strategy": st.name, "recipe": s.recipe.name,
        "optimizer": s.optimizer.name, "optimizer_impl": s.optimizer_impl,
        "micro_batch": s.micro_batch, "seq_len": s.seq_len, "grad_accum": s.grad_accum, "recompute": s.recompute,
        "compile": s.compile,
        "float8": float8_key(s.float8, s.float8_keep, s.float8_all_gather) if s.float8 != "none" else "none",
        "attn_implementation": attn_implementation, "device": c.device, "gpus_per_node": c.ranks_per_node,
        "warmup_steps": warmup_steps, "measured_steps": measured_steps, "seed": 0,
        # DDP's own default where none was given (a cap given, even 25, makes the first bucket as large as the rest)
        "bucket_cap_mb": None if s.torch.bucket_cap_default else s.torch.bucket_cap_mb,
        "gradient_as_bucket_view": s.torch.gradient_as_bucket_view,
        # parameters no loss reads: DDP refuses its second step without find_unused_parameters, as a job's must set
        "find_unused_parameters": bool(s.unreached),
        "zero_optimizer": st.layout == GREEDY_WHOLE,  # whole params per rank: ZeroRedundancyOptimizer
        "fsdp_wrap": s.torch.fsdp_wrap, "fsdp_root_reshard": s.torch.fsdp_root_reshard,
        "shard_size": n, "reshard_after_forward": raf if not isinstance(raf, bool) or st.shard_params else False,
        # LoRA: PEFT adds the adapters to the built model (harness/setup.py), as the job's script does
        "lora": None if s.lora is None else {**s.lora.trace_fields(),
                                             **({"adapter_dtype": "float32"} if s.recipe.adapter_bytes else
                                                {"adapter_dtype": "bfloat16"} if s.recipe.name == "pure-bf16"
                                                else {}),
                                             **({"quant_storage": s.lora.quant_storage}
                                                if s.lora.quant_storage != "uint8" else {})},
    }
    if s.optimizer.per_tensor in LOW_RANK_STEPS:
        # the projection renewed at every step (update_proj_gap 1): the step memplan's figure describes (the
        # first, then every 200th of the Trainer's run: precision.per_tensor_step_scratch), measured
        spec["update_proj_gap"] = 1
    if fw == "deepspeed":
        spec["ds_config"] = ds_config(s)
    return spec


def _parallel_spec(config: dict[str, Any], s: Settings, layout: Any, warmup_steps: int, measured_steps: int,
                   attn_implementation: str) -> dict[str, Any]:
    """A tensor / pipeline-parallel job's spec (harness/model_parallel.py): torchtitan's layout under FSDP2 (or
    DDP without TP), a transformers decoder with q/k/v, o, gate/up/down projections."""
    from memplan.parallel import TORCHTITAN

    job = layout.settings
    p = job.parallel
    deepspeed_pipe = layout.name != TORCHTITAN and p.tp == 1
    ddp_pipe = job.strategy.name == "ddp" and p.tp == 1
    if not (deepspeed_pipe or ddp_pipe) and (layout.name != TORCHTITAN or
                                             job.strategy.name not in ("fsdp-full", "fsdp-grad-op")):
        raise SettingsError("the harness runs tensor and pipeline parallelism under FSDP2 (fsdp-full, "
                            "fsdp-grad-op: torchtitan's layout) and DeepSpeed's PipelineEngine (ZeRO 0-1, --pp); "
                            "Megatron's tensor parallelism needs Megatron")
    if deepspeed_pipe and job.recipe.name != "deepspeed-bf16":
        raise SettingsError(f"the harness runs DeepSpeed's PipelineEngine with deepspeed-bf16, not {job.recipe.name}")
    if not deepspeed_pipe and job.recipe.name not in ("fsdp-bf16", "fp32", "torch-amp"):
        raise SettingsError(f"the harness runs tensor and pipeline parallelism with fsdp-bf16 or fp32, not "
                            f"{job.recipe.name}")
    if job.recompute != "none" and p.pp > 1:
        raise SettingsError("the harness's pipeline stages run without recompute")
    ep_alone = p.ep > 1 and p.tp == 1 and p.pp == 1 and p.cp == 1  # the whole model: any family with fused experts
    if not ep_alone and config.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3") + (
            ("mixtral", "qwen2_moe", "qwen3_moe") if p.tp == 1 or p.ep > 1 else ()) + (
            ("deepseek_v3",) if p.tp == 1 and p.pp == 1 else ()):
        raise SettingsError("the harness applies tensor and pipeline parallelism to llama-style decoders "
                            "(llama, mistral, qwen2, qwen3; mixtral, qwen2_moe, qwen3_moe without --tp or with --ep; "
                            "any MoE family with --ep alone)")
    one = replace(s, parallel=None, cluster=replace(s.cluster, gpus=layout.dp))
    spec = build_spec(config, one, warmup_steps=warmup_steps, measured_steps=measured_steps,
                      attn_implementation=attn_implementation)
    from memplan.parallel.schedules import rank_stages
    from memplan.settings import reshard_after_forward

    spec["reshard_after_forward"] = reshard_after_forward(layout.ranks[0][2])  # the layout's (torchtitan's) default
    v = len(layout.ranks[0][0].chunks)
    if p.cp > 1 and (p.tp > 1 or p.pp > 1 or p.ep > 1 or config.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3")):
        raise SettingsError("the harness runs context parallelism alone (with FSDP2 or DDP over dp x cp) on llama-style "
                            "decoders")
    spec.update(tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, vpp=p.vpp, sp=p.sp, schedule=p.schedule, gpus_per_node=job.cluster.ranks_per_node,
                loss_parallel=p.loss_parallel,
                chunks=[[(list(c.layers), c.first, c.last) for c in share.chunks] for share, _, _ in layout.ranks],
                stage_ids=[list(ids) for ids in rank_stages(p.schedule, p.pp, v)])
    return spec
