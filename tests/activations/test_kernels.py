"""memplan.activations.kernels against what an H100 (torch 2.11.0+cu130, cuDNN 9.19) measured: SDPA's backend choice for
17,730 calls, and the bytes each fused backend saves and allocates (tests/data, made by lab/gpu-runs/probe2.py)."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest

from memplan.activations import kernels as K

DATA = Path(__file__).resolve().parents[1] / "data"


def _call(dtype, hq, hkv, gqa, dq, dv, mask, dropout, sq, sk):  # noqa: ANN001, ANN202
    mask_kind = {"none": None, "causal": None, "bool": "bool", "bool1": "bool", "float": "float",
                 "floath": "float", "float32": "float32" if dtype != "float32" else "float"}[mask]
    shape = {"bool1": (1, 1, sq, sk), "floath": (2, hq, sq, sk)}.get(mask, (2, 1, sq, sk))
    return K.SdpaCall(dtype=dtype, batch=2, hq=hq, hkv=hkv, sq=sq, sk=sk, dq=dq, dv=dv, mask=mask_kind,
                      mask_shape=shape if mask_kind else None, dropout=dropout, is_causal=mask == "causal",
                      enable_gqa=gqa)


def test_cuda_backend_choice_matches_every_measured_call():
    doc = json.loads(gzip.open(DATA / "sdpa_choice_h100.json.gz", "rt").read())
    names = doc["backends"]
    wrong = []
    for dtype, hq, hkv, gqa, dq, dv, mask, dropout, sq, sk, grad, layout, choice in doc["rows"]:
        got, _ = K.cuda_backend(_call(dtype, hq, hkv, gqa, dq, dv, mask, dropout, sq, sk), "sm90")
        if got != names[str(choice)]:
            wrong.append((dtype, hq, hkv, gqa, dq, dv, mask, dropout, sq, sk, got, names[str(choice)]))
    assert len(doc["rows"]) == 17730 and wrong == []


def test_priority_order_after_the_first_call_puts_cudnn_first_on_hopper():
    doc = json.loads(gzip.open(DATA / "sdpa_choice_h100.json.gz", "rt").read())
    after = next(p for p in doc["priority"] if p["kind"] == "order_after")["order"]
    assert [doc["backends"].get(str(i)) for i in after[:4]] == list(K.priority_order("sm90"))
    assert K.priority_order("sm80") == ("flash", "efficient", "math")


def test_fused_backends_save_and_allocate_what_they_did_on_the_h100():
    # the kernels' own tensors (SdpaBackend.saved, with the 512-byte blocks the allocator counts) and the backward's
    # scratch, for every causal and masked case measured with model-like (b, s, h, d) layouts
    rows = json.loads(gzip.open(DATA / "sdpa_backend_bytes_h100.json.gz", "rt").read())
    checked = exact = 0
    for r in rows:
        if r["backend"] == "math" or r["dropout"] or r["mask"] not in ("causal", "bool"):
            continue
        if r["dq"] != r["dv"] or r["s"] % 128 or r["dq"] % 32:
            continue  # the layouts and roundings these rules are exact for
        call = K.SdpaCall(dtype=r["dtype"], batch=r["b"], hq=r["hq"], hkv=r["hkv"] if r["gqa"] else r["hq"], sq=r["s"], sk=r["s"], dq=r["dq"],
                          dv=r["dv"], mask="bool" if r["mask"] == "bool" else None, mask_shape=(r["b"], 1, r["s"], r["s"])
                          if r["mask"] == "bool" else None, is_causal=r["mask"] == "causal", enable_gqa=r["gqa"])
        block = lambda n: -(-n // 512) * 512  # noqa: E731
        want = sum(block(x[0]) for x in r["saved"] if x[2] != [r["b"], r["hq"], r["s"], r["dv"]])  # not the output
        size = {"float32": 4, "bfloat16": 2, "int64": 8}
        got = sum(block(max(1, _numel(shape)) * size[dt]) for shape, dt in K.BACKENDS[r["backend"]].saved(call))
        assert got == want, (r["backend"], r["dtype"], r["mask"], r["s"], r["dq"])
        scratch = r["bwd_peak"] - r["before_bwd"] - sum(r["grads"])
        if r["backend"] == "efficient" and r["hkv"] == r["hq"]:
            # derived from PyTorch's source (kernels.efficient_backward): to the byte
            assert K.BACKENDS[r["backend"]].backward_scratch(call) == scratch, r
            exact += 1
        elif r["backend"] != "efficient":
            slack = 2 * 512 + 4 * r["b"] * r["hq"] * r["s"] + (0.25 * scratch if r["dq"] > 128 else 0) + (1 << 20)
            assert 0 <= K.BACKENDS[r["backend"]].backward_scratch(call) - scratch <= slack, r
        checked += 1
    assert checked >= 20 and exact >= 6


def _numel(shape) -> int:  # noqa: ANN001
    n = 1
    for x in shape:
        n *= x
    return n


@pytest.mark.parametrize("arch,cls", [("sm90", "sm90"), ("sm100", "sm90"), ("sm80", "sm80"), ("sm86", "sm86"),
                                      ("sm89", "sm86"), ("sm120", "sm86"), ("sm70", "sm70"), ("gfx942", "rocm")])
def test_architecture_classes(arch, cls):
    assert K.sdpa_class(arch) == cls


def test_cuda_reduction_staging_buffers_match_the_recorded_streams():
    # bench/gpu/traces/phi2_ddp_fp32 (H100: 132 SMs, 2,048 threads each): the bias gradients' sums over 4,096
    # tokens (head 51,200 wide, fc2 / dense 2,560, fc1 10,240), each with its int semaphores
    h100 = (132, 2048, 32)
    assert K.reduce_scratch((4096, 51200), (51200, 1), (0,), 4, 4, 4, h100) == (157286400, 1600)
    assert K.reduce_scratch((2, 2048, 51200), (2048 * 51200, 51200, 1), (0, 1), 4, 4, 4, h100) == (157286400, 1600)
    assert K.reduce_scratch((4096, 2560), (2560, 1), (0,), 4, 4, 4, h100)[0] == 83886080
    assert K.reduce_scratch((4096, 10240), (10240, 1), (0,), 4, 4, 4, h100)[0] == 141557760
    # llama-3.2-1b's norm weights over 8,192 tokens (../shared/gpu/traces/ddp_amp: 134,217,728 B transients)
    assert K.reduce_scratch((4, 2048, 2048), (2048 * 2048, 2048, 1), (0, 1), 4, 4, 4, h100)[0] == 134217728
    # a reduction over the innermost dim fills the GPU without splitting: no buffer
    assert K.reduce_scratch((8192, 2048), (2048, 1), (1,), 4, 4, 4, h100) == (0, 0)
    # fewer multiprocessors split the head's sum in fewer blocks (A100: 108)
    assert K.reduce_scratch((4096, 51200), (51200, 1), (0,), 4, 4, 4, (108, 2048, 32))[0] == 4 * 51200 * 5 * 128


def test_embedding_backward_partial_segments_match_the_recorded_streams():
    # phi-2 fp32, 4,096 tokens of a 51,200 x 2,560 table; llama-3.2-1b, 8,192 tokens, 2,048 wide (bf16 -> fp32)
    assert K.embedding_backward_scratch(4096, 51200, 2560, 4, False) == 46131200
    assert K.embedding_backward_scratch(8192, 128256, 2048, 4, False) == 73818112
    assert K.embedding_backward_scratch(3072, 51200, 2560, 4, False) == 0  # the direct kernel, no sort
    assert K.embedding_backward_scratch(3072, 51200, 2560, 4, True) > 0


def test_efficient_backward_workspace_of_phi2_fp32():
    # the 67,141,632 B the phi2_ddp_fp32 stream shows per layer: 128-query tiles, two 64-wide column tiles of dQ
    call = K.SdpaCall(dtype="float32", batch=2, hq=32, hkv=32, sq=2048, sk=2048, dq=80, dv=80, is_causal=True)
    temps, delta, work = K.efficient_backward(call, "sm90")
    assert work == 67141632 and delta == 4 * 2 * 32 * 2048
    assert temps == [4 * 2 * 2048 * 32 * 80, 4 * 2 * 2048 * 32]  # (grad_out * out) and its sum over the head dim


def test_target_key_names_a_gpu_shape_other_than_its_classs_usual_part():
    assert K.Target(device="cuda", arch="sm90").key == "cuda:sm90"
    assert K.Target(device="cuda", arch="sm90", sms=132).key == "cuda:sm90"
    assert K.Target(device="cuda", arch="sm80").key == "cuda:sm80"
    assert K.Target(device="cuda", arch="sm100").key == "cuda:sm90:148sm2048t"
    assert K.Target(device="cuda", arch="sm90", sms=114).key == "cuda:sm90:114sm2048t"
    assert K.Target(device="cuda", arch="gfx942").gpu == (304, 2048, 64)


def test_a_backend_is_one_class_in_the_registry():
    # the priority on each GPU comes from the backends' own ranks; each name is its class's
    assert set(K.BACKENDS) == {"cudnn", "flash", "efficient", "math"}
    assert all(name == b.name for name, b in K.BACKENDS.items())
    assert [b.name for b in K.BACKENDS.values() if not b.fused] == ["math"]
    assert K.priority_order("sm100") == ("cudnn", "flash", "efficient", "math")
    assert K.priority_order("sm70") == ("flash", "efficient", "math")  # flash refuses there (why_not), math runs
    call = K.SdpaCall(dtype="bfloat16", batch=2, hq=8, hkv=8, sq=1024, sk=1024, dq=64, dv=64, is_causal=True)
    assert K.cuda_backend(call, "sm70")[0] == "math"  # below sm80 memory-efficient takes fp16 and fp32 only
    assert K.cuda_backend(replace(call, dtype="float16"), "sm70")[0] == "efficient"
    assert K.cuda_backend(call, "sm90")[0] == "cudnn" and K.cuda_backend(call, "sm80")[0] == "flash"


def test_a_learned_bias_as_mask_takes_the_kernel_that_makes_its_gradient():
    """A mask that requires grad (T5's relative position bias): cuDNN and the CPU flash kernel refuse it
    (sdp_utils_cpp.h check_attn_mask_shape, which can_use_cudnn_attention and the CPU flash check both run), flash
    takes no mask, so a GPU runs memory-efficient attention and a CPU the math kernel."""
    c = K.SdpaCall(dtype="bfloat16", batch=2, hq=12, hkv=12, sq=256, sk=64, dq=64, dv=64, mask="float",
                   mask_shape=(2, 12, 256, 64), mask_grad=True)
    assert K.cuda_backend(c, "sm90")[0] == "efficient"
    assert K.cuda_backend(replace(c, mask_grad=False), "sm90")[0] == "cudnn"
    assert K.cpu_backend(c)[0] == "math" and K.cpu_backend(replace(c, mask_grad=False))[0] == "flash"


def test_the_cpu_chooses_math_for_a_mask_that_requires_grad():
    """The rule above, against torch's own choice on CPU tensors (the profiler names the kernel that ran)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    for grad, kernel in ((True, "aten::_scaled_dot_product_attention_math"),
                         (False, "aten::_scaled_dot_product_flash_attention_for_cpu")):
        m = torch.randn(1, 4, 16, 16, requires_grad=grad)
        with torch.profiler.profile() as prof:
            F.scaled_dot_product_attention(q, k, v, attn_mask=m).sum().backward()
        assert kernel in {e.name for e in prof.events()}
        assert (m.grad is not None) == grad


def test_memory_efficient_backward_makes_the_bias_gradient():
    """The traced stand-in for memory-efficient attention returns the mask's gradient from a buffer of the
    expanded bias's sizes with its last dim rounded up to 16, in the bias's dtype (attention_backward.cu
    _efficient_attention_backward, bias_requires_grad)."""
    torch = pytest.importorskip("torch")
    from memplan.activations.substitutes_sdpa import fused_kernel

    fused = fused_kernel(K.Target(device="cuda", arch="sm90"))
    q, k, v = (torch.randn(2, 3, 20, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = torch.randn(2, 3, 20, 20, dtype=torch.bfloat16, requires_grad=True)
    call = K.SdpaCall(dtype="bfloat16", batch=2, hq=3, hkv=3, sq=20, sk=20, dq=8, dv=8, mask="float",
                      mask_shape=(2, 3, 20, 20), mask_grad=True)
    out = fused.apply(q, k, v, mask, "efficient", call)
    grads = torch.autograd.grad(out.sum(), (q, mask))
    assert grads[1].shape == mask.shape and grads[1].dtype == torch.bfloat16
    assert grads[1].untyped_storage().nbytes() == 2 * 3 * 20 * 32 * 2  # 20 keys rounded up to 32
