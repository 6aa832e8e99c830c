"""One rank of a validation run: build the model, apply the strategy with the real framework, train, measure.

Entry points: ``rank_main`` (called by launch.py in a spawned process) and ``python -m memplan.harness.run
--spec spec.json --out DIR`` (the same code under ``torchrun`` for several nodes: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT come from the environment).

The spec (a JSON dict, written by launch.py) names the strategy's framework settings explicitly; this module
never imports memplan's accounting, so what it measures does not depend on what memplan predicts.
Results go to ``DIR/rank<R>.json``; a failure to ``DIR/rank<R>.error`` (the exception, one line, then the
traceback); progress lines to ``DIR/rank<R>.status``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any


def _status(out: str, rank: int, text: str) -> None:
    with open(os.path.join(out, f"rank{rank}.status"), "a") as fh:
        fh.write(f"{time.time():.3f} {text}\n")


def _build_model(spec: dict[str, Any], on_meta: bool) -> Any:
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from memplan.model.meta_builder import hf_config

    cfg = hf_config(spec["config"])
    torch.manual_seed(spec.get("seed", 0))
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=spec["attn_implementation"],
                                                 dtype=torch.float32)
    if spec["recompute"] == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _blocks(model: Any) -> list[Any]:
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in no_split]


def _torch_optimizer(spec: dict[str, Any], params: Any) -> Any:
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
    if name == "adamw":
        return torch.optim.AdamW(params, weight_decay=0.0, **kw)
    if name == "adam":
        return torch.optim.Adam(params, **kw)
    if name == "sgd":
        return torch.optim.SGD(params, momentum=0.9, **kw)
    raise ValueError(f"the harness runs adamw, adam and sgd; not {name}")


def _setup(spec: dict[str, Any], device: Any) -> tuple[Any, Any, Any]:
    """(module to call, optimizer, engine-or-None) for the spec's strategy."""
    import torch
    import torch.distributed as dist

    kind = spec["framework"]
    if kind == "deepspeed":
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
    if kind == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = _build_model(spec, on_meta=False).to(device)
        if spec["recipe"] == "pure-bf16":
            model = model.to(torch.bfloat16)
        ddp = DDP(model, bucket_cap_mb=spec["bucket_cap_mb"],
                  gradient_as_bucket_view=spec["gradient_as_bucket_view"],
                  init_sync=False)  # every rank built the same weights from one seed; the broadcast
        # would leave its flat buffer counted (freed on a gloo thread the profiler does not follow)
        if spec["zero_optimizer"]:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            impl = spec.get("optimizer_impl")
            kw = {"foreach": impl == "foreach"} if impl in ("foreach", "single-tensor") else {}
            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                          weight_decay=0.0, **kw)
        else:
            opt = _torch_optimizer(spec, ddp.parameters())
        return ddp, opt, None
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        world = dist.get_world_size()
        shard = spec["shard_size"]
        model = _build_model(spec, on_meta=False)
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
            _gloo_flat_collectives_in_place()
        # FSDP1 as accelerate / the HF Trainer configure it by default: one FlatParameter per decoder block
        # (ModuleWrapPolicy on the block class) and one for the root, use_orig_params=False, BACKWARD_PRE
        # prefetch, limit_all_gathers; the harness's blocks are those of _no_split_modules
        fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(b) for b in _blocks(model)}),
                    sharding_strategy=strategy, mixed_precision=mp, device_id=device, use_orig_params=False, **kw)
        opt = _torch_optimizer(spec, fsdp.parameters())
        return fsdp, opt, None
    if kind in ("fsdp2",):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        world = dist.get_world_size()
        shard = spec["shard_size"]
        mesh_kind = "cuda" if device.type == "cuda" else "cpu"
        if shard == world:
            mesh = init_device_mesh(mesh_kind, (world,))
        else:
            mesh = init_device_mesh(mesh_kind, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        model = _build_model(spec, on_meta=True)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if spec["recipe"] == "fsdp-bf16" else MixedPrecisionPolicy()
        raf = spec["reshard_after_forward"]
        for block in _blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
        # the root keeps FSDP2's default (reshard_after_forward=None: True for the blocks, False for the root,
        # _fully_shard.py), as `fully_shard(model)` in a training script does; the engine assumes it
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if device.type == "cpu":
            _gloo_collectives_in_place(model)
        model.to_empty(device=device)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        _reinit_buffers(model)
        opt = _torch_optimizer(spec, model.parameters())
        return model, opt, None
    raise ValueError(f"unknown framework {kind!r}")


def _all_gather_in_place(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:  # noqa: A002
    """all_gather_into_tensor as an all-reduce of zero-padded contributions, written into ``output`` only."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        output.zero_()
        output.view(dist.get_world_size(group), -1)[dist.get_rank(group)].copy_(input.view(-1))
    return dist.all_reduce(output, group=group, async_op=async_op)


def _reduce_scatter_in_place(output: Any, input: Any, op: Any = None, group: Any = None,  # noqa: A002
                             async_op: bool = False) -> None:
    """reduce_scatter_tensor as an in-place all-reduce of ``input`` (the framework only frees that buffer
    afterwards) and a copy of this rank's chunk into ``output``."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(input, op=dist.ReduceOp.SUM if op is None else op, group=group)
    with torch.no_grad():
        output.view(-1).copy_(input.view(dist.get_world_size(group), -1)[dist.get_rank(group)])
    return None


def _gloo_collectives_in_place(model: Any) -> None:
    """FSDP2 on gloo: run its all-gather and reduce-scatter as in-place all-reduces of FSDP2's own buffers.

    NCCL's all_gather_into_tensor and reduce_scatter_tensor write straight into FSDP2's output buffers. Gloo's
    (ProcessGroupGloo) stage through torch-allocated temporaries instead: a flat output on the worker thread for
    the all-gather, a clone of the whole input for the reduce-scatter. They are freed when the finished work is
    dropped, on whichever thread drops it last, so the measured peak moved from run to run by up to 9% (session
    3, docs/accuracy.md) and included bytes a GPU run never allocates. The same results without temporaries: the
    all-gather as a sum of zero-padded contributions into the output, the reduce-scatter as a sum over the input
    (FSDP2 keeps that buffer only to free it later) and a copy of this rank's chunk. Bytes from FSDP2's own
    allocations, timing and buffer lifetimes are unchanged (set_custom_all_gather / set_custom_reduce_scatter,
    torch/distributed/fsdp/_fully_shard/_fsdp_api.py).
    """
    import torch
    from torch.distributed.fsdp import FSDPModule

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:  # an older torch: keep gloo's own collectives
        return

    class _AllGather(AllGather):
        def allocate(self, size, *, dtype, device):  # noqa: ANN001, ANN201
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001, ANN201
            return _all_gather_in_place(output_tensor, input_tensor, group, async_op)

    class _ReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):  # noqa: ANN001, ANN201
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN201
            return _reduce_scatter_in_place(output_tensor, input_tensor, op, group)

    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_custom_all_gather(_AllGather())
            mod.set_custom_reduce_scatter(_ReduceScatter())


def _gloo_flat_collectives_in_place() -> None:
    """FSDP1 on gloo: its all_gather_into_tensor and reduce_scatter_tensor as in-place all-reduces (see
    _gloo_collectives_in_place: gloo stages both through temporaries NCCL never allocates). FSDP1 calls them
    through the torch.distributed module (_flat_param.py, _runtime_utils.py: all_gather_single,
    reduce_scatter_single), so this rank process's module attributes are replaced; results are identical."""
    import torch
    import torch.distributed as dist

    def all_gather(tensor_list, tensor, group=None, async_op=False):  # noqa: ANN001, ANN202
        # FSDP1 gathers CPU flat parameters into chunks of its unsharded buffer with the list form
        rank = dist.get_rank(group)
        with torch.no_grad():
            for i, out in enumerate(tensor_list):
                out.copy_(tensor) if i == rank else out.zero_()
        for out in tensor_list:
            dist.all_reduce(out, group=group)
        return None

    dist.all_gather = all_gather
    # torch 2.13's FSDP1 calls the *_single names (aliases of *_into_tensor / *_tensor); older ones the others
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            setattr(dist, name, _all_gather_in_place)
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, _reduce_scatter_in_place)


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


