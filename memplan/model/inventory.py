"""ParamInventory: every parameter tensor of a model, not just a count.

Sharding is per tensor (FSDP2 pads each parameter's dim 0 to the shard count, ZeroRedundancyOptimizer assigns
whole tensors, ZeRO-3 keeps tensors below a threshold whole, gather buffers are sized by the largest block), so
the accounting needs the list of tensors, the block that owns each one (the unit FSDP would wrap: a decoder
layer, or the root for embeddings / final norm / head) and which names alias the same storage (tied weights,
counted once).

This module is pure Python: it imports neither torch nor transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from math import prod

from memplan.units import dtype_bytes

ROOT_BLOCK = ""  # owner of parameters outside every wrapped block (embeddings, final norm, head)
#: ParamTensor.unit's prefix for units of a job the FSDP models take as the root alone (model/wrap_units.py)
HELD_UNIT = "<held>/"

CATEGORIES = ("embedding", "attention", "mlp", "experts", "router", "norm", "head", "other")

#: the output head's module names (a tied embedding's alias among them ties it to the head)
HEAD_PREFIXES = ("lm_head.", "embed_out.", "output.")

_ROUTER_RE = re.compile(r"(\.gate\.weight$|shared_expert_gate\.)")


def classify(name: str) -> str:
    """Category of a parameter from its fully qualified name (shared by every builder)."""
    last = name.rsplit(".", 2)
    leaf = ".".join(last[-2:]) if len(last) >= 2 else name
    low = name.lower()
    if "embed_tokens" in low or "embed_in" in low or leaf.startswith(("wte.", "wpe.", "word_embeddings.")) or \
            ".embeddings." in low or low.startswith("embeddings."):
        return "embedding"
    if low.startswith(HEAD_PREFIXES):
        return "head"
    parts = low.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if "norm" in module or module.startswith("ln") or module.endswith("_ln"):
        return "norm"
    if _ROUTER_RE.search(low):
        return "router"
    if ".experts." in low:
        return "experts"
    if "mlp" in low or "feed_forward" in low or ".ffn" in low or "shared_expert" in low:
        return "mlp"
    if "attn" in low or "attention" in low:
        return "attention"
    return "other"


@dataclass(frozen=True, slots=True)
class ParamTensor:
    """One parameter tensor."""

    name: str  #: fully qualified name of its first occurrence (module order)
    shape: tuple[int, ...]
    dtype: str  #: stored dtype (config torch_dtype or the checkpoint's header); training dtypes come from the recipe
    block: str  #: owning block, ROOT_BLOCK for the root
    category: str  #: one of CATEGORIES
    tied_names: tuple[str, ...] = ()  #: other names that alias this same storage
    #: the layer class that holds it where the builder knows it: "linear" (nn.Linear, weight [out, in]), "conv1d"
    #: (transformers' Conv1D, weight [in, out]), "embedding"; "" otherwise (what LoRA may target: model/lora.py)
    layer: str = ""
    #: requires_grad: False for a frozen base weight under LoRA (no gradient, no optimizer state)
    trainable: bool = True
    #: requires_grad, but no loss reads it, so no gradient reaches it in the step (the traced step:
    #: Settings.unreached): trainable is then False where the framework makes it no gradient and no state
    #: (one GPU, DDP, FSDP2: frameworks.with_unreached), and DDP still buckets it
    unused: bool = False
    #: the FSDP unit that holds it where a size-based wrap policy makes units other than the blocks
    #: (model/wrap_units.py: the unit's module path, "<root>" for the root); "" otherwise: the block is the unit
    unit: str = ""
    #: expert parallelism (memplan/parallel/degrees.py Parallel.ep): the tensor is already split this many ways across the
    #: data-parallel group (whole experts per EP rank), so its FSDP shard group is that group's size / shard_split
    #: (torchtitan's dp_shard_mod_ep mesh, transformers' efsdp); 1 otherwise
    shard_split: int = 1
    #: QLoRA with a float bnb_4bit_quant_storage (model/lora.py quantize_base): this frozen parameter is the
    #: packed 4-bit storage of a linear weight of this many elements; 0 otherwise
    packs: int = 0

    @property
    def numel(self) -> int:
        return prod(self.shape) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    @property
    def group(self) -> str:
        """The block it is gathered with: its block, or the root group when its FSDP unit lies above the blocks
        (a size-based unit around the decoder stack, or the root)."""
        if not self.unit or self.unit.startswith(HELD_UNIT) or (
                self.block != ROOT_BLOCK and (self.unit == self.block or self.unit.startswith(self.block + "."))):
            return self.block
        return ROOT_BLOCK

    @property
    def module(self) -> str:
        """Path of the module that holds this parameter (what DeepSpeed ZeRO-3 gathers by hooks)."""
        return self.name.rpartition(".")[0]


@dataclass(frozen=True)
class BlockInfo:
    name: str
    num_tensors: int
    numel: int


@dataclass(frozen=True)
class ParamInventory:
    """Every parameter tensor of one model, in module order, tied weights once."""

    model_name: str
    source: str  #: where the model came from ("preset gpt2", "config /x/config.json", ...)
    builder: str  #: "analytic" (from the config, no torch) or "meta" (instantiated on the meta device)
    family: str  #: model_type or the module's class
    tensors: tuple[ParamTensor, ...]
    notes: tuple[str, ...] = ()
    #: Model dimensions the activation and buffer terms need (hidden size, layers, vocab, ...), when known.
    dims: dict = field(default_factory=dict, compare=False)
    #: a 4-bit base (QLoRA, model/lora.py): the bitsandbytes storage of each quantized linear weight (packed
    #: uint8 and its quantisation state) in its own dtypes. Frozen, kept whole on every rank and never cast by a
    #: recipe; the float tensors above no longer hold those weights
    quantized: tuple[ParamTensor, ...] = ()
    quantized_params: int = 0  #: the elements those weights had before quantization
    #: the head the job trains (model/tasks.py: causal-lm, masked-lm, sequence-classification, ...)
    task: str = "causal-lm"
    #: the model class's _keep_in_fp32_modules (T5's "wo"): module-name patterns that transformers' quantizers
    #: never convert (quantizers/base.py get_modules_to_not_convert)
    keep_fp32_modules: tuple[str, ...] = ()
    #: the module paths --freeze froze (model/freeze.py): their parameters are not trainable
    frozen_paths: tuple[str, ...] = ()
    #: the model's buffers (named_buffers: persistent or not, M2M100's sinusoidal position tables, the rotary
    #: inv_freq), in module order, floating ones as built in fp32. On the device whole on every rank under every
    #: strategy: DDP broadcasts them, FSDP (fully_shard's _move_states_to_device; FSDP1 does not flatten them)
    #: and ZeRO-3 (zero.Init partitions parameters only) keep them whole, and offload moves parameters only
    buffers: tuple[ParamTensor, ...] = ()
    #: LoRA on parameters (PEFT's target_parameters, lora.ParamWrapper; model/lora.py): the base parameters, by
    #: their names before PEFT, whose module each forward folds the adapters into a full copy of
    param_adapted: tuple[str, ...] = ()

    def buffer_bytes(self, half: bool, block: int = 1) -> int:
        """Bytes of the buffers on a rank: floating ones in 16 bits where the model is converted to or loaded in a
        half dtype (``half``: Recipe.half_buffers; Module._apply casts floating buffers with the parameters), the
        others (int64 position_ids, bool masks) as built; each rounded up to ``block`` bytes (the CUDA caching
        allocator's 512-byte blocks: a rotary inv_freq of 64 fp32 takes 512)."""
        return sum(-(-n // block) * block for n in self.buffer_sizes(half))

    def buffer_sizes(self, half: bool) -> tuple[int, ...]:
        """Each buffer's bytes on a rank, in order (buffer_bytes)."""
        return tuple(t.numel * 2 if half and t.dtype == "float32" else t.nbytes for t in self.buffers)

    @cached_property
    def numels(self) -> tuple[int, ...]:
        """Each tensor's elements, in order (computed once: the layouts read them for every GPU count)."""
        return tuple(t.numel for t in self.tensors)

    @cached_property
    def num_params(self) -> int:
        return sum(self.numels)

    @cached_property
    def adapter_params(self) -> int:
        """Elements of LoRA adapter weights (lora_A, lora_B: what PEFT upcasts on a half-precision base)."""
        return sum(t.numel for t in self.tensors if ".lora_A." in t.name or ".lora_B." in t.name)

    @cached_property
    def quantized_bytes(self) -> int:
        """The 4-bit base's bytes kept whole on every rank (inv.quantized)."""
        return sum(t.nbytes for t in self.quantized)

    @cached_property
    def packed_params(self) -> int:
        """Elements of the parameters that are a 4-bit base's packed storage (a float quant_storage)."""
        return sum(t.numel for t in self.tensors if t.packs)

    @cached_property
    def model_params(self) -> int:
        """The model's own parameter count: a 4-bit weight counted by the elements it had, not its storage's."""
        return self.num_params - self.packed_params + self.quantized_params

    @cached_property
    def quantized_storage_bytes(self) -> int:
        """Every byte of the 4-bit base: what is kept whole and the packed parameters (sharded or not)."""
        return self.quantized_bytes + sum(t.nbytes for t in self.tensors if t.packs)

    @cached_property
    def trainable_params(self) -> int:
        """Elements that get gradients and optimizer states (all of them unless some are frozen)."""
        return sum(t.numel for t in self.tensors if t.trainable)

    @cached_property
    def unused_params(self) -> int:
        """Elements that require a gradient that no loss reads (ParamTensor.unused): DDP buckets them too."""
        return sum(t.numel for t in self.tensors if t.unused)

    @cached_property
    def frozen(self) -> bool:
        return any(not t.trainable for t in self.tensors)

    @cached_property
    def trainable_inventory(self) -> ParamInventory:
        """The same model with only its trainable tensors (itself when nothing is frozen): what gradients, reduce
        buffers and optimizer states are sized from."""
        if not self.frozen:
            return self
        from dataclasses import replace

        return replace(self, tensors=tuple(t for t in self.tensors if t.trainable))

    @cached_property
    def blocks(self) -> tuple[BlockInfo, ...]:
        """Wrapped blocks in order of first appearance; the root block first."""
        order: dict[str, list[int]] = {ROOT_BLOCK: [0, 0]}
        for t in self.tensors:
            entry = order.setdefault(t.block, [0, 0])
            entry[0] += 1
            entry[1] += t.numel
        return tuple(BlockInfo(name, n, numel) for name, (n, numel) in order.items())

    @property
    def layer_blocks(self) -> tuple[BlockInfo, ...]:
        return tuple(b for b in self.blocks if b.name != ROOT_BLOCK)

    @cached_property
    def largest_block(self) -> BlockInfo:
        return max(self.blocks, key=lambda b: b.numel)

    @cached_property
    def largest_layer_block(self) -> BlockInfo | None:
        layers = self.layer_blocks
        return max(layers, key=lambda b: b.numel) if layers else None

    @cached_property
    def largest_tensor(self) -> ParamTensor:
        return max(self.tensors, key=lambda t: t.numel)

    @cached_property
    def numel_by_category(self) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for t in self.tensors:
            out[t.category] += t.numel
        return {c: n for c, n in out.items() if n}

    @cached_property
    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return out

    @property
    def tied(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return tuple((t.name, t.tied_names) for t in self.tensors if t.tied_names)

    def block_tensors(self, block: str) -> tuple[ParamTensor, ...]:
        return tuple(t for t in self.tensors if t.block == block)
