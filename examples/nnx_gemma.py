"""A Gemma-3-style causal LM in Flax NNX with sharding in types, written for sharding-dump's examples.

It has the features of flax's NNX Gemma (`examples/gemma` in the flax repository) that matter to a
sharding harness, written anew: its own :class:`ShardingConfig` of PartitionSpecs in mesh axes, for
weights (`out_sharding` metadata on every parameter) and for activations (`out_sharding=` on every
embedding, einsum and linear call, which needs a mesh whose axes are Explicit); a call
`model(tokens, positions, cache, attention_mask, rngs=None)` returning `(logits, cache)`; dropout
drawn from the `rngs` passed in; grouped-query attention with query/key norms, RoPE and alternating
sliding-window / global layers; a Python list of layers. With :func:`gemma3_1b` its parameter
shapes are those of Gemma 3 1B (as flax's lm1b training configures it: a 35,008-token vocabulary).

Dump it (explicit sharding):

    sharding-dump --model examples.nnx_gemma:small_gemma --topology cpu-4 --rule examples/gemma_rules.yml \\
        ici_fsdp_parallelism=2 ici_tensor_parallelism=2 shard_mode=explicit
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import sharding_dump as sd


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Where weights and activations live, in mesh axes (None: replicated, as without a mesh)."""

    emb_vd: P | None = None
    q_weight_ndh: P | None = None
    kv_weight_cndh: P | None = None
    o_weight_nhd: P | None = None
    ffw_weight_df: P | None = None
    ffw_weight_fd: P | None = None
    rms_norm_weight: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_btnh: P | None = None
    act_cbtkh: P | None = None

    @staticmethod
    def fsdp_tp(fsdp: str = "fsdp", tp: str = "tensor") -> "ShardingConfig":
        """Weights split over both axes, activations' batch over fsdp and features over tp."""
        return ShardingConfig(emb_vd=P(tp, fsdp), q_weight_ndh=P(tp, fsdp, None), kv_weight_cndh=P(None, None, fsdp, None),
                              o_weight_nhd=P(tp, None, fsdp), ffw_weight_df=P(fsdp, tp), ffw_weight_fd=P(tp, fsdp),
                              rms_norm_weight=P(tp), act_btd=P(fsdp, None, tp), act_btf=P(fsdp, None, tp),
                              act_btnh=P(fsdp, None, tp, None), act_cbtkh=P(None, fsdp, None, None, None))


@dataclasses.dataclass(frozen=True)
class Config:
    num_layers: int
    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    sliding_window_size: int = 512
    global_every: int = 6  # every 6th layer attends globally, the rest within the sliding window
    dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32
    shd: ShardingConfig = ShardingConfig()


def gemma3_1b(**override) -> Config:
    """Gemma 3 1B's shapes (26 layers, 1152 wide, 4 query heads and 1 key/value head of 256)."""
    return Config(**{"num_layers": 26, "num_embed": 35_008, "embed_dim": 1152, "hidden_dim": 6 * 1152,
                     "num_heads": 4, "head_dim": 256, "num_kv_heads": 1, **override})


def _param_meta(spec: P | None) -> dict:
    return {"out_sharding": spec} if spec is not None else {}


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, spec: P | None, rngs: nnx.Rngs, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32), **_param_meta(spec))
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
        return (normed * (1.0 + self.scale[...])).astype(self.dtype)


def rope(x: jax.Array, positions: jax.Array, max_wavelength: int) -> jax.Array:
    """Rotary position embedding over the last axis of [B, T, N, H]."""
    head_dim = x.shape[-1]
    timescale = max_wavelength ** (2 * jnp.arange(head_dim // 2) / head_dim)
    angle = (positions[..., None] / timescale)[..., None, :]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, sliding: bool, rngs: nnx.Rngs):
        shd = cfg.shd
        self.cfg, self.sliding = cfg, sliding
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (cfg.num_heads, cfg.embed_dim, cfg.head_dim),
                                   kernel_metadata=_param_meta(shd.q_weight_ndh), dtype=cfg.dtype, rngs=rngs)
        self.kv_einsum = nnx.Einsum("BTD,CKDH->CBTKH", (2, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim),
                                    kernel_metadata=_param_meta(shd.kv_weight_cndh), dtype=cfg.dtype, rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (cfg.num_heads, cfg.head_dim, cfg.embed_dim),
                                          kernel_metadata=_param_meta(shd.o_weight_nhd), dtype=cfg.dtype, rngs=rngs)
        self.query_norm = RMSNorm(cfg.head_dim, None, rngs, cfg.dtype)
        self.key_norm = RMSNorm(cfg.head_dim, None, rngs, cfg.dtype)
        self.dropout = nnx.Dropout(cfg.dropout_rate)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: dict | None, mask: jax.Array,
                 rngs: nnx.Rngs | None = None) -> tuple[dict | None, jax.Array]:
        cfg = self.cfg
        query = self.query_norm(self.q_einsum(x, out_sharding=cfg.shd.act_btnh))
        key, value = self.kv_einsum(x, out_sharding=cfg.shd.act_cbtkh)
        key = self.key_norm(key)
        wavelength = 10_000 if self.sliding else 1_000_000
        query = rope(query, positions, wavelength) * cfg.head_dim ** -0.5
        key = rope(key, positions, wavelength)
        b, t, n, h = query.shape
        groups = cfg.num_heads // cfg.num_kv_heads
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", query.reshape(b, t, cfg.num_kv_heads, groups, h), key)
        logits = logits.reshape(b, t, n, -1)
        if self.sliding:
            ones = jnp.ones(mask.shape, dtype=mask.dtype)
            window = cfg.sliding_window_size
            mask = mask * jnp.triu(ones, 1 - window) * jnp.tril(ones, window - 1)
        probs = jax.nn.softmax(jnp.where(mask[:, :, None, :], logits, -2.3819763e38), axis=-1).astype(value.dtype)
        probs = self.dropout(probs, rngs=rngs)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(b, t, cfg.num_kv_heads, groups, -1), value)
        out = self.attn_vec_einsum(encoded.reshape(b, t, n, h), out_sharding=cfg.shd.act_btd)
        return cache, out


