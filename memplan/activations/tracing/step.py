"""One traced training micro-step of transformers' model on fake CPU tensors, with the target device's kernels
(memplan/activations/substitutes.py), its live-bytes timeline and the moments the strategies act at."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from memplan.activations import kernels as K
from memplan.activations import substitutes as sub
from memplan.activations.kernels import Target
from memplan.model import user_module
from memplan.parallel import CP_KEY, EP_KEY
from memplan.activations.tracing.accumulate import Accumulations
from memplan.activations.tracing.compiled import COMPILE_DDP_KEY, COMPILE_KEY, compiling, warm_up
from memplan.activations.tracing.explain import ModuleStack
from memplan.activations.tracing.live import LiveBytes, dispatch_mode, plain_tensors
from memplan.activations.tracing.segments import block_hooks, block_segments, loss_segment, root_first_hook, root_hooks_done
from memplan.activations.tracing_keys import FLOAT8_GATHERED, FLOAT8_KEY, trace_dtypes


@contextlib.contextmanager
def _substitutions(config: dict[str, Any], dtype: str, attention: str, target: Target, linear: str,
                   kernels: dict[str, str], cp: int = 1, compiled: bool = False) -> Iterator[None]:
    """What runs in place of the fake CPU tensors' kernels for the target (memplan/activations/substitutes.py), installed
    for the step and restored after it. Under torch.compile (tracing/compiled.py) a fused attention kernel is one
    operator the compiled graphs keep whole, and CUDA's dropout is aten's native_dropout, which inductor
    decomposes into a bool mask as the fused kernel keeps."""
    import logging

    import torch.nn.functional as F
    import transformers
    import transformers.masking_utils as mu

    real_sdpa, real_dropout, real_linear = F.scaled_dot_product_attention, F.dropout, F.linear
    # fake-tensor kernels that refuse an input log a traceback before raising; the raise is what we report
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_level, tf_level = fake_log.level, transformers.logging.get_verbosity()
    fake_log.setLevel(logging.CRITICAL)
    transformers.logging.set_verbosity_error()
    # packed-sequence detection reads values (.item()), which fake tensors do not have: one unpacked sequence
    real_packed = getattr(mu, "find_packed_sequence_indices", None)
    # whether SDPA may drop the mask (is_causal, or none at all) reads the 2-D padding mask's values; on a fake one
    # transformers never drops it (masking_utils.py _ignore_causal_mask_sdpa / _ignore_bidirectional_mask_sdpa:
    # is_tracing is true of a FakeTensor), where the job's all-ones mask (an encoder's or a BERT-style decoder's
    # torch.ones when none is given) is dropped: a [b, 1, s, s] mask made, the SDPA kernel picked for a mask, and an
    # eager attention's fp32 mask added to its bf16 scores (MegatronBERT: its probabilities in fp32, +1.87% on the
    # CPU harness). The traced step pads nothing, so the checks run as on no padding mask at all
    real_skips = {k: getattr(mu, k, None) for k in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")}
    # MoE experts run through grouped_mm. Its fake (meta) kernel takes bf16 only
    # (torch/_meta_registrations.py _meta_grouped_mm_common), while the real kernels also run fp32 weights
    # (torch-amp, fp32 recipes) through a fallback; for those the trace computes with transformers' own fallback op
    # (transformers::grouped_mm_fallback) under torch's grouped_mm autograd (substitutes.grouped_mm). Every fp32
    # trace is patched, whatever its config names its experts (Aria's and ERNIE-4.5's moe_num_experts); a dense
    # model never calls it.
    moe = None
    if dtype == "float32":
        import transformers.integrations.moe as moe
    real_can_grouped = getattr(moe, "_can_use_grouped_mm", None)
    real_grouped = getattr(moe, "_grouped_mm", None)
    # transformers' value checks (torch_compilable_check: a vision-language model's image tokens against its image
    # features) read a fake tensor's value; transformers' own switch turns them off (utils/import_utils.py). On the
    # device they make a scalar or two (a 512-byte block each), not counted
    import os

    real_check = os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    try:
        if real_can_grouped is not None:
            moe._can_use_grouped_mm = lambda *a, **k: False
        if real_grouped is not None:
            moe._grouped_mm = sub.grouped_mm()
        if attention in ("flash", "sdpa"):
            F.scaled_dot_product_attention = sub.sdpa(real_sdpa, target, kernels, cp, compiled)
        if target.device == "cuda":
            F.dropout = sub.cuda_dropout(compiled)
        if linear == "deepspeed-zero3":
            F.linear = sub.deepspeed_zero3_linear("cpu")  # the traced tensors are (fake) CPU tensors
        if real_packed is not None:
            mu.find_packed_sequence_indices = lambda position_ids: None
        for k, real in real_skips.items():
            if real is not None:
                setattr(mu, k, (lambda real: lambda padding_mask, *a, **kw: real(None, *a, **kw))(real))
        from memplan.activations.tracing.grids import constant_inputs

        with constant_inputs(config), sub.balanced_topk_gating(config):
            # a Qwen-VL step reads its inputs' values (tracing/grids.py); JetMoE's router its expert counts
            yield
    finally:
        if real_check is None:
            os.environ.pop("TRANSFORMERS_DISABLE_TORCH_CHECK", None)
        else:
            os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = real_check
        fake_log.setLevel(fake_level)
        transformers.logging.set_verbosity(tf_level)
        F.scaled_dot_product_attention, F.dropout, F.linear = real_sdpa, real_dropout, real_linear
        if real_packed is not None:
            mu.find_packed_sequence_indices = real_packed
        for k, real in real_skips.items():
            if real is not None:
                setattr(mu, k, real)
        if real_can_grouped is not None:
            moe._can_use_grouped_mm = real_can_grouped
        if real_grouped is not None:
            moe._grouped_mm = real_grouped


@contextlib.contextmanager
def fake_module_conversion() -> Any:
    """A model built of fake tensors converts its modules as a real one does: a constructor's ``module.to(dtype)``
    (DeepSeek-V4's fp32 norms, a short convolution's) swaps each fake parameter for its converted copy
    (torch/nn/modules/module.py _apply: swap_tensors for a FakeTensor), which torch refuses for a tensor with
    weakrefs, and a fake tensor has them. Where the swap is refused, each parameter and buffer is replaced by its
    converted copy (Module._apply's overwrite branch) and one already converted is left as it is: the module then
    holds what the real one holds."""
    import torch

    real = torch.nn.Module._apply

    def apply(self: Any, fn: Any, recurse: bool = True) -> Any:
        try:
            return real(self, fn, recurse)
        except RuntimeError as exc:
            if "Couldn't swap" not in str(exc):
                raise
        for mod in (self.modules() if recurse else [self]):
            for key, p in list(mod._parameters.items()):
                if p is not None:
                    with torch.no_grad():
                        new = fn(p)
                    if new is not p:
                        mod._parameters[key] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
            for key, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[key] = fn(b)
        return self

    torch.nn.Module._apply = apply
    try:
        yield
    finally:
        torch.nn.Module._apply = real


def record_block_inputs(blocks: list[Any]) -> set[str]:
    """The dtypes of the floating-point tensors the blocks are given (args and kwargs), filled as they run: where
    all are the computing dtype, FSDP2's cast of each unit's inputs (cast_block_inputs) copies nothing."""
    import torch
    from torch.utils._pytree import tree_leaves

    seen: set[str] = set()

    def hook(_module: Any, args: Any, kwargs: Any) -> None:
        seen.update(str(x.dtype).removeprefix("torch.") for x in tree_leaves((args, kwargs))
                    if isinstance(x, torch.Tensor) and torch.is_floating_point(x))

    for b in blocks:
        b.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def cast_block_inputs(blocks: list[Any], dtype: Any) -> None:
    """Each block's floating-point inputs cast to ``dtype`` as it is entered, as FSDP2's pre-forward hook does for
    every fully_shard'ed module under MixedPrecisionPolicy(param_dtype=...) with cast_forward_inputs (its default):
    torch/distributed/fsdp/_fully_shard/_fsdp_state.py _cast_forward_inputs, _fsdp_common.py _cast_fp_tensor (a
    floating tensor of another dtype is copied, args and kwargs alike). A block given fp32 tensors (Qwen-VL's vision
    rotary cos and sin) then holds its own bf16 copies, and what it upcasts from them is its own too. Recomputed
    blocks cast again, as the hook runs again under activation checkpointing."""
    import torch
    from torch.utils._pytree import tree_map

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    def hook(_module: Any, args: Any, kwargs: Any) -> Any:
        return tree_map(cast, args), tree_map(cast, kwargs)

    for b in blocks:
        b.register_forward_pre_hook(hook, with_kwargs=True)


class _BlockMoments:
    """When each block's forward and backward begin and end, as timeline indices (and event indices, for the
    allocator replay): the moments FSDP and ZeRO-3 gather, reshard and reduce at."""

    def __init__(self, live: LiveBytes) -> None:
        self.live = live
        #: live bytes and timeline index when each block's forward begins, and the index when it ends (its
        #: first call: not a recomputation in backward)
        self.forward_starts: dict[int, tuple[int, int]] = {}
        self.forward_ends: dict[int, int] = {}
        #: timeline index at which the gradient of each block's input is complete: the block's backward is
        #: over (all its nodes ran and released what they saved). FSDP's post-backward hook (reduce) fires
        #: then: FSDP2 applies RegisterPostBackwardFunction to the block's inputs
        #: (torch/distributed/fsdp/_fully_shard/_fsdp_state.py _pre_forward), FSDP1 hooks the same moment.
        self.backward_ends: dict[int, int] = {}
        #: timeline index at which the gradient of each block's output is complete: its backward begins.
        #: FSDP2's pre-backward (unshard) is a hook on the block's outputs (_fsdp_state.py
        #: _register_pre_backward_hook: t.register_hook(self._pre_backward)); DeepSpeed ZeRO-3 gathers at the
        #: same moment (PreBackwardFunctionForModule applied to the outputs). For the last block that is after
        #: the final norm's whole backward, not at its weight's gradient.
        self.backward_starts: dict[int, int] = {}
        #: the same moments as indices into live.events (fs, fe: forward start, end; bs, be: backward)
        self.regions: dict[str, Any] = {"fs": {}, "fe": {}, "bs": {}, "be": {}}

    def _at_grad(self, x: Any, i: int, timeline: dict[int, int], region: str) -> None:
        import torch

        if isinstance(x, torch.Tensor) and x.requires_grad:
            def hook(_grad: Any) -> None:
                self.live.tick()
                timeline.setdefault(i, len(self.live.timeline) - 1)
                self.regions[region].setdefault(i, len(self.live.events))
            x.register_hook(hook)

    def note_start(self, i: int) -> Any:
        def hook(_mod: Any, args: Any, kwargs: Any) -> None:
            if i in self.forward_starts:
                return  # a recomputation in backward
            self.forward_starts[i] = (self.live.live, len(self.live.timeline))
            self.regions["fs"][i] = len(self.live.events)
            self._at_grad(args[0] if args else kwargs.get("hidden_states"), i, self.backward_ends, "be")
        return hook

    def note_end(self, i: int) -> Any:
        def hook(_mod: Any, _args: Any, out: Any) -> None:
            if i in self.forward_ends:
                return  # a recomputation in backward
            self.forward_ends[i] = len(self.live.timeline)
            self.regions["fe"][i] = len(self.live.events)
            y = out[0] if isinstance(out, (tuple, list)) and out else out
            self._at_grad(y, i, self.backward_starts, "bs")
        return hook

    def install(self, blocks: list[Any]) -> None:
        for i, blk in enumerate(blocks):
            blk.register_forward_pre_hook(self.note_start(i), with_kwargs=True)
            blk.register_forward_hook(self.note_end(i))

    def install_experts(self, blocks: list[Any]) -> None:
        """Where each block's expert-parallel experts module (substitutes.expert_parallel) runs, as event indices:
        its forward's start and end ("xfs", "xfe": FSDP2's pre- and post-forward of the experts' own unit, which
        fully_shard hooks on the module's forward) and its backward's ("xbs": the gradient of its output complete,
        FSDP2's pre-backward hook on the outputs; "xbe": the gradients of all its inputs complete, when
        RegisterPostBackwardFunction, applied to the forward's inputs, runs the unit's post-backward:
        torch/distributed/fsdp/_fully_shard/_fsdp_state.py _register_pre_backward_hook,
        _fsdp_param_group.py _register_post_backward_hook); a recomputation's start and end in backward ("xrs",
        "xre": the unit, idle then, unshards in its _pre_forward and reshards in its _post_forward)."""
        import torch

        moments = self

        class PostBackward(torch.autograd.Function):
            """RegisterPostBackwardFunction's place: the forward's inputs passed through unchanged, its backward
            run once all their gradients from inside the module are in (not their other uses': the router's)."""

            @staticmethod
            def forward(ctx: Any, i: int, *inputs: Any) -> Any:
                ctx.block = i
                return inputs

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                moments.regions["xbe"].setdefault(ctx.block, len(moments.live.events))
                return (None, *grads)

        for key in ("xfs", "xfe", "xbs", "xbe", "xrs", "xre"):
            self.regions[key] = {}
        for i, blk in enumerate(blocks):
            mod = next((m for m in blk.modules() if getattr(m, "memplan_expert_parallel", False)), None)
            if mod is None:
                continue

            def start(_mod: Any, args: Any, kwargs: Any, i: int = i) -> Any:
                if i in self.regions["xfs"]:  # its recomputation in backward
                    self.regions["xrs"].setdefault(i, len(self.live.events))
                    return None
                self.regions["xfs"][i] = len(self.live.events)
                pos = [k for k, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
                if not pos:
                    return None
                through = PostBackward.apply(i, *(args[k] for k in pos))
                new = list(args)
                for k, x in zip(pos, through):
                    new[k] = x
                return tuple(new), kwargs

            def end(_mod: Any, _args: Any, out: Any, i: int = i) -> None:
                if i in self.regions["xfe"]:
                    self.regions["xre"].setdefault(i, len(self.live.events))
                    return
                self.regions["xfe"][i] = len(self.live.events)
                y = out[0] if isinstance(out, (tuple, list)) and out else out
                if isinstance(y, torch.Tensor) and y.requires_grad:
                    def pre_backward(_grad: Any, i: int = i) -> None:
                        self.regions["xbs"].setdefault(i, len(self.live.events))
                    y.register_hook(pre_backward)

            mod.register_forward_pre_hook(start, with_kwargs=True)
            mod.register_forward_hook(end)


class _GradientHooks:
    """Each parameter's gradient, taken out of the activations when it is accumulated (the strategy accounts for
    gradients), with where it was made and where its hook ran."""

    def __init__(self, live: LiveBytes, block_of: dict[int, int]) -> None:
        self.live, self.block_of = live, block_of
        #: (timeline index at which the gradient was created, block index or -1, numel), per parameter
        self.grads: list[tuple[int, int, int]] = []
        #: per entry of grads: the timeline index from which its post-accumulate hook has run (a strategy
        #: that takes each gradient in that hook, as ZeRO does, holds it only until then)
        self.hooked: list[int] = []
        #: per entry of grads: the timeline index of its hook's own moment
        self.hook_points: list[int] = []
        #: per parameter used more than once (a tied embedding): its first gradient contribution (see
        #: first_contributions)
        self.first_contrib: dict[int, list[Any]] = {}
        self.root_firsts: list[tuple[int, int]] = []
        #: a tied weight's first contribution where it is not the gradient's own storage: (from, to, numel)
        self.partials: list[tuple[int, int, int]] = []
        #: the parameters whose gradient was accumulated (the others get none: no loss reads them)
        self.reached: set[int] = set()

    def drop(self, p: Any) -> None:
        live = self.live
        self.reached.add(id(p))
        # the hook's own moment (a strategy's hook works here: ZeRO reduces, DeepSpeed's offload takes the
        # norm): activations then, the gradient itself taken out below
        live.tick()
        hook_at = len(live.timeline) - 1
        first = self.first_contrib.get(id(p))
        if first is not None and first[0] is not None and first[0]() is not p.grad.untyped_storage():
            # gradient bytes from the head's backward on, not activations (in place or not, see above)
            end = first[2] if first[2] is not None else len(live.timeline)
            live.not_activation_between(first[1], end, first[3])
            self.partials.append((first[1], end, p.grad.numel()))
            if first[1] is not None:
                # the loss segment counts a tied weight's gradient from its first contribution on; where the
                # engine added the later contributions into it in place, the gradient is that storage, born
                # then, and counted once as itself (T5 under torch-amp, once its shared embedding is tied)
                self.root_firsts.append((first[1], p.grad.numel()))
        live.mark_grad(p.grad, self.block_of.get(id(p), -1))
        born = live.not_activation(p.grad)
        if born is not None:
            self.grads.append((born, self.block_of.get(id(p), -1), p.grad.numel()))
            self.hooked.append(len(live.timeline) + 1)
            self.hook_points.append(hook_at)
        p.grad = None


def one_step(config: dict[str, Any], batch: int, seq: int, recipe: str, attention: str,
             recompute: str, target: Target | None = None, linear: str = "aten") -> dict[str, Any]:
    """Trace one micro-step of ``batch`` sequences of ``seq`` tokens for ``target``: the live-bytes timeline, op by
    op (memplan/activations/substitutes.py: what runs in place of the fake CPU tensors' kernels)."""
    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes
    from memplan.activations.profile import checkpoint_every
    from memplan.model import tasks
    from memplan.model.meta_builder import checkpointing_on, hf_config

    dtype, autocast = trace_dtypes(recipe)
    from memplan.model.hf import INPUT_DTYPE_KEY

    # an image's pixels in the stored parameters' dtype where it is not the traced one's (model/hf.py)
    input_dtype = config.get(INPUT_DTYPE_KEY) or dtype
    lora = config.get("lora")
    if lora is not None:
        config = {k: v for k, v in config.items() if k != "lora"}
    from memplan.model.hf import FROZEN_KEY

    frozen = config.get(FROZEN_KEY)
    ep, cp, compile_mode = config.get(EP_KEY, 1), config.get(CP_KEY, 1), config.get(COMPILE_KEY, "none")
    ddp_bucket, float8 = config.get(COMPILE_DDP_KEY), config.get(FLOAT8_KEY)
    if any(k in config for k in (EP_KEY, CP_KEY, COMPILE_KEY, COMPILE_DDP_KEY, FLOAT8_KEY)):
        config = {k: v for k, v in config.items()
                  if k not in (EP_KEY, CP_KEY, COMPILE_KEY, COMPILE_DDP_KEY, FLOAT8_KEY)}
    target = target or Target(device="cuda")
    cuda = target.device == "cuda"
    held: list[Any] = []  # an image task's inputs, alive through the step (dropped after its backward)
    kernels: dict[str, str] = {}
    # a GPU job's autocast is CUDA's (substitutes.CudaAutocast), on the CPU tensors the trace runs
    policy = sub.CudaAutocast("bfloat16") if cuda and autocast else contextlib.nullcontext()
    with _substitutions(config, dtype, attention, target, linear, kernels, cp, compile_mode != "none"), \
            FakeTensorMode(allow_non_fake_inputs=True), policy:
        if user_module.is_user_module(config):  # the user's own module (a factory)
            model, user_blocks, run = user_module.build(config, batch, seq, dtype, recompute)
        else:
            # a head other than a causal LM's is built without its weights' initialisation: some initialise with
            # data-dependent ops (ViT's trunc_normal_ reads .item()) that fake tensors cannot run; the values do not
            # change the bytes, and the construction is outside the traced step
            from transformers.initialization import no_init_weights

            quiet = contextlib.nullcontext()
            if tasks.task_of(config) != tasks.CAUSAL_LM:
                quiet = no_init_weights()
            build_kw = dict(dtype=getattr(torch, dtype), attn_implementation="eager" if attention == "eager" else "sdpa")
            try:
                with quiet, fake_module_conversion():
                    model = tasks.build(config, hf_config(tasks.trace_config(config)), **build_kw)
            except DataDependentOutputException:  # a causal LM initialised so too (ModernBERT-decoder's trunc_normal_)
                with no_init_weights(), fake_module_conversion():
                    model = tasks.build(config, hf_config(tasks.trace_config(config)), **build_kw)
            # transformers 5.24 ties the embeddings in its weights' initialisation, which no_init_weights skips: a
            # model built under it holds its tied weights apart (BART's shared embedding as four parameters,
            # Gemma 3's head beside its embedding), so they are tied again, as the job's model has them
            model.tie_weights()
            if attention != "eager" and not tasks.sdpa_supported(config):
                kernels.setdefault("eager", "the model has no SDPA attention: transformers runs its eager attention, "
                                            "which keeps each layer's probabilities")
            ep, ep_tp = (ep, 1) if isinstance(ep, int) else ep
            if ep > 1 and not sub.expert_parallel(model, ep, ep_tp):  # an EP rank: its experts, via AllToAllEP
                raise ValueError("no fused experts module (.experts with 3-D gate_up_proj) to split over --ep")
            if checkpoint_every(recompute):
                checkpointing_on(model, recompute)
            user_blocks, ids = None, torch.zeros(batch, seq, dtype=torch.long)
            task = tasks.task_of(config)
            if task in (tasks.IMAGE, tasks.IMAGE_TEXT):
                # the image is made in the step, so that its bytes are counted (token ids are a few bytes a token,
                # a batch of images is not), and held to the end of the backward, as a training loop holds its
                # batch through the step (the Trainer's `inputs`, the CPU harness's step loop): a frozen vision
                # tower's pixels, which nothing saves, are alive at the peak (docs/accuracy.md's frozen-vision rows)
                def run(m: Any) -> Any:
                    held[:] = [tasks.step_inputs(task, config, ids, getattr(torch, input_dtype))]
                    return m(**held[0]).loss
            else:
                step_inputs = tasks.step_inputs(task, config, ids, getattr(torch, input_dtype))
                run = (lambda m: m(**step_inputs).loss)  # noqa: E731
        if float8:  # torchao's Float8Linear in place of the eligible nn.Linear (tracing/float8.py)
            from memplan.activations.tracing.float8 import convert

            convert(model, float8, cuda_autocast=cuda and autocast)
        if lora is not None:  # PEFT's adapters, after gradient checkpointing as a Trainer enables it
            from memplan.activations.tracing.lora import inject, quantize

            if lora.get("quantize"):  # QLoRA: the 4-bit base transformers loads, before PEFT adds adapters
                quantize(model, lora, cuda)
            inject(model, lora, str(config.get("model_type") or ""))
        if frozen:  # --freeze (model/freeze.py): no gradients, and what reads only frozen inputs saves nothing
            from memplan.model.freeze import requires_grad_off

            requires_grad_off(model, frozen)
        model.train()
        params = list(model.parameters())
        block_of, block_list = block_index(model, user_blocks)
        from memplan.model.hf import BLOCK_INPUT_CAST_KEY

        block_floats = record_block_inputs(block_list)  # what FSDP2's cast of each unit's inputs would copy
        if config.get(BLOCK_INPUT_CAST_KEY):  # FSDP2's MixedPrecisionPolicy casts each unit's inputs (model/hf.py)
            cast_block_inputs(block_list, getattr(torch, config[BLOCK_INPUT_CAST_KEY]))
        if float8 and float8.endswith(FLOAT8_GATHERED):  # FSDP2's float8 weights, handed over at each block's start
            from memplan.activations.tracing.float8 import hand_over

            hand_over(block_list)
        stack = ModuleStack(model)
        stack.install()
        compiled = contextlib.ExitStack()
        try:
            if compile_mode != "none":
                # compiled, then one step untracked: the tracked step runs compiled code as a job's later steps do
                # (the first step's compilation keeps references to that step's inputs: tracing/compiled.py)
                compiled.enter_context(compiling(block_list, compile_mode, ddp_bucket))
                warm_up(model, run, params, autocast)
                held.clear()
            live = LiveBytes(K.CUDA_BLOCK if cuda else 1)
            for t in params + list(model.buffers()):
                live.ignore(t)
            # parameters, and the float8 weights FSDP2 would gather (tracing/float8.py): the strategy counts them
            gathered = [b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith("memplan_float8")]
            param_storages = {id(t.untyped_storage()) for p in params + gathered for t in plain_tensors(p)}
            moments = _BlockMoments(live)
            moments.install(block_list)
            if (ep if isinstance(ep, int) else ep[0]) > 1:  # an EP rank's (a TP x EP rank's: [ep, tp])
                moments.install_experts(block_list)
            hooks = _GradientHooks(live, block_of)
            for p in params:
                if p.requires_grad:  # a frozen parameter (LoRA) gets no gradient
                    p.register_post_accumulate_grad_hook(hooks.drop)
            saved: dict[int, int] = {}
            saved_ids: set[int] = set()
            live.labeler = stack.label

            def pack(t: Any) -> Any:
                for inner in plain_tensors(t):  # a tensor subclass (torchao's float8 weight) saves its inner tensors
                    st = inner.untyped_storage()
                    if id(st) not in param_storages:
                        saved.setdefault(id(st), live.nbytes(st))
                        sid = live._sid.get(id(st))
                        if sid is not None:
                            saved_ids.add(sid)
                # detached: a packed tensor that is its node's own output would hold its grad_fn, and so the node,
                # in a reference cycle that only Python's collector breaks; autograd's own SavedVariable saves an
                # output without its grad_fn (no cycle), so a branch no loss reads (LLaVA's last vision layer) is
                # freed as soon as its outputs are (the cycle held that layer's saved tensors through the step: the
                # llava-tiny rows of docs/accuracy.md at commit 58db21e, +2.15% with its unread layer's optimizer
                # states counted too; -0.02% now, python bench/accuracy.py --repredict). Detached with the modes off: the detach
                # allocates nothing, and a storage made before the step (the token ids) must not be followed from
                # it as a new one
                with _disable_current_modes():
                    return t.detach()

            accumulate = Accumulations()
            probe = LiveBytes(live.block)
            accumulate.calibrate(dispatch_mode(probe, accumulate=accumulate), probe)
            with dispatch_mode(live, None if cuda else sub.gemm_scratch(target.cpu_isa, target.cpu_threads),
                               sub.cuda_scratch(target.gpu) if cuda else None, accumulate):
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = run(model)
                live.tick()
                forward_end = len(live.timeline)
                moments.regions["forward_end"] = len(live.events)
                live.phase = "b"  # the backward's ops run on autograd's device thread, with its own cuBLAS handle
                after_forward = live.live
                first_contributions(loss, live, hooks.first_contrib)
                accumulate.hook(loss, live)
                loss.backward()
                live.tick()
                # a block whose input needs no gradient (the first one under LoRA: the frozen embedding's output)
                # gets no hook on it; its backward is over when the whole backward is (nothing runs below it)
                # a block whose output no loss reads (LLaVA's last vision layer under vision_feature_layer -2) gets
                # no gradient and has no backward: it begins where it ends
                for i in range(len(block_list)):
                    moments.regions["be"].setdefault(i, len(live.events))
                    moments.regions["bs"].setdefault(i, moments.regions["be"][i])
                del loss
                held.clear()
            live.ready_order()
        finally:
            compiled.close()
            stack.remove()
        names = {id(m): n for n, m in model.named_modules()}
        # parameters that require a gradient and got none: no loss reads them (a decoder's cross-attention with no
        # encoder, Mllama's cross-attention layers without images, DeepSeek-V3.2's indexer behind its top-k)
        unreached = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in hooks.reached]
    out = _result(live, moments, hooks, kernels, sum(saved.values()), after_forward, forward_end, len(block_list))
    out["counts"] = _counts(live, moments, hooks, len(saved), forward_end, len(block_list))
    out["block_float_inputs"] = sorted(block_floats)
    out["unreached"] = unreached
    out["origins"] = {"origins": live.origins, "grads": live.grad_ids, "saved": saved_ids,
                      "blocks": [names.get(id(b), "") for b in block_list],
                      "last_backward_start": moments.backward_starts.get(len(block_list) - 1),
                      "timeline": live.corrected()}
    return out


