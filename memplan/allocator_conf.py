"""PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, parsed as PyTorch 2.13 parses it: the text a job would run with is
accepted exactly when PyTorch accepts it, and what it sets is read the same way. No torch here.

PyTorch parses the text twice (c10/core/AllocatorConfig.h setAllocatorSettings):

1. ``AcceleratorAllocatorConfig::parseArgs`` (c10/core/AllocatorConfig.cpp): the device-generic keys
   (large_segment_size_mb first, then max_split_size_mb, max_non_split_rounding_mb, garbage_collection_threshold,
   roundup_power2_divisions, expandable_segments, pinned_use_background_threads, pinned_max_round_threshold_mb,
   pinned_max_cached_size_mb); with a device hook registered, any other key must be one of the keys the hook
   registered ("Unrecognized key ... in Accelerator allocator config"); other keys' values are skipped.
2. the CUDA hook, ``CUDAAllocatorConfig::parseArgs`` (c10/cuda/CUDAAllocatorConfig.cpp): backend,
   release_lock_on_cudamalloc, pinned_use_cuda_host_register, pinned_num_register_threads,
   pinned_reserve_segment_size_mb, graph_capture_record_stream_reuse, per_process_memory_fraction,
   pinned_free_catch_all, throw_on_cudamalloc_oom (and the hip spellings); the generic keys are skipped.

The tokenizer (ConfigTokenizer) splits at ``,`` ``:`` ``[`` ``]`` and drops whitespace; a key's ``:`` and the
``,`` between settings are looked at but never required (checkToken's answer is ignored), while reading past the
last token is an internal assertion. Numbers are C's: ``std::stoull`` (an optional sign, ASCII digits, the
rest ignored: ``100abc`` is 100, ``1_000`` is 1, ``-3`` wraps around to 2^64 - 3) and ``std::stod`` (decimal or
hexadecimal floats, inf, nan; out of range is an error). Booleans are ``True`` or ``False`` exactly.

Checked against the installed PyTorch's own parser for the generic keys (torch._C._accelerator_setAllocatorSettings
runs step 1 on the CPU build; tests/allocator/test_allocator.py).
"""

from __future__ import annotations

import math
import re

from memplan.errors import SettingsError
from memplan.inputs import quote

MB = 1 << 20
LARGE_BUFFER = 20 << 20  #: kLargeBuffer, large_segment_size's default
MIN_LARGE_ALLOC = 10 << 20  #: kMinLargeAlloc: large_segment_size_mb must be above it
SIZE_MAX = (1 << 64) - 1
#: roundup_power2_divisions' intervals: one per power of two from 1 MiB to 64 GiB (kRoundUpPowerOfTwoIntervals)
INTERVALS = 16

#: the generic keys (AcceleratorAllocatorConfig::getMutableKeys) and the CUDA hook's (CUDAAllocatorConfig::getKeys)
GENERIC_KEYS = ("large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
                "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
                "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
CUDA_KEYS = ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "release_lock_on_hipmalloc",
             "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
             "pinned_num_register_threads", "per_process_memory_fraction", "pinned_free_catch_all",
             "throw_on_cudamalloc_oom")
#: settings PyTorch honours that change nothing on the device's memory (host pinned memory, locking, CUDA graphs)
NO_DEVICE_BYTES = ("pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
                   "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
                   "pinned_use_hip_host_register", "graph_capture_record_stream_reuse",
                   "pinned_reserve_segment_size_mb", "pinned_num_register_threads", "pinned_free_catch_all")


class _Refused(Exception):
    """PyTorch refuses the text (its message)."""


class _Tokens:
    """c10::CachingAllocator::ConfigTokenizer."""

    def __init__(self, text: str) -> None:
        self.items: list[str] = []
        buf = ""
        for ch in text:
            if ch in ",:[]":
                if buf:
                    self.items.append(buf)
                    buf = ""
                self.items.append(ch)
            elif ch not in " \t\n\v\f\r":  # std::isspace in the C locale
                buf += ch
        if buf:
            self.items.append(buf)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < len(self.items):
            raise _Refused("the text ends where a value or a ':' should follow (PyTorch: \"Index out of bounds in "
                           "ConfigTokenizer\")")
        return self.items[i]

    def check(self, i: int, token: str) -> bool:
        return self[i] == token

    def value(self, i: int) -> int:
        """A key's value: its ':' looked at (never required: checkToken's answer is ignored), the index after."""
        self.check(i + 1, ":")
        return i + 2

    def size_t(self, i: int) -> int:
        return stoull(self[i])

    def double(self, i: int) -> float:
        return stod(self[i])

    def boolean(self, i: int) -> bool:
        t = self[i]
        if t in ("True", "False"):
            return t == "True"
        raise _Refused(f"expected True or False, got {quote(t)}")

    def skip_key(self, i: int) -> int:
        self.check(i + 1, ":")
        i += 2
        if self[i] != "[":
            return i
        i += 1
        while i < len(self.items) and self.items[i] != "]":
            i += 1
        if i >= len(self.items):
            raise _Refused("a '[' list is never closed with ']'")
        return i


