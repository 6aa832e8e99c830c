"""Each framework applied to the model as a training script applies it (the rank's side of validate): DeepSpeed's
engine, DDP (with ZeroRedundancyOptimizer), FSDP1 and FSDP2; the model built from the spec's config."""

from __future__ import annotations

from typing import Any

from memplan.harness import gloo


def _build_model(spec: dict[str, Any], on_meta: bool) -> Any:
    import contextlib

    import torch

    from memplan.activations import checkpoint_every, is_checkpointed
    from memplan.model import tasks
    from memplan.model.meta_builder import checkpointing_on, hf_config

    if spec["config"].get("factory"):  # the user's own module, built by its factory in fp32
        from memplan.model import user_module
        from memplan.model.meta_builder import call_factory

        torch.manual_seed(spec.get("seed", 0))
        model, make_inputs = call_factory(spec["config"]["factory"], torch.device("meta") if on_meta else None)
        for i, blk in enumerate(user_module.blocks_of(model)):
            if is_checkpointed(spec["recompute"], i):  # full, every:N, layer-sac:N, op-sac
                user_module.checkpointed(blk, spec["recompute"])
        model.memplan_inputs = make_inputs  # the input builder, for the step (memplan/harness/run.py)
        model.train()
        return model

    cfg = hf_config(tasks.trace_config(spec["config"]))
    torch.manual_seed(spec.get("seed", 0))
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        # the config's own head (model/tasks.py): a causal LM, or a text encoder's classification or masked-LM head
        model = tasks.build(spec["config"], cfg, attn_implementation=spec["attn_implementation"],
                            dtype=torch.float32)
    if checkpoint_every(spec["recompute"]):
        checkpointing_on(model, spec["recompute"])
    from memplan.model.freeze import requires_grad_off
    from memplan.model.hf import FROZEN_KEY

    requires_grad_off(model, spec["config"].get(FROZEN_KEY))  # --freeze (model/freeze.py)
    if spec.get("lora"):
        # a bf16 load, then PEFT (which upcasts the adapters to fp32); a 4-bit base loaded in bf16 under a wrapper
        # that keeps the recipe's dtypes (FSDP2 pure-bf16: FSDP-QLoRA's torch_dtype=bfloat16), quantized from it
        if spec["lora"].get("adapter_dtype") or (spec["lora"].get("quantize") and spec["recipe"] == "pure-bf16"):
            model = model.to(torch.bfloat16)
        if spec["lora"].get("quantize"):
            bnb_4bit_config(model, spec["lora"])
        model = peft_model(model, spec["lora"])
    if spec.get("float8", "none") != "none":  # torchtitan converts the model before it parallelises it
        from memplan.activations.tracing.float8 import convert

        convert(model, spec["float8"], harness=True)
    model.train()
    compile_model(model, spec.get("compile", "none"))
    return model


def compile_model(model: Any, mode: str) -> None:
    """torch.compile with inductor, before the framework wraps the model (torchtitan's apply_compile runs before
    apply_fsdp): ``blocks`` compiles each transformer block's forward (torchtitan's per-block compile; the
    block's hooks stay outside the graph)."""
    if mode == "none":
        return
    import torch

    from memplan.activations.tracing.step import block_index

    _, blocks = block_index(model)
    if not blocks:
        raise ValueError("--compile blocks: the model has no transformer blocks to compile")
    for blk in blocks:
        # the class's forward looked up at each call: FSDP2 swaps the block's class (FSDP<Block>), whose forward
        # transformers wraps again for checkpointing, and only the outermost wrapper checkpoints
        blk.forward = torch.compile(lambda *a, _blk=blk, **k: type(_blk).forward(_blk, *a, **k))


