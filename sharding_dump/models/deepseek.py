"""DeepSeek decoders (V2, V3): multi-head latent attention, `first_num_dense_layers` dense blocks,
then MoE blocks with routed and shared experts; each kind of block is its own scanned stack.

Parameter tree (L = the stack's layer axis, `dense_layers` or `moe_layers`, at position 1)::

    token_embedder/embedding                                       (vocab, embed_vocab)
    decoder/<L>/{pre,post}_self_attention_layer_norm/scale         (norm, L)
    decoder/<L>/self_attention/query/kernel                        (embed, L, q_heads, kv)   [q_lora_rank 0]
    decoder/<L>/self_attention/wq_a/kernel                         (embed, L, q_lora_up_proj)
    decoder/<L>/self_attention/q_norm/scale                        (norm, L)
    decoder/<L>/self_attention/wq_b/kernel                         (q_lora, L, q_heads, kv)
    decoder/<L>/self_attention/wkv_a/kernel                        (embed, L, kv_lora_up_proj)
    decoder/<L>/self_attention/kv_norm/scale                       (norm, L)
    decoder/<L>/self_attention/wkv_b/kernel                        (kv_lora, L, kv_heads, kv_head_dim)
    decoder/<L>/self_attention/out/kernel                          (heads, L, kv, embed)
    decoder/dense_layers/mlp/{wi_0,wi_1}/kernel, wo/kernel         (embed, L, mlp), (mlp, L, embed)
    decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/...           routed experts (see models/moe.py)
    decoder/moe_layers/DeepSeekMoeBlock_0/shared_experts/...       like mlp, width shared_experts * moe_mlp_dim
    decoder/decoder_norm/scale                                     (norm)
    decoder/logits_dense/kernel                                    (embed_vocab, vocab)
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharding_dump.core.capture import constrain
from sharding_dump.models.attention import MLA_INPUT, MLA_OUT, MLA_QKV, causal_attention
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM, Stack
from sharding_dump.models.dense import MlpBlock
from sharding_dump.models.layers import BLE, Dense, RMSNorm
from sharding_dump.models.moe import RoutedAndSharedExperts
from sharding_dump.models.rope import apply_rotary, yarn_mscale


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared when the context was stretched."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.max_position_embeddings > cfg.original_max_position_embeddings:
        scale *= yarn_mscale(cfg.rope_factor, cfg.mscale) ** 2
    return scale


class Indexer(nn.Module):
    """DeepSeek-V3.2's sparse attention indexer: per query, the `indexer_topk` keys that a light
    multi-head scorer (ReLU of query . key, weighted per head) ranks highest; the main attention sees
    only those. Its inputs are cut from the gradient, as in MaxText (it learns from its own loss).
    The key norm is a LayerNorm whose scale and bias carry no logical axes, as MaxText's."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, low_rank_query: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        heads, dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        x, low_rank_query = jax.lax.stop_gradient(x), jax.lax.stop_gradient(low_rank_query)
        q = Dense(cfg, (heads, dim), ("q_lora",), ("q_heads", "kv"), name="wq_b")(low_rank_query)
        k = Dense(cfg, (dim,), (cfg.attention_embed_axis,), ("kv",), name="wk")(x)
        k = nn.LayerNorm(dtype=jnp.float32, param_dtype=jnp.dtype(cfg.weight_dtype), name="k_norm")(k)
        plain = dataclasses.replace(cfg, rope_interleave=False)  # the indexer rotates half-split pairs
        q = partial_rotary(q, positions, plain)
        k = partial_rotary(k[:, :, None, :], positions, plain)[:, :, 0, :]
        fp32 = dataclasses.replace(cfg, dtype="float32", weight_dtype="float32")  # as MaxText: never low precision
        weights = Dense(fp32, (heads,), (cfg.attention_embed_axis,), ("q_heads",), name="weights_proj")(x) * heads**-0.5 * dim**-0.5
        logits = jax.nn.relu(jnp.einsum("bthd,bsd->btsh", q, k.astype(q.dtype)))
        score = jnp.einsum("btsh,bth->bts", logits.astype(jnp.float32), weights)
        length = score.shape[-1]
        causal = jnp.arange(length)[None, :] <= jnp.arange(length)[:, None]
        score = jnp.where(causal, score, -jnp.inf)
        topk = min(cfg.indexer_topk, length)
        threshold = jax.lax.top_k(score, topk)[0][..., -1:]
        return (score >= threshold) & causal


