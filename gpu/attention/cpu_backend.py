"""The CPU attention backend: decode rows read the paged cache in place through C++ kernels.

``cpu_paged_attention.cpp`` is compiled on first use with torch's extension builder (a C++
compiler and ninja are needed) for this machine's instruction set, and cached under
``TORCH_EXTENSIONS_DIR``; the first start on a machine takes about a minute for it. Where it
cannot be built, ``get_attention_backend`` falls back to the torch backend, which gathers each
decode row's context into a copy first. Prefill chunks take the torch path either way: they are
compute-bound, and torch's fused attention runs them at GEMM speed.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
DISABLE_ENV = "TIDAL_NO_CPU_KERNELS"  # set to 1 to skip building the kernels


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, rows: list[int],
                out: torch.Tensor) -> None:
        """All decode rows in one pass whatever their lengths: softmax(q.k * scale) @ v."""
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        tokens = torch.tensor([qsl[i] for i in rows])
        row_index = torch.tensor(rows)
        max_len = max(lens[i] for i in rows)
        scores = torch.full((len(rows), query.shape[1], max_len), float("-inf"))
        self.kernels.decode_scores(scores, query, key_cache, meta.block_table, meta.seq_lens,
                                   row_index, tokens, scale)
        probs = torch.softmax(scores, dim=-1)
        self.kernels.decode_weighted_values(out, probs, value_cache, meta.block_table,
                                            meta.seq_lens, row_index, tokens)


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled kernels, or ``None`` (with a warning saying why) where they can't be built."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    from torch.utils.cpp_extension import load

    _put_interpreter_bin_on_path()
    name = f"tidal_cpu_attention_{_build_key()}"
    logger.info("loading the C++ CPU attention kernels (built once per machine)")
    try:
        return load(name=name, sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, a failed build: keep the torch path
        logger.warning("C++ CPU attention kernels unavailable, using torch's gather path: %s",
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
    digest = hashlib.sha256(SOURCE.read_bytes())
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
