"""An Equinox LM trained as Levanter trains its models: the program builds its own mesh.

Written after the pattern of Levanter (haliax named arrays in Equinox modules, placed by
`named_jit`): the trainer's config holds the mesh shape and the axis mappings from the model's own
axis names to mesh axes (:class:`MeshConfig`); the program builds a concrete `jax.sharding.Mesh`
over `jax.devices()`, creates its state inside one `jax.jit(out_shardings=...)` and runs its step as
`jax.jit(train_step, in_shardings=(state, batch), out_shardings=(state, loss))`, every sharding on
its own mesh. Each weight is an :class:`Linear` whose static `axes` name its dimensions, as a haliax
array's axes do, and AdamW's moments keep those names (optax maps over the module).

The harness reads all of it: every weight on the spec the program's mapping gives it, the batch in
the layout the step's `in_shardings` demand (`batch.program_spec` in activation_shardings.json), and
the program's mesh, which must be the case's: another shape is refused in one line naming both.
A program that sets its mesh as a context instead (Levanter's `with trainer:`, haliax's `named_jit`
taking the mesh from it) names it as `TrainProgram(mesh=...)`: `small_lm_context` places everything
on `jax.sharding.get_abstract_mesh()`, and its mesh too must be the case's. The command and the
pytest plugin give the program as many CPU devices as the case has (here 8):

    sharding-dump --model examples.eqx_lm:small_lm \\
        --topology cpu-8 --rule examples/eqx_rules.yml ici_data_parallelism=4 ici_model_parallelism=2 \\
        per_device_batch_size=2 max_target_length=32
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sharding_dump as sd


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The trainer's mesh (Levanter's `trainer.mesh`): axis sizes, and the mappings from the model's
    axis names to mesh axes for parameters and for the batch (Levanter's axis resources)."""

    axes: tuple[tuple[str, int], ...] = (("data", 4), ("model", 2))
    param_mapping: tuple[tuple[str, str | None], ...] = (("embed", "data"), ("mlp", "model"), ("heads", "model"),
                                                         ("vocab", "model"))
    batch_mapping: tuple[tuple[str, str | None], ...] = (("batch", "data"),)
    step_mapping: tuple[tuple[str, str | None], ...] | None = None  # the step's jit takes and returns the state
    #                                                                  on it (Levanter's axis_resources); None: param_mapping
    axis_type: AxisType = AxisType.Auto  # Levanter's use_explicit_mesh_axes: Explicit

    def build(self) -> jax.sharding.Mesh:
        """A concrete mesh over this process's devices, as the trainer builds it."""
        names, sizes = zip(*self.axes)
        return jax.make_mesh(sizes, names, axis_types=(self.axis_type,) * len(names))

    def spec(self, axes: tuple[str, ...], mapping: tuple[tuple[str, str | None], ...] | None = None) -> P:
        """The spec of named dimensions under `mapping` (default: the parameters')."""
        found = dict(self.param_mapping if mapping is None else mapping)
        return P(*(found.get(axis) for axis in axes))


MESH = MeshConfig()


class Linear(eqx.Module):
    """A weight with named dimensions (a haliax array's axes)."""

    weight: jax.Array
    axes: tuple[str, ...] = eqx.field(static=True)

    @staticmethod
    def make(key: jax.Array, axes: tuple[str, ...], shape: tuple[int, ...]) -> Linear:
        return Linear(jax.random.normal(key, shape) * shape[0] ** -0.5, axes)


class Block(eqx.Module):
    attn_norm: Linear
    qkv: Linear
    out: Linear
    mlp_norm: Linear
    up: Linear
    down: Linear

    def __init__(self, key: jax.Array, embed: int, heads: int, head_dim: int, mlp: int):
        keys = jax.random.split(key, 4)
        self.attn_norm = Linear(jnp.ones(embed), ("norm",))
        self.qkv = Linear.make(keys[0], ("embed", "qkv", "heads", "head_dim"), (embed, 3, heads, head_dim))
        self.out = Linear.make(keys[1], ("heads", "head_dim", "embed"), (heads, head_dim, embed))
        self.mlp_norm = Linear(jnp.ones(embed), ("norm",))
        self.up = Linear.make(keys[2], ("embed", "mlp"), (embed, mlp))
        self.down = Linear.make(keys[3], ("mlp", "embed"), (mlp, embed))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = rms_norm(x, self.attn_norm.weight)
        q, k, v = jnp.einsum("btd,dchk->cbthk", h, self.qkv.weight)
        x = x + jnp.einsum("bthk,hkd->btd", jax.nn.dot_product_attention(q, k, v, is_causal=True), self.out.weight)
        return x + jax.nn.gelu(rms_norm(x, self.mlp_norm.weight) @ self.up.weight) @ self.down.weight


