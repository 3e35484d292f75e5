"""What this CPU is: its model name and instruction-set flags, read from ``/proc/cpuinfo``.

Kernel builds and the selector's cached choices are keyed by these, so that neither is reused
on another machine (a shared home directory, a container image moved between hosts).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# The flags that decide which kernels run well: vector width, FMA, half-precision and matrix
# units. ``avx2`` alone (Zen 2/3, older Intel) and ``avx512f`` hosts take different code paths.
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
              "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
              "amx_int8", "asimd", "sve", "bf16", "i8mm")


@functools.cache
def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields (x86 names its flags ``flags``, ARM ``Features``)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    fields = _cpuinfo_fields()
    return fields.get("model name") or fields.get("Model") or platform.processor() or "unknown"


def cpu_flags() -> frozenset[str]:
    fields = _cpuinfo_fields()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


def simd_flags() -> list[str]:
    """The flags of ``SIMD_FLAGS`` this CPU has, in that order."""
    flags = cpu_flags()
    return [flag for flag in SIMD_FLAGS if flag in flags]


def describe() -> str:
    """One line naming the CPU, its SIMD flags and its cores, for logs and results files."""
    import os

    flags = " ".join(simd_flags()) or "no SIMD flags read"
    return f"{cpu_model()} ({flags}; {os.cpu_count()} cores)"
