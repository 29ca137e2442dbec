"""Gemma (first generation, 2B and 7B): a dense decoder with GeGLU MLPs, multi-query (2B) or
multi-head (7B) attention with 256-wide heads, and output logits through the tied input embedding.

Parameter tree, as MaxText's Gemma layer names it (layer axis `layers` at position 1)::

    token_embedder/embedding                           (vocab, embed_vocab)   [also the output projection]
    decoder/layers/pre_self_attention_norm/scale       (norm, layers)
    decoder/layers/self_attention/{query,key,value,out}/kernel   as the dense decoder (models/dense.py)
    decoder/layers/pre_ffw_norm/scale                  (norm, layers)
    decoder/layers/mlp/{wi_0,wi_1,wo}/kernel           as the dense decoder
    decoder/decoder_norm/scale                         (norm)
"""

from __future__ import annotations

import flax.linen as nn
import jax

from sharding_dump.core.capture import constrain
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM
from sharding_dump.models.dense import Attention, MlpBlock
from sharding_dump.models.layers import BLE, RMSNorm


class GemmaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the gated MLP (no norm on the attention output)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        x = constrain(x, BLE, "layer_input")
        h = constrain(RMSNorm(cfg, name="pre_self_attention_norm")(x), BLE, "pre_attention_norm")
        h = constrain(Attention(cfg, name="self_attention")(h, positions), BLE, "attention_result")
        x = x + h
        h = RMSNorm(cfg, name="pre_ffw_norm")(x)
        h = constrain(MlpBlock(cfg, cfg.mlp_dim, name="mlp")(h), BLE, "mlp_output")
        return constrain(x + h, BLE, "layer_output"), None


class GemmaDecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "gemma"
    card_fields = ("head_dim", "mlp_activations", "logits_via_embedding", "rope_max_timescale")

    layer = GemmaDecoderLayer
