"""Our model classes by the architecture name a ``config.json`` gives
(``ModelConfig.architecture``; ``SUPPORTED_ARCHITECTURES`` in ``gpu/model_config.py`` holds the
same names with the config facts that tell them apart)."""

from __future__ import annotations

from torch import nn

from tidal.gpu.models.gemma import GemmaForCausalLM
from tidal.gpu.models.gpt_oss import GptOssForCausalLM
from tidal.gpu.models.llama import LlamaForCausalLM
from tidal.gpu.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}
