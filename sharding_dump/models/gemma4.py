"""Gemma 4 (26B MoE, 31B dense) text decoder: blocks of five sliding-window layers and one global
layer, as MaxText scans them: the block stack is `scanned_blocks` (layer axis `layers`), and inside a
block the five local layers are themselves scanned (`local_layers`, axis `local_layers`), so a local
weight carries both axes. Global layers have their own head width and key/value head count and
share one projection for keys and values; every layer norms queries, keys (learned scales) and
values (no scale), rotates part of each head, sandwiches attention and MLP in norms, and scales its
output by a learned `layer_scalar`. The 26B's feed-forward is a shared expert plus routed experts,
each normed, the router reading a separately normed and scaled input.

Parameter tree (L = layers at position 1, then local_layers at 2 for the local layers)::

    decoder/scanned_blocks/{local_layers,global_layer}/{pre,post}_self_attention_norm/scale   (norm, L)
    decoder/scanned_blocks/{local_layers,global_layer}/self_attention/{query,key,out}/kernel  as the dense decoder
    decoder/scanned_blocks/local_layers/self_attention/value/kernel                           (global: shared with key)
    decoder/scanned_blocks/{local_layers,global_layer}/self_attention/{query,key}_norm/scale  (norm, L)
    decoder/scanned_blocks/{local_layers,global_layer}/{pre,post}_ffw_norm/scale             (norm, L)
    decoder/scanned_blocks/{local_layers,global_layer}/layer_scalar                          (None, L)
    decoder/scanned_blocks/.../mlp/{wi_0,wi_1,wo}/kernel                                      [dense]
    decoder/scanned_blocks/.../mlp/moe_block/MoeBlock_0/{gate/kernel,per_expert_scale,wi_0,wi_1,wo}   [MoE]
    decoder/scanned_blocks/.../mlp/moe_block/shared_experts/{wi_0,wi_1,wo}/kernel             mlp_dim wide
    decoder/scanned_blocks/.../mlp/{pre_feedforward_layernorm_2,post_feedforward_layernorm_1,2}/scale, pre_forward_scale_2 (embed, L)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharding_dump.core.capture import constrain
from sharding_dump.models.attention import ATTENTION_INPUT, ATTENTION_OUT, QKV, causal_attention
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM, Stack
from sharding_dump.models.dense import MlpBlock, l2_normed
from sharding_dump.models.layers import BLE, Dense, RMSNorm, scan_layers, weight_param
from sharding_dump.models.moe import RoutedExperts
from sharding_dump.models.rope import apply_rotary

PATTERN = 6  # five local layers, then one global


class Gemma4Attention(nn.Module):
    """Attention with q/k/v norms and partial RoPE; the global variant shares its key projection as
    values and has its own head width and key/value heads."""

    cfg: ModelConfig
    is_global: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        dim = cfg.global_head_dim if self.is_global and cfg.global_head_dim else cfg.resolved_head_dim
        kv_heads = cfg.global_num_kv_heads if self.is_global and cfg.global_num_kv_heads else cfg.num_kv_heads
        x_q = constrain(x, ATTENTION_INPUT, "inputs_q")
        x_kv = constrain(x, ATTENTION_INPUT, "inputs_kv")
        q = Dense(cfg, (cfg.num_query_heads, dim), (cfg.attention_embed_axis,), ("q_heads", "kv"), name="query")(x_q)
        k = Dense(cfg, (kv_heads, dim), (cfg.attention_embed_axis,), ("kv_heads", "kv_head_dim"), name="key")(x_kv)
        v = k if self.is_global and cfg.share_kv_projections else Dense(
            cfg, (kv_heads, dim), (cfg.attention_embed_axis,), ("kv_heads", "kv_head_dim"), name="value")(x_kv)
        q = RMSNorm(cfg, name="query_norm")(q)
        k = RMSNorm(cfg, name="key_norm")(k)
        v = l2_normed(v, cfg)
        if self.is_global:
            fraction, timescale = cfg.global_rope_proportion, cfg.global_rope_max_timescale or None
        else:
            fraction, timescale = cfg.local_rope_proportion, cfg.local_rope_max_timescale or None
        rotated = int(dim * fraction) // 2 * 2
        q = jnp.concatenate([apply_rotary(q[..., :rotated], positions, cfg, timescale), q[..., rotated:]], axis=-1)
        k = jnp.concatenate([apply_rotary(k[..., :rotated], positions, cfg, timescale), k[..., rotated:]], axis=-1)
        q, k, v = (constrain(t, QKV, name) for t, name in ((q, "query"), (k, "key"), (v, "value")))
        window = 0 if self.is_global else cfg.sliding_window_size
        out = causal_attention(q, k, v, scale=1.0, sliding_window=window, soft_cap=cfg.attn_logits_soft_cap)
        out = constrain(out, ATTENTION_OUT, "attention_out")
        return Dense(cfg, (x.shape[-1],), ("heads", "kv"), (cfg.attention_embed_axis,), name="out")(out)


class SharedAndRoutedExperts(nn.Module):
    """MaxText's `moe_block` (RoutedAndSharedMoE), whose two halves Gemma 4 calls on different inputs."""

    cfg: ModelConfig

    def setup(self) -> None:
        self.MoeBlock_0 = RoutedExperts(self.cfg, gate_embed_axis=self.cfg.router_embed_axis, expert_scale=True)
        self.shared_experts = MlpBlock(self.cfg, self.cfg.shared_experts * self.cfg.mlp_dim)

    def shared(self, x: jax.Array) -> jax.Array:
        return self.shared_experts(x)

    def routed(self, x: jax.Array, gate_inputs: jax.Array) -> jax.Array:
        return self.MoeBlock_0(x, gate_inputs)


