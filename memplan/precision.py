"""Precision recipes and optimizers, named after what the frameworks really allocate.

A recipe fixes the bytes per element of every copy of the model a rank holds; an optimizer fixes the state
bytes per parameter and the scratch its step allocates. Pure data and small pure functions; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.errors import SettingsError
from memplan.inputs import quote
from memplan.model.inventory import ParamInventory, ParamTensor


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    #: Bytes of the parameters a rank stores between steps (DeepSpeed: its bf16 copy; FSDP2: the fp32 shard).
    param_bytes: int
    #: Bytes of the fp32 master copy an optimizer wrapper keeps beside them (DeepSpeed bf16/fp16), else 0.
    master_bytes: int
    #: Bytes of a gradient as backward produces it (the .grad of a parameter, or the unsharded grad).
    grad_bytes: int
    #: Bytes of a gradient as reduced and stored for the step (FSDP2 reduce_dtype; DeepSpeed's fp32 partition).
    reduced_grad_bytes: int
    #: Bytes of the weights the matmuls read (autocast copies / MixedPrecisionPolicy.param_dtype).
    compute_bytes: int
    #: Bytes of an optimizer state element (fp32 except in pure half precision).
    state_bytes: int
    #: Bytes of the residual stream between blocks (fp32 under autocast, else the compute dtype).
    residual_bytes: int
    #: True when autocast makes bf16 copies of fp32 weights in forward and saves them for backward.
    autocast_weight_copies: bool
    description: str
    #: True when the step checks the grads for inf/nan first (dynamic loss scaling)
    loss_scaling: bool = False
    #: Bytes of a LoRA adapter's weight where it differs from param_bytes (0: the same): PEFT upcasts adapters
    #: on a bf16/fp16 base to fp32 (get_peft_model's autocast_adapter_dtype=True)
    adapter_bytes: int = 0
    #: the 16-bit dtype of the recipe's half-precision copies (bf16, or fp16 under DeepSpeed's fp16)
    half_dtype: str = "bfloat16"
    #: the step runs under torch.autocast (tracing_keys.TRACE_DTYPES and the harness follow it)
    autocast: bool = False

    #: False where a 16-bit param_bytes comes from the framework casting the parameters alone: DeepSpeed 0.19.8's
    #: engine casts parameters and leaves buffers in the dtype they were loaded in unless its config sets
    #: buffer_dtype (engine.py _cast_module_mixed_precision: "preserve fp32 buffers (e.g. rotary inv_freq)")
    casts_buffers: bool = True

    @property
    def half_buffers(self) -> bool:
        """Floating buffers are 16-bit: the model converted or loaded in half precision (model.to(bfloat16),
        Module._apply casting buffers with the parameters), or a LoRA base loaded in bf16 (adapter_bytes)."""
        return self.param_bytes == 2 and (self.casts_buffers or bool(self.adapter_bytes))

    @property
    def stored_dtype(self) -> str:
        """The dtype of the parameters a rank stores (param_bytes)."""
        return "float32" if self.param_bytes == 4 else self.half_dtype


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe(name="deepspeed-bf16", param_bytes=2, master_bytes=4, grad_bytes=2, reduced_grad_bytes=4,
           compute_bytes=2, state_bytes=4, residual_bytes=2, autocast_weight_copies=False,
           description="DeepSpeed bf16: bf16 params and grads, fp32 master partition, fp32 Adam states, "
                       "grads converted to an fp32 partition for the step", casts_buffers=False),
    Recipe(name="deepspeed-fp16", param_bytes=2, master_bytes=4, grad_bytes=2, reduced_grad_bytes=4,
           compute_bytes=2, state_bytes=4, residual_bytes=2, autocast_weight_copies=False,
           description="DeepSpeed fp16 with dynamic loss scaling: as deepspeed-bf16, fp16 instead of bf16",
           loss_scaling=True, half_dtype="float16", casts_buffers=False),
    Recipe(name="torch-amp", param_bytes=4, master_bytes=0, grad_bytes=4, reduced_grad_bytes=4,
           compute_bytes=2, state_bytes=4, residual_bytes=4, autocast_weight_copies=True, autocast=True,
           description="torch.autocast(bf16): fp32 params, grads and states; bf16 casts of weights saved for "
                       "backward; fp32 residual stream"),
    Recipe(name="fsdp-bf16", param_bytes=4, master_bytes=0, grad_bytes=2, reduced_grad_bytes=4,
           compute_bytes=2, state_bytes=4, residual_bytes=2, autocast_weight_copies=False,
           description="FSDP MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 shards, bf16 "
                       "unsharded params and grads, fp32 reduce-scatter and sharded grads"),
    Recipe(name="pure-bf16", param_bytes=2, master_bytes=0, grad_bytes=2, reduced_grad_bytes=2,
           compute_bytes=2, state_bytes=2, residual_bytes=2, autocast_weight_copies=False,
           description="model.to(bfloat16): everything in bf16, optimizer states in bf16 too"),
    # transformers 5 loads a checkpoint in its config's dtype (from_pretrained dtype="auto": modeling_utils.py
    # _get_dtype), and the Trainer's bf16=True runs the step under torch.autocast (Accelerate's autocast_handler)
    # without casting the model: a bf16 model's weights, gradients and AdamW states (zeros_like(p)) stay bf16
    Recipe(name="bf16-autocast", param_bytes=2, master_bytes=0, grad_bytes=2, reduced_grad_bytes=2,
           compute_bytes=2, state_bytes=2, residual_bytes=2, autocast_weight_copies=False, autocast=True,
           description="bf16 parameters under torch.autocast(bf16): the HF Trainer's bf16 on a model loaded in "
                       "bf16 (transformers 5's dtype='auto'); gradients and optimizer states bf16"),
    # the same with a float16 checkpoint (llama-2's) under bf16 autocast: every matmul casts its fp16 weight to bf16
    # and saves the copy (autocast's weight cache), and fp16 + bf16 promotes the residual stream to fp32
    Recipe(name="fp16-bf16-autocast", param_bytes=2, master_bytes=0, grad_bytes=2, reduced_grad_bytes=2,
           compute_bytes=2, state_bytes=2, residual_bytes=4, autocast_weight_copies=True, half_dtype="float16",
           autocast=True,
           description="float16 parameters under torch.autocast(bf16): the HF Trainer's bf16 on a model loaded in "
                       "float16; bf16 copies of the weights saved for backward, gradients and optimizer states fp16"),
    Recipe(name="fp32", param_bytes=4, master_bytes=0, grad_bytes=4, reduced_grad_bytes=4,
           compute_bytes=4, state_bytes=4, residual_bytes=4, autocast_weight_copies=False,
           description="full fp32 training"),
)}


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    name: str
    #: State tensors per parameter element (Adam: exp_avg and exp_avg_sq).
    states_per_param: int
    #: If set, states are stored in this many bytes per element instead of the recipe's state_bytes.
    state_bytes_override: int | None = None
    #: Adafactor: second moment factored into row and column vectors for matrices.
    factored: bool = False
    #: bitsandbytes 8-bit: per-block absmax (fp32 per `quant_block` elements, per state) for large tensors, and
    #: the optimizer's two shared 256-entry fp32 quantization maps (Optimizer2State.init_state: blocksize 256,
    #: qmap1 = name2qmap["dynamic"], qmap2 = name2qmap["udynamic"]; bitsandbytes 0.50 optim/optimizer.py)
    quant_block: int = 0
    #: bitsandbytes keeps tensors with fewer elements than this in 32-bit states (min_8bit_size=4096).
    min_8bit_numel: int = 0
    description: str = ""
    #: the step's kernel on CUDA when the optimizer has only one: bitsandbytes updates each parameter in one
    #: kernel (optim/optimizer.py update_step -> functional.optimizer_update_32bit / _8bit_blockwise), no
    #: temporaries, whatever torch.optim's default would be
    kernel: str | None = None
    #: bitsandbytes' paged optimizers: states in CUDA unified memory (functional.py get_paged, cudaMallocManaged),
    #: outside PyTorch's allocator
    paged: bool = False
    #: the optimizer's states depend on each tensor's shape and size (Adafactor's factored second moment,
    #: bitsandbytes' 8-bit threshold and blocks): what it is handed matters (FrameworkModel.optimizer_tensors)
    shape_dependent: bool = False
    #: a per-tensor step that first copies a 16-bit parameter and its gradient to fp32 (transformers' Adafactor:
    #: grad.float(), p.float(), then p.copy_): two more fp32 tensors of the one being stepped
    upcasts_half: bool = False
    #: bitsandbytes' CPU kernels (backends/cpu/ops.py _optimizer_update_8bit_blockwise_cpu, 0.50): per tensor, its
    #: states dequantized to fp32 (two), grad.float() * gnorm_scale, and sqrt() / correction2 at once, and
    #: p.float() where the parameter is 16-bit: fp32 tensor-sized temporaries of the tensor being stepped,
    #: freed when its update returns
    cpu_step_copies: int = 0
    #: the step's scratch when it is a Python loop of its own: "" (torch.optim's single-tensor loop: two
    #: temporaries of the tensor stepped, the second bound to the loop's local until the next replaces it), or
    #: "in-call" (lion-pytorch's update_fn: ``exp_avg.clone().mul_(beta1).add(grad, ...)`` makes a clone and the
    #: sum at once, both freed when the function returns: two temporaries of the tensor stepped, none carried over)
    scratch: str = ""
    #: each tensor's state made just before its own update, inside the step's loop (lion-pytorch), not all first
    #: (torch.optim's _init_group)
    lazy_states: bool = False
    #: the one kernel runs off CUDA too (schedulefree's foreach default: hasattr(torch, "_foreach_mul_"))
    any_device: bool = False
    #: states and step scratch decided per named tensor of the whole model ("muon", "adam-mini"): modelled on whole
    #: tensors only (per_tensor_states, per_tensor_step_scratch)
    per_tensor: str = ""
    #: what its step allocates on a CUDA device that memplan does not count, said in a note: the figures are a
    #: bound from below by it ("" where everything is counted)
    cuda_uncounted: str = ""


#: the target modules of transformers' documentation's example for its low-rank optimizers (GaLore, APOLLO):
#: optim_target_modules=[r".*.attn.*", r".*.mlp.*"] (the Trainer refuses these optimizers without one)
LOW_RANK_TARGETS = (r".*.attn.*", r".*.mlp.*")
#: transformers' Trainer arguments for apollo_adamw (trainer_optimizer.py _get_apollo_optimizer defaults)
APOLLO_RANK = 128
#: transformers' Trainer arguments for galore_adamw (trainer_optimizer.py _get_galore_optimizer defaults: rank 128,
#: update_proj_gap 200, scale 0.25, proj_type "std")
GALORE_RANK = 128
GALORE_UPDATE_GAP = 200

OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer(name="adamw", states_per_param=2, description="AdamW: exp_avg + exp_avg_sq"),
    Optimizer(name="adam", states_per_param=2, description="Adam: exp_avg + exp_avg_sq"),
    Optimizer(name="sgd", states_per_param=1, description="SGD with momentum: momentum_buffer"),
    # transformers' Adafactor (optimization.py): states are created .to(grad) after grad.float(), so fp32 whatever
    # the parameters' dtype; one implementation, a Python loop over the tensors (single-tensor temporaries)
    Optimizer(name="adafactor", states_per_param=1, factored=True, state_bytes_override=4, kernel="single-tensor",
              shape_dependent=True, upcasts_half=True,
              description="Adafactor (no first moment): row + column factors for matrices, full for vectors"),
    Optimizer(name="adam8bit", states_per_param=2, state_bytes_override=1, quant_block=256, min_8bit_numel=4096,
              description="bitsandbytes AdamW8bit: uint8 states + fp32 absmax per 256-element block",
              kernel="fused", shape_dependent=True, cpu_step_copies=5),
    Optimizer(name="paged_adamw_8bit", states_per_param=2, state_bytes_override=1, quant_block=256,
              min_8bit_numel=4096, kernel="fused", paged=True, shape_dependent=True, cpu_step_copies=5,
              description="bitsandbytes PagedAdamW8bit: AdamW8bit's states in CUDA unified memory"),
    Optimizer(name="paged_adamw_32bit", states_per_param=2, state_bytes_override=4, kernel="fused", paged=True,
              description="bitsandbytes PagedAdamW32bit: fp32 exp_avg + exp_avg_sq in CUDA unified memory"),
    # lion-pytorch 0.2.5 (lucidrains; lion_pytorch.py): state['exp_avg'] = zeros_like(p) made in the step's loop,
    # then update_fn's clone and sum of it (the Triton update_fn, use_triton=True, is not modelled)
    Optimizer(name="lion", states_per_param=1, kernel="single-tensor", scratch="in-call", lazy_states=True,
              any_device=True, description="Lion (lion-pytorch): exp_avg"),
    # schedulefree 1.4 AdamWScheduleFree (adamw_schedulefree.py): state['z'] = clone(p) and
    # state['exp_avg_sq'] = zeros_like(p) for every parameter first, then the foreach step (its default off CUDA
    # too): ``denom = torch._foreach_div(exp_avg_sq, bias_correction2)``, one state-sized temporary per tensor as
    # torch's foreach Adam; train()/eval() swap y and x in place
    Optimizer(name="adamw-schedulefree", states_per_param=2, kernel="foreach", any_device=True,
              description="schedule-free AdamW (schedulefree): z + exp_avg_sq"),
    # torch.optim.Muon (torch 2.13 _muon.py) on the blocks' matrices, which is all it takes ("Muon only supports 2D
    # parameters"; its docs: embeddings, the head, gains and biases with AdamW), torch.optim.AdamW on the rest:
    # muon_state_bytes, muon_step_scratch
    Optimizer(name="muon", states_per_param=2, per_tensor="muon", description="Muon (torch.optim.Muon) on the blocks' matrices: "
              "momentum_buffer; AdamW on the rest: exp_avg + exp_avg_sq"),
    # Keller Jordan's muon-optimizer 0.1.0 (muon.py): MuonWithAuxAdam over DDP ranks, SingleDeviceMuonWithAuxAdam
    # on one GPU, grouped as its docstring's example: muon_aux_adam_step
    Optimizer(name="muon-with-aux-adam", states_per_param=2, lazy_states=True, per_tensor="muon-aux-adam",
              description="Keller Jordan's Muon (muon-optimizer MuonWithAuxAdam: each rank orthogonalises every "
              "world-th matrix and all-gathers the results) on the blocks' matrices: momentum_buffer; its own AdamW "
              "on the rest: exp_avg + exp_avg_sq"),
    # adam-mini 1.1.1 (Adam_mini, adam_mini.py): m for every tensor, v per head (queries, keys), per output row
    # (embedding, head, values, output projection, MLP), one scalar (norms) or whole (biases): adam_mini_states
    Optimizer(name="adam-mini", states_per_param=2, lazy_states=True, per_tensor="adam-mini",
              description="Adam-mini: m, and v per head / row / block"),
    # galore-torch 1.0 GaLoreAdamW as transformers' Trainer sets it up (optim galore_adamw): galore_step
    Optimizer(name="galore-adamw", states_per_param=2, lazy_states=True, per_tensor="galore",
              cuda_uncounted="each projection renewal (the first step, then every "
              f"{GALORE_UPDATE_GAP}) runs torch.linalg.svd on every projected matrix's gradient, and cuSOLVER "
              "gesvdj's workspace (its bufferSize, taken from the caching allocator for one matrix at a time) is "
              "not counted: that step's peak can exceed the figure by one matrix's workspace",
              description=f"GaLore (galore-torch GaLoreAdamW, rank {GALORE_RANK}, SVD projection renewed every "
              f"{GALORE_UPDATE_GAP} steps) on the attention and MLP linear weights: the projection and low-rank "
              "exp_avg + exp_avg_sq; AdamW on the rest"),
    # apollo-torch 1.0.3 APOLLOAdamW as transformers' Trainer sets it up (optim apollo_adamw): apollo_step
    Optimizer(name="apollo-adamw", states_per_param=2, lazy_states=True, per_tensor="apollo",
              description=f"APOLLO (apollo-torch APOLLOAdamW, rank {APOLLO_RANK}, random projection, channel "
              "scaling) on the attention and MLP linear weights: the projection and low-rank exp_avg + exp_avg_sq; "
              "AdamW on the rest"),
)}
#: names the optimizers go by elsewhere (--optimizer takes them too)
OPTIMIZER_ALIASES = {"muon_with_aux_adam": "muon-with-aux-adam", "muon-aux-adam": "muon-with-aux-adam",
                     "apollo": "apollo-adamw", "apollo_adamw": "apollo-adamw", "galore": "galore-adamw",
                     "galore_adamw": "galore-adamw",
                     "schedulefree": "adamw-schedulefree", "adamw_schedulefree": "adamw-schedulefree",
                     "schedule_free_adamw": "adamw-schedulefree", "schedule-free-adamw": "adamw-schedulefree"}

#: How an optimizer's step allocates scratch (torch.optim's implementations and DeepSpeed's kernels).
#: foreach (torch default on CUDA): _multi_tensor_adam's `torch._foreach_sqrt(exp_avg_sqs)` allocates one
#:   state-sized temporary for every tensor the rank updates -> 1 x state bytes of its partition.
#: fused (torch fused=True, DeepSpeed FusedAdam on CUDA): one kernel, no temporaries -> 0.
#: single-tensor (torch default on CPU): per tensor, `exp_avg_sq.sqrt() / bias_correction2_sqrt` holds two
#:   temporaries of the largest tensor -> 2 x its state bytes.
OPTIMIZER_IMPLS = ("foreach", "fused", "single-tensor")


#: float8 training with torchao's Float8Linear (torchao 0.18 float8/config.py Float8LinearRecipeName): --precision
#: names it, and the recipe of its bf16 compute is torchtitan's for the strategy (options._recipe): a Float8Linear
#: casts its bf16 input,
#: weight and output gradient to float8 for torch._scaled_mm and saves the bf16 ones (float8_linear.py)
FLOAT8_PRECISIONS = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise", "fp8-rowwise-gw-hp": "rowwise_with_gw_hp"}
#: "fp8" is torchao's Float8LinearConfig() default: tensorwise dynamic scaling
FLOAT8_ALIASES = {"fp8": "fp8-tensorwise"}
#: --float8's values -> torchao's recipe names
FLOAT8_RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise-gw-hp": "rowwise_with_gw_hp"}
#: --float8-keep: which linears stay bf16 besides those with a dim not a multiple of 16: torchtitan's converter
#: (its configs' filter_fqns = ["output"]) or Accelerate's (utils/ao.py convert_model_to_fp8_ao: the first and the
#: last nn.Linear, find_first_last_linear_layers)
FLOAT8_KEEP = ("output", "first-last")
#: the recipes float8 training runs on: a bf16 compute (FSDP2's param_dtype, or autocast to bf16)
FLOAT8_BASES = ("fsdp-bf16", "torch-amp", "bf16-autocast", "pure-bf16")


def float8_weights(inv: ParamInventory, keep: str) -> frozenset[str]:
    """The names of the weights torchao's converter swaps into Float8Linear (tracing/float8.py convert, the same
    rule on the trace's modules): an nn.Linear weight whose two dims are multiples of 16, but the output projection
    (``keep`` output: torchtitan's) or the first and last nn.Linear (first-last: Accelerate's)."""
    from memplan.model.inventory import classify

    linears = [t for t in inv.tensors if t.layer == "linear" and len(t.shape) == 2 and t.name.endswith(".weight")]
    kept = {linears[0].name, linears[-1].name} if keep == "first-last" and linears else set()
    return frozenset(t.name for t in linears if t.shape[0] % 16 == 0 and t.shape[1] % 16 == 0
                     and t.name not in kept and (keep != "output" or classify(t.name) != "head"))


def float8_gathered(inv: ParamInventory, s: Any) -> frozenset[str]:
    """The weights FSDP2 all-gathers in float8 (torchao's enable_fsdp_float8_all_gather, --float8-all-gather:
    fsdp_utils.py WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather casts each shard to float8, and the
    all-gather, its output and the unsharded weight hold one byte an element); empty without it. frameworks/fsdp2.py,
    its replay and comm.py read it."""
    return float8_weights(inv, s.float8_keep) if s.float8_all_gather else frozenset()


def float8_precision(name: str) -> str | None:
    """The torchao recipe a --precision name asks for (tensorwise, rowwise, rowwise_with_gw_hp), or None."""
    return FLOAT8_PRECISIONS.get(FLOAT8_ALIASES.get(name, name))


def float8_name(recipe: str) -> str:
    """The --precision name of a torchao float8 recipe."""
    return next(k for k, v in FLOAT8_PRECISIONS.items() if v == recipe)


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise SettingsError(f"unknown precision recipe {quote(name)}; valid: {', '.join(RECIPES)}, "
                            f"{', '.join(FLOAT8_PRECISIONS)} (float8: torchao's Float8Linear)") from None


def get_optimizer(name: str) -> Optimizer:
    try:
        return OPTIMIZERS[OPTIMIZER_ALIASES.get(name.lower(), name.lower())]
    except KeyError:
        raise SettingsError(f"unknown optimizer {quote(name)}; valid: {', '.join(OPTIMIZERS)}") from None


#: bitsandbytes' two shared quantization maps (create_dynamic_map: 256 fp32 entries each), once per optimizer
QMAP_BYTES = 2 * 256 * 4


def state_allocations(opt: Optimizer, recipe: Recipe, shape: tuple[int, ...], numel: int) -> tuple[int, ...]:
    """The state tensors (bytes each, in the order they are made) for one tensor of ``shape`` (``numel``
    elements) as the optimizer is handed it."""
    if opt.factored and len(shape) >= 2:
        # Adafactor: exp_avg_sq_row (shape[:-1]) then exp_avg_sq_col (shape[:-2] + shape[-1:]), fp32
        rows, cols = shape[-2], shape[-1]
        lead = numel // (rows * cols) if rows * cols else 0
        b = opt.state_bytes_override or recipe.state_bytes
        return (b * lead * rows, b * lead * cols)
    if opt.state_bytes_override is not None and numel >= opt.min_8bit_numel:
        if not opt.quant_block:
            return (numel * opt.state_bytes_override,) * opt.states_per_param
        # bitsandbytes 8-bit: state1, state2 (uint8), then absmax1, absmax2 (fp32 per 256-element block)
        blocks = -(-numel // opt.quant_block)
        return (numel * opt.state_bytes_override,) * opt.states_per_param + (4 * blocks,) * opt.states_per_param
    return (numel * (4 if opt.quant_block else opt.state_bytes_override or recipe.state_bytes),) * \
        opt.states_per_param


def state_bytes_for(opt: Optimizer, recipe: Recipe, shape: tuple[int, ...], numel: int) -> int:
    """Optimizer-state bytes for one tensor of ``shape`` (``numel`` elements) as the optimizer is handed it."""
    return sum(state_allocations(opt, recipe, shape, numel))


def state_bytes(opt: Optimizer, recipe: Recipe, tensors: tuple[tuple[tuple[int, ...], int], ...]) -> int:
    """Optimizer-state bytes for the tensors the optimizer steps ((shape, elements) each); bitsandbytes 8-bit
    adds its two shared quantization maps where any tensor gets 8-bit states."""
    out = sum(state_bytes_for(opt, recipe, shape, numel) for shape, numel in tensors)
    if opt.quant_block and any(numel >= opt.min_8bit_numel for _, numel in tensors):
        out += QMAP_BYTES
    return out


def step_temporaries(opt: Optimizer, impl: str, stepped_bytes: int, recipe: Recipe, numels: list[int],
                     device: str = "cuda") -> int:
    """Bytes of the single-tensor step's temporaries at their worst: per tensor in the optimizer's order, two
    tensor-sized temporaries (Adam's exp_avg_sq.sqrt() and its division; Adafactor's grad**2 + eps, its
    approximation or rsqrt, and -update) while the previous tensor's is still bound to the loop's local
    (torch/optim/adam.py _single_tensor_adam; transformers optimization.py Adafactor.step); Adafactor also holds
    fp32 copies of a 16-bit parameter and its gradient (``stepped_bytes``: bytes per element of what it
    steps). max over i of n[i-1] + k n[i], in state bytes."""
    if impl != "single-tensor":
        return 0
    if opt.scratch == "in-call":
        return (opt.state_bytes_override or recipe.state_bytes) * 2 * max(numels, default=0)
    if opt.cpu_step_copies and device == "cpu":
        return 4 * (opt.cpu_step_copies + (stepped_bytes < 4)) * max(numels, default=0)
    k = 2 + (2 if opt.upcasts_half and stepped_bytes < 4 else 0)
    best = prev = 0
    for x in numels:
        best = max(best, prev + k * x)
        prev = x
    # the temporaries are in the states' dtype (Adafactor's fp32; an 8-bit optimizer's kernel off CUDA in the
    # recipe's, as torch.optim's)
    width = opt.state_bytes_override if opt.state_bytes_override and not opt.quant_block else recipe.state_bytes
    return width * best


# ---- Muon (torch.optim.Muon) with AdamW beside it ----

def muon_tensors(inv: Any) -> tuple[bool, ...]:
    """Per tensor of the model, module order: whether Muon steps it (a trainable 2-D tensor inside a block; the
    embedding, the head, norms and biases go to AdamW, as torch.optim.Muon's documentation and its 2-D-only check
    have it)."""
    from memplan.model.inventory import ROOT_BLOCK

    return tuple(t.trainable and t.block != ROOT_BLOCK and len(t.shape) == 2 for t in inv.tensors)


def muon_state_bytes(inv: Any, recipe: Recipe) -> int:
    """Muon's momentum_buffer (zeros_like(p.grad): the gradient's dtype) for its tensors, AdamW's two states (the
    parameter's dtype) for the others that train."""
    out = 0
    for t, muon in zip(inv.tensors, muon_tensors(inv)):
        if muon:
            out += t.numel * recipe.grad_bytes
        elif t.trainable:
            out += 2 * t.numel * recipe.state_bytes
    return out


