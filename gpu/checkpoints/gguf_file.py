"""A GGUF file (llama.cpp's format) as a model: its weights by Hugging Face name, kept
quantized (``gguf_blocks.py``), and its metadata as a Hugging Face ``config.json`` would say it.

The file is read with the ``gguf`` package's ``GGUFReader``, which memory-maps it: a tensor's
bytes are read once, when it is unpacked, and the pages stay the page cache's, not the process's.

llama.cpp's converter permutes the rows of the query and key projections of Llama-architecture
models (Llama, Mistral) so that rotary pairs sit next to each other (its "normal" rotary); our
model, like Hugging Face's, rotates the two halves of each head ("neox"). The reader undoes that
permutation on the rows' raw bytes, before unpacking, which is valid for quantized rows since
every block lies within one row. Qwen2 and Qwen3 files are written unpermuted.

Mixture-of-experts files (``qwen3moe``; Mixtral's, which say ``llama`` with an expert count)
stack each layer's experts in one tensor per projection, ``blk.N.ffn_gate_exps`` ``[E, I, H]``
(and ``ffn_up_exps``, ``ffn_down_exps``), beside the router ``blk.N.ffn_gate_inp``. They are
read as the per-expert weights a Hugging Face checkpoint names
(``model.layers.N.mlp.experts.{e}.gate_proj.weight``), which the MoE loader stacks again
(``gpu/moe_weights.py``); a layer without them is a dense one (Qwen3-MoE's
``mlp_only_layers``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from tidal.gpu.checkpoints.gguf_blocks import QUANTIZED_TYPES, dense_tensor, to_weight
from tidal.gpu.checkpoints.gguf_gpt_oss import (
    GPT_OSS_ARCH,
    ExpertPairs,
    gpt_oss_config,
    is_expert_part,
)
from tidal.gpu.checkpoints.gguf_gpt_oss import LAYER_NAMES as GPT_OSS_NAMES
from tidal.gpu.checkpoints.gguf_settings import GEMMAS, gemma_config, moe_config

logger = logging.getLogger(__name__)

# GGUF general.architecture -> (the HF architecture, Q/K rows permuted by the converter)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),  # Mistral's GGUFs say llama too
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
    "gemma2": ("Gemma2ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
    GPT_OSS_ARCH: ("GptOssForCausalLM", False),  # gguf_gpt_oss.py
}
# Gemma's norms around each block, where GGUF's names differ from a Llama's
_GEMMA_NAMES = {"ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
MIXTRAL = "MixtralForCausalLM"  # a ``llama`` file with experts
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
# a layer's stacked experts -> each expert's projection
EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                "ffn_down_exps": "down_proj"}
FUSED_GATE_UP = "ffn_gate_up_exps"  # newer converters' gpt-oss experts, gate rows then up
LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
NOT_WEIGHTS = ("rope_freqs.weight",)  # read into the config (``hf_config``)


@lru_cache(maxsize=2)
def open_reader(path: str) -> GGUFReader:
    """The file's reader, parsed once per process (the config, the weights and the tokenizer
    all ask; parsing a 150,000-token vocabulary's metadata takes a while). A file the parser
    cannot read (damaged, truncated: numpy's errors as it walks the bytes) is a ``ValueError``
    that names it."""
    try:
        return GGUFReader(path)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever numpy raises on bytes that are wrong
        raise ValueError(f"{path}: not a readable GGUF file (damaged or truncated?): "
                         f"{type(exc).__name__}: {exc}") from None


def hf_name(name: str, arch: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``None`` for a
    tensor no model weight comes from."""
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    match = _LAYER_TENSOR.fullmatch(name)
    names = _arch_names(arch)
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        if part == "attn_sinks":  # a parameter of its own, not a module's weight
            return f"model.layers.{layer}.{names[part]}"
        return f"model.layers.{layer}.{names[part]}.{kind}"
    return None


def _arch_names(arch: str) -> dict[str, str]:
    if arch in GEMMAS:
        return {**_LAYER_NAMES, **_GEMMA_NAMES}
    if arch == GPT_OSS_ARCH:
        return {**_LAYER_NAMES, **GPT_OSS_NAMES}
    return _LAYER_NAMES


def gguf_weights(path: str | Path) -> Iterator[tuple[str, Any]]:
    """The file's weights as ``(Hugging Face name, float tensor or QuantizedWeight)``. The
    reader is dropped once they are read, so the file's pages leave the process with it."""
    try:
        yield from _read_weights(open_reader(str(path)))
    finally:
        open_reader.cache_clear()


def _read_weights(reader: GGUFReader) -> Iterator[tuple[str, Any]]:
    meta = Metadata(reader)
    permuted = ARCHITECTURES[meta.arch][1]
    heads = {"attn_q": meta.int("attention.head_count"),
             "attn_k": meta.int("attention.head_count_kv", meta.int("attention.head_count"))}
    pairs = ExpertPairs()
    for tensor in reader.tensors:
        name = hf_name(tensor.name, meta.arch)
        match = _LAYER_TENSOR.fullmatch(tensor.name)
        if (match and meta.arch == GPT_OSS_ARCH and is_expert_part(match.group(2))
                and not _kept_experts(tensor)):
            layer, part, kind = match.groups()
            yield from pairs.add(layer, part, kind, dense_tensor(tensor.name,
                                                                 tensor.tensor_type,
                                                                 tensor.data))
            continue
        if match and (name is None and match.group(2) in EXPERT_PARTS or _kept_experts(tensor)):
            yield from _experts(tensor)
            continue
        if name is None:
            if tensor.name not in NOT_WEIGHTS:
                logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        data = tensor.data
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if permuted and part in heads:
            data = data[unpermute_rows(data.shape[0], heads[part])]
        weight = to_weight(tensor.name, tensor.tensor_type, data)
        if meta.arch in GEMMAS and tensor.name.endswith("norm.weight"):
            weight = weight - 1  # llama.cpp stores Gemma's norms as the 1 + w they scale by
        yield name, weight
    pairs.check_done()


def _kept_experts(tensor: Any) -> bool:
    """Stacked MXFP4 expert weights (gpt-oss's, any ``_exps`` part): read as each expert's
    codebook weights, which the loader keeps in MXFP4 (``checkpoints.experts_arrive_quantized``)
    rather than dequantized."""
    return tensor.tensor_type == T.MXFP4 and tensor.name.endswith("_exps.weight")


def _experts(tensor: Any) -> Iterator[tuple[str, Any]]:
    """A stacked expert tensor ``[E, out, in]`` as each expert's weight, by HF name (a fused
    ``ffn_gate_up_exps``, gate rows first, as each expert's gate and up)."""
    _, layer, part, _ = tensor.name.split(".")
    data = tensor.data
    experts = int(tensor.shape[-1]) if len(tensor.shape) == 3 else data.shape[0]
    data = data.reshape(experts, -1, data.shape[-1])
    prefix = f"model.layers.{layer}.mlp.experts"
    for e in range(experts):
        if part == FUSED_GATE_UP:
            gate, up = np.split(data[e], 2)
            yield f"{prefix}.{e}.gate_proj.weight", to_weight(tensor.name, tensor.tensor_type, gate)
            yield f"{prefix}.{e}.up_proj.weight", to_weight(tensor.name, tensor.tensor_type, up)
            continue
        name = f"{prefix}.{e}.{EXPERT_PARTS[part]}.weight"
        yield name, to_weight(tensor.name, tensor.tensor_type, data[e])


def experts_in_mxfp4(path: str | Path) -> bool:
    """Whether the file's stacked experts are MXFP4, by the tensor index alone."""
    return any(_kept_experts(t) for t in open_reader(str(path)).tensors)


def all_linears_quantized(path: str | Path) -> bool:
    """Whether every decoder-layer linear of the file (``blk.N.attn_q.weight`` ...) is of a
    quantized type, by the tensor index alone (no data is read)."""
    linears = [t for t in open_reader(str(path)).tensors
               if t.name.startswith("blk.") and t.name.endswith(".weight")
               and t.name.split(".")[2] in LINEAR_PARTS]
    return bool(linears) and all(t.tensor_type in QUANTIZED_TYPES for t in linears)


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's ``permute`` of a Q or K projection of ``heads``
    heads: the converter's row ``h*d + 2i + j`` is Hugging Face's ``h*d + j*d/2 + i``."""
    order = np.arange(rows).reshape(heads, rows // heads // 2, 2)
    return order.transpose(0, 2, 1).reshape(-1)


class Metadata:
    """The file's key-value metadata, by key with the ``{arch}.`` prefix implied."""

    def __init__(self, reader: GGUFReader) -> None:
        self.reader = reader
        self.arch = str(self.get("general.architecture", None, prefixed=False))
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.arch!r} is not one tidal serves "
                             f"(it serves {', '.join(ARCHITECTURES)})")

    def get(self, key: str, default: Any = None, prefixed: bool = True) -> Any:
        name = f"{self.arch}.{key}" if prefixed else key
        field = self.reader.get_field(name)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:  # noqa: BLE001 - a damaged field's bytes
            raise ValueError(f"GGUF metadata {name} is damaged: {exc}") from None

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if isinstance(value, list):  # per-layer values (some models): tidal needs one
            if len(set(value)) != 1:
                raise ValueError(f"GGUF {self.arch}.{key} differs between layers: {value}")
            value = value[0]
        if value is None:
            raise ValueError(f"GGUF metadata lacks {self.arch}.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"GGUF metadata {self.arch}.{key} must be an integer, "
                             f"got {value!r}")
        return int(value)

    def float(self, key: str, default: float) -> float:
        """A float32 setting as the decimal it was written from (``1e-06``, not
        ``9.99999997e-07``): the shortest one that gives the same float32."""
        return float(str(np.float32(self.get(key, default))))

    def tensor(self, name: str) -> Any:
        return next((t for t in self.reader.tensors if t.name == name), None)


