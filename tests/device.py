"""Where the device-aware tests run: ``TIDAL_TEST_DEVICE=cuda`` puts the fidelity tests and the
integration tests' servers on the GPU (default: the CPU)."""

import os

import torch

TEST_DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cpu")
# The KV cache of each engine a GPU test builds: fixed, so several fit on one GPU side by side
# (by default an engine takes 90 % of the GPU's memory).
GPU_TEST_KV_CACHE = 256 << 20
# Where the Triton kernels' tests run: TEST_DEVICE; with none named, a GPU where there is one
# (Triton's interpreter is off there), else the CPU in the interpreter.
KERNEL_TEST_DEVICE = (TEST_DEVICE if TEST_DEVICE != "cpu"
                      else "cuda" if torch.cuda.is_available() else "cpu")


def on_test_device(**engine_args: object) -> dict[str, object]:
    """``engine_args`` for an engine on ``TEST_DEVICE``: on a GPU, with the fixed test KV
    cache unless they name one."""
    engine_args.setdefault("device", TEST_DEVICE)
    if TEST_DEVICE != "cpu":
        engine_args.setdefault("kv_cache_memory", GPU_TEST_KV_CACHE)
    return engine_args
