"""Building blocks of Llama-family models: RMSNorm, rotary position embeddings, the gated
MLP's activation and the token embedding over this rank's vocabulary rows; and Gemma's forms of
the first and third (``GemmaRMSNorm``, ``GeluAndMul``).

Each has a torch form (``*_torch`` below: 6, 14 and 2 ops, whose fixed costs dominate a decode
step and whose intermediates are each a trip through memory at prefill sizes) and a fused
kernel per device, chosen in ``fused_kernels_for``: on a GPU the Triton kernels of
``gpu/triton_elementwise.py``; on the CPU the compiled ones (``gpu/cpu/csrc/kernels.cpp``,
``activation.cpp``) where they are built and their plan (timed on the host,
``gpu/cpu/op_plans.py``) says they are faster for the rows at hand.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tidal.gpu.cpu.kernels import cpu_kernels_for
from tidal.gpu.cpu.selector import Plan
from tidal.gpu.distributed import TensorParallel, tensor_parallel

# ``TIDAL_GPU_KERNELS=off`` keeps torch's forms on a GPU too (the baseline the fused kernels
# are measured against).
GPU_KERNELS = os.environ.get("TIDAL_GPU_KERNELS", "on") != "off"
# Whether the Triton kernels also take CPU tensors, in Triton's interpreter (tests only).
TRITON_ON_CPU = False


def fused_kernels_for(x: torch.Tensor, plan: Plan | None = None) -> ModuleType | None:
    """The fused kernels for ``x``'s device, or None for the torch forms: the Triton ones on
    a GPU, the compiled CPU ones where built and ``plan`` gives them ``x``'s rows."""
    if x.device.type == "cuda" or (TRITON_ON_CPU and x.device.type == "cpu"):
        return _triton_kernels() if GPU_KERNELS else None
    return cpu_kernels_for(x, plan)


@functools.cache
def _triton_kernels() -> ModuleType | None:
    try:
        from tidal.gpu import triton_elementwise
    except ImportError:  # no Triton for this platform: torch's forms
        return None
    return triton_elementwise


def _takes(kernels: ModuleType, *tensors: torch.Tensor) -> bool:
    """Whether ``kernels`` take these tensors as laid out: the CPU kernels want them
    contiguous, the Triton ones any view with a contiguous last dimension."""
    return getattr(kernels, "TAKES_VIEWS", False) or all(t.is_contiguous() for t in tensors)


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, as HF's LlamaRMSNorm does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.plan: Plan | None = None  # which rows the CPU kernel takes (None: every row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = fused_kernels_for(x, self.plan)
        if kernels is not None:
            # a view the kernel does not take (Qwen3's per-head q/k norms, over the fused qkv
            # output) is copied first: a copy and one pass beat torch's six ops
            return kernels.rms_norm(x if _takes(kernels, x) else x.contiguous(), self.weight,
                                    self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, norm(x + delta))``: a residual add and the norm after it, in one
        pass where a fused kernel takes them (the add alone is a trip through memory at
        prefill sizes, and a launch of its own on a GPU)."""
        kernels = fused_kernels_for(x, self.plan)
        if (kernels is not None and _takes(kernels, x, delta) and delta.dtype == x.dtype
                and delta.shape == x.shape):
            return kernels.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored less one (scaled by ``1 + weight``), and the scaling
    is done in float32 before rounding to the input dtype (HF's Gemma2RMSNorm). The fused
    kernels, which scale in the input dtype, take float32 inputs only, where both agree."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = fused_kernels_for(x, self.plan)
        if kernels is not None and x.dtype == torch.float32 and _takes(kernels, x):
            return kernels.rms_norm(x, 1.0 + self.weight, self.eps)
        return gemma_rms_norm_torch(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = fused_kernels_for(x, self.plan)
        if (kernels is not None and x.dtype == torch.float32 and _takes(kernels, x, delta)
                and delta.dtype == x.dtype and delta.shape == x.shape):
            return kernels.add_rms_norm(x, delta, 1.0 + self.weight, self.eps)
        x = x + delta
        return x, self(x)


def gemma_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_and_mul(gate_up: torch.Tensor, plan: Plan | None = None) -> torch.Tensor:
    """``SiLU(gate) * up`` of a fused ``[..., 2n]`` gate/up projection, rounded as HF's
    ``F.silu(gate) * up`` (SiLU to the input dtype, then the product)."""
    kernels = fused_kernels_for(gate_up, plan)
    if kernels is not None and _takes(kernels, gate_up) and gate_up.dim() == 2:
        return kernels.silu_and_mul(gate_up)
    return silu_and_mul_torch(gate_up)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """The gated MLP's activation, ``silu_and_mul``, with the plan of its CPU kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: Plan | None = None  # which rows the CPU kernel takes (None: every row)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up, self.plan)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's experts' activation over fused ``[..., 2n]`` ``[gate | up]`` rows: the gate
    clamped above at ``limit``, the up clamped to ``[-limit, limit]``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)`` (HF's ``GptOssExperts._apply_gate``, whose
    checkpoints interleave gate and up; the loader puts them in halves)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class ClampedSwiGLU:
    """``clamped_swiglu`` at a model's ``limit`` and ``alpha`` (gpt-oss's experts), which the
    CPU's compiled MoE block takes as they are (``gpu/cpu/csrc/moe_block.cpp``)."""

    limit: float
    alpha: float = 1.702

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.limit, self.alpha)


