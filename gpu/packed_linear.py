"""Linear layers whose weights are packed once for oneDNN, for inference on the CPU.

``F.linear`` on the CPU hands every call to MKL's sgemm, which re-packs the weight into its
blocked layout each time. For the few rows of a decode step that packing costs about as much
as the multiply. Packing once at load time and calling oneDNN's linear directly gave, on a
2-core AVX-512 host over a 30M Llama's projections (float32, GFLOP/s, packed against plain):
223 vs 117 at 16 rows, 278 vs 177 at 32, 328 vs 258 at 64, 371 vs 326 at 512, and parity at
2,048. The results are ordinary IEEE float32 (no reduced-precision maths): they differ from
``F.linear`` only in summation order.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` over a oneDNN-packed copy of ``W``. The plain weight is dropped with
    the ``nn.Linear`` (a tied output head's stays, as the input embedding). The packed bytes
    are opaque: convert the model's dtype before packing, never after."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight),
                             persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                  [None], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_pack(device: str | torch.device, dtype: torch.dtype) -> bool:
    """oneDNN on a CPU; bfloat16 only where oneDNN has a bfloat16 path (AVX-512 or AVX-NE)."""
    if (torch.device(device).type != "cpu" or dtype not in PACKABLE_DTYPES
            or not torch.backends.mkldnn.is_available()):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a ``PackedLinear``; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    logger.debug("packed %d linear layers for oneDNN", len(swaps))
    return len(swaps)