def backward_grads(timeline: list[int], h: _GradientHooks, forward_end: int) -> list[list[int]]:
    """Every point of the backward as [live bytes, gradient elements made by then, 0]: each gradient from its
    creation on (one GPU and DDP keep them as autograd makes them until the step), a tied weight's first
    contribution from the head's backward to where its sum replaces it. Where the blocks differ (two stacks) the
    most alive with its gradients need not fall inside a block at all: BART's shared embedding accumulating its
    decoder contribution, the encoder's activations all saved and the decoder's gradients all made."""
    sizes = sorted((born, n) for born, _, n in h.grads)
    out = []
    made = k = 0
    for t in range(forward_end - 1, len(timeline)):
        while k < len(sizes) and sizes[k][0] <= t:
            made += sizes[k][1]
            k += 1
        part = sum(n for a, b, n in h.partials if a <= t < b)
        out.append([timeline[t], made + part, 0])
    return out


def _counts(live: LiveBytes, m: _BlockMoments, h: _GradientHooks, saved: int, forward_end: int,
            nblocks: int) -> dict[str, Any]:
    """The storages alive at the same points as _result's bytes (the same readers over the count timeline):
    how many allocator blocks each point's bytes are made of, at most (memplan/activations/profile_fit.py)."""
    counts = live.counts
    blocks = block_segments(counts, h.grads, forward_end, m.backward_ends, h.hooked, m.backward_starts)
    last_start = m.forward_starts.get(nblocks - 1, (0, 0))
    return {"saved": saved, "live": counts[forward_end - 1], "forward": counts[:forward_end],
            "backward": counts[forward_end - 1:], "blocks": [[p[0] for p in seg] for seg in blocks],
            "backward_grads": counts[forward_end - 1:],
            "hooks": [[p[0] for p in hk] for hk in block_hooks(counts, h.grads, h.hook_points)],
            "root_hooks_done": root_hooks_done(counts, h.grads, h.hook_points, forward_end, m.backward_starts),
            "root_first_hook": first_hook_at(counts, h, forward_end, m),
            "loss_backward": [p[0] for p in loss_segment(counts, h.grads, h.root_firsts, forward_end, blocks,
                                                         m.backward_starts)],
            "last_block_forward_start": max(counts[max(0, last_start[1] - 1):last_start[1] + 1] or [0]),
            "last_block_forward": counts[last_start[1]:m.forward_ends.get(nblocks - 1, 0) + 1]}


