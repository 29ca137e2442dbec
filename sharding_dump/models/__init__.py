"""Model registry: a card's `decoder_block` picks the Flax module that builds it (the DecoderLM
subclass of a module here that names that block, or a family an installed package registers through
the `sharding_dump.families` entry-point group).

>>> cfg = load_config("qwen3-0.6b")
>>> type(build_model(cfg)).__name__
'Qwen3DecoderLM'
>>> pipelined_stack_length(cfg)
28
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn

from sharding_dump.models.config import (
    ModelConfig,
    block_class,
    check_model_name,
    decoder_blocks,
    load_config,
    model_names,
    resolve_model,
)
from sharding_dump.models.decoder import pipelined_length

if TYPE_CHECKING:
    from sharding_dump.models.pipeline import PipelineConfig

__all__ = ["ModelConfig", "block_class", "build_model", "check_model_name", "decoder_blocks", "load_config",
           "model_names", "pipelined_stack_length", "resolve_model"]


def build_model(cfg: ModelConfig, pipeline: PipelineConfig | None = None) -> nn.Module:
    """The Flax module for a model config, its layer stack pipelined by `pipeline` when given (never
    initialised with real arrays here)."""
    family = block_class(cfg.decoder_block)
    return family(cfg) if pipeline is None else family(cfg, pipeline)


def pipelined_stack_length(cfg: ModelConfig) -> int | None:
    """Length of the layer stack a pipeline would cut into stages (None: the family cannot be pipelined)."""
    return pipelined_length(block_class(cfg.decoder_block), cfg)
