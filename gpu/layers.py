"""Building blocks of Llama-family models: RMSNorm, rotary position embeddings and the gated
MLP's activation.

On the CPU each runs as one compiled kernel (``gpu/cpu/csrc/kernels.cpp``, ``activation.cpp``)
where they are built and their plan (timed on the host, ``gpu/cpu/op_plans.py``) says they are
faster for the rows at hand: the torch forms below are 6, 14 and 2 ops, whose fixed costs
dominate a decode step and whose intermediates are each a trip through memory at prefill
sizes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu.kernels import cpu_kernels_for
from gpu.cpu.selector import Plan


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, as HF's LlamaRMSNorm does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.plan: Plan | None = None  # which rows the CPU kernel takes (None: every row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels_for(x, self.plan)
        if kernels is not None and x.is_contiguous():
            return kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, norm(x + delta))``: a residual add and the norm after it, in one
        pass on the CPU (the add alone is a trip through memory at prefill sizes)."""
        kernels = cpu_kernels_for(x, self.plan)
        if kernels is not None and x.is_contiguous() and delta.is_contiguous():
            return kernels.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


def silu_and_mul(gate_up: torch.Tensor, plan: Plan | None = None) -> torch.Tensor:
    """``SiLU(gate) * up`` of a fused ``[..., 2n]`` gate/up projection, rounded as HF's
    ``F.silu(gate) * up`` (SiLU to the input dtype, then the product)."""
    kernels = cpu_kernels_for(gate_up, plan)
    if kernels is not None and gate_up.is_contiguous():
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") RoPE with a precomputed cos/sin table per position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":  # shapes only (model_loader.read_model)
            cos = sin = torch.empty(max_positions, head_dim)
        else:
            cos, sin = _rotary_table(head_dim, max_positions, theta, scaling or {})
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.plan: Plan | None = None  # which rows the CPU kernel takes (None: every row)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``/``k`` are ``[tokens, heads, head_dim]``. The compiled kernel rotates them in
        place (outside autograd: this is inference code) and returns them; the torch form
        returns new tensors."""
        kernels = cpu_kernels_for(q, self.plan)
        if kernels is not None and positions.dtype == torch.int64:
            kernels.rotary_embedding(q, k, self.cos, self.sin, positions)
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotary_table(head_dim: int, max_positions: int, theta: float,
                  scaling: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin of every position's angles, ``[max_positions, head_dim]`` each."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                / head_dim))
    inv_freq = _scale_inv_freq(inv_freq, scaling)
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":  # a divisor per frequency, as GGUF's rope_freqs tensor holds
        return inv_freq / torch.tensor(scaling["factors"], dtype=inv_freq.dtype)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, "
                     "freq_factors")


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
