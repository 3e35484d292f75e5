"""Quantized weights in one form every format maps onto, and the quantizers of
``--quantization``.

A linear weight ``W`` of ``[out, in]`` is kept as small integers ``q`` with a scale (and, for
asymmetric formats, an offset) per group of ``group_size`` consecutive inputs of one output::

    W[n, k] = q[n, k] * scales[n, k // group_size] + offsets[n, k // group_size]

That affine form holds every format tidal reads: per-channel int8 (one group per row), int4
with a minimum (``--quantization int4``, GPTQ/AWQ's ``(q - zero) * scale``, GGUF's Q4_K), and
the symmetric GGUF blocks (Q8_0, Q4_0, Q6_K). ``q`` is one value per byte here; the kernels
repack it (two 4-bit values to a byte) as they need.

A 4-bit weight may instead index a ``codebook`` of 16 int8 values, ``W[n, k] =
codebook[q[n, k]] * scales[n, k // group_size]``: MXFP4 (gpt-oss's experts), whose E2M1 values
doubled are integers (``MXFP4_CODEBOOK``) and whose scales are powers of two. Such a weight is
read natively by the dot kernel only; every other path takes it as the int8 weight it equals
(``expanded``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = (4, 8)
INT4_GROUP_SIZES = (32, 64, 128)
# MXFP4's E2M1 values doubled (a sign bit over 0, 0.5, 1, 1.5, 2, 3, 4, 6), with scales halved
MXFP4_CODEBOOK = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@dataclass
class QuantizedWeight:
    """``bits`` 8: ``q`` int8 in [-128, 127]; ``bits`` 4: ``q`` uint8 in [0, 15] (a symmetric
    4-bit format's ``(q - 8) * scale`` has the offset ``-8 * scale``), or indices into
    ``codebook``. ``offsets`` is ``None`` where it would be all zeros."""

    bits: int
    group_size: int
    q: torch.Tensor  # [out, in], int8 or uint8, one value per byte
    scales: torch.Tensor  # [out, in // group_size], float32
    offsets: torch.Tensor | None = None  # like scales
    codebook: torch.Tensor | None = None  # [16] int8: the values 4-bit q stand for

    def __post_init__(self) -> None:
        out, inp = self.q.shape
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}; got {self.bits}")
        if inp % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide in_features {inp}")
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.q.dtype != want:
            raise ValueError(f"{self.bits}-bit values must be {want}; got {self.q.dtype}")
        if self.codebook is not None and (self.bits != 4 or self.offsets is not None or
                                          self.codebook.dtype != torch.int8 or
                                          tuple(self.codebook.shape) != (16,)):
            raise ValueError("a codebook is 16 int8 values that 4-bit q index, with no offsets")
        groups = (out, inp // self.group_size)
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != groups:
                raise ValueError(f"{name} must be {list(groups)}; got {list(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.q.shape[1]

    @property
    def nbytes(self) -> int:
        """The bytes this weight takes in a kernel's layout (4-bit values two to a byte)."""
        n, k = self.shape
        groups = n * (k // self.group_size) * (1 if self.offsets is None else 2)
        scale_bytes = 1 if self.codebook is not None else self.scales.element_size()  # E8M0
        return n * k * self.bits // 8 + groups * scale_bytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]`` this stands for (the reference every kernel meets)."""
        n, k = self.shape
        values = self.q if self.codebook is None else self.codebook[self.q.long()]
        w = values.float().view(n, -1, self.group_size) * self.scales.float()[..., None]
        if self.offsets is not None:
            w = w + self.offsets.float()[..., None]
        return w.view(n, k).to(dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """This weight with its values, scales and offsets on ``device``."""
        move = (lambda t: None if t is None else t.to(device))
        return QuantizedWeight(self.bits, self.group_size, move(self.q), move(self.scales),
                               move(self.offsets), move(self.codebook))

    def expanded(self) -> QuantizedWeight:
        """A codebook weight as the int8 weight it equals (its entries as the values); any
        other weight as it is."""
        if self.codebook is None:
            return self
        return QuantizedWeight(8, self.group_size, self.codebook[self.q.long()], self.scales)

    def float16_params(self) -> QuantizedWeight:
        """This weight with its scales and offsets rounded to float16, as the dot kernel
        (``gpu/cpu/csrc/dot_linear.cpp``) keeps them."""
        half = (lambda t: None if t is None else t.half().float())
        return QuantizedWeight(self.bits, self.group_size, self.q, half(self.scales),
                               half(self.offsets), self.codebook)

    def narrow_rows(self, start: int, length: int) -> QuantizedWeight:
        """Output rows ``start:start + length`` (a shard of a fused weight)."""
        cut = (lambda t: None if t is None else t.narrow(0, start, length))
        return QuantizedWeight(self.bits, self.group_size, cut(self.q), cut(self.scales),
                               cut(self.offsets), self.codebook)

    def narrow_cols(self, start: int, length: int) -> QuantizedWeight:
        """Inputs ``start:start + length`` (a row-parallel rank's part), cut at group
        boundaries; a per-channel weight keeps its one group per row."""
        if self.per_channel:
            return QuantizedWeight(self.bits, length, self.q.narrow(1, start, length),
                                   self.scales, self.offsets, self.codebook)
        g = self.group_size
        if start % g or length % g:
            raise ValueError(f"a shard of inputs {start}:{start + length} cuts groups of {g}")
        cut = (lambda t: None if t is None else t.narrow(1, start // g, length // g))
        return QuantizedWeight(self.bits, g, self.q.narrow(1, start, length), cut(self.scales),
                               cut(self.offsets), self.codebook)


Weight = torch.Tensor | QuantizedWeight  # a checkpoint's tensor, float or quantized


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights stacked along their outputs (q, k and v into qkv). Parts in different formats
    (a GGUF's Q4_K queries beside its Q6_K values) are first put in the one format that holds
    each exactly (``common_format``)."""
    parts = common_format(parts)
    first = parts[0]
    offsets = (None if first.offsets is None
               else torch.cat([p.offsets for p in parts]))
    return QuantizedWeight(first.bits, first.group_size, torch.cat([p.q for p in parts]),
                           torch.cat([p.scales for p in parts]), offsets, first.codebook)


def common_format(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """``parts`` in one format, losslessly: the most bits (4-bit values fit int8), the
    greatest group size dividing every part's (a group's scale repeated over its sub-groups)
    and offsets if any part has them (zeros for the others). Codebook weights stay so where
    all share one codebook, and are ``expanded`` where not."""
    codebooks = [p.codebook for p in parts]
    if any(c is not None for c in codebooks):
        if all(c is not None and torch.equal(c, codebooks[0]) for c in codebooks):
            if len({p.group_size for p in parts}) == 1:
                return parts
        parts = [p.expanded() for p in parts]
    bits = max(p.bits for p in parts)
    group = math.gcd(*(p.group_size for p in parts))
    offsets = any(p.offsets is not None for p in parts)
    return [_in_format(p, bits, group, offsets) for p in parts]


def _in_format(w: QuantizedWeight, bits: int, group: int, offsets: bool) -> QuantizedWeight:
    if (w.bits, w.group_size, w.offsets is not None) == (bits, group, offsets):
        return w
    q = w.q.to(torch.int8) if bits != w.bits else w.q
    repeat = w.group_size // group
    scales = w.scales.repeat_interleave(repeat, dim=1)
    shift = (torch.zeros_like(w.scales) if w.offsets is None else w.offsets) if offsets else None
    return QuantizedWeight(bits, group, q, scales,
                           None if shift is None else shift.repeat_interleave(repeat, dim=1))


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one scale per output channel: ``q = round(w / (absmax / 127))``."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    q = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(8, w.shape[1], q, scales)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4 per group of ``group_size`` inputs: ``q`` in [0, 15] over each group's
    [min, max], the offset being the minimum."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}; got {group_size}")
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide in_features {k}")
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(4, group_size, q.view(n, k), scales, lo)


def quantize(weight: torch.Tensor, method: str, group_size: int = 32) -> QuantizedWeight:
    """``method``: ``int8`` or ``int4``."""
    if method == "int8":
        return quantize_int8(weight)
    if method == "int4":
        return quantize_int4(weight, group_size)
    raise ValueError(f"quantization must be int8 or int4; got {method!r}")