def hf_config(path: str | Path) -> dict[str, Any]:
    """What a Hugging Face ``config.json`` of this model would hold, from the metadata;
    a setting missing or of the wrong kind is a ``ValueError`` naming the file and key."""
    try:
        return _hf_config(path)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if str(path) in message else f"{path}: {message}") from None


def _hf_config(path: str | Path) -> dict[str, Any]:
    meta = Metadata(open_reader(str(path)))
    heads = meta.int("attention.head_count")
    hidden = meta.int("embedding_length")
    embed = meta.tensor("token_embd.weight")
    vocab = (int(embed.shape[-1]) if embed is not None
             else len(meta.get("tokenizer.ggml.tokens", [], prefixed=False)))
    return {
        "architectures": [MIXTRAL if meta.arch == "llama" and meta.get("expert_count")
                          else ARCHITECTURES[meta.arch][0]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.int("feed_forward_length",
                                      meta.get("expert_feed_forward_length")),
        "num_hidden_layers": meta.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.int("attention.head_count_kv", heads),
        "head_dim": meta.int("attention.key_length", hidden // heads),
        "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": meta.int("context_length", 2048),
        "rope_theta": meta.float("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta),
        "tie_word_embeddings": meta.tensor("output.weight") is None,
        "eos_token_id": [int(v) for key in ("eos_token_id", "eot_token_id")
                         if (v := meta.get(f"tokenizer.ggml.{key}", prefixed=False))
                         is not None],
        **moe_config(meta),
        **gemma_config(meta, hidden, heads),
        **(gpt_oss_config(meta) if meta.arch == GPT_OSS_ARCH else {}),
    }


def _rope_scaling(meta: Metadata) -> dict[str, Any] | None:
    """Linear scaling from the metadata; Llama 3's frequency factors, which the converter
    writes as the ``rope_freqs`` tensor instead of settings."""
    freqs = meta.tensor("rope_freqs.weight")
    if freqs is not None:
        return {"rope_type": "freq_factors",
                "factors": np.asarray(freqs.data, dtype=np.float32).tolist()}
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not one tidal reads (it reads "
                         "linear and yarn)")
    scaling = {"rope_type": kind, "factor": meta.float("rope.scaling.factor", 1.0)}
    if kind == "yarn":  # llama.cpp's defaults for the betas where the file has none
        scaling.update(original_max_position_embeddings=meta.int(
            "rope.scaling.original_context_length"),
            beta_fast=meta.float("rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=meta.float("rope.scaling.yarn_beta_slow", 1.0))
        if meta.arch == GPT_OSS_ARCH:
            scaling["truncate"] = False  # as gpt-oss's own config says
    return scaling
