import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests run tidal's kernels wherever they apply, as the kernel tests expect; the selector's
# tests set ``auto`` themselves, with their own timings and plan caches.
os.environ.setdefault("TIDAL_CPU_KERNELS", "force")
# Without a GPU, Triton kernels run in its interpreter. It reads the variable when triton is
# first imported, which any test module may do first: set it before all of them.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
