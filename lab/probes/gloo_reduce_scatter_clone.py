"""gloo's reduce_scatter_tensor clones its input; NCCL's does not (session 22).

The CPU harness measures DeepSpeed over gloo, and only FSDP's collectives are made in-place there
(memplan/harness/gloo.py), so a DeepSpeed ZeRO-3 row measured on CPU holds one clone of each reduced bucket that a
GPU run does not: the engine, modelling NCCL, is that much under on those rows (docs/accuracy-cross.md, ZeRO-3
offload with full recompute, -0.72%). One bf16 reduce-scatter of 196,608 elements (gpt2's c_attn at hidden 256)
on a world of one, its allocations from the profiler:

usage: python lab/probes/gloo_reduce_scatter_clone.py   (prints aten::clone 393216: 2 bytes x 196,608)
"""
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29777"))
dist.init_process_group("gloo", rank=0, world_size=1)
x = torch.randn(196608, dtype=torch.bfloat16)
out = x.view(-1)[:196608]
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as p:
    dist.reduce_scatter_tensor(out, x)
ev = [e for e in p.events() if e.cpu_memory_usage]
for e in ev[:10]: print(e.name, e.cpu_memory_usage)
print("total positive", sum(e.cpu_memory_usage for e in ev if e.cpu_memory_usage > 0), "vs 2*numel", 2*196608)
