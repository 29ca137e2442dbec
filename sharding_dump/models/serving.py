"""The zoo's dense decoders served as MaxText's MaxEngine serves them: prefill, insert and generate over
MaxText's KV cache.

MaxEngine (`inference/maxengine/maxengine.py`, MaxText 0.2.5) builds the model twice: in prefill mode
(one prompt, the cache's batch `cache_batch_prefill`) and in autoregressive mode (the decode batch of
`per_device_batch_size` x devices slots, `cache_batch`). Its decode state holds the generate model's
cache and, per slot, the last logits, next position, generated count, last token and its log
probability. Its steps, as :class:`ServingSteps` runs them here:

* prefill (`_prefill_jit`): one prompt of `max_prefill_predict_length` tokens through the prefill model;
  the prefix it hands on (the prefill part of its cache, the last position's logits, the first token)
  laid out as `get_prefix_destination_sharding` places it: the cache by the rules, the rest replicated;
* insert (`_insert_jit`): the prefix copied into one slot of the decode state (`cached_prefill_*` and
  the prefill segment ids at the slot, the slot's generate lengths reset), the cache re-constrained
  to the generate model's layout (`kv_cache_shardings`) and the rest replicated;
* generate (`_generate_jit`): one token for every slot through the generate model, the cache
  re-constrained to `kv_cache_shardings`, the logits replicated.

The weights are the training model's (same parameter tree, same logical axes); the cache is
:mod:`sharding_dump.models.kvcache`'s, one per attention layer, stacked over `layers` in front.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump.core.capture import constrain, constrain_spec
from sharding_dump.core.program import Input, ServingProgram, ServingSettings, ServingStep
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.dense import DecoderLayer
from sharding_dump.models.kvcache import DEFAULT_AXIS_ORDER, CacheSpec, cache_names
from sharding_dump.models.layers import BLE, Embed, RMSNorm, output_logits, scan_layers

DECODE_STATE = ("logits", "next_pos", "generated_tokens", "tokens", "token_logp")  # MaxEngine's, beside the cache
PREFILL_PARTS = ("cached_prefill_", "cache_prefill_segment_id")  # the cache variables insert reads of a prefix


class ServingDecoder(nn.Module):
    """The scanned stack of a dense decoder with its KV cache, the final norm and the logits."""

    cfg: ModelConfig
    cache: CacheSpec
    shared_embedding: Embed | None = None

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        stack = scan_layers(DecoderLayer, self.cfg.num_decoder_layers, "layers", cache=True)
        x, _ = stack(self.cfg, self.cache, name="layers")(x, positions)
        return output_logits(self.cfg, x, self.shared_embedding, RMSNorm)


class ServingLM(nn.Module):
    """Token ids (batch, length) and positions -> logits, reading and writing the `cache` collection;
    the parameter tree is the training model's (token_embedder, decoder/layers/..., decoder_norm)."""

    cfg: ModelConfig
    cache: CacheSpec

    def setup(self) -> None:
        self.token_embedder = Embed(self.cfg)
        shared = self.token_embedder if self.cfg.logits_via_embedding else None
        self.decoder = ServingDecoder(self.cfg, self.cache, shared)

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        return self.decoder(constrain(self.token_embedder(tokens), BLE, "embedded_inputs"), positions)


