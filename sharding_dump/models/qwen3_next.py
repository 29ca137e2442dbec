"""Qwen3-Next (80B-A3B): blocks of `inhomogeneous_layer_cycle_interval` (4) layers, scanned; the
first three mix tokens with a Gated DeltaNet (linear attention with a gated delta-rule state), the
fourth with full attention whose query projection also yields a sigmoid output gate. Every layer's
feed-forward is routed experts plus one shared expert scaled by a learned sigmoid gate. Norms are
zero-centred RMS norms declared without logical axes, as MaxText's Qwen3NextRMSNorm: scanned, their
layer dimension is named (None, layers); pipelined, they have no logical axes at all, as in MaxText,
whose pipeline stacks its stages with `nnx.vmap` (models/layers.DeclaredUnnamed).

Parameter tree (i = 0..3, layer axis `layers` at position 1; a parameter without logical axes is
replicated)::

    decoder/layers/layer_<i>/{input_layernorm,post_attention_layernorm}/scale   (None, layers)
    decoder/layers/layer_<i>/attention/in_proj_qkvz/kernel, in_proj_ba/kernel   (embed, layers, gdn_head)  [i < 3]
    decoder/layers/layer_<i>/attention/conv1d/kernel                            (kernel, layers, 1, conv)   no axes
    decoder/layers/layer_<i>/attention/{A_log,dt_bias}                          (value heads, layers)       no axes
    decoder/layers/layer_<i>/attention/norm/rms_norm/scale                      (None, layers)
    decoder/layers/layer_<i>/attention/out_proj/kernel                          (gdn_head, layers, embed)
    decoder/layers/layer_3/attention/attention/query/kernel                     (embed, layers, q_heads, kv), 2 x head_dim wide
    decoder/layers/layer_3/attention/attention/{key,value}/kernel               as the dense decoder
    decoder/layers/layer_3/attention/attention/{query,key}_norm/scale           (None, layers)
    decoder/layers/layer_3/attention/attention/out/kernel                       (mlp, layers, embed), heads x head_dim flat
    decoder/layers/layer_<i>/mlp/routed_experts/...                             routed experts (models/moe.py)
    decoder/layers/layer_<i>/mlp/shared_expert/{wi_0,wi_1,wo}/kernel            like a dense mlp
    decoder/layers/layer_<i>/mlp/shared_expert_gate/kernel                      (embed, layers, None)

MaxText 0.2.5 holds a cycle as its Qwen3NextScannableBlock does (`qwen3_next_layers: local_global`, set by
data/maxtext_releases.yml): the Gated DeltaNet layers scanned once more inside the cycle, their second
layer axis `local_layers` after `layers`, and the full-attention layer alone::

    decoder/layers/local_layers/...   as layer_<i < 3> above, with (..., layers, local_layers, ...)
    decoder/layers/global_layer/...   as layer_3 above
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharding_dump.core.capture import constrain
from sharding_dump.models.attention import ATTENTION_INPUT, QKV, causal_attention
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM, LayerCycle, Stack
from sharding_dump.models.dense import MlpBlock, l2_normed
from sharding_dump.models.layers import BLE, Dense, RMSNorm, scan_layers
from sharding_dump.models.moe import RoutedExperts
from sharding_dump.models.rope import apply_rotary

UNNAMED = ()  # the logical axes of Qwen3-Next's norm scales: none, as MaxText's RMSNorm declares them
OUTPUT = ("activation_batch", "activation_length", "activation_embed")  # the full attention's output, as MaxText names it


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array) -> jax.Array:
    """The recurrence S_t = exp(g_t) S_(t-1) + k_t (beta_t (v_t - S^T k_t))^T, o_t = S_t^T q_t, per
    head: q, k (b, s, h, dk), v (b, s, h, dv), g, beta (b, s, h) -> (b, s, h, dv)."""
    def step(state: jax.Array, xs: tuple) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t = xs
        state = state * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", state, k_t)) * b_t[..., None]
        state = state + jnp.einsum("bhk,bhv->bhkv", k_t, delta)
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    batch, _, heads, dk = q.shape
    state = jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32)
    time_major = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    _, out = jax.lax.scan(step, state, tuple(time_major))
    return jnp.moveaxis(out, 0, 1)


class GatedDeltaNet(nn.Module):
    """Linear attention: q, k, v and an output gate z from one projection, a causal depthwise
    convolution, then the gated delta rule over value heads, a gated RMS norm and out_proj."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        nk, nv, dk, dv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
        key_dim, value_dim = nk * dk, nv * dv
        batch, length, _ = x.shape
        qkvz = Dense(cfg, (2 * key_dim + 2 * value_dim,), (cfg.attention_embed_axis,), ("gdn_head",), name="in_proj_qkvz")(x)
        ba = Dense(cfg, (2 * nv,), (cfg.attention_embed_axis,), ("gdn_head",), name="in_proj_ba")(x)
        per_k = nv // nk
        q, k, v, z = jnp.split(qkvz.reshape(batch, length, nk, -1), [dk, 2 * dk, 2 * dk + per_k * dv], axis=-1)
        b, a = jnp.split(ba.reshape(batch, length, nk, 2 * per_k), [per_k], axis=-1)
        mixed = jnp.concatenate([q.reshape(batch, length, -1), k.reshape(batch, length, -1),
                                 v.reshape(batch, length, -1)], axis=-1)
        conv = nn.Conv(mixed.shape[-1], (cfg.gdn_conv_kernel_dim,), feature_group_count=mixed.shape[-1],
                       padding="CAUSAL", use_bias=False, dtype=jnp.dtype(cfg.dtype),
                       param_dtype=jnp.dtype(cfg.weight_dtype), name="conv1d")
        q, k, v = jnp.split(jax.nn.silu(conv(mixed)), [key_dim, 2 * key_dim], axis=-1)
        q = jnp.repeat(l2_normed(q.reshape(batch, length, nk, dk), cfg), per_k, axis=2)
        k = jnp.repeat(l2_normed(k.reshape(batch, length, nk, dk), cfg), per_k, axis=2)
        v = v.reshape(batch, length, nv, dv)
        a_log = self.param("A_log", lambda key, shape, dtype: jnp.log(
            jax.random.uniform(key, shape, dtype, 1e-9, 16.0)), (nv,), jnp.dtype(cfg.weight_dtype))
        dt_bias = self.param("dt_bias", nn.initializers.ones, (nv,), jnp.dtype(cfg.weight_dtype))
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.reshape(batch, length, nv) + dt_bias)
        out = gated_delta_rule(q * dk**-0.5, k, v, g, jax.nn.sigmoid(b.reshape(batch, length, nv)))
        out = GatedRMSNorm(cfg, name="norm")(out.astype(jnp.dtype(cfg.dtype)), z.reshape(batch, length, nv, dv))
        return Dense(cfg, (x.shape[-1],), ("gdn_head",), (cfg.attention_embed_axis,), name="out_proj")(out.reshape(batch, length, -1))


