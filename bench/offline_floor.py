"""What an offline run's work costs at the rates torch itself reaches on this host.

Greedy generation of ``output_len`` tokens for each prompt has a fixed amount of work, whoever
does it: every prompt token and every generated token but the last goes through the layers'
linears, every generated token through the output head, and each decode step reads its
request's whole KV cache. Those matmul FLOPs at the rate of a large torch matmul, plus those KV
bytes at the rate of a streaming torch sum, give the run's time at rates this host reaches: an
estimate of where any engine's floor lies (a kernel tuned past torch's own, or a KV cache held
in the CPU's caches, can go somewhat under it), and so of how far any engine could get ahead of
the peer's time. The rest of the work (norms, activations, rotary, prefill attention) is left
out, which puts the estimate lower still.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.common import best_ms
from bench.decode_timing import sync
from tidal.gpu.model_config import ModelConfig

MATMUL_SIZE = 2048  # a square matmul this large runs near the host's best rate
READ_BYTES = {"cpu": 512 << 20, "cuda": 2 << 30}  # far past the CPU's caches / a GPU's L2


@dataclass
class HostRates:
    """The rates a large matmul and a streaming read reach here, in the run's dtype: the best
    of several calls each, as another tenant of the host can slow any one of them."""

    matmul_flop_per_s: float
    read_bytes_per_s: float

    @classmethod
    def measure(cls, device: str, dtype: str, repeats: int = 10) -> HostRates:
        torch_dtype = getattr(torch, dtype)
        a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device).to(torch_dtype)
        b = torch.randn_like(a)
        data = torch.ones(READ_BYTES[device.split(":")[0]] // a.element_size(), device=device,
                          dtype=torch_dtype)

        def matmul() -> None:
            torch.mm(a, b)
            sync(device)

        def read() -> None:
            data.sum()
            sync(device)

        matmul_ms, read_ms = best_ms(matmul, repeats), best_ms(read, repeats)
        return cls(matmul_flop_per_s=2 * MATMUL_SIZE ** 3 / (matmul_ms / 1000),
                   read_bytes_per_s=data.nbytes / (read_ms / 1000))


@dataclass
class OfflineWork:
    """The matmul FLOPs and KV-cache bytes read of greedily generating ``output_len`` tokens
    for each prompt (the first from its prefill, the rest from one decode step each)."""

    matmul_flop: float
    kv_read_bytes: float

    @classmethod
    def of(cls, config: ModelConfig, prompt_lens: list[int], output_len: int,
           dtype_size: int) -> OfflineWork:
        decodes = output_len - 1
        layer_tokens = sum(prompt_lens) + len(prompt_lens) * decodes
        head_macs = len(prompt_lens) * output_len * config.hidden_size * config.vocab_size
        macs = layer_tokens * config.num_layers * config.layer_linear_macs() + head_macs
        # decode step j (1 ... decodes) of an n-token prompt attends over n + j positions
        positions = sum(decodes * n + decodes * (decodes + 1) // 2 for n in prompt_lens)
        return cls(matmul_flop=2.0 * macs,
                   kv_read_bytes=float(positions * config.kv_bytes_per_token(dtype_size)))

    def seconds_at(self, rates: HostRates) -> float:
        return (self.matmul_flop / rates.matmul_flop_per_s
                + self.kv_read_bytes / rates.read_bytes_per_s)


def floor_report(work: OfflineWork, rates: HostRates, ours_seconds: float,
                 peer_seconds: float) -> dict:
    """The run's work, the host's rates, the time the work takes at them, and what that leaves
    for any engine against the peer: ``ratio_ceiling`` is the peer's time over that floor."""
    floor = work.seconds_at(rates)
    return {"matmul_tflop": work.matmul_flop / 1e12, "kv_read_gb": work.kv_read_bytes / 1e9,
            "torch_matmul_gflop_per_s": rates.matmul_flop_per_s / 1e9,
            "torch_read_gb_per_s": rates.read_bytes_per_s / 1e9,
            "floor_seconds": floor, "tidal_over_floor": ours_seconds / floor,
            "ratio_ceiling": peer_seconds / floor}
