"""Load a model's checkpoint (``gpu/checkpoints/``) into our model code."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from tidal.gpu.attention import AttentionBackend
from tidal.gpu.checkpoints import (
    checkpoint_weights,
    experts_arrive_quantized,
    linears_arrive_quantized,
)
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.backend import CpuBackend, prepare_for_cpu
from tidal.gpu.cpu.packed_linear import TWO_LAYOUTS_MAX_BYTES, can_pack
from tidal.gpu.cpu.selector import PlanCache
from tidal.gpu.layers import RotaryEmbedding
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.models import MODELS
from tidal.gpu.moe_weights import checkpoint_layout, expert_slot
from tidal.gpu.pipeline import stage_weights
from tidal.gpu.quantization.apply import (
    QUANTIZED_LINEARS,
    install,
    leave_unallocated,
    log_quantized,
    quantize_on_read,
    quantized_bytes,
)
from tidal.gpu.quantization.experts import (
    ExpertCollector,
    counterpart,
    leave_experts_unallocated,
)
from tidal.gpu.quantization.head import (
    QuantEmbedding,
    QuantHead,
    install_tied_head,
    leave_vocab_unallocated,
    quantize_head,
)
from tidal.gpu.quantization.linear import QuantLinear
from tidal.gpu.quantization.planner import QuantPlanner
from tidal.gpu.quantization.weights import QuantizedWeight, Weight, cat_rows
from tidal.gpu.weight_shards import shard_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF parameter name suffix -> (our fused parameter, shard index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model: over which attention backend, for how many positions, in which
    dtype and on which device; its decoder layers' linears quantized where ``quantization``
    says (``int8``, or ``int4`` in groups of ``group_size``). On the CPU its ops are planned
    for steps of up to ``max_rows`` tokens and ``max_seqs`` decode rows
    (``gpu/cpu/op_plans.py``), from ``plan_cache`` (by default this host's), by timing them
    unless not ``timed``."""

    backend: AttentionBackend
    max_positions: int
    dtype: torch.dtype
    device: str
    max_rows: int = 256
    max_seqs: int = 64
    plan_cache: PlanCache | None = None
    timed: bool = True
    quantization: str | None = None
    group_size: int = 32
    # a model read from the same checkpoint and options (the one serving, for its upgrade):
    # its int8 embedding and head are taken as they are, not quantized and held a second time,
    # and its quantized linears' and experts' packed layouts where the new plans use them too
    reuse: nn.Module | None = None


class LoadedModel(NamedTuple):
    """A model ready to run, and on the CPU (where its dtype is packed) its plans and one-call
    decode step, which the runner offers each step to first (``gpu/cpu/backend.py``)."""

    model: nn.Module
    cpu: CpuBackend | None


def load_model(model_dir: str | Path, cfg: ModelConfig, options: LoadOptions) -> LoadedModel:
    """The model, ready to run, as ``options`` say. On the CPU, quantized experts are planned
    and packed as each layer's are read (``ExpertCollector``), from the plans and cache the
    rest of the model's ops are planned with after."""
    if not can_pack(options.device, options.dtype):
        return LoadedModel(read_model(model_dir, cfg, options), None)
    auto = selector.mode() == "auto"
    timed = options.timed and auto
    # untimed under auto, this host's plans still say how its quantized linears ran best
    cache = options.plan_cache if options.plan_cache is not None else (
        PlanCache() if auto else None)
    # used where the experts stay quantized (read_model decides)
    planner = (lambda nbytes: QuantPlanner(options.max_rows, cache if timed else None,
                                           nbytes > TWO_LAYOUTS_MAX_BYTES,
                                           hints=None if timed else cache))
    model = read_model(model_dir, cfg, options, planner)
    cpu = prepare_for_cpu(model, options.max_rows, options.max_seqs, cache, options.timed)
    return LoadedModel(model, cpu)


