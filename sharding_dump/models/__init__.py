"""Model registry: a card's `decoder_block` picks the Flax module that builds it.

>>> cfg = load_config("qwen3-0.6b")
>>> type(build_model(cfg)).__name__
'DenseDecoderLM'
"""

from __future__ import annotations

import flax.linen as nn

from sharding_dump.models.config import ModelConfig, check_model_name, load_config, model_names
from sharding_dump.models.deepseek import DeepSeekDecoderLM
from sharding_dump.models.dense import DenseDecoderLM
from sharding_dump.models.gpt_oss import GptOssDecoderLM

DECODERS: dict[str, type[nn.Module]] = {
    "llama2": DenseDecoderLM,
    "qwen3": DenseDecoderLM,
    "deepseek": DeepSeekDecoderLM,
    "gpt_oss": GptOssDecoderLM,
}

__all__ = ["DECODERS", "ModelConfig", "build_model", "check_model_name", "load_config", "model_names"]


def build_model(cfg: ModelConfig) -> nn.Module:
    """The Flax module for a model config (never initialised with real arrays here)."""
    return DECODERS[cfg.decoder_block](cfg)