def newton_schulz_peak(shape: tuple[int, int], grad_bytes: int, gemm: Any = None) -> int:
    """The most one matrix's Muon update holds beyond the states (torch 2.13 _muon.py _single_tensor_muon and
    _zeropower_via_newtonschulz, nesterov and five steps by default), for a gradient of ``shape`` [a, b], k =
    min(a, b): the Nesterov update grad.lerp(buf) (U, the gradient's dtype) held by the caller through the call;
    its bf16 copy (none when already bf16) as the first iterate X; per step gram = X X^T and gram_update (k x k,
    bf16, each bound until the next step's replaces it) and the next X (a x b, bf16) made while the last is
    alive: U + 4ab + 4k^2 bytes at the last product. ``gemm(m, n, k)``: a CPU matmul's own scratch, during it."""
    a, b = shape
    k, ab = min(a, b), a * b
    g = gemm or (lambda m, n, kk: 0)
    l_ = max(a, b)
    u = grad_bytes * ab
    copy = 0 if grad_bytes == 2 else 2 * ab
    first = u + copy + 4 * k * k + 2 * ab + g(k, l_, k)
    later = max(u + 2 * ab + 6 * k * k + g(k, k, l_), u + 2 * ab + 6 * k * k + g(k, k, k),
                u + 4 * ab + 4 * k * k + g(k, l_, k))
    return max(first, later, u + copy + 2 * k * k + g(k, k, l_))


