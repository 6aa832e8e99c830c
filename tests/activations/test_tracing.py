"""Traced activation profiles: linear in the micro-batch, linear in the sequence with flash attention,
quadratic with eager attention, recompute, the disk cache, and the engine's use of them."""

from __future__ import annotations

import pytest

from memplan import activations as act
from memplan.activations import profile_cache
from memplan.model.scaling import scale_config
from memplan.model import sources
from memplan.activations.kernels import Target
from memplan.activations.tracing import trace_profile
from memplan.request import JobRequest

#: the CPU the exact CPU figures below were measured on (AVX512 without bf16 instructions: oneDNN's fp32 GEMM
#: scratch); a trace for it is the same on any host
AVX512 = Target(device="cpu", cpu_isa="avx512")


def tiny(name: str = "llama-7b") -> dict:
    return scale_config(sources.resolve(name).config, layers=3, hidden=256, vocab=1024)[0]


def per_layer(cfg: dict, seq: int, attention: str, b: int = 1) -> int:
    p = trace_profile(cfg, seq_len=seq, recipe="deepspeed-bf16", attention=attention, recompute="none")
    return p["per_layer"][0] + b * p["per_layer"][1]


def test_linear_in_micro_batch_at_a_third_point():
    from memplan.activations.tracing.step import one_step

    # a GPU trace counts every storage in 512-byte blocks: exact at any micro-batch when each per-sequence tensor
    # is a multiple of 512 bytes, as at sequence 128 (at 64, an fp32 [b, s] norm statistic is not)
    cfg = tiny()
    p = trace_profile(cfg, seq_len=128, recipe="deepspeed-bf16", attention="flash", recompute="none")
    direct = one_step(scale_config(cfg, layers=2)[0], 3, 128, "deepspeed-bf16", "flash", "none")
    c0, c1 = p["live_after_forward"]
    assert c0 + 3 * c1 == direct["live"]


def test_flash_is_linear_in_sequence_and_eager_adds_the_quadratic_term():
    cfg = tiny()
    # linear but for the fused kernel's philox seed and offset, two 512-byte blocks per layer whatever the length
    assert per_layer(cfg, 256, "flash") == 2 * per_layer(cfg, 128, "flash") - 2 * 512
    heads = cfg["num_attention_heads"]
    # eager keeps the fp32 softmax output (4 B) and its bf16 cast read by the second matmul (2 B): 6 * heads * s^2
    quad = per_layer(cfg, 256, "eager") - 2 * per_layer(cfg, 128, "eager")
    assert quad == 6 * heads * (256 ** 2 - 2 * 128 ** 2)


def test_full_recompute_keeps_block_inputs_only():
    cfg = tiny()
    p = trace_profile(cfg, seq_len=128, recipe="deepspeed-bf16", attention="flash", recompute="full")
    assert p["per_layer"] == [0, 128 * cfg["hidden_size"] * 2]  # one bf16 hidden state per token per block


def test_profile_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    cfg = tiny()
    first = profile_cache.load_or_trace(cfg, seq_len=64, micro_batch=2, recipe="fsdp-bf16", attention="flash", recompute="none")
    again = profile_cache.load_or_trace(cfg, seq_len=64, micro_batch=2, recipe="pure-bf16", attention="sdpa", recompute="none")
    assert first.origin == "traced now" and again.origin == "cache"  # bf16 recipes and sdpa/flash share a trace
    assert first.forward_bytes("none") == again.forward_bytes("none") > 0
    assert profile_cache.load_or_trace(cfg, seq_len=80, micro_batch=1, recipe="fp32", attention="flash", recompute="none",
                             allow_trace=False) is None


def test_a_profile_cached_by_another_revision_of_the_tracing_is_traced_again(tmp_path, monkeypatch):
    """A fix to the tracing (tracing_keys.TRACE_REVISION) reaches the profiles a disk cache kept from before it."""
    import json

    from memplan.activations import tracing_keys

    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    cfg = tiny()
    key = dict(seq_len=64, micro_batch=2, recipe="fsdp-bf16", attention="flash", recompute="none")
    assert profile_cache.load_or_trace(cfg, **key).origin == "traced now"
    assert profile_cache.load_or_trace(cfg, **key).origin == "cache"
    (path,) = tmp_path.glob("activations/*.json")
    assert json.loads(path.read_text())["trace_revision"] == tracing_keys.TRACE_REVISION
    monkeypatch.setattr(profile_cache, "_READ", {})
    monkeypatch.setattr(profile_cache, "TRACE_REVISION", tracing_keys.TRACE_REVISION + 1)
    assert profile_cache.load_or_trace(cfg, **key, allow_trace=False) is None
    assert profile_cache.load_or_trace(cfg, **key).origin == "traced now"


@pytest.mark.parametrize("name", sources.preset_names())
def test_shipped_profiles_cover_every_preset(name):
    # what tools/ship_activation_profiles.py traces: every preset at the default sequence, both traced recipes,
    # with and without recompute, and DeepSpeed ZeRO-3's linear where it differs on a GPU (autocast). A preset
    # without an analytic builder (a vision-language model: its inventory is built on the meta device, so its
    # estimate imports torch anyway) traces on first use and is cached
    from memplan.model import families

    if not families.supports(sources.resolve(name).config):
        pytest.skip("built on the meta device: traced on first use")
    for recipe, linear in (("deepspeed-bf16", "aten"), ("torch-amp", "aten"), ("torch-amp", "deepspeed-zero3")):
        for recompute in ("none", "full"):
            p = profile_cache.load_or_trace(sources.resolve(name).config, seq_len=2048, micro_batch=1, recipe=recipe,
                                  attention="flash", recompute=recompute, allow_trace=False, linear=linear)
            assert p is not None and p.origin == "shipped", (recipe, recompute, linear)


