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

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump import models
from sharding_dump.core.layout import (  # noqa: F401  (the zoo's names for the core's layout pieces)
    TensorLayout,
    indivisible,
    is_box,
    leaves,
    path_text,
    per_device_totals,
    typed_layouts,
)
from sharding_dump.core.layout import tensor_layouts as core_tensor_layouts
from sharding_dump.core.state import (  # noqa: F401
    abstract_train_state,
    as_model,
    default_optimizer,
    parameter_count,
)
from sharding_dump.errors import BadInput
from sharding_dump.models.pipeline import PipelineConfig
from sharding_dump.zoo import rules
from sharding_dump.zoo.mesh import MeshPlan

INIT_SHAPE = (1, 8)  # parameter shapes do not depend on the batch used to initialise
MOMENTS = ("mu", "nu")  # AdamW's per-parameter slots, under opt_state/<index>/
DATA_AXIS = "data"
TENSOR_AXIS = "tensor"  # ZeRO-1 never adds data to a dimension split over it


def optimizer() -> optax.GradientTransformation:
    """The optimizer of every zoo case: the core's default AdamW."""
    return default_optimizer()


def abstract_state(cfg: models.ModelConfig, pipeline: PipelineConfig | None = None) -> dict[str, Any]:
    """The boxed abstract state {'step', 'params', 'opt_state'} of a zoo model, via jax.eval_shape."""
    return abstract_train_state(as_model(models.build_model(cfg, pipeline)).abstract_params(), optimizer())


def is_moment(path: str) -> bool:
    """True for an AdamW moment leaf: `opt_state/<index>/mu/...` or `.../nu/...`."""
    parts = path.split("/")
    return len(parts) > 3 and parts[0] == "opt_state" and parts[2] in MOMENTS


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
    """Auto mode: every leaf's logical axes resolved to a NamedSharding on the plan's abstract mesh
    (AdamW moments also over `data` with `optimizer_over_data`)."""
    sizes = plan.sizes

    def zero1(path: str, shape: tuple[int, ...], spec: PartitionSpec) -> PartitionSpec:
        return over_data(spec, shape, sizes) if is_moment(path) else spec

    return core_tensor_layouts(state, plan.abstract_mesh(), rule_set, zero1 if optimizer_over_data else None)


def explicit_state(cfg: models.ModelConfig, plan: MeshPlan, rule_set: rules.RuleSet,
                   optimizer_over_data: bool = False, pipeline: PipelineConfig | None = None) -> dict[str, Any]:
    """The boxed state traced on the plan's Explicit-axis abstract mesh: every leaf carries the sharding
    JAX gives it. Parameters are placed by the rules (`jax.sharding.reshard`: flax's init cannot run
    under an Explicit mesh); the optimizer state follows from them by sharding-in-types, except that
    ZeRO-1 reshards the moments over `data`."""
    model = models.build_model(cfg, pipeline)
    tx = optimizer()
    mesh = plan.abstract_mesh(explicit=True)

    def place(box: nn.Partitioned | jax.Array) -> nn.Partitioned | jax.Array:
        if not is_box(box):  # a parameter without logical axes (Qwen3-Next's decay) stays replicated
            return box
        spec = rules.to_mesh_axes(box.names, rule_set.logical_axis_rules)
        return box.replace_boxed(jax.sharding.reshard(box.value, NamedSharding(mesh, spec)))

    def moment_over_data(key_path: Any, leaf: Any) -> Any:
        if not (is_box(leaf) and is_moment(path_text(key_path))):
            return leaf
        value = leaf.value
        spec = over_data(jax.typeof(value).sharding.spec, value.shape, plan.sizes)
        return leaf.replace_boxed(jax.sharding.reshard(value, NamedSharding(mesh, spec)))

    def init(key: jax.Array) -> dict[str, Any]:
        tokens = jnp.zeros(INIT_SHAPE, jnp.int32)
        params = jax.tree.map(place, model.init(key, tokens, tokens)["params"], is_leaf=is_box)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
        if optimizer_over_data:
            state = jax.tree_util.tree_map_with_path(moment_over_data, state, is_leaf=is_box)
        return state

    key = jax.random.key(0)  # made outside the mesh: a concrete key needs no devices of it
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.eval_shape(init, key)


def explicit_tensor_layouts(cfg: models.ModelConfig, plan: MeshPlan, rule_set: rules.RuleSet,
                            optimizer_over_data: bool = False,
                            pipeline: PipelineConfig | None = None) -> list[TensorLayout]:
    """Explicit mode: every leaf's PartitionSpec as read from :func:`explicit_state`'s outputs
    (a scalar JAX leaves unannotated is replicated)."""
    return typed_layouts(explicit_state(cfg, plan, rule_set, optimizer_over_data, pipeline), plan.sizes)
