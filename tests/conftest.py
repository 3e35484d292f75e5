import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.device import TEST_DEVICE  # noqa: E402  (after the path above)

# Tests run tidal's kernels wherever they apply, as the kernel tests expect; the selector's
# tests set ``auto`` themselves, with their own timings and plan caches. The GPU suite's few
# engines on the CPU (the twins its GPU engines are checked against) take torch's paths: the
# CPU suite tests the kernels, and building them would cost a GPU machine minutes.
os.environ.setdefault("TIDAL_CPU_KERNELS", "force" if TEST_DEVICE == "cpu" else "off")
# Without a GPU, Triton kernels run in its interpreter. It reads the variable when triton is
# first imported, which any test module may do first: set it before all of them.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    """Under ``TIDAL_TEST_DEVICE=cuda``, a test marked ``cpu_only(reason)`` is skipped with its
    reason, which ``-rs`` prints: the GPU suite skips nothing without saying why."""
    if TEST_DEVICE == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is None:
            continue
        reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
        if not reason:
            raise pytest.UsageError(f"{item.nodeid}: cpu_only needs a reason")
        item.add_marker(pytest.mark.skip(reason=f"CPU only: {reason}"))


def pytest_configure(config):
    if TEST_DEVICE.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"TIDAL_TEST_DEVICE={TEST_DEVICE}, but torch sees no GPU")


@pytest.fixture(autouse=True)
def _kernel_mode_of_the_environment():
    """Each test starts from the environment's CPU kernel mode: an engine built with
    ``cpu_kernels=`` sets the whole process's (``gpu.cpu.selector.set_mode``)."""
    yield
    from tidal.gpu.cpu import selector

    selector.set_mode(None)
