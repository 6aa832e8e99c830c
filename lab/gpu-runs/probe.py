"""CUDA facts for memplan: SDPA backend choice grid, per-backend saved/transient bytes, CUDA autocast dtypes
(real CUDA vs fake CUDA tensors), on this GPU. Writes JSON lines to $OUT/probe.jsonl."""
import itertools, json, os, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

OUT = open(os.path.join(os.environ.get("OUT", "."), "probe.jsonl"), "w")
def emit(kind, **kw):
    OUT.write(json.dumps(dict(kind=kind, **kw)) + "\n"); OUT.flush()

dev = torch.device("cuda")
emit("info", torch=torch.__version__, cap=torch.cuda.get_device_capability(), name=torch.cuda.get_device_name(),
     flash=torch.backends.cuda.flash_sdp_enabled(), mem=torch.backends.cuda.mem_efficient_sdp_enabled(),
     cudnn=torch.backends.cuda.cudnn_sdp_enabled(), math=torch.backends.cuda.math_sdp_enabled(),
     order=[int(x) for x in torch._C._get_sdp_priority_order()] if hasattr(torch._C, "_get_sdp_priority_order") else None,
     cudnn_version=torch.backends.cudnn.version(), total=torch.cuda.mem_get_info()[1])

def mask_of(kind, b, s_q, s_k, dtype):
    if kind == "none" or kind == "causal":
        return None
    if kind == "bool":
        return torch.ones(b, 1, s_q, s_k, dtype=torch.bool, device=dev).tril()
    if kind == "bool1":
        return torch.ones(1, 1, s_q, s_k, dtype=torch.bool, device=dev).tril()
    if kind == "float":
        return torch.zeros(b, 1, s_q, s_k, dtype=dtype, device=dev)
    if kind == "floath":
        return torch.zeros(b, 8, s_q, s_k, dtype=dtype, device=dev)
    raise ValueError(kind)

# ---- 1. choice grid ----
t0 = time.time()
n = 0
for dtype, (hq, hkv), gqa, (dq, dv), mk, drop, (sq, sk), rg in itertools.product(
        (torch.float32, torch.bfloat16, torch.float16), ((8, 8), (8, 2)), (False, True),
        ((64, 64), (72, 72), (80, 80), (96, 96), (128, 128), (160, 160), (192, 128), (192, 192), (256, 256), (320, 320), (512, 512)),
        ("none", "causal", "bool", "bool1", "float"), (0.0, 0.1), ((128, 128), (1024, 1024), (1, 128), (128, 256)), (True, False)):
    if gqa and hq == hkv:
        continue
    if not gqa and hq != hkv:
        continue
    if rg is False and (sq, sk) != (1024, 1024):
        continue
    b = 2
    q = torch.empty(b, hq, sq, dq, dtype=dtype, device=dev, requires_grad=rg)
    k = torch.empty(b, hkv, sk, dq, dtype=dtype, device=dev, requires_grad=rg)
    v = torch.empty(b, hkv, sk, dv, dtype=dtype, device=dev, requires_grad=rg)
    m = mask_of(mk, b, sq, sk, dtype)
    try:
        c = int(torch._fused_sdp_choice(q, k, v, m, drop, mk == "causal", None, gqa))
    except Exception as e:
        c = "err:" + type(e).__name__
    emit("choice", dtype=str(dtype)[6:], hq=hq, hkv=hkv, gqa=gqa, dq=dq, dv=dv, mask=mk, dropout=drop, sq=sq, sk=sk,
         grad=rg, choice=c)
    n += 1
emit("choice_done", n=n, s=round(time.time() - t0, 1))

