"""Big CPU tensors of a process that imports tidal first sit on transparent huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TENSOR_MB = 64

# A fresh process: tidal first, as the server and `from tidal import LLM` do, then one tensor
# far past the 2 MB threshold; prints the process's anonymous huge pages in kB.
PROBE = f"""
import tidal, torch
t = torch.ones({TENSOR_MB} << 20, dtype=torch.uint8)
rollup = open("/proc/self/smaps_rollup").read().splitlines()
print(next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages")))
"""


def huge_kb(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, check=True,
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    return int(out.stdout.split()[-1])


def host_offers_huge_pages() -> bool:
    return THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()


@pytest.mark.cpu_only("what is checked is the host memory of a CPU tensor")
@pytest.mark.skipif(not host_offers_huge_pages(), reason="this kernel offers no huge pages")
def test_a_big_tensor_lands_on_huge_pages_unless_the_user_says_not():
    assert huge_kb() >= TENSOR_MB * 1024 // 2  # most of it (the kernel may fall short a page)
    assert huge_kb(THP_MEM_ALLOC_ENABLE="0") == 0
