"""Where a program places its own state: the shardings its init declares, and the older flax
partitioning API's `params_axes` collection.

A program may place its weights itself rather than name their logical axes in flax boxes:

* in the output's *type* (sharding in types): `jax.jit(init, out_shardings=...)`, `jax.device_put`,
  `jax.sharding.reshard` or `jax.lax.with_sharding_constraint` on what init returns. On an Explicit
  mesh JAX carries the sharding in the output's type; on an Auto mesh the traced init still holds
  what the program declared. :func:`declared_specs` reads both from init's jaxpr, so a program that
  shards a weight can never have it dumped whole.
* in the `params_axes` collection of `flax.linen.partitioning.param_with_axes` (t5x, flaxformer):
  one `AxisMetadata(names)` per parameter beside the `params` collection. :func:`box_params_axes`
  boxes each parameter with its names (:class:`AxesBox`), so the rule file's logical rules place it
  and its optimizer slots as they place a linen box, and the dump can say where it came from.

Each leaf's layout names its source (:data:`SOURCES`): `type`, `box`, `params_axes`, `regex` or `none`.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
>>> mesh = AbstractMesh((2,), ("x",), axis_types=(AxisType.Auto,))
>>> def init():
...     shard = NamedSharding(jax.sharding.get_abstract_mesh(), P("x"))
...     return jax.jit(lambda: {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}, out_shardings={"w": shard, "b": None})()
>>> with jax.sharding.use_abstract_mesh(mesh):
...     [spec if spec is None else tuple(spec) for spec in declared_specs(jax.make_jaxpr(init)())]
[None, ('x',)]
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump.core.handback import producer_spec
from sharding_dump.errors import BadInput, shown

SOURCES = ("type", "box", "params_axes", "regex", "none")  # where a leaf's spec came from, by precedence
AXES_COLLECTION = "params_axes"  # flax.linen.partitioning's collection of per-parameter axis names


class AxesBox(nn.Partitioned):
    """A parameter boxed with the names its `params_axes` entry gives it (the older flax API)."""


def _sharded(spec: Any) -> PartitionSpec | None:
    """The spec when it splits anything (an all-None or empty spec places nothing)."""
    return spec if spec is not None and any(entry is not None for entry in spec) else None


def _named(sharding: Any) -> PartitionSpec | None:
    return _sharded(sharding.spec) if isinstance(sharding, NamedSharding) else None


def declared_specs(closed: Any) -> list[PartitionSpec | None]:
    """Per output of a traced init (a ClosedJaxpr), the spec the program gives it: what the equation
    producing it declares (a jit's `out_shardings`, a constraint, a `reshard` or `device_put`,
    replicated included), else the sharding in its type when that splits it (Explicit mesh), else
    None."""
    out: list[PartitionSpec | None] = []
    made: dict[int, dict[int, tuple[Any, int]]] = {}
    for var in closed.jaxpr.outvars:
        if isinstance(var, jax.extend.core.Literal):
            out.append(None)
            continue
        declared = producer_spec(closed.jaxpr, var, made)
        out.append(declared if declared is not None else _named(getattr(var.aval, "sharding", None)))
    return out


def _named_array(node: Any) -> bool:
    """A named array (haliax's `NamedArray`): an `array` and its `axis_names`, one name per dimension."""
    names, array = getattr(node, "axis_names", None), getattr(node, "array", None)
    return (isinstance(names, tuple) and all(isinstance(name, str) for name in names)
            and len(names) == len(getattr(array, "shape", (None,) * (len(names) + 1))))


def box_named_arrays(state: Any) -> Any:
    """The state with the array of every named array boxed with its axis names, at the array's own
    path: a program's named axes are logical axes (the rule file's logical rules place the array where
    the program did not place it itself)."""

    def box(node: Any) -> Any:
        if not _named_array(node):
            return node
        children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda child: child is not node)
        if len(children) != 1:  # the array is the node's one child (its names are static)
            return node
        return treedef.unflatten([nn.Partitioned(children[0], names=tuple(node.axis_names))])

    return jax.tree.map(box, state, is_leaf=lambda node: _named_array(node) or isinstance(node, nn.Partitioned))


