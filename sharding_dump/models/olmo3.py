"""OLMo 3 (7B, 32B): post-norm layers (no norm before attention or MLP, an RMS norm after each),
queries and keys RMS-normed over all heads at once, three sliding-window layers then one global
layer, scanned in blocks of `inhomogeneous_layer_cycle_interval` (4) layers. The global layers rotate
with the card's rotary variant (YaRN for the long-context checkpoints), the local ones with plain RoPE.

Parameter tree (k = 0..3 within a block, layer axis `layers` at position 1)::

    token_embedder/embedding                                          (vocab, embed_vocab)
    decoder/layers/layers_<k>/attention/{query,key,value,out}/kernel  as the dense decoder (models/dense.py)
    decoder/layers/layers_<k>/attention/query_norm/scale              (norm, layers), heads x head_dim wide
    decoder/layers/layers_<k>/attention/key_norm/scale                (norm, layers), kv_heads x head_dim wide
    decoder/layers/layers_<k>/post_self_attention_layer_norm/scale    (norm, layers)
    decoder/layers/layers_<k>/mlp/{wi_0,wi_1,wo}/kernel               as the dense decoder
    decoder/layers/layers_<k>/post_mlp_layer_norm/scale               (norm, layers)
    decoder/decoder_norm/scale, decoder/logits_dense/kernel
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from sharding_dump.core.capture import constrain
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM, LayerCycle
from sharding_dump.models.dense import Attention, MlpBlock
from sharding_dump.models.layers import BLE, RMSNorm

GLOBAL_EVERY = 4  # the last layer of each run of four attends globally


class Olmo3DecoderLayer(nn.Module):
    """Attention, norm, residual; MLP, norm, residual."""

    cfg: ModelConfig
    sliding_window: int = 0

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg if not self.sliding_window else dataclasses.replace(self.cfg, rope_type="default")
        x = constrain(x, BLE, "layer_input")
        h = Attention(cfg, self.sliding_window, global_qk_norm=True, name="attention")(x, positions)
        h = RMSNorm(cfg, name="post_self_attention_layer_norm")(constrain(h, BLE, "attention_result"))
        x = x + constrain(h, BLE, "post_attention_norm")
        h = MlpBlock(cfg, cfg.mlp_dim, name="mlp")(x)
        h = RMSNorm(cfg, name="post_mlp_layer_norm")(constrain(h, BLE, "mlp_output"))
        return constrain(x + constrain(h, BLE, "post_mlp_norm"), BLE, "layer_output")


class Olmo3Block(LayerCycle):
    """One scanned unit: `inhomogeneous_layer_cycle_interval` layers, every fourth global."""

    layer = Olmo3DecoderLayer

    def options(self, index: int) -> dict[str, int]:
        return {"sliding_window": self.cfg.sliding_window_size if index % GLOBAL_EVERY != GLOBAL_EVERY - 1 else 0}


class Olmo3DecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "olmo3"
    card_fields = (
        "head_dim", "mlp_activations", "logits_via_embedding", "rope_max_timescale", "use_qk_norm",
        "sliding_window_size", "inhomogeneous_layer_cycle_interval", "rope_type", "max_position_embeddings",
        "original_max_position_embeddings", "rope_factor", "beta_fast", "beta_slow", "rope_interleave", "rope_truncate",
        "rope_attention_scaling")

    layer = Olmo3Block