def bnb_4bit_config(model: Any, fields: dict[str, Any]) -> None:
    """QLoRA's base as transformers loads it with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type,
    bnb_4bit_use_double_quant): each nn.Linear (and Conv1D, transposed) transformers' replace_with_bnb_linear
    converts, outside get_keys_to_not_convert, becomes a bitsandbytes Linear4bit whose weight is quantized from
    a bf16 copy (a bf16 load) when it is moved to the device. bitsandbytes runs this on the CPU too."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        from memplan.errors import SettingsError

        raise SettingsError("the harness runs QLoRA with bitsandbytes: pip install bitsandbytes") from None
    import torch
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    # get_modules_to_not_convert: those keys and the class's _keep_in_fp32_modules (T5's "wo")
    skip = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or ())
    # BitsAndBytesConfig.bnb_4bit_quant_storage: the dtype the codes are packed into (a float one FSDP shards)
    storage = getattr(torch, fields.get("quant_storage", "uint8"))
    for name, m in list(model.named_modules()):
        if not name or not should_convert_module(name, skip):
            continue
        if not (type(m) is torch.nn.Linear or isinstance(m, Conv1D)):
            continue
        w = m.weight.detach().t() if isinstance(m, Conv1D) else m.weight.detach()
        q = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=m.bias is not None,
                              compute_dtype=getattr(torch, fields.get("compute_dtype", "bfloat16")),
                              compress_statistics=bool(fields.get("double_quant")), quant_type=fields["quantize"],
                              quant_storage=storage, device="meta")
        q.weight = bnb.nn.Params4bit(w.to(torch.bfloat16).contiguous(), requires_grad=False,
                                     compress_statistics=bool(fields.get("double_quant")),
                                     quant_type=fields["quantize"], quant_storage=storage, module=q)
        if m.bias is not None:
            q.bias = torch.nn.Parameter(m.bias.detach().clone(), requires_grad=False)
        q = q.to(w.device)  # Params4bit._quantize
        q.requires_grad_(False)
        model.set_submodule(name, q)


def peft_model(model: Any, fields: dict[str, Any]) -> Any:
    """PEFT's LoRA on the built model (get_peft_model), with the job's adapter config: what memplan's inventory
    (model/lora.py) and traced step (tracing/lora.py) model."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        from memplan.errors import SettingsError

        raise SettingsError("the harness runs LoRA with PEFT: pip install peft") from None
    targets = fields["targets"]
    cfg = LoraConfig(r=fields["r"], lora_alpha=fields["r"], target_modules=targets if targets else None,
                     lora_dropout=fields["dropout"], bias=fields["bias"],
                     modules_to_save=fields["modules_to_save"] or None,
                     layers_to_transform=fields["layers_to_transform"] or None,
                     exclude_modules=fields["exclude"] or None, rank_pattern=dict(fields["rank_pattern"]))
    # "bfloat16": the adapters kept in the base's half dtype, as memplan counts them where no wrapper casts for
    # compute and the recipe says so (FSDP2 pure-bf16: options.py's note); PEFT's default upcasts them to fp32
    return get_peft_model(model, cfg, autocast_adapter_dtype=fields.get("adapter_dtype") != "bfloat16")


def _head_unit(model: Any) -> list[Any]:
    """The final norm and the output embedding (torchtitan's [model.norm, model.output]): the model's last
    norm module outside the blocks, and its head."""
    blocks = {id(m) for b in _blocks(model) for m in b.modules()}
    norms = [m for name, m in model.named_modules() if id(m) not in blocks and "norm" in type(m).__name__.lower()
             and any(True for _ in m.parameters(recurse=False))]
    return norms[-1:] + [model.get_output_embeddings()]


def _blocks(model: Any) -> list[Any]:
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    if not no_split:  # the user's own module: the inventory's rule
        from memplan.model.user_module import blocks_of

        return blocks_of(model)
    import torch

    # the layer stack's (the inventory's rule, model/meta_builder.py _block_names): a no-split module outside
    # every ModuleList (BERT's BertEmbeddings) belongs to the root
    stacked = {id(m) for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst}
    blocks = [m for m in model.modules() if type(m).__name__ in no_split]
    return [m for m in blocks if id(m) in stacked] or blocks


class _MuonWithAdamW:
    """torch.optim.Muon on the blocks' matrices and torch.optim.AdamW on the rest, stepped in that order (as
    torch.optim.Muon's documentation pairs them; memplan's --optimizer muon)."""

    def __init__(self, *optimizers: Any) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def _muon(spec: dict[str, Any], model: Any, kw: dict[str, Any]) -> Any:
    """memplan's Muon split (precision.muon_tensors): the trainable 2-D parameters of the blocks to Muon."""
    import torch

    inside = {id(p) for b in _blocks(model) for p in b.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in params if p.ndim == 2 and id(p) in inside]
    rest = [p for p in params if not (p.ndim == 2 and id(p) in inside)]
    return _MuonWithAdamW(torch.optim.Muon(matrices, lr=1e-3),
                          torch.optim.AdamW(rest, weight_decay=0.0, **kw))