def placed_outputs(shapes: Any, specs: list[PartitionSpec | None], mesh: Any) -> tuple[Any, dict[str, PartitionSpec]]:
    """The abstract outputs of init (a pytree of ShapeDtypeStructs) with each declared spec in its
    leaf's type, as a trainer's state holds it after its jitted init, and {leaf path: declared spec}
    (every spec on `mesh`: :func:`sharding_dump.core.handback.check_mesh` refused any other first)."""
    from sharding_dump.core.tree import path_text

    flat, _ = jax.tree_util.tree_flatten_with_path(shapes)
    _check_paths([path_text(key_path) for key_path, _ in flat])
    declared = {path_text(key_path): spec for (key_path, _), spec in zip(flat, specs) if spec is not None}
    return placed(shapes, declared, mesh), declared


def _check_paths(paths: list[str]) -> None:
    """Each leaf of init's state is one golden path: a key that is empty, or that joins with '/' into
    another leaf's path, would be written under a path no leaf or a second leaf has."""
    seen: set[str] = set()
    for path in paths:
        if path == "" or "" in path.split("/"):
            raise BadInput(f"init returned a state with a leaf at {shown(path)}, a path with an empty name; "
                           "give every leaf a non-empty key (a mapping of names, e.g. {'params': ...})")
        if path in seen:
            raise BadInput(f"init returned two leaves at {shown(path)} (a key holding '/' repeats another "
                           "leaf's path); give each leaf a path of its own")
        seen.add(path)


def placed(state: Any, specs: Mapping[str, PartitionSpec], mesh: Any) -> Any:
    """`state` (abstract, boxed or not) with every leaf named in `specs` ({path: spec}) carrying that
    sharding in its type on `mesh`."""
    from sharding_dump.core.tree import path_text

    def typed(key_path: Any, leaf: Any) -> Any:
        spec = specs.get(path_text(key_path))
        if spec is None or not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec), weak_type=leaf.weak_type)

    return jax.tree_util.tree_map_with_path(typed, state, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def box_params_axes(variables: Any) -> Any:
    """Every Mapping in `variables` that holds both `params` and `params_axes` (flax variables, or a
    state keeping them side by side) with each parameter boxed as an :class:`AxesBox` of its names, a
    state object holding `params_axes` as an attribute (t5x's) boxed by it too; anything else as it was
    (the very object, when nothing holds `params_axes`)."""
    from flax.core import unfreeze
    from flax.linen import partitioning

    if not isinstance(variables, Mapping):
        return _box_by_axes_attribute(variables)
    items = dict(variables)
    if "params" in items and AXES_COLLECTION in items:
        names = partitioning.get_axis_names(unfreeze(items[AXES_COLLECTION]))
        items["params"] = _boxed(unfreeze(items["params"]), unfreeze(names))
        return items
    boxed = {key: box_params_axes(value) for key, value in items.items()}
    return boxed if any(boxed[key] is not items[key] for key in items) else variables


def _box_by_axes_attribute(state: Any) -> Any:
    """A train state object keeping its parameters' `params_axes` as an attribute (t5x's
    FlaxOptimTrainState: the parameters at `_optimizer/target/...`, their moments in its optimizer
    state) with every array whose path ends in a parameter's path, at its rank, boxed with its names:
    t5x's own `as_logical_axes()` gives a parameter's moments its names too. Else `state` as it was."""
    from flax.core import unfreeze
    from flax.linen import partitioning
    from flax.traverse_util import flatten_dict

    from sharding_dump.core.tree import is_box, path_text

    axes = getattr(state, AXES_COLLECTION, None)
    if not isinstance(axes, Mapping) or not axes:
        return state
    names = {"/".join(key): tuple(spec) for key, spec in
             flatten_dict(unfreeze(partitioning.get_axis_names(unfreeze(axes)))).items()}

    def box(key_path: Any, leaf: Any) -> Any:
        if is_box(leaf) or not hasattr(leaf, "shape"):
            return leaf
        parts = path_text(key_path).split("/")
        found = next((names[key] for key in ("/".join(parts[i:]) for i in range(len(parts))) if key in names), None)
        return AxesBox(leaf, names=found) if found is not None and len(found) == len(leaf.shape) else leaf

    return jax.tree_util.tree_map_with_path(box, state, is_leaf=is_box)


def _boxed(params: Any, names: Any) -> Any:
    if isinstance(params, Mapping):
        return {key: _boxed(value, names.get(key) if isinstance(names, Mapping) else None)
                for key, value in params.items()}
    if isinstance(names, PartitionSpec) and not isinstance(params, nn.Partitioned):
        return AxesBox(params, names=tuple(names))
    return params


def source_of(leaf: Any) -> str:
    """`params_axes` for a parameter boxed from that collection, `box` for any other box."""
    return "params_axes" if isinstance(leaf, AxesBox) else "box"
