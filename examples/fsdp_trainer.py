"""A linen LM trained as Kauldron trains its models: the trainer, not the model, decides the sharding.

Written after the pattern of Kauldron's `kd.sharding`: the model's weights carry no logical axes; a
:class:`ShardingStrategy` of the trainer places the whole state FSDP-style (each leaf split over
`fsdp` on its largest dimension that divides, as `kd.sharding.FSDPSharding` does) and the batch on
its own layout. Its init creates the state inside `jax.jit(out_shardings=...)`; its step places the
batch first (a sharding constraint at the top) and constrains the whole state it returns at the
end, as a jitted step's `out_shardings` would.

The harness reads every one of those decisions: each leaf on the strategy's spec, the batch's layout
(`batch.program_spec` in activation_shardings.json, with a warning when it is not the rule file's
`data_sharding`), and the layout of every leaf the step hands back (`returned`, when it is not the
layout the leaf went in with). `small_lm_data_sharding` is the same trainer with its batch arriving
on the strategy's layout from its own data pipeline, as Kauldron's does (`Input(sharding=...)`).

    sharding-dump --model examples.fsdp_trainer:small_lm --topology cpu-8 --rule examples/fsdp_rules.yml \\
        ici_fsdp_parallelism=8 per_device_batch_size=2 max_target_length=32
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding_dump as sd

REPLICATED = None


@dataclasses.dataclass(frozen=True)
class ShardingStrategy:
    """Where the trainer puts the state and the batch (Kauldron's `ShardingStrategy`): `state` the
    mesh axis each leaf is split over on its largest dividing dimension (None: replicated), `batch`
    the spec of every batch field."""

    state: str | None = "fsdp"
    batch: P | None = P("fsdp")

    def state_shardings(self, tree: Any) -> Any:
        mesh = jax.sharding.get_abstract_mesh()
        return jax.tree.map(lambda leaf: NamedSharding(mesh, self.fsdp(leaf.shape, mesh)), tree)

    def fsdp(self, shape: tuple[int, ...], mesh: Any) -> P:
        """The largest dimension that splits evenly over the axis (the first of equals), else replicated."""
        if self.state is None or not shape:
            return P()
        ways = mesh.shape[self.state]
        fits = [d for d in range(len(shape)) if shape[d] % ways == 0 and shape[d] >= ways]
        if not fits:
            return P()
        dim = max(fits, key=lambda d: (shape[d], -d))
        return P(*(self.state if d == dim else None for d in range(len(shape))))

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(jax.sharding.get_abstract_mesh(), P() if self.batch is REPLICATED else self.batch)


STRATEGY = ShardingStrategy()
STEP_STRATEGY: ShardingStrategy | None = None  # the step's own, when not the init's


class MLPLM(nn.Module):
    vocab: int = 256
    embed: int = 64
    mlp: int = 256
    layers: int = 2

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.embed)(tokens)
        for i in range(self.layers):
            h = nn.RMSNorm(name=f"norm_{i}")(x)
            x = x + nn.Dense(self.embed, use_bias=False, name=f"down_{i}")(
                nn.gelu(nn.Dense(self.mlp, use_bias=False, name=f"up_{i}")(h)))
        return nn.Dense(self.vocab, use_bias=False, name="lm_head")(nn.RMSNorm(name="final_norm")(x))


def program(strategy: ShardingStrategy, step_strategy: ShardingStrategy | None = None,
            data_sharding: bool = False) -> sd.TrainProgram:
    """Its own init and step, both placed by the trainer's strategy; with `data_sharding`, the batch
    arrives on the strategy's layout from the trainer's own data pipeline (Kauldron's `sharding.ds`,
    declared as each field's `Input(sharding=...)`) rather than being constrained in the step."""
    model = MLPLM()
    tx = optax.adamw(3e-4, weight_decay=0.1)
    at_end = step_strategy or strategy

    def make_state(key: jax.Array) -> dict:
        params = model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def init(key: jax.Array) -> dict:
        return jax.jit(make_state, out_shardings=strategy.state_shardings(jax.eval_shape(make_state, key)))(key)

    def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
        if not data_sharding:
            batch = jax.lax.with_sharding_constraint(batch, strategy.batch_sharding())

        def loss_fn(params: Any) -> jax.Array:
            logits = model.apply({"params": params}, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                     "step": state["step"] + 1}
        return jax.lax.with_sharding_constraint(new_state, at_end.state_shardings(new_state)), {"loss": loss}

    delivered = (P() if strategy.batch is REPLICATED else strategy.batch) if data_sharding else None
    return sd.TrainProgram(init, train_step, batch={"inputs": sd.Input(sharding=delivered),
                                                    "targets": sd.Input(sharding=delivered)})


def small_lm() -> sd.TrainProgram:
    """The module's STRATEGY (and STEP_STRATEGY, when set), read when called."""
    return program(STRATEGY, STEP_STRATEGY)


def small_lm_data_sharding() -> sd.TrainProgram:
    """`small_lm` with its batch delivered on the strategy's layout by its own data pipeline."""
    return program(STRATEGY, STEP_STRATEGY, data_sharding=True)
