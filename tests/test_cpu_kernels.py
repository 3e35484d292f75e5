"""The compiled CPU kernels' thread settings: denormals flushed on the whole torch pool."""

from __future__ import annotations

import subprocess
import sys

# A fresh interpreter, whose worker threads have never been flushed.
SCRIPT = """
import torch
from gpu.cpu_kernels import denormals_flushed
torch.set_num_threads(2)
tiny, scale = torch.full((1 << 20,), 1e-30), torch.full((1 << 20,), 1e-10)
before = int(((tiny * scale) == 0).sum())
with denormals_flushed():
    inside = int(((tiny * scale) == 0).sum())
    normal_kept = bool((torch.full((8,), 1e-20) * 1e-10 != 0).all())
after = 1e-300 * 1e-10 != 0.0  # Python's own floats on this thread, unflushed again
print(before, inside, normal_kept, after)
"""


def test_denormals_flushed_on_every_worker_and_restored_on_the_caller():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True).stdout.split()
    assert int(out[0]) == 0  # 1e-40 is a denormal, kept by default
    assert int(out[1]) == 1 << 20  # a multiply split across the pool: every share flushed
    assert out[2] == "True"  # 1e-30 is a normal float: untouched
    assert out[3] == "True"  # the calling thread keeps IEEE denormals outside the block
