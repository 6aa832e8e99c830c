"""Device call 2: SDPA backend choice (after a warm-up call, model-like layouts), per-backend bytes with model-like
layouts. Writes $OUT/probe2.jsonl."""
import itertools, json, os, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

OUT = open(os.path.join(os.environ.get("OUT", "."), "probe2.jsonl"), "w")
def emit(kind, **kw):
    OUT.write(json.dumps(dict(kind=kind, **kw)) + "\n"); OUT.flush()
dev = torch.device("cuda")
def order():
    return [int(x) for x in torch._C._get_sdp_priority_order()] if hasattr(torch._C, "_get_sdp_priority_order") else None
emit("order_before", order=order())
q = torch.randn(1, 8, 128, 64, device=dev, dtype=torch.bfloat16)
F.scaled_dot_product_attention(q, q, q, is_causal=True)
emit("order_after", order=order(), cudnn=torch.backends.cudnn.version(), cap=torch.cuda.get_device_capability())

def qkv(b, hq, hkv, sq, sk, dq, dv, dtype, rg, layout):
    if layout == "bshd":  # as transformers makes them: projections viewed (b, s, h, d), transposed
        q = torch.empty(b, sq, hq, dq, dtype=dtype, device=dev, requires_grad=rg).transpose(1, 2)
        k = torch.empty(b, sk, hkv, dq, dtype=dtype, device=dev, requires_grad=rg).transpose(1, 2)
        v = torch.empty(b, sk, hkv, dv, dtype=dtype, device=dev, requires_grad=rg).transpose(1, 2)
    else:
        q = torch.empty(b, hq, sq, dq, dtype=dtype, device=dev, requires_grad=rg)
        k = torch.empty(b, hkv, sk, dq, dtype=dtype, device=dev, requires_grad=rg)
        v = torch.empty(b, hkv, sk, dv, dtype=dtype, device=dev, requires_grad=rg)
    return q, k, v

def mask_of(kind, b, hq, sq, sk, dtype):
    if kind in ("none", "causal"):
        return None
    if kind == "bool":
        return torch.ones(b, 1, sq, sk, dtype=torch.bool, device=dev).tril()
    if kind == "bool1":
        return torch.ones(1, 1, sq, sk, dtype=torch.bool, device=dev).tril()
    if kind == "float":
        return torch.zeros(b, 1, sq, sk, dtype=dtype, device=dev)
    if kind == "float32":
        return torch.zeros(b, 1, sq, sk, dtype=torch.float32, device=dev)
    if kind == "floath":
        return torch.zeros(b, hq, sq, sk, dtype=dtype, device=dev)

t0 = time.time(); n = 0
for dtype, (hq, hkv, gqa), (dq, dv), mk, drop, (sq, sk), rg, layout in itertools.product(
        (torch.float32, torch.bfloat16, torch.float16), ((8, 8, False), (8, 2, True), (8, 1, True)),
        ((64, 64), (72, 72), (80, 80), (96, 96), (112, 112), (128, 128), (160, 160), (192, 128), (192, 192), (224, 224), (256, 256), (320, 320), (512, 512), (60, 60), (36, 36)),
        ("none", "causal", "bool", "bool1", "float", "float32", "floath"), (0.0, 0.1, 0.0625), ((1024, 1024), (128, 128), (1, 128), (128, 256), (1000, 1000), (4097, 4097)), (True, False), ("bshd", "bhsd")):
    if not rg and (sq, sk) != (1024, 1024):
        continue
    if layout == "bhsd" and (sq, sk) != (1024, 1024):
        continue
    if drop == 0.0625 and mk not in ("causal", "none"):
        continue
    if (sq, sk) == (4097, 4097) and (mk not in ("causal", "bool") or dtype == torch.float16):
        continue
    b = 2
    q, k, v = qkv(b, hq, hkv, sq, sk, dq, dv, dtype, rg, layout)
    m = mask_of(mk, b, hq, sq, sk, dtype)
    try:
        c = int(torch._fused_sdp_choice(q, k, v, attn_mask=m, dropout_p=drop, is_causal=mk == "causal", scale=None,
                                         enable_gqa=gqa))
    except Exception as e:
        c = "err:" + (str(e).splitlines()[0][:120] if str(e) else type(e).__name__)
    emit("choice", dtype=str(dtype)[6:], hq=hq, hkv=hkv, gqa=gqa, dq=dq, dv=dv, mask=mk, dropout=drop, sq=sq, sk=sk,
         grad=rg, layout=layout, choice=c)
    n += 1