_STOULL = re.compile(r"([+-]?)([0-9]+)")


def stoull(token: str) -> int:
    """std::stoull(token): the leading digits (after an optional sign) as an unsigned 64-bit value; a minus sign
    wraps around (strtoull negates in unsigned arithmetic); no digits, or more than 2^64 - 1, is refused."""
    m = _STOULL.match(token)
    if not m:
        raise _Refused(f"{quote(token)} is not a number (std::stoull: no digits)")
    v = int(m.group(2)) if len(m.group(2)) <= 40 else SIZE_MAX + 1
    if v > SIZE_MAX:
        raise _Refused(f"{quote(token)} is out of range (std::stoull)")
    return (-v) % (1 << 64) if m.group(1) == "-" else v


_STOD = re.compile(r"[+-]?(?:0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
                   r"|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
                   r"|(?:[iI][nN][fF](?:[iI][nN][iI][tT][yY])?)|(?:[nN][aA][nN](?:\([0-9A-Za-z_]*\))?))")


def stod(token: str) -> float:
    """std::stod(token): the longest leading C floating-point number (decimal, hexadecimal, inf, nan); none, or
    one out of a double's range (strtod sets ERANGE on overflow and underflow), is refused."""
    m = _STOD.match(token)
    if not m:
        raise _Refused(f"{quote(token)} is not a number (std::stod)")
    text = m.group(0)
    body = text.lstrip("+-")
    low = body.lower()
    if low.startswith("inf"):
        return -math.inf if text.startswith("-") else math.inf
    if low.startswith("nan"):
        return math.nan
    try:
        value = float.fromhex(text) if low.startswith("0x") else float(text)
    except (ValueError, OverflowError):
        raise _Refused(f"{quote(token)} is out of range (std::stod)") from None
    nonzero = any(c not in "0.xX+-" for c in re.split(r"[eEpP]", body)[0])
    if math.isinf(value) or (nonzero and (value == 0 or abs(value) < 2.2250738585072014e-308)):
        raise _Refused(f"{quote(token)} is out of range (std::stod)")
    return value


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def parse(text: str, cuda: bool = True) -> dict[str, object]:
    """The settings ``text`` gives, as PyTorch reads them: {"max_split_size", "max_non_split_rounding",
    "large_segment_size", "roundup_power2_divisions" (16 intervals), "garbage_collection_threshold",
    "expandable_segments", "per_process_memory_fraction", "backend", "throw_on_cudamalloc_oom", "keys" (the keys
    given)}; a one-line SettingsError where PyTorch refuses the text."""
    try:
        return _parse(text, cuda)
    except _Refused as exc:
        raise SettingsError(f"allocator config {quote(text)}: {exc.args[0]} (PyTorch refuses it)") from None


