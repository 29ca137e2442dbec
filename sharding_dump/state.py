"""The abstract training state (params + AdamW state + step) and the layout of every leaf.

`jax.eval_shape` runs the model's `init` and `optax.adamw(...).init` without allocating or compiling
anything; flax's partition boxes survive into the optimizer moments, so every leaf keeps its logical
axes. Two ways to get each leaf's physical layout on the case's mesh:

* auto (:func:`tensor_layouts`): the logical axes resolved by the rules;
* explicit (:func:`explicit_tensor_layouts`): the state traced again on an Explicit-axis mesh, the
  parameters placed by the rules, everything else left to JAX's sharding-in-types, and each leaf's
  sharding read from the traced output.

With ZeRO-1 (`shard_optimizer_over_data`), AdamW's moments are also split over `data`
(:func:`over_data`).

>>> from sharding_dump import models
>>> state = abstract_state(models.load_config("qwen3-0.6b"))
>>> parameter_count(state)
596049920
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump import models, rules
from sharding_dump.errors import BadInput
from sharding_dump.mesh import MeshPlan

INIT_SHAPE = (1, 8)  # parameter shapes do not depend on the batch used to initialise
MOMENTS = ("mu", "nu")  # AdamW's per-parameter slots, under opt_state/<index>/
DATA_AXIS = "data"
TENSOR_AXIS = "tensor"  # ZeRO-1 never adds data to a dimension split over it


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """One leaf of the training state: logical and physical layout."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...]
    partition_spec: PartitionSpec
    mesh_sizes: dict[str, int]

    @property
    def per_device_shape(self) -> tuple[int, ...]:
        """Each dim divided by the product of its mesh axes (rounded up: XLA pads a ragged split)."""
        return tuple(-(-dim // self.shards(i)) for i, dim in enumerate(self.shape))

    @property
    def per_device_bytes(self) -> int:
        """Bytes of the largest shard: what every device holds of this leaf (padding included)."""
        return math.prod(self.per_device_shape) * jnp.dtype(self.dtype).itemsize

    @property
    def group(self) -> str:
        """The top-level part of the state the leaf belongs to: params, opt_state or step."""
        return self.path.split("/", 1)[0]

    def axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes dimension `dim` is split over (size-1 axes included)."""
        return rules.axes_of(self.partition_spec[dim] if dim < len(self.partition_spec) else None)

    def shards(self, dim: int) -> int:
        """How many pieces dimension `dim` is split into."""
        return math.prod(self.mesh_sizes[a] for a in self.axes(dim))


def optimizer() -> optax.GradientTransformation:
    """AdamW with a learning-rate schedule, as trainers configure it (the schedule adds a count)."""
    return optax.adamw(optax.constant_schedule(1e-4), b1=0.9, b2=0.95, weight_decay=0.1)


def abstract_state(cfg: models.ModelConfig) -> dict[str, Any]:
    """The boxed abstract state {'step', 'params', 'opt_state'} of a model, via jax.eval_shape."""
    model = models.build_model(cfg)
    tx = optimizer()

    def init(key: jax.Array) -> dict[str, Any]:
        tokens = jnp.zeros(INIT_SHAPE, jnp.int32)
        params = model.init(key, tokens, tokens)["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    return jax.eval_shape(init, jax.random.key(0))


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def _key_text(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    raise TypeError(f"unexpected pytree key {entry!r}")


def path_text(key_path: Sequence[Any]) -> str:
    """A pytree key path as the '/'-joined path the goldens use (a box's `value` is not a level)."""
    return "/".join(_key_text(k) for k in key_path if not isinstance(k, jax.tree_util.GetAttrKey)
                    or k.name not in ("value",))


def is_moment(path: str) -> bool:
    """True for an AdamW moment leaf: `opt_state/<index>/mu/...` or `.../nu/...`."""
    parts = path.split("/")
    return len(parts) > 3 and parts[0] == "opt_state" and parts[2] in MOMENTS


def leaves(state: dict[str, Any]) -> list[tuple[str, jax.ShapeDtypeStruct, tuple[str | None, ...]]]:
    """(path, abstract array, logical axes) for every leaf, paths '/'-joined, in path order."""
    out = []
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_box):
        path = path_text(key_path)
        if _is_box(leaf):
            array, logical = leaf.value, tuple(leaf.names)
        else:
            array, logical = leaf, (None,) * len(leaf.shape)
        out.append((path, array, logical))
    return sorted(out, key=lambda item: item[0])


def parameter_count(state: dict[str, Any]) -> int:
    """Sum of the sizes of every parameter leaf."""
    return sum(math.prod(a.shape) for p, a, _ in leaves(state) if p.startswith("params/"))


def per_device_totals(layouts: list[TensorLayout]) -> dict[str, int]:
    """Bytes each device holds per top-level group of the state, and their `total`."""
    totals: dict[str, int] = {}
    for t in layouts:
        totals[t.group] = totals.get(t.group, 0) + t.per_device_bytes
    totals["total"] = sum(totals.values())
    return dict(sorted(totals.items()))


def over_data(spec: PartitionSpec, shape: Sequence[int], sizes: dict[str, int]) -> PartitionSpec:
    """ZeRO-1 as MaxText adds `data` to an optimizer leaf: `data` becomes the outermost mesh axis of the
    first dimension whose shard still splits evenly over it and whose axes do not include `tensor` (even
    a size-1 `tensor`), so each data-parallel replica keeps (and updates) a slice of the moments.
    Unchanged when `data` is already used or no dimension qualifies. A leaf whose layout does not
    split evenly is refused (BadInput), as MaxText cannot shard it."""
    entries = [spec[i] if i < len(spec) else None for i in range(len(shape))]
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        shards = math.prod(sizes[a] for a in rules.axes_of(entry))
        if size % shards:
            raise BadInput(f"shard_optimizer_over_data=true: a dimension of size {size} (shape {tuple(shape)}) "
                           f"does not split evenly over {'x'.join(rules.axes_of(entry))} ({shards} shards); ZeRO-1 "
                           f"needs even splits of the optimizer state")
    if any(DATA_AXIS in rules.axes_of(e) for e in entries):
        return spec
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        axes = rules.axes_of(entry)
        shard = size // math.prod(sizes[a] for a in axes)
        if shard % sizes[DATA_AXIS] == 0 and TENSOR_AXIS not in axes:
            entries[dim] = (DATA_AXIS,) + axes
            return PartitionSpec(*entries)
    return spec


def tensor_layouts(state: dict[str, Any], plan: MeshPlan, rule_set: rules.RuleSet,
                   optimizer_over_data: bool = False) -> list[TensorLayout]:
    """Auto mode: resolves every leaf's logical axes to a NamedSharding on the plan's abstract mesh
    (AdamW moments also over `data` with `optimizer_over_data`)."""
    mesh = plan.abstract_mesh()
    sizes = plan.sizes
    out = []
    for path, array, logical in leaves(state):
        spec = rules.to_mesh_axes(logical, rule_set.logical_axis_rules)
        if optimizer_over_data and is_moment(path):
            spec = over_data(spec, array.shape, sizes)
        sharding = NamedSharding(mesh, spec)
        out.append(TensorLayout(path, tuple(array.shape), jnp.dtype(array.dtype).name, logical,
                                sharding.spec, sizes))
    return out


def explicit_state(cfg: models.ModelConfig, plan: MeshPlan, rule_set: rules.RuleSet,
                   optimizer_over_data: bool = False) -> dict[str, Any]:
    """The boxed state traced on the plan's Explicit-axis abstract mesh: every leaf carries the sharding
    JAX gives it. Parameters are placed by the rules (`jax.sharding.reshard`: flax's init cannot run
    under an Explicit mesh); the optimizer state follows from them by sharding-in-types, except that
    ZeRO-1 reshards the moments over `data`."""
    model = models.build_model(cfg)
    tx = optimizer()
    mesh = plan.abstract_mesh(explicit=True)

    def place(box: nn.Partitioned) -> nn.Partitioned:
        spec = rules.to_mesh_axes(box.names, rule_set.logical_axis_rules)
        return box.replace_boxed(jax.sharding.reshard(box.value, NamedSharding(mesh, spec)))

    def moment_over_data(key_path: Any, leaf: Any) -> Any:
        if not (_is_box(leaf) and is_moment(path_text(key_path))):
            return leaf
        value = leaf.value
        spec = over_data(jax.typeof(value).sharding.spec, value.shape, plan.sizes)
        return leaf.replace_boxed(jax.sharding.reshard(value, NamedSharding(mesh, spec)))

    def init(key: jax.Array) -> dict[str, Any]:
        tokens = jnp.zeros(INIT_SHAPE, jnp.int32)
        params = jax.tree.map(place, model.init(key, tokens, tokens)["params"], is_leaf=_is_box)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
        if optimizer_over_data:
            state = jax.tree_util.tree_map_with_path(moment_over_data, state, is_leaf=_is_box)
        return state

    key = jax.random.key(0)  # made outside the mesh: a concrete key needs no devices of it
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.eval_shape(init, key)


def explicit_tensor_layouts(cfg: models.ModelConfig, plan: MeshPlan, rule_set: rules.RuleSet,
                            optimizer_over_data: bool = False) -> list[TensorLayout]:
    """Explicit mode: every leaf's PartitionSpec as read from :func:`explicit_state`'s outputs
    (a scalar JAX leaves unannotated is replicated)."""
    out = []
    for path, array, logical in leaves(explicit_state(cfg, plan, rule_set, optimizer_over_data)):
        spec = array.sharding.spec if array.sharding is not None else PartitionSpec()
        out.append(TensorLayout(path, tuple(array.shape), jnp.dtype(array.dtype).name, logical,
                                spec, plan.sizes))
    return out


def indivisible(layouts: Sequence[TensorLayout]) -> list[tuple[TensorLayout, int]]:
    """(leaf, dimension) pairs whose size does not split evenly over the dimension's mesh axes."""
    return [(t, dim) for t in layouts for dim, size in enumerate(t.shape) if size % t.shards(dim)]
