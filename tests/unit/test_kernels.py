"""memplan.kernels against what an H100 (torch 2.11.0+cu130, cuDNN 9.19) measured: SDPA's backend choice for
17,730 calls, and the bytes each fused backend saves and allocates (tests/data, made by bench/gpu/device/probe2.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from memplan import kernels as K

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
    # the kernels' own tensors (saved_extra, with the 512-byte blocks the allocator counts) and the backward's
    # scratch, for every causal and masked case measured with model-like (b, s, h, d) layouts
    rows = json.loads(gzip.open(DATA / "sdpa_backend_bytes_h100.json.gz", "rt").read())
    checked = 0
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
        got = sum(block(max(1, _numel(shape)) * size[dt]) for shape, dt in K.saved_extra(r["backend"], call))
        assert got == want, (r["backend"], r["dtype"], r["mask"], r["s"], r["dq"])
        scratch = r["bwd_peak"] - r["before_bwd"] - sum(r["grads"])
        slack = 2 * 512 + 4 * r["b"] * r["hq"] * r["s"] + (0.25 * scratch if r["dq"] > 128 else 0) + (1 << 20)
        assert 0 <= K.backward_scratch(r["backend"], call) - scratch <= slack, r
        checked += 1
    assert checked >= 20


def _numel(shape) -> int:  # noqa: ANN001
    n = 1
    for x in shape:
        n *= x
    return n


@pytest.mark.parametrize("arch,cls", [("sm90", "sm90"), ("sm100", "sm90"), ("sm80", "sm80"), ("sm86", "sm86"),
                                      ("sm89", "sm86"), ("sm120", "sm86"), ("sm70", "sm70"), ("gfx942", "rocm")])
def test_architecture_classes(arch, cls):
    assert K.sdpa_class(arch) == cls
