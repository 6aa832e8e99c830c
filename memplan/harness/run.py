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

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any

from memplan.harness.setup import setup


def _status(out: str, rank: int, text: str) -> None:
    with open(os.path.join(out, f"rank{rank}.status"), "a") as fh:
        fh.write(f"{time.time():.3f} {text}\n")


def rank_main(rank: int, world: int, spec: dict[str, Any], out: str) -> None:
    """Run one rank; write rank<R>.json, or rank<R>.error on failure. Never raises."""
    from memplan import progress

    progress.quiet_imports()
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
    from torch.profiler import ProfilerActivity, profile

    from memplan.harness.measure import follow_all_threads

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
    module, optimizer, engine = setup(spec, device)
    attributions, gpu_steps = _train(rank, spec, out, device, module, optimizer, engine)
    dist.barrier()
    measured = _profiled_steps(prof, rank, spec, global_totals) if prof is not None else gpu_steps
    result = {"rank": rank, "world": world, "device": str(device), "backend": backend,
              "steps": measured, "start_attribution": attributions, "all_threads_counted": global_totals or on_gpu,
              "versions": _versions(spec["framework"])}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    _status(out, rank, "done")
    dist.destroy_process_group()


def _train(rank: int, spec: dict[str, Any], out: str, device: Any, module: Any, optimizer: Any,
           engine: Any) -> tuple[list[dict[str, int]], list[dict[str, Any]]]:
    """The warm-up and measured steps, each in a profiler region per phase; (the model states attributed at each
    measured step's start, on a GPU each measured step's allocator figures)."""
    import torch
    from torch.profiler import record_function

    from memplan.harness.measure import attribute

    on_gpu = device.type == "cuda"
    from memplan.precision import get_recipe

    autocast = get_recipe(spec["recipe"]).autocast
    steps = spec["warmup_steps"] + spec["measured_steps"]
    attributions: list[dict[str, int]] = []
    gpu_steps: list[dict[str, Any]] = []
    inner_model = module.module if hasattr(module, "module") else module
    factory = spec["config"].get("factory")
    if factory:  # the user's own module: its inputs and its loss as the trace takes them (model/user_module.py)
        from memplan.model import user_module

        inputs = user_module.inputs_for(factory, inner_model, getattr(inner_model, "memplan_inputs", None),
                                        spec["micro_batch"], spec["seq_len"], device)
        run = (lambda m: user_module.loss_of(m(**inputs) if isinstance(inputs, dict) else m(*inputs)))  # noqa
    else:
        gen = torch.Generator().manual_seed(1234 + rank)
        # context parallelism: each rank holds its 1/cp of the sequence (torchtitan shards the batch's sequence
        # dim; the token ids do not change the bytes)
        batch = torch.randint(0, spec["config"].get("vocab_size", 2), (spec["micro_batch"], spec["seq_len"] //
                                                               spec.get("cp", 1)), generator=gen).to(device)
        # sequence parallelism: the blocks see a sequence shard, so the rotary positions are given whole
        where = {"position_ids": torch.arange(spec["seq_len"], device=device).unsqueeze(0)} if spec.get("sp") else {}
        from memplan.model import tasks

        # the config's head takes its own labels (model/tasks.py); a causal LM's are the input ids
        where.update(tasks.step_inputs(tasks.task_of(spec["config"]), spec["config"], batch,
                                       next(inner_model.parameters()).dtype))
        run = (lambda m: m(**where).loss)  # noqa: E731
    pipe = engine if isinstance(engine, dict) else None
    if pipe is not None:  # torch.distributed.pipelining (or DeepSpeed's PipelineEngine) runs the micro-batches
        engine = None
        gen = torch.Generator().manual_seed(1234)
        whole = torch.randint(0, spec["config"]["vocab_size"], (spec["micro_batch"] * spec["grad_accum"],
                                                                spec["seq_len"]), generator=gen).to(device)
    # the head's logits stay split over the TP ranks (loss_parallel), unless gathered whole
    parallel_loss = spec.get("tp", 1) > 1 and spec.get("loss_parallel", True)
    if parallel_loss:
        from torch.distributed.tensor.parallel import loss_parallel
    cp_mesh = getattr(inner_model, "memplan_cp_mesh", None)
    if cp_mesh is not None:  # ring attention over the CP ranks (harness/cp.py)
        from torch.distributed.tensor.experimental import context_parallel
    for step in range(1, steps + 1):
        _status(out, rank, f"step {step}/{steps}")
        if step > spec["warmup_steps"]:
            attributions.append(attribute(inner_model, optimizer))
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                gstart = torch.cuda.memory_allocated()
        with record_function(f"memplan:step{step}"):
            if pipe is not None and "deepspeed" in pipe:  # the engine runs the micro-batches and the step
                with record_function("memplan:forward"):
                    mb = spec["micro_batch"]
                    pipe["deepspeed"].train_batch(iter([(whole[i * mb:(i + 1) * mb], whole[i * mb:(i + 1) * mb])
                                                        for i in range(spec["grad_accum"])]))
            elif pipe is not None:
                with record_function("memplan:forward"), (loss_parallel() if parallel_loss else
                                                           contextlib.nullcontext()), \
                        torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    # as torchtitan's trainer calls it: the last stage keeps no micro-batch's output
                    kw: dict[str, Any] = {"return_outputs": False}
                    if pipe["last"]:
                        kw.update(target=whole, losses=[])
                    pipe["schedule"].step(*((whole,) if pipe["first"] else ()), **kw)
            for micro in range(spec["grad_accum"] if pipe is None else 0):
                with contextlib.ExitStack() as ctx:
                    if parallel_loss:
                        ctx.enter_context(loss_parallel())
                    if cp_mesh is not None:  # the inputs are already this rank's chunk: a token buffer to shard
                        ctx.enter_context(context_parallel(cp_mesh, buffers=[torch.zeros(2 * cp_mesh.size(),
                                                                                          device=device)],
                                                           buffer_seq_dims=[0]))
                    with record_function("memplan:forward"):
                        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                            loss = run(module)
                    with record_function("memplan:backward"):
                        if engine is not None:
                            engine.backward(loss)
                            # DeepSpeed counts micro-steps in step() (engine.py: is_gradient_accumulation_boundary
                            # reads micro_steps), so it is called after every backward, as its training loop
                            # does; before the boundary it only counts (no optimizer work)
                            if micro < spec["grad_accum"] - 1:
                                engine.step()
                        else:
                            loss.backward()
                    del loss
            with record_function("memplan:optimizer-step"):
                if pipe is not None and "deepspeed" in pipe:
                    pass  # train_batch stepped
                elif engine is not None:
                    engine.step()
                else:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        if on_gpu and step > spec["warmup_steps"]:
            torch.cuda.synchronize()
            gpu_steps.append({"step": step, "start_bytes": gstart, "peak_bytes": torch.cuda.max_memory_allocated(),
                              "peak_phase": "step", "phase_peaks": {}})
    return attributions, gpu_steps


def _profiled_steps(prof: Any, rank: int, spec: dict[str, Any], global_totals: bool) -> list[dict[str, Any]]:
    """Each measured step's allocator peaks, read from the CPU profiler's memory events."""
    from memplan.harness.measure import as_dict, steps_from_trace

    prof.__exit__(None, None, None)
    fd, trace = tempfile.mkstemp(suffix=".json", prefix=f"memplan-rank{rank}-")
    os.close(fd)
    try:
        prof.export_chrome_trace(trace)
        return [as_dict(m) for m in steps_from_trace(trace, global_totals) if m.step > spec["warmup_steps"]]
    finally:
        keep = os.environ.get("MEMPLAN_TRACE_DIR")  # debugging: keep each rank's chrome trace
        if keep:
            os.makedirs(keep, exist_ok=True)
            os.replace(trace, os.path.join(keep, f"rank{rank}.json"))
        else:
            os.unlink(trace)


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
    # what the frameworks print (transformers' notices, the profiler's lines, warnings) goes to the rank's log in
    # the run directory, not to the terminal beside --json or the progress lines; the rank's error file says what
    # failed, and MEMPLAN_KEEP keeps the logs
    log = os.open(os.path.join(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
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
