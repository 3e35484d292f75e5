"""GPTQ and AWQ checkpoints as Hugging Face saves them (``quant_method`` ``gptq`` or ``awq`` in
config.json's ``quantization_config``), read into ``QuantizedWeight``s that stay quantized.

Both store a linear of ``[out, in]`` as three tensors, scales and zeros per group of ``G``
consecutive inputs, and dequantize as ``(q - zero) * scale``:

- GPTQ (AutoGPTQ, GPTQModel): ``qweight`` int32 ``[in / p, out]`` packed along the inputs
  (``p = 32 / bits`` values a word, the first in the lowest bits), ``qzeros`` int32
  ``[in / G, out / p]`` packed along the outputs, ``scales`` ``[in / G, out]``, ``g_idx`` the
  group of each input. The original (v1) format stores each zero minus one; ``gptq_v2`` stores
  it as it is.
- AWQ (AutoAWQ's ``gemm`` version): ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` int32
  ``[in / G, out / 8]``, both packed along the outputs with the eight nibbles of a word holding
  outputs ``0, 2, 4, 6, 1, 3, 5, 7`` of its eight, and ``scales`` ``[in / G, out]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from tidal.gpu.checkpoints.int_packing import (
    PACKED_BITS,
    CheckpointTensors,
    Weight,
    affine_weight,
    iter_quantized,
    unpack_int32,
)
from tidal.gpu.quantization.weights import QuantizedWeight

GPTQ_PARTS = frozenset(("qweight", "qzeros", "scales", "g_idx"))
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_PARTS = frozenset(("qweight", "qzeros", "scales"))
# Output j of a word's eight is the nibble AWQ_UNDO[j] of it (AWQ packs 0, 2, 4, 6, 1, 3, 5, 7).
AWQ_UNDO = (0, 4, 1, 5, 2, 6, 3, 7)


def gptq_weights(model_dir: Path, config: dict) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's weights, each GPTQ linear a ``QuantizedWeight``. The configuration is
    checked now, so an unreadable checkpoint fails before the first tensor is read."""
    bits = config.get("bits")
    if bits not in PACKED_BITS:
        raise ValueError(f"GPTQ checkpoints of {bits} bits are not read: tidal reads 4- and "
                         "8-bit GPTQ")
    fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not read: tidal reads "
                         f"{', '.join(GPTQ_FORMATS)} (a Marlin or BitBLAS repack is not)")
    if config.get("dynamic"):
        raise ValueError("GPTQ checkpoints with per-module settings (GPTQModel's dynamic) are "
                         "not read: every linear must share the config's bits")
    zero_shift = 1 if fmt == "gptq" else 0  # v1 stores each zero minus one
    desc_act = bool(config.get("desc_act"))

    def read(module: str, tensors: CheckpointTensors) -> QuantizedWeight:
        q = unpack_int32(tensors.get(f"{module}.qweight"), bits, 0).t()
        zeros = unpack_int32(tensors.get(f"{module}.qzeros"), bits, 1).t() + zero_shift
        scales = tensors.get(f"{module}.scales").t()
        if zeros.shape[0] != q.shape[0]:
            raise ValueError(f"{module}: qzeros hold {zeros.shape[0]} outputs, qweight "
                             f"{q.shape[0]}")
        _check_contiguous_groups(module, tensors, q.shape[1], scales.shape[1], desc_act)
        return affine_weight(bits, q, zeros, scales)

    return iter_quantized(model_dir, "qweight", GPTQ_PARTS, read)


def _check_contiguous_groups(module: str, tensors: CheckpointTensors, inputs: int,
                             groups: int, desc_act: bool) -> None:
    """GPTQ's act-order (``desc_act``) gives inputs to groups in the order of their
    importance, through ``g_idx``. Our weights take groups of consecutive inputs; turning the
    one into the other would reorder the inputs, and with them the activations every forward,
    which the model does not do. So ``g_idx`` must be the trivial ``k // G``."""
    name = f"{module}.g_idx"
    if not tensors.has(name):
        if desc_act:
            raise ValueError(f"{module}: desc_act is set but the checkpoint has no g_idx")
        return
    g_idx = tensors.get(name).to(torch.int64)
    trivial = torch.arange(inputs) // (inputs // groups)
    if g_idx.shape != trivial.shape or not torch.equal(g_idx, trivial):
        raise ValueError(f"{module}: this GPTQ checkpoint was quantized with desc_act "
                         "(act-order): its g_idx puts inputs in groups out of order, which "
                         "tidal does not read; quantize with desc_act=False")


def awq_weights(model_dir: Path, config: dict) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's weights, each AWQ linear a ``QuantizedWeight`` (``gemm`` version only:
    ``gemv`` and Marlin checkpoints pack their words otherwise)."""
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"AWQ checkpoints of {bits} bits are not read: tidal reads 4-bit AWQ")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not read: tidal reads the 'gemm' layout "
                         "(AutoAWQ's default)")

    def read(module: str, tensors: CheckpointTensors) -> QuantizedWeight:
        if not tensors.has(f"{module}.qzeros"):
            raise ValueError(f"{module}: an AWQ linear without qzeros (zero_point=False) is "
                             "not read")
        q = _awq_unpack(tensors.get(f"{module}.qweight")).t()
        zeros = _awq_unpack(tensors.get(f"{module}.qzeros")).t()
        scales = tensors.get(f"{module}.scales").t()
        return affine_weight(4, q, zeros, scales)

    return iter_quantized(model_dir, "qweight", AWQ_PARTS, read)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """``[rows, cols / 8]`` int32 words to ``[rows, cols]`` values in the outputs' order."""
    rows = packed.shape[0]
    nibbles = unpack_int32(packed, 4, 1).view(rows, -1, 8)
    return nibbles[..., list(AWQ_UNDO)].reshape(rows, -1)
