"""One real training configuration on one CUDA GPU (NCCL, world 1); prints allocator figures as one JSON line.

Independent of the project's harness. Truth = torch.cuda.max_memory_allocated() over a measured step, with
the peak stats reset after two warm-up steps (steps 3 and 4 are measured; the larger is the case's figure).

usage: gpu_case.py CONFIG_JSON FRAMEWORK MODE MICRO_BATCH SEQ_LEN RECOMPUTE ATTN
  FRAMEWORK deepspeed: MODE is a zero_optimization JSON object (with "_fp16": true for fp16, else bf16);
            client torch AdamW(fused=True) (what the HF Trainer hands DeepSpeed with its default optim), torch
            AdamW on the host when the optimizer is offloaded
  FRAMEWORK fsdp2:     MODE full|gradop (MixedPrecisionPolicy(bf16 params, fp32 reduce)) | purebf16 (bf16
            params, grads and states); AdamW (foreach)
  FRAMEWORK ddp:       MODE amp (fp32 params, bf16 autocast) | fp32; AdamW (foreach)
  RECOMPUTE none|full (HF gradient_checkpointing_enable, use_reentrant=False); ATTN sdpa|eager
SNAPSHOT=summary adds "peak_sites" (allocations of step 3 alive at its peak, by model-code line);
SNAPSHOT=full:PATH writes the allocator's events of the whole run to PATH (gzip), one [action, address, size, stream] per line.
ROOT_AUTO=1 (fsdp2) calls fully_shard(model) without reshard_after_forward (FSDP2 keeps the root unsharded after
forward), as a script's bare call does; by default the root gets the blocks' value, as gpu_case.py and Accelerate.
NOSYNC=1 runs the four steps as a training loop does, with no torch.cuda.synchronize() or peak reset between them
(the host may run ahead of the device), and reports the whole run's max_memory_allocated/reserved once at the end
("nosync": true; every entry of "steps" is that one reading).
"""
import json, os, sys, time

import torch


def build(cfg_path, attn):
    from transformers import AutoConfig, AutoModelForCausalLM
    d = json.load(open(cfg_path))
    d.pop("torch_dtype", None)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    cfg.use_cache = False
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    return model, cfg


def setup(framework, mode, cfg_path, mb, recompute, attn):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29611"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
    torch.cuda.set_device(0)
    model, cfg = build(cfg_path, attn)
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if framework == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="nccl")
        zero = json.loads(mode)
        half = "fp16" if zero.pop("_fp16", False) else "bf16"
        ds = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1, half: {"enabled": True},
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
        if zero.get("offload_optimizer"):
            ds["zero_force_ds_cpu_optimizer"] = False
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
        eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)

        def step(ids):
            loss = eng(input_ids=ids, labels=ids).loss
            eng.backward(loss)
            eng.step()
        return step, cfg
    import torch.distributed as dist
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    if framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        mpp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mode == "purebf16":  # bf16 parameters, grads and AdamW states; no mixed-precision policy
            model.to(torch.bfloat16)
            mpp = MixedPrecisionPolicy()
        reshard = {"full": True, "gradop": False, "purebf16": True}[mode]
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        blocks = max(lists, key=len)
        for layer in blocks:
            fully_shard(layer, reshard_after_forward=reshard, mp_policy=mpp)
        if os.environ.get("ROOT_AUTO") == "1":  # fully_shard(model) without the argument: the root kept
            fully_shard(model, mp_policy=mpp)
        else:
            fully_shard(model, reshard_after_forward=reshard, mp_policy=mpp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

        def step(ids):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, cfg
    if framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[0])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        amp = mode == "amp"

        def step(ids):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, cfg
    raise SystemExit(f"unknown framework {framework}")


def peak_sites(snap, top=20):
    """Allocations made during the recorded step that are alive at its peak, grouped by the model-code line."""
    live, cur, peak, at_peak = {}, 0, 0, {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        if cur > peak:
            peak, at_peak = cur, dict(live)
    groups = {}
    for e in at_peak.values():
        frames = [f for f in e.get("frames") or [] if "/torch/" not in f["filename"] or "autograd" in f["filename"]]
        key = " <- ".join(f'{f["filename"].rsplit("/", 1)[-1]}:{f["line"]}:{f["name"]}' for f in frames[:3]) or "(backward)"
        g = groups.setdefault(key, {"bytes": 0, "count": 0, "sizes": {}})
        g["bytes"] += e["size"]
        g["count"] += 1
        g["sizes"][e["size"]] = g["sizes"].get(e["size"], 0) + 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])[:top]
    return {"step_allocs_alive_at_peak": peak, "sites": [dict(site=k, **v) for k, v in rows]}


def main():
    cfg_path, framework, mode, mb, seq, recompute, attn = sys.argv[1:8]
    mb, seq = int(mb), int(seq)
    t0 = time.time()
    global out
    out = {"config": os.path.basename(cfg_path), "framework": framework, "mode": mode, "world": 1,
           "micro_batch": mb, "seq_len": seq, "recompute": recompute, "attn": attn}
    full = os.environ.get("SNAPSHOT", "").startswith("full:")
    if full:  # the whole run's allocator events (no stacks), for replaying the caching allocator
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=3_000_000)
    try:
        step, cfg = setup(framework, mode, cfg_path, mb, recompute, attn)
        g = torch.Generator(device="cuda").manual_seed(1)
        steps = []
        snap = None if full else os.environ.get("SNAPSHOT")
        nosync = os.environ.get("NOSYNC") == "1"
        for i in range(4):
            ids = torch.randint(0, cfg.vocab_size, (mb, seq), generator=g, device="cuda")
            if nosync:
                step(ids)
                del ids
                continue
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            if snap and i == 2:
                torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
            step(ids)
            torch.cuda.synchronize()
            if snap and i == 2:
                if snap == "summary":
                    out["peak_sites"] = peak_sites(torch.cuda.memory._snapshot())
                else:
                    torch.cuda.memory._dump_snapshot(snap)
                torch.cuda.memory._record_memory_history(enabled=None)
            steps.append({"start": start, "peak": torch.cuda.max_memory_allocated(),
                          "end": torch.cuda.memory_allocated(), "reserved_peak": torch.cuda.max_memory_reserved()})
            del ids
        if nosync:
            torch.cuda.synchronize()
            steps = [{"start": None, "peak": torch.cuda.max_memory_allocated(), "end": torch.cuda.memory_allocated(),
                      "reserved_peak": torch.cuda.max_memory_reserved()}] * 4
            out["nosync"] = True
        out["steps"] = steps
        if full:
            import gzip
            snap = torch.cuda.memory._snapshot()
            with gzip.open(os.environ["SNAPSHOT"][5:], "wt") as fh:
                for e in snap["device_traces"][0]:
                    fh.write(json.dumps([e["action"], e["addr"], e["size"], e["stream"]]) + "\n")
            torch.cuda.memory._record_memory_history(enabled=None)
        out["peak_bytes"] = max(s["peak"] for s in steps[2:])
        out["reserved_peak_bytes"] = max(s["reserved_peak"] for s in steps[2:])
        out["versions"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
        import transformers
        out["versions"]["transformers"] = transformers.__version__
        if framework == "deepspeed":
            import deepspeed
            out["versions"]["deepspeed"] = deepspeed.__version__
    except Exception as e:  # one line, never a hang
        out["error"] = repr(e)[:500]
    out["wall_s"] = round(time.time() - t0, 1)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
