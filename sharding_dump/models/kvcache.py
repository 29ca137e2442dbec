"""MaxText's KV cache of one attention layer: its variables, shapes and logical axes, as MaxEngine builds
them in prefill and autoregressive mode.

MaxText (`inference/kvcache.py`, `KVCache`) keeps per attention layer a prefill cache of
`max_prefill_predict_length` tokens and an autoregressive (generate) cache of `max_target_length -
max_prefill_predict_length` tokens, each key and value stored in the dimension order `prefill_cache_axis_order`
/ `ar_cache_axis_order` give (default (1, 2, 0, 3): sequence, heads, batch, head dim), plus the
segment ids of both, the generated lengths and the write index. An int8 cache (`quantize_kvcache`)
keeps a bfloat16 scale per entry (`kv_quant_axis` heads_and_dkv: one per batch and position; dkv:
one per head too). The prefill model is built for one prompt (`cache_batch_prefill`), the
autoregressive one for the decode batch (`cache_batch`). A scanned decoder stacks every variable
over `layers` in front.

>>> cache = layer_cache(num_kv_heads=8, head_dim=128, batch=4, max_prefill_length=16, max_target_length=64,
...                     mode="autoregressive", quantize=True)
>>> cache["cached_ar_key"].value.shape, cache["cached_ar_key"].names
((48, 8, 4, 128), ('cache_sequence', 'cache_heads', 'cache_batch', 'cache_kv'))
>>> cache["cached_ar_key_scale"].value.shape
(48, 1, 4, 1)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

MODES = ("prefill", "autoregressive")
DEFAULT_AXIS_ORDER = (1, 2, 0, 3)  # MaxText's prefill_cache_axis_order and ar_cache_axis_order
CACHE_AXES = ("cache_batch", "cache_sequence", "cache_heads", "cache_kv")
SCALE_AXES = ("cache_scale_batch", "cache_scale_sequence", "cache_scale_heads", "cache_scale_kv")


def _ordered(items: Sequence, order: Sequence[int]) -> tuple:
    return tuple(items[i] for i in order)


def _box(shape: Sequence[int], dtype: str, names: Sequence[str]) -> nn.Partitioned:
    return nn.Partitioned(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)), names=tuple(names))


def layer_cache(num_kv_heads: int, head_dim: int, batch: int, max_prefill_length: int, max_target_length: int,
                mode: str, dtype: str = "bfloat16", quantize: bool = False, kv_quant_axis: str = "heads_and_dkv",
                prefill_axis_order: Sequence[int] = DEFAULT_AXIS_ORDER,
                ar_axis_order: Sequence[int] = DEFAULT_AXIS_ORDER) -> dict[str, nn.Partitioned]:
    """The cache variables of one attention layer, name -> boxed abstract array with its logical axes."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    if max_target_length <= max_prefill_length:
        raise ValueError(f"max_target_length={max_target_length} must be greater than max_prefill_predict_length="
                         f"{max_prefill_length} (the generate cache holds the difference)")
    batch_axis = "cache_batch_prefill" if mode == "prefill" else "cache_batch"
    axes = (batch_axis,) + CACHE_AXES[1:]
    kv_dtype = "int8" if quantize else dtype
    out: dict[str, nn.Partitioned] = {}
    for part, length, order in (("prefill", max_prefill_length, prefill_axis_order),
                                ("ar", max_target_length - max_prefill_length, ar_axis_order)):
        shape = _ordered((batch, length, num_kv_heads, head_dim), order)
        for kind in ("key", "value"):
            out[f"cached_{part}_{kind}"] = _box(shape, kv_dtype, _ordered(axes, order))
            if quantize:
                heads = num_kv_heads if kv_quant_axis == "dkv" else 1
                out[f"cached_{part}_{kind}_scale"] = _box(_ordered((batch, length, heads, 1), order), "bfloat16",
                                                          _ordered(SCALE_AXES, order))
        out[f"cache_{part}_segment_id"] = _box((batch, length), "int32", (batch_axis, "cache_sequence"))
    out["cached_ar_lengths"] = _box((batch,), "int32", ("cache_batch",))
    out["cache_ar_index"] = _box((1,), "int32", ())
    return out


def stacked(cache: dict[str, nn.Partitioned], layers: int, axis: str = "layers") -> dict[str, nn.Partitioned]:
    """Every variable of a layer's cache stacked over a scanned decoder's `layers` in front, as MaxText's
    scan stacks them (a variable with no logical axes gets the layer axis alone)."""
    return {name: _box((layers,) + tuple(box.value.shape), box.value.dtype.name, (axis,) + tuple(box.names))
            for name, box in cache.items()}


# --- the cache as a module: what MaxText's KVCache does with it in prefill and generate ------------------

@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """How one model of a server holds its cache: `mode` (prefill: one prompt, `cache_batch_prefill`;
    autoregressive: the decode batch of `batch` slots), the two lengths, int8 with scales or not, and the
    dimension orders of the prefill and generate caches (MaxText's `prefill_cache_axis_order`,
    `ar_cache_axis_order`)."""

    mode: str
    batch: int
    max_prefill_length: int
    max_target_length: int
    quantize: bool = False
    kv_quant_axis: str = "heads_and_dkv"
    prefill_axis_order: tuple[int, ...] = DEFAULT_AXIS_ORDER
    ar_axis_order: tuple[int, ...] = DEFAULT_AXIS_ORDER


def cache_names(spec: CacheSpec, num_kv_heads: int, head_dim: int, dtype: str) -> dict[str, tuple[str, ...]]:
    """name -> logical axes of every variable of one layer's cache under `spec` (MaxEngine's
    kv_cache_annotations_named, for one layer)."""
    return {name: tuple(box.names) for name, box in _layer(spec, num_kv_heads, head_dim, dtype).items()}


