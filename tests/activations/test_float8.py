"""Float8 training (--precision fp8-*): torchao's Float8Linear in the traced step (memplan/activations/tracing/float8.py).

The CPU integers below were checked against torchao 0.18 running on this CPU (torch._scaled_mm's emulation, the CPU
allocator's profiler events: memplan/harness/measure.py); the harness rows are in docs/accuracy.md."""

from __future__ import annotations

import pytest

from memplan.activations.kernels import Target
from memplan.activations.tracing_keys import FLOAT8_KEY

pytest.importorskip("torchao")

CPU = Target(device="cpu", cpu_isa="avx512_bf16")
CUDA = Target(device="cuda")
# a small vocabulary: the peak is in the blocks' GEMMs, not the loss
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=512, intermediate_size=1408,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
             tie_word_embeddings=False)


def _step(float8: str | None, target: Target) -> dict:
    from memplan.activations.tracing.step import one_step

    cfg = dict(LLAMA, **({FLOAT8_KEY: float8} if float8 else {}))
    return one_step(cfg, 2, 128, "fsdp-bf16", "sdpa", "none", target)


def test_float8_saves_what_bf16_saves_and_adds_its_casts():
    # Float8Linear saves its bf16 input and weight, as nn.Linear does (float8_linear.py save_for_backward), and casts
    # each GEMM operand to float8 when it needs it: abs, amax, an fp32 copy scaled and clamped, then float8
    # (float8_scaling_utils.hp_tensor_to_float8_dynamic), all transients of the step
    bf16, tw, rw = _step(None, CUDA), _step("tensorwise", CUDA), _step("rowwise", CUDA)
    assert bf16["saved"] == tw["saved"] == rw["saved"] == 13_323_776
    assert (max(bf16["forward"]), max(tw["forward"]), max(rw["forward"])) == (14_238_720, 19_775_488, 19_777_536)
    assert (max(bf16["backward"]), max(tw["backward"]), max(rw["backward"])) == (15_285_248, 19_021_824, 19_027_456)


def test_float8_on_the_cpu_target_counts_the_emulated_gemm():
    # the CPU's _scaled_mm converts both operands to fp32 (kernels.cpu_scaled_mm_scratch): more than CUDA's kernel
    tw, rw = _step("tensorwise", CPU), _step("rowwise", CPU)
    assert (max(tw["forward"]), max(tw["backward"])) == (22_197_264, 21_704_728)
    assert (max(rw["forward"]), max(rw["backward"])) == (22_203_392, 24_504_336)


def test_cpu_scaled_mm_scratch_as_measured():
    # torch 2.13's _scaled_mm_out_cpu_emulated on this CPU (profiler memory events), a (512, 256) by (256, 512)
    # float8 product with B column-major as torchao hands it, bf16 out: 2,752,512 B above its output
    from memplan.activations.kernels import cpu_scaled_mm_scratch

    assert cpu_scaled_mm_scratch(512, 512, 256, False, True, 2) == 2_752_512
    assert cpu_scaled_mm_scratch(512, 512, 256, False, True, 4) == 2_228_224  # fp32 out: no conversion


def test_converter_keeps_the_output_projection_and_odd_dims():
    # torchtitan's converter: every nn.Linear with both dims multiples of 16, but the output projection
    import torch
    from torchao.float8.float8_linear import Float8Linear
    from transformers import LlamaConfig, LlamaForCausalLM

    from memplan.activations.tracing.float8 import convert

    cfg = LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert convert(model, "tensorwise") == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    assert not isinstance(model.lm_head, Float8Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Float8Linear)