def partial_rotary(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """RoPE on the first `qk_rope_head_dim` dims of each head, the rest left as is (the indexer's split)."""
    rope, rest = jnp.split(x, [cfg.qk_rope_head_dim], axis=-1)
    return jnp.concatenate([apply_rotary(rope, positions, cfg), rest], axis=-1)


class MultiHeadLatentAttention(nn.Module):
    """MLA: keys and values come from one shared low-rank latent (kv_lora_rank) plus a single rotary
    key head; queries are full-rank or low-rank (q_lora_rank). Heads split into a position-free
    part (nope) and a rotary part (rope)."""

    cfg: ModelConfig

    def project_query(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The scaled query and, for a low-rank query, its normed latent (the indexer reads it)."""
        cfg = self.cfg
        low = None
        head = (cfg.num_query_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if cfg.q_lora_rank:
            low = Dense(cfg, (cfg.q_lora_rank,), (cfg.attention_embed_axis,), ("q_lora_up_proj",), name="wq_a")(x)
            low = RMSNorm(cfg, name="q_norm")(low)
            q = Dense(cfg, head, ("q_lora",), ("q_heads", "kv"), name="wq_b")(low)
        else:
            q = Dense(cfg, head, (cfg.attention_embed_axis,), ("q_heads", "kv"), name="query")(x)
        q_nope, q_pe = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
        q_nope = constrain(q_nope, MLA_QKV, "q_nope")
        q_pe = constrain(apply_rotary(q_pe, positions, cfg), MLA_QKV, "q_pe")
        query = jnp.concatenate([q_nope, q_pe], axis=-1) * softmax_scale(self.cfg)
        return constrain(query, MLA_QKV, "query"), low

    def project_key_value(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        low = Dense(cfg, (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), (cfg.attention_embed_axis,), ("kv_lora_up_proj",),
                    name="wkv_a")(x)
        latent, rope_part = jnp.split(low, [cfg.kv_lora_rank], axis=-1)
        latent = RMSNorm(cfg, name="kv_norm")(latent)
        key_rope = apply_rotary(rope_part[:, :, None, :], positions, cfg)  # one rotary head for all
        kv = Dense(cfg, (cfg.num_query_heads, cfg.qk_nope_head_dim + cfg.v_head_dim), ("kv_lora",),
                   ("kv_heads", "kv_head_dim"), name="wkv_b")(latent)
        key_nope, value = jnp.split(kv, [cfg.qk_nope_head_dim], axis=-1)
        key_rope = jnp.broadcast_to(key_rope, key_nope.shape[:-1] + (cfg.qk_rope_head_dim,))
        key_nope = constrain(key_nope, MLA_QKV, "key_nope")
        key_rope = constrain(key_rope, MLA_QKV, "key_rope")
        key = constrain(jnp.concatenate([key_nope, key_rope], axis=-1), MLA_QKV, "key")
        return key, constrain(value, MLA_QKV, "value")

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        inputs_q = constrain(x, MLA_INPUT, "inputs_q")
        inputs_kv = constrain(x, MLA_INPUT, "inputs_kv")
        query, low_rank_query = self.project_query(inputs_q, positions)
        key, value = self.project_key_value(inputs_kv, positions)
        selected = None
        if self.cfg.use_indexer:
            selected = Indexer(self.cfg, name="indexer")(inputs_q, low_rank_query, positions)
        out = causal_attention(query, key, value, scale=1.0, selected=selected)  # the query carries the scale
        out = constrain(out, MLA_OUT, "out")
        return Dense(self.cfg, (x.shape[-1],), ("heads", "kv"), (self.cfg.attention_embed_axis,), name="out")(out)


class DeepSeekLayer(nn.Module):
    """Pre-norm residual block: MLA, then a dense MLP or the routed + shared experts."""

    cfg: ModelConfig
    moe: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        x = constrain(x, BLE, "inputs")
        h = constrain(RMSNorm(cfg, name="pre_self_attention_layer_norm")(x), BLE, "pre_attention_norm")
        h = constrain(MultiHeadLatentAttention(cfg, name="self_attention")(h, positions), BLE, "attention_result")
        x = x + h
        h = constrain(RMSNorm(cfg, name="post_self_attention_layer_norm")(x), BLE, "post_attention_norm")
        if self.moe:
            h = constrain(RoutedAndSharedExperts(cfg, name="DeepSeekMoeBlock_0")(h), BLE, "mlp_lnx")
        else:
            h = constrain(MlpBlock(cfg, cfg.mlp_dim, name="mlp")(h), BLE, "mlp")
        return constrain(x + h, BLE, "x"), None


class DeepSeekMoeLayer(DeepSeekLayer):
    moe: bool = True


class DeepSeekDecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab): the dense stack, then the MoE stack,
    which is the one a pipeline cuts (MoE layers it leaves out run before it, after the dense ones)."""

    decoder_block = "deepseek"
    card_fields = (
        "mlp_activations", "rope_max_timescale", "rope_type", "max_position_embeddings",
        "original_max_position_embeddings", "rope_factor", "beta_fast", "beta_slow", "mscale", "rope_interleave",
        "rope_truncate", "rope_attention_scaling", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "first_num_dense_layers", "num_experts", "num_experts_per_tok", "moe_mlp_dim",
        "shared_experts", "routed_score_func", "routed_scaling_factor", "routed_bias", "use_indexer", "indexer_n_heads",
        "indexer_head_dim", "indexer_topk")
    required_fields = (
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok",
        "moe_mlp_dim")
    equal_fields = (("num_kv_heads", "num_query_heads"),)

    @classmethod
    def stacks(cls, cfg: ModelConfig) -> tuple[Stack, ...]:
        moe = Stack(DeepSeekMoeLayer, cfg.num_decoder_layers - cfg.first_num_dense_layers, "moe_layers",
                    pipelined=True, outside_first=True)
        if not cfg.first_num_dense_layers:
            return (moe,)
        return (Stack(DeepSeekLayer, cfg.first_num_dense_layers, "dense_layers"), moe)