def _parse(text: str, cuda: bool = True) -> dict[str, object]:
    """``cuda``: as a CUDA build parses it (its hook registered: unknown keys refused, the CUDA keys read); False:
    as a CPU build does (the generic keys only, every other key skipped), which tests compare with torch."""
    tok = _Tokens(text)
    out: dict[str, object] = {"max_split_size": None, "large_segment_size": LARGE_BUFFER,
                              "roundup_power2_divisions": (0,) * INTERVALS, "garbage_collection_threshold": 0.0,
                              "expandable_segments": False, "per_process_memory_fraction": 1.0,
                              "backend": "native", "throw_on_cudamalloc_oom": False, "keys": ()}
    keys: list[str] = []
    known = set(GENERIC_KEYS) | set(CUDA_KEYS)
    # 1. AcceleratorAllocatorConfig::parseArgs: large_segment_size_mb first (max_non_split_rounding follows it)
    i = 0
    while i < len(tok):
        if tok[i] == "large_segment_size_mb":
            i = tok.value(i)
            v = tok.size_t(i)
            if not v > MIN_LARGE_ALLOC // MB:
                raise _Refused(f"large_segment_size_mb must be > {MIN_LARGE_ALLOC // MB} MB, got {v}")
            out["large_segment_size"] = min(v, SIZE_MAX // MB) * MB
        i += 1
    out["max_non_split_rounding"] = out["large_segment_size"]
    i = 0
    while i < len(tok):
        key = tok[i]
        keys.append(key)
        if key == "large_segment_size_mb":
            i = tok.skip_key(i)
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            i = tok.value(i)
            v = tok.size_t(i)
            least = int(out["large_segment_size"]) // MB  # type: ignore[call-overload]
            if v < least:
                raise _Refused(f"{key} too small, must be >= {least}, got {v}")
            size = min(v, SIZE_MAX // MB) * MB
            out["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"] = size
        elif key == "garbage_collection_threshold":
            i = tok.value(i)
            t = tok.double(i)
            if not 0 < t < 1.0:
                raise _Refused(f"garbage_collection_threshold must be in (0.0, 1.0), got {t}")
            out["garbage_collection_threshold"] = t
        elif key == "roundup_power2_divisions":
            i = _roundup(tok, i, out)
        elif key == "expandable_segments":
            i = tok.value(i)
            out["expandable_segments"] = tok.boolean(i)
        elif key == "pinned_use_background_threads":
            i = tok.value(i)
            tok.boolean(i)
        elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            i = tok.value(i)
            tok.size_t(i)
        else:
            if cuda and key not in known:
                raise _Refused(f"unrecognized key {quote(key)} (PyTorch: \"Unrecognized key ... in Accelerator "
                               f"allocator config\"; known: {', '.join(GENERIC_KEYS + CUDA_KEYS)})")
            i = tok.skip_key(i)
        if i + 1 < len(tok):
            i += 1
            tok.check(i, ",")
        i += 1
    # 2. the CUDA hook
    i = 0
    while cuda and i < len(tok):
        key = tok[i]
        if key == "backend":
            i = tok.value(i)
            if tok[i] not in ("native", "cudaMallocAsync"):
                raise _Refused("unknown allocator backend: options are native and cudaMallocAsync")
            out["backend"] = tok[i]
        elif key in ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
                     "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_free_catch_all"):
            i = tok.value(i)
            tok.boolean(i)
        elif key == "throw_on_cudamalloc_oom":
            i = tok.value(i)
            out["throw_on_cudamalloc_oom"] = tok.boolean(i)
        elif key == "pinned_num_register_threads":
            i = tok.value(i)
            v = tok.size_t(i)
            if not _power_of_two(v):
                raise _Refused(f"pinned_num_register_threads has to be a power of 2, got {v}")
            if v > 128:  # pinned_max_register_threads()
                raise _Refused(f"pinned_num_register_threads should be at most 128, got {v}")
        elif key == "pinned_reserve_segment_size_mb":
            i = tok.value(i)
            if tok.size_t(i) == 0:
                raise _Refused("pinned_reserve_segment_size_mb has to be greater than 0")
        elif key == "per_process_memory_fraction":
            i = tok.value(i)
            f = tok.double(i)
            if not 0.0 <= f <= 1.0:
                raise _Refused(f"per_process_memory_fraction must be in [0.0, 1.0], got {f}")
            out["per_process_memory_fraction"] = f
        else:
            i = tok.skip_key(i)
        if i + 1 < len(tok):
            i += 1
            tok.check(i, ",")
        i += 1
    out["keys"] = tuple(dict.fromkeys(keys))
    return out


def _roundup(tok: _Tokens, i: int, out: dict[str, object]) -> int:
    """parseRoundUpPower2Divisions: one power of two for every size, or [size:divisions, ..., >:divisions] per
    interval (sizes in MB; each a power of two; the first entry also fills the intervals below it; ``>`` fills
    the ones after the last)."""
    div = [0] * INTERVALS
    tok.check(i + 1, ":")
    i += 2
    first = True
    if tok[i] == "[":
        last = 0
        i += 1
        while i < len(tok) and tok[i] != "]":
            at = i
            i = tok.value(i)
            value = tok.size_t(i)
            if not (value == 0 or _power_of_two(value)):
                raise _Refused("roundup_power2_divisions: the divisions have to be a power of 2 or 0")
            if tok[at] == ">":
                for k in range(last + 1, INTERVALS):
                    div[k] = value
            else:
                boundary = tok.size_t(at)
                if not _power_of_two(boundary):
                    raise _Refused("roundup_power2_divisions: the intervals have to be powers of 2")
                index = min(max(boundary.bit_length() - 1, 0), INTERVALS - 1)
                if first:
                    for k in range(index):
                        div[k] = value
                    first = False
                div[index] = value
                last = index
            if tok[i + 1] != "]":
                i += 1
                tok.check(i, ",")
            i += 1
        if i >= len(tok):
            raise _Refused("roundup_power2_divisions: a '[' list is never closed with ']'")
    else:
        value = tok.size_t(i)
        if not _power_of_two(value):
            raise _Refused(f"roundup_power2_divisions has to be a power of 2, got {value}")
        div = [value] * INTERVALS
    out["roundup_power2_divisions"] = tuple(div)
    return i