def test_a_tensor_subclass_is_followed_to_its_plain_tensors():
    # the dispatch mode runs Float8TrainingTensor's own __torch_dispatch__ under it (tracing/live.py): the layout
    # copy torchao makes for torch._scaled_mm is a birth, and the wrapper it returns holds no storage of its own
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.activations.tracing.float8 import torchao_float8
    from memplan.activations.tracing.live import LiveBytes, dispatch_mode

    f8 = torchao_float8()
    with FakeTensorMode(allow_non_fake_inputs=True):
        m = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False, dtype=torch.bfloat16),
                                torch.nn.Linear(128, 64, bias=False, dtype=torch.bfloat16))
        f8.convert_to_float8_training(m, config=f8.Float8LinearConfig.from_recipe_name("tensorwise"))
        x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
        live = LiveBytes(1)
        live.labeler = lambda: ""
        for p in m.parameters():
            live.ignore(p)
        with dispatch_mode(live):
            m(x).sum().backward()
    ops = [o[1] for o in live.origins]
    assert ops.count("_scaled_mm") == 6 and ops.count("contiguous") == 6
    # every birth is a plain tensor's: a float8 one is a float8 dtype, never the wrapper's bf16 at float8's size
    assert all(o[2].startswith("float8") for o in live.origins if o[1] in ("contiguous",))
    assert max(live.timeline) == 102_412  # 4,096 B less than with the wrapper of the input's float8 view counted


def test_fsdp2_float8_all_gather_hands_the_linears_float8_weights():
    # --float8-all-gather: FSDP2 gathers each float8 weight already cast (torchao fsdp_utils.py), so the linears
    # cast no weight in forward or backward; the gathered bytes are FSDP2's (not activations), the saved tensors
    # the same
    tw, ag = _step("tensorwise", CUDA), _step("tensorwise+all-gather", CUDA)
    assert ag["saved"] == tw["saved"] == 13_323_776
    assert (max(ag["forward"]), max(ag["backward"])) == (16_170_496, 16_630_272)


def test_float8_weights_on_the_inventory_are_the_converters():
    # precision.float8_weights (the engine's) and tracing/float8.py convert (the trace's) pick the same linears
    import torch
    from torchao.float8.float8_linear import Float8Linear
    from transformers import LlamaConfig, LlamaForCausalLM

    from memplan.activations.tracing.float8 import convert
    from memplan.model.meta_builder import inventory_from_module
    from memplan.precision import float8_weights

    cfg = LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures")})
    for keep in ("output", "first-last"):
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        inv = inventory_from_module(model, model_name="llama", source="test", family="llama")
        convert(model, "tensorwise" + ("" if keep == "output" else "/first-last"))
        swapped = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        assert float8_weights(inv, keep) == swapped and len(swapped) == (14 if keep == "output" else 13)


def test_compiled_blocks_save_float8_copies_of_the_gathered_weights():
    # --compile blocks with the float8 all-gather: the float8 weights reach each compiled graph as inputs (handed
    # over by the block's pre-hook, as FSDP2's pre-forward does), and inductor's partitioner saves float8 copies of
    # them for backward (what torchtitan's force_recompute_fp8_weight_in_bwd was for); without the all-gather it
    # casts the weights inside the graph and saves none. The CPU harness: -0.30% and -0.02% (docs/accuracy.md)
    from memplan.activations.tracing_keys import COMPILE_KEY

    def step(f8: str) -> dict:
        from memplan.activations.tracing.step import one_step

        return one_step(dict(LLAMA, **{FLOAT8_KEY: f8, COMPILE_KEY: "blocks"}), 2, 128, "fsdp-bf16", "sdpa", "none",
                        CUDA)

    def clones(out: dict) -> int:
        org = out["origins"]["origins"]
        return sum(org[i][6] for i in out["origins"]["saved"] if org[i][1] == "clone" and org[i][2] == "float8_e4m3fn")

    tw, ag = step("tensorwise"), step("tensorwise+all-gather")
    assert (tw["saved"], clones(tw)) == (7_308_800, 0)
    assert (ag["saved"], clones(ag)) == (12_151_296, 4_849_664)
    assert (max(ag["forward"]), max(ag["backward"])) == (12_804_096, 14_112_768)
