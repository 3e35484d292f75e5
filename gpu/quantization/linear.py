"""The linear layer of a quantized weight: ``y = x W^T + b`` with ``W`` kept quantized.

Which implementation multiplies depends on the format, the device and the row count, so on the
CPU the selector (``gpu/cpu/selector.py``) times the candidates for each weight shape and row
bucket, as it does for float linears:

- ``tidal``: tidal's own kernel (``gpu/cpu/csrc/quant_linear.cpp``), float32 maths (bfloat16
  activations are widened for it and the result rounded back):
  int8, or 4-bit values two to a byte, in groups of a multiple of one register's floats (16 with
  AVX-512, 8 with AVX2; twice that for 4-bit), dequantized in registers as it streams the weight;
- ``dot``: tidal's integer kernel (``gpu/cpu/csrc/dot_linear.cpp``): each row of ``x`` is
  rounded to int8 in blocks of 32 inputs with a scale each (as llama.cpp's activations), and
  multiplied by the weight's integers with byte dot products (VNNI, or AVX2's pairs). Its
  result is the weight times the rounded rows, so it is checked against that, and the models
  it serves against the fidelity bounds of ``--quantization``; scales and offsets in float16.
  The one method that reads a codebook weight (MXFP4) as it is (a table shuffle);
- ``aten``: torch's own fused ops, which dequantize inside the GEMM: ``_weight_int8pack_mm``
  (int8 with one scale per output channel) and ``_weight_int4pack_mm_for_cpu`` (int4 in groups
  of 32 to 256 with a scale and a zero point);
- ``triton`` (CUDA): a Triton GEMM (``gpu/quantization/triton_linear.py``) reading int8, or
  4-bit values two to a byte, and dequantizing each tile in registers in its K loop; the first
  candidate on a GPU, where no C++ kernel runs;
- ``torch``: the weight dequantized to the activations' dtype for the call and ``F.linear``
  over it. Always a candidate, and the reference the others are tested against; it never
  keeps a float copy of the weight between calls.

Where the kernels are built, each layer's dispatch is a C++ ``PlannedLinear`` over a
``QuantPack`` (``csrc/planned_linear.cpp``), which the Python layer and the one-call decode step
(``gpu/cpu/decode_stack.py``) both call, so the two follow one plan and give the same results.
"""

from __future__ import annotations

import copy
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.selector import KERNELS, TORCH, Plan
from tidal.gpu.quantization.weights import QuantizedWeight

ATEN = "aten"
DOT = "dot"
TRITON = "triton"
# In the order ``force`` prefers them: the exact kernels first, so an untimed plan keeps the
# float maths; ``dot`` runs where the selector measures it faster.
METHODS = (KERNELS, DOT, ATEN, TRITON, TORCH)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # activations tidal's kernels take
CSRC_METHODS = {KERNELS: 4, ATEN: 5, TORCH: 6, DOT: 7}  # csrc's LinearMethod of each
LAYOUTS = {KERNELS: "tidal", ATEN: "aten", DOT: "dot", TRITON: "triton"}  # QuantPacks' fields
FLOAT16_MAX = 65504.0
ATEN_INT4_GROUPS = (32, 64, 128, 256)
# Weights are timed with at most this many output features (the time grows in proportion).
TIMED_MAX_OUT_FEATURES = 8192


def candidate_methods(weight: QuantizedWeight, device: torch.device,
                      dtype: torch.dtype = torch.float32) -> list[str]:
    """The methods that can multiply by ``weight`` on ``device`` for activations of ``dtype``
    (for a codebook weight the dot kernel, the one that reads it as it is, and torch's path)."""
    if weight.codebook is not None:
        dot = device.type == "cpu" and dtype in KERNEL_DTYPES and _dot_fits(weight)
        return [DOT, TORCH] if dot else [TORCH]
    methods = []
    if device.type == "cpu" and dtype in KERNEL_DTYPES and _tidal_fits(weight):
        methods.append(KERNELS)
    if device.type == "cpu" and dtype in KERNEL_DTYPES and _dot_fits(weight):
        methods.append(DOT)
    if device.type == "cpu" and _aten_fits(weight):
        methods.append(ATEN)
    if device.type == "cuda" and dtype in TRITON_DTYPES and _triton_fits(weight):
        methods.append(TRITON)
    return methods + [TORCH]


