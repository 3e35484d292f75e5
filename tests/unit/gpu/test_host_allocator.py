"""The C allocator's thresholds keep the steps' freed memory for the next step; an idle
engine's release gives it back to the OS (glibc hosts)."""

from __future__ import annotations

import platform

import pytest
import torch

from tidal.gpu.cpu.host_allocator import keep_freed_host_memory, release_freed_host_memory

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the thresholds and the release are glibc's")


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024


def test_freed_step_memory_stays_until_released() -> None:
    assert keep_freed_host_memory()
    before = _rss_anon_mb()
    temporaries = [torch.ones(1 << 18) for _ in range(256)]  # 256 MB in 1 MB blocks
    del temporaries
    kept = _rss_anon_mb() - before
    assert kept > 128, f"only {kept:.0f} MB of 256 kept: the thresholds do not hold it"
    assert release_freed_host_memory()
    left = _rss_anon_mb() - before
    assert left < 32, f"{left:.0f} MB still resident after the release"
