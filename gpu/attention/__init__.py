"""Attention backends over the paged KV cache, behind one interface."""

from tidal.gpu.attention.backend import AttentionBackend
from tidal.gpu.attention.cpu_backend import CpuAttentionBackend
from tidal.gpu.attention.metadata import AttentionMetadata
from tidal.gpu.attention.torch_ref import TorchAttentionBackend
from tidal.gpu.cpu.kernels import load_cpu_kernels


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """``cpu`` (the CPU default, C++ decode kernels; ``torch`` where they can't be built),
    ``torch`` (attention in plain torch) or ``triton`` (the GPU default). The other CPU
    kernels (RMSNorm, rotary) follow ``TIDAL_NO_CPU_KERNELS`` alone."""
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "cpu"
    if name == "cpu":
        kernels = load_cpu_kernels()
        return CpuAttentionBackend(kernels) if kernels is not None else TorchAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from tidal.gpu.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError("attention_backend must be one of 'auto', 'cpu', 'torch', 'triton', "
                     f"got {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "CpuAttentionBackend", "TorchAttentionBackend",
           "get_attention_backend"]
