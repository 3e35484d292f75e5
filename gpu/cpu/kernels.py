"""Compiled CPU kernels: paged decode attention (``attention.cpp``) and prefill attention
(``prefill_attention.cpp``), the float32 GEMM of the
linear layers (``linear.cpp``, with MKL's packed GEMM for many rows in
``mkl_linear.cpp``), the MLP's SiLU(gate) * up (``activation.cpp``), the
greedy sampler's argmax (``argmax.cpp``), and the KV-cache write, RMSNorm (with or without
the residual add before it), rotary embeddings and the flush of denormal floats on torch's
worker threads (``kernels.cpp``).

The sources are compiled on first use with torch's extension builder (a C++ compiler and ninja
are needed) for this machine's instruction set, and cached under ``TORCH_EXTENSIONS_DIR``; the
first start on a machine spends under a minute on it (45 s on 2 cores). Where they cannot be
built, callers keep their plain torch paths.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name
           for name in ("kernels.cpp", "attention.cpp", "prefill_attention.cpp", "linear.cpp",
                        "mkl_linear.cpp", "activation.cpp", "argmax.cpp", "inputs.cpp",
                        "decoder.cpp")]
HEADERS = [CSRC / name for name in ("kernels.h", "paged.h", "parallel.h", "vec.h")]
DISABLE_ENV = "TIDAL_NO_CPU_KERNELS"  # set to 1 to skip building the kernels (read once)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_pool_flushed = threading.local()


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Flush denormal floats to zero while the block runs on this thread, and on its torch
    worker threads for good (they run nothing but torch work).

    Softmax leaves many attention weights below float32's normal range (exp of a score far
    under the row's maximum), and every multiply that touches one takes x86's slow microcode
    path: with real scores, decode attention ran twice slower and its softmax three times.
    What flushing drops is below 1.2e-38, beneath float32's resolution of any output here.
    The calling thread gets its previous setting back on exit, as Python's own float maths
    runs on it. The workers are reached through the kernels; without them only the calling
    thread is flushed (and left unflushed on exit, the default).
    """
    kernels = load_cpu_kernels()
    if kernels is None:
        torch.set_flush_denormal(True)
        try:
            yield
        finally:
            torch.set_flush_denormal(False)
        return
    previous = kernels.set_thread_flush(True)
    try:
        if not getattr(_pool_flushed, "done", False):
            kernels.flush_denormals_in_pool()
            _pool_flushed.done = True
        yield
    finally:
        kernels.set_thread_flush(previous)


def cpu_kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The kernels where ``x`` is a CPU tensor of a dtype they handle and they are built."""
    if x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES:
        return None
    return load_cpu_kernels()


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled kernels, or ``None`` (with a warning saying why) where they can't be built."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    from torch.utils.cpp_extension import load

    _put_interpreter_bin_on_path()
    name = f"tidal_cpu_kernels_{_build_key()}"
    logger.info("loading the C++ CPU kernels (built once per machine)")
    try:
        return load(name=name, sources=[str(path) for path in SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, a failed build: keep the torch path
        logger.warning("C++ CPU kernels unavailable, using plain torch: %s",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def _put_interpreter_bin_on_path() -> None:
    """torch's builder looks for ninja on PATH; the ``ninja`` wheel installs it beside this
    interpreter, which is not on PATH when a virtualenv's python is run without activating."""
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _build_key() -> str:
    """Source and CPU features: a build made with ``-march=native`` on another machine (a
    shared home directory) must not be loaded here."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:12]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
