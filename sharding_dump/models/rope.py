"""Rotary position embeddings: plain RoPE and YaRN, with half-split or interleaved pairs.

YaRN (used by DeepSeek and gpt-oss) keeps the high-frequency dimensions as trained and interpolates
the low-frequency ones by `rope_factor`, with a linear ramp between the two ranges set by
`beta_fast` / `beta_slow`; that is how a 4k-trained model reaches 128k+ positions.

>>> import dataclasses
>>> from sharding_dump.zoo.cards import load_config
>>> cfg = load_config("deepseek2-16b")
>>> freqs = inverse_frequencies(cfg, 64)
>>> freqs.shape, bool(freqs[0] == 1.0), bool(freqs[-1] < 1e-4)
((32,), True, True)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sharding_dump.models.config import ModelConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inverse_frequencies(cfg: ModelConfig, dim: int, max_timescale: float | None = None) -> np.ndarray:
    """The `dim // 2` rotation frequencies of the card's rotary variant (a constant, not traced), with
    base `max_timescale` (default: the card's `rope_max_timescale`)."""
    base = float(max_timescale or cfg.rope_max_timescale)
    plain = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if cfg.rope_type != "yarn":
        return plain.astype(np.float32)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return dim * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (divided by rope_factor)
    return (plain / cfg.rope_factor * ramp + plain * keep).astype(np.float32)


def apply_rotary(x: jax.Array, positions: jax.Array, cfg: ModelConfig, max_timescale: float | None = None,
                 linear_scaling: float = 1.0) -> jax.Array:
    """Rotates the last dim of x (batch, length, heads, dim) by position (divided by `linear_scaling`,
    Gemma 3's stretch of its global layers' context), with base `max_timescale` when given."""
    dim = x.shape[-1]
    scaled = positions[..., None].astype(jnp.float32) / linear_scaling
    angles = scaled * jnp.asarray(inverse_frequencies(cfg, dim, max_timescale))
    scale = yarn_mscale(cfg.rope_factor) if (cfg.rope_type == "yarn" and cfg.rope_attention_scaling) else 1.0
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if cfg.rope_interleave:
        first, second = x32[..., 0::2], x32[..., 1::2]
        rotated = jnp.stack([first * cos - second * sin, second * cos + first * sin], axis=-1)
        return rotated.reshape(x.shape).astype(x.dtype)
    first, second = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)