class GatedRMSNorm(nn.Module):
    """RMS norm of x (scale without logical axes) times silu of the gate."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return RMSNorm(self.cfg, UNNAMED, name="rms_norm")(x) * jax.nn.silu(gate)


class GatedAttention(nn.Module):
    """Full attention whose query projection also gives a per-head sigmoid gate on the output;
    zero-centred q/k norms, RoPE on the first `partial_rotary_factor` of each head, and an out
    projection over the flattened heads (logical axes mlp, embed) as MaxText's."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        dim = cfg.resolved_head_dim
        x_q = constrain(x, ATTENTION_INPUT, "inputs_q")
        x_kv = constrain(x, ATTENTION_INPUT, "inputs_kv")
        q_gate = Dense(cfg, (cfg.num_query_heads, 2 * dim), (cfg.attention_embed_axis,), ("q_heads", "kv"), name="query")(x_q)
        q, gate = jnp.split(q_gate, 2, axis=-1)
        k = Dense(cfg, (cfg.num_kv_heads, dim), (cfg.attention_embed_axis,), ("kv_heads", "kv_head_dim"), name="key")(x_kv)
        v = Dense(cfg, (cfg.num_kv_heads, dim), (cfg.attention_embed_axis,), ("kv_heads", "kv_head_dim"), name="value")(x_kv)
        q = RMSNorm(cfg, UNNAMED, name="query_norm")(q)
        k = RMSNorm(cfg, UNNAMED, name="key_norm")(k)
        rotated = int(dim * cfg.partial_rotary_factor)
        q = jnp.concatenate([apply_rotary(q[..., :rotated], positions, cfg), q[..., rotated:]], axis=-1)
        k = jnp.concatenate([apply_rotary(k[..., :rotated], positions, cfg), k[..., rotated:]], axis=-1)
        q, k, v = (constrain(t, QKV, name) for t, name in ((q, "query"), (k, "key"), (v, "value")))
        # MaxText (models/qwen3.py) gives the attention three output names for its four dimensions, and
        # constrains the output before the gate.
        out = constrain(causal_attention(q, k, v, scale=dim**-0.5), OUTPUT, "attention_out") * jax.nn.sigmoid(gate)
        flat = out.reshape(out.shape[:2] + (-1,))
        return Dense(cfg, (x.shape[-1],), ("mlp",), (cfg.attention_embed_axis,), name="out")(flat)