def read_model(model_dir: str | Path, cfg: ModelConfig, options: LoadOptions,
               planner: Callable[[int], QuantPlanner] | None = None) -> nn.Module:
    """The model with its weights read, in plain torch layers (nothing packed or planned).
    With ``quantization``, each decoder linear's weight is quantized as it is read, so the
    float model never exists whole in memory; nor does it where the checkpoint's linears are
    all quantized already (a GGUF's). Under tensor parallelism each weight is cut to this
    rank's part as it is read (after quantization, so that the parts are the whole's); a
    pipeline stage reads its layers' weights only.
    With ``quantization``, the output head becomes int8 with one scale per row, which a tied
    embedding shares, and an untied embedding is int8 per row too
    (``gpu/quantization/head.py``). Experts stay quantized under ``quantization`` and where
    they arrive so (MXFP4's). ``planner``, given the bytes the model's quantized weights will
    take, plans the experts as each layer's are read."""
    quantization, dtype, device = options.quantization, options.dtype, options.device
    keep_experts = quantization is not None or experts_arrive_quantized(model_dir)
    with torch.device("meta"), _uninitialized_layers():
        model = MODELS[cfg.architecture](cfg, options.backend, options.max_positions)
        if cfg.num_labels:  # a sequence classifier's head, applied by the pooler
            model.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
    weights = checkpoint_layout(cfg.architecture, checkpoint_weights(model_dir))
    experts_planner = None
    if keep_experts and planner is not None:
        experts_planner = planner(quantized_bytes(model, quantization, options.group_size))
    if quantization is not None or linears_arrive_quantized(model_dir):
        leave_unallocated(model)
    if keep_experts:
        leave_experts_unallocated(model)
    if quantization is not None:
        leave_vocab_unallocated(model)
    if quantization is not None:
        weights = quantize_on_read(weights, quantization, options.group_size)
    if model.tp.size > 1:
        weights = shard_weights(weights, cfg, model.tp)
    if model.stage.size > 1:
        weights = stage_weights(weights, model.stage, cfg.num_layers)
    model = model.to(dtype).to_empty(device=device)  # in the dtype: no float32 copy first
    model.tie_weights()
    _reset_rotary_tables(model, device)
    _load_weights(model, model.local_config, weights, dtype, str(model_dir),
                  quantized=quantization is not None, planner=experts_planner,
                  reuse=options.reuse, keep_experts=keep_experts)
    if keep_experts:
        log_quantized(model, quantization, options.group_size)
    return model.eval()


def _reset_rotary_tables(model: nn.Module, device: str) -> None:
    """The rotary tables are no weights: computed again, in float32, once the model is on
    ``device``."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_table(device)


@contextmanager
def _uninitialized_layers() -> Iterator[None]:
    """Linear and embedding layers built without their random initialization, for a model
    built on the meta device only to have its weights read into it. On meta tensors torch runs
    the initializers through its Python reference ops, whose first call imports torch._dynamo,
    and Triton with it, into a server that never compiles (bench/NOTES.md: what that costs)."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = _no_initialization
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset


def _no_initialization(_layer: nn.Module) -> None:
    pass


def _load_weights(model: nn.Module, cfg: ModelConfig, weights: Iterable[tuple[str, Weight]],
                  dtype: torch.dtype, source: str, quantized: bool = False,
                  planner: QuantPlanner | None = None, reuse: nn.Module | None = None,
                  keep_experts: bool = False) -> None:
    """``quantized`` (``--quantization``): the output head and embedding int8 per row (or
    ``reuse``'s). ``keep_experts``: the experts, quantized as read (or read so), kept so
    (``gpu/quantization/experts.py``), and planned and packed as each layer's are read where
    a ``planner`` is given."""
    params = dict(model.named_parameters())
    device = next(model.parameters()).device  # checkpoints are read on the CPU
    loaded: set[str] = set()
    shards: dict[str, dict[int, QuantizedWeight]] = {}  # quantized target -> shards read so far
    experts = ExpertCollector(model, dtype, planner, reuse)
    tied_head = quantized and cfg.tie_word_embeddings
    for name, value in weights:
        slot = expert_slot(name)  # a MoE's per-expert weight (gpu/moe_weights.py)
        if slot is not None and slot.target in params:
            if keep_experts and isinstance(value, QuantizedWeight):
                experts.take(slot, value.to(device))
            else:
                slot.copy_into(params[slot.target], value.to(device))
            loaded.add(slot.target)
            continue
        target, shard = _map_name(name)
        if target is None or target not in params:
            if not name.endswith("rotary_emb.inv_freq"):
                logger.debug("skipping weight %s", name)
            continue
        value = value.to(device)  # quantized weights, which no parameter's copy_ moves
        if target == "embed_tokens.weight" and _in_place(value, model.embed_tokens, dtype, cfg):
            model.embed_tokens.weight = nn.Parameter(value, requires_grad=False)
            loaded.add(target)
            continue
        if tied_head and target == "embed_tokens.weight":
            install_tied_head(model, _int8_rows(value, reuse, "lm_head"), dtype)
            loaded.add(target)
            continue
        if quantized and target == "lm_head.weight":  # an untied head: int8 alone
            model.lm_head = _untied_head(value, reuse, dtype)
            loaded.add(target)
            continue
        if quantized and target == "embed_tokens.weight":  # an untied embedding: int8 rows
            model.embed_tokens = QuantEmbedding(_int8_rows(value, reuse, "embed_tokens"), dtype)
            loaded.add(target)
            continue
        if isinstance(value, QuantizedWeight):
            if _takes_quantized(target):
                shards.setdefault(target, {})[0 if shard is None else shard] = value
                loaded.add(target)
                continue
            value = value.dequantize()  # the embedding or output head: kept in the dtype
        param = params[target]
        with torch.no_grad():
            if shard is None:
                param.copy_(value)
            else:
                _fused_slice(param, target, shard, cfg).copy_(value)
        loaded.add(target)
    for target, parts in shards.items():
        layer = _install_quantized(model, target, parts, dtype)
        layer.borrow(counterpart(reuse, target.removesuffix(".weight")))
    experts.install()
    if cfg.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"weights missing from {source}: {sorted(missing)[:5]}")