@dataclasses.dataclass(frozen=True)
class ZooServer:
    """A model card served by MaxEngine's steps: the card's config, the int8 cache's scale axis and the
    two cache dimension orders (MaxText's `kv_quant_axis`, `prefill_cache_axis_order`,
    `ar_cache_axis_order`)."""

    config: ModelConfig
    kv_quant_axis: str = "heads_and_dkv"
    prefill_axis_order: tuple[int, ...] = DEFAULT_AXIS_ORDER
    ar_axis_order: tuple[int, ...] = DEFAULT_AXIS_ORDER

    def spec(self, mode: str, settings: ServingSettings) -> CacheSpec:
        """The cache of the prefill (one prompt) or autoregressive (every slot) model."""
        return CacheSpec(mode, 1 if mode == "prefill" else settings.slots, settings.max_prefill_length,
                         settings.max_length, settings.cache_dtype == "int8", self.kv_quant_axis,
                         self.prefill_axis_order, self.ar_axis_order)

    def model(self, mode: str, settings: ServingSettings) -> ServingLM:
        return ServingLM(self.config, self.spec(mode, settings))

    def names(self, mode: str, settings: ServingSettings) -> dict[str, tuple[str, ...]]:
        """Cache variable name -> its logical axes, stacked over `layers` (MaxEngine's annotations)."""
        cfg = self.config
        return {name: ("layers",) + axes for name, axes in
                cache_names(self.spec(mode, settings), cfg.num_kv_heads, cfg.resolved_head_dim, cfg.dtype).items()}

    def program(self) -> ServingProgram:
        """init, prefill, insert and generate, as MaxEngine runs them."""
        return ServingProgram(self.init, {
            "prefill": ServingStep(self.prefill, {"tokens": Input((1, "prefill_length"))}, requests=1),
            "insert": ServingStep(self.insert, {"slot": Input(())}, requests=1, takes="prefill"),
            "generate": ServingStep(self.generate),
        })

    # --- init and the steps ------------------------------------------------------------------------

    def init(self, key: jax.Array, settings: ServingSettings) -> dict[str, Any]:
        """The weights, the generate model's cache for every slot and the decode state
        (MaxEngine's load_params and init_decode_state)."""
        slots = settings.slots
        tokens = jnp.zeros((slots, 1), jnp.int32)
        variables = self.model("autoregressive", settings).init(key, tokens, tokens)
        decode = {"logits": jnp.zeros((slots, 1, self.config.vocab_size), jnp.float32),
                  "next_pos": tokens, "generated_tokens": tokens, "tokens": tokens,
                  "token_logp": jnp.zeros((slots, 1), jnp.float32)}
        decode = {k: _replicated(v, f"decode_{k}") for k, v in decode.items()}  # as insert and generate keep it
        return {"params": variables["params"], "cache": variables["cache"], "decode_state": decode}

    def prefill(self, state: dict[str, Any], inputs: dict[str, Any],
                settings: ServingSettings) -> tuple[dict[str, Any], dict[str, Any]]:
        """One prompt through the prefill model; the prefix laid out as MaxEngine hands it on."""
        tokens = inputs["tokens"]
        length = tokens.shape[1]
        positions = jnp.arange(length, dtype=jnp.int32)[None, :]
        logits, variables = self.model("prefill", settings).apply({"params": state["params"]}, tokens, positions,
                                                                   mutable=["cache"])
        selected = _replicated(logits[:, -1:, :].astype(jnp.float32), "selected_logits")
        first = jnp.argmax(selected, axis=-1).astype(jnp.int32)
        cache = _placed(_prefill_part(nn.unbox(variables["cache"])), self.names("prefill", settings), "prefix")
        prefix = {"logits": selected, "cache": cache, "next_pos": jnp.full((1, 1), length, jnp.int32),
                  "generated_tokens": jnp.zeros((1, 1), jnp.int32), "tokens": first,
                  "token_logp": jnp.zeros((1, 1), jnp.float32)}
        replicated = {k: _replicated(v, f"prefix_{k}") for k, v in prefix.items() if k != "cache"}
        return state, {**prefix, **replicated}

    def insert(self, state: dict[str, Any], inputs: dict[str, Any],
               settings: ServingSettings) -> tuple[dict[str, Any], dict[str, Any]]:
        """The prefix copied into slot `inputs["slot"]` of the decode state (MaxEngine's _insert_jit)."""
        prefix, slot = inputs["prefill"], inputs["slot"]
        names = self.names("autoregressive", settings)

        def copy(path: tuple[Any, ...], full: jax.Array) -> jax.Array:
            name = path[-1].key
            axes = names[name]
            batch = axes.index("cache_batch") if "cache_batch" in axes else axes.index("cache_scale_batch") \
                if "cache_scale_batch" in axes else None
            if name.startswith(PREFILL_PARTS):
                partial = _at(prefix["cache"], path)
                return jax.lax.dynamic_update_index_in_dim(full, partial.astype(full.dtype), slot, batch)
            if name in ("cache_ar_segment_id", "cached_ar_lengths"):  # the slot starts generating afresh
                shape = full.shape[:batch] + (1,) + full.shape[batch + 1:]
                return jax.lax.dynamic_update_index_in_dim(full, jnp.zeros(shape, full.dtype), slot, batch)
            return full  # the generate cache and its write index stay

        cache = _placed(jax.tree_util.tree_map_with_path(copy, state["cache"]), names, "inserted")
        decode = {k: _replicated(jax.lax.dynamic_update_index_in_dim(v, prefix[k].astype(v.dtype), slot, 0),
                                 f"inserted_{k}")
                  for k, v in state["decode_state"].items()}
        return {**state, "cache": cache, "decode_state": decode}, {}

    def generate(self, state: dict[str, Any], inputs: dict[str, Any],
                 settings: ServingSettings) -> tuple[dict[str, Any], dict[str, Any]]:
        """One token for every slot through the generate model (MaxEngine's _generate_jit)."""
        decode = state["decode_state"]
        logits, variables = self.model("autoregressive", settings).apply(
            {"params": state["params"], "cache": state["cache"]}, decode["tokens"], decode["next_pos"],
            mutable=["cache"])
        logits = _replicated(logits.astype(jnp.float32), "out_logits")
        cache = _placed(nn.unbox(variables["cache"]), self.names("autoregressive", settings), "new_cache")
        token = jnp.argmax(logits[:, -1, :], axis=-1).astype(jnp.int32)[:, None]
        decode = {"logits": logits, "next_pos": decode["next_pos"] + 1,
                  "generated_tokens": decode["generated_tokens"] + 1, "tokens": token,
                  "token_logp": jnp.zeros_like(decode["token_logp"])}
        return {**state, "cache": cache, "decode_state": decode}, {"tokens": token}


def _prefill_part(cache: Any) -> Any:
    """The prefill variables of a prefill model's cache (what insert reads of a prefix)."""
    out = {}
    for key, value in cache.items():
        if hasattr(value, "items"):
            value = _prefill_part(value)
            if value:
                out[key] = value
        elif key.startswith(PREFILL_PARTS):
            out[key] = value
    return out


def _replicated(x: jax.Array, name: str) -> jax.Array:
    """x whole on every device (MaxEngine's replicated_sharding), noted as `name`; as it is off a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return x if mesh.empty else constrain_spec(x, NamedSharding(mesh, PartitionSpec()), name)


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for entry in path:
        tree = tree[entry.key]
    return tree


def _placed(cache: Any, names: dict[str, tuple[str, ...]], label: str) -> Any:
    """Every cache variable constrained to its logical axes by the rules (MaxEngine's
    with_sharding_constraint to its cache shardings), noted as `<label>_<variable>`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: constrain(leaf, names[path[-1].key], f"{label}_{path[-1].key}"), cache)
