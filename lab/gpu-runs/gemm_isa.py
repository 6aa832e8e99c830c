"""CPU bf16 GEMM scratch on this host, per oneDNN ISA cap (ONEDNN_MAX_CPU_ISA set by the caller)."""
import json, os, sys, tempfile, itertools
import torch
from torch.profiler import ProfilerActivity, profile
torch.set_num_threads(int(os.environ.get("THREADS", "4")))
def temps(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    fd, path = tempfile.mkstemp(suffix=".json"); os.close(fd)
    prof.export_chrome_trace(path)
    ev = [e["args"]["Bytes"] for e in json.load(open(path))["traceEvents"] if e.get("name") == "[memory]"]
    os.unlink(path)
    return [x for x in ev if x > 0 and x != out.nbytes]
rows = []
for m, n, k in itertools.product([1, 8, 64, 512], [64, 256, 1024], [8, 16, 32, 48, 64, 96, 128, 256, 512, 768, 1024, 2048, 4096]):
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    rows.append([m, n, k, temps(lambda: a @ b), temps(lambda: torch.addmm(torch.randn(n, dtype=torch.bfloat16), a, b)),
                 temps(lambda: a @ b.t().contiguous().t())])
print(json.dumps({"isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "threads": torch.get_num_threads(),
                  "mkldnn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(), "rows": rows}))
