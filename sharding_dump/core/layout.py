"""The layout of every leaf of a state on a mesh: shape, dtype, logical axes, partition spec,
per-device shape and bytes.

:func:`leaf_layout` lays out one leaf; :func:`tensor_layouts` maps it over a state tree whose leaves
carry their logical axes (flax `Partitioned` boxes, as linen's `with_logical_partitioning` and
:func:`sharding_dump.core.state.abstract_train_state` leave them).

>>> import jax, flax.linen as nn
>>> from jax.sharding import AbstractMesh
>>> mesh = AbstractMesh((4, 2), ("fsdp", "tensor"))
>>> rules = [("embed", "fsdp"), ("mlp", "tensor")]
>>> leaf = nn.Partitioned(jax.ShapeDtypeStruct((1024, 4096), "float32"), names=("embed", "mlp"))
>>> (t,) = tensor_layouts({"w": leaf}, mesh, rules)
>>> t.path, t.partition_spec, t.per_device_shape, t.per_device_bytes
('w', P('fsdp', 'tensor'), (256, 2048), 2097152)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump.core import specs
from sharding_dump.core.specs import PathRule, match_path_rule
from sharding_dump.core.tree import is_box, path_text

LogicalAxes = tuple[str | None, ...]
# A hook that may change a leaf's resolved spec (e.g. ZeRO-1 adds `data` to optimizer moments).
SpecTransform = Callable[[str, tuple[int, ...], PartitionSpec], PartitionSpec]


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """One leaf: logical and physical layout, and what one device holds of it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_axes: LogicalAxes
    partition_spec: PartitionSpec
    mesh_sizes: Mapping[str, int]
    source: str = "none"  # where the spec came from (core.placement.SOURCES); not written to goldens

    @property
    def per_device_shape(self) -> tuple[int, ...]:
        """Each dim divided by the product of its mesh axes (rounded up: XLA pads a ragged split)."""
        return tuple(-(-dim // self.shards(i)) for i, dim in enumerate(self.shape))

    @property
    def per_device_bytes(self) -> int:
        """Bytes of the largest shard: what every device holds of this leaf (padding included)."""
        return math.prod(self.per_device_shape) * specs.itemsize(self.dtype)

    @property
    def group(self) -> str:
        """The top-level part of the state the leaf belongs to (params, opt_state, step...)."""
        return self.path.split("/", 1)[0]

    def axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes dimension `dim` is split over (size-1 axes included)."""
        return specs.spec_axes(self.partition_spec, len(self.shape))[dim]

    def shards(self, dim: int) -> int:
        """How many pieces dimension `dim` is split into."""
        return math.prod(self.mesh_sizes[a] for a in self.axes(dim))


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """{axis name: size} of a `Mesh` or `AbstractMesh`."""
    return dict(mesh.shape)


def rules_of(rules: Any) -> tuple[tuple[str, Any], ...]:
    """Logical axis rules as flax wants them: pairs of (logical name, mesh axis | tuple | None).
    Takes a sequence of pairs (lists from YAML are fine) or anything with `logical_axis_rules`."""
    pairs = getattr(rules, "logical_axis_rules", rules)
    return tuple((name, specs.rule_axes(axes)) for name, axes in pairs)


def resolve(logical_axes: Sequence[str | None], rules: Any) -> PartitionSpec:
    """The physical PartitionSpec of one logical spec, by flax's own resolver.

    >>> resolve(("embed", "mlp"), [("embed", "fsdp"), ("mlp", ("fsdp", "tensor"))])
    P('fsdp', None)
    """
    return nn.logical_to_mesh_axes(tuple(logical_axes), rules_of(rules))


def leaves(state: Any) -> list[tuple[str, Any, LogicalAxes]]:
    """(path, abstract array, logical axes) for every leaf, in path order (an unboxed leaf has no
    logical axes: `()`, which MaxText's logical dump writes `[]`, where a box of unnamed dimensions
    writes one null per dimension)."""
    out = []
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_box):
        if is_box(leaf):
            array, logical = leaf.value, tuple(leaf.names)
        else:
            array, logical = leaf, ()
        out.append((path_text(key_path), array, logical))
    return sorted(out, key=lambda item: item[0])


def dtype_name(dtype: Any) -> str:
    """The name a golden gives a leaf's dtype: numpy's (`float32`, `bfloat16`), or JAX's for an extended
    dtype (a typed PRNG key, `jax.random.key`: `key<fry>`), whose bytes are those of its underlying data."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        specs.note_itemsize(str(dtype), int(dtype.itemsize))
        return str(dtype)
    return jax.numpy.dtype(dtype).name


def leaf_layout(path: str, array: Any, logical_axes: Sequence[str | None], mesh: Any, rules: Any,
                transform: SpecTransform | None = None, spec: Sequence[Any] | None = None,
                source: str = "none") -> TensorLayout:
    """The layout of one leaf: its logical axes resolved by `rules` on `mesh`, or `spec` (mesh axes
    per dimension) when given; `source` says where they came from (core.placement.SOURCES)."""
    shape = tuple(int(d) for d in array.shape)
    spec = resolve(logical_axes, rules) if spec is None else PartitionSpec(*spec)
    if transform is not None:
        spec = transform(path, shape, spec)
    spec = NamedSharding(mesh, spec).spec  # the spec exactly as a NamedSharding on this mesh holds it
    return TensorLayout(path, shape, dtype_name(array.dtype), tuple(logical_axes), spec,
                        mesh_sizes(mesh), source)


class PartitionRuleError(ValueError):
    """A path rule that cannot place the parameter it matches (more entries than dimensions)."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical axis rules and path rules together, for the core API (a rule file's RuleSet has both).

    >>> from jax.sharding import PartitionSpec as P
    >>> rules = Rules([("embed", "fsdp")], [("attention/w[qkv]/kernel", P("fsdp", "tensor")), (".*", P())])
    >>> path_rules_of(rules)[0].spec
    ('fsdp', 'tensor')
    """

    logical_axis_rules: Sequence[tuple[str, Any]] = ()
    partition_rules: Sequence[Any] = ()  # PathRule, or (regex, PartitionSpec) pairs


def path_rules_of(rules: Any) -> tuple[PathRule, ...]:
    """The path rules of a rule set (its `partition_rules`: PathRules or `(regex, PartitionSpec)` pairs)."""
    return tuple(r if isinstance(r, PathRule) else PathRule(r[0], tuple(r[1]))
                 for r in getattr(rules, "partition_rules", ()))


def place_by_path(path_rules: Sequence[PathRule], key: str, shape: tuple[int, ...]) -> tuple[LogicalAxes, tuple | None]:
    """(logical axes, mesh spec or None) of a parameter without logical axes, by the first path rule."""
    index = match_path_rule(path_rules, key) if shape else None
    if index is None:
        return (), None
    rule = path_rules[index]
    if len(rule.entries) > len(shape):
        raise PartitionRuleError(f"partition rule {rule.where or repr(rule.pattern)} ({rule.pattern!r}): "
                       f"{len(rule.entries)} entries for parameter {key} of rank {len(shape)} {shape}; give at "
                       f"most {len(shape)} (a regex that matches it less widely, or a rule before it)")
    pad = (None,) * (len(shape) - len(rule.entries))
    if rule.logical is not None:
        return tuple(rule.logical) + pad, None
    return (None,) * len(shape), tuple(rule.spec or ()) + pad


def tensor_layouts(state: Any, mesh: Any, rules: Any, transform: SpecTransform | None = None,
                   declared: Mapping[str, PartitionSpec] | None = None) -> list[TensorLayout]:
    """The layout of every leaf of `state` (a pytree of abstract arrays, boxed with logical axes).

    A parameter without logical axes is placed by the rules' path rules (:class:`PathRule`), if any,
    and the optimizer leaves derived from it (:class:`sharding_dump.core.optimizer.Slot`) follow it.
    `declared` ({leaf path: spec}) holds what the program placed itself
    (:mod:`sharding_dump.core.placement`): those leaves keep that spec before anything else, and
    their slots follow it. Each layout names its source."""
    from sharding_dump.core.optimizer import Slot
    from sharding_dump.core.placement import source_of

    path_rules = path_rules_of(rules)
    boxed = sorted(((path_text(k), leaf) for k, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_box)),
                   key=lambda item: item[0])
    prefix = next((f"{k}/" for k in specs.PARAMETER_PARTS if isinstance(state, Mapping) and k in state), "")
    placed: dict[str, tuple[LogicalAxes, tuple | None, str]] = {}  # parameter key -> (logical, mesh spec, source)

    def own(path: str, leaf: Any) -> tuple[LogicalAxes, tuple | None, str]:
        array = leaf.value if is_box(leaf) else leaf
        logical = tuple(leaf.names) if is_box(leaf) else ()
        spec = (declared or {}).get(path)
        if spec is not None:
            return logical, tuple(spec) + (None,) * (len(array.shape) - len(spec)), "type"
        return logical, None, source_of(leaf) if any(n is not None for n in logical) else "none"

    for path, leaf in boxed:
        if isinstance(leaf, Slot) or not path.startswith(prefix):
            continue
        logical, spec, source = own(path, leaf)
        if source == "none" and path_rules:
            array = leaf.value if is_box(leaf) else leaf
            logical, spec = place_by_path(path_rules, path[len(prefix):], tuple(array.shape))
            if spec is not None or any(n is not None for n in logical):
                source = "regex"
        placed[path[len(prefix):]] = (logical, spec, source)
    out = []
    for path, leaf in boxed:
        array = leaf.value if is_box(leaf) else leaf
        if isinstance(leaf, Slot):
            logical, spec, source = own(path, leaf)
            param_logical, param_spec, param_source = placed.get(leaf.parameter, (None, None, "none"))
            if source == "type" or (source == "box" and param_spec is None):
                source = param_source if source == "box" else source
            elif param_logical or param_spec is not None:  # placed by a path rule or by its type
                logical = tuple(param_logical[d] if d is not None else None for d in leaf.dims) if param_logical else ()
                if param_spec is not None:
                    spec = tuple(param_spec[d] if d is not None else None for d in leaf.dims)
                source = param_source  # the weight's, replicated by its program's own say too
        elif path.startswith(prefix):
            logical, spec, source = placed[path[len(prefix):]]
        else:
            logical, spec, source = own(path, leaf)
        out.append(leaf_layout(path, array, logical, mesh, rules, transform, spec, source))
    return out


def typed_layouts(state: Any, sizes: Mapping[str, int], rules: Any = None) -> list[TensorLayout]:
    """The layout of every leaf of a state traced on an Explicit-axis mesh, read from the sharding
    each leaf carries in its type (a leaf without one, e.g. a scalar JAX leaves unannotated, is
    replicated); logical axes from the boxes as :func:`leaves` reads them. The harness placed the
    state by its boxes and the path rules of `rules`, so a leaf's source is its box's (`box`,
    `params_axes`), else `regex` when a path rule matches its parameter, else its type's."""
    from sharding_dump.core.optimizer import Slot
    from sharding_dump.core.placement import source_of

    path_rules = path_rules_of(rules) if rules is not None else ()
    out = []
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_box):
        array = leaf.value if is_box(leaf) else leaf
        logical = tuple(leaf.names) if is_box(leaf) else ()
        sharding = getattr(array, "sharding", None)
        spec = sharding.spec if sharding is not None else PartitionSpec()
        path = path_text(key_path)
        part = path.split("/", 1)[0]
        parameter = leaf.parameter if isinstance(leaf, Slot) else path[len(part) + 1:] if \
            part in specs.PARAMETER_PARTS else None
        source = source_of(leaf) if any(n is not None for n in logical) else \
            "none" if not any(e is not None for e in spec) else \
            "regex" if parameter and match_path_rule(path_rules, parameter) is not None else "type"
        out.append(TensorLayout(path, tuple(array.shape), dtype_name(array.dtype), logical,
                                spec, dict(sizes), source))
    return sorted(out, key=lambda t: t.path)


def per_device_totals(layouts: Sequence[TensorLayout]) -> dict[str, int]:
    """Bytes each device holds per top-level group of the state, and their `total`."""
    totals: dict[str, int] = {}
    for t in layouts:
        totals[t.group] = totals.get(t.group, 0) + t.per_device_bytes
    totals["total"] = sum(totals.values())
    return dict(sorted(totals.items()))


def indivisible(layouts: Sequence[TensorLayout]) -> list[tuple[TensorLayout, int]]:
    """(leaf, dimension) pairs whose size does not split evenly over the dimension's mesh axes."""
    return [(t, dim) for t in layouts for dim, size in enumerate(t.shape) if size % t.shards(dim)]