def first_hook_at(timeline: list[int], h: _GradientHooks, forward_end: int, m: _BlockMoments) -> list[int] | None:
    """[timeline value, gradient elements outside the blocks made so far] at the backward's first gradient hook
    (segments.root_first_hook), or None."""
    hit = root_first_hook(timeline, h.grads, h.hook_points, h.root_firsts, forward_end, m.backward_starts)
    return None if hit is None else list(hit)


def _result(live: LiveBytes, m: _BlockMoments, h: _GradientHooks, kernels: dict[str, str], saved: int,
            after_forward: int, forward_end: int, nblocks: int) -> dict[str, Any]:
    """The traced step read at its moments (memplan/activations/tracing/segments.py)."""
    timeline = live.corrected()
    blocks = block_segments(timeline, h.grads, forward_end, m.backward_ends, h.hooked, m.backward_starts)
    last_start = m.forward_starts.get(nblocks - 1, (0, 0))
    return {"saved": saved, "live": after_forward, "forward": timeline[:forward_end],
            "backward": timeline[forward_end - 1:],
            "blocks": blocks, "backward_grads": backward_grads(timeline, h, forward_end),
            "hooks": block_hooks(timeline, h.grads, h.hook_points),
            "root_hooks_done": root_hooks_done(timeline, h.grads, h.hook_points, forward_end, m.backward_starts),
            "root_first_hook": first_hook_at(timeline, h, forward_end, m),
            "loss_backward": loss_segment(timeline, h.grads, h.root_firsts, forward_end, blocks, m.backward_starts),
            "attention_kernels": kernels,
            "events": live.events, "regions": m.regions, "blas": dict(live.blas),
            "last_block_forward_start": last_start[0],
            "last_block_forward": timeline[last_start[1]:m.forward_ends.get(nblocks - 1, 0) + 1]}