def muon_aux_adam_optimizer(model: Any) -> Any:
    """Keller Jordan's Muon (muon-optimizer 0.1.0) grouped as its docstring's example, which memplan's
    precision.muon_aux_adam_groups follows: the blocks' 2-D matrices to Muon; AdamW groups for the head, the
    embeddings, then the rest. MuonWithAuxAdam where torch.distributed runs more than one rank,
    SingleDeviceMuonWithAuxAdam otherwise."""
    import torch.distributed as dist
    from muon import MuonWithAuxAdam, SingleDeviceMuonWithAuxAdam

    inside = {id(p) for b in _blocks(model) for p in b.parameters()}
    head = model.get_output_embeddings()
    head_ids = {id(head.weight)} if head is not None else set()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mats = [p for n, p in named if p.ndim == 2 and id(p) in inside]
    rest = [(n, p) for n, p in named if not (p.ndim == 2 and id(p) in inside)]
    embed = [p for n, p in rest if "embed" in n and id(p) not in head_ids]
    heads = [p for n, p in rest if id(p) in head_ids]
    other = [p for n, p in rest if id(p) not in head_ids and "embed" not in n]
    groups = [dict(params=g, use_muon=False) for g in (heads, embed, other) if g]
    groups.append(dict(params=mats, use_muon=True))
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return (MuonWithAuxAdam if distributed else SingleDeviceMuonWithAuxAdam)(groups)


def _low_rank_groups(model: Any, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """The param groups transformers' _setup_low_rank_optimizer makes: the rest first, then the weights of the
    nn.Linear modules optim_target_modules matches (check_target_module_exists; memplan's
    precision.LOW_RANK_TARGETS) with the optimizer's own arguments."""
    from torch import nn
    from transformers.trainer_utils import check_target_module_exists

    from memplan.precision import LOW_RANK_TARGETS

    names = {f"{m}.weight" for m, mod in model.named_modules()
             if isinstance(mod, nn.Linear) and check_target_module_exists(list(LOW_RANK_TARGETS), m)}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n not in names]},
            {"params": [p for n, p in named if n in names], **kwargs}]


def apollo_optimizer(model: Any, gap: int = 200) -> Any:
    """APOLLOAdamW as the Trainer builds optim apollo_adamw (_get_apollo_optimizer's defaults; APOLLO_RANK),
    the projection renewed every ``gap`` steps."""
    from apollo_torch import APOLLOAdamW

    from memplan.precision import APOLLO_RANK

    return APOLLOAdamW(_low_rank_groups(model, {"rank": APOLLO_RANK, "proj": "random", "scale_type": "channel",
                                                "update_proj_gap": gap, "scale": 1.0, "proj_type": "std"}), lr=1e-4)


def galore_optimizer(model: Any, gap: int | None = None) -> Any:
    """GaLoreAdamW as the Trainer builds optim galore_adamw (_get_galore_optimizer's defaults: GALORE_RANK,
    update_proj_gap GALORE_UPDATE_GAP unless ``gap``, scale 0.25, proj_type std)."""
    from galore_torch import GaLoreAdamW

    from memplan.precision import GALORE_RANK, GALORE_UPDATE_GAP

    return GaLoreAdamW(_low_rank_groups(model, {"rank": GALORE_RANK, "update_proj_gap": gap or GALORE_UPDATE_GAP,
                                                "scale": 0.25, "proj_type": "std"}), lr=1e-4,
                       no_deprecation_warning=True)


