"""The abstract training state (params + AdamW state + step) and the layout of every leaf.

`jax.eval_shape` runs the model's `init` and `optax.adamw(...).init` without allocating or compiling
anything; flax's partition boxes survive into the optimizer moments, so every leaf keeps its logical
axes. :func:`tensor_layouts` resolves them to physical PartitionSpecs on the case's mesh.

>>> from sharding_dump import models
>>> state = abstract_state(models.load_config("qwen3-0.6b"))
>>> parameter_count(state)
596049920
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump import models, rules
from sharding_dump.mesh import MeshPlan

INIT_SHAPE = (1, 8)  # parameter shapes do not depend on the batch used to initialise


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

    def shards(self, dim: int) -> int:
        """How many pieces dimension `dim` is split into."""
        entry = self.partition_spec[dim] if dim < len(self.partition_spec) else None
        axes = (entry,) if isinstance(entry, str) else (entry or ())
        return math.prod(self.mesh_sizes[a] for a in axes)


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


def leaves(state: dict[str, Any]) -> list[tuple[str, jax.ShapeDtypeStruct, tuple[str | None, ...]]]:
    """(path, abstract array, logical axes) for every leaf, paths '/'-joined, in path order."""
    out = []
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_box):
        path = "/".join(_key_text(k) for k in key_path if not isinstance(k, jax.tree_util.GetAttrKey)
                        or k.name not in ("value",))
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


def tensor_layouts(state: dict[str, Any], plan: MeshPlan, rule_set: rules.RuleSet) -> list[TensorLayout]:
    """Resolves every leaf's logical axes to a NamedSharding on the plan's abstract mesh."""
    mesh = plan.abstract_mesh()
    sizes = plan.sizes
    out = []
    for path, array, logical in leaves(state):
        spec = rules.to_mesh_axes(logical, rule_set.logical_axis_rules)
        sharding = NamedSharding(mesh, spec)
        out.append(TensorLayout(path, tuple(array.shape), jnp.dtype(array.dtype).name, logical,
                                sharding.spec, sizes))
    return out
