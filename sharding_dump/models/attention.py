"""Causal softmax attention: grouped heads, a value width of its own (MLA), an optional sliding
window, optional per-head attention sinks (gpt-oss) and an optional logit soft cap (Gemma 2).

`jax.nn.dot_product_attention` covers none of these (and computes its scores in float32), so the
score matrix is written out.

>>> import jax.numpy as jnp
>>> q = jnp.ones((1, 4, 8, 16)); k = jnp.ones((1, 4, 2, 16)); v = jnp.ones((1, 4, 2, 12))
>>> causal_attention(q, k, v, scale=0.25, sliding_window=2, sinks=jnp.zeros(8)).shape
(1, 4, 8, 12)
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import jax.numpy as jnp

from sharding_dump.core.capture import constrain

# Logical axes of the activations MaxText's standard attention constrains in training (inputs, q/k/v,
# output before the out projection): the `_attn` names of its attention layer.
ATTENTION_INPUT = ("activation_batch_attn", "activation_input_length_attn", "activation_embed_attn")
QKV = ("activation_kv_batch", "activation_length_attn", "activation_kv_heads", "activation_kv_head_dim")
ATTENTION_OUT = ("activation_batch_attn", "activation_length_attn", "activation_heads", "activation_kv")
# In serving, MaxText's attention names them per model mode: a prefill (one prompt) and a generate step
# (one token per slot) each have their own (`prefill_*` / `decode_*` axis names of its attention layer).
SERVING_AXES = {
    "prefill": {"input": ("activation_prefill_kv_batch", "prefill_activation_length", "activation_embed_attn"),
                "query": ("activation_prefill_kv_batch", "prefill_activation_length", "activation_kv_heads",
                          "activation_kv_head_dim"),
                "key": ("activation_prefill_kv_batch", "prefill_activation_length", "activation_kv_heads",
                        "activation_kv_head_dim"),
                "out": ("activation_prefill_kv_batch", "prefill_activation_length", "activation_heads", "activation_kv")},
    "autoregressive": {"input": ("decode_batch", "decode_length", "activation_embed_attn"),
                       "query": ("decode_batch", "decode_length", "activation_heads", "activation_kv"),
                       "key": ("decode_batch", "decode_length", "activation_kv_heads", "activation_kv"),
                       "out": ("decode_batch", "decode_length", "activation_heads", "activation_kv")},
}
# Latent attention (DeepSeek's MLA) keeps the older, non-attention names for the same three points.
MLA_INPUT = ("activation_batch_attn", "activation_length", "activation_embed")
MLA_QKV = ("activation_kv_batch", "activation_length", "activation_kv_heads", "activation_kv_head_dim")
MLA_OUT = ("activation_batch_attn", "activation_length", "activation_heads", "activation_kv")
# The batch's segment ids as MaxText's attention constrains them before its kernel (its `decoder_segment_ids`):
# once as the queries' (batch and query length axes), once as the keys' (batch and key length axes); only its
# NNX build feeds them to the layers.
SEGMENT_IDS = ("activation_batch_attn", "activation_q_length")
SEGMENT_IDS_NAME = "decoder_segment_ids"
KV_SEGMENT_IDS = ("activation_batch_attn", "activation_kv_length")
KV_SEGMENT_IDS_NAME = "decoder_segment_ids_kv"
_SEGMENTS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("decoder_segment_ids", default=None)


@contextlib.contextmanager
def segment_ids(ids: jax.Array | None) -> Iterator[None]:
    """Every attention called in the block masks and constrains `ids` (batch, length) as its segment
    ids (None: no segment ids). The decoder sets them once for all its layers, a pipeline stage its
    microbatch's, so no layer signature carries them."""
    reset = _SEGMENTS.set(ids)
    try:
        yield
    finally:
        _SEGMENTS.reset(reset)


def current_segment_ids() -> jax.Array | None:
    """The segment ids :func:`segment_ids` set for the attentions called now (None: none)."""
    return _SEGMENTS.get()


