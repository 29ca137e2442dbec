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

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharding_dump.core.capture import constrain
from sharding_dump.models.attention import MLA_INPUT, MLA_OUT, MLA_QKV, causal_attention
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM, Stack
from sharding_dump.models.dense import MlpBlock
from sharding_dump.models.layers import BLE, Dense, RMSNorm
from sharding_dump.models.moe import RoutedExperts
from sharding_dump.models.rope import apply_rotary, yarn_mscale


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared when the context was stretched."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.max_position_embeddings > cfg.original_max_position_embeddings:
        scale *= yarn_mscale(cfg.rope_factor, cfg.mscale) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    """MLA: keys and values come from one shared low-rank latent (kv_lora_rank) plus a single rotary
    key head; queries are full-rank or low-rank (q_lora_rank). Heads split into a position-free
    part (nope) and a rotary part (rope)."""

    cfg: ModelConfig

    def project_query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        head = (cfg.num_query_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if cfg.q_lora_rank:
            low = Dense(cfg, (cfg.q_lora_rank,), ("embed",), ("q_lora_up_proj",), name="wq_a")(x)
            low = RMSNorm(cfg, name="q_norm")(low)
            q = Dense(cfg, head, ("q_lora",), ("q_heads", "kv"), name="wq_b")(low)
        else:
            q = Dense(cfg, head, ("embed",), ("q_heads", "kv"), name="query")(x)
        q_nope, q_pe = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
        q_nope = constrain(q_nope, MLA_QKV, "q_nope")
        q_pe = constrain(apply_rotary(q_pe, positions, cfg), MLA_QKV, "q_pe")
        return constrain(jnp.concatenate([q_nope, q_pe], axis=-1) * softmax_scale(self.cfg), MLA_QKV, "query")

    def project_key_value(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        low = Dense(cfg, (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), ("embed",), ("kv_lora_up_proj",),
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
        query = self.project_query(inputs_q, positions)
        key, value = self.project_key_value(inputs_kv, positions)
        out = causal_attention(query, key, value, scale=1.0)  # the query already carries the scale
        out = constrain(out, MLA_OUT, "out")
        return Dense(self.cfg, (x.shape[-1],), ("heads", "kv"), ("embed",), name="out")(out)


class RoutedAndSharedExperts(nn.Module):
    """DeepSeek's MoE feed-forward: routed experts plus always-on shared experts."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        out = RoutedExperts(cfg, gate_embed_axis="embed_moe", name="MoeBlock_0")(x)
        if cfg.shared_experts:
            out = out + MlpBlock(cfg, cfg.shared_experts * cfg.moe_mlp_dim, name="shared_experts")(x)
        return out


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

    @classmethod
    def stacks(cls, cfg: ModelConfig) -> tuple[Stack, ...]:
        moe = Stack(DeepSeekMoeLayer, cfg.num_decoder_layers - cfg.first_num_dense_layers, "moe_layers",
                    pipelined=True, outside_first=True)
        if not cfg.first_num_dense_layers:
            return (moe,)
        return (Stack(DeepSeekLayer, cfg.first_num_dense_layers, "dense_layers"), moe)
