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
import sys
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from sharding_dump.core.layout import leaves, path_rules_of, place_by_path
from sharding_dump.core.legacy_mesh import legacy_mesh
from sharding_dump.core.optimizer import Slot, optimizer_state
from sharding_dump.core.placement import AXES_COLLECTION, box_params_axes
from sharding_dump.core.tree import is_box, path_text, unbox

INIT_TOKENS = (1, 8)  # parameter shapes do not depend on the batch used to initialise
ApplyFn = Callable[[Any, dict[str, Any], dict[str, jax.Array]], Any]  # (raw params, batch, rng keys) -> output


# AdamW as MaxText configures it by default (base.yml: adam_b1, adam_b2, adam_eps, adam_eps_root,
# adam_weight_decay), with a constant learning-rate schedule.
ADAMW = {"learning_rate": 1e-4, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "eps_root": 0.0, "weight_decay": 0.1}


def default_optimizer() -> optax.GradientTransformation:
    """AdamW with a learning-rate schedule, as trainers configure it (the schedule adds a count)."""
    hp = dict(ADAMW)
    return optax.adamw(optax.constant_schedule(hp.pop("learning_rate")), **hp)


def abstract_key(impl: str | None = None) -> jax.ShapeDtypeStruct:
    """The PRNG key an init is traced with, as a shape and dtype (of PRNG implementation `impl`, jax's
    default when None): a concrete `jax.random.key(0)` would start a backend and compile the seeding
    (0.13 s of a cold start) for a value never looked at."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl))


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
        params = jax.eval_shape(params, abstract_key())
    return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
            "opt_state": optimizer_state(tx, params)}


def parameter_count(state: Any) -> int:
    """Sum of the sizes of every leaf under `params/` (or of every leaf of a bare parameter tree)."""
    found = leaves(state)
    under = [a for p, a, _ in found if p.startswith("params/")] if isinstance(state, dict) and "params" in state \
        else [a for _, a, _ in found]
    return sum(math.prod(a.shape) for a in under)


CallFn = Callable[[Any, dict[str, Any], dict[str, jax.Array]], Any]  # (module, batch, rng keys) -> output


def takes(fn: Callable[..., Any], name: str) -> bool:
    """True when `fn`'s signature has a parameter `name` (or takes **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


SEGMENT_FIELD = "inputs_segmentation"  # a batch's segment ids (MaxText's field), for a model that takes them


def tokens_call(module: Any, batch: dict[str, Any], rngs: dict[str, jax.Array]) -> Any:
    """The plain call: `module(tokens)`, plus `positions=` when its `__call__` takes it, and
    `segment_ids=` when it takes them and the batch has them."""
    call = module.__call__ if isinstance(module, nn.Module) else type(module).__call__
    params = _parameters(call)
    extra = {"segment_ids": batch[SEGMENT_FIELD]} if SEGMENT_FIELD in batch and "segment_ids" in params else {}
    if "positions" in params:
        return module(batch["inputs"], positions=batch["inputs_position"], **extra)
    return module(batch["inputs"], **extra)


def _parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def init_batch(fields: dict[str, jax.ShapeDtypeStruct] | None = None) -> dict[str, jax.Array]:
    """A small concrete-shaped batch to initialise parameters with (their shapes do not depend on it)."""
    if fields is None:
        return {f: jnp.zeros(INIT_TOKENS, jnp.int32) for f in ("inputs", "inputs_position", "targets")}
    return {name: jnp.zeros(f.shape, f.dtype) for name, f in fields.items()}