class Gemma4MoE(nn.Module):
    """The shared expert (mlp_dim wide) on the normed input and the routed experts on the residual
    stream normed again, each normed after; the router reads the residual stream RMS-normed without
    a scale and multiplied by `pre_forward_scale_2`."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
        cfg = self.cfg
        experts = SharedAndRoutedExperts(cfg, name="moe_block")
        shared = RMSNorm(cfg, name="post_feedforward_layernorm_1")(experts.shared(x))
        routed_in = RMSNorm(cfg, name="pre_feedforward_layernorm_2")(residual)
        scale = weight_param(self, "pre_forward_scale_2", (x.shape[-1],), ("embed",), cfg, nn.initializers.ones)
        gate_inputs = l2_normed(residual, cfg) * x.shape[-1] ** -0.5 * scale.astype(residual.dtype)
        routed = RMSNorm(cfg, name="post_feedforward_layernorm_2")(experts.routed(routed_in, gate_inputs))
        return shared + routed


class Gemma4DecoderLayer(nn.Module):
    """Sandwich-normed attention and feed-forward, the output scaled by `layer_scalar`."""

    cfg: ModelConfig
    is_global: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        x = constrain(x, BLE, "layer_input")
        h = constrain(RMSNorm(cfg, name="pre_self_attention_norm")(x), BLE, "pre_attention_norm")
        h = Gemma4Attention(cfg, self.is_global, name="self_attention")(h, positions)
        if cfg.use_post_attn_norm:
            h = RMSNorm(cfg, name="post_self_attention_norm")(h)
        x = x + constrain(h, BLE, "attention_result")
        h = RMSNorm(cfg, name="pre_ffw_norm")(x)
        h = Gemma4MoE(cfg, name="mlp")(h, x) if cfg.num_experts > 1 else MlpBlock(cfg, cfg.mlp_dim, name="mlp")(h)
        if cfg.use_post_ffw_norm:
            h = RMSNorm(cfg, name="post_ffw_norm")(h)
        scalar = weight_param(self, "layer_scalar", (1,), (None,), cfg, nn.initializers.ones)
        out = (x + constrain(h, BLE, "mlp_output")) * scalar.astype(x.dtype)
        return constrain(out, BLE, "layer_output"), None


class Gemma4GlobalLayer(Gemma4DecoderLayer):
    is_global: bool = True


class Gemma4Block(nn.Module):
    """Five local layers, themselves scanned (`local_layers`), then the global layer."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        x, _ = scan_layers(Gemma4DecoderLayer, PATTERN - 1, "local_layers")(self.cfg, name="local_layers")(x, positions)
        return Gemma4GlobalLayer(self.cfg, name="global_layer")(x, positions)


class Gemma4DecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "gemma4"
    card_fields = (
        "head_dim", "mlp_activations", "logits_via_embedding", "rope_max_timescale", "sliding_window_size",
        "use_post_attn_norm", "use_post_ffw_norm", "attn_logits_soft_cap", "final_logits_soft_cap",
        "local_rope_max_timescale", "global_head_dim", "global_num_kv_heads", "share_kv_projections",
        "global_rope_max_timescale", "global_rope_proportion", "local_rope_proportion", "num_experts",
        "num_experts_per_tok", "moe_mlp_dim", "shared_experts")

    @classmethod
    def stacks(cls, cfg: ModelConfig) -> tuple[Stack, ...]:
        blocks, rest = divmod(cfg.num_decoder_layers, PATTERN)
        if rest:
            raise ValueError(f"{cfg.name}: the gemma4 block builds whole blocks of {PATTERN} layers; "
                             f"num_decoder_layers {cfg.num_decoder_layers} leaves {rest} over")
        return (Stack(Gemma4Block, blocks, "scanned_blocks", axis="layers", pipelined=True, unit_layers=PATTERN),)