def _in_place(value: Weight, embedding: nn.Module, dtype: torch.dtype, cfg: ModelConfig) -> bool:
    """Whether an untied embedding is used as read: a float tensor in the model's dtype and
    the layer's shape (under ``--quantization`` too). On the CPU that is the checkpoint's
    memory map (safetensors' tensors, a GGUF's float ones), of which only the rows looked up
    become resident, as with llama.cpp's mapped files: the rest of a large vocabulary's
    embedding (a gigabyte for gpt-oss's) stays on disk. A tied embedding is the output head,
    read whole every step."""
    shape = (embedding.num_embeddings, embedding.embedding_dim)
    return (not cfg.tie_word_embeddings and isinstance(value, torch.Tensor)
            and value.dtype == dtype and value.is_contiguous() and tuple(value.shape) == shape)


def _int8_rows(value: Weight, reuse: nn.Module | None, layer: str) -> QuantizedWeight:
    """``value`` as int8 rows (``quantize_head``), or ``reuse``'s ``layer`` weight where it has
    one (the same checkpoint's rows, quantized alike)."""
    weight = getattr(getattr(reuse, layer, None), "weight_format", None)
    if isinstance(weight, QuantizedWeight) and weight.shape == tuple(value.shape):
        return weight
    return quantize_head(value)


def _untied_head(value: Weight, reuse: nn.Module | None, dtype: torch.dtype) -> QuantHead:
    """An untied head as int8 rows (``_int8_rows``); where ``reuse``'s head has let its rows go
    for its packed layouts, one that borrows those (``QuantHead.borrowing``)."""
    lender = getattr(reuse, "lm_head", None)
    if isinstance(lender, QuantHead) and lender.can_lend(tuple(value.shape), dtype):
        return QuantHead.borrowing(lender, value, dtype)
    return QuantHead(_int8_rows(value, reuse, "lm_head"), dtype, tied=False)


def _takes_quantized(target: str) -> bool:
    """Whether ``target`` is a decoder-layer linear's weight, which stays quantized."""
    parts = target.split(".")
    return len(parts) > 2 and parts[-2] in QUANTIZED_LINEARS and parts[-1] == "weight"


def _install_quantized(model: nn.Module, target: str,
                       shards: dict[int, QuantizedWeight], dtype: torch.dtype) -> QuantLinear:
    """Replace the linear ``target`` names (``layers.0.self_attn.qkv_proj.weight``) with a
    ``QuantLinear`` over its shards fused in order."""
    path, attr, _ = target.rsplit(".", 2)
    parent = model.get_submodule(path)
    linear = getattr(parent, attr)
    expected = 3 if attr == "qkv_proj" else 2 if attr == "gate_up_proj" else 1
    if sorted(shards) != list(range(expected)):
        raise ValueError(f"quantized {target} is missing shards: got {sorted(shards)}")
    weight = cat_rows([shards[i] for i in range(expected)])
    shape = (linear.out_features, linear.in_features)
    if weight.shape != shape:
        raise ValueError(f"quantized {target} is {list(weight.shape)}, the model's {list(shape)}")
    return install(parent, attr, weight, linear.bias, dtype)


def _map_name(name: str) -> tuple[str | None, int | None]:
    if name.startswith("model."):
        name = name[len("model."):]
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
    return name, None


def _fused_slice(param: torch.Tensor, target: str, shard: int,
                 cfg: ModelConfig) -> torch.Tensor:
    if "qkv_proj" in target:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size] * 2
    start = sum(sizes[:shard])
    return param.narrow(0, start, sizes[shard])
