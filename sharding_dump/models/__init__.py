"""Model registry: a card's `decoder_block` picks the Flax module that builds it (`data/blocks.yml`,
or a family an installed package registers through the `sharding_dump.families` entry-point group).

>>> cfg = load_config("qwen3-0.6b")
>>> type(build_model(cfg)).__name__
'DenseDecoderLM'
"""

from __future__ import annotations

import flax.linen as nn

from sharding_dump.models.config import (ModelConfig, block_class, check_model_name, decoder_blocks, load_config,
                                         model_names, resolve_model)

__all__ = ["ModelConfig", "block_class", "build_model", "check_model_name", "decoder_blocks", "load_config",
           "model_names", "resolve_model"]


def build_model(cfg: ModelConfig) -> nn.Module:
    """The Flax module for a model config (never initialised with real arrays here)."""
    return block_class(cfg.decoder_block)(cfg)