def _torch_optimizer(spec: dict[str, Any], params: Any, model: Any = None) -> Any:
    import torch

    impl = spec.get("optimizer_impl")
    kw: dict[str, Any] = {"lr": 1e-4}
    if impl == "foreach":
        kw["foreach"] = True
    elif impl == "single-tensor":
        kw["foreach"] = False
    elif impl == "fused":
        kw["fused"] = True
    name = spec["optimizer"]
    if name == "muon":
        return _muon(spec, model, kw)
    if name == "adam-mini":  # adam-mini 1.1.1: the model's named parameters, dim and heads from its config
        from adam_mini import Adam_mini

        cfg = model.config
        return Adam_mini(named_parameters=model.named_parameters(), lr=1e-4, weight_decay=0.0,
                         dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
                         n_kv_heads=getattr(cfg, "num_key_value_heads", None), verbose=False)
    if name == "adamw":
        return torch.optim.AdamW(params, weight_decay=0.0, **kw)
    if name == "adam":
        return torch.optim.Adam(params, **kw)
    if name == "sgd":
        return torch.optim.SGD(params, momentum=0.9, **kw)
    if name == "adafactor":  # as the HF Trainer builds optim="adafactor" (trainer.py get_optimizer_cls_and_kwargs)
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False, warmup_init=False)
    if name == "adam8bit":  # optim="adamw_bnb_8bit": bitsandbytes' AdamW with 8-bit states
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-4)
    if name == "apollo-adamw":  # transformers' Trainer, optim apollo_adamw (trainer_optimizer.py)
        return apollo_optimizer(model, spec.get("update_proj_gap", 200))
    if name == "muon-with-aux-adam":  # muon-optimizer's MuonWithAuxAdam (SingleDevice on one rank)
        return muon_aux_adam_optimizer(model)
    if name == "galore-adamw":  # transformers' Trainer, optim galore_adamw (trainer_optimizer.py)
        return galore_optimizer(model, spec.get("update_proj_gap"))
    if name == "lion":  # lion-pytorch's Lion (update_fn in Python; use_triton False)
        from lion_pytorch import Lion

        return Lion(params, lr=1e-4)
    if name == "adamw-schedulefree":  # schedulefree's AdamWScheduleFree, in train mode for the steps
        import schedulefree

        opt = schedulefree.AdamWScheduleFree(params, lr=1e-4, warmup_steps=0)
        opt.train()
        return opt
    raise ValueError(f"the harness runs adamw, adam, sgd, adafactor, adam8bit, lion, adamw-schedulefree, muon, "
                     f"adam-mini, apollo-adamw, galore-adamw and muon-with-aux-adam; not "
                     f"{name}")


def setup(spec: dict[str, Any], device: Any) -> tuple[Any, Any, Any]:
    """(module to call, optimizer, engine-or-None) for the spec's strategy (with --tp/--pp: the pipeline's
    schedule in place of the engine, harness/model_parallel.py)."""
    if any(spec.get(k, 1) > 1 for k in ("tp", "pp", "ep", "cp")):
        from memplan.harness import model_parallel

        if spec["framework"] == "deepspeed":
            return model_parallel.setup_deepspeed_pipe(spec, device, _torch_optimizer)
        return model_parallel.setup(spec, device, _build_model, _torch_optimizer, materialize)
    setups = {"deepspeed": _setup_deepspeed, "torch-ddp": _setup_ddp, "torch": _setup_single, "fsdp1": _setup_fsdp1,
              "fsdp2": _setup_fsdp2}
    if spec["framework"] not in setups:
        raise ValueError(f"unknown framework {spec['framework']!r}")
    return setups[spec["framework"]](spec, device)


def _setup_deepspeed(spec: dict[str, Any], device: Any) -> tuple[Any, Any, Any]:
    import deepspeed

    if spec["recipe"] == "deepspeed-fp16" and device.type == "cpu":
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        if not acc.is_fp16_supported():
            # DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels
            # (cpu_accelerator.py is_fp16_supported); torch's CPU kernels compute fp16 regardless, and the
            # check only gates the config. The engine's fp16 path (module.half(), loss scaler, fp32
            # partitions) is what the harness measures.
            type(acc).is_fp16_supported = lambda self: True
    model = _build_model(spec, on_meta=False)
    if spec["ds_config"]["zero_optimization"].get("offload_optimizer") and spec["optimizer"] in ("adamw", "adam"):
        # What DeepSpeed builds for Adam(W) under optimizer offload (engine.py get_optimizer_configuration:
        # DeepSpeedCPUAdam with fp32 states; a client torch optimizer is refused unless
        # zero_force_ds_cpu_optimizer is false). Its C++ step updates in place: no step scratch.
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, weight_decay=0.0,
                               adamw_mode=spec["optimizer"] == "adamw")
    else:
        opt = _torch_optimizer(spec, model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=spec["ds_config"])
    return engine, optimizer, engine


def _setup_single(spec: dict[str, Any], device: Any) -> tuple[Any, Any, Any]:
    """One GPU without a wrapper: the model on the device and an optimizer, as a fine-tuning script has them."""
    import torch

    model = _build_model(spec, on_meta=False).to(device)
    if spec["recipe"] in ("pure-bf16", "bf16-autocast") and not (spec.get("lora") or {}).get("adapter_dtype"):
        model = model.to(torch.bfloat16)
    elif spec["recipe"] == "fp16-bf16-autocast":  # a float16 checkpoint as transformers 5 loads it
        model = model.to(torch.float16)
    return model, _torch_optimizer(spec, model.parameters(), model), None