def block_index(model: Any, blocks: list[Any] | None = None) -> tuple[dict[int, int], list[Any]]:
    """id(parameter) -> index of the decoder block that owns it (the longest ModuleList of the model, or the
    ``blocks`` given: the unit FSDP and DeepSpeed wrap; parameters outside it are not in the map), and the
    blocks."""
    import torch

    if blocks is not None:
        return {id(p): i for i, blk in enumerate(blocks) for p in blk.parameters()}, list(blocks)
    if getattr(model, "_no_split_modules", None):
        # transformers' blocks, as the inventory takes them (meta_builder.block_modules): an encoder-decoder's two
        # stacks, encoder first; their backward runs in the reverse order
        from memplan.model.meta_builder import block_modules

        found = block_modules(model)
        if found:
            return {id(p): i for i, blk in enumerate(found) for p in blk.parameters()}, found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return {}, []
    blocks = max(lists, key=len)
    return {id(p): i for i, blk in enumerate(blocks) for p in blk.parameters()}, list(blocks)


def first_contributions(loss: Any, live: LiveBytes, out: dict[int, list[Any]]) -> None:
    """Hooks the first gradient contribution to each parameter the graph reaches more than once (a tied
    embedding: the head's matmul, then the embedding). Its bytes are gradient bytes from the head's backward to
    the end, which the strategy accounts for (the head's grads), not activations. The real engine adds the later
    contributions into the first in place where it can steal the buffer (torch/csrc/autograd/input_buffer.cpp,
    accumulate), so the first contribution becomes the gradient: gpt2 under torch-amp, where the profiler shows
    the embedding's 2 MB contribution freed right after its add and no new storage; where it cannot (measured
    with a bf16 weight, or an fp32 weight without autocast) it adds out of place at the end, and the first
    contribution lives until then. A fake-tensor run adds in place only where tracing/accumulate.py redoes the
    engine's choice (a tensor subclass is never stolen); out of place, the first contribution would stay in the
    timeline as an activation until the end.
    ``out[id(param)]`` = [storage weakref, birth, death, bytes, data_ptr (real tensors only)]."""
    from torch._subclasses.fake_tensor import FakeTensor

    incoming: dict[Any, list[tuple[Any, int]]] = {}
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for i, (nxt, _) in enumerate(fn.next_functions):
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):  # AccumulateGrad: a leaf
                incoming.setdefault(nxt, []).append((fn, i))
            else:
                stack.append(nxt)
    for acc, edges in incoming.items():
        if len(edges) < 2:
            continue
        key = id(acc.variable)

        def hook(grad_inputs: Any, _grad_outputs: Any, pos: int = 0, key: int = key) -> None:
            g = grad_inputs[pos]
            if g is None or key in out:
                return
            st = g.untyped_storage()
            rec = [None, live._born.get(id(st), len(live.timeline)), None, live.nbytes(st),
                   None if isinstance(g, FakeTensor) else g.data_ptr()]

            def died(_ref: Any, rec: list[Any] = rec) -> None:
                rec[2] = len(live.timeline)

            rec[0] = weakref.ref(st, died)
            out[key] = rec
            live.mark_contribution(g)

        for fn, i in edges:
            fn.register_hook(lambda gi, go, i=i, h=hook: h(gi, go, pos=i))