def _layer(spec: CacheSpec, num_kv_heads: int, head_dim: int, dtype: str) -> dict[str, nn.Partitioned]:
    return layer_cache(num_kv_heads, head_dim, spec.batch, spec.max_prefill_length, spec.max_target_length,
                       spec.mode, dtype, spec.quantize, spec.kv_quant_axis, spec.prefill_axis_order, spec.ar_axis_order)


INT8_MAX = 127.0


def quantize(kv: jax.Array, names: Sequence[str], axis: str) -> tuple[jax.Array, jax.Array]:
    """kv in int8 and its scale, the largest magnitude over the heads and head dim (`heads_and_dkv`) or
    the head dim alone (`dkv`), as MaxText's KVQuant.quantize."""
    over = (names.index("cache_kv"),) if axis == "dkv" else (names.index("cache_heads"), names.index("cache_kv"))
    scale = jnp.max(jnp.abs(kv), axis=over, keepdims=True)
    return jnp.rint(kv * (INT8_MAX / scale)).astype(jnp.int8), scale


class KVCache(nn.Module):
    """One attention layer's cache (variables of the `cache` collection, boxed with their logical axes):
    a prefill writes a prompt's keys and values into the prefill cache; a generate step writes one token
    per slot into the generate cache at the write index and reads both back, as MaxText's KVCache does
    (`kv_cache_prefill`, `kv_cache_autoregressive`)."""

    spec: CacheSpec
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def setup(self) -> None:
        self.variables_ = {
            name: self.variable("cache", name, nn.with_logical_partitioning(
                lambda shape=box.value.shape, dtype=box.value.dtype: jnp.zeros(shape, dtype), box.names))
            for name, box in _layer(self.spec, self.num_kv_heads, self.head_dim, self.dtype).items()}

    def _store(self, cache: dict[str, nn.Variable], part: str, kind: str, kv: jax.Array, write: Any) -> None:
        """kv (b, s, n, d) in the part's dimension order, quantized when the cache is int8, written by
        `write(old, new, names, label)` (label: the activation name of a key or value, None for a scale)."""
        order = self.spec.prefill_axis_order if part == "prefill" else self.spec.ar_axis_order
        names = _ordered(("cache_batch",) + CACHE_AXES[1:], order)
        shaped = jnp.transpose(kv, order)
        if self.spec.quantize:
            shaped, scale = quantize(shaped, names, self.spec.kv_quant_axis)
            var = cache[f"cached_{part}_{kind}_scale"]
            var.value = write(var.value, scale.astype(var.value.dtype), _ordered(SCALE_AXES, order), None)
        var = cache[f"cached_{part}_{kind}"]
        var.value = write(var.value, shaped.astype(var.value.dtype), names, f"cached_{part}_{kind}")

    def _read(self, cache: dict[str, nn.Variable], part: str, kind: str, dtype: Any) -> jax.Array:
        """The part's keys or values back in (b, s, n, d), dequantized."""
        order = self.spec.prefill_axis_order if part == "prefill" else self.spec.ar_axis_order
        value = cache[f"cached_{part}_{kind}"].value.astype(dtype)
        if self.spec.quantize:
            value = value * (cache[f"cached_{part}_{kind}_scale"].value.astype(dtype) / INT8_MAX)
        return jnp.moveaxis(value, (0, 1, 2, 3), order)

    def prefill(self, key: jax.Array, value: jax.Array) -> None:
        """Writes a prompt's keys and values (b, s, n, d) and its segment ids into the prefill cache."""
        cache = self.variables_
        for kind, kv in (("key", key), ("value", value)):
            self._store(cache, "prefill", kind, kv, lambda old, new, names, label: new)
        segment = cache["cache_prefill_segment_id"]
        segment.value = jnp.ones(segment.value.shape, segment.value.dtype)

    def generate(self, key: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Writes one token's keys and values (b, 1, n, d) at the write index and returns every cached
        key and value (b, prefill + generate length, n, d) with the positions that hold a token."""
        from sharding_dump.core.capture import constrain

        cache = self.variables_
        index = jnp.squeeze(cache["cache_ar_index"].value)

        def write(old: jax.Array, new: jax.Array, names: tuple[str, ...], label: str | None) -> jax.Array:
            updated = jax.lax.dynamic_update_index_in_dim(old, new, index, names.index(
                "cache_sequence" if label else "cache_scale_sequence"))
            return updated if label is None else constrain(updated, names, label)  # as MaxText re-constrains it

        for kind, kv in (("key", key), ("value", value)):
            self._store(cache, "ar", kind, kv, write)
        segment = cache["cache_ar_segment_id"]
        segment.value = jax.lax.dynamic_update_index_in_dim(segment.value, jnp.ones((key.shape[0], 1), jnp.int32),
                                                            index, 1)
        cache["cache_ar_index"].value = jnp.mod(cache["cache_ar_index"].value + 1,
                                                self.spec.max_target_length - self.spec.max_prefill_length)
        cache["cached_ar_lengths"].value = cache["cached_ar_lengths"].value + 1
        keys = jnp.concatenate([self._read(cache, p, "key", key.dtype) for p in ("prefill", "ar")], axis=1)
        values = jnp.concatenate([self._read(cache, p, "value", value.dtype) for p in ("prefill", "ar")], axis=1)
        visible = jnp.concatenate([cache["cache_prefill_segment_id"].value, segment.value], axis=1) != 0
        return keys, values, visible