def _triton_fits(w: QuantizedWeight) -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from tidal.gpu.quantization.triton_linear import supports

    return supports(w)


def _tidal_fits(w: QuantizedWeight) -> bool:
    kernels = load_cpu_kernels()
    return kernels is not None and kernels.quant_linear_supports(w.bits, w.group_size, w.shape[1])


def _dot_fits(w: QuantizedWeight) -> bool:
    """The dot kernel is built (x86 with AVX2), takes the groups, and the scales and offsets
    are float16 numbers (none too large; none so small that float16 loses their digits); a
    codebook weight's scales are powers of two it keeps as exponent bytes."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.dot_linear_supports(w.bits, w.group_size, w.shape[1]):
        return False
    if w.codebook is not None:
        return _exponent_bytes(w.scales) is not None
    for t in (w.scales, w.offsets):
        if t is None:
            continue
        a = t.float().abs()
        if a.max() > FLOAT16_MAX or ((a > 0) & (a < torch.finfo(torch.float16).tiny)).any():
            return False
    return True


def _exponent_bytes(scales: torch.Tensor) -> torch.Tensor | None:
    """Power-of-two scales as the dot kernel's bytes ``b`` (``2 ** (b - 127)``; scales below
    ``2 ** -126`` as 0, which it reads as 0); None where a scale is no power of two or is too
    large."""
    mantissa, exponent = torch.frexp(scales.float())  # scale = mantissa * 2 ** exponent
    b = exponent.to(torch.int32) + 126
    if not bool(((mantissa == 0.5) | (scales == 0)).all()) or int(b.max()) > 254:
        return None
    return torch.where((scales == 0) | (b < 1), 0, b).to(torch.uint8)


def _aten_fits(w: QuantizedWeight) -> bool:
    if w.bits == 8:
        return w.per_channel and w.offsets is None
    return w.group_size in ATEN_INT4_GROUPS and w.offsets is not None


class QuantPacks:
    """A quantized weight in the layouts that ``methods`` name, for activations of ``dtype``;
    those that ``lent`` (the same weight's packs) has already are taken from it, not made."""

    def __init__(self, weight: QuantizedWeight, methods: set[str], dtype: torch.dtype,
                 lent: QuantPacks | None = None) -> None:
        self.format = weight
        self.bits, self.group_size = weight.bits, weight.group_size
        self.out_features = weight.shape[0]
        self.kernels = load_cpu_kernels() if weight.q.device.type == "cpu" else None
        self.tidal = self.aten = self.dot = self.triton = None
        makers = {KERNELS: lambda: pack_for_kernel(weight, *self.kernels.quant_linear_tile()),
                  ATEN: lambda: _aten_pack(weight, dtype),
                  DOT: lambda: pack_for_dot(weight, *dot_tile(self.kernels)),
                  TRITON: lambda: _triton_pack(weight)}
        for method in methods & LAYOUTS.keys():
            have = getattr(lent, LAYOUTS[method], None)
            setattr(self, LAYOUTS[method], have if have is not None else makers[method]())

    def only(self, methods: set[str]) -> QuantPacks | None:
        """A copy holding only the layouts ``methods`` name, or None where this lacks one of
        them or they need the weight's own form (torch's path) that this no longer holds."""
        if any(getattr(self, LAYOUTS[m], None) is None if m in LAYOUTS else self.format is None
               for m in methods):
            return None
        packs = copy.copy(self)
        for method, layout in LAYOUTS.items():
            if method not in methods:
                setattr(packs, layout, None)
        return packs

    def run(self, method: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b`` by ``method``, from Python (for timing, and where no kernels exist)."""
        if method == KERNELS:
            return self.kernels.quant_linear(x, *self.tidal, self.bits, self.group_size,
                                             self.out_features, bias)
        if method == DOT:
            return self.kernels.dot_linear(x, *self.dot, self.bits, self.group_size,
                                           self.out_features, bias)
        if method == ATEN:
            weight, scales = self.aten
            y = (torch.ops.aten._weight_int8pack_mm(x, weight, scales) if self.bits == 8 else
                 torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, self.group_size, scales))
            return y if bias is None else y + bias
        if method == TRITON:
            from tidal.gpu.quantization.triton_linear import triton_quant_linear

            return triton_quant_linear(x, self.triton, bias)
        return F.linear(x, self.format.dequantize(x.dtype), bias)

    def kernel(self, bias: torch.Tensor | None, plan: Plan) -> object | None:
        """The C++ ``PlannedLinear`` running ``plan`` over these layouts, or ``None`` without
        the kernels."""
        if self.kernels is None:
            return None
        w = None if self.format is None else self.format.expanded()  # C++ dequantizes int8
        pack = self.kernels.QuantPack(
            self.bits, self.group_size, self.out_features,
            *(self.tidal or (None, None)), *(self.aten or (None, None)),
            *((w.q, w.scales, w.offsets) if w is not None else (None, None, None)),
            *(self.dot or (None, None)))
        return self.kernels.PlannedLinear(bias, pack, [CSRC_METHODS[m] for m in plan.by_rows()])


def _triton_pack(w: QuantizedWeight) -> object:
    from tidal.gpu.quantization.triton_linear import pack_for_triton

    return pack_for_triton(w)


def pack_for_kernel(w: QuantizedWeight, lanes: int, rows: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` in ``csrc/quant_linear.cpp``'s layout for a build whose registers hold ``lanes``
    floats and whose items are ``rows`` output rows: (k-blocks of each item's rows, bytes;
    each item's groups' scales then offsets, float32). The last item is padded with zero rows."""
    n, k = w.shape
    items = -(-n // rows)
    pad = items * rows - n

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

    if w.bits == 4:  # byte j of a k-block: input j in the low nibble, j + lanes in the high
        q = padded(w.q).view(items, rows, k // (2 * lanes), 2, lanes)
        q = q[:, :, :, 0] | (q[:, :, :, 1] << 4)
    else:
        q = padded(w.q).view(torch.uint8).view(items, rows, k // lanes, lanes)
    packed = q.permute(0, 2, 1, 3).contiguous().view(-1)
    offsets = w.offsets if w.offsets is not None else torch.zeros_like(w.scales)
    params = torch.stack([padded(t.float()).view(items, rows, -1).transpose(1, 2)
                          for t in (w.scales, offsets)], dim=2)
    return packed, params.contiguous().view(-1)


ACTIVATION_BLOCK = 32  # inputs of x that share one scale in the dot kernel


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the dot kernel multiplies it (the reference it is tested against): each block
    of ``ACTIVATION_BLOCK`` inputs of a row as ``q * (amax / 127)``, ``q = round(x * (127 /
    amax))`` in float32 (ties to even), ``amax`` the block's largest magnitude."""
    blocks = x.float().reshape(-1, x.shape[-1] // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127)).reshape(x.shape).to(x.dtype)


def dot_tile(kernels: object) -> tuple[int, int]:
    """The build's dot layout: (output rows an item, the bias its int8 bytes carry)."""
    rows, _, int8_bias = kernels.dot_linear_tile()
    return rows, int8_bias


def pack_for_dot(w: QuantizedWeight, rows: int, int8_bias: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` in ``csrc/dot_linear.cpp``'s layout for items of ``rows`` output rows: (each
    item's registers, bytes; each item's groups' scales then offsets, float16). A register
    holds four consecutive inputs of each of the ``rows`` rows: int8 as ``q + int8_bias``
    (128 where the build multiplies unsigned weights, VNNI's, else 0); 4-bit values two to a
    byte, the high nibbles the four inputs after the low ones'. The last item is padded with
    zero rows. A codebook weight's params are bytes: its codebook, then each item's groups'
    scale exponents (``_exponent_bytes``)."""
    n, k = w.shape
    items = -(-n // rows)
    pad = items * rows - n

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

    if w.bits == 8:
        q = padded(w.q).view(torch.uint8)
        q = (q ^ 0x80 if int8_bias == 128 else q).view(items, rows, k // 4, 4)
    else:
        q = padded(w.q).view(items, rows, k // 8, 2, 4)
        q = q[:, :, :, 0] | (q[:, :, :, 1] << 4)
    packed = q.permute(0, 2, 1, 3).contiguous().view(-1)
    if w.codebook is not None:
        exponents = padded(_exponent_bytes(w.scales)).view(items, rows, -1).transpose(1, 2)
        return packed, torch.cat([w.codebook.view(torch.uint8), exponents.reshape(-1)])
    parts = [w.scales] if w.offsets is None else [w.scales, w.offsets]
    params = torch.stack([padded(t.float()).view(items, rows, -1).transpose(1, 2)
                          for t in parts], dim=2)
    return packed, params.to(torch.float16).contiguous().view(-1)


def _aten_pack(w: QuantizedWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's packed weight and scales for ``_weight_int8pack_mm`` / ``_int4pack_mm``."""
    if w.bits == 8:
        return w.q.contiguous(), w.scales.view(-1).to(dtype).contiguous()
    # torch's int4 format dequantizes as (q - 8) * scale + zero, zeros [groups, out, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
    zeros = w.offsets + 8 * w.scales
    sz = torch.stack([w.scales, zeros], dim=-1).transpose(0, 1).to(dtype).contiguous()
    return packed, sz


class QuantLinear(nn.Module):
    """A linear layer over a ``QuantizedWeight``, run by the method its plan names for the row
    count. Only the layouts the plan uses are kept."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, plan: Plan | None = None) -> None:
        super().__init__()
        if weight.codebook is not None and DOT not in candidate_methods(
                weight, weight.q.device, dtype):
            weight = weight.expanded()  # the int8 weight it equals, which every path reads
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        self.codebook = weight.codebook is not None
        self.dtype = dtype
        # The weight's own form, until a plan packs it (``replan``); kept after only where the
        # plan runs torch's path, which dequantizes from it.
        self.weight_format: QuantizedWeight | None = weight
        self.format_nbytes = weight.nbytes  # kept once the plan's layouts replace the weight
        self.plan_name: str | None = None  # the plan's name in the cache, once planned
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype),
                             persistent=False)
        self.plan = plan or Plan.always(candidate_methods(weight, weight.q.device, dtype)[0])
        # Packed when planned (a model planned on the CPU is packed once, for its plan), else
        # on the first call.
        self.packs: QuantPacks | None = None
        self.lent: QuantPacks | None = None  # layouts to take rather than make (``borrow``)
        self.kernel = None  # the C++ PlannedLinear over the packs, which the decode step calls
        if plan is not None:
            self.replan(plan)

    @property
    def format_name(self) -> str:
        if self.codebook:
            return f"mxfp4g{self.group_size}"
        per_channel = self.group_size == self.in_features
        return f"int{self.bits}" + ("" if per_channel else f"g{self.group_size}")

    def replan(self, plan: Plan) -> None:
        """Pack for ``plan`` and keep only the layouts it uses."""
        if self.weight_format is None:
            raise RuntimeError("this layer was planned already: its weight's own form is gone")
        self.plan = plan
        self.packs = QuantPacks(self.weight_format, plan.used(), self.dtype, self.lent)
        self.lent = None
        if TORCH not in plan.used():
            self.packs.format = self.weight_format = None
        self.kernel = self.packs.kernel(self.bias, plan)

    def borrow(self, lender: nn.Module | None) -> None:
        """Take ``lender``'s packed layouts when planned, those its plan uses too, rather than
        packing them again, where ``lender`` is this layer read from the same checkpoint and
        quantized alike (the model that serves while this one is prepared): one copy held by
        both, not two."""
        if isinstance(lender, QuantLinear) and lender.packs is not None and (
                lender.kind() == self.kind()):
            self.lent = lender.packs

    def kind(self) -> tuple:
        return (self.out_features, self.in_features, self.format_name, self.bits, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return planned_forward(self, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.format_name}, {self.plan.describe()}")


def planned_forward(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
                    ) -> torch.Tensor:
    """``x W^T + b`` for a quantized layer (``QuantLinear``, ``head.QuantHead``): packed for
    its plan on the first call, then its C++ ``PlannedLinear`` where the kernels are built,
    else the method its plan names for the row count."""
    if layer.packs is None:
        layer.replan(layer.plan)
    rows = x.reshape(-1, layer.in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if layer.kernel is not None:
        y = layer.kernel(rows)
    else:
        y = layer.packs.run(layer.plan.pick(rows.shape[0]), rows, bias)
    return y.view(*x.shape[:-1], layer.out_features)
