"""Compiled CPU kernels: paged decode attention (``attention.cpp``) and prefill attention
(``prefill_attention.cpp``), the float32 GEMM of the linear layers (``linear.cpp``, with MKL's
packed GEMM for many rows in ``mkl_linear.cpp``), the quantized linears (``quant_linear.cpp``,
and ``dot_linear.cpp`` over int8-rounded activations), the MLP's SiLU(gate) * up
(``activation.cpp``), a block of quantized experts (``moe_block.cpp``), the one-call decode
step (``decoder.cpp``), the greedy sampler's argmax (``argmax.cpp``), and the KV-cache write,
RMSNorm (with or without the residual add before it), rotary embeddings and
the flush of denormal floats on torch's worker threads (``kernels.cpp``).

The sources are compiled on first use with torch's extension builder (a C++ compiler and ninja
are needed) for this machine's instruction set, and cached under ``TORCH_EXTENSIONS_DIR``; the
first start on a machine spends under a minute on it (45 s on 2 cores). Where they cannot be
built, callers keep their plain torch paths.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType

import torch

from tidal.gpu.cpu.host import cpu_flags, cpu_model
from tidal.gpu.cpu.selector import KERNELS, Plan, mode

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name
           for name in ("kernels.cpp", "attention.cpp", "prefill_attention.cpp", "linear.cpp",
                        "mkl_linear.cpp", "quant_linear.cpp", "dot_linear.cpp",
                        "planned_linear.cpp", "moe_block.cpp",
                        "activation.cpp", "argmax.cpp", "inputs.cpp", "decoder.cpp")]
HEADERS = [CSRC / name
           for name in ("decode_rows.h", "kernels.h", "paged.h", "parallel.h", "vec.h")]
# The instruction set to build for, as GCC's -march takes it: ``native`` (this CPU, the default)
# or a baseline such as ``x86-64-v3`` (AVX2 and FMA), to run here the code an AVX2 host runs.
ISA_ENV = "TIDAL_CPU_ISA"
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


def cpu_kernels_for(x: torch.Tensor, plan: Plan | None = None) -> ModuleType | None:
    """The kernels where ``x`` is a CPU tensor of a dtype they handle, they are built, and
    the op's ``plan`` (if any) gives ``x``'s rows to them rather than to torch."""
    if x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES:
        return None
    if plan is not None and plan.pick(x.shape[0] if x.dim() else 1) != KERNELS:
        return None
    return load_cpu_kernels()


_background: Future | None = None  # a build running on a thread of its own, while torch serves


def load_cpu_kernels() -> ModuleType | None:
    """The compiled kernels, or ``None``: switched off, being built in the background (until
    that build is done), or impossible to build here (with a warning saying why)."""
    if mode() == "off" or (_background is not None and not _background.done()):
        return None
    return _build_and_load()


def build_in_background() -> Future:
    """Start building the kernels on a thread of their own, if they are not built yet; until
    the returned future is done, ``load_cpu_kernels`` answers ``None`` and callers keep torch's
    paths. Its result is the kernels (or ``None`` where they cannot be built)."""
    global _background
    if _background is None:
        _background = Future()
        future = _background

        def build() -> None:
            try:
                future.set_result(_build_and_load())
            except BaseException as exc:  # never leave the future pending
                future.set_exception(exc)

        threading.Thread(target=build, name="tidal-kernel-build", daemon=True).start()
    return _background


@functools.cache
def _build_and_load() -> ModuleType | None:
    from torch.utils.cpp_extension import load

    _put_interpreter_bin_on_path()
    _clear_stale_lock()
    built = is_built()
    logger.info("%s the C++ CPU kernels for -march=%s", "loading" if built else
                "building (once per machine)", target_isa())
    if built and (module := _import_built()) is not None:
        return module
    owner = _build_dir() / BUILDER_FILE
    try:
        owner.parent.mkdir(parents=True, exist_ok=True)
        owner.write_text(str(os.getpid()))
        return load(name=build_name(), sources=[str(path) for path in SOURCES],
                    extra_cflags=["-O3", f"-march={target_isa()}", "-fopenmp"],
                    extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, a failed build: keep the torch path
        logger.warning("C++ CPU kernels unavailable, using plain torch: %s",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    finally:
        owner.unlink(missing_ok=True)


def _import_built() -> ModuleType | None:
    """The finished build imported as it is. Not through torch's builder, which compiles every
    source again when torch's headers are newer than its objects (torch reinstalled at the
    same version: minutes of compiling where the start should take seconds); the build's name
    holds what makes a build valid here (``build_name``). ``None`` if it cannot be imported
    (then the builder makes it again)."""
    path = _build_dir() / f"{build_name()}.so"
    try:
        spec = importlib.util.spec_from_file_location(build_name(), path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError as exc:
        logger.warning("the kernels' build at %s does not load (%s); building them again",
                       path, exc)
        return None


BUILDER_FILE = "tidal-builder.pid"  # the process building, beside torch's build lock
STALE_LOCK_SECONDS = 1800  # a lock no process of ours claims is stale after this long


def _build_dir() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(build_name(), verbose=False))


def _clear_stale_lock() -> None:
    """Remove torch's build lock when the process that took it is gone. A build cut short (a
    server stopped during its first start) leaves the lock behind, and torch's builder would
    wait for it forever."""
    lock = _build_dir() / "lock"
    if not lock.exists():
        return
    owner = lock.with_name(BUILDER_FILE)
    try:
        pid = int(owner.read_text())
        os.kill(pid, 0)
        return  # its builder is alive: wait for it
    except (OSError, ValueError):
        pass
    try:

        if owner.exists() or time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            logger.warning("removing a stale build lock left by a build cut short: %s", lock)
            lock.unlink(missing_ok=True)
    except OSError:
        pass


def _put_interpreter_bin_on_path() -> None:
    """torch's builder looks for ninja on PATH; the ``ninja`` wheel installs it beside this
    interpreter, which is not on PATH when a virtualenv's python is run without activating."""
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def target_isa() -> str:
    """The ``-march`` the kernels are built for (``TIDAL_CPU_ISA``, else ``native``)."""
    return os.environ.get(ISA_ENV, "").strip() or "native"


def build_name() -> str:
    """The build's name: the sources, torch's version (whose ABI the build links against), the
    target ISA and this CPU's model and flags, so that a build made for another torch, or with
    ``-march=native`` on another machine (a shared home directory), is never loaded here."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(f"{torch.__version__}|{target_isa()}|{cpu_model()}|"
                  f"{' '.join(sorted(cpu_flags()))}".encode())
    return f"tidal_cpu_kernels_{digest.hexdigest()[:12]}"


def is_built() -> bool:
    """Whether this machine has a finished build of the kernels, so loading them takes seconds
    rather than a compile."""
    return (_build_dir() / f"{build_name()}.so").is_file()