@dataclasses.dataclass(frozen=True)
class Model:
    """A causal LM as the harness drives it: abstract boxed parameters and a pure apply function
    `(raw params, batch, rng keys) -> output`; `batch` holds `inputs`, `inputs_position`, `targets`
    (and any field the call takes), `rng keys` one key per stream (empty: none)."""

    kind: str  # linen | nnx
    build_params: Callable[[], Any]
    apply: Callable[[Any, dict[str, Any], dict[str, jax.Array]], Any]

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

    def placement(self, names: tuple[Any, ...], rules: Any) -> jax.sharding.PartitionSpec:
        """Where training puts a parameter with these axis names on an Explicit-axis mesh, as flax
        does it: a linen box by flax's logical resolver, an NNX variable by NNX's own rule application
        (a name with no rule is taken as a mesh axis)."""
        from sharding_dump.core.layout import resolve, rules_of

        if self.kind == "linen":
            return resolve(names, rules)
        from flax.core import spmd as core_spmd

        with nn.logical_axis_rules(rules_of(rules)):
            return core_spmd.get_pspec(tuple(names))


def explicit_train_state(model: Model, mesh: Any, rules: Any,
                         optimizer: optax.GradientTransformation | None = None) -> dict[str, Any]:
    """{'step', 'params', 'opt_state'} traced on an Explicit-axis `mesh`: every parameter placed as
    :meth:`Model.placement` says, or by the rules' path rules when it has no axis names
    (`jax.sharding.reshard`); every optimizer leaf that derives axes from its parameter
    (:mod:`sharding_dump.core.optimizer`) placed by them, as a trainer places its state by its
    annotations (AdamW's moments would follow by sharding-in-types anyway); each leaf carries its
    sharding."""
    tx = optimizer or default_optimizer()
    params = model.build_params()
    template = optimizer_state(tx, params)
    path_rules = path_rules_of(rules)
    specs: dict[str, tuple[Any, ...]] = {}  # parameter path -> its spec entries, one per dimension
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_box):
        shape = tuple((leaf.value if is_box(leaf) else leaf).shape)
        if is_box(leaf) and any(n is not None for n in leaf.names):
            spec = tuple(model.placement(tuple(leaf.names), rules))
        elif path_rules and shape:
            logical, direct = place_by_path(path_rules, path_text(key_path), shape)
            spec = direct if direct is not None else tuple(model.placement(logical, rules))
        else:
            continue
        specs[path_text(key_path)] = spec + (None,) * (len(shape) - len(spec))

    def reshard(value: Any, spec: Sequence[Any]) -> Any:
        return jax.sharding.reshard(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))

    def place(key_path: Any, leaf: Any) -> Any:
        spec = specs.get(path_text(key_path))
        if spec is None:
            return leaf
        return leaf.replace_boxed(reshard(leaf.value, spec)) if is_box(leaf) else reshard(leaf, spec)

    def slot(boxed: Any, leaf: Any) -> Any:
        if not isinstance(boxed, Slot):
            return leaf
        if any(n is not None for n in boxed.names):
            return boxed.replace_boxed(reshard(leaf, model.placement(tuple(boxed.names), rules)))
        param = specs.get(boxed.parameter)
        if param is None:
            return leaf
        return boxed.replace_boxed(reshard(leaf, [param[d] if d is not None else None for d in boxed.dims]))

    def init(p: Any) -> dict[str, Any]:
        placed = jax.tree_util.tree_map_with_path(place, p, is_leaf=is_box)
        opt_state = jax.tree.map(slot, template, tx.init(unbox(placed)), is_leaf=is_box)
        return {"step": jnp.zeros((), jnp.int32), "params": placed, "opt_state": opt_state}

    with jax.sharding.use_abstract_mesh(mesh):
        return jax.eval_shape(init, params)


def _linen_model(module: nn.Module, call: CallFn, fields: dict[str, jax.ShapeDtypeStruct] | None,
                 streams: tuple[str, ...]) -> Model:
    def abstract_params() -> Any:
        def init(key: jax.Array) -> Any:
            keys = {"params": key, **{s: jax.random.fold_in(key, i + 1) for i, s in enumerate(streams)}}
            variables = module.init(keys, init_batch(fields), keys, method=_call_method(call))
            return {name: variables[name] for name in ("params", AXES_COLLECTION) if name in variables}
        # the older flax API's `params_axes` (param_with_axes) boxes each parameter with its names
        return box_params_axes(jax.eval_shape(init, abstract_key()))["params"]

    def apply(params: Any, batch: dict[str, Any], rngs: dict[str, jax.Array]) -> Any:
        return module.apply({"params": params}, batch, rngs, rngs=rngs or None, method=_call_method(call))

    return Model("linen", abstract_params, apply)


