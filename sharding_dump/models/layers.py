"""Building blocks shared by every decoder: kernels with logical axes, norms, embeddings, scans.

Kernels are declared with `self.param` and applied with `jnp.einsum`/`tensordot` (flax's
multi-dimensional DenseGeneral with logical partitioning trips a rank check under a mesh). Weights
live in `weight_dtype`; compute runs in `dtype` (bfloat16 by default).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from sharding_dump.core.capture import constrain
from sharding_dump.models.config import ModelConfig

Axes = tuple[str | None, ...]
# (batch, length, embed): the logical axes of the residual stream between blocks, in every family.
BLE = ("activation_batch", "activation_norm_length", "activation_embed")
# A transform's metadata parameter: the stack is built as flax NNX's transforms (`nnx.vmap`) build one.
NNX_STACK = "nnx_stack"


class DeclaredUnnamed(nn.LogicallyPartitioned):
    """The box of a weight declared with no logical axes, `()`, as MaxText's NNX modules declare some
    norm scales (RMSNorm's default `kernel_axes`). A linen stack (`nn.scan`, flax pads the names with
    None) names its layer dimension; a stack built as flax NNX builds one (`nnx.spmd.add_axis` skips an
    empty sharding) adds no name, so in MaxText's pipeline such a weight keeps no logical axes at all."""

    def add_axis(self, index: int, params: dict[Any, Any]) -> nn.LogicallyPartitioned:
        return self if params.get(NNX_STACK) and not self.names else super().add_axis(index, params)

    def remove_axis(self, index: int, params: dict[Any, Any]) -> nn.LogicallyPartitioned:
        return self if params.get(NNX_STACK) and not self.names else super().remove_axis(index, params)


def weight_param(module: nn.Module, name: str, shape: Sequence[int], axes: Axes, cfg: ModelConfig,
                 init: nn.initializers.Initializer | None = None) -> jax.Array:
    """A parameter annotated with its logical axes, in the run's weight dtype; `axes=()` declares it
    with none, as MaxText's `()` (:class:`DeclaredUnnamed`)."""
    if axes and len(shape) != len(axes):
        raise ValueError(f"{name}: {len(axes)} logical axes for shape {tuple(shape)}")
    if module.has_variable("params", name):
        # Applying: read the weight as it is. flax's `param` would first trace the initializer again
        # (jax.eval_shape) only to compare shapes: one trace per weight per step, ~15% of a case's CPU.
        return meta.unbox(module.get_variable("params", name))
    init = init or nn.initializers.lecun_normal()
    boxed = nn.with_logical_partitioning(init, axes)
    if not axes:
        boxed = lambda *args: DeclaredUnnamed(init(*args), ())  # noqa: E731
    return module.param(name, boxed, tuple(shape), jnp.dtype(cfg.weight_dtype))


class Dense(nn.Module):
    """y = x . kernel over the last `len(in_axes)` dims of x; kernel axes = in_axes + out_axes."""

    cfg: ModelConfig
    features: tuple[int, ...]
    in_axes: Axes
    out_axes: Axes
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n_in = len(self.in_axes)
        kernel = weight_param(self, "kernel", x.shape[-n_in:] + tuple(self.features),
                              self.in_axes + self.out_axes, self.cfg)
        dtype = jnp.dtype(self.cfg.dtype)
        y = jnp.tensordot(x.astype(dtype), kernel.astype(dtype), axes=n_in)
        if self.use_bias:
            bias = weight_param(self, "bias", self.features, self.out_axes, self.cfg, nn.initializers.zeros)
            y = y + bias.astype(dtype)
        return y


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale on logical axis `norm`."""

    cfg: ModelConfig
    axes: Axes = ("norm",)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = weight_param(self, "scale", (x.shape[-1],), self.axes, self.cfg, nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.normalization_layer_epsilon)
        return (y * scale.astype(jnp.float32)).astype(jnp.dtype(self.cfg.dtype))


class Embed(nn.Module):
    """Token embedding table (vocab, embed_vocab); `attend` gives tied output logits. With
    `num_embeddings`, a table of that many rows (MaxText's learned positions, on the same axes)."""

    cfg: ModelConfig
    num_embeddings: int = 0  # 0: the vocabulary

    def setup(self) -> None:
        self.embedding = weight_param(self, "embedding", (self.num_embeddings or self.cfg.vocab_size, self.cfg.emb_dim),
                                      ("vocab", "embed_vocab"), self.cfg, nn.initializers.normal(1.0))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # The table is cast before the lookup, as MaxText's Embed does: the lookup's gradient is then a
        # scatter-add into a bfloat16 table, not a float32 one (1.7 GB less per device for a
        # 151,936-word vocabulary of width 2048 under fsdp, where every device holds the whole sum).
        return jnp.take(self.embedding.astype(jnp.dtype(self.cfg.dtype)), tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        dtype = jnp.dtype(self.cfg.dtype)
        return jnp.einsum("bse,ve->bsv", x.astype(dtype), self.embedding.astype(dtype))


def activation(name: str, x: jax.Array) -> jax.Array:
    """The named MLP activation ('linear' is the identity)."""
    if name == "linear":
        return x
    return getattr(jax.nn, name)(x)


def scan_layers(layer: type[nn.Module], length: int, layer_axis: str, nnx_stack: bool = False,
                cache: bool = False) -> type[nn.Module]:
    """`length` copies of a rematerialised `layer`, stacked by nn.scan with the layer dimension at
    position 1 of every weight and named `layer_axis` in its logical spec (`nnx_stack`: named as flax
    NNX names it, see :class:`DeclaredUnnamed`). The layer broadcasts nothing out, so flax's extra
    trace that proves broadcast outputs constant is skipped (one trace of the layer per scan, not two).
    `cache`: a server's stack, not rematerialised, whose KV cache variables stack at position 0 (as
    MaxText's scanned decoder stacks its `cache` collection)."""
    return nn.scan(
        layer if cache else nn.remat(layer, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable),
        variable_axes={"params": 1, "cache": 0} if cache else {"params": 1},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=length,
        metadata_params={nn.PARTITION_NAME: layer_axis, NNX_STACK: nnx_stack},
        check_constancy_invariants=False,
    )


def output_logits(cfg: ModelConfig, x: jax.Array, shared_embedding: "Embed | None" = None,
                  norm: type[nn.Module] = RMSNorm) -> jax.Array:
    """Final norm (`norm`, built with cfg) and output projection (through the tied embedding, or an own
    `logits_dense` kernel), constrained as logits. Call it from a decoder's compact `__call__`: the
    modules land in its scope."""
    x = norm(cfg, name="decoder_norm")(x)
    if shared_embedding is not None:
        logits = shared_embedding.attend(x)
    else:
        logits = Dense(cfg, (cfg.vocab_size,), ("embed_vocab",), ("vocab",), name="logits_dense")(x)
    if cfg.final_logits_soft_cap:
        logits = jnp.tanh(logits / cfg.final_logits_soft_cap) * cfg.final_logits_soft_cap
    return constrain(logits, ("activation_embed_and_logits_batch", "activation_length", "activation_vocab"),
                     "logits")
