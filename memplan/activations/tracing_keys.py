"""Which dtype setup a recipe is traced in (shared by the cache key and the tracer; no torch here)."""

from __future__ import annotations

#: the config pseudo-key that carries --compile into the trace and its cache key (tracing/compiled.py)
COMPILE_KEY = "memplan_compile"
#: under DDP, the Reducer's bucket cap in bytes: dynamo splits each compiled graph at bucket boundaries
#: (DDPOptimizer, torch/_dynamo/backends/distributed.py), so the trace compiles with the same splits
COMPILE_DDP_KEY = "memplan_compile_ddp_bucket"
#: --compile's values: none, each transformer block compiled (torchtitan's per-block compile)
COMPILE_MODES = ("none", "blocks")

#: the config pseudo-key that carries float8 training into the trace and its cache key (tracing/float8.py): the
#: torchao recipe (tensorwise, rowwise, rowwise_with_gw_hp)
FLOAT8_KEY = "memplan_float8"
#: its suffix under FSDP2's float8 all-gather (torchao's enable_fsdp_float8_all_gather)
FLOAT8_GATHERED = "+all-gather"


def float8_key(recipe: str, keep: str, all_gather: bool) -> str:
    """FLOAT8_KEY's value: the torchao recipe, ``/first-last`` where Accelerate's converter keeps the first and last
    linears (torchtitan's, keeping the output projection, adds nothing), and FLOAT8_GATHERED."""
    return recipe + ("" if keep == "output" else f"/{keep}") + (FLOAT8_GATHERED if all_gather else "")

#: bump when the traced profile's format or method changes (memplan/tracing): every cached key changes with it
PROFILE_VERSION = 20
#: bump when a change to the tracing can change a profile that is not shipped (a model type no preset has): the
#: disk cache's profiles and failure records of another revision are traced again (profile_cache._stored_on_disk),
#: while the shipped ones, whose presets tools/golden_plans.py checks, keep their keys
TRACE_REVISION = 7  # 7: softmax's contiguous copy of a non-contiguous input, views of value-carrying tensors (tracing/live.py); 6: Longformer and LED traced (their attention mask fed and read as values: tracing/grids.py reads_mask), their failure records retried; 5: decoder_sparse_step 1 traced as alike blocks (fit._heterogeneous); 2: an expert-parallel rank marks its experts modules (tracing/step.py); 3: PEFT 0.22 (ParamWrapper scales its folded delta in place); 4: JetMoE traced (substitutes.balanced_topk_gating), its failure records retried

#: recipe -> the recipe whose trace it shares: the bf16 recipes compute and keep the residual stream in bf16
#: alike (FSDP's MixedPrecisionPolicy casts the unsharded params and the inputs; DeepSpeed and pure bf16 hold bf16)
_TRACED_AS = {"deepspeed-bf16": "deepspeed-bf16", "fsdp-bf16": "deepspeed-bf16", "pure-bf16": "deepspeed-bf16",
              "deepspeed-fp16": "deepspeed-fp16", "torch-amp": "torch-amp", "fp32": "fp32",
              "bf16-autocast": "bf16-autocast", "fp16-bf16-autocast": "fp16-bf16-autocast"}


#: what a traced recipe runs in: (the parameters' and inputs' dtype, under torch.autocast to bf16)
TRACE_DTYPES = {"deepspeed-bf16": ("bfloat16", False), "deepspeed-fp16": ("float16", False),
                "torch-amp": ("float32", True), "fp32": ("float32", False), "bf16-autocast": ("bfloat16", True),
                "fp16-bf16-autocast": ("float16", True)}


def trace_recipe(recipe: str) -> str:
    return _TRACED_AS.get(recipe, recipe)


def trace_dtypes(recipe: str) -> tuple[str, bool] | None:
    """(dtype, autocast) the trace of a recipe runs in; None for a recipe that cannot be traced."""
    return TRACE_DTYPES.get(trace_recipe(recipe))


#: F.linear's autograd in the traced step: "aten" (linear decomposes to matmul; MmBackward0 makes the weight's
#: gradient, then the input's) or "deepspeed-zero3" (DeepSpeed ZeRO-3's LinearFunctionForZeroStage3, installed
#: as torch.nn.functional.linear when zero_optimization.memory_efficient_linear, the default, is on:
#: deepspeed/runtime/zero/partition_parameters.py _enable_mem_efficient_linear; it saves the inputs as given and
#: makes the input's gradient first: deepspeed/runtime/zero/linear.py)
LINEARS = ("aten", "deepspeed-zero3")


def trace_linear(linear: str, *, device: str, recipe: str) -> str:
    """The linear a trace runs for a job: DeepSpeed's ZeRO-3 linear holds other bytes than aten's only on CPU,
    where a bf16 GEMM allocates fp32 scratch of its output's size, so the order of the two backward GEMMs
    decides what the scratch coexists with; and under autocast, where it saves the uncast input and weight
    instead of autocast's bf16 copies. Elsewhere both orders end each linear's backward holding the same
    tensors (the input's and the weight's gradients) with nothing allocated between, so their peaks are equal
    and the jobs share one trace (and the shipped profiles)."""
    if linear == "aten" or (device != "cpu" and trace_recipe(recipe) != "torch-amp"):
        return "aten"
    return linear