def _call_method(call: CallFn) -> Callable[..., Any]:
    """`call` as a linen method: flax binds the module and passes it first."""
    def method(module: nn.Module, batch: dict[str, Any], rngs: dict[str, jax.Array]) -> Any:
        return call(module, batch, {k: v for k, v in rngs.items() if k != "params"})
    return method


def _concrete_placeholder(leaf: Any) -> Any:
    """A stand-in for a non-parameter NNX variable (RNG keys, counters) seen only while tracing."""
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jnp.zeros(leaf.shape + (2,), jnp.uint32))
    return jnp.zeros(leaf.shape, leaf.dtype)


def _nnx_model(abstract_module: Any, call: CallFn) -> Model:
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

    def apply(params: Any, batch: dict[str, Any], rngs: dict[str, jax.Array]) -> Any:
        values = []
        for path, var in flat:
            node = params
            for key in path:
                node = node[str(key)]
            values.append((path, var.replace(node)))
        rest_values = jax.tree.map(_concrete_placeholder, rest)
        module = nnx.merge(graphdef, nnx.from_flat_state(values), rest_values)
        return call(module, batch, rngs)

    return Model("nnx", abstract_params, apply)


def as_model(model: Any, call: CallFn | None = None, fields: dict[str, jax.ShapeDtypeStruct] | None = None,
             streams: tuple[str, ...] = (), *, built: Any = None) -> Model:
    """A linen module, an NNX module, or a zero-argument factory of either, as a :class:`Model`
    called by `call(module, batch, rng keys)` (default :func:`tokens_call`). `fields` shape the batch
    a linen module is initialised with, `streams` the RNG streams its init gets.

    An NNX factory is called under `nnx.eval_shape` (with eager sharding off), so even a 400B model
    allocates nothing; a linen module is inert until `init`. `built` is what the factory returned
    when the caller ran it already (see :func:`build_abstract`)."""
    call = call or tokens_call
    if built is None:
        built = model if isinstance(model, nn.Module) or _is_nnx_module(model) else build_abstract(model)
    if isinstance(built, nn.Module):
        return _linen_model(built, call, fields, streams)
    if _is_nnx_module(built):
        return _nnx_model(built, call)
    raise TypeError(f"{getattr(model, '__qualname__', model)!r} returned {type(built).__name__}, "
                    "not a Flax linen or NNX module")


def loaded_nnx() -> Any:
    """flax.nnx if anything has imported it, else None. No NNX object exists before that, so a linen
    model's dump need not import it (0.1 s of a cold start)."""
    return sys.modules.get("flax.nnx")


def _is_nnx_module(obj: Any) -> bool:
    nnx = loaded_nnx()
    return nnx is not None and isinstance(obj, nnx.Module)


def build_abstract(factory: Callable[[], Any]) -> Any:
    """What a zero-argument factory returns, built under `nnx.eval_shape` with eager sharding off: an
    NNX module comes back abstract (nothing allocated), anything else as the factory returned it."""
    from flax import nnx

    if not callable(factory):
        raise TypeError(f"{factory!r} is neither a Flax module nor a factory of one")
    other: list[Any] = []

    def build() -> Any:
        built = factory()
        if isinstance(built, nnx.Module):
            return built
        other.append(built)
        return None

    with nnx.use_eager_sharding(False):
        built = nnx.eval_shape(build)
    return other[0] if other else built


__all__ = ["Model", "abstract_train_state", "as_model", "build_abstract", "default_optimizer", "explicit_train_state",
           "parameter_count", "tokens_call", "unbox"]
