"""What this CPU is: its model name and instruction-set flags, read from ``/proc/cpuinfo``.

Kernel builds and the selector's cached plans are keyed by these, so that neither is reused on
another machine (a shared home directory, a container image moved between hosts), and every
benchmark result names them.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# The flags that decide which kernels run well: vector width, FMA, half-precision and matrix
# units. ``avx2`` alone (Zen 2/3, older Intel) and ``avx512f`` hosts take different code paths.
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw",
              "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
              "amx_int8", "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm")


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags (x86 says ``flags``, ARM ``Features``)."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return model or platform.processor() or platform.machine(), flags


@functools.cache
def _this_cpu() -> tuple[str, frozenset[str]]:
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return parse_cpuinfo("")


def cpu_model() -> str:
    return _this_cpu()[0]


def cpu_flags() -> frozenset[str]:
    return _this_cpu()[1]


def simd_flags(flags: frozenset[str] | None = None) -> list[str]:
    """The flags of ``SIMD_FLAGS`` among ``flags`` (this CPU's by default), in that order."""
    flags = cpu_flags() if flags is None else flags
    return [flag for flag in SIMD_FLAGS if flag in flags]


def describe() -> str:
    """One line naming the CPU, its SIMD flags and its cores, for logs and results files."""
    flags = " ".join(simd_flags()) or "no SIMD flags read"
    return f"{cpu_model()} ({flags}; {os.cpu_count()} cores)"