class EqxLM(eqx.Module):
    embedding: Linear
    blocks: list[Block]
    final_norm: Linear
    lm_head: Linear

    def __init__(self, key: jax.Array, vocab: int = 256, embed: int = 64, heads: int = 4, mlp: int = 128,
                 layers: int = 2):
        keys = jax.random.split(key, layers + 2)
        self.embedding = Linear.make(keys[0], ("vocab", "embed"), (vocab, embed))
        self.blocks = [Block(k, embed, heads, embed // heads, mlp) for k in keys[1:-1]]
        self.final_norm = Linear(jnp.ones(embed), ("norm",))
        self.lm_head = Linear.make(keys[-1], ("embed", "vocab"), (embed, vocab))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embedding.weight[tokens]
        for block in self.blocks:
            x = block(x)
        return rms_norm(x, self.final_norm.weight) @ self.lm_head.weight


def rms_norm(x: jax.Array, gamma: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gamma


def shardings(tree: Any, config: MeshConfig, mesh: jax.sharding.Mesh, mapping: Any = None) -> Any:
    """Every named weight (and every AdamW moment of one) on the spec `mapping` (default: the
    parameters') gives it, the rest replicated: what Levanter's `infer_resource_partitions` gives a
    state of named arrays."""
    def one(leaf: Any) -> Any:
        if isinstance(leaf, Linear):
            return Linear(NamedSharding(mesh, config.spec(leaf.axes, mapping)), leaf.axes)
        return NamedSharding(mesh, P())
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, Linear))


def program(config: MeshConfig, context: bool = False) -> sd.TrainProgram:
    """Its own mesh, init and jitted step; with `context`, every sharding on the mesh of the context
    (`jax.set_mesh(mesh)` around a real run, the case's mesh traced) and the mesh given to the harness."""
    own = config.build()

    def mesh_of() -> Any:
        return jax.sharding.get_abstract_mesh() if context else own
    tx = optax.adamw(3e-4, weight_decay=0.1)

    def make_state(key: jax.Array) -> dict:
        model = EqxLM(key)
        return {"model": model, "opt_state": tx.init(eqx.filter(model, eqx.is_array)),
                "step": jnp.zeros((), jnp.int32)}

    def state_shardings(key: jax.Array) -> Any:
        return shardings(jax.eval_shape(make_state, key), config, mesh_of())

    def init(key: jax.Array) -> dict:
        return jax.jit(make_state, out_shardings=state_shardings(key))(key)

    def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
        def loss_fn(model: EqxLM) -> jax.Array:
            logits = model(batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(state["model"])
        updates, opt_state = tx.update(grads, state["opt_state"], eqx.filter(state["model"], eqx.is_array))
        return ({"model": eqx.apply_updates(state["model"], updates), "opt_state": opt_state,
                 "step": state["step"] + 1}, {"loss": loss})

    def step(state: dict, batch: dict) -> tuple[dict, dict]:
        mesh = mesh_of()
        placed = shardings(state, config, mesh, config.step_mapping)
        batch_sharding = {name: NamedSharding(mesh, config.spec(("batch", "length"), config.batch_mapping))
                          for name in batch}
        jitted = jax.jit(train_step, in_shardings=(placed, batch_sharding),
                         out_shardings=(placed, NamedSharding(mesh, P())))
        return jitted(state, batch)

    return sd.TrainProgram(init, step, batch={"inputs": sd.Input(), "targets": sd.Input()},
                           mesh=own if context else None)


def small_lm() -> sd.TrainProgram:
    """Two blocks at toy sizes on the module's MESH (read when called)."""
    return program(MESH)


def small_lm_context() -> sd.TrainProgram:
    """The same, its mesh set as a context (Levanter's `with trainer:`) and given as TrainProgram(mesh=...)."""
    return program(MESH, context=True)
