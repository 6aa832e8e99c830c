"""Probe (session 31): FSDP2 fully_shard over a bitsandbytes Linear4bit stored with quant_storage=torch.bfloat16,
2 ranks over gloo on CPU. Result: the packed weight [32768, 1] bf16 (256 x 512 nf4) is sharded to [16384, 1] per
rank and forward runs, once Params4bit is built with module= (fix_4bit_weight_quant_state_from_module restores the
quant state after the all-gather). Run: python lab/probes/fsdp2_qlora_quant_storage.py"""
import os, torch, torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world):
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = "29531"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import bitsandbytes as bnb
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 512, bias=False).to(torch.bfloat16)
    q = bnb.nn.Linear4bit(256, 512, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                          quant_storage=torch.bfloat16)
    q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                 quant_storage=torch.bfloat16, module=q)
    q = q.to("cpu")
    print(rank, "module quant_state", q.quant_state is not None if hasattr(q, "quant_state") else None, flush=True)
    w = q.weight
    print(rank, "before", type(w).__name__, w.dtype, tuple(w.shape), getattr(w, "bnb_quantized", None), flush=True)
    model = torch.nn.Sequential(q)
    try:
        fully_shard(model)
        p = next(model.parameters())
        print(rank, "sharded", type(p).__name__, p.dtype, tuple(p.shape), tuple(p.to_local().shape), flush=True)
        x = torch.randn(4, 256, dtype=torch.bfloat16)
        y = model(x)
        print(rank, "forward ok", tuple(y.shape), flush=True)
    except Exception as e:
        print(rank, "FAILED", type(e).__name__, str(e)[:300], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)
