"""The abstract training state of any Flax model and optax optimizer: nothing is allocated.

A model is given as a linen module (its `init` runs under `jax.eval_shape`) or as an NNX module, or a
factory of one (built under `nnx.eval_shape`). Either way the parameters come back *boxed* with their
logical axes (flax `Partitioned`); the optimizer state is built over the raw parameters and each of
its leaves is traced back to its parameter (:mod:`sharding_dump.core.optimizer`).

>>> import flax.linen as nn, jax.numpy as jnp
>>> class Tiny(nn.Module):
...     @nn.compact
...     def __call__(self, tokens):
...         w = self.param("w", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab", "embed")), (100, 16))
...         return jnp.take(w, tokens, axis=0) @ w.T
>>> model = as_model(Tiny())
>>> state = abstract_train_state(model.abstract_params(), default_optimizer())
>>> sorted(state), parameter_count(state)
(['opt_state', 'params', 'step'], 1600)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from sharding_dump.core.capture import note_nnx_modules
from sharding_dump.core.layout import leaves, unbox
from sharding_dump.core.legacy_mesh import legacy_mesh
from sharding_dump.core.optimizer import optimizer_state

INIT_TOKENS = (1, 8)  # parameter shapes do not depend on the batch used to initialise
ApplyFn = Callable[[Any, jax.Array, jax.Array], jax.Array]  # (raw params, tokens, positions) -> logits


# AdamW as MaxText configures it by default (base.yml: adam_b1, adam_b2, adam_eps, adam_eps_root,
# adam_weight_decay), with a constant learning-rate schedule.
ADAMW = {"learning_rate": 1e-4, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "eps_root": 0.0, "weight_decay": 0.1}


def default_optimizer() -> optax.GradientTransformation:
    """AdamW with a learning-rate schedule, as trainers configure it (the schedule adds a count)."""
    hp = dict(ADAMW)
    return optax.adamw(optax.constant_schedule(hp.pop("learning_rate")), **hp)


def abstract_train_state(params: Any, optimizer: optax.GradientTransformation | None = None) -> dict[str, Any]:
    """{'step', 'params', 'opt_state'} as abstract arrays.

    `params` is an abstract (boxed) parameter tree, or a function `key -> params` that is run under
    `jax.eval_shape`. The optimizer (default: :func:`default_optimizer`; any optax
    GradientTransformation) is initialised abstractly over the raw parameters, as a trainer does, and
    every leaf of its state that belongs to a parameter carries the logical axes it derives from it
    (:mod:`sharding_dump.core.optimizer`): AdamW's mu and nu the parameter's, Adafactor's factored
    moments those of the dimensions they keep."""
    tx = optimizer or default_optimizer()
    if callable(params):
        params = jax.eval_shape(params, jax.random.key(0))
    return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
            "opt_state": optimizer_state(tx, params)}


def parameter_count(state: Any) -> int:
    """Sum of the sizes of every leaf under `params/` (or of every leaf of a bare parameter tree)."""
    found = leaves(state)
    under = [a for p, a, _ in found if p.startswith("params/")] if isinstance(state, dict) and "params" in state \
        else [a for _, a, _ in found]
    return sum(math.prod(a.shape) for a in under)


def _takes_positions(fn: Callable[..., Any]) -> bool:
    try:
        return "positions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class Model:
    """A causal LM as the harness drives it: abstract boxed parameters and a pure apply function
    `(raw params, tokens, positions) -> logits`."""

    kind: str  # linen | nnx
    build_params: Callable[[], Any]
    apply: ApplyFn

    def abstract_params(self, mesh: Any = None, rules: Any = None) -> Any:
        """The boxed abstract parameters. With a mesh (and rules), initialisation runs under them, as
        in training: a model that places plain `jax.lax.with_sharding_constraint(x, P(...))` needs one."""
        if mesh is None:
            return self.build_params()
        from sharding_dump.core.layout import rules_of

        abstract = mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh
        with jax.sharding.use_abstract_mesh(abstract), legacy_mesh(abstract), \
                nn.logical_axis_rules(rules_of(rules or ())):
            return self.build_params()


def _linen_model(module: nn.Module) -> Model:
    positions_kw = _takes_positions(module.__call__)

    def call_kwargs(positions: jax.Array) -> dict[str, Any]:
        return {"positions": positions} if positions_kw else {}

    def abstract_params() -> Any:
        def init(key: jax.Array) -> Any:
            tokens = jnp.zeros(INIT_TOKENS, jnp.int32)
            return module.init(key, tokens, **call_kwargs(tokens))["params"]
        return jax.eval_shape(init, jax.random.key(0))

    def apply(params: Any, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        return module.apply({"params": params}, tokens, **call_kwargs(positions))

    return Model("linen", abstract_params, apply)


def _concrete_placeholder(leaf: Any) -> Any:
    """A stand-in for a non-parameter NNX variable (RNG keys, counters) seen only while tracing."""
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jnp.zeros(leaf.shape + (2,), jnp.uint32))
    return jnp.zeros(leaf.shape, leaf.dtype)


def _nnx_model(abstract_module: Any) -> Model:
    from flax import nnx

    graphdef, params_state, rest = nnx.split(abstract_module, nnx.Param, ...)
    flat = list(nnx.to_flat_state(params_state))

    def abstract_params() -> Any:
        tree: dict[str, Any] = {}
        for path, var in flat:
            value = var.get_value()
            names = var.get_metadata().get("out_sharding")
            node = tree
            for key in path[:-1]:
                node = node.setdefault(str(key), {})
            node[str(path[-1])] = nn.Partitioned(value, names=tuple(names)) if names else value
        return tree

    positions_kw = _takes_positions(type(abstract_module).__call__)

    def apply(params: Any, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        values = []
        for path, var in flat:
            node = params
            for key in path:
                node = node[str(key)]
            values.append((path, var.replace(node)))
        rest_values = jax.tree.map(_concrete_placeholder, rest)
        module = nnx.merge(graphdef, nnx.from_flat_state(values), rest_values)
        note_nnx_modules(module)
        return module(tokens, positions=positions) if positions_kw else module(tokens)

    return Model("nnx", abstract_params, apply)


def as_model(model: Any) -> Model:
    """A linen module, an NNX module, or a zero-argument factory of either, as a :class:`Model`.

    An NNX factory is called under `nnx.eval_shape` (with eager sharding off), so even a 400B model
    allocates nothing; a linen module is inert until `init`."""
    from flax import nnx

    if isinstance(model, nn.Module):
        return _linen_model(model)
    if isinstance(model, nnx.Module):
        return _nnx_model(model)
    if not callable(model):
        raise TypeError(f"{model!r} is neither a Flax module nor a factory of one")
    linen: list[nn.Module] = []

    def build() -> Any:
        built = model()
        if isinstance(built, nn.Module):
            linen.append(built)
            return None
        return built

    with nnx.use_eager_sharding(False):
        built = nnx.eval_shape(build)
    if linen:
        return _linen_model(linen[0])
    if isinstance(built, nnx.Module):
        return _nnx_model(built)
    raise TypeError(f"{getattr(model, '__qualname__', model)!r} returned {type(built).__name__}, "
                    "not a Flax linen or NNX module")


__all__ = ["Model", "abstract_train_state", "as_model", "default_optimizer", "parameter_count", "unbox"]
