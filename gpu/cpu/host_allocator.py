"""Keep the C allocator from handing tensor memory back to the OS between steps.

On the CPU every step allocates and frees many tensors of several MB (a layer's gathered KV
context, prefill activations). With glibc's defaults, blocks that big on the main thread are
mmap'd and unmapped on each use, or trimmed off the top of the heap when freed, so every step
page-faults its working set back in (docs/cpu-backend.md has what that cost). Raising glibc's
mmap and trim thresholds keeps it there (the process holds on to its peak working set, as
tcmalloc or jemalloc would).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt(3) parameters from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for this setting on 64-bit hosts
TRIM_THRESHOLD_BYTES = 1 << 30

_applied = False


def keep_freed_host_memory() -> bool:
    """Apply the thresholds once per process; ``False`` where the C library is not glibc."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not ok:
        logger.warning("mallopt refused the allocator thresholds; CPU steps may page-fault")
    _applied = ok
    return ok


def release_freed_host_memory() -> bool:
    """Hand the C allocator's free pages back to the OS once (``malloc_trim``): after loading,
    where the thresholds above would keep every temporary of the load resident for good (a
    quantized model's unpacked values, freed as each layer is packed). ``False`` where the C
    library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc_trim(0)
    return True