def muon_step_scratch(inv: Any, recipe: Recipe, adamw_impl: str, gemm: Any = None) -> int:
    """The step's scratch at its worst: Muon's loop (newton_schulz_peak per matrix; the last matrix's result, 2ab
    bf16, still bound while the next one's Nesterov update is made), then AdamW's step on the rest (foreach: one state-sized
    temporary per tensor; single-tensor: max over i of n[i-1] + 2 n[i])."""
    muon, prev = 0, 0
    rest: list[int] = []
    for t, m in zip(inv.tensors, muon_tensors(inv)):
        if m:
            # ``update = grad.lerp(buf, momentum)`` is made while the last matrix's result is still bound, which
            # the rebinding then frees, before the Newton-Schulz steps
            u = recipe.grad_bytes * t.numel
            muon = max(muon, prev + u, newton_schulz_peak(t.shape, recipe.grad_bytes, gemm))
            prev = 2 * t.numel
        elif t.trainable:
            rest.append(t.numel)
    if adamw_impl == "foreach":
        adam = recipe.state_bytes * sum(rest)
    elif adamw_impl == "single-tensor":
        best = last = 0
        for x in rest:
            best = max(best, last + 2 * x)
            last = x
        adam = recipe.state_bytes * best
    else:
        adam = 0
    return max(muon, adam)


