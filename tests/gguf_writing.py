"""GGUF files written in the tests, as llama.cpp's converter writes them: a random Hugging Face
model directory's metadata, byte-level BPE tokenizer and weights, quantized with the ``gguf``
package's reference quantizers (Q8_0, Q4_0, BF16) or, for the K types it only dequantizes, with
the packers below (blocks laid out as ggml's ``block_q4_K`` / ``block_q6_K``), and the query and
key rows of Llama models permuted as the converter permutes them."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file
from transformers import AutoTokenizer

# Hugging Face layer weight names -> GGUF's
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


# a mixture of experts' router and each expert's projections (Qwen3-MoE's names, Mixtral's)
ROUTERS = ("mlp.gate", "block_sparse_moe.gate")
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
EXPERT_STACKS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


# Gemma's norms around each block (llama.cpp's names), and its archs
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
GEMMAS = ("gemma2", "gemma3")
# gpt-oss's parts (llama.cpp's names) and its experts in a checkpoint
GPT_OSS_NAMES = {"self_attn.sinks": "attn_sinks", "post_attention_layernorm":
                 "post_attention_norm", "mlp.router": "ffn_gate_inp"}
GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                             r"(_bias)?")


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    if module in ROUTERS:
        return f"blk.{layer}.ffn_gate_inp.{kind}"
    if arch == "gpt-oss" and rest in GPT_OSS_NAMES:  # the sinks: no module, no kind
        return f"blk.{layer}.{GPT_OSS_NAMES[rest]}.weight"
    if arch == "gpt-oss" and module in GPT_OSS_NAMES:
        return f"blk.{layer}.{GPT_OSS_NAMES[module]}.{kind}"
    names = {**LAYER_NAMES, **GEMMA_NAMES} if arch in GEMMAS else LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (on any row layout: floats or blocks)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    """``w`` [rows, k] in ``qtype``'s blocks, [rows, bytes a row] (F32/F16: the floats)."""
    if qtype == T.Q4_K:
        return pack_q4_k(w)
    if qtype == T.Q6_K:
        return pack_q6_k(w)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def _f16_bytes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` [blocks] as float16 (its bytes [blocks, 2]) and back as float32."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def pack_q4_k(w: np.ndarray) -> np.ndarray:
    """Super-blocks of 256: 8 sub-blocks of 32, ``w = d*sc*q - dmin*m``, 6-bit sc and m."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    sub_scale, sub_min = (hi - lo) / 15, -lo
    d_bytes, d = _f16_bytes(sub_scale.max(-1) / 63)
    m_bytes, dmin = _f16_bytes(sub_min.max(-1) / 63)
    sc = np.clip(np.round(sub_scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(sub_min / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    scale = d[:, None] * sc
    q = np.round((x + (dmin[:, None] * m)[..., None]) / np.where(scale == 0, 1, scale)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    scales = np.concatenate([
        (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
        (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1).astype(np.uint8)
    return np.concatenate([d_bytes, m_bytes, scales, qs], axis=1).reshape(rows, -1)


def pack_q6_k(w: np.ndarray) -> np.ndarray:
    """Super-blocks of 256: 16 sub-blocks of 16, ``w = d*sc*(q - 32)``, 6-bit q, int8 sc."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 16, 16)
    sub_scale = np.abs(x).max(-1) / 31
    d_bytes, d = _f16_bytes(sub_scale.max(-1) / 127)
    sc = np.clip(np.round(sub_scale / np.where(d == 0, 1, d)[:, None]), -128, 127)
    scale = d[:, None] * sc
    q = np.round(x / np.where(scale == 0, 1, scale)[..., None])
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    high = high.reshape(-1, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(-1, 64)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, d_bytes], axis=1).reshape(rows, -1)


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    """The HF directory's byte-level BPE tokenizer as llama.cpp writes a ``gpt2`` one."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = json.loads((model_dir / "tokenizer.json").read_text())["model"]["merges"]
    special = set(tok.all_special_ids) | {vocab[t] for t in tok.get_added_vocab()
                                          if t.startswith("<|")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_chat_template(tok.chat_template)


def add_config(writer: gguf.GGUFWriter, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}  # transformers 5 keeps rope_theta there
    rope = rope.get("full_attention", rope)  # Gemma 3's: by layer type, the global layers'
    writer.add_rope_freq_base(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    arch = (config.get("architectures") or [""])[0]
    if arch == "GptOssForCausalLM":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch.startswith("Gemma"):  # as llama.cpp's Gemma converters
        writer.add_value_length(config["head_dim"])
        writer.add_sliding_window(config["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key):
                getattr(writer, f"add_{key}")(config[key])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def write_gguf(model_dir: Path, out: Path, arch: str,
               types: dict[str, T]) -> dict[str, np.ndarray]:
    """Write ``model_dir`` as ``out``; ``types`` maps GGUF tensor names to their type (F32 for
    the rest). Returns the Hugging Face weights as the file holds them, dequantized by
    ``gguf.quants.dequantize`` (the reference): the float twin's weights."""
    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(out, arch)
    add_config(writer, config)
    add_tokenizer(writer, model_dir)
    twin: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, tuple[str, np.ndarray]]] = defaultdict(dict)
    for hf, w in load_file(model_dir / "model.safetensors").items():
        if match := EXPERT.fullmatch(hf):
            layer, expert, part = match.groups()
            stacks[f"blk.{layer}.{EXPERT_STACKS[part]}.weight"][int(expert)] = (hf, w)
            continue
        if match := GPT_OSS_EXPERTS.fullmatch(hf):
            _add_gpt_oss_experts(writer, match.group(1), hf, w, types, twin)
            continue
        name = gguf_name(hf, arch)
        qtype = types.get(name, T.F32)
        packed = quantize(w, qtype) if w.ndim == 2 else w.astype(np.float32)
        twin[hf] = gguf.quants.dequantize(packed, qtype).reshape(w.shape)
        if arch in GEMMAS and name.endswith("norm.weight"):
            packed = packed + 1  # llama.cpp stores Gemma's norms as the 1 + w they scale by
        heads = {"attn_q": config["num_attention_heads"],
                 "attn_k": config["num_key_value_heads"]}.get(name.split(".")[-2])
        if arch == "llama" and heads is not None:
            packed = llama_cpp_permute(packed, heads)
        writer.add_tensor(name, packed, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    for name, experts in stacks.items():
        _add_experts(writer, name, [experts[e] for e in sorted(experts)],
                     types.get(name, T.F32), twin)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return twin


def _add_experts(writer: gguf.GGUFWriter, name: str, experts: list[tuple[str, np.ndarray]],
                 qtype: T, twin: dict[str, np.ndarray]) -> None:
    """One projection of a layer's experts stacked ``[E, out, in]``, as llama.cpp's converter
    writes them; each expert's dequantized matrix into ``twin``."""
    stacked = np.stack([w for _, w in experts]).astype(np.float32)
    num, rows, cols = stacked.shape
    packed = quantize(stacked.reshape(num * rows, cols), qtype)
    back = gguf.quants.dequantize(packed, qtype).reshape(stacked.shape)
    for (hf, _), value in zip(experts, back):
        twin[hf] = value
    writer.add_tensor(name, packed.reshape(num, rows, -1),
                      raw_dtype=None if qtype in (T.F32, T.F16) else qtype)


def _add_gpt_oss_experts(writer: gguf.GGUFWriter, layer: str, hf: str, w: np.ndarray,
                         types: dict[str, T], twin: dict[str, np.ndarray]) -> None:
    """A gpt-oss checkpoint's experts as llama.cpp's converter writes them: ``gate_up_proj``
    ``[E, H, 2I]`` (gate and up columns interleaved) split into ``ffn_gate_exps`` and
    ``ffn_up_exps`` ``[E, I, H]``, ``down_proj`` ``[E, I, H]`` transposed into
    ``ffn_down_exps``, the biases split alike; ``twin`` gets them back in the checkpoint's
    form, dequantized."""
    w = w.astype(np.float32)
    if hf.endswith("_bias"):
        if "gate_up" in hf:
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(w[:, ::2]))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(w[:, 1::2]))
        else:
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", w)
        twin[hf] = w
        return
    rows = w.transpose(0, 2, 1)  # [E, out, in]
    parts = ({"ffn_gate_exps": rows[:, ::2], "ffn_up_exps": rows[:, 1::2]} if "gate_up" in hf
             else {"ffn_down_exps": rows})
    back = {}
    for part, value in parts.items():
        name = f"blk.{layer}.{part}.weight"
        qtype = types.get(name, T.F32)
        num, out, cols = value.shape
        packed = quantize(np.ascontiguousarray(value).reshape(num * out, cols), qtype)
        back[part] = gguf.quants.dequantize(packed, qtype).reshape(value.shape)
        writer.add_tensor(name, packed.reshape(num, out, -1),
                          raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    if "gate_up" in hf:
        both = np.stack([back["ffn_gate_exps"], back["ffn_up_exps"]], axis=2)
        twin[hf] = both.reshape(w.shape[0], -1, w.shape[1]).transpose(0, 2, 1)
    else:
        twin[hf] = back["ffn_down_exps"].transpose(0, 2, 1)
