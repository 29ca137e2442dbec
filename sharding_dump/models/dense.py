"""Dense decoder-only transformers (MaxText's llama2, mistral, qwen2 and qwen3 blocks): attention +
gated MLP blocks, stacked by scan.

Parameter tree (what the goldens see)::

    token_embedder/embedding                      (vocab, embed_vocab)
    decoder/layers/self_attention/query/kernel    (embed, layers, q_heads, kv)
    decoder/layers/self_attention/{key,value}/kernel  (embed, layers, kv_heads, kv_head_dim)
    decoder/layers/self_attention/out/kernel      (heads, layers, kv, embed)
    decoder/layers/self_attention/{query,key}_norm/scale  (norm, layers)      [use_qk_norm]
    decoder/layers/self_attention/{query,key,value}/bias  (q_heads|kv_heads, layers, kv|kv_head_dim)  [attention_bias]
    decoder/layers/mlp/{wi_0,wi_1}/kernel         (embed, layers, mlp)
    decoder/layers/mlp/wo/kernel                  (mlp, layers, embed)
    decoder/layers/{pre,post}_self_attention_layer_norm/scale  (norm, layers)
    decoder/decoder_norm/scale                    (norm)
    decoder/logits_dense/kernel                   (embed_vocab, vocab)      [untied embeddings]

With pipeline parallelism the layer stack is cut into stages (see models/pipeline.py).

Activations are constrained through `sharding_dump.core.capture.constrain` at MaxText's points (layer
input, both norms, attention inputs/q/k/v/output and result, MLP hidden and output, layer output,
logits), so the traced step carries the constraints a training run does.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharding_dump.core.capture import constrain
from sharding_dump.models.attention import (ATTENTION_INPUT, ATTENTION_OUT, QKV, SERVING_AXES, cached_attention,
                                            causal_attention)
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM
from sharding_dump.models.kvcache import CacheSpec, KVCache
from sharding_dump.models.layers import BLE, Dense, RMSNorm, activation
from sharding_dump.models.rope import apply_rotary

PREFILL_BLE = ("activation_batch", "prefill_activation_norm_length", "activation_embed")  # a layer's, in prefill


class MlpBlock(nn.Module):
    """Gated MLP: product of activation(x . wi_k) over `mlp_activations`, then wo."""

    cfg: ModelConfig
    intermediate_dim: int
    embed_axis: str = "embed"
    mlp_axis: str = "mlp"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = None
        for index, act in enumerate(self.cfg.mlp_activations):
            h = Dense(self.cfg, (self.intermediate_dim,), (self.embed_axis,), (self.mlp_axis,), name=f"wi_{index}")(x)
            h = activation(act, h)
            hidden = h if hidden is None else hidden * h
        hidden = constrain(hidden, ("activation_batch", "activation_length", "activation_mlp"), "mlp_hidden")
        return Dense(self.cfg, (x.shape[-1],), (self.mlp_axis,), (self.embed_axis,), name="wo")(hidden)


def qk_normed(cfg: ModelConfig, x: jax.Array, name: str, over_heads: bool = False) -> jax.Array:
    """x (batch, length, heads, dim) RMS-normed per head, or over all heads at once (`over_heads`).
    Call it from a module's compact `__call__`: the norm is created there as `name`."""
    if not over_heads:
        return RMSNorm(cfg, name=name)(x)
    return RMSNorm(cfg, name=name)(x.reshape(x.shape[:-2] + (-1,))).reshape(x.shape)


