"""The abstract training state (params + optimizer state + step) and the layout of every leaf.

`jax.eval_shape` runs the model's `init` and the optimizer's without allocating or compiling
anything; every optimizer leaf takes the logical axes it derives from its parameter
(:mod:`sharding_dump.core.optimizer`). Two ways to get each leaf's physical layout on the case's mesh:

* auto (:func:`tensor_layouts`): the logical axes resolved by the rules;
* explicit (:func:`explicit_tensor_layouts`): the state traced again on an Explicit-axis mesh, the
  parameters placed by the rules, everything else left to JAX's sharding-in-types, and each leaf's
  sharding read from the traced output.

With ZeRO-1 (`shard_optimizer_over_data`), the optimizer state is also split over `data`
(:func:`over_data`), as MaxText does for every optimizer leaf.

>>> from sharding_dump.zoo import cards
>>> from sharding_dump.core.state import parameter_count
>>> state = abstract_state(cards.load_config("qwen3-0.6b"))
>>> parameter_count(state)
596049920
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump import models
from sharding_dump.core.layout import PartitionRuleError, TensorLayout, resolve, typed_layouts
from sharding_dump.core.layout import tensor_layouts as core_tensor_layouts
from sharding_dump.core.optimizer import Slot
from sharding_dump.core.specs import entry_axes
from sharding_dump.core.state import (
    abstract_key,
    abstract_train_state,
    as_model,
    default_optimizer,
)
from sharding_dump.core.tree import is_box, unbox
from sharding_dump.errors import BadInput
from sharding_dump.models.pipeline import PipelineConfig
from sharding_dump.zoo import cards, rules
from sharding_dump.zoo.mesh import MeshPlan

INIT_SHAPE = (1, 8)  # parameter shapes do not depend on the batch used to initialise
DATA_AXIS = "data"
TENSOR_AXIS = "tensor"  # ZeRO-1 never adds data to a dimension split over it


def abstract_params(cfg: models.ModelConfig, pipeline: PipelineConfig | None = None) -> Any:
    """The boxed abstract parameters of a zoo model alone (no optimizer traced): enough to count them."""
    return as_model(cards.build_model(cfg, pipeline)).abstract_params()


def abstract_state(cfg: models.ModelConfig, tx: optax.GradientTransformation | None = None,
                   pipeline: PipelineConfig | None = None) -> dict[str, Any]:
    """The boxed abstract state {'step', 'params', 'opt_state'} of a zoo model trained with `tx`
    (default: the core's AdamW), its layers pipelined by `pipeline`, via jax.eval_shape."""
    return abstract_train_state(abstract_params(cfg, pipeline), tx or default_optimizer())


def is_optimizer_leaf(path: str) -> bool:
    """True for a leaf of the optimizer state (`opt_state/...`): what ZeRO-1 splits over `data`, as
    MaxText adds `data` to every optimizer leaf (a scalar has no dimension to add it to)."""
    return path.startswith("opt_state/")


def over_data(spec: PartitionSpec, shape: Sequence[int], sizes: dict[str, int]) -> PartitionSpec:
    """ZeRO-1 as MaxText adds `data` to an optimizer leaf: `data` becomes the outermost mesh axis of the
    first dimension whose shard still splits evenly over it and whose axes do not include `tensor` (even
    a size-1 `tensor`), so each data-parallel replica keeps (and updates) a slice of the moments.
    Unchanged when `data` is already used or no dimension qualifies. A leaf whose layout does not
    split evenly is refused (BadInput), as MaxText cannot shard it."""
    entries = [spec[i] if i < len(spec) else None for i in range(len(shape))]
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        shards = math.prod(sizes[a] for a in entry_axes(entry))
        if size % shards:
            raise BadInput(f"shard_optimizer_over_data=true: a dimension of size {size} (shape {tuple(shape)}) "
                           f"does not split evenly over {'x'.join(entry_axes(entry))} ({shards} shards); ZeRO-1 "
                           f"needs even splits of the optimizer state")
    if any(DATA_AXIS in entry_axes(e) for e in entries):
        return spec
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        axes = entry_axes(entry)
        shard = size // math.prod(sizes[a] for a in axes)
        if shard % sizes[DATA_AXIS] == 0 and TENSOR_AXIS not in axes:
            entries[dim] = (DATA_AXIS,) + axes
            return PartitionSpec(*entries)
    return spec


def tensor_layouts(state: dict[str, Any], plan: MeshPlan, rule_set: rules.RuleSet,
                   optimizer_over_data: bool = False,
                   declared: Mapping[str, PartitionSpec] | None = None) -> list[TensorLayout]:
    """Every leaf's logical axes resolved to a NamedSharding on the plan's abstract mesh (the
    optimizer state also over `data` with `optimizer_over_data`); a leaf the program placed itself
    (`declared`, {path: spec}: a user's own init) keeps that spec."""
    sizes = plan.sizes

    def zero1(path: str, shape: tuple[int, ...], spec: PartitionSpec) -> PartitionSpec:
        return over_data(spec, shape, sizes) if is_optimizer_leaf(path) else spec

    try:
        return core_tensor_layouts(state, plan.abstract_mesh(), rule_set, zero1 if optimizer_over_data else None,
                                   declared)
    except PartitionRuleError as err:  # a rule file's partition rule that does not fit the model
        raise BadInput(str(err)) from None


def explicit_state(cfg: models.ModelConfig, plan: MeshPlan, rule_set: rules.RuleSet,
                   optimizer_over_data: bool = False, tx: optax.GradientTransformation | None = None,
                   pipeline: PipelineConfig | None = None) -> dict[str, Any]:
    """The boxed state traced on the plan's Explicit-axis abstract mesh: every leaf carries the sharding
    JAX gives it. Parameters are placed by the rules (`jax.sharding.reshard`: flax's init cannot run
    under an Explicit mesh), and so is every optimizer leaf that derives logical axes from its
    parameter, as a trainer places its state by its logical annotations (AdamW's moments already follow
    their parameter); ZeRO-1 then reshards the optimizer leaves over `data`."""
    model = cards.build_model(cfg, pipeline)
    tx = tx or default_optimizer()
    template = abstract_state(cfg, tx, pipeline)["opt_state"]  # every optimizer leaf's derived axes
    mesh = plan.abstract_mesh(explicit=True)

    def place(box: nn.Partitioned | jax.Array, over: bool = False) -> nn.Partitioned | jax.Array:
        if not is_box(box):  # a parameter without logical axes (Qwen3-Next's decay) stays replicated
            return box
        spec = resolve(box.names, rule_set)
        if over:
            spec = over_data(spec, box.value.shape, plan.sizes)
        return box.replace_boxed(jax.sharding.reshard(box.value, NamedSharding(mesh, spec)))

    def slot(boxed: Any, leaf: Any) -> Any:
        if not isinstance(boxed, Slot):
            return leaf
        return place(boxed.replace_boxed(leaf), optimizer_over_data)

    def init(key: jax.Array) -> dict[str, Any]:
        tokens = jnp.zeros(INIT_SHAPE, jnp.int32)
        params = jax.tree.map(place, model.init(key, tokens, tokens)["params"], is_leaf=is_box)
        opt_state = jax.tree.map(slot, template, tx.init(unbox(params)), is_leaf=is_box)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state}

    key = abstract_key()
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.eval_shape(init, key)


def explicit_tensor_layouts(cfg: models.ModelConfig, plan: MeshPlan, rule_set: rules.RuleSet,
                            optimizer_over_data: bool = False,
                            tx: optax.GradientTransformation | None = None,
                            pipeline: PipelineConfig | None = None) -> list[TensorLayout]:
    """Explicit mode: every leaf's PartitionSpec as read from :func:`explicit_state`'s outputs
    (a scalar JAX leaves unannotated is replicated)."""
    return typed_layouts(explicit_state(cfg, plan, rule_set, optimizer_over_data, tx, pipeline), plan.sizes)