class GeluAndMul(nn.Module):
    """Gemma's gated MLP activation, ``GELU(gate) * up`` with GELU's tanh approximation
    (``gelu_pytorch_tanh``), over a fused ``[..., 2n]`` gate/up projection. torch's form on
    every device: no fused kernel has it yet."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: Plan | None = None  # unused: kept as SiluAndMul's, which the planner reads

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class VocabParallelEmbedding(nn.Embedding):
    """Token embedding over this rank's rows of the vocabulary (all of it on one device)."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        tp = tensor_parallel()
        super().__init__(tp.shard_size(vocab_size), dim)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(super().forward, input_ids, self.num_embeddings, self.tp)


def vocab_parallel_lookup(lookup: Callable[[torch.Tensor], torch.Tensor],
                          input_ids: torch.Tensor, rows: int,
                          tp: TensorParallel) -> torch.Tensor:
    """``lookup(input_ids)`` over a table of each rank's ``rows`` vocabulary rows: under tensor
    parallelism each rank looks up the ids in its rows, zeros the others, and the ranks' rows
    are summed."""
    if tp.size == 1:
        return lookup(input_ids)
    local = input_ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    x = lookup(local.masked_fill(outside, 0))
    return tp.all_reduce(x.masked_fill_(outside[:, None], 0))


class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") RoPE with a precomputed cos/sin table per position
    (YaRN's attention factor, where it scales, folded into the table)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        self.table_args = (head_dim, max_positions, theta, scaling or {})
        cos, sin = self._table()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.plan: Plan | None = None  # which rows the CPU kernel takes (None: every row)

    def reset_table(self, device: torch.device | str) -> None:
        """Compute the float32 cos/sin table on ``device`` again: a model built on the meta
        device holds none once allocated (the table is no weight), or one cast to its dtype."""
        with torch.device(device):
            self.cos, self.sin = self._table()

    def _table(self) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim, max_positions = self.table_args[:2]
        if torch.get_default_device().type == "meta":  # shapes only (model_loader.read_model)
            empty = torch.empty(max_positions, head_dim)
            return empty, empty
        return _rotary_table(*self.table_args)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``/``k`` are ``[tokens, heads, head_dim]``. The compiled kernel rotates them in
        place (outside autograd: this is inference code) and returns them; the torch form
        returns new tensors."""
        kernels = fused_kernels_for(q, self.plan)
        if kernels is not None and (getattr(kernels, "TAKES_VIEWS", False)
                                    or positions.dtype == torch.int64):
            kernels.rotary_embedding(q, k, self.cos, self.sin, positions)
            return q, k
        return rotary_torch(q, k, self.cos, self.sin, positions)


def rotary_torch(q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].to(q.dtype)[:, None, :]
    sin = sin_table[positions].to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotary_table(head_dim: int, max_positions: int, theta: float,
                  scaling: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin of every position's angles, ``[max_positions, head_dim]`` each."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                / head_dim))
    if _rope_kind(scaling) == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, theta, scaling)
    else:
        inv_freq = _scale_inv_freq(inv_freq, scaling)
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = _yarn_attention_factor(scaling) if _rope_kind(scaling) == "yarn" else 1.0
    return emb.cos() * factor, emb.sin() * factor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_kind(scaling: dict) -> str:
    return scaling.get("rope_type") or scaling.get("type") or "default"


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = _rope_kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":  # a divisor per frequency, as GGUF's rope_freqs tensor holds
        return inv_freq / torch.tensor(scaling["factors"], dtype=inv_freq.dtype)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, "
                     "yarn, freq_factors")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by ``factor``, short
    ones kept, a smooth blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, base: float, s: dict) -> torch.Tensor:
    """YaRN (as HF's ``_compute_yarn_parameters``): frequencies that turn fewer than
    ``beta_slow`` times over the original context are slowed by ``factor``, those turning more
    than ``beta_fast`` times kept, a linear ramp over the dimensions in between."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    dim = 2 * inv_freq.shape[0]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency left unscaled
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _yarn_attention_factor(s: dict) -> float:
    """The scale of cos and sin: ``attention_factor``, else ``0.1 ln(factor) + 1`` (each
    term times ``mscale`` over ``mscale_all_dim``, where both are given)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = s["factor"]

    def mscale(scale: float = 1.0) -> float:
        return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(s["mscale"]) / mscale(s["mscale_all_dim"])
    return mscale()