def l2_normed(x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x divided by the root mean square of its last dim (no learned scale)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.normalization_layer_epsilon)
            ).astype(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary positions (and optional q/k RMS norms, logit
    soft cap, and a sliding window of `sliding_window` positions when > 0)."""

    cfg: ModelConfig
    sliding_window: int = 0
    qk_norm: bool | None = None  # None: the card's use_qk_norm (Gemma 3's layer always norms them)
    global_qk_norm: bool = False  # norm over all heads at once, not per head (OLMo 3)
    use_rope: bool = True  # False: no position embedding at all (Llama 4's NoPE layers)
    qk_l2_norm: bool = False  # L2-normalise queries and keys after RoPE, no parameters (Llama 4)
    cache: CacheSpec | None = None  # serving: the KV cache of a prefill or generate model (None: training)

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        head_dim = cfg.resolved_head_dim
        names = {"input": ATTENTION_INPUT, "query": QKV, "key": QKV, "out": ATTENTION_OUT} if self.cache is None \
            else SERVING_AXES[self.cache.mode]
        x_q = constrain(x, names["input"], "inputs_q")
        x_kv = constrain(x, names["input"], "inputs_kv")
        bias = cfg.attention_bias  # on the query, key and value projections only, as MaxText's Qwen2
        q = Dense(cfg, (cfg.num_query_heads, head_dim), (cfg.attention_embed_axis,), ("q_heads", "kv"), bias, name="query")(x_q)
        k = Dense(cfg, (cfg.num_kv_heads, head_dim), (cfg.attention_embed_axis,), ("kv_heads", "kv_head_dim"), bias, name="key")(x_kv)
        v = Dense(cfg, (cfg.num_kv_heads, head_dim), (cfg.attention_embed_axis,), ("kv_heads", "kv_head_dim"), bias,
                  name="value")(x_kv)
        if cfg.use_qk_norm if self.qk_norm is None else self.qk_norm:
            q = qk_normed(self.cfg, q, "query_norm", self.global_qk_norm)
            k = qk_normed(self.cfg, k, "key_norm", self.global_qk_norm)
        # Local (sliding-window) layers rotate with their own base when the card gives one, and are
        # not stretched by the linear scaling of the global ones (MaxText's Gemma 3).
        local = self.sliding_window and cfg.local_rope_max_timescale
        timescale = cfg.local_rope_max_timescale if local else None
        scaling = 1.0 if self.sliding_window else cfg.rope_linear_scaling_factor
        if self.use_rope:
            q = apply_rotary(q, positions, cfg, timescale, scaling)
            k = apply_rotary(k, positions, cfg, timescale, scaling)
            if self.qk_l2_norm:
                q, k = l2_normed(q, cfg), l2_normed(k, cfg)
        q = constrain(q, names["query"], "query")
        k = constrain(k, names["key"], "key")
        v = constrain(v, names["key"], "value")
        if self.cache is not None and self.cache.mode == "autoregressive":
            keys, values, visible = KVCache(self.cache, cfg.num_kv_heads, head_dim, cfg.dtype, name="KVCache_0")\
                .generate(k, v)
            out = cached_attention(q, keys, values, visible, scale=head_dim**-0.5)
        else:
            if self.cache is not None:  # a prefill: the prompt's keys and values go to the cache
                KVCache(self.cache, cfg.num_kv_heads, head_dim, cfg.dtype, name="KVCache_0").prefill(k, v)
            out = causal_attention(q, k, v, scale=head_dim**-0.5, sliding_window=self.sliding_window,
                                   soft_cap=cfg.attn_logits_soft_cap)
        out = constrain(out, names["out"], "attention_out")
        return Dense(cfg, (x.shape[-1],), ("heads", "kv"), (cfg.attention_embed_axis,), name="out")(out)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then gated MLP (serving: with the attention's KV cache)."""

    cfg: ModelConfig
    cache: CacheSpec | None = None

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        ble = PREFILL_BLE if self.cache is not None and self.cache.mode == "prefill" else BLE
        x = constrain(x, ble, "layer_input")
        h = constrain(RMSNorm(self.cfg, name="pre_self_attention_layer_norm")(x), ble, "pre_attention_norm")
        h = constrain(Attention(self.cfg, cache=self.cache, name="self_attention")(h, positions), ble,
                      "attention_result")
        x = constrain(x + h, ble, "attention_residual")
        h = constrain(RMSNorm(self.cfg, name="post_self_attention_layer_norm")(x), ble, "post_attention_norm")
        h = constrain(MlpBlock(self.cfg, self.cfg.mlp_dim, name="mlp")(h), ble, "mlp_output")
        return constrain(x + h, ble, "layer_output"), None


class DenseDecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "llama2"
    card_fields = ("head_dim", "mlp_activations", "logits_via_embedding", "rope_max_timescale")

    layer = DecoderLayer


class Qwen3DecoderLM(DenseDecoderLM):
    """Qwen3: the dense decoder with query/key norms."""

    decoder_block = "qwen3"
    card_fields = DenseDecoderLM.card_fields + ("use_qk_norm",)


class MistralDecoderLM(DenseDecoderLM):
    """Mistral: the dense decoder as llama2 builds it."""

    decoder_block = "mistral"


class Qwen2DecoderLM(DenseDecoderLM):
    """Qwen2 (Qwen2.5): the dense decoder with biased attention projections."""

    decoder_block = "qwen2"
    card_fields = DenseDecoderLM.card_fields + ("attention_bias",)
