"""Models of two stacks of unlike blocks (a vision-language model's vision tower and language model) and the
trace's rules they exposed: the head's side of the root, the most inside any block's backward, a boolean
attention mask as the kernels keep it, and a branch no loss reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.request import JobRequest

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def test_the_head_side_of_the_root_is_what_follows_the_last_block():
    """LLaVA's projector and its language model's input embedding sit between the two stacks: their gradients come
    after the language model's backward, not with the head's (layouts._gather_sizes root_head)."""
    pytest.importorskip("torch")
    from memplan import layouts
    from memplan.model import sources

    inv = sources.build_inventory(sources.resolve(str(CONFIGS / "llava-tiny.json")))
    g = layouts.gather_sizes(inv, "replicated", 1)
    # lm_head 1024 x 128 and the language model's final norm (128): nothing between the stacks
    assert g.root_head == 1024 * 128 + 128
    assert g.head_largest_tensor == 1024 * 128


def test_every_backward_point_carries_the_gradients_made_by_then():
    """step.backward_grads: each gradient from its creation on, a tied weight's first contribution over its own
    interval (the head's partial gradient until the embedding's sum replaces it)."""
    from types import SimpleNamespace

    from memplan.activations.tracing.step import backward_grads

    timeline = [5, 6, 7, 8, 9, 10]
    h = SimpleNamespace(grads=[(2, 1, 10), (4, -1, 100)], partials=[(1, 4, 100)])
    # the forward ends at index 1 (the backward's points from its last): 1 .. 5
    assert backward_grads(timeline, h, 2) == [[6, 100, 0], [7, 110, 0], [8, 110, 0], [9, 110, 0], [10, 110, 0]]


def test_a_boolean_mask_is_converted_and_kept_for_backward():
    """scaled_dot_product_attention converts a boolean mask into an additive one in the query's dtype for each call
    (aten's convert_boolean_attn_mask) and the kernel keeps it for backward: what torch saves for the CPU flash
    kernel, and what the stand-in saves (kernels.FlashAttention.saved on CPU; the CUDA kernels' own rules kept it
    already, measured on the H100)."""
    torch = pytest.importorskip("torch")
    from memplan.activations import kernels as K
    from memplan.activations.substitutes_sdpa import fused_kernel

    q = torch.zeros(2, 4, 128, 32, requires_grad=True)
    mask = torch.ones(2, 1, 128, 128, dtype=torch.bool)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert ((2, 1, 128, 128), torch.float32) in saved
    call = K.SdpaCall(dtype="float32", batch=2, hq=4, hkv=4, sq=128, sk=128, dq=32, dv=32, mask="bool",
                      mask_shape=(2, 1, 128, 128))
    assert K.BACKENDS["flash"].saved(call, "cpu") == [((2, 4, 128), "float32"), ((2, 1, 128, 128), "float32")]
    causal = K.SdpaCall(dtype="float32", batch=2, hq=4, hkv=4, sq=128, sk=128, dq=32, dv=32, is_causal=True)
    assert K.BACKENDS["flash"].saved(causal, "cpu") == [((2, 4, 128), "float32")]
    ours = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: ours.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        fused_kernel(K.host_target("cpu")).apply(q, q, q, mask, "flash", call)
    assert ((2, 1, 128, 128), torch.float32) in ours


@pytest.mark.parametrize("config,recompute,peak", [
    # the trace's own peak (activations and gradients) of one step at micro-batch 2 and 128 tokens on this CPU,
    # against the CPU harness's measured peak less weights and optimizer states: Gemma 3 full recompute measured
    # 11,768,664 B (this engine: 11,751,180 with the buffers, -0.15%), LLaVA 12,373,096 B (12,355,616, -0.14%)
    ("gemma3-vl-tiny.json", "full", 11_751_180),
    ("llava-tiny.json", "full", 12_355_616),
])
def test_a_training_vision_tower_under_recompute(config, recompute, peak):
    pytest.importorskip("torch")
    from memplan import accounting, options
    from memplan.model import sources

    src = sources.resolve(str(CONFIGS / config))
    inv = sources.build_inventory(src)
    s = options.resolve(inv, JobRequest.of(gpus=1, micro_batch=2, seq_len=128, device="cpu", precision="fp32",
                                           recompute=recompute, cpu_isa="avx512_bf16"), config=src.config).settings
    assert accounting.estimate(inv, s).peak_bytes == peak