class FeedForward(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.shd = cfg.shd

        def linear(d_in: int, d_out: int, spec: P | None) -> nnx.Linear:
            return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=nnx.initializers.normal(),
                              kernel_metadata=_param_meta(spec), dtype=cfg.dtype, rngs=rngs)

        self.gate_proj = linear(cfg.embed_dim, cfg.hidden_dim, cfg.shd.ffw_weight_df)
        self.up_proj = linear(cfg.embed_dim, cfg.hidden_dim, cfg.shd.ffw_weight_df)
        self.down_proj = linear(cfg.hidden_dim, cfg.embed_dim, cfg.shd.ffw_weight_fd)
        self.dropout = nnx.Dropout(cfg.dropout_rate)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        hidden = nnx.gelu(self.gate_proj(x, out_sharding=self.shd.act_btf)) * self.up_proj(x, out_sharding=self.shd.act_btf)
        return self.down_proj(self.dropout(hidden, rngs=rngs), out_sharding=self.shd.act_btd)


class Block(nnx.Module):
    def __init__(self, cfg: Config, sliding: bool, rngs: nnx.Rngs):
        def norm() -> RMSNorm:
            return RMSNorm(cfg.embed_dim, cfg.shd.rms_norm_weight, rngs, cfg.dtype)

        self.pre_attention_norm, self.post_attention_norm = norm(), norm()
        self.pre_ffw_norm, self.post_ffw_norm = norm(), norm()
        self.attn = Attention(cfg, sliding, rngs)
        self.mlp = FeedForward(cfg, rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: dict | None, mask: jax.Array,
                 rngs: nnx.Rngs | None = None) -> tuple[dict | None, jax.Array]:
        cache, attended = self.attn(self.pre_attention_norm(x), positions, cache, mask, rngs=rngs)
        x = x + self.post_attention_norm(attended)
        x = x + self.post_ffw_norm(self.mlp(self.pre_ffw_norm(x), rngs=rngs))
        return cache, self.dropout(x, rngs=rngs)


class ScaledEmbed(nnx.Embed):
    def __call__(self, x: jax.Array, out_sharding: P | None = None) -> jax.Array:
        return super().__call__(x, out_sharding) * jnp.sqrt(self.features)


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedder = ScaledEmbed(cfg.num_embed, cfg.embed_dim, dtype=cfg.dtype, rngs=rngs,
                                    embedding_metadata=_param_meta(cfg.shd.emb_vd))
        self.layers = nnx.List([Block(cfg, (i + 1) % cfg.global_every != 0, rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.shd.rms_norm_weight, rngs, cfg.dtype)
        self.final_dropout = nnx.Dropout(cfg.dropout_rate)

    def __call__(self, last_tokens: jax.Array, positions: jax.Array, cache: dict | None, attention_mask: jax.Array,
                 rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict | None]:
        x = self.embedder(last_tokens, out_sharding=self.cfg.shd.act_btd)
        for layer in self.layers:
            cache, x = layer(x, positions, cache, attention_mask, rngs=rngs)
        x = self.final_dropout(self.final_norm(x), rngs=rngs)
        return self.embedder.attend(x, out_sharding=self.cfg.shd.act_btd), cache


def causal_mask(tokens: jax.Array, pad_id: int = 0) -> jax.Array:
    """[B, T, T]: token t sees the non-padding tokens up to itself (what the trainer builds per step)."""
    valid = tokens > pad_id
    return valid[..., None, :] & jnp.tril(jnp.ones((tokens.shape[-1],) * 2, dtype=jnp.bool_))


def program(cfg: Config) -> sd.ModelProgram:
    """How a trainer calls it: positions from the batch, the causal mask built from the tokens, no
    cache, dropout keys through `rngs` (the call takes it, so the harness passes `nnx.Rngs(dropout=...)`),
    the logits the first element of the output pair."""
    return sd.ModelProgram(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), positions="positions",
                           inputs={"attention_mask": lambda batch: causal_mask(batch["inputs"])},
                           kwargs={"cache": None})


def small_gemma() -> sd.ModelProgram:
    """Two layers (one sliding-window, one global), a 512-token vocabulary, dropout on."""
    return program(gemma3_1b(num_layers=2, global_every=2, num_embed=512, embed_dim=64, hidden_dim=128,
                             num_heads=4, head_dim=16, num_kv_heads=1, dropout_rate=0.1,
                             shd=ShardingConfig.fsdp_tp()))


def gemma_1b() -> sd.ModelProgram:
    """Gemma 3 1B's shapes, sharded as flax's lm1b trainer shards it (fsdp and tensor)."""
    return program(gemma3_1b(dropout_rate=0.1, dtype=jnp.bfloat16, shd=ShardingConfig.fsdp_tp()))