# ---- Keller Jordan's Muon (muon-optimizer 0.1.0, muon.py): MuonWithAuxAdam, SingleDeviceMuonWithAuxAdam ----


def muon_aux_adam_groups(inv: Any) -> tuple[list[Any], list[Any]]:
    """(the AdamW groups' tensors in step order, the Muon group's matrices in its order), as the class's
    docstring example groups a model: Muon for the blocks' 2-D matrices (muon_tensors); AdamW groups for the
    head, then the embeddings, then the rest (gains, biases), in that order."""
    muon = muon_tensors(inv)
    mats = [t for t, m in zip(inv.tensors, muon) if m]
    rest = [t for t, m in zip(inv.tensors, muon) if t.trainable and not m]
    head = [t for t in rest if t.category == "head"]
    embed = [t for t in rest if t.category != "head" and "embed" in t.name]
    return head + embed + [t for t in rest if t.category != "head" and "embed" not in t.name], mats


def muon_aux_adam_sorted(mats: list[Any]) -> list[Any]:
    """MuonWithAuxAdam's order: ``sorted(params, key=lambda x: x.size(), reverse=True)`` (shapes compared as
    tuples; a stable sort)."""
    return sorted(mats, key=lambda t: tuple(t.shape), reverse=True)


def muon_aux_adam_why_not(inv: Any, world: int, gloo: bool = False) -> str | None:
    """Why MuonWithAuxAdam cannot step this model on ``world`` ranks: no matrices; a matrix count it pads with
    ``len(params) % world`` copies, not up to a multiple of world, so that the last all_gather is handed fewer
    tensors than ranks; over gloo (``gloo``), an all_gather of tensors of two shapes (ProcessGroupGloo requires
    one)."""
    mats = muon_aux_adam_groups(inv)[1]
    n = len(mats)
    if not n:
        return "the model has no 2-D matrices in its blocks for Muon to orthogonalise"
    if world > 1 and (n + n % world) % world:
        return (f"MuonWithAuxAdam pads its {n} matrices with len(params) % world = {n % world} tensors, not up to a "
                f"multiple of {world} ranks, so its last all_gather is handed fewer tensors than ranks and fails")
    if world > 1 and gloo:
        order = muon_aux_adam_sorted(mats)
        order += [order[-1]] * (n % world)
        for base in range(0, len(order), world):
            if len({tuple(t.shape) for t in order[base:base + world]}) > 1:
                return ("MuonWithAuxAdam all-gathers matrices of two shapes at once here, which gloo refuses "
                        "(ProcessGroupGloo's allgather takes one shape; NCCL broadcasts them): run it on CUDA")
    return None


