"""MXFP4 checkpoints (``quant_method`` ``mxfp4`` in config.json's ``quantization_config``), as
openai/gpt-oss publishes its experts, dequantized as they are read.

A matrix ``W`` of ``[..., out, in]`` is stored as two uint8 tensors (the OCP Microscaling
format, MX): ``{W}_blocks`` ``[..., out, in / 32, 16]``, each row cut in blocks of 32 FP4
(E2M1) values, two a byte with the even element in the low nibble; and ``{W}_scales``
``[..., out, in / 32]``, each block's shared E8M0 scale ``2 ** (s - 127)``. An E2M1 nibble is a
sign bit and one of eight magnitudes (``FP4_E2M1``). Every other tensor is stored in float.

Dequantized values are exact in bfloat16 (a magnitude has at most two significant bits, and
bfloat16 has float32's exponent range), the dtype they are read in. The reader gives each
matrix transposed, ``[..., in, out]``: transformers holds gpt-oss's experts so, and so do its
float checkpoints, which the model's loader takes alike (``gpu/models/gpt_oss.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tidal.gpu.checkpoints.safetensors_files import safetensors_files

# an E2M1 nibble's value: bit 3 the sign, bits 0-2 the magnitude's index
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127  # an E8M0 scale byte s stands for 2 ** (s - 127)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., G * 32]`` values from ``blocks`` uint8 ``[..., G, 16]`` and ``scales`` uint8
    ``[..., G]``; one leading slice at a time, so the lookup's indices stay small."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales "
                         f"{list(scales.shape)} (blocks must be [..., G, 16], scales [..., G])")
    if blocks.dim() > 2:
        return torch.stack([dequantize_mxfp4(b, s, dtype) for b, s in zip(blocks, scales)])
    table = torch.tensor(FP4_E2M1, dtype=dtype, device=blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [G, 32], even elements first
    exponents = scales.to(torch.int32)[..., None] - SCALE_BIAS
    return torch.ldexp(values, exponents).to(dtype).flatten(-2)


def mxfp4_weights(model_dir: Path, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's weights: each ``{W}_blocks``/``{W}_scales`` pair as ``W`` dequantized
    and transposed (see above), every other tensor as it is."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for name in sorted(names):
                if name.endswith(SCALES) and name[:-len(SCALES)] + BLOCKS in names:
                    continue  # read with its blocks
                if not name.endswith(BLOCKS):
                    yield name, f.get_tensor(name)
                    continue
                base = name[:-len(BLOCKS)]
                if base + SCALES not in names:
                    raise ValueError(f"{file}: {name} has no {base + SCALES} beside it")
                weight = dequantize_mxfp4(f.get_tensor(name), f.get_tensor(base + SCALES))
                yield base, weight.transpose(-1, -2)