def causal_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, scale: float,
                     sliding_window: int = 0, sinks: jax.Array | None = None, soft_cap: float = 0.0,
                     selected: jax.Array | None = None) -> jax.Array:
    """query (b, t, heads, d), key (b, s, kv_heads, d), value (b, s, kv_heads, dv) -> (b, t, heads, dv).

    `sliding_window` > 0 lets a position see only the last `sliding_window` positions; `sinks`
    (heads,) adds one extra logit per head that takes probability mass but contributes no value;
    `soft_cap` > 0 bounds the logits smoothly to (-soft_cap, soft_cap) (Gemma 2); `selected` (b, t, s)
    lets query t see only the keys chosen for it (DeepSeek's sparse attention indexer).

    Computed as MaxText's dot-product attention in training with its defaults `float32_qk_product`
    and `float32_logits` false: scores, mask, softmax and weighted values all in the query's dtype,
    the values weighted by the unnormalised exponentials and divided by their sum afterwards. A
    bfloat16 step so holds its (b, kv_heads, group, t, s) scores in bfloat16, as MaxText's does: in
    float32 they would double the largest buffers of a compiled step.

    Inside :func:`segment_ids`, a query sees only keys of its own segment, and the segment ids are
    constrained first, as the queries' (`decoder_segment_ids`) and as the keys' (`decoder_segment_ids_kv`),
    as MaxText's NNX build constrains them before its flash kernel."""
    batch, length, heads, _ = query.shape
    kv_heads = key.shape[2]
    group = heads // kv_heads
    dtype = query.dtype
    if scale != 1.0:
        query = query * jnp.asarray(scale, dtype)  # MaxText folds the scale into the query's kernel
    q = query.reshape(batch, length, kv_heads, group, query.shape[-1])
    logits = jnp.einsum("btkgd,bskd->bkgts", q, key.astype(dtype))
    if soft_cap:
        logits = jnp.tanh(logits / soft_cap) * soft_cap
    positions = jnp.arange(length)
    visible = positions[None, :] <= positions[:, None]
    if sliding_window:
        visible &= positions[None, :] > positions[:, None] - sliding_window
    if selected is not None:
        visible = visible & selected[:, None, None]
    segments = current_segment_ids()
    if segments is not None:
        queries = constrain(segments, SEGMENT_IDS, SEGMENT_IDS_NAME)
        keys = constrain(segments, KV_SEGMENT_IDS, KV_SEGMENT_IDS_NAME)
        visible = visible & (queries[:, :, None] == keys[:, None, :])[:, None, None]
    logits = jnp.where(visible, logits, jnp.finfo(dtype).min)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(dtype).reshape(kv_heads, group, 1, 1), logits.shape[:-1] + (1,))
        logits = jnp.concatenate([logits, sink], axis=-1)
    exps = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    total = jnp.moveaxis(exps.sum(axis=-1, keepdims=True), 3, 1)  # (b, t, kv_heads, group, 1)
    out = jnp.einsum("bkgts,bskd->btkgd", exps[..., :length].astype(value.dtype), value)
    out = out / total.astype(out.dtype)
    return out.reshape(batch, length, heads, value.shape[-1])


def cached_attention(query: jax.Array, key: jax.Array, value: jax.Array, visible: jax.Array, *,
                     scale: float) -> jax.Array:
    """query (b, 1, heads, d) of one new token per slot over every cached key and value (b, s, kv_heads,
    d) whose position holds a token (`visible`, (b, s)): a generate step's attention over the prefill
    and generate caches, in the query's dtype."""
    batch, length, heads, _ = query.shape
    kv_heads = key.shape[2]
    dtype = query.dtype
    q = (query * jnp.asarray(scale, dtype)).reshape(batch, length, kv_heads, heads // kv_heads, query.shape[-1])
    logits = jnp.einsum("btkgd,bskd->bkgts", q, key.astype(dtype))
    logits = jnp.where(visible[:, None, None, None, :], logits, jnp.finfo(dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(value.dtype), value)
    return out.reshape(batch, length, heads, value.shape[-1])