def muon_aux_adam_step(inv: Any, recipe: Recipe, first: bool = False, gemm: Any = None, cpu: bool = False,
                       world: int = 1) -> list[tuple[str, int]]:
    """Rank 0's step (StepEvents): on one GPU SingleDeviceMuonWithAuxAdam, on ``world`` DDP ranks
    MuonWithAuxAdam. Rank 0 steps the first of every ``world`` matrices in size order, the largest of each:
    the most states and scratch of any rank.

    The AdamW groups first, per tensor (states lazily, zeros_like(p)): adam_update's ``grad.square()``, then
    ``buf1c``, ``buf2c``, ``buf2c.sqrt()``, its ``+ eps``, the quotient (returned); the step's ``update`` local
    holds it until the next tensor's replaces it. The Muon group: MuonWithAuxAdam's ``params_pad`` adds one
    ``empty_like(params[-1])`` where the count is not a multiple of world (held to the end of the step); per
    matrix of its own the momentum buffer at the first step, muon_update (``momentum.lerp_``, ``grad.lerp_`` in
    place), zeropower_via_newtonschulz5: the gradient's bf16 copy (none when bf16), its norm and ``+ 1e-7`` (one
    element each), the normalised X; five times ``A = X @ X.mT`` [k, k], ``b * A``, ``c * A``, ``(c * A) @ A``,
    ``B``, then ``a * X``, ``B @ X``, the next X (A, B and X each bound until replaced); the result is
    ``update``. Then each all_gather of ``world`` tensors of one shape flattens its outputs into one
    world x numel buffer (ProcessGroupNCCL / ProcessGroupGloo ``newLikeFlat``), copied out and freed; tensors of
    mixed shapes go by broadcasts on NCCL (no buffer) and are refused by gloo (muon_aux_adam_why_not's caller).
    ``gemm(m, n, k)``: a CPU matmul's own scratch, during it."""
    gb, pb = recipe.grad_bytes, recipe.param_bytes
    e = StepEvents()
    adam, mats = muon_aux_adam_groups(inv)
    for t in adam:
        n = t.numel
        if first:
            e.alloc(pb * n, keep=True)
            e.alloc(pb * n, keep=True)
        e.temporary(gb * n)  # grad.square()
        b1, b2, sq = e.alloc(pb * n), e.alloc(pb * n), e.alloc(pb * n)
        den = e.alloc(pb * n)
        e.free(sq)
        q = e.alloc(pb * n)
        for i in (den, b1, b2):
            e.free(i)
        e.bind("update", q)
    g = gemm or (lambda m, n, k: 0)
    if world > 1:
        mats = muon_aux_adam_sorted(mats)
    pad = e.alloc(pb * mats[-1].numel) if world > 1 and len(mats) % world else None
    for base in range(0, len(mats), world):
        t = mats[base]
        a_, b_ = t.shape
        k, ab = min(a_, b_), a_ * b_
        l_ = max(a_, b_)
        if first:
            e.alloc(pb * t.numel, keep=True)  # momentum_buffer
        x0 = None if gb == 2 else e.alloc(2 * ab)  # G.bfloat16()
        nrm = e.alloc(2)
        eps = e.alloc(2)
        e.free(nrm)
        x = e.alloc(2 * ab)
        e.free(eps)
        e.free(x0)
        e.bind("X", x)
        for _ in range(5):
            e.temporary(g(k, k, l_))
            e.bind("A", e.alloc(2 * k * k))
            ba = e.alloc(2 * k * k)
            ca = e.alloc(2 * k * k)
            e.temporary(g(k, k, k))
            caa = e.alloc(2 * k * k)
            e.free(ca)
            bn = e.alloc(2 * k * k)
            e.free(ba)
            e.free(caa)
            e.bind("B", bn)
            ax = e.alloc(2 * ab)
            e.temporary(g(k, l_, k))
            bx = e.alloc(2 * ab)
            xn = e.alloc(2 * ab)
            e.free(ax)
            e.free(bx)
            e.bind("X", xn)
        out = e.bound["X"]
        e.bind("A", None)  # the function's locals go, then ``update = ...`` drops the last update
        e.bind("B", None)
        e.bind("update", out)
        e.bind("X", None)
        if world > 1:
            chunk = mats[base:base + world] + [mats[-1]] * max(0, base + world - len(mats))
            if len({tuple(c.shape) for c in chunk}) == 1:
                e.temporary(pb * world * t.numel)
    e.free(pad)
    return e.done()


def muon_aux_adam_states(inv: Any, recipe: Recipe, world: int = 1) -> int:
    """What rank 0 keeps: AdamW's two states per tensor of its groups, a momentum buffer per matrix it steps."""
    return sum(x for kind, x in muon_aux_adam_step(inv, recipe, first=True, world=world) if kind == "s")


# ---- Adam-mini (adam-mini 1.1.1, adam_mini.py) ----

