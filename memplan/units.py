"""Dtype sizes, byte formatting and parsing, integer rounding.

Units: GiB = 2**30 bytes (binary), GB = 10**9 bytes (decimal). Display is always binary and says so.
"""

from __future__ import annotations

import re

from memplan.errors import SettingsError
from memplan.inputs import quote

#: Bytes per element of each dtype name used in config.json / safetensors / torch.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}

#: safetensors header dtype codes -> torch dtype names.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}

_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}


def normalize_dtype(name: str) -> str:
    """Map "torch.bfloat16", "bf16", "BF16" etc. to the canonical names of :data:`DTYPE_BYTES`."""
    key = str(name).removeprefix("torch.").strip()
    key = SAFETENSORS_DTYPES.get(key, key).lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise SettingsError(f"unknown dtype {quote(name)}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return key


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[normalize_dtype(name)]


def ceil_div(a: int, b: int) -> int:
    """Integer ceiling of a / b for non-negative a and positive b."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= a."""
    return ceil_div(a, multiple) * multiple


GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


def fmt_bytes(n: int) -> str:
    """Binary units, two decimals: 1.50 GiB, 12.00 MiB, 512 B."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1 << 40,
    "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40,
}


#: no size given for one device (GPU memory, a context, a buffer) is this large
MAX_SIZE = 2**50


def parse_size(text: str, allow_zero: bool = False) -> tuple[int, str]:
    """Parse "80GB" (10**9) or "80GiB" (2**30) or a plain byte count.

    Returns (bytes, how it was read) so the output can say which interpretation was used.
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise SettingsError(f"memory size {quote(text)} is not a number with an optional unit (e.g. 80GB, 80GiB)")
    value, unit = m.group(1), m.group(2).lower()
    if unit == "" and float(value) != 0:
        # "80" would be 80 bytes: almost always a size whose unit was forgotten
        raise SettingsError(f"memory size {quote(text)} has no unit: write {value}GB (10^9), {value}GiB (2^30) or "
                            f"{value}B for bytes")
    if unit in ("k", "m", "g", "t"):
        raise SettingsError(f"memory size {quote(text)} is ambiguous: write {value}{unit.upper()}B (10^"
                            f"{ {'k': 3, 'm': 6, 'g': 9, 't': 12}[unit]}) or {value}{unit.upper()}iB (2^"
                            f"{ {'k': 10, 'm': 20, 'g': 30, 't': 40}[unit]})")
    if unit not in _SIZE_UNITS:
        raise SettingsError(f"memory size {quote(text)}: unknown unit {quote(m.group(2))}; use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    x = float(value) * _SIZE_UNITS[unit]
    if not x < MAX_SIZE:  # also inf, from a number too long for a float
        raise SettingsError(f"memory size {quote(text)} is more than 1 PiB: not a size for one device")
    n = int(round(x))
    if n < 0 or (n == 0 and not allow_zero):
        raise SettingsError(f"memory size {quote(text)} must be positive")
    label = {"": "bytes", "b": "bytes"}.get(unit, m.group(2))
    base = "decimal, 10^" + str({"kb": 3, "mb": 6, "gb": 9, "tb": 12}[unit]) if unit in ("kb", "mb", "gb", "tb") else (
        "binary, 2^" + str({"kib": 10, "mib": 20, "gib": 30, "tib": 40, "k": 10, "m": 20, "g": 30, "t": 40}[unit])
        if unit not in ("", "b") else "bytes")
    return n, f"{value} {label} ({base}) = {n} bytes"
