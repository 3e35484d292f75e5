"""Pages of a memory-mapped checkpoint let go once read.

safetensors maps its files, and a weight read through the map (quantized, copied into the
model) leaves its pages in the process's resident set until the file is closed: quantizing
gpt-oss's 1.2 GB output head kept 1.2 GB of it resident at the load's peak, beside everything
the load made. ``MappedPages.let_go`` drops such pages from the resident set (``madvise``'s
``MADV_DONTNEED``) once read; they stay in the page cache, and a later read faults them back
from it. Only pages of file mappings none of whose pages the process has written to are let
go: there that is harmless, where on memory of the process's own (an anonymous map, a private
page written to) it would zero or undo the data. Off Linux nothing is let go.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform
from pathlib import Path

import torch

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
MIN_BYTES = 1 << 20  # less is not worth reading the mappings for (tens of ms)
SMAPS = Path("/proc/self/smaps")


def _clean_file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files that hold no page of its own
    (``Anonymous: 0 kB``: none written to since mapped, so each page is the file's)."""
    ranges, current = [], None
    for line in SMAPS.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            start, end = (int(x, 16) for x in fields[0].split("-"))
            current = (start, end) if len(fields) == 6 and fields[5].startswith("/") else None
        elif fields[0] == "Anonymous:" and current is not None and fields[1] == "0":
            ranges.append(current)
    return ranges


class MappedPages:
    """Lets go of tensors' pages where they view a clean file mapping; the mappings are read
    once, at the first tensor of ``MIN_BYTES`` or more (make one per weight read in chunks,
    and none while that weight's mapping may be written to)."""

    def __init__(self) -> None:
        self.enabled = platform.system() == "Linux" and SMAPS.exists()
        self.ranges: list[tuple[int, int]] | None = None
        self.libc = None

    def _clean_ranges(self) -> list[tuple[int, int]]:
        if self.ranges is None:
            self.ranges = _clean_file_mappings()
            self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return self.ranges

    def let_go(self, t: torch.Tensor) -> int:
        """Drop the whole pages ``t``'s bytes cover from the resident set, where they lie in a
        file mapping none of whose pages is the process's own; the bytes let go (0 elsewhere)."""
        if (not self.enabled or t.device.type != "cpu" or not t.is_contiguous()
                or t.nbytes < MIN_BYTES):
            return 0
        ranges = self._clean_ranges()
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page
        if last <= first or not any(lo <= first and last <= hi for lo, hi in ranges):
            return 0
        if self.libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                             MADV_DONTNEED) != 0:
            return 0
        return last - first