class FullAttention(nn.Module):
    """MaxText's wrapper around the gated attention (hence attention/attention/... in the tree)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return GatedAttention(self.cfg, name="attention")(x, positions)


class SparseMoeBlock(nn.Module):
    """Routed experts plus one shared expert, the latter scaled by sigmoid(x . shared_expert_gate)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        routed = RoutedExperts(cfg, name="routed_experts")(x)
        shared = MlpBlock(cfg, cfg.shared_experts * cfg.moe_mlp_dim, name="shared_expert")(x)
        gate = Dense(cfg, (1,), ("embed",), (None,), name="shared_expert_gate")(x)
        return routed + jax.nn.sigmoid(gate) * shared


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm residual block: Gated DeltaNet or gated full attention, then the MoE block. `scan_body`:
    it returns (x, None), the body of a scan."""

    cfg: ModelConfig
    full_attention: bool = False
    scan_body: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array | tuple[jax.Array, None]:
        cfg = self.cfg
        x = constrain(x, BLE, "layer_input")
        h = constrain(RMSNorm(cfg, UNNAMED, name="input_layernorm")(x), BLE, "pre_attention_norm")
        mixer = FullAttention if self.full_attention else GatedDeltaNet
        x = constrain(x + mixer(cfg, name="attention")(h, positions), BLE, "attention_residual")
        h = constrain(RMSNorm(cfg, UNNAMED, name="post_attention_layernorm")(x), BLE, "post_attention_norm")
        out = constrain(x + SparseMoeBlock(cfg, name="mlp")(h), BLE, "layer_output")
        return (out, None) if self.scan_body else out


class Qwen3NextBlock(LayerCycle):
    """One scanned unit: three Gated DeltaNet layers, then one full-attention layer."""

    layer = Qwen3NextDecoderLayer
    prefix = "layer_"

    def options(self, index: int) -> dict[str, bool]:
        return {"full_attention": (index + 1) % self.cfg.inhomogeneous_layer_cycle_interval == 0}


class Qwen3NextLocalGlobalBlock(nn.Module):
    """One scanned unit as MaxText 0.2.5's Qwen3NextScannableBlock holds it: the Gated DeltaNet layers of
    the cycle scanned once more (`local_layers`, their own layer axis after `layers`), then the
    full-attention layer alone (`global_layer`)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        local = scan_layers(Qwen3NextDecoderLayer, cfg.inhomogeneous_layer_cycle_interval - 1, "local_layers")
        x, _ = local(cfg, scan_body=True, name="local_layers")(x, positions)
        return Qwen3NextDecoderLayer(cfg, full_attention=True, name="global_layer")(x, positions), None


# How the qwen3_next block holds a cycle's layers, by ModelConfig.qwen3_next_layers (a MaxText release sets it).
BLOCKS = {"cycle": Qwen3NextBlock, "local_global": Qwen3NextLocalGlobalBlock}


class Qwen3NextDecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "qwen3_next"
    card_fields = (
        "head_dim", "rope_max_timescale", "inhomogeneous_layer_cycle_interval", "num_experts", "num_experts_per_tok",
        "moe_mlp_dim", "shared_experts", "mlp_activations", "gdn_conv_kernel_dim", "gdn_key_head_dim",
        "gdn_value_head_dim", "gdn_num_key_heads", "gdn_num_value_heads", "partial_rotary_factor")
    required_fields = (
        "num_experts", "num_experts_per_tok", "moe_mlp_dim", "gdn_num_key_heads", "gdn_num_value_heads",
        "gdn_key_head_dim", "gdn_value_head_dim", "gdn_conv_kernel_dim")

    layer = Qwen3NextBlock

    @classmethod
    def stacks(cls, cfg: ModelConfig) -> tuple[Stack, ...]:
        """One stack of cycles, each held as :meth:`cycle_block` says."""
        return tuple(dataclasses.replace(s, layer=cls.cycle_block(cfg)) for s in super().stacks(cfg))

    @classmethod
    def cycle_block(cls, cfg: ModelConfig) -> type[nn.Module]:
        """The module of one cycle, as the release's `qwen3_next_layers` holds it."""
        if cfg.qwen3_next_layers not in BLOCKS:
            raise ValueError(f"qwen3_next_layers {cfg.qwen3_next_layers!r}: must be one of {', '.join(BLOCKS)}")
        return BLOCKS[cfg.qwen3_next_layers]


class Qwen35DecoderLM(Qwen3NextDecoderLM):
    """Qwen3.5: Qwen3-Next's hybrid decoder under its own block name."""

    decoder_block = "qwen3_5"

    @classmethod
    def cycle_block(cls, cfg: ModelConfig) -> type[nn.Module]:
        """One module per layer in every release (MaxText 0.2.5's Qwen3_5ScannableBlock keeps layer_0 ...)."""
        return Qwen3NextBlock
