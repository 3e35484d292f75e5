"""The part of each weight a tensor-parallel rank holds.

The q/k/v and gate/up projections are split by their outputs (column-parallel: each rank
computes its own heads and its own slice of the MLP), the output and down projections by their
inputs (row-parallel: each rank's product is a partial sum, all-reduced once), and the
embedding and output head by vocabulary rows. Attention heads go to ranks in order with their
KV heads; where there are fewer KV heads than ranks, ranks sharing a KV head each hold a copy.
Quantized weights are cut the same way, at their group boundaries.

A MoE block's router is whole on every rank (each routes alike); every expert's intermediate
is split as the dense MLP's is: each rank holds its slice of every expert's gate and up rows
and down inputs (``moe_weights.shard_experts``), and the block's output is all-reduced once.
gpt-oss's attention sinks (one a head) go with their heads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from tidal.gpu.distributed import TensorParallel
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.moe_weights import shard_experts
from tidal.gpu.quantization.weights import QuantizedWeight, Weight

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """``ValueError`` naming ``tensor_parallel_size`` where the model cannot be split so."""
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (nor does it divide by them)")
    if cfg.intermediate_size % size:
        problems.append(f"an intermediate size of {cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % size:
        problems.append(f"an expert intermediate size of {cfg.moe_intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         f"{' or '.join(problems)}")


def local_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """``cfg`` as one rank sees it: its heads, KV heads and MLP slice (vocabulary and hidden
    size whole)."""
    if tp.size == 1:
        return cfg
    check_tensor_parallel(cfg, tp.size)
    return replace(cfg, num_heads=cfg.num_heads // tp.size,
                   num_kv_heads=max(1, cfg.num_kv_heads // tp.size),
                   intermediate_size=cfg.intermediate_size // tp.size,
                   moe_intermediate_size=cfg.moe_intermediate_size // tp.size)


def shard_weights(weights: Iterable[tuple[str, Weight]], cfg: ModelConfig,
                  tp: TensorParallel) -> Iterator[tuple[str, Weight]]:
    """This rank's part of each of a checkpoint's weights (Hugging Face names)."""
    for name, value in weights:
        yield name, shard_weight(name, value, cfg, tp)


def shard_weight(name: str, value: Weight, cfg: ModelConfig, tp: TensorParallel) -> Weight:
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    if tp.size == 1:
        return value
    experts = shard_experts(name, value, cfg.moe_intermediate_size // tp.size, tp.rank)
    if experts is not None:  # a MoE's experts: each expert's intermediate split alike
        return experts
    if parts[-1] == "sinks":  # gpt-oss's attention sinks: one a head
        heads = cfg.num_heads // tp.size
        return value.narrow(0, tp.rank * heads, heads)
    if module not in _COLUMN + _ROW + _VOCAB:
        return value
    if module in _VOCAB:
        return _vocab_rows(value, tp)
    start, length = _span(module, local_config(cfg, tp), cfg, tp.rank)
    if module in _ROW:
        if parts[-1] != "weight":  # a bias of a row-parallel linear is added once, on rank 0
            return value if tp.rank == 0 else torch.zeros_like(value)
        return (value.narrow_cols(start, length) if isinstance(value, QuantizedWeight)
                else value.narrow(1, start, length))
    return (value.narrow_rows(start, length) if isinstance(value, QuantizedWeight)
            else value.narrow(0, start, length))


def _span(module: str, local: ModelConfig, cfg: ModelConfig, rank: int) -> tuple[int, int]:
    """Where this rank's outputs (column-parallel) or inputs (row-parallel) start, and how
    many it has."""
    hd = cfg.head_dim
    if module in ("q_proj", "o_proj"):
        return rank * local.num_heads * hd, local.num_heads * hd
    if module in ("k_proj", "v_proj"):
        first_kv_head = rank * local.num_heads // (cfg.num_heads // cfg.num_kv_heads)
        return first_kv_head * hd, local.num_kv_heads * hd
    return rank * local.intermediate_size, local.intermediate_size


def _vocab_rows(value: Weight, tp: TensorParallel) -> torch.Tensor:
    """This rank's vocabulary rows, zero-padded to the shard size."""
    if isinstance(value, QuantizedWeight):
        value = value.dequantize()  # the embedding and output head are kept in the dtype
    vocab = value.shape[0]
    size = tp.shard_size(vocab)
    start = min(tp.rank * size, vocab)
    rows = value[start:start + size]
    if rows.shape[0] == size:
        return rows
    pad = torch.zeros((size - rows.shape[0], *rows.shape[1:]), dtype=rows.dtype)
    return torch.cat([rows, pad])
