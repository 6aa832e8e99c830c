"""What the target device's kernels do that changes the bytes of a training step, as rules (no torch here).

* **SDPA backend choice** on CUDA and CPU, and what each backend keeps for backward and allocates in its
  backward (the attention probabilities for math, an fp32 logsumexp for the fused kernels).
* **CPU GEMM scratch** by instruction set: what oneDNN takes from the allocator inside a bf16 matmul.
* **CUDA kernels' own buffers**: a reduction split across blocks (Reduce.cuh's staging buffer: a bias's or a
  norm weight's gradient), an embedding's backward (its partial-segment sums), the memory-efficient attention
  backward (its delta and dQ workspace), each from PyTorch's source and the H100's allocator streams.

The tracer (memplan/activations/tracing/) applies them to every call; ``Target`` names the device, part of a profile's key.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from memplan.errors import SettingsError
from memplan.inputs import quote
from memplan.units import round_up

#: CPU instruction-set classes that decide what a bf16 GEMM allocates (see cpu_gemm_scratch)
CPU_ISAS = ("avx2", "avx512", "avx512_bf16", "amx")
#: the default GPU architecture when no GPU is named: the H100's, on which the shared GPU cases were measured
DEFAULT_ARCH = "sm90"

#: (multiprocessors, max threads per multiprocessor) of each architecture's usual part (cudaDeviceProp
#: multiProcessorCount and maxThreadsPerMultiProcessor; NVIDIA's datasheets and CUDA programming guide, compute
#: capability table): H100 SXM5 and H200 132, B200 148, A100 108, A10G 80, L40S 142 (1,536 threads on 8.6 and
#: 8.9), V100 80; MI300X 304 compute units. A GPU preset's own "multiprocessors" overrides it (H100 PCIe: 114).
GPU_SHAPES = {"sm90": (132, 2048), "sm100": (148, 2048), "sm80": (108, 2048), "sm86": (80, 1536),
              "sm89": (142, 1536), "sm70": (80, 2048), "gfx942": (304, 2048)}
#: the part whose shape each SDPA class's shipped profiles were traced for (a profile's key names any other)
CLASS_PART = {"sm90": "sm90", "sm80": "sm80", "sm86": "sm86", "sm70": "sm70", "rocm": "gfx942"}

#: CUDA caching allocator: every block is a multiple of 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
#: kMinBlockSize and round_size), so max_memory_allocated counts each tensor rounded up to it
CUDA_BLOCK = 512


@dataclass(frozen=True, kw_only=True)
class Target:
    """The device a trace predicts for."""

    device: str = "cuda"  #: cuda | cpu
    arch: str = DEFAULT_ARCH  #: cuda: the GPU's architecture (smXY, or gfxNNN for ROCm)
    cpu_isa: str = "avx512"  #: cpu: one of CPU_ISAS
    cpu_threads: int = 1  #: cpu: threads per rank (oneDNN's AMX scratch is per thread; the harness runs 1)
    #: cuda: the GPU's multiprocessors and its threads per multiprocessor (0: those of the architecture's usual
    #: part, GPU_SHAPES), which decide how a CUDA reduction splits across blocks (reduce_scratch)
    sms: int = 0
    threads_per_sm: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise SettingsError(f"--device must be cuda or cpu, got {quote(self.device)}")
        if self.device == "cuda" and not re.fullmatch(r"sm\d{2,3}|gfx\w+", self.arch):
            raise SettingsError(f"unknown GPU architecture {quote(self.arch)} (smXY or gfxNNN)")
        if self.cpu_isa not in CPU_ISAS:
            raise SettingsError(f"--cpu-isa must be one of {', '.join(CPU_ISAS)}, got {quote(self.cpu_isa)}")

    @property
    def key(self) -> str:
        """What of the target changes a trace (the profile cache key's part)."""
        if self.device == "cuda":
            cls = sdpa_class(self.arch)
            sms, threads, _ = self.gpu
            usual = GPU_SHAPES[CLASS_PART[cls]]
            return f"cuda:{cls}" + ("" if (sms, threads) == usual else f":{sms}sm{threads}t")
        # "amx" became an upper bound over oneDNN's packing and "avx512_bf16" was re-measured on a native host
        # (cpu_gemm_scratch): their traces are new keys; both rules are per thread
        if self.cpu_isa == "amx":
            return f"cpu:amx-bound x{self.cpu_threads}"
        if self.cpu_isa == "avx512_bf16":
            return f"cpu:avx512_bf16-zen4 x{self.cpu_threads}"
        return f"cpu:{self.cpu_isa}"

    @property
    def gpu(self) -> tuple[int, int, int]:
        """(multiprocessors, max threads per multiprocessor, warp size) of a CUDA target."""
        sms, threads = GPU_SHAPES.get(self.arch) or GPU_SHAPES[CLASS_PART[sdpa_class(self.arch)]]
        return self.sms or sms, self.threads_per_sm or threads, 64 if self.arch.startswith("gfx") else 32

    def describe(self) -> str:
        if self.device == "cuda":
            order = " > ".join(priority_order(self.arch))
            return f"{self.arch} (SDPA priority {order})"
        per_thread = self.cpu_isa in ("amx", "avx512_bf16")
        return f"CPU {self.cpu_isa}" + (f", {self.cpu_threads} thread(s)" if per_thread else "")


def sm_version(arch: str) -> tuple[int, int]:
    """(major, minor) of an NVIDIA architecture name: sm90 -> (9, 0), sm100 -> (10, 0), sm86 -> (8, 6)."""
    digits = arch[2:]
    return int(digits[:-1]), int(digits[-1])


def sdpa_class(arch: str) -> str:
    """The architectures whose SDPA dispatch is alike: ``sm90`` (9.x and 10.x: cuDNN attention first),
    ``sm80`` (8.x, 11.x, 12.x: flash first), ``sm86`` (8.6-8.9 and 12.x: flash, but not for training with head
    dims in (192, 224]), ``sm70`` (below 8.0: no flash, no cuDNN attention), ``rocm``."""
    if arch.startswith("gfx"):
        return "rocm"
    major, minor = sm_version(arch)
    if major < 8:
        return "sm70"
    if major in (9, 10):
        return "sm90"
    if (major == 8 and minor >= 6) or major == 12:
        return "sm86"
    return "sm80"


def priority_order(arch: str) -> tuple[str, ...]:
    """SDPA's backend priority on a GPU (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp priority_order):
    flash, memory-efficient, math, unless check_prefer_cudnn_attention puts cuDNN first, which it does on
    sm90 and sm10x with cuDNN newer than 9.15 (PyTorch's CUDA 13 wheels ship 9.19). Measured on an H100 with torch
    2.11.0+cu130: torch._C._get_sdp_priority_order() is [cudnn, flash, efficient, math] once the first SDPA call
    has run. Math always accepts, so cuDNN, last elsewhere, is never reached there. Each backend gives its own
    place (SdpaBackend.rank)."""
    ranked = [(b.rank(arch), b.name) for b in BACKENDS.values()]
    return tuple(name for r, name in sorted((r, n) for r, n in ranked if r is not None))


@dataclass(frozen=True, kw_only=True)
class SdpaCall:
    """One scaled_dot_product_attention call: shapes (batch, heads, seq, head dim), dtype and options."""

    dtype: str  #: q's dtype after autocast ("bfloat16", "float16", "float32")
    batch: int
    hq: int
    hkv: int
    sq: int
    sk: int
    dq: int  #: q and k head dim
    dv: int
    mask: str | None = None  #: None | "bool" | "float" (q's dtype) | "float32" (another float dtype)
    mask_shape: tuple[int, ...] | None = None  #: the mask's own (broadcast) shape
    dropout: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    #: the mask requires grad (a learned bias passed as attn_mask: T5's relative position bias)
    mask_grad: bool = False

    @property
    def half(self) -> bool:
        return self.dtype in ("float16", "bfloat16")

    @property
    def elem(self) -> int:
        return 2 if self.half else 4 if self.dtype == "float32" else 8


def _heads_ok(c: SdpaCall, supports_gqa: bool) -> bool:
    """check_batch_size_and_num_heads_dense (sdp_utils_cpp.h): equal heads, or enable_gqa with a backend that
    takes grouped-query attention and q heads a multiple of kv heads."""
    if c.hq == c.hkv:
        return True
    return c.enable_gqa and supports_gqa and c.hkv > 0 and c.hq % c.hkv == 0


def _cudnn(c: SdpaCall, arch: str) -> str | None:
    """Why cuDNN attention cannot run this call (None: it can). can_use_cudnn_attention as measured on torch
    2.11+cu130, cuDNN 9.19, sm90 (bench/gpu/sdpa_choice_h100.json.gz): fp16/bf16, head dims multiples of 8 up to
    256, any mask, grouped-query heads, dropout, non-square causal; not a key/value length of 1, nor a query length
    of 1 with dropout (check_cudnn_tensor_shapes), nor a mask that requires grad (can_use_cudnn_attention runs
    sdp_utils_cpp.h check_attn_mask_shape, which refuses one: PyTorch main's sdp_utils.cpp)."""
    if not c.half:
        return "cuDNN needs fp16/bf16"
    if c.mask_grad:
        return "cuDNN takes no mask that requires grad"
    if c.dq > 256 or c.dv > 256:
        return f"cuDNN takes head dims up to 256, not {max(c.dq, c.dv)}"
    if c.dq % 8 or c.dv % 8:
        return "cuDNN needs head dims that are multiples of 8"
    if c.sk == 1:
        return "cuDNN does not take a key length of 1"
    if c.sq == 1 and c.dropout > 0:
        return "cuDNN does not take a query length of 1 with dropout"
    if not _heads_ok(c, True):
        return "heads differ without enable_gqa"
    return None


def _flash(c: SdpaCall, arch: str) -> str | None:
    """can_use_flash_attention (sdp_utils.cpp): sm80-sm121, fp16/bf16, no attn_mask, one head dim for q, k and
    v up to 256, causal only with equal lengths, grouped-query heads; sm86/89/12x refuse training with head dims
    in (192, 224], or above 224 with dropout (check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89)."""
    cls = sdpa_class(arch)
    if cls == "sm70":
        return "flash needs sm80 or newer"
    if not c.half:
        return "flash needs fp16/bf16"
    if c.mask is not None:
        return "flash takes no attention mask"
    if not (c.dq == c.dv and c.dq <= 256):
        return "flash needs one head dim up to 256"
    if c.is_causal and c.sq != c.sk:
        return "flash's causal needs equal lengths"
    if cls == "sm86" and (192 < c.dq <= 224 or (c.dq > 224 and c.dropout > 0)):
        return "flash on sm86/89/12x does not train these head dims"
    if not _heads_ok(c, True):
        return "heads differ without enable_gqa"
    return None


def _efficient(c: SdpaCall, arch: str) -> str | None:
    """can_use_mem_efficient_attention (sdp_utils.cpp): fp16/fp32 (and bf16 from sm80), q and k head dims equal,
    head dims aligned to minimum_gemm_alignment (8 elements for fp16/bf16, 4 for fp32 on sm80+), any mask; no
    grouped-query heads: measured on torch 2.11 (fp32 GQA takes math on the H100). PyTorch main adds GQA to this
    kernel (pull request 191085, July 2026); until a release is measured memplan keeps the math kernel there, the
    larger figure."""
    cls = sdpa_class(arch)
    dtypes = ("float16", "float32", "bfloat16") if cls not in ("sm70",) else ("float16", "float32")
    if c.dtype not in dtypes:
        return f"memory-efficient takes {', '.join(dtypes)}"
    if c.dq <= 0 or c.dv <= 0:
        return "empty head dim"
    if cls == "sm70":
        align = 8 if c.half else 1
    else:
        align = 8 if c.half else 4
    if c.dq % align or c.dv % align:
        return f"memory-efficient needs head dims that are multiples of {align}"
    if c.hq != c.hkv:
        return "memory-efficient takes no grouped-query heads (enable_gqa)"
    return None



def cuda_backend(c: SdpaCall, arch: str = DEFAULT_ARCH) -> tuple[str, str]:
    """(backend, why) that SDPA runs for this call on a GPU of ``arch`` (select_sdp_backend: the first backend
    in priority_order whose checks pass; math otherwise). ``why`` names the reason the fused kernels were not
    taken when math runs."""
    reasons = []
    for name in priority_order(arch):
        why = BACKENDS[name].why_not(c, arch)
        if why is None:
            if not BACKENDS[name].fused:
                break
            return name, f"{c.dtype}, head dim {c.dq}" + (f"/{c.dv}" if c.dv != c.dq else "") + \
                (", mask" if c.mask else "") + (", GQA" if c.hq != c.hkv else "")
        reasons.append(why)
    return MATH, "; ".join(dict.fromkeys(reasons))


def cpu_backend(c: SdpaCall) -> tuple[str, str]:
    """(backend, why) on CPU (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp select_sdp_backend_cpp): the
    CPU flash kernel, else math; flash needs no dropout (check_for_dropout), one head dim for q, k and v
    (check_head_dim_size_cpp), no mask that requires grad (check_attn_mask_shape: T5's learned relative bias
    runs math, measured with the profiler on torch 2.13.0+cpu) and as many key and value heads as query heads
    unless enable_gqa groups them (check_batch_size_and_num_heads_dense: Falcon's multi-query attention hands
    SDPA one key head to broadcast, and runs math). Checked with torch._fused_sdp_choice on real CPU
    tensors (tests)."""
    if c.dropout > 0:
        return MATH, f"attention dropout {c.dropout:g}"
    if c.mask_grad:
        return MATH, "a mask that requires grad (a learned bias)"
    if not (c.dq == c.dv):
        return MATH, f"head dims q {c.dq}, k {c.dq}, v {c.dv} differ"
    if not _heads_ok(c, True):  # check_batch_size_and_num_heads_dense: key/value heads broadcast (Falcon's one)
        return MATH, "heads differ without enable_gqa"
    return FLASH, "cpu flash"


def backend_for(c: SdpaCall, target: Target) -> tuple[str, str]:
    return cuda_backend(c, target.arch) if target.device == "cuda" else cpu_backend(c)


# ---- what each fused backend keeps and allocates ------------------------------------------------------------

def _cutlass_backward_kernel(c: SdpaCall, arch: str) -> tuple[int, int, int]:
    """(kBlockSizeI, kBlockSizeJ, kMaxK) of the memory-efficient backward kernel PyTorch launches: the first of
    dispatch_cutlassB's list (aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernels/cutlassB.h) whose
    kMaxK takes max(q, v head dims), as _efficient_attention_backward's launchKernel picks it. sm80 and newer:
    fp16/bf16 64x64 (k 32, 64), 128x64 k96 on sm86/sm89 only, 128x128 k128, 64x64 k128, 128x64 k65536; fp32 64x64
    (k 32, 64), 128x64 k128, 64x64 k128, 128x64 k65536. The 128-row fp32 and 128x128 kernels need more than the
    99 KB of shared memory sm86/sm89 have, so there the 64x64 ones run (from their tile sizes; not measured);
    below sm80 every kernel is 64x64."""
    dmax = max(c.dq, c.dv)
    major, minor = sm_version(arch)
    cc = major * 10 + minor
    if cc < 80:
        kernels = [(64, 64, 32), (64, 64, 64), (64, 64, 128), (64, 64, 65536)]
    elif c.half:
        kernels = [(64, 64, 32), (64, 64, 64)] + ([(128, 64, 96)] if cc in (86, 89) else [])
        kernels += ([] if cc in (86, 89) else [(128, 128, 128)]) + [(64, 64, 128)]
        kernels += ([] if cc in (86, 89) else [(128, 64, 65536)]) + [(64, 64, 65536)]
    else:
        kernels = [(64, 64, 32), (64, 64, 64)] + ([] if cc in (86, 89) else [(128, 64, 128)]) + [(64, 64, 128)]
        kernels += ([] if cc in (86, 89) else [(128, 64, 65536)]) + [(64, 64, 65536)]
    return next(k for k in kernels if k[2] >= dmax)


def efficient_backward(c: SdpaCall, arch: str) -> tuple[list[int], int, int]:
    """What the memory-efficient backward allocates beside q, k and v's gradients, in order
    (attention_backward.cu _efficient_attention_backward, cutlass path): (temporaries, delta, workspace).

    * delta, fp32 [b, h, s_q]: an empty tensor the fp16/bf16 kernels fill (kKernelComputesDelta); in fp32 it is
      ``(grad_out.float() * out.float()).sum(-1).transpose(-2, -1).contiguous()``, whose temporaries (the
      product, fp32 [b, s_q, h, d_v], and its sum, fp32 [b, s_q, h]) are freed once delta exists;
    * the workspace (kernel_backward.h workspace_size): per (batch, head) the dQ accumulator tiles of every query
      block (GradQTempStorage: a 16-byte lock and counter, then kBlockSizeI x kBlockSizeJ fp32, for
      ceil(d_q / kBlockSizeJ) column tiles: kNeedsAccumGradQ holds from sm70 on), and, where dK and dV are not
      kept in registers (fp16/bf16 with kMaxK > kBlockSizeI), their fp32 accumulators for each key split
      (num_splits_key: the key blocks, at most 200 / (b x h) then), aligned to 4 floats.

    delta is freed when the kernel is launched, the workspace when the op returns. Checked against every
    memory-efficient backward measured on the H100 (tests/data/sdpa_backend_bytes_h100.json.gz: 13 of 16 to
    the byte, the rest within 1 MiB, a GQA case under) and phi-2's recorded allocator stream (67,141,632 bytes
    for b 2, 32 heads, s 2048, head dim 80 in fp32: 128-query tiles, two 64-wide column tiles)."""
    bi, bj, kmax = _cutlass_backward_kernel(c, arch)
    b, h = c.batch, c.hq
    in_registers = c.half and kmax <= bi
    accum_kv = c.half and not in_registers
    gq = -(-c.sq // bi) * -(-c.dq // bj) * (4 + bi * bj)
    splits = -(-c.sk // bj)
    if b * h >= 256 and c.sk <= 2 * bj:
        splits = 1
    if accum_kv:
        splits = min(splits, 200 // (b * h))
    splits = max(splits, 1)
    gk = splits * bj * round_up(c.dq, bi) if accum_kv else 0
    gv = splits * bj * round_up(c.dv, bi) if accum_kv else 0
    workspace = b * h * round_up(gk + gv + gq, 4) * 4
    temps = [] if c.half else [4 * b * c.sq * h * c.dv, 4 * b * c.sq * h]
    return temps, 4 * b * h * c.sq, workspace


# ---- the SDPA backends: when each runs, what it keeps for backward, what it allocates ----------------------

class SdpaBackend:
    """One scaled_dot_product_attention kernel, as the trace and the engine see it. A new kernel is a subclass
    (its place in the priority, its checks, what it saves and allocates) added to BACKENDS, and a row of measured
    bytes in tests/data (tests/activations/test_kernels.py)."""

    name = ""
    #: a fused kernel (its own saved tensors and scratch); the math kernel runs PyTorch's composite instead
    fused = True
    #: writes its output in (b, s, h, d) memory order whatever q's layout (flash and cuDNN follow q's)
    output_bshd = False

    def rank(self, arch: str) -> int | None:
        """Its place in SDPA's priority on a GPU of ``arch`` (sdp_utils.cpp priority_order); None: not tried."""
        raise NotImplementedError

    def why_not(self, c: SdpaCall, arch: str) -> str | None:
        """Why it cannot run this call on a GPU of ``arch`` (None: it can)."""
        raise NotImplementedError

    def saved(self, c: SdpaCall, device: str = "cuda") -> list[tuple[tuple[int, ...], str]]:
        """What it saves for backward beside q, k, v and its output, as (shape, dtype)."""
        return []

    def forward_scratch(self, c: SdpaCall, device: str = "cuda") -> int:
        """Bytes its forward allocates and frees before returning."""
        return 0

    def backward_scratch(self, c: SdpaCall, device: str = "cuda", arch: str = DEFAULT_ARCH) -> int:
        """Bytes its backward allocates beside q, k and v's gradients and frees before returning."""
        return 0

    def backward_allocations(self, c: SdpaCall, device: str, arch: str) -> tuple[list[int], int, int] | None:
        """Where the order of its backward's allocations matters: (temporaries, then a buffer they make, then a
        workspace), each freed as the kernel does; None: backward_scratch as one block."""
        return None


class CudnnAttention(SdpaBackend):
    """cuDNN attention: first on sm90 and sm10x (check_prefer_cudnn_attention with cuDNN newer than 9.15),
    never reached elsewhere (math, before it, always accepts)."""

    name = "cudnn"

    def rank(self, arch: str) -> int | None:
        return 0 if sdpa_class(arch) == "sm90" else None

    def why_not(self, c: SdpaCall, arch: str) -> str | None:
        return _cudnn(c, arch)

    def saved(self, c: SdpaCall, device: str = "cuda") -> list[tuple[tuple[int, ...], str]]:
        """Softmax stats fp32 [b, h, s_q, 1], seed and offset, a bool mask converted to q's dtype (measured on
        the H100, torch 2.11+cu130, with saved_tensors_hooks)."""
        out = [((c.batch, c.hq, c.sq, 1), "float32"), ((), "int64"), ((), "int64")]
        if c.mask == "bool":
            out.append((_mask_shape(c), c.dtype))
        return out

    def forward_scratch(self, c: SdpaCall, device: str = "cuda") -> int:
        return 0 if device == "cpu" else CUDA_BLOCK

    def backward_scratch(self, c: SdpaCall, device: str = "cuda", arch: str = DEFAULT_ARCH) -> int:
        """An fp32 dq-sized workspace, the stats' size and 512 bytes; with grouped-query heads dk and dv at the
        query's head count (dk_expanded, dv_expanded), summed down."""
        if device == "cpu":
            return 0
        b, h = c.batch, c.hq
        gqa = _gqa_expanded(c)
        return 4 * b * c.sq * h * c.dq + 4 * b * h * c.sq + CUDA_BLOCK + gqa + ((1 << 20) if gqa else 0)


class FlashAttention(SdpaBackend):
    """FlashAttention-2 (aten/src/ATen/native/transformers/cuda/flash_attn), and the CPU flash kernel."""

    name = "flash"

    def rank(self, arch: str) -> int | None:
        return 1

    def why_not(self, c: SdpaCall, arch: str) -> str | None:
        return _flash(c, arch)

    def saved(self, c: SdpaCall, device: str = "cuda") -> list[tuple[tuple[int, ...], str]]:
        """Logsumexp fp32 [b, h, s_q] and its philox seed and offset (uint64 [2], []); the CPU flash kernel
        (attention.cpp _scaled_dot_product_flash_attention_cpu) returns the output and the logsumexp only, and
        its backward takes the mask it was given: a bool mask converted to q's dtype by
        scaled_dot_product_attention (convert_boolean_attn_mask, at::where(mask, 0, -inf): a new tensor for every
        call, every layer), kept to that layer's backward (measured on torch 2.13.0+cpu with saved_tensors_hooks:
        a [2, 1, 128, 128] bool mask saved as an fp32 aten.where output; the gemma3 image-text rows of
        docs/accuracy.md read -1.39% to -1.51% without it, at commit 58db21e)."""
        if device == "cpu":
            return [((c.batch, c.hq, c.sq), "float32")] + ([(_mask_shape(c), c.dtype)] if c.mask == "bool" else [])
        return [((c.batch, c.hq, c.sq), "float32"), ((2,), "int64"), ((), "int64")]

    def backward_scratch(self, c: SdpaCall, device: str = "cuda", arch: str = DEFAULT_ARCH) -> int:
        """flash_api.cpp mha_bwd: an fp32 dq accumulator [b, s_q rounded to 128, h, d rounded to 32 (64 above
        128)] and softmax_d fp32 [b, h, s_q rounded to 128]; with grouped-query heads dk and dv expanded (a
        further buffer of up to 0.9 MB was measured: 12 q heads per kv head, s 4096)."""
        if device == "cpu":
            return 0  # the CPU harness's measurements match the trace without it (docs/accuracy.md)
        b, h = c.batch, c.hq
        gqa = _gqa_expanded(c)
        s = round_up(c.sq, 128)
        d = round_up(c.dq, 32 if c.dq <= 128 else 64)
        return 4 * b * s * h * d + 4 * b * h * s + gqa + ((1 << 20) if gqa else 0)


class EfficientAttention(SdpaBackend):
    """Memory-efficient attention (xFormers' cutlass kernels, mem_eff_attention)."""

    name = "efficient"
    output_bshd = True

    def rank(self, arch: str) -> int | None:
        return 2

    def why_not(self, c: SdpaCall, arch: str) -> str | None:
        return _efficient(c, arch)

    def saved(self, c: SdpaCall, device: str = "cuda") -> list[tuple[tuple[int, ...], str]]:
        """Logsumexp fp32 [b, h, s_q rounded up to 32], seed and offset (int64 []), and a bool mask converted to
        q's dtype, its last dim padded to 16 bytes (a float mask of q's dtype is kept as given unless it needs
        that padding)."""
        out: list[tuple[tuple[int, ...], str]] = [((c.batch, c.hq, round_up(c.sq, 32)), "float32"), ((), "int64"),
                                                  ((), "int64")]
        shape = _mask_shape(c)
        align = 16 // c.elem
        if c.mask == "bool" or (c.mask is not None and shape[-1] % align):
            out.append((shape[:-1] + (round_up(shape[-1], align),), c.dtype))
        return out

    def forward_scratch(self, c: SdpaCall, device: str = "cuda") -> int:
        """An fp32 output accumulator when the head dims differ and exceed 128."""
        if device == "cpu" or not (max(c.dq, c.dv) > 128 and c.dq != c.dv):
            return 0
        return 4 * c.batch * c.hq * c.sq * c.dv

    def backward_scratch(self, c: SdpaCall, device: str = "cuda", arch: str = DEFAULT_ARCH) -> int:
        """On CUDA: efficient_backward's buffers as the allocator holds them; on ROCm an fp32 dq accumulator and
        two [b, h, s_q rounded to 32] fp32 buffers."""
        if device == "cpu":
            return 0
        b, h = c.batch, c.hq
        if not arch.startswith("gfx"):
            temps, delta, work = efficient_backward(c, arch)
            blk = [round_up(n, CUDA_BLOCK) for n in temps + [delta, work]]
            return max(sum(blk[:-1]), blk[-2] + blk[-1])
        s = round_up(c.sq, 32)
        if c.half and max(c.dq, c.dv) > 128:
            # fp16/bf16 head dims past 128 take a further workspace, 19 to 27 MB in the three shapes measured
            # whatever their size (b 2, heads 4 to 16, s 1024 to 2048): its largest, rounded up, as a bound
            return 4 * b * h * s * c.dq + 2 * 4 * b * h * s + (28 << 20)
        return 4 * b * h * s * c.dq + 2 * 4 * b * h * s

    def backward_allocations(self, c: SdpaCall, device: str, arch: str) -> tuple[list[int], int, int] | None:
        if device != "cuda" or arch.startswith("gfx"):
            return None
        return efficient_backward(c, arch)


class MathAttention(SdpaBackend):
    """The math kernel: PyTorch's composite (_scaled_dot_product_attention_math), traced as it runs; on a GPU
    with the measured extra of its CUDA kernels (math_extra)."""

    name = "math"
    fused = False

    def rank(self, arch: str) -> int | None:
        return 3

    def why_not(self, c: SdpaCall, arch: str) -> str | None:
        return None


def _mask_shape(c: SdpaCall) -> tuple[int, ...]:
    return tuple(c.mask_shape) if c.mask_shape else (c.batch, 1, c.sq, c.sk)


def _gqa_expanded(c: SdpaCall) -> int:
    """Grouped-query heads: dk and dv made at the query's head count before they are summed down."""
    return 0 if c.hq == c.hkv else c.batch * c.sk * c.hq * (c.dq + c.dv) * c.elem


#: every SDPA backend by name; the priority on each GPU comes from their ranks (priority_order)
BACKENDS: dict[str, SdpaBackend] = {b.name: b for b in (CudnnAttention(), FlashAttention(), EfficientAttention(),
                                                         MathAttention())}
CUDNN, FLASH, EFFICIENT, MATH = "cudnn", "flash", "efficient", "math"

def math_extra(c: SdpaCall) -> tuple[int, int]:
    """(forward, backward) bytes the math kernel allocates on a GPU beyond what its composite
    (_scaled_dot_product_attention_math) allocates when traced: measured on the H100 against the trace of the
    same call, eight shapes (fp32 and bf16, MHA and GQA, causal and masked): one bool [b, h, s_q, s_k] in the
    forward, one fp32 [b, h, s_q, s_k] in the backward."""
    p = c.batch * c.hq * c.sq * c.sk
    return p, 4 * p


# ---- CUDA reductions: the cross-block staging buffer ----------------------------------------------------------

def _last_pow2(n: int) -> int:
    """Reduce.cuh last_pow2: the largest power of two not above ``n`` (at least 1)."""
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _reduce_iter(shape: tuple[int, ...], strides: tuple[int, ...], reduce: frozenset[int], in_elem: int,
                 out_elem: int) -> tuple[list[int], list[int], int]:
    """A reduction's TensorIterator (aten/src/ATen/TensorIterator.cpp): its dims reordered (reorder_dimensions:
    the reduced dims first, since the output's stride is 0 there, then by the input's strides) and coalesced
    (coalesce_dimensions); returns (shape, input strides in bytes, number of reduced dims). The output is the
    contiguous result (the structured kernel's set_output_raw_strided) restrided with 0 in the reduced dims."""
    n = len(shape)
    out_strides, acc = [0] * n, out_elem
    for d in reversed(range(n)):
        if d not in reduce:
            out_strides[d] = acc
            acc *= shape[d]
    ops = [out_strides, [s * in_elem for s in strides]]

    def should_swap(d0: int, d1: int) -> int:
        for i, st in enumerate(ops):
            s0, s1 = st[d0], st[d1]
            if i == 0 and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(n)))
    for i in range(1, n):  # reorder_dimensions' insertion sort
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    sh = [shape[p] for p in perm]
    st = [[o[p] for p in perm] for o in ops]
    if n:
        prev = 0
        for d in range(1, n):  # coalesce_dimensions
            if sh[prev] == 1 or sh[d] == 1 or all(o[prev] * sh[prev] == o[d] for o in st):
                if sh[prev] == 1:
                    for o in st:
                        o[prev] = o[d]
                sh[prev] *= sh[d]
            else:
                prev += 1
                if prev != d:
                    for o in st:
                        o[prev] = o[d]
                    sh[prev] = sh[d]
        sh, st = sh[:prev + 1], [o[:prev + 1] for o in st]
    nred = sum(1 for s in st[0] if s == 0) if n else 0
    return sh, st[1], nred


def reduce_scratch(shape: tuple[int, ...], strides: tuple[int, ...], dims: tuple[int, ...] | None, in_elem: int,
                   acc_elem: int, out_elem: int, gpu: tuple[int, int, int]) -> tuple[int, int]:
    """(buffer, semaphores): the bytes a CUDA reduction (gpu_reduce_kernel, aten/src/ATen/native/cuda/
    Reduce.cuh: sum, mean, norm, amax...) takes from the caching allocator for itself, after its output and
    before its kernel, and frees when it returns (semaphores first). Only a reduction split across blocks has
    them (setReduceConfig: a reduction over outer dims, or a long one, whose outputs are too few to fill the
    GPU): ``global_memory_size`` (the acc type's size x outputs x blocks per output, x block.x x output_vec_size
    when the lanes of a warp hold different outputs) and ``semaphore_size`` (an int per block column). A
    Linear's bias gradient and a norm's weight gradient (a sum over the tokens) are such reductions: phi-2's
    head bias over 4,096 tokens takes 157,286,400 bytes on an H100, as its recorded allocator stream shows.
    ``gpu``: (multiprocessors, max threads per multiprocessor, warp size). Not modelled: an iterator too large
    for 32-bit indexing (split in halves, each reduced on its own)."""
    sms, threads_per_sm, warp = gpu
    numel = 1
    for s in shape:
        numel *= s
    if numel <= 1:
        return 0, 0
    reduce = frozenset(range(len(shape)) if not dims else (d % len(shape) for d in dims))
    if numel * in_elem >= 2 ** 31:
        return 0, 0
    sh, st, nred = _reduce_iter(tuple(shape), tuple(strides), reduce, in_elem, out_elem)
    ndim = len(sh)
    num_outputs = 1
    for s in sh[nred:]:
        num_outputs *= s
    num_inputs = numel // num_outputs
    if ndim:
        on_fastest = nred == ndim or st[0] < st[nred]
        dim0, dim1, fastest = (num_inputs, num_outputs, st[0]) if on_fastest else \
            (num_outputs, num_inputs, st[nred])
    else:
        on_fastest, fastest, dim0, dim1 = True, in_elem, 1, 1
    out_vec = 1
    if fastest == in_elem:
        if on_fastest and dim0 >= 128 and nred == 1:
            dim0 //= 4  # vectorize along the input (input_vec_size: vt0, 4)
        elif not on_fastest:
            out_vec = 4  # get_output_vec_size: 4, halved until it divides the output dim and the other strides
            for n in [sh[nred]] + [s // in_elem for j, s in enumerate(st) if j != nred]:
                while n % out_vec:
                    out_vec //= 2
            dim0 //= out_vec
    max_threads = 512 // out_vec  # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex double: not met here)
    d0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    d1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    bw = min(d0, warp)
    bh = min(d1, max_threads // bw)
    bw = min(d0, max_threads // bh)
    step_in = step_out = 1
    block_x_reduce = ndim == 0 or on_fastest
    if block_x_reduce:
        step_in *= bw
    else:
        step_out *= bw
    rocm = warp == 64
    min_vpt, max_vpt = (128 if rocm else 16), 256
    split_warps = -(-num_inputs // step_in) >= min(bh * 16, max_vpt)
    if split_warps:
        step_in *= bh
    else:
        step_out *= bh
    grid_x = -(-(num_outputs // out_vec) // step_out)
    target = sms * (threads_per_sm // (bw * bh))
    vpt = -(-num_inputs // step_in)
    if not (split_warps and vpt >= max_vpt and grid_x <= target):
        return 0, 0
    ctas = max(min(-(-target // grid_x), -(-vpt // min_vpt)), -(-vpt // max_vpt))
    if ctas > 1 and rocm:
        ctas = max(ctas, 64)
    if ctas <= 1:
        return 0, 0
    size = acc_elem * num_outputs * ctas * (1 if block_x_reduce else bw * out_vec)
    return size, 4 * grid_x


def scratch_args(shape: tuple[int, ...], strides: tuple[int, ...], dims: tuple[int, ...] | None, in_elem: int,
                 acc_elem: int, out_elem: int, gpu: tuple[int, int, int]) -> list[int]:
    """A reduction's reduce_scratch arguments as one list of integers (a traced step's kernel-scratch birth keeps
    them, each a line in the micro-batch: kernel_scratch evaluates them at any)."""
    n = len(shape)
    red = sorted({d % n for d in dims}) if dims else []
    return [n, *shape, *strides, len(red), *red, in_elem, acc_elem, out_elem, *gpu]


@functools.lru_cache(maxsize=4096)
def kernel_scratch(kind: str, args: tuple[int, ...]) -> int:
    """The bytes of a traced kernel-scratch birth (tracing/live.py LiveBytes.scratch) from its integer arguments
    at the micro-batch wanted: "reduce" (a reduction's staging buffer) and "semaphores" (scratch_args, then
    reduce_scratch), "embedding" (embedding_backward_scratch). Sizes that are not lines in the micro-batch (the
    blocks a reduction splits into, the embedding's 3,072-index threshold) are so exact at every micro-batch."""
    if kind == "embedding":
        return embedding_backward_scratch(*args[:4], bool(args[4]))
    n = args[0]
    shape, strides = tuple(args[1:1 + n]), tuple(args[1 + n:1 + 2 * n])
    k = args[1 + 2 * n]
    dims = tuple(args[2 + 2 * n:2 + 2 * n + k]) or None
    in_elem, acc_elem, out_elem, *gpu = args[2 + 2 * n + k:]
    buf, sem = reduce_scratch(shape, strides, dims, in_elem, acc_elem, out_elem, tuple(gpu))
    return buf if kind == "reduce" else sem if kind == "semaphores" else 0


def embedding_backward_scratch(indices: int, num_weights: int, dim: int, opmath: int, scale_grad_by_freq: bool) -> int:
    """Bytes an embedding's CUDA backward (aten/src/ATen/native/cuda/Embedding.cu embedding_dense_backward_cuda)
    allocates after its gradient and frees before returning: above 3,072 indices (or with scale_grad_by_freq) it
    sorts them and sums each index's rows in partial segments (EmbeddingBackwardKernel.cu
    embedding_backward_cuda_kernel), whose per-segment sums take max_partial_segment x dim in the opmath type,
    max_partial_segment = indices / NROWS_PER_THREAD (10) + min(indices, num_weights). The allocator streams
    recorded on the H100 show it: phi-2 (4,096 tokens, 2,560 wide, fp32) 46,131,200 bytes, llama-3.2-1b (8,192
    tokens, 2,048 wide) 73,818,112. Its sorting buffers (int64 per index: the small pool) are not counted."""
    if indices <= 3072 and not scale_grad_by_freq:
        return 0
    return (indices // 10 + min(indices, num_weights)) * dim * opmath


# ---- CPU GEMM scratch ---------------------------------------------------------------------------------------

def cpu_gemm_scratch(isa: str, m: int, n: int, k: int, dtype: str, threads: int = 1) -> int:
    """Bytes a CPU matmul (aten::mm / addmm of an (m, k) by (k, n) product) takes from the allocator for itself
    and frees before returning, by the host's instruction set. Only bf16 GEMMs that PyTorch hands to oneDNN
    allocate: at::native mkldnn_bf16_gemm (aten/src/ATen/native/mkldnn/Matmul.cpp) runs when
    mkldnn_bf16_device_check() holds (AVX512 BW/VL/DQ, avx_ne_convert, AMX, or Arm bf16) and m*n*k > 16*16*16.
    Measured with the profiler's memory events on torch 2.13.0+cpu (this repository's tests, AVX512) and 2.11.0
    (a Sapphire Rapids host, with oneDNN capped by ONEDNN_MAX_CPU_ISA; docs/accuracy.md "CPU kernels"):

    - ``avx2`` (no mkldnn bf16: PyTorch's own cpublas kernel): nothing. Also oneDNN capped at AVX2.
    - ``avx512`` (AVX512 without bf16 instructions: oneDNN converts and accumulates in fp32): an fp32 buffer of
      the output's size plus 128 bytes, m*n*4 + 128 (exact for dims that are multiples of 16; smaller dims are
      padded by up to 512 bytes).
    - ``amx`` (AMX tiles: oneDNN's brgemm packs B, and A for tall products, per thread): an upper bound,
      threads x (2 x k' x n' + 2 x k' x m' [m >= 1024] + 6,144), k' = k rounded up to 32, n' = n rounded up to
      64 (64 for m = 1), m' = m rounded up to 64. oneDNN picks its blocks from the CPU's caches
      (brgemm_matmul_utils.cpp, compute_blocking_heuristic_amx): Sapphire Rapids with torch 2.11 packed 64
      columns, an AMX host with torch 2.13.0 up to all n (bench/cpu/gemm_scratch_amx_torch2.13.jsonl). The bound
      holds for every shape measured on both and is exact to 1 KiB where B is packed whole.
    - ``avx512_bf16`` (no AMX): per thread 128 k' + 256 min(m, 256) + 1,024 (k' = k rounded up to 32 up to 512,
      then 512 up to k = 1024 and for m = 1, then 1024): a packed block of B, an fp32 accumulator of up to 256 x 64.
      Tall products (m >= 1024) with k a power of two >= 4096 also copy A: 540,800 + 1,024 (n' - 64) more, n' = n
      rounded up to 64 within [64, 1024]. Exact on a native host (AMD EPYC Zen 4, torch 2.13.0; bench/cpu/
      gemm_scratch_avx512bf16_zen4_torch2.13.jsonl) for m <= 256 at one thread, an upper bound elsewhere.
    fp16 and fp32 GEMMs allocate nothing on any of them, nor does cuBLAS per call."""
    if dtype != "bfloat16" or m * n * k <= 16 * 16 * 16:
        return 0
    if isa == "avx512":
        return 4 * m * n + 128
    if isa == "amx":
        kp = round_up(max(k, 32), 32)
        packed_b = 2 * kp * (64 if m == 1 else round_up(n, 64))
        packed_a = 2 * kp * round_up(m, 64) if m >= 1024 else 0
        return max(1, threads) * (packed_b + packed_a + 6144)
    if isa == "avx512_bf16":
        kb = round_up(max(k, 32), 32) if k <= 512 else 512 if (k <= 1024 or m == 1) else 1024
        copy_a = 0
        if m >= 1024 and k >= 4096 and k & (k - 1) == 0:
            copy_a = 540800 + 1024 * (min(max(round_up(n, 64), 64), 1024) - 64)
        return max(1, threads) * (128 * kb + 256 * min(m, 256) + 1024 + copy_a)
    return 0


def cpu_scaled_mm_scratch(m: int, n: int, k: int, a_copy: bool, b_copy: bool, out_size: int) -> int:
    """Bytes a CPU torch._scaled_mm of float8 (m, k) by (k, n) operands holds above its output at its peak,
    without AMX (aten/src/ATen/native/Blas.cpp _scaled_mm_out_cpu_emulated, torch 2.13; AMX hosts take oneDNN's
    mkldnn_scaled_mm instead, not modelled): each operand made contiguous (``a_copy``, ``b_copy``: a one-byte
    copy where it is not: torchao hands B column-major), then converted to fp32 and scaled (``mat.to(kFloat)``
    and ``at::mul``, two fp32 copies at once, the first freed), the fp32 product (``at::matmul``) and its
    conversion to the output's dtype (``out_size`` bytes an element; none for fp32), all freed on return. The
    fp32 GEMM's own scratch is taken as none, as for every fp32 GEMM (cpu_gemm_scratch)."""
    copies = (m * k if a_copy else 0) + (n * k if b_copy else 0)
    a32, b32, c32 = 4 * m * k, 4 * k * n, 4 * m * n
    return copies + max(2 * a32, a32 + 2 * b32, a32 + b32 + c32 + (m * n * out_size if out_size != 4 else 0))


@functools.lru_cache(maxsize=1)
def host_cpu_isa() -> str:
    """The instruction-set class of this machine's CPU, decided as PyTorch decides whether a bf16 GEMM goes to
    oneDNN (aten/src/ATen/native/mkldnn/Utils.h mkldnn_bf16_device_check: cpuinfo's AVX512 BW, VL and DQ, or
    avx_ne_convert; Arm with bf16), read from /proc/cpuinfo without importing torch: AMX tiles, else
    AVX512-BF16, else that oneDNN path, else none. Arm with bf16 (Graviton 3) is not measured: taken as
    ``avx512`` (oneDNN accumulating in fp32), the larger figure."""
    flags = _cpu_flags()
    x86 = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    arm_bf16 = "bf16" in flags
    if not (x86 or arm_bf16):
        return "avx2"
    if "amx_bf16" in flags or "amx_tile" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "avx512"


def host_target(device: str) -> Target:
    """The target when only a device is named: the default GPU architecture, or this machine's CPU."""
    return Target(device="cpu", cpu_isa=host_cpu_isa()) if device == "cpu" else Target(device=device)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def describe_cpu_gemm(isa: str) -> str:
    return {"avx2": "cpu gemm scratch: none (no mkldnn bf16 on this CPU class)",
            "avx512": "cpu gemm scratch: fp32 output buffer, 4*m*n + 128 B per bf16 GEMM (oneDNN on AVX512)",
            "amx": "cpu gemm scratch: oneDNN AMX packing, threads x (128*k + 4864) B per bf16 GEMM",
            "avx512_bf16": "cpu gemm scratch: oneDNN AVX512-BF16 brgemm, threads x (128*k' + 256*min(m, 256) + 1024) B "
                           "per bf16 GEMM"}[isa]