def test_building_the_transformers_config_leaves_the_dict_alone():
    # transformers fills rope_scaling in place (rope_theta); the caller's dict, and so the profile's cache key,
    # must not change (it did: the shipped llama-3.1-405b and deepseek-v3 profiles were keyed after a mutation)
    import copy

    from memplan.model.meta_builder import hf_config

    for name in ("llama-3.1-405b", "deepseek-v3"):
        cfg = sources.resolve(name).config
        before = copy.deepcopy(cfg)
        hf_config(cfg)
        assert cfg == before


@pytest.mark.parametrize("name,one_block_at_3", [("gpt2", 10_040_320), ("qwen2.5-7b", 9_776_128),
                                                  ("mistral-7b", 7_674_880)])
def test_other_families_profile_predicts_a_direct_step_exactly(name, one_block_at_3):
    # the profile (two traced blocks, micro-batches 2 and 4) against steps run directly at a third micro-batch:
    # the live bytes after forward of two blocks, and one more block's, to the byte (sequence 128, where every
    # per-sequence tensor is whole 512-byte blocks)
    from memplan.activations.tracing.step import one_step

    cfg = scale_config(sources.resolve(name).config, layers=3, hidden=256, vocab=1024)[0]
    p = trace_profile(cfg, seq_len=128, recipe="torch-amp", attention="flash", recompute="none")
    two = one_step(scale_config(cfg, layers=2)[0], 3, 128, "torch-amp", "flash", "none")["live"]
    three = one_step(cfg, 3, 128, "torch-amp", "flash", "none")["live"]
    c0, c1 = p["live_after_forward"]
    a, b = p["per_layer"]
    assert c0 + 3 * c1 == two
    assert a + 3 * b == three - two == one_block_at_3


def test_cpu_attention_with_dropout_is_traced_with_the_math_kernel():
    # CPU SDPA has no fused kernel with dropout (it runs _scaled_dot_product_attention_math, which keeps the
    # probabilities); CUDA's flash kernels support dropout. GPT-2 trains with attn_pdrop 0.1.
    from memplan import options
    from memplan.model import sources

    src = sources.resolve("gpt2")
    inv = sources.build_inventory(src)
    cpu = options.resolve(inv, JobRequest.of(gpus=2, strategy="ddp", device="cpu", seq_len=128, micro_batch=2), config=src.config)
    gpu = options.resolve(inv, JobRequest.of(gpus=2, strategy="ddp", device="cuda", seq_len=128, micro_batch=2), config=src.config)
    assert "dropout 0.1" in cpu.settings.activation_profile.data["attention_kernels"]["math"]
    assert any("math kernel" in n for n in cpu.notes)
    assert "math" not in gpu.settings.activation_profile.data["attention_kernels"]
    # the math kernel keeps the attention probabilities: more bytes than flash, quadratic in the sequence
    assert cpu.settings.activation_profile.terms("none", 2)[2] > gpu.settings.activation_profile.terms("none", 2)[2]


@pytest.mark.parametrize("dims,dropout", [((64, 64, 64), 0.0), ((64, 64, 64), 0.1), ((192, 192, 128), 0.0),
                                          ((128, 128, 128), 0.0), ((96, 96, 64), 0.1)])
def test_sdpa_kernel_choice_follows_the_cpu_dispatch(dims, dropout):
    # memplan's rule against PyTorch's own choice on real CPU tensors (0 = math)
    import torch

    from memplan.activations.kernels import SdpaCall, cpu_backend

    q, k, v = (torch.randn(2, 4, 16, d, dtype=torch.bfloat16) for d in dims)
    real_math = torch._fused_sdp_choice(q, k, v, dropout_p=dropout, is_causal=True) == 0
    call = SdpaCall(dtype="bfloat16", batch=2, hq=4, hkv=4, sq=16, sk=16, dq=dims[0], dv=dims[2], dropout=dropout,
                    is_causal=True)
    assert (cpu_backend(call)[0] == "math") == real_math


@pytest.mark.parametrize("hkv,gqa", [(1, False), (1, True), (2, True), (2, False), (4, False)])
def test_cpu_sdpa_heads_follow_the_cpu_dispatch(hkv, gqa):
    """Key and value heads fewer than the query's: the CPU flash kernel takes them grouped (enable_gqa), math takes
    them broadcast (Falcon's multi-query attention passes one key head without enable_gqa)."""
    import torch

    from memplan.activations.kernels import SdpaCall, cpu_backend

    q = torch.randn(2, 4, 16, 64, dtype=torch.bfloat16)
    kv = torch.randn(2, hkv, 16, 64, dtype=torch.bfloat16)
    real_math = torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, enable_gqa=gqa) == 0
    call = SdpaCall(dtype="bfloat16", batch=2, hq=4, hkv=hkv, sq=16, sk=16, dq=64, dv=64, is_causal=True,
                    enable_gqa=gqa)
    assert (cpu_backend(call)[0] == "math") == real_math


def test_mla_attention_on_cpu_is_traced_with_the_math_kernel():
    # DeepSeek's MLA: q and k head dims 192 (nope + rope), v 128; CPU flash needs one head dim
    cfg = scale_config(sources.resolve("deepseek-v3").config, layers=2, hidden=256, vocab=1024)[0]
    p = trace_profile(cfg, seq_len=64, recipe="deepspeed-bf16", attention="flash", recompute="none", device="cpu", target=AVX512)
    assert "differ" in p["attention_kernels"]["math"]


