"""The architecture facts our model code needs, read from a HF ``config.json`` or a GGUF
file's metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tidal.gpu.gemma_config import GEMMA_ARCHITECTURES, GemmaFacts, with_gemma_facts
from tidal.gpu.gpt_oss_config import GPT_OSS, GptOssFacts, with_gpt_oss_facts
from tidal.gpu.model_checks import ModelFileError, check_config_values, check_shape_rules

# architecture name in config.json -> (qkv bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Gemma2ForCausalLM": (False, False),
    "Gemma3ForCausalLM": (False, True),
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    "GptOssForCausalLM": (False, False),  # q/k/v/o biases where attention_bias (its default)
}
# The bodies without an output head that embedding models ship (Qwen3-Embedding's checkpoint
# has no lm_head): read as their causal model, its head tied to the embedding and never used
# by a pooling runner (core/pooling.py)
HEADLESS_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
# Cross-encoders and LLM rerankers (core/pooling.py): the causal model's body, and a ``score``
# head [num_labels, hidden] (no bias) on the last token's final hidden state, no lm_head
CLASSIFIER_ARCHITECTURES = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # the output projection's bias (gpt-oss)
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    gemma: GemmaFacts | None = None  # Gemma 2/3's sliding windows etc. (gpu/gemma_config.py)
    gpt_oss: GptOssFacts | None = None  # gpt-oss's windows, SwiGLU (gpu/gpt_oss_config.py)
    # Mixture of experts (``gpu/moe.py``; 0 experts: a dense model): each MoE layer's router
    # sends a token to ``num_experts_per_tok`` experts of ``moe_intermediate_size``, their
    # weights renormalised to sum to one where ``norm_topk_prob``. Layers listed in
    # ``mlp_only_layers``, or whose number plus one ``decoder_sparse_step`` does not divide,
    # keep a dense MLP of ``intermediate_size`` (Qwen3-MoE's rule; Mixtral's every layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    num_labels: int = 0  # a sequence classifier's outputs (its ``score`` head); 0: none

    @classmethod
    def load(cls, model: str | Path) -> ModelConfig:
        """The config of a Hugging Face model directory or of a GGUF file."""
        from tidal.core.config import is_gguf_file

        return cls.from_gguf(model) if is_gguf_file(model) else cls.from_dir(model)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"model must be a Hugging Face model directory with a config.json; "
                             f"{path} does not exist")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFileError(f"{path}: not a readable JSON config: {exc}") from None
        if not isinstance(raw, dict):
            raise ModelFileError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_hf_dict(raw, _eos_ids(model_dir, raw), str(path))

    @classmethod
    def from_gguf(cls, path: str | Path) -> ModelConfig:
        """From a GGUF file's metadata, put as a ``config.json`` would put it."""
        from tidal.gpu.checkpoints.gguf_file import hf_config

        raw = hf_config(path)
        return cls.from_hf_dict(raw, raw["eos_token_id"], str(path))

    @classmethod
    def from_hf_dict(cls, raw: dict, eos_token_ids: list[int],
                     source: str = "config.json") -> ModelConfig:
        """From a ``config.json``'s contents (``source`` names it in errors): each size
        checked for range before anything is built from it (``gpu/model_checks.py``)."""
        architectures = raw.get("architectures") or ["?"]
        arch = architectures[0] if isinstance(architectures, list) else architectures
        num_labels = _num_labels(raw, source) if arch in CLASSIFIER_ARCHITECTURES else 0
        headless = arch in HEADLESS_ARCHITECTURES or num_labels > 0
        if headless:
            arch = {**HEADLESS_ARCHITECTURES, **CLASSIFIER_ARCHITECTURES}[arch]
        if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
            pooled = sorted([*HEADLESS_ARCHITECTURES, *CLASSIFIER_ARCHITECTURES])
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (and "
                             f"{', '.join(pooled)} for pooling)")
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        check_config_values(raw, source)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if raw.get(key) is None:
                raise ModelFileError(f"{source}: lacks {key}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ModelFileError(f"{source}: rope_scaling must be an object, got {rope!r}")
        rope = dict(rope)
        heads = raw["num_attention_heads"]
        try:
            cfg = cls(
                architecture=arch,
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_layers=raw["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                rope_scaling=rope,
                tie_word_embeddings=headless or bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias or bool(raw.get("attention_bias", arch == GPT_OSS)),
                qk_norm=qk_norm,
                eos_token_ids=list(eos_token_ids),
                num_labels=num_labels,
                **_moe_settings(arch, raw, source),
            )
        except (TypeError, ValueError) as exc:
            raise ModelFileError(f"{source}: a setting has the wrong type: {exc}") from None
        check_shape_rules(cfg, source)
        if arch in GEMMA_ARCHITECTURES:
            cfg = with_gemma_facts(cfg, raw, source)
        if arch == GPT_OSS:
            cfg = with_gpt_oss_facts(cfg, raw, source)
        return cfg

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has experts rather than a dense MLP."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def kv_bytes_per_token(self, dtype_size: int, scale_size: int = 0) -> int:
        """Bytes of KV cache per token: a key and a value of ``dtype_size`` bytes an element,
        each with a scale of ``scale_size`` bytes per KV head (int8 caches), in every layer."""
        return (2 * self.num_layers * self.num_kv_heads
                * (self.head_dim * dtype_size + scale_size))

    def layer_linear_macs(self) -> int:
        """Multiply-adds of one token through one layer's linears: the q, k, v and output
        projections and the gated MLP's three matrices."""
        hidden, q = self.hidden_size, self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        mlp = (self.num_experts_per_tok * self.moe_intermediate_size if self.num_experts
               else self.intermediate_size)  # a MoE layer: the experts a token goes to
        return hidden * (2 * q + 2 * kv) + 3 * hidden * mlp

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: full attention); empty for a model without any."""
        facts = self.gemma or self.gpt_oss
        return facts.layer_windows if facts is not None else ()

    def attention_cost_context(self) -> int:
        """The context length at which a token's attention over its cached positions takes as
        many FLOPs as its pass through the linear layers (per layer: the projections and the
        gated MLP against q.k and the weighted sum of v, 2 FLOPs a multiply-add each)."""
        q = self.num_heads * self.head_dim
        return max(1, round(2 * self.layer_linear_macs() / (4 * q)))


def _moe_settings(arch: str, raw: dict, source: str) -> dict:
    """The mixture-of-experts fields of a Qwen3-MoE, Mixtral or gpt-oss ``config.json`` (none
    for a dense model). Mixtral's and gpt-oss's experts are as large as their
    ``intermediate_size``, Mixtral's always renormalised (gpt-oss's routing is its own,
    ``gpu/moe.py``); transformers 5 saves Qwen3-MoE's ``num_experts`` as
    ``num_local_experts``."""
    if arch in ("MixtralForCausalLM", GPT_OSS):
        moe = dict(num_experts=raw.get("num_local_experts"),
                   num_experts_per_tok=raw.get("num_experts_per_tok",
                                               4 if arch == GPT_OSS else 2),
                   moe_intermediate_size=raw.get("intermediate_size"))
    elif arch == "Qwen3MoeForCausalLM":
        moe = dict(num_experts=raw.get("num_experts") or raw.get("num_local_experts"),
                   num_experts_per_tok=raw.get("num_experts_per_tok"),
                   moe_intermediate_size=raw.get("moe_intermediate_size"),
                   decoder_sparse_step=raw.get("decoder_sparse_step", 1))
    else:
        return {}
    for key, value in moe.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
            raise ModelFileError(f"{source}: {key} must be a positive integer, got {value!r}")
    if moe["num_experts_per_tok"] > moe["num_experts"]:
        raise ModelFileError(f"{source}: num_experts_per_tok {moe['num_experts_per_tok']} is "
                             f"more than the {moe['num_experts']} experts")
    if arch == "Qwen3MoeForCausalLM":
        moe.update(norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                   mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))
    return moe


def _num_labels(raw: dict, source: str) -> int:
    """A sequence classifier's number of labels: ``id2label``'s size, as transformers saves
    it (``num_labels`` itself is not saved), else transformers' default of two."""
    labels = raw.get("id2label")
    count = len(labels) if isinstance(labels, dict) and labels else raw.get("num_labels", 2)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1 << 16:
        raise ModelFileError(f"{source}: a classifier needs 1 to 65536 labels, got {count!r}")
    return count


def _eos_ids(model_dir: Path, raw: dict) -> list[int]:
    """End-of-sequence ids from config.json and generation_config.json, in that order."""
    ids: list[int] = []
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    for value in (raw.get("eos_token_id"), gen.get("eos_token_id")):
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids
