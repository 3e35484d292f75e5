"""The single entry point from the engine core into device code."""

from __future__ import annotations

import logging

from core.config import EngineConfig
from gpu.model_config import ModelConfig
from gpu.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def create_model_runner(config: EngineConfig) -> ModelRunner:
    model_config = ModelConfig.load(config.model)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                       max_model_len, model_config.max_position_embeddings)
    return ModelRunner(config, model_config, max_model_len)
