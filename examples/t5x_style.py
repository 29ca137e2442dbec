"""A decoder-only LM written with the older flax partitioning API, as t5x and flaxformer write theirs.

Every weight is created by `flax.linen.partitioning.param_with_axes(name, init, shape, axes=...)`,
which keeps its logical axis names in the `params_axes` collection beside `params` (and constrains
the weight to them where it is read). Activations go through `partitioning.with_sharding_constraint`
with logical names. The rule file (`examples/t5x_rules.yml`) holds only logical rules: each weight
and its optimizer slots are placed by the weight's own `params_axes` under them, no axis written twice.

Two programs: `small_decoder` (the harness's step over the module) and `small_decoder_train` (a
t5x-style init whose state keeps `params` and `params_axes` side by side, and its own step).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import partitioning as nn_partitioning

import sharding_dump as sd

param_with_axes = nn_partitioning.param_with_axes
with_sharding_constraint = nn_partitioning.with_sharding_constraint

# The logical names of the MLP's hidden dimension: the test changes it to prove the golden bites.
MLP_AXES = ("embed", "mlp")


class DenseGeneral(nn.Module):
    features: int
    kernel_axes: tuple[str, ...]

    @nn.compact
    def __call__(self, x):
        kernel = param_with_axes("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                                 axes=self.kernel_axes)
        return jnp.einsum("...d,df->...f", x, kernel)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = param_with_axes("scale", nn.initializers.ones, (x.shape[-1],), axes=("embed",))
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


class DecoderLayer(nn.Module):
    heads: int
    head_dim: int
    mlp_dim: int
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x, deterministic: bool):
        embed = x.shape[-1]
        h = RMSNorm(name="pre_attention_norm")(x)
        q, k, v = (DenseGeneral(self.heads * self.head_dim, ("embed", "joined_kv"), name=n)(h) for n in "qkv")
        split = lambda t: t.reshape(t.shape[:-1] + (self.heads, self.head_dim))  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / self.head_dim ** 0.5
        length = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores, -1e9)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), v).reshape(x.shape[:-1] + (-1,))
        x = x + DenseGeneral(embed, ("joined_kv", "embed"), name="out")(attn)
        x = with_sharding_constraint(x, ("batch", "length", "embed"))
        h = RMSNorm(name="pre_mlp_norm")(x)
        h = nn.gelu(DenseGeneral(self.mlp_dim, MLP_AXES, name="wi")(h))
        h = with_sharding_constraint(h, ("batch", "length", "mlp"))
        h = nn.Dropout(self.dropout, broadcast_dims=(-2,))(h, deterministic=deterministic)
        return x + DenseGeneral(embed, MLP_AXES[::-1], name="wo")(h)


class Decoder(nn.Module):
    vocab: int = 256
    embed: int = 64
    heads: int = 4
    head_dim: int = 16
    mlp_dim: int = 128
    layers: int = 2

    @nn.compact
    def __call__(self, tokens, decoder_positions=None, deterministic: bool = False):
        table = param_with_axes("embedding", nn.initializers.normal(1.0), (self.vocab, self.embed),
                                axes=("vocab", "embed"))
        x = jnp.take(table, tokens, axis=0)
        x = with_sharding_constraint(x, ("batch", "length", "embed"))
        for i in range(self.layers):
            x = DecoderLayer(self.heads, self.head_dim, self.mlp_dim, name=f"layers_{i}")(x, deterministic)
        x = RMSNorm(name="decoder_norm")(x)
        return DenseGeneral(self.vocab, ("embed", "vocab"), name="logits_dense")(x)


def small_decoder() -> sd.ModelProgram:
    """The module in training mode (dropout on), called by the harness's next-token step."""
    return sd.ModelProgram(Decoder(), kwargs={"deterministic": False})


def small_decoder_train() -> sd.TrainProgram:
    """A t5x-style program: init keeps `params` and `params_axes` side by side (t5x's train state
    holds both), the step is its own (AdamW, dropout)."""
    model = Decoder()
    tx = optax.adamw(1e-3)

    def init(key):
        tokens = jnp.ones((1, 8), jnp.int32)
        variables = model.init({"params": key, "dropout": key}, tokens)
        params = variables["params"]
        return {"params": params, "params_axes": variables["params_axes"], "opt_state": tx.init(params),
                "step": jnp.zeros((), jnp.int32)}

    def train_step(state, batch):
        dropout = jax.random.fold_in(jax.random.key(0), state["step"])

        def loss_fn(params):
            logits = model.apply({"params": params}, batch["inputs"], rngs={"dropout": dropout})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {**state, "params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                "step": state["step"] + 1}, {"loss": loss}

    return sd.TrainProgram(init, train_step, batch={"inputs": sd.Input(), "targets": sd.Input()})
