"""Attention backends over the paged KV cache, behind one interface."""

from gpu.attention.backend import AttentionBackend
from gpu.attention.metadata import AttentionMetadata
from gpu.attention.torch_ref import TorchAttentionBackend


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """``torch`` (the CPU default) or ``triton`` (the GPU default)."""
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from gpu.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be one of 'auto', 'torch', 'triton', got {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend",
           "get_attention_backend"]