def _tied_step(hook: bool):  # noqa: ANN202
    """gpt2's tied embedding under torch-amp, one backward: (the weight, first_contributions' records)."""
    import torch
    import torch.nn.functional as F

    from memplan.activations.tracing.live import LiveBytes
    from memplan.activations.tracing.step import first_contributions

    w = torch.randn(512, 256, requires_grad=True)
    ids = torch.randint(0, 512, (4, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.linear(F.embedding(ids, w) * 2.0, w).float().sum()
    out: dict = {}
    if hook:
        first_contributions(loss, LiveBytes(), out)
    loss.backward()
    return w, out


def test_a_tied_weight_grad_is_its_first_contribution(tmp_path):
    # the head's contribution (its fp32 cast) comes first in backward and the engine adds the embedding's into
    # it in place: two allocations of the weight's size, and the grad is the first (the profiler's memory
    # events, as the harness measures). Where a contribution cannot be stolen the engine adds out of place at
    # the end instead; either way the first contribution's bytes exist from the head's backward on.
    import json

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        w, _ = _tied_step(hook=False)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    allocs = [e["args"]["Addr"] for e in events if e.get("name") == "[memory]" and e["args"]["Bytes"] == 512 * 256 * 4
              and e["args"]["Addr"] != w.data_ptr()]  # the weight itself is made inside the profile too
    assert len(allocs) == 2 and allocs[0] == w.grad.data_ptr()
    # the trace hooks that first contribution (its bytes leave the activations from its creation)
    w, out = _tied_step(hook=True)
    assert out[id(w)][3] == w.numel() * 4 and out[id(w)][1] is not None


def test_gpu_dropout_keeps_a_one_byte_mask():
    # CUDA's fused native_dropout saves a bool mask; CPU's _dropout saves a noise tensor in the input's dtype,
    # which is what a fake-tensor trace follows unless the CUDA stand-in is swapped in (GPU jobs).
    import torch

    from memplan.activations.substitutes import cuda_dropout as _cuda_dropout

    saved = []
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = _cuda_dropout()(x, p=0.1, training=True)
    assert y.shape == x.shape and [t.dtype for t in saved] == [torch.bool]
    assert _cuda_dropout()(x, p=0.1, training=False) is x
    from memplan import activations as act
    from memplan.model import sources

    gpt2, llama = sources.resolve("gpt2").config, sources.resolve("llama-7b").config
    assert act.has_dropout(gpt2) and not act.has_dropout(llama)
    key = dict(seq_len=128, recipe="torch-amp", attention="flash", recompute="none")
    assert profile_cache.profile_key(gpt2, device="cpu", **key) != profile_cache.profile_key(gpt2, device="cuda", **key)
    # CPU traces follow the host's instruction set (kernels.Target.key): every CPU trace has its own key
    assert profile_cache.profile_key(llama, device="cpu", **key) != profile_cache.profile_key(llama, device="cuda", **key)


def test_block_backward_segments_follow_each_block_and_its_grads():
    from memplan.activations.tracing.segments import block_segments

    # timeline (activations only) of a toy backward; forward ends at index 2. Head grad (block -1) born at 3,
    # block 1's grads at 5 and 6, block 0's at 9
    timeline = [0, 10, 20, 19, 18, 17, 16, 15, 14, 13, 12]
    grads = [(3, -1, 100), (5, 1, 7), (6, 1, 5), (9, 0, 11)]
    last, first = block_segments(timeline, grads, 2)
    # from after the head's grad to block 1's last grad; without hook times no grad is counted as held
    assert last == [[18, 0, 0], [17, 7, 0], [16, 12, 0]]
    assert first == [[15, 0, 0], [14, 0, 0], [13, 11, 0]]
    # each grad held from its birth until its post-accumulate hook has run (ZeRO takes it there)
    hooked = [4, 6, 8, 10]
    last, first = block_segments(timeline, grads, 2, None, hooked)
    assert last == [[18, 0, 0], [17, 7, 7], [16, 12, 5]]
    assert first == [[15, 0, 0], [14, 0, 0], [13, 11, 11]]


def test_loss_segment_counts_the_roots_grads_up_to_the_last_block():
    from memplan.activations.tracing.segments import block_segments, loss_segment

    # the toy above: the loss and head's backward run from the end of forward (index 1 on) to the last block's
    # segment (index 4); the head's grad (100 elements) is born at 3, a tied weight's first contribution at 2
    timeline = [0, 10, 20, 19, 18, 17, 16, 15, 14, 13, 12]
    grads = [(3, -1, 100), (5, 1, 7), (6, 1, 5), (9, 0, 11)]
    blocks = block_segments(timeline, grads, 2)
    assert loss_segment(timeline, grads, [], 2, blocks) == [[10, 0], [20, 0], [19, 100]]
    assert loss_segment(timeline, grads, [(2, 50)], 2, blocks) == [[10, 0], [20, 50], [19, 150]]


def test_a_blocks_backward_begins_when_its_outputs_gradient_is_complete():
    from memplan.activations.tracing.segments import block_segments, loss_segment

    # the toy above, with the gradient of block 1's output complete at index 5 (what ran before it, say a final
    # norm, created its weight's gradient at 3 and went on to 5): FSDP2's pre-backward and ZeRO-3's gather hook
    # that output, so block 1's segment starts there and the loss segment runs to 4
    timeline = [0, 10, 20, 19, 18, 17, 16, 15, 14, 13, 12]
    grads = [(3, -1, 100), (5, 1, 7), (6, 1, 5), (9, 0, 11)]
    last, first = block_segments(timeline, grads, 2, None, None, {1: 5})
    assert last == [[17, 7, 0], [16, 12, 0]]
    assert first == [[15, 0, 0], [14, 0, 0], [13, 11, 0]]
    assert loss_segment(timeline, grads, [], 2, [last, first], {1: 5}) == [[10, 0], [20, 0], [19, 100], [18, 100]]
    # a start outside [after what ran before, the block's first gradient] is ignored
    assert block_segments(timeline, grads, 2, None, None, {1: 7})[0] == [[18, 0, 0], [17, 7, 0], [16, 12, 0]]


def test_root_hooks_done_is_the_last_hook_outside_the_blocks_before_them():
    from memplan.activations.tracing.segments import root_hooks_done

    # the toy above with a final norm's grad (block -1) born at 4 and hooked at 5; the head's hooked at 4; a tied
    # embedding's (block -1) born at 10, after every block, is not before them
    timeline = [0, 10, 20, 19, 18, 17, 16, 15, 14, 13, 12]
    grads = [(3, -1, 100), (4, -1, 3), (5, 1, 7), (6, 1, 5), (9, 0, 11), (10, -1, 100)]
    points = [4, 5, 6, 7, 10, 10]
    assert root_hooks_done(timeline, grads, points, 2) == 17
    assert root_hooks_done(timeline, grads, points, 2, {1: 5}) == 17
    assert root_hooks_done(timeline, [g for g in grads if g[1] >= 0], points[2:5], 2) is None


def test_the_last_blocks_backward_begins_after_the_final_norms_backward():
    # measured (fsdp-full reshard 2, fp32, 4 ranks, llama-3-8b with 2 blocks, hidden 512, vocabulary
    # 2048, micro-batch 2, sequence 128, CPU): the last block's copy-out in backward (its pre-backward hook)
    # peaked at 104,503,404 B with 80,240,128 B of params, states, gathered blocks and head grads, i.e.
    # 24,263,276 B of activations less the harness's 2,660-byte constant: 24,260,616 B. Starting the segment at
    # the final norm's weight gradient gave 25,834,504 B: the norm's backward temporaries (3 x 512 KiB)
    cfg = scale_config(sources.resolve("llama-3-8b").config, layers=2, hidden=512, vocab=2048)[0]
    p = trace_profile(cfg, seq_len=128, recipe="fp32", attention="flash", recompute="none", device="cpu", target=AVX512)
    assert act.TracedProfile(p, 1, "traced now").moment_activations(2)[-5] == 24_260_616


def test_block_hooks_give_the_activations_at_each_parameters_hook():
    from memplan.activations.tracing.segments import block_hooks

    timeline = [0, 10, 20, 19, 18, 17, 16, 15, 14, 13, 12]
    grads = [(3, -1, 100), (5, 1, 7), (6, 1, 5), (9, 0, 11)]
    # hooks at 4 (the head's: not a block's), 6, 7 and 10; the last block first
    assert block_hooks(timeline, grads, [4, 6, 7, 10]) == [[[16, 7], [15, 5]], [[12, 11]]]
    cfg = tiny()
    p = trace_profile(cfg, seq_len=64, recipe="deepspeed-bf16", attention="flash", recompute="none")
    prof = act.TracedProfile(p, 1, "traced now")
    src = sources.ModelSource(name="tiny", kind="config", description="test", config=cfg)
    block_numel = sources.build_inventory(src).largest_layer_block.numel
    hooks = prof.block_hooks(3)
    assert len(hooks) == 3 and all(sum(g for _, g in blk) == block_numel for blk in hooks)
    # the first block's hooks see no block below it; the last block's the untraced block's saved activations
    assert max(x for x, _ in hooks[0]) > max(x for x, _ in hooks[2]) > 0


def test_loss_moment_is_the_heads_weight_gradient_gemm():
    # autograd makes the head's weight gradient as a new tensor. Measured on ZeRO-3 at 1 rank (
    # llama-3-8b with 2 blocks, hidden 512, vocabulary 2048, micro-batch 2, sequence 128, CPU): the head's GEMM,
    # its bf16 output and fp32 scratch, topped the loss's own peak by 1.31 MB
    cfg = scale_config(sources.resolve("llama-3-8b").config, layers=2, hidden=512, vocab=2048)[0]
    p = trace_profile(cfg, seq_len=128, recipe="deepspeed-bf16", attention="flash", recompute="none", device="cpu", target=AVX512)
    prof = act.TracedProfile(p, 1, "traced now")
    head = 2048 * 512
    x, g = prof.loss_moment(2, 2)
    assert g == head
    without = max(c0 + 2 * c1 for c0, c1, g in p["loss_backward"]["2"] if g == 0)
    assert x + 2 * g > without
    # the moment is the GEMM: its output and scratch, every block's saved activations below
    assert x < prof.terms("none", 2)[1] + 4 * head
    assert act.analytic_profile({"hidden_size": 8, "num_layers": 2, "num_heads": 2}, micro_batch=1, seq_len=4,
                                compute_bytes=2, residual_bytes=2, attention="flash", recompute="none",
                                gated_mlp=True).loss_moment(1, 2) is None


def test_block_moments_pair_activations_with_the_blocks_grads():
    cfg = tiny()
    p = trace_profile(cfg, seq_len=64, recipe="deepspeed-bf16", attention="flash", recompute="none")
    assert len(p["block_backward"]) == 2  # the last block, then the one before it
    prof = act.TracedProfile(p, 1, "traced now")
    src = sources.ModelSource(name="tiny", kind="config", description="test", config=cfg)
    block_numel = sources.build_inventory(src).largest_layer_block.numel
    for width in (2, 4):
        (x0, g0), (x1, g1), (x2, g2), (x3, g3) = prof.block_moments(3, width)
        assert all(0 <= g <= block_numel for g in (g0, g1, g2, g3))
        # inside the last block's backward every block below it still holds its activations; the one before it
        # (3 blocks: one untraced block below it) holds more than the first, which has none below
        assert x0 > x1 > x2 > 0
        # the second block has one block below it: of three, it is the one before the last
        assert (x3, g3) == (x1, g1)
    named = prof.moment_activations(3)
    fwd, _, saved, _, block = prof.terms("none", 3)
    # the last block's forward begins with everything but its own activations and the loss's saved
    assert 0 < named[-7] < saved
    # its backward begins with everything saved but the loss's; the one before it after one block is freed
    assert saved < named[-5] <= saved + block and named[-6] < named[-5]
    # wider grads favour a later moment of the block's backward: never fewer grads counted
    assert prof.block_moments(3, 4)[0][1] >= prof.block_moments(3, 2)[0][1]
    assert act.analytic_profile({"hidden_size": 8, "num_layers": 2, "num_heads": 2}, micro_batch=1, seq_len=4,
                                compute_bytes=2, residual_bytes=2, attention="flash", recompute="none",
                                gated_mlp=True).block_moments(1, 2) == ()


def _gemm_temps(m: int, n: int, k: int, dtype) -> list[int]:  # noqa: ANN001
    """The allocator's events of one real (m, k) @ (k, n) GEMM on this CPU, less its output (the profiler's
    memory events, as the harness measures)."""
    import json
    import os
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = a @ b
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = [e["args"]["Bytes"] for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.unlink(path)
    return [x for x in events if x > 0 and x != out.nbytes]


@pytest.mark.parametrize("m,n,k", [(256, 128, 64), (128, 512, 256), (64, 256, 512), (8, 8, 64)])
def test_cpu_gemm_scratch_rule_matches_this_host(m, n, k):
    # the rule the CPU trace applies for this machine's instruction set (kernels.host_cpu_isa), checked against
    # the real allocator here, whatever the CPU: exact where the rule is exact (no oneDNN bf16: nothing; AVX512:
    # the fp32 output buffer; AMX: the per-thread packing buffer), an upper bound for AVX512-BF16's brgemm
    import torch

    from memplan.activations.kernels import cpu_gemm_scratch, host_cpu_isa

    isa, threads = host_cpu_isa(), torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness runs each rank (oneDNN's AMX and AVX512-BF16 buffers are per thread)
    try:
        got = sum(_gemm_temps(m, n, k, torch.bfloat16))
    finally:
        torch.set_num_threads(threads)
    rule = cpu_gemm_scratch(isa, m, n, k, "bfloat16", 1)
    if isa == "amx":  # an upper bound: oneDNN sizes its packing blocks from the CPU's caches (docs/cpu-kernels.md)
        assert 0 <= rule - got, (isa, got, rule)
    elif isa == "avx512_bf16":  # exact on a native AVX512-BF16 host for m <= 256; an upper bound elsewhere
        assert 0 <= rule - got <= 44544 + 256 * min(m, 256) + 1024, (isa, got, rule)
    else:
        assert got == rule, (isa, got, rule)
    # fp32 GEMMs allocate nothing on any instruction set
    assert _gemm_temps(m, n, k, torch.float32) == [] and cpu_gemm_scratch(isa, m, n, k, "float32") == 0


def test_cpu_gemm_scratch_rules_by_instruction_set():
    # the arithmetic of each rule, given explicitly (measured: kernels.cpu_gemm_scratch)
    from memplan.activations.kernels import cpu_gemm_scratch

    assert cpu_gemm_scratch("avx2", 200, 96, 64, "bfloat16") == 0
    assert cpu_gemm_scratch("avx512", 200, 96, 64, "bfloat16") == 4 * 200 * 96 + 128 == 76_928
    assert cpu_gemm_scratch("avx512", 16, 16, 16, "bfloat16") == 0  # m*n*k <= 16^3 stays in PyTorch's kernel
    assert cpu_gemm_scratch("amx", 64, 1024, 768, "bfloat16", threads=2) == 2 * (2 * 768 * 1024 + 6144)
    assert cpu_gemm_scratch("amx", 64, 1000, 8, "bfloat16", threads=3) == 3 * (2 * 32 * 1024 + 6144) == 215_040
    assert cpu_gemm_scratch("amx", 1, 1024, 64, "bfloat16") == 2 * 64 * 64 + 6144  # m = 1: 64 columns
    assert cpu_gemm_scratch("amx", 1024, 64, 64, "bfloat16") == 2 * 64 * (64 + 1024) + 6144  # A packed too
    assert cpu_gemm_scratch("avx512_bf16", 64, 1024, 4096, "bfloat16", threads=3) == 3 * (128 * 1024 + 64 * 256 + 1024)
    assert cpu_gemm_scratch("avx512_bf16", 3, 64, 100, "bfloat16") == 128 * 128 + 3 * 256 + 1024 == 18_176  # Zen 4
    # a tall product with k a power of two from 4096 on also copies A (measured on Zen 4: 1,721,472 B)
    assert cpu_gemm_scratch("avx512_bf16", 2048, 4096, 8192, "bfloat16") == 128 * 1024 + 66560 + 540800 + 983040
    assert cpu_gemm_scratch("avx512_bf16", 2048, 4096, 12288, "bfloat16") == 128 * 1024 + 66560
    assert cpu_gemm_scratch("avx512", 200, 96, 64, "float16") == 0


def test_cpu_gemm_scratch_rules_bound_every_kept_measurement():
    # bench/cpu/*.jsonl: GEMMs measured on other hosts (a Sapphire Rapids with oneDNN capped at each level, torch
    # 2.11; an AMX host and an AMD Zen 4 (AVX512-BF16) host, torch 2.13). The avx512_bf16 and amx rules are upper
    # bounds on every one; avx2 is exact;
    # avx512 is exact but for dims that are not multiples of 16 (up to 512 B below).
    import json
    from pathlib import Path

    from memplan.activations.kernels import cpu_gemm_scratch

    caps = {None: "amx", "AVX512_CORE_AMX": "amx", "AVX512_CORE_BF16": "avx512_bf16", "AVX512_CORE": "avx512",
            "AVX2": "avx2"}
    seen = 0
    for path in sorted((Path(__file__).resolve().parents[2] / "bench" / "cpu").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.startswith("{"):  # lscpu's lines, kept below the measurements
                continue
            d = json.loads(line)
            isa = d.get("host_isa", "amx") if d["isa"] is None else caps[d["isa"]]
            for m, n, k, temps, *_ in d["rows"]:
                rule, got = cpu_gemm_scratch(isa, m, n, k, "bfloat16", d["threads"]), sum(temps)
                assert rule - got >= (-512 if isa == "avx512" else 0), (path.name, isa, m, n, k, got, rule)
                seen += 1
    assert seen >= 2700


def test_a_failed_trace_is_remembered(tmp_path, monkeypatch):
    from memplan.activations import tracing
    from memplan.errors import SettingsError

    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise SettingsError("tracing activations failed (RuntimeError: no); use --activations analytic")

    monkeypatch.setattr(tracing, "trace_profile", refuse)
    key = dict(seq_len=64, micro_batch=1, recipe="fsdp-bf16", attention="flash", recompute="none")
    for _ in range(2):
        with pytest.raises(SettingsError, match="RuntimeError: no"):
            profile_cache.load_or_trace(tiny(), **key)
    assert len(calls) == 1  # the second run read the recorded failure instead of tracing again


@pytest.mark.parametrize("shape,bias", [((3, 5, 16), True), ((3, 5, 16), False), ((7, 16), True), ((7, 16), False)])
def test_deepspeed_zero3_linear_computes_a_linear(shape, bias):
    # the trace's stand-in for DeepSpeed's LinearFunctionForZeroStage3 gives F.linear's values and gradients
    import torch
    import torch.nn.functional as F

    from memplan.activations.substitutes import deepspeed_zero3_linear as _deepspeed_zero3_linear

    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True) if bias else None
    ours = _deepspeed_zero3_linear("cpu")(x, w, b)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(ours, ref)
    grads = torch.autograd.grad(ours.square().sum(), [t for t in (x, w, b) if t is not None])
    refs = torch.autograd.grad(ref.square().sum(), [t for t in (x, w, b) if t is not None])
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r)


def test_deepspeed_zero3_linear_order_on_cpu():
    # DeepSpeed ZeRO-3's linear makes the input's gradient before the weight's, so on CPU the weight GEMM's fp32
    # scratch (4 x out x in) coexists with the input's gradient. llama-3-8b at hidden 512 (intermediate 1792),
    # 128 tokens (b = 2, seq 64): the last block's peak is its down_proj weight GEMM, where the scratch
    # (4 x 512 x 1792) tops the input GEMM's (4 x 128 x 1792 + the weight's grad): DeepSpeed's order holds
    # the input's gradient there too, 2 x 128 x 1792 bytes; the head's (2048 x 512) likewise its input's
    # gradient, 2 x 128 x 512. The forward is the same op for op.
    cfg = scale_config(sources.resolve("llama-3-8b").config, layers=2, hidden=512, vocab=2048)[0]
    kw = dict(seq_len=64, recipe="deepspeed-bf16", attention="flash", recompute="none", device="cpu", target=AVX512)
    aten = act.TracedProfile(trace_profile(cfg, **kw), 2, "test")
    ds = act.TracedProfile(trace_profile(cfg, linear="deepspeed-zero3", **kw), 2, "test")
    for k in ("forward_peak", "live_after_forward", "saved_for_backward", "last_block_forward_peak"):
        assert ds.data[k] == aten.data[k]
    (a0, ag), (d0, dg) = aten.block_moments(2, 2, True)[0], ds.block_moments(2, 2, True)[0]
    assert d0 - a0 == 2 * 128 * 1792 and dg == ag
    assert ds.loss_moment(2, 2)[0] - aten.loss_moment(2, 2)[0] == 2 * 128 * 512


def test_linear_variant_keys_only_where_it_changes_bytes():
    from memplan.activations.tracing_keys import trace_linear

    cfg = tiny()
    kw = dict(seq_len=64, attention="flash", recompute="none")
    key = lambda **k: profile_cache.profile_key(cfg, **kw, **k)  # noqa: E731
    # on a GPU without autocast both orders hold the same bytes at every peak: the shipped profiles serve
    assert key(recipe="deepspeed-bf16", linear="deepspeed-zero3") == key(recipe="deepspeed-bf16")
    assert trace_linear("deepspeed-zero3", device="cuda", recipe="fsdp-bf16") == "aten"
    # CPU (GEMM scratch) and autocast (it saves the uncast input and weight) trace DeepSpeed's
    assert key(recipe="deepspeed-bf16", device="cpu", linear="deepspeed-zero3") != key(recipe="deepspeed-bf16",
                                                                                       device="cpu")
    assert key(recipe="torch-amp", linear="deepspeed-zero3") != key(recipe="torch-amp")


@pytest.mark.parametrize("dtype,autocast", [("bfloat16", False), ("float32", True), ("float32", False)])
def test_deepspeed_zero3_linear_allocates_as_deepspeeds_own(dtype, autocast):
    # real DeepSpeed's zero3_linear_wrap against the trace's stand-in, on real CPU tensors: the same live bytes op
    # for op (bf16 GEMM scratch included) and the same tensors saved for backward (under autocast the fp32 input
    # and weight, where aten's linear saves autocast's bf16 copies)
    import torch
    import torch.nn.functional as F

    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from memplan.activations.substitutes import deepspeed_zero3_linear as _deepspeed_zero3_linear
    from memplan.activations.substitutes import gemm_scratch
    from memplan.activations.tracing.live import LiveBytes, dispatch_mode

    def run(fn):  # noqa: ANN001, ANN202
        live, saved = LiveBytes(), []
        torch.manual_seed(0)
        w = torch.randn(512, 256, dtype=getattr(torch, dtype), requires_grad=True)
        x0 = torch.randn(4, 64, 256, dtype=getattr(torch, dtype), requires_grad=True)

        def pack(t):  # noqa: ANN001, ANN202
            saved.append((t.dtype, tuple(t.shape)))
            return t

        with dispatch_mode(live, gemm_scratch("avx512")):  # the rule these figures were measured with
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    y = fn(x0 * 1.0, w, None)
            torch.autograd.grad(y.float().sum(), [x0, w])
            live.tick()
        return live.timeline, saved

    ds, ours, aten = run(zero3_linear_wrap), run(_deepspeed_zero3_linear("cpu")), run(F.linear)
    assert ours == ds
    if autocast:
        assert ds[1] == [(torch.float32, (4, 64, 256)), (torch.float32, (512, 256))]
        assert {d for d, _ in aten[1]} == {torch.bfloat16}
    elif dtype == "bfloat16":
        assert max(ds[0]) > max(aten[0])  # the weight GEMM's scratch beside the input's gradient
    else:
        assert max(ds[0]) == max(aten[0])  # no scratch: either order peaks alike


@pytest.mark.parametrize("name", ["llama-7b", "gpt2"])
def test_autocast_keeps_each_blocks_weight_casts_until_the_forward_ends(name):
    # torch.autocast caches the cast of a float32 leaf that requires grad for the whole autocast region
    # (autocast_mode.cpp cached_cast), under no_grad too: a checkpointed block saves only its input, but its
    # weights' bf16 casts stay alive until the forward ends. The trace's CUDA autocast probe once emptied that
    # cache (it cleared autocast's cache after each first-seen op), dropping the casts made before it
    from memplan.replay import forward_block_line

    cfg = tiny(name)
    gpu = Target(device="cuda", arch="sm90")
    full = trace_profile(cfg, seq_len=128, recipe="torch-amp", attention="flash", recompute="full", target=gpu)
    casts = 2 * sum(t.numel for t in sources.build_inventory(sources.ModelSource("tiny", "config", "", config=cfg))
                    .tensors if ".0." in t.name and len(t.shape) == 2)
    line = forward_block_line(full["alloc_events"])
    assert full["per_layer"][0] == 0 and line[0] >= casts and line[1] == full["per_layer"][1]
    # without recompute the weights' casts are saved for backward: a block keeps through the forward what it saves,
    # and the cached casts nothing saves (gpt2's addmm does not save its bias: c_attn's 2,304-element bf16 cast)
    none = trace_profile(cfg, seq_len=128, recipe="torch-amp", attention="flash", recompute="none", target=gpu)
    kept = forward_block_line(none["alloc_events"])
    assert kept[1] == none["per_layer"][1] and 0 <= kept[0] - none["per_layer"][0] <= 4608
    # the engine's forward counts each untraced block's casts, as the replay holds them
    layers = 32
    prof = act.TracedProfile(dict(full, num_layers=layers), 1, "test")
    bare = act.TracedProfile(dict(full, num_layers=layers, alloc_events=None), 1, "test")
    assert prof.terms("full", 1)[0] - bare.terms("full", 1)[0] == (layers - 2) * line[0]
    assert prof.terms("full", 1)[1] == bare.terms("full", 1)[1]  # the backward starts after the region exits


def test_deaths_that_come_together_may_come_in_either_order():
    # two runs of the traced step (micro-batches 2 and 4) whose storages that die together are released in another
    # order (bitsandbytes' 4-bit layers on the CPU) are the same step; another set of deaths is not
    from memplan.activations.tracing.segments import deaths_as_in

    a = [[8, 0], [16, 0], 0, 1, [8, 0]]
    assert deaths_as_in(a, [[8, 0], [16, 0], 1, 0, [8, 0]]) == a
    assert deaths_as_in(a, [[8, 0], [16, 0], 1, 2, [8, 0]]) is None
    assert deaths_as_in(a, [[8, 0], [16, 0], 0, [8, 0], 1]) is None


def test_moe_experts_named_moe_num_experts_trace_in_fp32_on_a_gpu():
    """ERNIE-4.5-MoE and Aria name their experts moe_num_experts. Their fused experts run through grouped_mm, whose
    fake kernel takes bf16 alone: an fp32 trace (torch-amp's fp32 weights) computes them with transformers' own
    fallback op, as for every MoE, instead of failing into the analytic formula."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    cfg = dict(AutoConfig.for_model("ernie4_5_moe").to_dict(), architectures=["Ernie4_5_MoeForCausalLM"],
               num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_attention_heads=2, num_key_value_heads=1, moe_num_experts=4, moe_k=2, vocab_size=256,
               moe_layer_start_index=0)
    cfg.pop("transformers_version", None)
    prof = trace_profile(cfg, seq_len=32, recipe="torch-amp", attention="flash", recompute="none",
                         target=Target(device="cuda", arch="sm90"))
    assert prof["per_layer"][1] > 0 and prof["live_after_forward"][1] > 0


def test_multi_head_latent_attention_needs_no_head_multiple():
    """MLA (DeepSeek-V3, GLM-4.7-Flash) sizes its heads by qk_nope_head_dim + qk_rope_head_dim and v_head_dim:
    hidden 2048 over 20 heads is a real config, not a bad one."""
    from memplan.errors import ConfigError
    from memplan.model.config import check_config

    mla = {"model_type": "glm4_moe_lite", "hidden_size": 2048, "num_attention_heads": 20, "num_hidden_layers": 2,
           "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "kv_lora_rank": 512}
    check_config(mla)
    with pytest.raises(ConfigError, match="not a multiple of the number of attention heads"):
        check_config({"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 20, "num_hidden_layers": 2})


def test_a_constructor_s_module_to_converts_fake_parameters():
    """torch swaps a fake parameter on module.to() and refuses to for a tensor with weakrefs (every fake tensor):
    under fake_module_conversion the module holds its converted parameters, as a real one does, and a .to() that
    changes nothing leaves the parameter itself (DeepSeek-V4's attention builds its norms so)."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.activations.tracing.step import fake_module_conversion

    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            torch.nn.LayerNorm(8).to(dtype=torch.float32)
        with fake_module_conversion():
            norm = torch.nn.LayerNorm(8)
            w = norm.weight
            assert norm.to(dtype=torch.float32).weight is w
            half = norm.to(dtype=torch.bfloat16)
            assert half is norm and norm.weight.dtype == norm.bias.dtype == torch.bfloat16
            assert isinstance(norm.weight, torch.nn.Parameter) and norm.weight.requires_grad
    assert torch.nn.Module._apply.__name__ == "_apply"  # restored


def test_jetmoe_traces_with_balanced_expert_counts(tmp_path, monkeypatch):
    # JetMoE's router reads its expert counts back (expert_size.tolist()), which a fake tensor has no values for:
    # the trace gives each expert an even share of the tokens x top_k rows (substitutes.balanced_topk_gating).
    # The same job on the CPU harness (2 blocks, hidden 256, torch-amp, 4 x 512 tokens, --cpu-isa avx512):
    # 300,485,864 B measured at its backward peak, this prediction -0.01% (session 45)
    import json
    from pathlib import Path

    from clirun import run_cli

    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    config = Path(__file__).resolve().parents[1] / "data" / "configs" / "jetmoe-tiny.json"
    code, out, err = run_cli(["estimate", str(config), "--device", "cpu", "--cpu-isa", "avx512", "--seq-len", "512",
                              "--micro-batch", "4", "--precision", "torch-amp", "--gpus", "1", "--json"])
    assert code == 0, err
    rep = json.loads(out)
    assert rep["assumptions"]["activations"].startswith("traced")
    assert rep["per_gpu"]["peak_bytes"] == 300_469_384


def test_softmax_of_a_non_contiguous_input_copies_it_first():
    """PyTorch's softmax kernels (SoftMax.cpp softmax_cpu_out, cuda/SoftMax.cu host_softmax) run on
    ``input.contiguous()``: a transposed input is copied whole beside the output, freed on return
    (live.CONTIGUOUS_INPUTS); a contiguous one is not."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.activations.tracing.live import LiveBytes, dispatch_mode

    def peak(transposed: bool) -> int:
        live = LiveBytes(1)
        with FakeTensorMode():
            x = torch.empty(64, 32)
            x = x.t() if transposed else x
            with dispatch_mode(live):
                y = torch.softmax(x, dim=-1)
            assert y.is_contiguous()
        return max(live.timeline)

    assert peak(False) == 64 * 32 * 4
    assert peak(True) == 2 * 64 * 32 * 4


def test_a_view_of_a_value_carrying_tensor_holds_no_bytes():
    """A fake tensor given a value by hand (tracing/grids.py _on_values: a mask computed on the inputs' values) is
    viewed through the fake mode's constant path, which wraps each view on a storage of its own: the trace counts
    it as a view (no bytes), keeping its base alive as the model's view does (live._view_base)."""
    import sys

    import torch
    import torch._subclasses.fake_tensor as ft
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.activations.tracing.live import LiveBytes, dispatch_mode

    live = LiveBytes(1)
    limit = ft.CONSTANT_NUMEL_LIMIT
    ft.CONSTANT_NUMEL_LIMIT = sys.maxsize
    value = torch.zeros(2, 1, 16, 16)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), dispatch_mode(live):
            mask = torch.empty_strided((2, 1, 16, 16), (256, 256, 16, 1))
            mask.constant = value
            view = mask[:, 0, 0, :]
            del mask
            one = torch.empty(1)  # a point of the timeline after the base's name is gone
            assert view.shape == (2, 16) and one.numel() == 1
            assert live.live == 2 * 256 * 4 + 4  # the base, alive through its view; the one float
    finally:
        ft.CONSTANT_NUMEL_LIMIT = limit
