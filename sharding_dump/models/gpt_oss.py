"""gpt-oss decoder: every layer is attention + routed experts; layers alternate sliding-window and
global attention, so the scanned unit is a block of `inhomogeneous_layer_cycle_interval` layers.

Parameter tree (layer axis `layers` at position 1; i = 0 .. interval-1, even i sliding-window)::

    token_embedder/embedding                                       (vocab, embed_vocab)
    decoder/layers/layers_<i>/{pre,post}_self_attention_layer_norm/scale   (norm, layers)
    decoder/layers/layers_<i>/GptOssAttention/query/{kernel,bias}  (embed, layers, q_heads, kv), (q_heads, layers, kv)
    decoder/layers/layers_<i>/GptOssAttention/{key,value}/{kernel,bias}  (embed, layers, kv_heads, kv_head_dim), ...
    decoder/layers/layers_<i>/GptOssAttention/out/{kernel,bias}    (heads, layers, kv, embed), (embed, layers)
    decoder/layers/layers_<i>/GptOssAttention/sinks                (None, layers)
    decoder/layers/layers_<i>/GptOssMlp/...                        routed experts with biases (models/moe.py)
    decoder/decoder_norm/scale, decoder/logits_dense/kernel
"""

from __future__ import annotations

import flax.linen as nn
import jax

from sharding_dump.core.capture import constrain
from sharding_dump.models.attention import ATTENTION_INPUT, ATTENTION_OUT, QKV, causal_attention
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM, LayerCycle
from sharding_dump.models.layers import BLE, Dense, RMSNorm, weight_param
from sharding_dump.models.moe import RoutedExperts
from sharding_dump.models.rope import apply_rotary


class GptOssAttention(nn.Module):
    """Grouped-query attention with projection biases, per-head sinks and an optional window."""

    cfg: ModelConfig
    sliding_window: int = 0  # 0: global

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        head_dim, bias = cfg.resolved_head_dim, cfg.attention_bias
        inputs_q = constrain(x, ATTENTION_INPUT, "inputs_q")
        inputs_kv = constrain(x, ATTENTION_INPUT, "inputs_kv")
        q = Dense(cfg, (cfg.num_query_heads, head_dim), (cfg.attention_embed_axis,), ("q_heads", "kv"), bias, name="query")(inputs_q)
        k = Dense(cfg, (cfg.num_kv_heads, head_dim), (cfg.attention_embed_axis,), ("kv_heads", "kv_head_dim"), bias,
                  name="key")(inputs_kv)
        v = Dense(cfg, (cfg.num_kv_heads, head_dim), (cfg.attention_embed_axis,), ("kv_heads", "kv_head_dim"), bias,
                  name="value")(inputs_kv)
        q = constrain(apply_rotary(q, positions, cfg), QKV, "query")
        k = constrain(apply_rotary(k, positions, cfg), QKV, "key")
        v = constrain(v, QKV, "value")
        sinks = None
        if cfg.attention_sink:
            sinks = weight_param(self, "sinks", (cfg.num_query_heads,), (None,), cfg, nn.initializers.zeros)
        out = causal_attention(q, k, v, scale=head_dim**-0.5, sliding_window=self.sliding_window, sinks=sinks)
        out = constrain(out, ATTENTION_OUT, "out")
        return Dense(cfg, (x.shape[-1],), ("heads", "kv"), (cfg.attention_embed_axis,), bias, name="out")(out)


class GptOssLayer(nn.Module):
    """Pre-norm residual block: attention, then routed experts."""

    cfg: ModelConfig
    sliding_window: int = 0

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = constrain(x, BLE, "inputs")
        h = constrain(RMSNorm(cfg, name="pre_self_attention_layer_norm")(x), BLE, "pre_attention_norm")
        h = GptOssAttention(cfg, self.sliding_window, name="GptOssAttention")(h, positions)
        x = x + constrain(h, BLE, "attention_result")
        h = constrain(RMSNorm(cfg, name="post_self_attention_layer_norm")(x), BLE, "post_attention_norm")
        h = constrain(RoutedExperts(cfg, name="GptOssMlp")(h), BLE, "mlp_lnx")
        return constrain(x + h, BLE, "x")


class GptOssBlock(LayerCycle):
    """One scanned unit: `inhomogeneous_layer_cycle_interval` layers, sliding-window then global."""

    layer = GptOssLayer

    def options(self, index: int) -> dict[str, int]:
        return {"sliding_window": self.cfg.sliding_window_size if index % 2 == 0 else 0}


class GptOssDecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab); the untied output projection."""

    decoder_block = "gpt_oss"
    card_fields = (
        "head_dim", "mlp_activations", "mlp_activations_limit", "rope_max_timescale", "rope_type",
        "original_max_position_embeddings", "rope_factor", "beta_fast", "beta_slow", "rope_interleave", "rope_truncate",
        "rope_attention_scaling", "num_experts", "num_experts_per_tok", "moe_mlp_dim", "routed_score_func",
        "routed_bias", "mlp_bias", "attention_bias", "attention_sink", "sliding_window_size",
        "inhomogeneous_layer_cycle_interval")
    required_fields = ("num_experts", "num_experts_per_tok", "moe_mlp_dim", "head_dim")
    equal_fields = (("moe_mlp_dim", "mlp_dim"),)

    layer = GptOssBlock
