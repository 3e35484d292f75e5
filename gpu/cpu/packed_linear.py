"""Linear layers whose weights are packed once at load time, for inference on the CPU.

``F.linear`` on the CPU hands every call to MKL's sgemm, which re-packs the weight into its
blocked layout each time; for the few rows of a decode step that costs about as much as the
multiply. So every weight is packed once:

- float32, where the C++ kernels are built: into the column panels of tidal's own GEMM
  (``linear.cpp``), which overlaps each weight's trip from memory with the arithmetic.
  Over a 30M Llama's 33 weights on a 2-core AVX-512 host, one pass took (ms, oneDNN packed
  against ours): 4.6 vs 2.8 at 1 row, 5.4 vs 3.3 at 8, 10.5 vs 7.0 at 32, 15.5 vs 11.8 at 64,
  and even at 128 (at 32 rows ours is 6.5 ms since the work split of ``linear.cpp``).
  Where torch has MKL, each weight is also packed for MKL's packed GEMM
  (``mkl_linear.cpp``), which takes steps of 128 rows and more (big decode batches,
  prefill chunks): 10 % faster there. That second copy doubles the float32 weights' memory,
  so it is made only while the linears hold at most ``MKL_PACK_MAX_BYTES``.
  Without MKL, from ``PLAIN_GEMM_MIN_ROWS`` rows the panels are copied back to a plain
  ``W^T`` for torch's GEMM, a copy far smaller than the multiply.
- otherwise (bfloat16, or no kernels): for oneDNN, which against plain ``F.linear`` gave
  (GFLOP/s) 223 vs 117 at 16 rows, 278 vs 177 at 32, 328 vs 258 at 64 and parity at 2,048.

Both give ordinary IEEE float results (no reduced-precision maths): they differ from
``F.linear`` only in summation order and fused multiply-adds.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gpu.cpu.kernels import load_cpu_kernels

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Without MKL's packs, from this many rows (long prefill chunks) the float32 panels are laid
# out plainly again for torch's sgemm, which then outruns the panel GEMM: for [rows, 512] x
# [512, 2816], 16.2 against 18.8 ms at 2,048 rows and 9.1 against 10.1 at 1,024 (the copy
# included); even at 512.
PLAIN_GEMM_MIN_ROWS = 1024
# The most float32 linear-weight bytes given a second copy packed for MKL (about 250M
# parameters); a larger model keeps the panels alone.
MKL_PACK_MAX_BYTES = 1 << 30


class PackedLinear(nn.Module):
    """``y = x W^T + b`` over a packed copy of ``W``. The plain weight is dropped with the
    ``nn.Linear`` (a tied output head's stays, as the input embedding). The packed bytes are
    opaque: convert the model's dtype before packing, never after."""

    def __init__(self, linear: nn.Linear, mkl_pack: bool = True) -> None:
        """``mkl_pack``: also pack a float32 weight for MKL's GEMM, where torch has MKL."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        kernels = load_cpu_kernels() if weight.dtype == torch.float32 else None
        self.own_gemm = kernels is not None
        packed = (kernels.pack_linear_weight(weight) if kernels is not None
                  else torch.ops.mkldnn._reorder_linear_weight(weight))
        self.register_buffer("packed_weight", packed, persistent=False)
        # MKL's pack keeps metadata tied to its address: a buffer never to be copied or moved.
        mkl_packed = (kernels.mkl_pack_linear_weight(weight) if kernels is not None and mkl_pack
                      else None)
        self.register_buffer("mkl_packed_weight", mkl_packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.own_gemm:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                      [None], "")
        rows = x.reshape(-1, self.in_features)
        if self.mkl_packed_weight is None and rows.shape[0] >= PLAIN_GEMM_MIN_ROWS:
            return self._plain_linear(rows).view(*x.shape[:-1], self.out_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()  # the kernel reads each row as one run of floats
        y = load_cpu_kernels().packed_linear(rows, self.packed_weight, self.out_features,
                                             self.bias, self.mkl_packed_weight)
        return y.view(*x.shape[:-1], self.out_features)

    def _plain_linear(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows W^T + b`` by torch's GEMM, from a plain copy of ``W^T`` made from the panels
        (a memory-bound copy, small beside the multiply at this many rows)."""
        panels = self.packed_weight  # [ceil(N / 32), K, 32]: columns 32p..32p+31 of W^T
        w_t = panels.permute(1, 0, 2).reshape(self.in_features, -1)[:, : self.out_features]
        if self.bias is None:
            return torch.mm(rows, w_t)
        return torch.addmm(self.bias, rows, w_t)

    def extra_repr(self) -> str:
        layout = "oneDNN"
        if self.own_gemm:
            layout = "panels" + ("" if self.mkl_packed_weight is None else " and MKL's pack")
        return f"in_features={self.in_features}, out_features={self.out_features}, {layout}"


def can_pack(device: str | torch.device, dtype: torch.dtype) -> bool:
    """A CPU with oneDNN; bfloat16 only where oneDNN has a bfloat16 path (AVX-512 or AVX-NE)."""
    if (torch.device(device).type != "cpu" or dtype not in PACKABLE_DTYPES
            or not torch.backends.mkldnn.is_available()):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(model: nn.Module, mkl_pack_max_bytes: int = MKL_PACK_MAX_BYTES) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a ``PackedLinear``; returns how many. Their
    float32 weights get MKL's second copy while they hold ``mkl_pack_max_bytes`` or fewer."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    float32_bytes = sum(child.weight.nbytes for _, _, child in swaps
                        if child.weight.dtype == torch.float32)
    mkl_pack = float32_bytes <= mkl_pack_max_bytes
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, mkl_pack))
    logger.debug("packed %d linear layers", len(swaps))
    return len(swaps)