#: Adam_mini's name sets, in the order its step tests them (a lower-cased parameter name containing one)
ADAM_MINI_BIAS = ("bias",)
ADAM_MINI_QK = ("k_proj", "q_proj", "wq", "wk", "query", "key")
ADAM_MINI_ROWS = ("embed", "embd", "wte", "lm_head", "output", "final_layer", "v_proj", "wv", "value", "o_proj",
                  "wo", "attn.proj", "feed_forward", "linear", "mlp")


def adam_mini_kind(name: str) -> str:
    """Which of Adam_mini.step's branches a parameter takes: "bias" (Adam), "heads" (queries, keys: v per head),
    "rows" (v per output row), "block" (one v: norms and the rest)."""
    low = name.lower()
    for kind, names in (("bias", ADAM_MINI_BIAS), ("heads", ADAM_MINI_QK), ("rows", ADAM_MINI_ROWS)):
        if any(n in low for n in names):
            return kind
    return "block"


def _adam_mini_rows(t: ParamTensor, kind: str, head_numel: int) -> int:
    if kind == "heads":
        return t.numel // head_numel
    if kind == "rows":
        return t.shape[0] if t.shape else 1
    return 1


def adam_mini_head_numel(inv: ParamInventory) -> int:
    """Adam_mini's head_numel, dim x dim / n_heads, from the config (dim = hidden_size)."""
    hidden: int = inv.dims["hidden_size"]
    heads: int = inv.dims["num_heads"]
    return hidden * hidden // heads


def adam_mini_states(inv: Any, recipe: Recipe) -> int:
    """m (zeros_like(p); the gradient's dtype where the branch takes zeros_like(p.grad)) for every tensor that
    trains, and v: whole for a bias, one per head or row, or one element."""
    hn = adam_mini_head_numel(inv)
    out = 0
    for t in inv.tensors:
        if not t.trainable:
            continue
        kind = adam_mini_kind(t.name)
        b = recipe.grad_bytes if kind == "rows" else recipe.state_bytes
        out += t.numel * b + (t.numel if kind == "bias" else _adam_mini_rows(t, kind, hn)) * b
    return out


def adam_mini_step(inv: Any, recipe: Recipe, first: bool = False, cpu: bool = False) -> list[tuple[str, int]]:
    """Adam_mini.step's allocations and frees in order, as ("a", bytes), ("f", index of the allocation) and, at the
    first step, ("s", bytes) for each state made in the loop just before its tensor's update (kept); the loop's
    locals (``update``, ``h``, ``stepsize``, ``tmp_lr``) stay bound until the next tensor rebinds them."""
    hn = adam_mini_head_numel(inv)
    sb, gb = recipe.state_bytes, recipe.grad_bytes
    ev: list[tuple[str, int]] = []
    bound: dict[str, int] = {}

    def alloc(n: int) -> int:
        ev.append(("a", n))
        return len(ev) - 1

    def bind(local: str, i: int) -> None:
        old = bound.get(local)
        bound[local] = i
        if old is not None:
            ev.append(("f", old))

    for t in inv.tensors:
        if not t.trainable:
            continue
        kind = adam_mini_kind(t.name)
        n = t.numel
        if first:  # m, then v (a bias's whole; a norm's made from torch.sum(p * p), its p * p a temporary)
            rows = n if kind == "bias" else _adam_mini_rows(t, kind, hn)
            b = gb if kind == "rows" else sb
            ev.append(("s", b * n))
            if kind == "block":
                ev.append(("f", alloc(sb * n)))
            ev.append(("s", b * rows))
        if kind == "bias":  # Adam: h = (v.sqrt() / c).add_(eps)
            r = alloc(sb * n)
            h = alloc(sb * n)
            ev.append(("f", r))
            bind("h", h)
            continue
        rows = _adam_mini_rows(t, kind, hn)
        b = gb if kind == "rows" else sb
        if kind == "block":  # tmp_lr = torch.sum(grad * grad)
            sq = alloc(gb * n)
            tmp = alloc(gb)
        else:  # tmp_lr = torch.mean(grad * grad, dim=1, keepdim=True)
            sq = alloc(gb * n)
            if cpu and gb < 4:
                # ATen's CPU mean_out of a 16-bit input: "cast_fp32 -> sum -> div -> cast" (ReduceOps.cpp), the
                # fp32 result and the input's fp32 copy materialised in sum_out
                res = alloc(4 * rows)
                ev.append(("f", alloc(4 * n)))
                tmp = alloc(gb * rows)
                ev.append(("f", res))
            else:
                tmp = alloc(gb * rows)
        ev.append(("f", sq))
        bind("tmp_lr", tmp)
        if kind == "block":
            q = alloc(gb)  # tmp_lr / block_numel
            bind("tmp_lr", q)
        r = alloc(b * rows)  # h = (vmean.sqrt() / c).add_(eps)
        h = alloc(b * rows)
        ev.append(("f", r))
        bind("h", h)
        st = alloc(b * rows)  # stepsize = (1 / c1) / h
        bind("stepsize", st)
        u = alloc(b * n)  # update = m * stepsize
        bind("update", u)
        neg = alloc(b * n)  # p.add_(-update)
        ev.append(("f", neg))
    for i in bound.values():
        ev.append(("f", i))
    return ev


def step_events_peak(ev: list[tuple[str, int]]) -> int:
    """The most a step's events (adam_mini_step, apollo_step) hold at once, states made in it included."""
    live: dict[int, int] = {}
    cur = best = 0
    for i, (kind, x) in enumerate(ev):
        if kind in ("a", "s"):
            live[i] = x
            cur += x
            best = max(best, cur)
        else:
            cur -= live.pop(x)
    return best


def adam_mini_step_scratch(inv: Any, recipe: Recipe, cpu: bool = False) -> int:
    """The most adam_mini_step holds at once."""
    return step_events_peak(adam_mini_step(inv, recipe, cpu=cpu))


# ---- APOLLO (apollo-torch 1.0.3 APOLLOAdamW, apollo.py and random_projector.py) ----



def low_rank_tensors(inv: Any) -> tuple[bool, ...]:
    """Per tensor, module order: whether a low-rank optimizer (GaLore, APOLLO) projects it. transformers'
    _setup_low_rank_optimizer takes the weight of each nn.Linear whose module name check_target_module_exists
    matches LOW_RANK_TARGETS (a list: the name itself, a substring, or re.fullmatch); every other parameter is in
    the plain AdamW group."""
    import re

    def target(t: Any) -> bool:
        if not (t.trainable and t.layer == "linear" and t.name.endswith(".weight") and len(t.shape) == 2):
            return False
        mod = t.name[: -len(".weight")]
        return any(k in mod for k in LOW_RANK_TARGETS) or any(re.fullmatch(k, mod) for k in LOW_RANK_TARGETS)
    return tuple(target(t) for t in inv.tensors)


