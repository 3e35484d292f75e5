"""MXFP4 checkpoints (``quant_method`` ``mxfp4`` in config.json's ``quantization_config``), as
openai/gpt-oss publishes its experts, read as codebook weights that stay in MXFP4.

A matrix ``W`` of ``[..., out, in]`` is stored as two uint8 tensors (the OCP Microscaling
format, MX): ``{W}_blocks`` ``[..., out, in / 32, 16]``, each row cut in blocks of 32 FP4
(E2M1) values, two a byte with the even element in the low nibble; and ``{W}_scales``
``[..., out, in / 32]``, each block's shared E8M0 scale ``2 ** (s - 127)``. An E2M1 nibble is a
sign bit and one of eight magnitudes (``FP4_E2M1``). Every other tensor is stored in float.

The stacked experts (``mlp.experts.gate_up_proj``, ``down_proj``) are read one expert at a time
as ``QuantizedWeight``s over ``MXFP4_CODEBOOK`` (``gpu/quantization/weights.py``), under the
per-expert names the loader places (``mlp.experts.{e}.gate_proj.weight``; the gate and up rows
of ``gate_up_proj`` alternate), and kept so: the dot kernel reads them as they are on the CPU,
and every other path as the int8 weights they equal. Any other MXFP4 matrix is dequantized,
exactly in bfloat16 (a magnitude has at most two significant bits, and bfloat16 has float32's
exponent range), and given transposed, ``[..., in, out]``, as transformers holds gpt-oss's
matrices.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tidal.gpu.checkpoints.safetensors_files import safetensors_files
from tidal.gpu.quantization.weights import MXFP4_CODEBOOK, QuantizedWeight, Weight

# an E2M1 nibble's value: bit 3 the sign, bits 0-2 the magnitude's index
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127  # an E8M0 scale byte s stands for 2 ** (s - 127)
BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32  # values sharing a scale
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


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


def expert_weights(name: str, blocks: torch.Tensor, scales: torch.Tensor
                   ) -> Iterator[tuple[str, QuantizedWeight]] | None:
    """Stacked experts ``name`` (``blocks`` ``[E, out, G, 16]``) as each expert's codebook
    weights under their per-expert names; None for any other matrix."""
    match = _STACKED_EXPERTS.match(name)
    if match is None or blocks.dim() != 4:
        return None
    prefix, part = match.groups()
    return _each_expert(prefix, part, blocks, scales)


def _each_expert(prefix: str, part: str, blocks: torch.Tensor, scales: torch.Tensor
                 ) -> Iterator[tuple[str, QuantizedWeight]]:
    codebook = torch.tensor(MXFP4_CODEBOOK, dtype=torch.int8)
    for e in range(blocks.shape[0]):
        weight = codebook_weight(blocks[e], scales[e], codebook)
        if part == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", weight
            continue
        rows = weight.shape[0]
        gate = torch.arange(0, rows, 2)
        yield f"{prefix}.{e}.gate_proj.weight", _rows(weight, gate)
        yield f"{prefix}.{e}.up_proj.weight", _rows(weight, gate + 1)


def codebook_weight(blocks: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor
                    ) -> QuantizedWeight:
    """One matrix's blocks ``[out, G, 16]`` and scale bytes ``[out, G]`` as ``[out, G * 32]``
    codes over ``codebook`` (E2M1 doubled), each group's scale ``2 ** (s - 128)``."""
    q = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-3)  # even elements first
    exponents = scales.to(torch.int32) - SCALE_BIAS - 1  # the codebook's values are doubled
    return QuantizedWeight(4, GROUP, q.contiguous(),
                           torch.ldexp(torch.ones(exponents.shape), exponents), codebook=codebook)


def _rows(w: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    return QuantizedWeight(w.bits, w.group_size, w.q[rows].contiguous(),
                           w.scales[rows].contiguous(), codebook=w.codebook)


def mxfp4_weights(model_dir: Path, config: dict) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's weights: stacked experts' blocks and scales as each expert's codebook
    weights, any other ``{W}_blocks``/``{W}_scales`` pair as ``W`` dequantized and transposed
    (see above), every other tensor as it is."""
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
                blocks, scales = f.get_tensor(name), f.get_tensor(base + SCALES)
                experts = expert_weights(base, blocks, scales)
                if experts is not None:
                    yield from experts
                    continue
                yield base, dequantize_mxfp4(blocks, scales).transpose(-1, -2)
