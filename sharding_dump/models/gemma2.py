"""Gemma 2 (2B, 9B, 27B): each scanned layer is a pair, a sliding-window attention half then a global
one, as MaxText's Gemma 2 layer merges them (so a card's `num_decoder_layers` counts pairs: 13 for
the 26-layer 2B). Each half normalises before and after attention and before and after its GeGLU MLP;
attention and output logits are soft-capped, and the output goes through the tied embedding.

Parameter tree (layer axis `layers` at position 1; h = local, global)::

    token_embedder/embedding                                    (vocab, embed_vocab)
    decoder/layers/pre_self_attention_norm_<h>/scale            (norm, layers)
    decoder/layers/self_attention_<h>/{query,key,value,out}/kernel   as the dense decoder (models/dense.py)
    decoder/layers/post_self_attention_norm_<h>/scale           (norm, layers)   [use_post_attn_norm]
    decoder/layers/pre_ffw_norm_<h>/scale                       (norm, layers)
    decoder/layers/mlp_<h>/{wi_0,wi_1,wo}/kernel                as the dense decoder
    decoder/layers/post_ffw_norm_<h>/scale                      (norm, layers)   [use_post_ffw_norm]
    decoder/decoder_norm/scale                                  (norm)
"""

from __future__ import annotations

import flax.linen as nn
import jax

from sharding_dump.core.capture import constrain
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM
from sharding_dump.models.dense import Attention, MlpBlock
from sharding_dump.models.layers import BLE, RMSNorm


def sandwich_block(cfg: ModelConfig, x: jax.Array, positions: jax.Array, suffix: str = "",
                   sliding_window: int = 0, qk_norm: bool | None = None) -> jax.Array:
    """Attention then MLP, each normed before and (as the card says) after, with residual adds. Call
    it from a layer's compact `__call__`: its modules are named `<module><suffix>` in that layer."""
    h = constrain(RMSNorm(cfg, name=f"pre_self_attention_norm{suffix}")(x), BLE, "pre_attention_norm")
    h = Attention(cfg, sliding_window, qk_norm, name=f"self_attention{suffix}")(h, positions)
    if cfg.use_post_attn_norm:
        h = RMSNorm(cfg, name=f"post_self_attention_norm{suffix}")(h)
    x = x + constrain(h, BLE, "attention_result")
    h = RMSNorm(cfg, name=f"pre_ffw_norm{suffix}")(x)
    h = MlpBlock(cfg, cfg.mlp_dim, name=f"mlp{suffix}")(h)
    if cfg.use_post_ffw_norm:
        h = RMSNorm(cfg, name=f"post_ffw_norm{suffix}")(h)
    return constrain(x + constrain(h, BLE, "mlp_output"), BLE, "layer_output")


class Gemma2DecoderLayer(nn.Module):
    """A sliding-window layer, then a global one."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        x = constrain(x, BLE, "layer_input")
        x = sandwich_block(self.cfg, x, positions, "_local", self.cfg.sliding_window_size)
        return sandwich_block(self.cfg, x, positions, "_global"), None


class Gemma2DecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "gemma2"
    card_fields = (
        "head_dim", "mlp_activations", "logits_via_embedding", "rope_max_timescale", "sliding_window_size",
        "use_post_attn_norm", "use_post_ffw_norm", "attn_logits_soft_cap", "final_logits_soft_cap")

    layer = Gemma2DecoderLayer
