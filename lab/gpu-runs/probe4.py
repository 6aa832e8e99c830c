"""Device call 4: the math kernel with broadcast MQA (k, v with one head, no enable_gqa: Falcon's call)."""
import json, os
import torch
import torch.nn.functional as F
OUT = open(os.path.join(os.environ.get("OUT", "."), "probe4.jsonl"), "w")
dev = torch.device("cuda")
def measure(b, hq, hkv, s, d, dtype, gqa, layout, autocast):
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    if layout == "falcon":  # q copied contiguous (b, h, s, d); k, v (b, 1, s, d) views
        xq = torch.randn(b, s, hq, d, device=dev, dtype=torch.float32 if autocast else dtype, requires_grad=True)
        xk = torch.randn(b, s, hkv, d, device=dev, dtype=torch.float32 if autocast else dtype, requires_grad=True)
        xv = torch.randn(b, s, hkv, d, device=dev, dtype=torch.float32 if autocast else dtype, requires_grad=True)
        q = xq.transpose(1, 2).reshape(b, hq, s, d)
        k = xk.transpose(1, 2).reshape(b, hkv, s, d)
        v = xv.transpose(1, 2).reshape(b, hkv, s, d)
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    saved = {}
    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in inputs:
            saved.setdefault(st.data_ptr(), (st.nbytes(), str(t.dtype)[6:], list(t.shape)))
        return t
    torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            choice = int(torch._fused_sdp_choice(q.to(torch.bfloat16) if autocast else q, (k.to(torch.bfloat16) if autocast else k), (v.to(torch.bfloat16) if autocast else v), is_causal=True, enable_gqa=gqa))
            torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base; after_fwd = torch.cuda.memory_allocated() - base
    g = torch.randn_like(out)
    torch.cuda.synchronize(); before = torch.cuda.memory_allocated() - base; torch.cuda.reset_peak_memory_stats()
    gi = torch.autograd.grad(out, (q, k, v), g)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    OUT.write(json.dumps(dict(b=b, hq=hq, hkv=hkv, s=s, d=d, dtype=str(dtype)[6:], gqa=gqa, autocast=autocast, choice=choice,
        saved=list(saved.values()), fwd_peak=fwd_peak, after_fwd=after_fwd, before_bwd=before, bwd_peak=bwd_peak,
        grads=[x.untyped_storage().nbytes() for x in gi], out=out.untyped_storage().nbytes())) + "\n"); OUT.flush()
for args in [(2, 71, 1, 2048, 64, torch.float32, False, "falcon", True), (2, 71, 1, 1024, 64, torch.float32, False, "falcon", False),
             (2, 16, 1, 1024, 64, torch.bfloat16, False, "falcon", False), (2, 16, 4, 1024, 64, torch.float32, True, "falcon", False),
             (2, 16, 1, 1024, 64, torch.float32, True, "falcon", False), (2, 16, 16, 1024, 64, torch.float32, False, "falcon", False)]:
    try:
        measure(*args)
    except Exception as e:
        OUT.write(json.dumps({"args": str(args), "error": str(e)[:200]}) + "\n")
print("probe4 done")
