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

from typing import Sequence

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
