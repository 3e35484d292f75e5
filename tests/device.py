"""Where the device-aware tests run: ``TIDAL_TEST_DEVICE=cuda`` puts the fidelity tests and the
integration tests' servers on the GPU (default: the CPU)."""

import os

TEST_DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cpu")
# The KV cache of each engine a GPU test builds: fixed, so several fit on one GPU side by side
# (by default an engine takes 90 % of the GPU's memory).
GPU_TEST_KV_CACHE = 256 << 20
