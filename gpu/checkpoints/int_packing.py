"""What the integer-quantized checkpoint readers (GPTQ and AWQ in ``gptq_awq.py``,
compressed-tensors in ``compressed_tensors.py``) share: unpacking int32 words of 4- or 8-bit
values, mapping a format's ``(q - zero) * scale`` onto ``QuantizedWeight``'s affine form, and
the walk over a checkpoint's tensors that gathers each quantized linear's parts into one
weight under the ``...weight`` name the loader maps."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tidal.gpu.checkpoints.safetensors_files import safetensors_files
from tidal.gpu.quantization.weights import QuantizedWeight, Weight

PACKED_BITS = (4, 8)
# The linears the loader installs as quantized: those of the decoder layers. Any other
# quantized module (a quantized lm_head, which GPTQModel can write) is dequantized to float.
DECODER_LINEARS = frozenset(
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-wide values packed ``32 // bits`` to an int32 word along ``dim``,
    value ``k`` in word ``k // (32 // bits)`` at bit ``(k % (32 // bits)) * bits`` (GPTQ's and
    compressed-tensors' order; AWQ permutes after), as int32 with ``dim`` grown that much."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    view = [1] * (packed.dim() + 1)
    view[dim + 1] = per_word
    words = packed.to(torch.int32).unsqueeze(dim + 1)
    values = (words >> shifts.view(view)) & ((1 << bits) - 1)  # the sign bits masked away
    shape = list(packed.shape)
    shape[dim] *= per_word
    return values.reshape(shape)


def affine_weight(bits: int, q: torch.Tensor, zeros: torch.Tensor,
                  scales: torch.Tensor) -> QuantizedWeight:
    """``W = (q - zeros) * scales`` as a ``QuantizedWeight``: ``q`` unsigned ``[out, in]``,
    ``zeros`` and ``scales`` ``[out, groups]`` of contiguous groups of inputs. 4-bit values stay
    as they are with the offset ``-zero * scale``; 8-bit ones become signed (``q - 128``, what
    torch's int8 GEMM takes) with the offset ``(128 - zero) * scale``, none where every zero is
    128 (the symmetric formats). In float32 both are exact for 16-bit scales."""
    out, inp = q.shape
    groups = scales.shape[1]
    if tuple(scales.shape) != (out, groups) or tuple(zeros.shape) != (out, groups):
        raise ValueError(f"scales {list(scales.shape)} and zeros {list(zeros.shape)} do not "
                         f"fit a weight of {[out, inp]}")
    if groups == 0 or inp % groups:
        raise ValueError(f"{groups} groups do not divide {inp} inputs evenly")
    scales = scales.float().contiguous()
    if bits == 4:
        return QuantizedWeight(4, inp // groups, q.to(torch.uint8).contiguous(), scales,
                               -zeros.float() * scales)
    if bits == 8:
        shift = 128 - zeros
        offsets = shift.float() * scales if bool(shift.any()) else None
        return QuantizedWeight(8, inp // groups, (q - 128).to(torch.int8).contiguous(), scales,
                               offsets)
    raise ValueError(f"tidal reads {PACKED_BITS}-bit integer weights; got {bits} bits")


class CheckpointTensors:
    """A checkpoint's tensors by name, each read when asked for from whichever file holds it,
    so a linear's parts meet wherever the shards put them."""

    def __init__(self, model_dir: Path) -> None:
        self._stack = contextlib.ExitStack()
        self._where: dict[str, object] = {}
        self.names: list[str] = []
        for file in safetensors_files(model_dir):
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():
                self._where[name] = handle
                self.names.append(name)

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ValueError(f"the checkpoint has no tensor {name}")
        return self._where[name].get_tensor(name)


# ``read(module, tensors)``: the module's weight (``module`` is ``model.layers.0.mlp.up_proj``).
ModuleReader = Callable[[str, CheckpointTensors], QuantizedWeight]


def iter_quantized(model_dir: Path, marker: str, parts: frozenset[str],
                   read: ModuleReader) -> Iterator[tuple[str, Weight]]:
    """Every tensor of the checkpoint, where a module holding a tensor named ``marker`` is a
    quantized linear: its ``parts`` are read together (by ``read``, when the walk reaches the
    marker) into one ``...weight``; its other tensors (a bias) and every other module's pass
    through as they are."""
    with CheckpointTensors(model_dir) as tensors:
        quantized = {name.rpartition(".")[0] for name in tensors.names
                     if name.rpartition(".")[2] == marker}
        for name in tensors.names:
            module, _, leaf = name.rpartition(".")
            if module not in quantized:
                yield name, tensors.get(name)
            elif leaf == marker:
                weight = read(module, tensors)
                yield f"{module}.weight", (weight if installed_quantized(module)
                                           else weight.dequantize())
            elif leaf not in parts:
                yield name, tensors.get(name)


def installed_quantized(module: str) -> bool:
    """Whether the loader installs ``module`` as a ``QuantLinear`` (only the decoder layers'
    linears are)."""
    return ".layers." in f".{module}" and module.rpartition(".")[2] in DECODER_LINEARS
