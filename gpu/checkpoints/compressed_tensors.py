"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, what llm-compressor and
vLLM's tooling write) with integer weights, read into ``QuantizedWeight``s.

Two of its formats are read:

- ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 ``[out, in / p]`` packed along the
  inputs (``p = 32 / bits`` values a word, the first in the lowest bits), each value stored
  plus ``2 ** (bits - 1)`` so the signed range packs as unsigned; ``weight_scale``
  ``[out, groups]``; ``weight_shape`` ``[out, in]``; for asymmetric schemes
  ``weight_zero_point``, signed and shifted the same way, packed along the outputs
  (``[out / p, groups]``). A weight is ``(q - zero) * scale``.
- ``int-quantized`` / ``naive-quantized`` (W8A8, W8A16): ``weight`` int8 ``[out, in]`` with
  ``weight_scale`` and an optional ``weight_zero_point``. Any activation quantization the
  scheme names is not applied: tidal runs these weights with float activations.

Which modules are quantized how comes from the config's ``config_groups`` (each a scheme and
the modules it ``targets``); the modules it ``ignore``s are stored in float and pass through.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
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

logger = logging.getLogger(__name__)

PACKED = "pack-quantized"
INT_FORMATS = ("int-quantized", "naive-quantized")
PACKED_PARTS = frozenset(("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                          "weight_g_idx"))
INT_PARTS = frozenset(("weight", "weight_scale", "weight_zero_point", "weight_g_idx"))
STRATEGIES = ("group", "channel", "tensor")


@dataclass
class Scheme:
    """One config group: its format, weights arguments and the modules it targets."""

    format: str
    weights: dict
    targets: list[str]


def compressed_tensors_weights(model_dir: Path, config: dict) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's weights, each quantized linear a ``QuantizedWeight``; the config is
    checked now, so an unreadable checkpoint fails before the first tensor is read."""
    schemes = _schemes(config)
    formats = {scheme.format for scheme in schemes.values()}
    if len(formats) != 1:
        raise ValueError(f"compressed-tensors checkpoints mixing formats {sorted(formats)} are "
                         "not read")
    fmt = formats.pop()
    if fmt == PACKED:
        return iter_quantized(model_dir, "weight_packed", PACKED_PARTS,
                              lambda module, t: _read_packed(module, t, schemes))
    return iter_quantized(model_dir, "weight_scale", INT_PARTS, _read_int8)


def _schemes(config: dict) -> dict[str, Scheme]:
    """The config groups that quantize weights, by name, after checking tidal reads each."""
    if config.get("quantization_status", "compressed") != "compressed":
        raise ValueError("compressed-tensors checkpoints are read only when saved compressed; "
                         f"this one is {config.get('quantization_status')!r}")
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"sparse compressed-tensors checkpoints ({sparsity['format']}) are "
                         "not read")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("this compressed-tensors checkpoint names no config_groups")
    if config.get("kv_cache_scheme"):
        logger.warning("the checkpoint's kv_cache_scheme is not applied: the KV cache stays in "
                       "the model's dtype")
    schemes = {}
    for name, group in groups.items():
        fmt = group.get("format") or config.get("format")
        weights = group.get("weights")
        if not weights:
            continue  # a group quantizing only activations: nothing to read
        _check_scheme(name, fmt, weights)
        if group.get("input_activations"):
            logger.warning("config group %s quantizes activations too; tidal runs its weights "
                           "with float activations", name)
        schemes[name] = Scheme(fmt, weights, list(group.get("targets") or []))
    if not schemes:
        raise ValueError("no config group of this compressed-tensors checkpoint quantizes "
                         "weights")
    return schemes


def _check_scheme(name: str, fmt: str | None, weights: dict) -> None:
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    strategy = weights.get("strategy", "tensor")
    if fmt != PACKED and fmt not in INT_FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} (config group {name}) is not "
                         f"read: tidal reads {PACKED} and {', '.join(INT_FORMATS)}")
    if kind != "int":
        raise ValueError(f"compressed-tensors {kind} weights (config group {name}) are not "
                         "read: tidal reads integer weights")
    if bits not in PACKED_BITS or (fmt in INT_FORMATS and bits != 8):
        raise ValueError(f"compressed-tensors weights of {bits} bits in {fmt} (config group "
                         f"{name}) are not read: tidal reads 4 or 8 bits packed, 8 unpacked")
    if strategy not in STRATEGIES:
        raise ValueError(f"compressed-tensors strategy {strategy!r} (config group {name}) is "
                         f"not read: tidal reads {', '.join(STRATEGIES)}")


def _scheme_for(module: str, schemes: dict[str, Scheme]) -> dict:
    """The weights scheme of ``module``: that of the config group whose ``targets`` name it
    most closely (by name, then by ``re:`` pattern, then by class, as ``Linear``); of equals,
    the first, as vLLM does."""
    ranked = [(_target_rank(module, scheme.targets), name) for name, scheme in schemes.items()]
    rank, name = max(ranked, key=lambda ranked_name: ranked_name[0])
    if rank < 0:
        raise ValueError(f"{module} is stored quantized but no config group targets it")
    return schemes[name].weights


def _read_packed(module: str, tensors: CheckpointTensors,
                 schemes: dict[str, Scheme]) -> QuantizedWeight:
    weights = _scheme_for(module, schemes)
    bits = weights["num_bits"]
    out, inp = (int(x) for x in tensors.get(f"{module}.weight_shape").tolist())
    q = unpack_int32(tensors.get(f"{module}.weight_packed"), bits, 1)[:out, :inp]
    scales = _scales(module, tensors, out)
    _check_no_g_idx(module, tensors, inp, scales.shape[1])
    middle = 1 << (bits - 1)  # the shift that made the signed values unsigned
    name = f"{module}.weight_zero_point"
    if weights.get("symmetric", True) or not tensors.has(name):
        zeros = torch.full(scales.shape, middle, dtype=torch.int32)
    else:
        zeros = _zero_points(tensors.get(name), bits, out, middle)
    return affine_weight(bits, q, zeros, scales)


def _zero_points(stored: torch.Tensor, bits: int, out: int, middle: int) -> torch.Tensor:
    """Asymmetric zero points in the weights' unsigned code: packed along the outputs as the
    packer writes them (int32 ``[out / p, groups]``), or one signed value each (older
    checkpoints, ``[out, groups]``)."""
    if stored.dtype == torch.int32 and stored.shape[0] * (32 // bits) >= out > stored.shape[0]:
        return unpack_int32(stored, bits, 0)[:out]
    return stored.to(torch.int32).reshape(out, -1) + middle


def _read_int8(module: str, tensors: CheckpointTensors) -> QuantizedWeight:
    weight = tensors.get(f"{module}.weight")
    if weight.dtype != torch.int8:
        raise ValueError(f"{module}: int8 weights expected, got {weight.dtype}")
    out, inp = weight.shape
    scales = _scales(module, tensors, out)
    _check_no_g_idx(module, tensors, inp, scales.shape[1])
    name = f"{module}.weight_zero_point"
    zeros = torch.zeros(scales.shape, dtype=torch.int32)
    if tensors.has(name):
        zeros = _per_row(tensors.get(name), out).to(torch.int32).expand(scales.shape)
    return affine_weight(8, weight.to(torch.int32) + 128, zeros + 128, scales)


def _scales(module: str, tensors: CheckpointTensors, out: int) -> torch.Tensor:
    return _per_row(tensors.get(f"{module}.weight_scale"), out)


def _per_row(t: torch.Tensor, out: int) -> torch.Tensor:
    """A scale or zero point as ``[out, groups]``: a per-tensor one is one group per row."""
    return t.reshape(1, 1).expand(out, 1) if t.numel() == 1 else t.reshape(out, -1)


def _check_no_g_idx(module: str, tensors: CheckpointTensors, inputs: int, groups: int) -> None:
    """Activation ordering by group (``actorder: group``) stores ``weight_g_idx``; our groups
    are of consecutive inputs, so only the trivial ``k // G`` reads (see ``gptq_awq.py``)."""
    name = f"{module}.weight_g_idx"
    if not tensors.has(name):
        return
    g_idx = tensors.get(name).to(torch.int64)
    if not torch.equal(g_idx, torch.arange(inputs) // (inputs // groups)):
        raise ValueError(f"{module}: this checkpoint was quantized with activation ordering "
                         "(actorder: group): its weight_g_idx puts inputs in groups out of "
                         "order, which tidal does not read")


def _target_rank(module: str, targets: list[str]) -> int:
    """How closely ``targets`` name ``module``: 2 by name, 1 by ``re:`` pattern, 0 by class
    (any other target: the stored tensors show the module is a quantized linear), -1 not."""
    ranks = [-1]
    for target in targets:
        if target.startswith("re:"):
            ranks.append(1 if re.match(target[3:], module) else -1)
        else:
            ranks.append(2 if target == module else 0 if "." not in target else -1)
    return max(ranks)