class StepEvents:
    """A Python optimizer step's allocations and frees in order (adam_mini_step's form): ("a", bytes), ("f", index
    of an allocation), ("s", bytes) for what the step keeps; the loop's locals (``bind``) hold what they name until
    they are rebound, and a tensor two locals name dies with the second."""

    def __init__(self) -> None:
        self.ev: list[tuple[str, int]] = []
        self.refs: dict[int, int] = {}
        self.bound: dict[str, int] = {}

    def alloc(self, n: int, keep: bool = False) -> int:
        self.ev.append(("s" if keep else "a", n))
        return len(self.ev) - 1

    def free(self, i: int | None) -> None:
        if i is not None:
            self.ev.append(("f", i))

    def temporary(self, n: int) -> None:
        """Made and dropped at once."""
        self.free(self.alloc(n))

    def drop(self, i: int | None) -> None:
        if i is None:
            return
        self.refs[i] -= 1
        if self.refs[i] == 0:
            self.free(i)

    def bind(self, local: str, i: int | None) -> None:
        old = self.bound.pop(local, None)
        if i is not None:
            self.refs[i] = self.refs.get(i, 0) + 1
            self.bound[local] = i
        self.drop(old)

    def done(self) -> list[tuple[str, int]]:
        """The step returns: its locals are dropped."""
        for local in list(self.bound):
            self.bind(local, None)
        return self.ev


def apollo_step(inv: Any, recipe: Recipe, first: bool = False, update: bool = True,
                gemm: Any = None, cpu: bool = False) -> list[tuple[str, int]]:
    """APOLLOAdamW.step's allocations and frees in order, as adam_mini_step's events: ("a", bytes), ("f", index
    of an allocation), ("s", bytes) for what the step keeps (states made at the first step). The param groups as
    the Trainer builds them: the rest first (AdamW), then the projected matrices (rank 128, random projection,
    channel scaling, the norm limiter on). Everything is in the gradient's dtype (zeros_like(grad)).

    Per projected matrix [m, n] (k = the low-rank gradient's elements, m x r for m >= n else r x n):
    ``grad = p.grad`` drops the previous low-rank gradient; at an update step (the first, then every
    update_proj_gap) get_orthogonal_matrix takes ``data.float()`` (a 16-bit gradient's fp32 copy, though only its
    shape is read), stable_randn's fp32 [r, n] (or [m, r]), its division by sqrt(r), and its cast to the gradient's
    dtype, which replaces the kept projection; the projection matmul (``gemm``: a CPU bf16 GEMM's own scratch);
    the states at the first step; ``denom``, ``norm_grad``; the channel norms (two vectors of max(m, n), the sum
    and the quotient); ``scaled_grad = p.grad * factor`` (full size); after the first step the limiter's
    ``scaled_grad / limiter`` (a second full-size tensor while the first is alive) and its 0-dim norms; then
    ``norm_grad = scaled_grad``. The loop's locals (grad, denom, norm_grad, scaled_grad, grad_scaling_factor) stay
    bound until rebound, across tensors and groups. Nothing of it differs on CPU (``cpu``)."""
    gb = recipe.grad_bytes
    r = APOLLO_RANK
    e = StepEvents()
    ev, alloc, bind, bound = e.ev, e.alloc, e.bind, e.bound
    targets = low_rank_tensors(inv)
    order = [(t, False) for t, a in zip(inv.tensors, targets) if t.trainable and not a] + \
        [(t, True) for t, a in zip(inv.tensors, targets) if a]
    for t, projected in order:
        n = t.numel
        bind("grad", None)  # grad = p.grad
        if not projected:
            if first:
                ev.extend([("s", gb * n), ("s", gb * n)])
            bind("denom", alloc(gb * n))
            bind("norm_grad", alloc(gb * n))
            continue
        rows, cols = t.shape
        o = r * cols if rows >= cols else rows * r  # the projection's elements
        k = rows * r if rows >= cols else r * cols  # the low-rank gradient's
        if update:
            copy = alloc(4 * n) if gb != 4 else None  # matrix = data.float()
            rnd = alloc(4 * o)
            div = alloc(4 * o)
            ev.append(("f", rnd))
            if gb != 4:
                if first:
                    ev.append(("s", gb * o))
                else:  # the new projection, then the old one dropped: the same bytes
                    ev.append(("f", alloc(gb * o)))
                ev.append(("f", div))
            elif first:
                ev[div] = ("s", 4 * o)
            else:
                ev.append(("f", div))
            if copy is not None:
                ev.append(("f", copy))
        if gemm is not None:
            ev.append(("f", alloc(gemm(rows, r, cols) if rows >= cols else gemm(r, cols, rows))))
        bind("grad", alloc(gb * k))
        if first:
            ev.extend([("s", gb * k), ("s", gb * k)])
        bind("denom", alloc(gb * k))
        bind("norm_grad", alloc(gb * k))
        v = max(rows, cols)
        n1 = alloc(gb * v)
        n2 = alloc(gb * v)
        n3 = alloc(gb * v)
        ev.append(("f", n2))
        q = alloc(gb * v)
        ev.append(("f", n1))
        ev.append(("f", n3))
        bind("grad_scaling_factor", q)
        bind("scaled_grad", alloc(gb * n))
        if first:
            ev.append(("s", gb))  # state["scaled_grad"] = torch.norm(scaled_grad), 0-dim
        else:
            norm = alloc(gb)  # scaled_grad_norm
            den = alloc(gb)  # state + 1e-8
            ratio = alloc(gb)
            ev.append(("f", den))
            lim = alloc(gb)  # max(ratio, 1.01) / 1.01
            ev.append(("f", ratio))
            bind("scaled_grad", alloc(gb * n))  # scaled_grad / limiter
            ev.append(("f", alloc(gb)))  # the new 0-dim state, the old one dropped
            ev.append(("f", lim))
            ev.append(("f", norm))
        bind("norm_grad", bound["scaled_grad"])
    return e.done()


# ---- GaLore (galore-torch 1.0 GaLoreAdamW, adamw.py and galore_projector.py) ----


#: what MKL's sgesdd (torch's CPU SVD, LAPACK from MKL 2024.2) takes from c10's CPU allocator for itself, made
#: and freed inside the kernel: the same bytes for every shape measured (64 x 64 to 3000 x 1000, fp32; torch 2.13's
#: CPU profiler, profile_memory), so modelled as a constant on CPU; nothing of the kind on CUDA
MKL_GESDD_BLOCK = 14400