def _setup_ddp(spec: dict[str, Any], device: Any) -> tuple[Any, Any, Any]:
    import torch

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _build_model(spec, on_meta=False).to(device)
    if spec["recipe"] in ("pure-bf16", "bf16-autocast") and not (spec.get("lora") or {}).get("adapter_dtype"):
        model = model.to(torch.bfloat16)
    elif spec["recipe"] == "fp16-bf16-autocast":  # a float16 checkpoint as transformers 5 loads it
        model = model.to(torch.float16)
    ddp = DDP(model, bucket_cap_mb=spec["bucket_cap_mb"],
              gradient_as_bucket_view=spec["gradient_as_bucket_view"],
              find_unused_parameters=bool(spec.get("find_unused_parameters")),
              init_sync=False)  # every rank built the same weights from one seed; the broadcast
    # would leave its flat buffer counted (freed on a gloo thread the profiler does not follow)
    if spec["zero_optimizer"]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        impl = spec.get("optimizer_impl")
        kw = {"foreach": impl == "foreach"} if impl in ("foreach", "single-tensor") else {}
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                      weight_decay=0.0, **kw)
    else:
        opt = _torch_optimizer(spec, ddp.parameters(), model)
    return ddp, opt, None


def _setup_fsdp1(spec: dict[str, Any], device: Any) -> tuple[Any, Any, Any]:
    import torch
    import torch.distributed as dist

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    world = dist.get_world_size()
    shard = spec["shard_size"]
    model = _build_model(spec, on_meta=False)
    if spec["recipe"] == "pure-bf16" and not (spec.get("lora") or {}).get("quantize"):
        model = model.to(torch.bfloat16)  # model.to(bfloat16), no MixedPrecision (a QLoRA base is loaded so)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if spec["recipe"] == "fsdp-bf16" else None
    if shard == 1:
        strategy = ShardingStrategy.NO_SHARD
    elif shard < world:
        strategy = ShardingStrategy.HYBRID_SHARD
    else:
        strategy = ShardingStrategy.FULL_SHARD if spec["reshard_after_forward"] is not False \
            else ShardingStrategy.SHARD_GRAD_OP
    kw: dict[str, Any] = {}
    if strategy == ShardingStrategy.HYBRID_SHARD:
        from torch.distributed.device_mesh import init_device_mesh

        kw["device_mesh"] = init_device_mesh("cuda" if device.type == "cuda" else "cpu",
                                             (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    if device.type == "cpu":
        gloo.flat_collectives_in_place()
    # FSDP1 as accelerate / the HF Trainer configure it by default: one FlatParameter per decoder block
    # (ModuleWrapPolicy on the block class) and one for the root, use_orig_params=False, BACKWARD_PRE
    # prefetch, limit_all_gathers; the harness's blocks are those of _no_split_modules
    # ("none": no auto-wrap policy, one FlatParameter for the whole model, the root's)
    # ("size:N": torch's size_based_auto_wrap_policy with min_num_params=N, as Accelerate's SIZE_BASED_WRAP sets it)
    # (LoRA: PEFT's fsdp_auto_wrap_policy, which the HF Trainer puts in place of the job's for a PEFT model:
    # transformers/distributed/fsdp.py update_fsdp_plugin_peft; each lora_A / lora_B its own FlatParameter)
    wrap = spec.get("fsdp_wrap", "block")
    if spec.get("lora"):
        from peft.utils.other import fsdp_auto_wrap_policy

        policy = fsdp_auto_wrap_policy(model)
    else:
        policy = ModuleWrapPolicy({type(b) for b in _blocks(model)}) if wrap == "block" \
            else _size_policy(wrap) if wrap.startswith("size:") \
            else ModuleWrapPolicy(_classes(model, wrap)) if wrap.startswith("class:") else None
    fsdp = FSDP(model, auto_wrap_policy=policy,
                sharding_strategy=strategy, mixed_precision=mp, device_id=device, use_orig_params=False, **kw)
    opt = _torch_optimizer(spec, fsdp.parameters())
    return fsdp, opt, None


def _classes(model: Any, wrap: str) -> set[type]:
    names = set(wrap[6:].split(","))
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def _size_policy(wrap: str) -> Any:
    import functools

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    return functools.partial(size_based_auto_wrap_policy, min_num_params=int(wrap.partition(":")[2]))


def _setup_fsdp2(spec: dict[str, Any], device: Any) -> tuple[Any, Any, Any]:
    import torch
    import torch.distributed as dist

    import functools

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    shard = spec["shard_size"]
    mesh_kind = "cuda" if device.type == "cuda" else "cpu"
    if shard == world:
        mesh = init_device_mesh(mesh_kind, (world,))
    else:
        mesh = init_device_mesh(mesh_kind, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    # a 4-bit base (QLoRA) is quantized from real weights: built on the host, as transformers loads it whole
    # before Accelerate's fsdp2_prepare_model shards it (no move to the meta device with Params4bit)
    quantized = bool((spec.get("lora") or {}).get("quantize"))
    model = _build_model(spec, on_meta=not quantized)
    if spec["recipe"] == "pure-bf16" and not quantized:  # model.to(bfloat16), then no mixed-precision policy
        model = model.to(torch.bfloat16)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if spec["recipe"] == "fsdp-bf16" else MixedPrecisionPolicy()
    # Accelerate 1.15 fsdp2_prepare_model: a Params4bit that is not floating (uint8 storage) cannot be sharded
    # (DTensor); it is passed to every fully_shard as ignored_params and stays whole on each rank
    ignored = {p for p in model.parameters() if type(p).__name__ == "Params4bit" and not p.is_floating_point()}
    if ignored:
        fully_shard = functools.partial(fully_shard, ignored_params=ignored)
    raf = spec["reshard_after_forward"]
    wrap = spec.get("fsdp_wrap", "block")
    if wrap == "block+embeddings":
        # torchtitan's units (parallelize.py apply_fsdp): the input embedding, each block, then the final norm
        # with the head as one unit not resharded after forward (its default policy), then the root
        fully_shard(model.get_input_embeddings(), mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    for block in _blocks(model) if wrap in ("block", "block+embeddings") else ():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    if wrap.startswith("class:"):
        # transformer_auto_wrap_policy's units with fully_shard: every module of the classes, children first
        classes = tuple(_classes(model, wrap))
        for m in reversed(list(model.modules())[1:]):
            if isinstance(m, classes):
                fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    if wrap.startswith("size:"):
        # torch's own size-based walk (wrap.py _recursive_wrap with size_based_auto_wrap_policy) applying
        # fully_shard to each module it would wrap, children first, then the root below
        from torch.distributed.fsdp.wrap import _recursive_wrap

        def shard(module: Any, **_: Any) -> Any:
            fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
            return module

        _recursive_wrap(model, auto_wrap_policy=_size_policy(wrap), wrapper_cls=shard, ignored_modules=set(),
                        ignored_params=set(), only_wrap_children=True)
    if wrap == "block+embeddings":
        fully_shard(_head_unit(model), mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    # the root: given the blocks' reshard_after_forward (--fsdp-root-reshard same, as Accelerate's
    # fsdp2_prepare_model passes it), or FSDP2's default (auto: reshard_after_forward=None keeps the root unsharded
    # after forward, _fsdp_state.py _lazy_init), as `fully_shard(model)` in a training script does
    if spec.get("fsdp_root_reshard", "auto") == "same" and wrap != "block+embeddings":
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    else:
        fully_shard(model, mesh=mesh, mp_policy=mp)
    if device.type == "cpu":
        gloo.collectives_in_place(model)
    if not quantized:
        materialize(model, device)
    opt = _torch_optimizer(spec, model.parameters())
    return model, opt, None


def materialize(model: Any, device: Any) -> None:
    """A model built on the meta device (and wrapped) given storage on ``device``: random weights, buffers made
    again (what every FSDP2 and model-parallel setup does after wrapping)."""
    import torch

    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    _reinit_buffers(model)


def _reinit_buffers(model: Any) -> None:
    """Buffers come out of ``to_empty`` uninitialised: recompute rotary frequencies, zero the rest.

    Values never change the bytes, but garbage (NaN) would reach MoE routing, which is data-dependent.
    """
    import torch

    with torch.no_grad():
        for mod in model.modules():
            own = dict(mod.named_buffers(recurse=False))
            if not own:
                continue
            inv = None
            if "inv_freq" in own and hasattr(mod, "config"):
                rope_type = getattr(mod, "rope_type", "default")
                fn = getattr(mod, "compute_default_rope_parameters", None) if rope_type == "default" else None
                try:
                    if fn is None:
                        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                        inv, _ = ROPE_INIT_FUNCTIONS[rope_type](mod.config, torch.device("cpu"))
                    else:
                        inv, _ = fn(mod.config)
                except Exception:
                    inv = None
            for name, buf in own.items():
                if inv is not None and name in ("inv_freq", "original_inv_freq"):
                    buf.copy_(inv.to(device=buf.device, dtype=buf.dtype))
                else:
                    buf.zero_()
