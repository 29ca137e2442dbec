"""GPT-3 (MaxText's gpt3 block, configs gpt3-52k, gpt3-6b, gpt3-22b, gpt3-175b): learned absolute
positions (`trainable_position_size` rows, added to the token embedding), layer norms with a bias,
one fused query/key/value projection and a one-matrix GELU MLP with biases, its pre-norm inside the
MLP; output through the tied embedding. As MaxText's `models/gpt3.py` at e591f30.

Parameter tree (layer axis `layers` at position 1)::

    token_embedder/embedding                                   (vocab, embed_vocab)
    decoder/position_embedder/embedding                        (vocab, embed_vocab)
    decoder/layers/pre_self_attention_norm/{scale,bias}        (norm, layers)
    decoder/layers/self_attention/qkv_proj/kernel              (embed, layers, qkv, heads, kv)
    decoder/layers/self_attention/qkv_proj/bias                (qkv, layers, heads, kv)
    decoder/layers/self_attention/out/kernel                   (heads, layers, kv, embed)
    decoder/layers/self_attention/out/bias                     (embed, layers)
    decoder/layers/mlp/mlp_layer_norm/{scale,bias}             (norm, layers)
    decoder/layers/mlp/wi/{kernel,bias}                        (embed, layers, mlp), (mlp, layers)
    decoder/layers/mlp/wo/{kernel,bias}                        (mlp, layers, embed), (embed, layers)
    decoder/decoder_norm/{scale,bias}                          (norm)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharding_dump.core.capture import constrain
from sharding_dump.models.attention import causal_attention
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM
from sharding_dump.models.layers import BLE, Dense, activation, weight_param

# The activation names MaxText's GPT-3 attention constrains its inputs, q/k/v and output with.
INPUT = ("activation_batch", "activation_length", "activation_embed")
HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")


class LayerNorm(nn.Module):
    """Layer norm over the last axis with a learned scale and bias on logical axis `norm`."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = weight_param(self, "scale", (x.shape[-1],), ("norm",), self.cfg, nn.initializers.ones)
        bias = weight_param(self, "bias", (x.shape[-1],), ("norm",), self.cfg, nn.initializers.zeros)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.cfg.normalization_layer_epsilon)
        dtype = jnp.dtype(self.cfg.dtype)
        return (y.astype(dtype) * scale.astype(dtype) + bias.astype(dtype)).astype(dtype)


class Gpt3Attention(nn.Module):
    """Multi-head causal attention, query, key and value from one fused projection, with biases."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        head_dim = cfg.resolved_head_dim
        x = constrain(x, INPUT, "inputs_q")
        qkv = Dense(cfg, (3, cfg.num_query_heads, head_dim), (cfg.attention_embed_axis,), ("qkv", "heads", "kv"), True,
                    name="qkv_proj")(x)
        q, k, v = (constrain(qkv[:, :, i], HEADS, name) for i, name in enumerate(("query", "key", "value")))
        out = constrain(causal_attention(q, k, v, scale=head_dim**-0.5), HEADS, "attention_out")
        return Dense(cfg, (x.shape[-1],), ("heads", "kv"), (cfg.attention_embed_axis,), True, name="out")(out)


class Gpt3Mlp(nn.Module):
    """Its own pre-norm, then wo(activation(wi(x))) with biases (`wi`: MaxText's name for one activation)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        h = LayerNorm(cfg, name="mlp_layer_norm")(x)
        h = activation(cfg.mlp_activations[0], Dense(cfg, (cfg.mlp_dim,), ("embed",), ("mlp",), True, name="wi")(h))
        h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"), "mlp_hidden")
        return Dense(cfg, (x.shape[-1],), ("mlp",), ("embed",), True, name="wo")(h)


class Gpt3DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        x = constrain(x, BLE, "layer_input")
        h = constrain(LayerNorm(self.cfg, name="pre_self_attention_norm")(x), BLE, "pre_attention_norm")
        x = x + constrain(Gpt3Attention(self.cfg, name="self_attention")(h), BLE, "attention_result")
        h = constrain(Gpt3Mlp(self.cfg, name="mlp")(x), BLE, "mlp_output")
        return constrain(x + h, BLE, "layer_output"), None


class Gpt3DecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab); positions learned, logits tied."""

    decoder_block = "gpt3"
    card_fields = ("head_dim", "mlp_activations", "logits_via_embedding", "trainable_position_size")
    required_fields = ("trainable_position_size",)
    equal_fields = (("num_kv_heads", "num_query_heads"),)
    final_norm = LayerNorm

    layer = Gpt3DecoderLayer