emit("choice_done", n=n, s=round(time.time() - t0, 1))

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
def measure(bk, b, hq, hkv, s, dq, dv, dtype, mk, drop, gqa):
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    xq = torch.randn(b, s, hq, dq, dtype=dtype, device=dev, requires_grad=True)
    xk = torch.randn(b, s, hkv, dq, dtype=dtype, device=dev, requires_grad=True)
    xv = torch.randn(b, s, hkv, dv, dtype=dtype, device=dev, requires_grad=True)
    m = mask_of(mk, b, hq, s, s, dtype)
    q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
    if hkv != hq and not gqa:  # transformers' repeat_kv
        n_rep = hq // hkv
        k = k[:, :, None].expand(b, hkv, n_rep, s, dq).reshape(b, hq, s, dq)
        v = v[:, :, None].expand(b, hkv, n_rep, s, dv).reshape(b, hq, s, dv)
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v) + ((m,) if m is not None else ())}
    saved = {}
    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in inputs:
            saved.setdefault(st.data_ptr(), (st.nbytes(), str(t.dtype)[6:], list(t.shape), t.device.type))
        return t
    torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with sdpa_kernel([BACKENDS[bk]]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=drop, is_causal=mk == "causal",
                                                     enable_gqa=gqa)
        torch.cuda.synchronize()
        fwd_peak = torch.cuda.max_memory_allocated() - base
        after_fwd = torch.cuda.memory_allocated() - base
        # the model's next op: transpose(1, 2).contiguous()
        g = torch.randn_like(out)
        torch.cuda.synchronize(); before_bwd = torch.cuda.memory_allocated() - base; torch.cuda.reset_peak_memory_stats()
        gi = torch.autograd.grad(out, (q, k, v), g)
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated() - base
        after_bwd = torch.cuda.memory_allocated() - base
        emit("backend", backend=bk, b=b, hq=hq, hkv=hkv, s=s, dq=dq, dv=dv, dtype=str(dtype)[6:], mask=mk, dropout=drop,
             gqa=gqa, out_bytes=out.untyped_storage().nbytes(), out_stride=list(out.stride()), saved=list(saved.values()),
             fwd_peak=fwd_peak, after_fwd=after_fwd, before_bwd=before_bwd, bwd_peak=bwd_peak, after_bwd=after_bwd,
             grads=[x.untyped_storage().nbytes() for x in gi], grad_strides=[list(x.stride()) for x in gi])
        del out, g, gi
    except Exception as e:
        emit("backend", backend=bk, b=b, hq=hq, hkv=hkv, s=s, dq=dq, dv=dv, dtype=str(dtype)[6:], mask=mk, dropout=drop,
             gqa=gqa, error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__)

t0 = time.time()
shapes = [(2, 16, 16, 1024, 64, 64, False), (2, 32, 8, 2048, 128, 128, True), (2, 32, 8, 2048, 128, 128, False),
          (2, 16, 16, 1000, 64, 64, False), (2, 8, 8, 2048, 256, 256, False), (2, 4, 1, 2048, 256, 256, True),
          (2, 4, 1, 2048, 256, 256, False), (3, 9, 3, 777, 64, 64, True), (2, 16, 16, 4096, 128, 128, False),
          (2, 16, 16, 1024, 192, 128, False), (2, 24, 2, 4096, 128, 128, True), (1, 12, 12, 333, 80, 80, False)]
for (b, hq, hkv, s, dq, dv, gqa), dtype, bk, mk, drop in itertools.product(
        shapes, (torch.bfloat16, torch.float32), BACKENDS, ("causal", "bool", "float", "float32"), (0.0, 0.1)):
    if bk == "math" and s >= 4096:
        continue
    measure(bk, b, hq, hkv, s, dq, dv, dtype, mk, drop, gqa)
emit("backend_done", s=round(time.time() - t0, 1))
print("probe2 done", flush=True)