def rank_main(rank: int, world: int, spec: dict[str, Any], out: str) -> None:
    """Run one rank; write rank<R>.json, or rank<R>.error on failure. Never raises."""
    try:
        _run(rank, world, spec, out)
    except BaseException as exc:  # report everything, including SystemExit from a framework
        with open(os.path.join(out, f"rank{rank}.error"), "w") as fh:
            fh.write(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n")
            fh.write(traceback.format_exc())
        sys.exit(1)


def _run(rank: int, world: int, spec: dict[str, Any], out: str) -> None:
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(rank % spec.get("gpus_per_node", world)))
    os.environ.setdefault("WORLD_SIZE", str(world))
    _status(out, rank, "importing torch")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, spec.get("threads_per_rank", 1)))
    on_gpu = spec["device"] == "cuda"
    if on_gpu:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if spec["framework"] == "deepspeed":
        _status(out, rank, "importing deepspeed")
        import deepspeed  # noqa: F401  (import before profiling: it allocates at import)

    import transformers  # noqa: F401
    from torch.profiler import ProfilerActivity, profile, record_function

    from memplan.harness.measure import as_dict, attribute, follow_all_threads, steps_from_trace

    prof = None
    global_totals = False
    if not on_gpu:
        global_totals = follow_all_threads()
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()
    _status(out, rank, "initialising process group")
    backend = "nccl" if on_gpu else "gloo"
    if spec["framework"] == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    _status(out, rank, "building the model and applying the strategy")
    module, optimizer, engine = _setup(spec, device)
    vocab = spec["config"]["vocab_size"]
    gen = torch.Generator().manual_seed(1234 + rank)
    batch = torch.randint(0, vocab, (spec["micro_batch"], spec["seq_len"]), generator=gen).to(device)
    autocast = spec["recipe"] == "torch-amp"
    steps = spec["warmup_steps"] + spec["measured_steps"]
    measured: list[dict[str, Any]] = []
    attributions: list[dict[str, int]] = []
    gpu_steps: list[dict[str, Any]] = []
    inner_model = module.module if hasattr(module, "module") else module
    for step in range(1, steps + 1):
        _status(out, rank, f"step {step}/{steps}")
        if step > spec["warmup_steps"]:
            attributions.append(attribute(inner_model, optimizer))
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                gstart = torch.cuda.memory_allocated()
        with record_function(f"memplan:step{step}"):
            for _ in range(spec["grad_accum"]):
                with record_function("memplan:forward"):
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                        loss = module(input_ids=batch, labels=batch).loss
                with record_function("memplan:backward"):
                    if engine is not None:
                        engine.backward(loss)
                    else:
                        loss.backward()
                del loss
            with record_function("memplan:optimizer-step"):
                if engine is not None:
                    engine.step()
                else:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        if on_gpu and step > spec["warmup_steps"]:
            torch.cuda.synchronize()
            gpu_steps.append({"step": step, "start_bytes": gstart, "peak_bytes": torch.cuda.max_memory_allocated(),
                              "peak_phase": "step", "phase_peaks": {}})
    dist.barrier()
    if prof is not None:
        prof.__exit__(None, None, None)
        fd, trace = tempfile.mkstemp(suffix=".json", prefix=f"memplan-rank{rank}-")
        os.close(fd)
        try:
            prof.export_chrome_trace(trace)
            measured = [as_dict(m) for m in steps_from_trace(trace, global_totals) if m.step > spec["warmup_steps"]]
        finally:
            keep = os.environ.get("MEMPLAN_TRACE_DIR")  # debugging: keep each rank's chrome trace
            if keep:
                os.makedirs(keep, exist_ok=True)
                os.replace(trace, os.path.join(keep, f"rank{rank}.json"))
            else:
                os.unlink(trace)
    else:
        measured = gpu_steps
    result = {"rank": rank, "world": world, "device": str(device), "backend": backend,
              "steps": measured, "start_attribution": attributions, "all_threads_counted": global_totals or on_gpu,
              "versions": _versions(spec["framework"])}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    _status(out, rank, "done")
    dist.destroy_process_group()


def _versions(framework: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    names = ("torch", "transformers") + (("deepspeed",) if framework == "deepspeed" else ())
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank when the process that spawned it dies, however it dies (SIGKILL
    included: prctl(PR_SET_PDEATHSIG)), so no rank outlives a stopped validate."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _spawn_entry(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    _die_with_parent()
    os.dup2(2, 1)  # frameworks print to stdout; keep the parent's stdout for --json
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(rank % spec.get("gpus_per_node", world))
    rank_main(rank, world, spec, out)


if __name__ == "__main__":  # torchrun entry point
    import argparse

    ap = argparse.ArgumentParser(description="one memplan validation rank (under torchrun)")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    with open(ns.spec) as fh:
        spec_ = json.load(fh)
    rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), spec_, ns.out)