# ---- 2. per-backend bytes ----
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
def measure(bk, b, hq, hkv, s, dq, dv, dtype, mk, drop, gqa):
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    q = torch.randn(b, hq, s, dq, dtype=dtype, device=dev, requires_grad=True)
    k = torch.randn(b, hkv, s, dq, dtype=dtype, device=dev, requires_grad=True)
    v = torch.randn(b, hkv, s, dv, dtype=dtype, device=dev, requires_grad=True)
    m = mask_of(mk, b, s, s, dtype)
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
        g = torch.randn_like(out)
        torch.cuda.synchronize(); before_bwd = torch.cuda.memory_allocated() - base; torch.cuda.reset_peak_memory_stats()
        with sdpa_kernel([BACKENDS[bk]]):
            out.backward(g)
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated() - base
        after_bwd = torch.cuda.memory_allocated() - base
        grads = sum(x.grad.untyped_storage().nbytes() for x in (q, k, v))
        emit("backend", backend=bk, b=b, hq=hq, hkv=hkv, s=s, dq=dq, dv=dv, dtype=str(dtype)[6:], mask=mk, dropout=drop,
             gqa=gqa, out_bytes=out.untyped_storage().nbytes(), out_stride=list(out.stride()), saved=list(saved.values()),
             fwd_peak=fwd_peak, after_fwd=after_fwd, before_bwd=before_bwd, bwd_peak=bwd_peak, after_bwd=after_bwd,
             grads=grads, in_bytes=[x.untyped_storage().nbytes() for x in (q, k, v)])
        del out, g
    except Exception as e:
        emit("backend", backend=bk, b=b, hq=hq, hkv=hkv, s=s, dq=dq, dv=dv, dtype=str(dtype)[6:], mask=mk, dropout=drop,
             gqa=gqa, error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
    del q, k, v, m

t0 = time.time()
shapes = [(2, 16, 16, 1024, 64, 64), (2, 16, 16, 2048, 128, 128), (2, 32, 8, 2048, 128, 128), (2, 16, 16, 1000, 64, 64),
          (4, 12, 12, 1024, 64, 64), (2, 8, 8, 2048, 256, 256), (1, 16, 16, 4096, 128, 128), (2, 16, 16, 1024, 192, 128),
          (2, 4, 1, 2048, 256, 256), (3, 9, 3, 777, 64, 64), (2, 16, 16, 4096, 64, 64)]
for (b, hq, hkv, s, dq, dv), dtype, bk, mk, drop in itertools.product(shapes, (torch.bfloat16, torch.float32),
                                                                     BACKENDS, ("causal", "bool", "float", "none"), (0.0, 0.1)):
    gqa = hq != hkv
    if bk == "math" and s >= 4096 and dtype == torch.float32:
        pass
    measure(bk, b, hq, hkv, s, dq, dv, dtype, mk, drop, gqa)
emit("backend_done", s=round(time.time() - t0, 1))

# ---- 3. autocast: real CUDA vs fake CUDA ----
from torch._subclasses.fake_tensor import FakeTensorMode
def ops():
    x = torch.randn(8, 16, device=dev); w = torch.randn(32, 16, device=dev); y3 = torch.randn(2, 8, 16, device=dev)
    lbl = torch.zeros(8, dtype=torch.long, device=dev)
    xh = x.to(torch.bfloat16)
    return {
        "linear": lambda: F.linear(x, w), "mm": lambda: x @ w.t(), "bmm": lambda: torch.bmm(y3, y3.transpose(1, 2)),
        "baddbmm": lambda: torch.baddbmm(torch.zeros(2, 8, 8, device=dev), y3, y3.transpose(1, 2)),
        "pow_scalar_fp32": lambda: torch.pow(x, 3.0), "pow_scalar_bf16": lambda: torch.pow(xh, 3.0),
        "pow_tensor": lambda: torch.pow(x, x), "exp_bf16": lambda: torch.exp(xh), "log_bf16": lambda: torch.log(xh.abs()),
        "softmax_bf16": lambda: torch.softmax(xh, -1), "log_softmax_bf16": lambda: torch.log_softmax(xh, -1),
        "layer_norm_bf16": lambda: F.layer_norm(xh, (16,)), "rms_norm_bf16": lambda: F.rms_norm(xh, (16,)) if hasattr(F, "rms_norm") else xh,
        "group_norm_bf16": lambda: F.group_norm(xh.view(8, 16, 1), 4),
        "gelu_bf16": lambda: F.gelu(xh), "gelu_tanh_bf16": lambda: F.gelu(xh, approximate="tanh"), "silu_bf16": lambda: F.silu(xh),
        "tanh_bf16": lambda: torch.tanh(xh), "sigmoid_bf16": lambda: torch.sigmoid(xh),
        "cross_entropy_bf16": lambda: F.cross_entropy(xh, lbl), "nll_bf16": lambda: F.nll_loss(xh, lbl),
        "mse_bf16": lambda: F.mse_loss(xh, xh), "sum_bf16": lambda: xh.sum(), "mean_bf16": lambda: xh.mean(),
        "prod_bf16": lambda: xh.prod(), "cumsum_bf16": lambda: xh.cumsum(0), "norm_bf16": lambda: xh.norm(),
        "rsqrt_bf16": lambda: torch.rsqrt(xh.abs()), "add_mixed": lambda: x + xh, "cat_mixed": lambda: torch.cat([x, xh]),
        "addcmul_mixed": lambda: torch.addcmul(x, xh, xh), "div_bf16": lambda: xh / 3, "reciprocal_bf16": lambda: torch.reciprocal(xh),
        "sdpa": lambda: F.scaled_dot_product_attention(y3[None], y3[None], y3[None]), "matmul": lambda: torch.matmul(y3, w.t()),
        "einsum": lambda: torch.einsum("bij,kj->bik", y3, w), "conv1d": lambda: F.conv1d(y3, torch.randn(4, 8, 3, device=dev)),
        "softplus_bf16": lambda: F.softplus(xh), "erf_bf16": lambda: torch.erf(xh), "sqrt_bf16": lambda: torch.sqrt(xh.abs()),
        "var_bf16": lambda: xh.var(-1), "topk_bf16": lambda: xh.topk(2).values, "clamp_bf16": lambda: xh.clamp(0, 1),
        "embedding": lambda: F.embedding(lbl, w), "dropout_bf16": lambda: F.dropout(xh, 0.1),
        "grouped_mm": lambda: torch._grouped_mm(torch.randn(8, 16, device=dev), torch.randn(2, 16, 32, device=dev), offs=torch.tensor([4, 8], dtype=torch.int32, device=dev)) if hasattr(torch, "_grouped_mm") else x,
    }
real = {}
with torch.autocast("cuda", dtype=torch.bfloat16):
    for name, fn in ops().items():
        try:
            real[name] = str(fn().dtype)[6:]
        except Exception as e:
            real[name] = "err:" + str(e).splitlines()[0][:80]
fake = {}
with FakeTensorMode(allow_non_fake_inputs=True):
    torch.set_autocast_enabled("cuda", True); torch.set_autocast_dtype("cuda", torch.bfloat16); torch.autocast_increment_nesting()
    try:
        for name, fn in ops().items():
            try:
                fake[name] = str(fn().dtype)[6:]
            except Exception as e:
                fake[name] = "err:" + str(e).splitlines()[0][:80]
    finally:
        torch.autocast_decrement_nesting(); torch.set_autocast_enabled("cuda", False)
emit("autocast", real=real, fake=fake, differ=[k for k in real if real[k] != fake.get(k)])
# fp16 autocast too
real16 = {}
with torch.autocast("cuda", dtype=torch.float16):
    for name, fn in ops().items():
        try:
            real16[name] = str(fn().dtype)[6:]
        except Exception as e:
            real16[name] = "err:" + str(e).splitlines()[0][:80]
emit("autocast_fp16", real=real16)
print("probe done", flush=True)
