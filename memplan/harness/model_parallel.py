"""Tensor and pipeline parallelism applied as torchtitan applies them (the rank's side of validate with --tp/--pp):
a device mesh [pp, dp, tp]; each pipeline rank keeps its stages' modules (memplan/parallel/pipeline.py's split, the same
the estimate sizes); DTensor tensor parallelism on each block (torchtitan's llama plan: ColwiseParallel on
q/k/v and gate/up, RowwiseParallel on o/down, the embedding split by vocabulary rows, the head column-parallel
with its logits left sharded for loss_parallel); FSDP2 over the dp ranks (each block, then the stage's root);
torch.distributed.pipelining's schedules with the micro-batches of a step.
"""

from __future__ import annotations

from typing import Any


def _stage_class() -> Any:
    import torch
    from torch import nn

    class Stage(nn.Module):
        """One pipeline stage of a transformers decoder: the embedding (first stage), its blocks, the final norm and
        the head (last stage); rotary embeddings computed per stage, causal attention without a mask."""

        def __init__(self, model: Any, layers: list[int], first: bool, last: bool) -> None:
            super().__init__()
            inner = model.model
            self.embed_tokens = inner.embed_tokens if first else None
            self.layers = nn.ModuleList([inner.layers[i] for i in layers])
            self.rotary_emb = inner.rotary_emb
            self.norm = inner.norm if last else None
            self.lm_head = model.lm_head if last else None

        def forward(self, x: Any) -> Any:
            h = self.embed_tokens(x) if self.embed_tokens is not None else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            pe = self.rotary_emb(h, pos)
            for layer in self.layers:
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
                h = h[0] if isinstance(h, tuple) else h
            if self.lm_head is not None:
                h = self.lm_head(self.norm(h))
            return h

    return Stage


def tensor_parallelize(model: Any, blocks: list[Any], mesh: Any, sp: bool, whole: bool,
                       loss_parallel: bool = True) -> None:
    """torchtitan's llama tensor-parallel plan (torchtitan/models/llama3/infra/parallelize.py apply_tp) on the
    transformers module names; ``whole``: the model itself (not a stage) holds the embedding and the head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    root: dict[str, Any] = {}
    holder = model.model if whole else model
    if getattr(holder, "embed_tokens", None) is not None:
        root[("model." if whole else "") + "embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    if getattr(model, "lm_head", None) is not None:
        if sp:
            root[("model." if whole else "") + "norm"] = SequenceParallel()
        # loss parallelism keeps the logits split (torchtitan); without it they are gathered whole, as transformers'
        # colwise_gather_output does
        root["lm_head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                          output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                          use_local_output=not loss_parallel)
    if root:
        parallelize_module(model, mesh, root)
    for blk in blocks:
        plan: dict[str, Any] = {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(
                output_layouts=Shard(1) if sp else Replicate()),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
        for shared in ("mlp.shared_expert", "mlp.shared_experts"):  # a MoE block's shared expert, as a dense MLP
            plan.update({f"{shared}.gate_proj": ColwiseParallel(), f"{shared}.up_proj": ColwiseParallel(),
                         f"{shared}.down_proj": RowwiseParallel()})
        if sp:
            plan.update({
                "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        # a MoE block's mlp has no gate/up/down projections: its experts run expert parallelism (expert_parallelize)
        names = {n for n, _ in blk.named_modules()}
        parallelize_module(blk, mesh, {k: v for k, v in plan.items() if k in names})


def experts_modules(model: Any) -> list[Any]:
    """The MoE layers' routed-experts modules (transformers' fused experts: 3-D gate_up_proj / down_proj)."""
    return [m for name, m in model.named_modules() if name.endswith(".experts")
            and getattr(getattr(m, "gate_up_proj", None), "dim", lambda: 0)() == 3]


def expert_parallelize(model: Any, ep_mesh: Any, tp_mesh: Any) -> list[Any]:
    """transformers' expert-parallel plan (base_model_ep_plan: "grouped_gemm" on the fused weights, Shard(0) over
    the EP mesh, "ep_dispatch_experts" on the module: AllToAllEP in training; transformers/distributed/
    expert_parallel.py), as DistributedConfig(ep_size) applies it; the experts modules."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel, MoEParamShard

    mods = experts_modules(model)
    for m in mods:
        for name in ("gate_up_proj", "down_proj"):
            MoEParamShard(Shard(0), shards_expert_dim=True).shard_param(m, name, ep_mesh)
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            if getattr(m, name, None) is not None:
                MoEParamShard(Shard(0), shards_expert_dim=True).shard_param(m, name, ep_mesh)
        EpDispatchExpertsParallel().install_forward(m, ep_mesh=ep_mesh, tp_mesh=tp_mesh)
    return mods