def galore_step(inv: Any, recipe: Recipe, first: bool = False, update: bool = True,
                gemm: Any = None, cpu: bool = False) -> list[tuple[str, int]]:
    """GaLoreAdamW.step's allocations and frees in order (StepEvents). The param groups as the Trainer builds them
    (_setup_low_rank_optimizer): the rest first (transformers-style AdamW), then the projected matrices (rank 128,
    proj_type "std", scale 0.25). The states are zeros_like of the (low-rank) gradient: its dtype.

    Per tensor: ``grad = p.grad`` drops the previous low-rank gradient. A projected matrix [m, n] (k = min(m, n),
    r = min(rank, k)) at an update step (the first, then every update_proj_gap) runs get_orthogonal_matrix:
    ``data.float()`` (a 16-bit gradient's fp32 copy); torch.linalg.svd(full_matrices=False), whose outputs U [m, k],
    Vh [k, n] and S [k] are made first (the structured kernel's meta), then its int info and the input's
    column-major copy (cloneBatchedColumnMajor), freed when the kernel returns, and on CPU MKL's own block
    (MKL_GESDD_BLOCK) beside them; LAPACK's work (CPU: a std::vector, not a tensor) and cuSOLVER gesvdj's workspace
    (CUDA: taken from the caching allocator, its size cuSOLVER's bufferSize, which no source memplan reads
    gives) are not counted.
    Then torch.diag(s[:r]) and, for m >= n ("right"), ``U[:, :r] @ diag`` [m, r] with ``Vh[:r]`` returned, cast
    to the gradient's dtype where it is not fp32 (a new [r, n]); fp32 returns the view, which keeps all of Vh
    [k, n] alive as the projection. For m < n ("left") ``diag @ Vh[:r]`` [r, n] and ``U[:, :r]`` returned (fp32:
    the view keeps U [m, k]). The function's locals die when it returns, then the new projection replaces the old.
    The projection matmul makes the low-rank gradient ([m, r] or [r, n]; ``gemm``: a CPU bf16 GEMM's own scratch),
    the first step the states, then ``denom = exp_avg_sq.sqrt()`` and ``norm_grad = exp_avg / denom``;
    project_back's matmul makes the full-size [m, n] and ``* scale`` another, the first dying when it returns.
    ``denom`` and ``norm_grad`` (full size after a projected matrix) stay bound until the next tensor rebinds
    them."""
    gb = recipe.grad_bytes
    e = StepEvents()
    targets = low_rank_tensors(inv)
    order = [(t, False) for t, a in zip(inv.tensors, targets) if t.trainable and not a] + \
        [(t, True) for t, a in zip(inv.tensors, targets) if a]
    for t, projected in order:
        n_el = t.numel
        e.bind("grad", None)  # grad = p.grad
        if not projected:
            if first:
                e.alloc(gb * n_el, keep=True)
                e.alloc(gb * n_el, keep=True)
            e.bind("denom", e.alloc(gb * n_el))
            e.bind("norm_grad", e.alloc(gb * n_el))
            continue
        m, n = t.shape
        k = min(m, n)
        r = min(GALORE_RANK, k)
        right = m >= n
        if update:
            fp32 = gb == 4
            copy = None if fp32 else e.alloc(4 * m * n)  # matrix = data.float()
            keep_u, keep_vh = first and fp32 and not right, first and fp32 and right
            u = e.alloc(4 * m * k, keep=keep_u)
            vh = e.alloc(4 * k * n, keep=keep_vh)
            s_ = e.alloc(4 * k)
            info = e.alloc(4)
            clone = e.alloc(4 * m * n)  # the column-major copy the kernel overwrites
            if cpu:
                e.temporary(MKL_GESDD_BLOCK)
            e.free(clone)
            e.free(info)
            diag = e.alloc(4 * r * r)
            made = e.alloc(4 * (m * r if right else r * n))  # U[:, :r] @ diag, or diag @ Vh[:r]
            e.free(diag)
            cast = None if fp32 else e.alloc(gb * (r * n if right else m * r), keep=first)
            # the locals die in order (matrix, U, s, Vh, A, B), the returned projection kept
            e.free(copy)
            if not (fp32 and not right):
                e.free(u)
            e.free(s_)
            if not (fp32 and right):
                e.free(vh)
            e.free(made)
            if not first:  # the new projection (the same bytes) replaces the old one
                e.free(u if fp32 and not right else vh if fp32 else cast)
        low = m * r if right else r * n
        e.bind("grad", e.alloc(gb * low))
        if gemm is not None:  # inside the kernel, after aten made its output
            e.temporary(gemm(m, r, n) if right else gemm(r, n, m))
        if first:
            e.alloc(gb * low, keep=True)
            e.alloc(gb * low, keep=True)
        e.bind("denom", e.alloc(gb * low))
        e.bind("norm_grad", e.alloc(gb * low))
        back = e.alloc(gb * m * n)
        if gemm is not None:
            e.temporary(gemm(m, n, r))
        scaled = e.alloc(gb * m * n)
        e.free(back)
        e.bind("norm_grad", scaled)
    return e.done()


def galore_states(inv: Any, recipe: Recipe) -> int:
    """What GaLoreAdamW keeps: the first step's kept allocations (AdamW's two states per plain tensor; per
    projected matrix its projection and the low-rank exp_avg and exp_avg_sq)."""
    return sum(x for kind, x in galore_step(inv, recipe, first=True) if kind == "s")


def apollo_states(inv: Any, recipe: Recipe) -> int:
    """What APOLLOAdamW keeps: the first step's kept allocations (AdamW's two states per plain tensor; per
    projected matrix its projection, the low-rank exp_avg and exp_avg_sq and the limiter's 0-dim norm)."""
    return sum(x for kind, x in apollo_step(inv, recipe, first=True) if kind == "s")


#: the low-rank optimizers' steps (Optimizer.per_tensor -> its events), each projecting LOW_RANK_TARGETS
LOW_RANK_STEPS = {"apollo": apollo_step, "galore": galore_step}


def step_events_of(opt: Optimizer, inv: Any, recipe: Recipe, first: bool, world: int = 1) -> list[tuple[str, int]] | None:
    """The step's events of an optimizer modelled event by event (Adam-mini; GaLore and APOLLO at an update
    step, the envelope of the steps after the first; Keller Jordan's Muon, rank 0 of ``world``), or None."""
    if opt.per_tensor == "adam-mini":
        return adam_mini_step(inv, recipe, first=first)
    if opt.per_tensor == "muon-aux-adam":
        return muon_aux_adam_step(inv, recipe, first=first, world=world)
    if opt.per_tensor in LOW_RANK_STEPS:
        return LOW_RANK_STEPS[opt.per_tensor](inv, recipe, first=first)
    return None


# ---- optimizers whose states follow each named tensor (Optimizer.per_tensor) ----

def per_tensor_states(opt: Optimizer, inv: Any, recipe: Recipe, world: int = 1) -> int:
    """The states of an optimizer that picks per tensor of the whole model (muon_state_bytes, adam_mini_states;
    rank 0's of ``world`` for Keller Jordan's Muon)."""
    if opt.per_tensor == "muon-aux-adam":
        return muon_aux_adam_states(inv, recipe, world)
    if opt.per_tensor == "apollo":
        return apollo_states(inv, recipe)
    if opt.per_tensor == "galore":
        return galore_states(inv, recipe)
    return muon_state_bytes(inv, recipe) if opt.per_tensor == "muon" else adam_mini_states(inv, recipe)


def per_tensor_step_scratch(opt: Optimizer, inv: Any, recipe: Recipe, impl: str, gemm: Any = None,
                            cpu: bool = False, world: int = 1) -> int:
    """Its step's scratch (muon_step_scratch with ``gemm``, a CPU matmul's own scratch; adam_mini_step_scratch with
    ``cpu``: ATen's CPU mean of a 16-bit input; Keller Jordan's Muon: rank 0's of ``world``)."""
    if opt.per_tensor == "muon":
        return muon_step_scratch(inv, recipe, impl, gemm)
    if opt.per_tensor == "muon-aux-adam":  # its Newton-Schulz products are bf16 GEMMs whatever the recipe
        return step_events_peak(muon_aux_adam_step(inv, recipe, first=False, gemm=gemm, cpu=cpu, world=world))
    if opt.per_tensor in LOW_RANK_STEPS:  # an update step after the first (states all made): the most it holds
        g = gemm if recipe.grad_bytes == 2 else None
        return step_events_peak(LOW_RANK_STEPS[opt.per_tensor](inv, recipe, first=False, update=True, gemm=g,
                                                               cpu=cpu))
    return adam_mini_step_scratch(inv, recipe, cpu=cpu)