def setup(spec: dict[str, Any], device: Any, build: Any, optimizer: Any, materialize: Any) -> tuple[Any, Any, Any]:
    """(module, optimizer, pipeline) for an FSDP2 / DDP job with tensor and pipeline parallelism. ``build``,
    ``optimizer`` and ``materialize``: harness/setup.py's model builder, optimizer, and storage on the device."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from memplan import parallel as par
    from memplan.harness import gloo

    tp, pp, ep, cp = spec["tp"], spec["pp"], spec.get("ep", 1), spec.get("cp", 1)
    world = dist.get_world_size()
    dp = world // (tp * pp * cp)
    kind = "cuda" if device.type == "cuda" else "cpu"
    if cp > 1:
        # torchtitan's mesh [pp, dp, cp, tp]: the parameters FSDP-sharded over dp x cp (its dp_shard_cp), the
        # sequence over cp
        full = init_device_mesh(kind, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp_only", "cp", "tp"))
        mesh = {"pp": full["pp"], "tp": full["tp"], "cp": full["cp"], "dp": full["dp_only", "cp"]._flatten("dp")}
        if device.type == "cpu":
            from memplan.harness.cp import enable_cpu_ring_attention

            enable_cpu_ring_attention(full["cp"])
        dp = dp * cp
    else:
        mesh = init_device_mesh(kind, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    # experts: transformers' expert mesh (pp, efsdp, ep), efsdp = dp x tp / ep (distributed/utils.py)
    emesh = init_device_mesh(kind, (pp, dp * tp // ep, ep), mesh_dim_names=("pp", "efsdp", "ep")) if ep > 1 else None
    model = build(spec, on_meta=True)
    experts = expert_parallelize(model, emesh["ep"], mesh["tp"]) if ep > 1 else []
    if ep > 1 and not experts:
        raise ValueError("--ep: the model has no fused experts module (.experts with a 3-D gate_up_proj) to split")
    p = par.Parallel(tp=tp, pp=pp, vpp=spec.get("vpp"), sp=spec.get("sp", False), schedule=spec["schedule"])
    rank = dist.get_rank()
    pp_rank = rank // (dp * tp)
    parts: list[Any] = []
    if pp > 1:
        chunks_by_rank = spec["chunks"]
        Stage = _stage_class()
        for layers, first, last in chunks_by_rank[pp_rank]:
            parts.append(Stage(model, list(layers), first, last))
    else:
        parts.append(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if spec["recipe"] == "fsdp-bf16" else MixedPrecisionPolicy()
    if spec["framework"] == "torch-ddp" and tp > 1:
        raise ValueError("the harness runs DDP with pipeline parallelism only")
    for part in parts:
        blocks = list(part.layers) if pp > 1 else list(part.model.layers)
        if tp > 1:
            tensor_parallelize(part, blocks, mesh["tp"], p.sp, whole=pp == 1,
                               loss_parallel=spec.get("loss_parallel", True))
        if spec["framework"] == "fsdp2":
            # the experts first, on their own mesh (transformers' apply_fully_sharded_data_parallelism; torchtitan's
            # apply_fsdp with ep: transformer_block.moe.experts on dp_mod_ep), resharded after forward
            for m in experts:
                if any(m is x for x in part.modules()):
                    # under pipelining torchtitan gives the experts their block's reshard_after_forward (False
                    # by default: llama4/infra/parallelize.py apply_fsdp, "reshard_after_forward = not pp_enabled")
                    fully_shard(m, mesh=emesh["efsdp"], mp_policy=mp,
                                reshard_after_forward=spec["reshard_after_forward"] if pp > 1 else True)
            for blk in blocks:
                fully_shard(blk, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=spec["reshard_after_forward"])
            fully_shard(part, mesh=mesh["dp"], mp_policy=mp)
        if device.type == "cpu" and spec["framework"] == "fsdp2":
            gloo.collectives_in_place(part)
        materialize(part, device)
    if spec["framework"] == "torch-ddp":  # DDP over the dp ranks of each stage (torchtitan's data_parallel_replicate)
        from torch.nn.parallel import DistributedDataParallel as DDP

        parts = [DDP(part, process_group=mesh["dp"].get_group(), bucket_cap_mb=spec["bucket_cap_mb"],
                     gradient_as_bucket_view=spec["gradient_as_bucket_view"], init_sync=False) for part in parts]
    params = [prm for part in parts for prm in part.parameters()]
    opt = optimizer(spec, params)
    if pp == 1:
        if cp > 1:
            parts[0].memplan_cp_mesh = mesh["cp"]  # the step runs inside context_parallel over it (harness/run.py)
        return parts[0], opt, None
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    from memplan.parallel.schedules import TORCH_NAMES

    from transformers.loss.loss_utils import ForCausalLMLoss

    vocab = spec["config"]["vocab_size"]
    stage_ids = spec["stage_ids"][pp_rank]
    total = pp * len(stage_ids)
    stages = [PipelineStage(part, sid, total, device, group=mesh["pp"].get_group()) for part, sid in
              zip(parts, stage_ids)]

    def loss_fn(logits: Any, target: Any) -> Any:
        return ForCausalLMLoss(logits, target, vocab)

    m = spec["grad_accum"]
    # memplan's schedule name -> torch's class (get_schedule_class, memplan/parallel/schedules.py TORCH_NAMES)
    cls = get_schedule_class(TORCH_NAMES[spec["schedule"]])
    sched = cls(stages if issubclass(cls, PipelineScheduleMulti) else stages[0], n_microbatches=m, loss_fn=loss_fn)
    pipe = {"schedule": sched, "first": any(s.is_first for s in stages), "last": any(s.is_last for s in stages),
            "parts": parts}
    inner = [x.module if hasattr(x, "module") else x for x in parts]
    return torch.nn.ModuleList(inner), opt, pipe  # every stage's parameters attributed as weights


def setup_deepspeed_pipe(spec: dict[str, Any], device: Any, optimizer: Any) -> tuple[Any, Any, Any]:
    """DeepSpeed's PipelineEngine over a PipelineModule of the transformers decoder's own layers, as
    Megatron-DeepSpeed lays a GPT out: [embedding, each block, final norm + head], partition_method "parameters"
    (DeepSpeed's default; memplan predicts the same split), the loss on the last stage; each rank builds only its
    stage's layers (LayerSpec)."""
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch import nn
    from transformers import AutoModelForCausalLM
    from transformers.loss.loss_utils import ForCausalLMLoss

    from memplan.model.meta_builder import hf_config

    cfg = hf_config(spec["config"])
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(cfg)
    block_cls, rotary_cls, norm_cls = (type(probe.model.layers[0]), type(probe.model.rotary_emb),
                                       type(probe.model.norm))
    del probe
    vocab, hidden = cfg.vocab_size, cfg.hidden_size

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, hidden)

        def forward(self, ids: Any) -> Any:
            return self.embed_tokens(ids)

    class Block(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.layer = block_cls(cfg, i)
            self.rotary_emb = rotary_cls(cfg)

        def forward(self, h: Any) -> Any:
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            out = self.layer(h, attention_mask=None, position_ids=pos, position_embeddings=self.rotary_emb(h, pos))
            return out[0] if isinstance(out, tuple) else out

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = norm_cls(hidden, eps=getattr(cfg, "rms_norm_eps", 1e-6))
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, h: Any) -> Any:
            return self.lm_head(self.norm(h))

    def loss_fn(logits: Any, labels: Any) -> Any:
        return ForCausalLMLoss(logits, labels, vocab)

    torch.manual_seed(spec.get("seed", 0))
    layers = [LayerSpec(Embed)] + [LayerSpec(Block, i) for i in range(cfg.num_hidden_layers)] + [LayerSpec(Head)]
    module = PipelineModule(layers=layers, num_stages=spec["pp"], loss_fn=loss_fn, partition_method="parameters")
    opt = optimizer(spec, module.parameters())
    engine, ds_opt, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=spec["ds_config"])
    return engine, ds_opt, {"deepspeed": engine, "first": engine.is_first_stage(), "last": engine.is_last_stage()}
