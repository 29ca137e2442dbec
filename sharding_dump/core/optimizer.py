"""Optimizer state of any optax optimizer, every leaf traced back to the parameter it belongs to.

The state is built over the raw parameters, as a trainer builds it. Each leaf is then matched to its
parameter *structurally*: its path holds the parameter's path (optax mirrors the parameter tree under
`mu`, `v_row`, `acc_grads`, `inner_states/...`), and its shape is the parameter's with some
dimensions dropped, so each of its dimensions is one of the parameter's:

* same shape (AdamW's mu/nu, Lion's mu, a `MultiSteps` accumulator): the parameter's axes;
* a factored moment (Adafactor's `v_row` / `v_col`, SM3's per-dimension accumulators): the axes of
  the dimensions it keeps, so an `[embed, mlp]` kernel's `v_row` is `[embed]` and its `v_col` `[mlp]`;
* a scalar (counts, step sizes), a placeholder of size 1, or a shape no parameter explains: no axes.

When the shape alone cannot tell (a factored moment of a square kernel: `(4096,)` may keep either
dimension), the optimizer's own update is traced once on a probe mesh that puts each parameter
dimension on an axis of its own (sizes 1, Explicit axis types): the sharding JAX gives each new
state leaf names the dimensions it came from. Each matched leaf is boxed as a :class:`Slot`, a
flax `Partitioned` with the derived logical axes, its parameter's path and the dimension map.

>>> import jax, optax, flax.linen as nn
>>> params = {"w": nn.Partitioned(jax.ShapeDtypeStruct((512, 2048), "float32"), names=("embed", "mlp"))}
>>> state = optimizer_state(optax.adafactor(1e-3), params)
>>> [(k, s.names) for k, s in sorted(slots(state).items())]
[('0/v/w', (None,)), ('0/v_col/w', ('mlp',)), ('0/v_row/w', ('embed',))]
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import flax.linen as nn
import jax
from flax import struct
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from sharding_dump.core.tree import is_box, path_text, unbox

DimMap = tuple[int | None, ...]  # per leaf dimension: the parameter dimension it is, or None
_PROBE_AXIS = "sharding_dump_dim"


class OptimizerAxesWarning(UserWarning):
    """An optimizer leaf whose dimensions could come from more than one dimension of its parameter,
    and whose update did not tell which: it is written with no logical axes (replicated)."""


class Slot(nn.Partitioned):
    """An optimizer leaf boxed with the logical axes it derives from its parameter (`names`), the
    parameter's path (as the goldens write it, without `params/`) and, per dimension, the parameter
    dimension it is (`dims`)."""

    parameter: str = struct.field(pytree_node=False, default="")
    dims: DimMap = struct.field(pytree_node=False, default=())


def optimizer_state(optimizer: Any, params: Any) -> Any:
    """The abstract state of `optimizer` (an optax GradientTransformation) over `params` (abstract,
    boxed or not), every leaf that belongs to a parameter boxed as a :class:`Slot`."""
    raw = unbox(params)
    return attach_slots(jax.eval_shape(optimizer.init, raw), params, optimizer)


def slots(opt_state: Any) -> dict[str, Slot]:
    """{leaf path: Slot} of every leaf of an optimizer state that belongs to a parameter."""
    found = jax.tree_util.tree_leaves_with_path(opt_state, is_leaf=is_box)
    return {path_text(k): leaf for k, leaf in found if isinstance(leaf, Slot)}


def _parameters(params: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], tuple[Any, ...]]]:
    """{path parts: (shape, logical axes)} of every parameter."""
    out = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_box):
        array = leaf.value if is_box(leaf) else leaf
        shape = tuple(int(d) for d in array.shape)
        names = tuple(leaf.names) if is_box(leaf) else ()  # unboxed: no logical axes, nor its slots
        out[tuple(path_text(key_path).split("/"))] = (shape, names)
    return out


def _owner(parts: Sequence[str], known: dict[tuple[str, ...], Any]) -> tuple[str, ...] | None:
    """The longest parameter path found as a contiguous run in a leaf's path (the last one on a tie)."""
    best: tuple[str, ...] | None = None
    for start in range(len(parts)):
        for end in range(len(parts), start, -1):
            run = tuple(parts[start:end])
            if run in known and (best is None or len(run) >= len(best)):
                best = run
                break
    return best


def candidate_dims(shape: Sequence[int], param_shape: Sequence[int]) -> list[DimMap]:
    """Every order-preserving way the leaf's dimensions can be the parameter's (equal sizes); a leaf
    dimension of size 1 may also be none of them (a placeholder). Maps using the most parameter
    dimensions first.

    >>> candidate_dims((256,), (256, 1024)), candidate_dims((64,), (64, 64))
    ([(0,)], [(0,), (1,)])
    >>> candidate_dims((1,), (1024,)), candidate_dims((3,), (4, 5))
    ([(None,)], [])
    """
    found: list[DimMap] = []

    def walk(i: int, start: int, acc: tuple[int | None, ...]) -> None:
        if i == len(shape):
            found.append(acc)
            return
        for d in range(start, len(param_shape)):
            if param_shape[d] == shape[i]:
                walk(i + 1, d + 1, acc + (d,))
        if shape[i] == 1:
            walk(i + 1, start, acc + (None,))

    walk(0, 0, ())
    return sorted(set(found), key=lambda m: (sum(d is None for d in m), m))


def _dims_of(shape: tuple[int, ...], param_shape: tuple[int, ...]) -> list[DimMap]:
    """The candidate maps worth choosing between: an exact shape is the identity; otherwise the
    candidates that map the most dimensions."""
    if shape == param_shape:
        return [tuple(range(len(shape)))]
    found = candidate_dims(shape, param_shape)
    if not found:
        return [(None,) * len(shape)]
    best = sum(d is not None for d in found[0])
    return [m for m in found if sum(d is not None for d in m) == best]


def attach_slots(opt_state: Any, params: Any, optimizer: Any = None) -> Any:
    """`opt_state` (abstract) with every leaf that belongs to a parameter of `params` boxed as a
    :class:`Slot`. `optimizer` is traced only when a leaf's shape leaves its dimensions ambiguous."""
    probe: dict[str, Any] = {}

    def probed() -> dict[str, DimMap]:
        if "result" not in probe:
            probe["result"] = (_probe(optimizer, params) if optimizer is not None else None) or {}
        return probe["result"]

    slot = _slotter(_parameters(params), lambda path: probed().get(path))
    return _warn_ambiguous(slot, jax.tree_util.tree_map_with_path(
        lambda key_path, leaf: slot(path_text(key_path), leaf), opt_state, is_leaf=is_box))


def state_with_slots(state: Any) -> Any:
    """A whole training state of the user's own (a dict or a `TrainState`: its `params` and
    `opt_state` parts found by path) with every optimizer leaf re-derived from its parameter, the
    boxes optax carried onto reshaped leaves (a factored moment keeping its kernel's names) dropped.
    A state without both parts comes back as it was."""
    found = jax.tree_util.tree_leaves_with_path(state, is_leaf=is_box)
    params = {path[len("params/"):]: leaf for path, leaf in ((path_text(k), v) for k, v in found)
              if path.startswith("params/")}
    if not params or not any(path_text(k).startswith("opt_state/") for k, _ in found):
        return state
    slot = _slotter(_parameters(params), lambda path: None)

    def derive(key_path: Any, leaf: Any) -> Any:
        path = path_text(key_path)
        return slot(path[len("opt_state/"):], leaf) if path.startswith("opt_state/") else leaf

    return _warn_ambiguous(slot, jax.tree_util.tree_map_with_path(derive, state, is_leaf=is_box))


def _slotter(known: dict[tuple[str, ...], Any], traced: Any) -> Any:
    """(path, leaf) -> the leaf boxed as a Slot of its parameter (or as it was); the ambiguous leaves
    it met are kept on `.ambiguous`. `traced(path)` is the probe's dimension map of a leaf, if any."""

    def slot(path: str, leaf: Any) -> Any:
        value = leaf.value if is_box(leaf) else leaf
        shape = tuple(int(d) for d in getattr(value, "shape", ()))
        owner = _owner(path.split("/"), known) if shape else None
        if owner is None:
            return leaf
        param_shape, names = known[owner]
        maps = _dims_of(shape, param_shape)
        dims = maps[0]
        if len(maps) > 1:
            dims = traced(path)
            if dims not in maps:
                dims = (None,) * len(shape)
                slot.ambiguous.append(f"{path} {shape} of {'/'.join(owner)} {param_shape}")
        axes = tuple(names[d] if d is not None and d < len(names) else None for d in dims) if names else ()
        return Slot(value, names=axes, parameter="/".join(owner), dims=dims)

    slot.ambiguous = []
    return slot


def _warn_ambiguous(slot: Any, result: Any) -> Any:
    ambiguous = slot.ambiguous
    if ambiguous:
        more = f" and {len(ambiguous) - 1} more" if len(ambiguous) > 1 else ""
        warnings.warn(OptimizerAxesWarning(
            f"{len(ambiguous)} optimizer lea{'ves' if len(ambiguous) > 1 else 'f'} could keep more than one set of "
            f"their parameter's dimensions and the optimizer's update does not tell which, e.g. optimizer leaf "
            f"{ambiguous[0]}{more}; written with no logical axes (replicated)"), stacklevel=3)
    return result


def _probe(optimizer: Any, params: Any) -> dict[str, DimMap] | None:
    """{leaf path: dims} from one abstract update of `optimizer` with every parameter dimension on a
    probe mesh axis of its own; None when the update cannot be traced that way (e.g. it contracts a
    parameter dimension, which Explicit axes refuse without an `out_sharding`)."""
    raw = unbox(params)
    rank = max((len(x.shape) for x in jax.tree.leaves(raw)), default=0)
    if rank == 0:
        return None
    names = tuple(f"{_PROBE_AXIS}{i}" for i in range(rank))
    mesh = AbstractMesh((1,) * rank, names, axis_types=(AxisType.Explicit,) * rank)

    def run(values: Any) -> Any:
        values = jax.tree.map(lambda x: jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*names[:x.ndim]))),
                              values)
        _, new_state = optimizer.update(values, optimizer.init(values), values)
        return new_state

    try:
        with jax.sharding.use_abstract_mesh(mesh):
            traced = jax.eval_shape(run, raw)
    except Exception:  # noqa: BLE001  (any optimizer's own error means: no probe)
        return None
    out = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(traced):
        spec = leaf.sharding.spec if getattr(leaf, "sharding", None) is not None else PartitionSpec()
        out[path_text(key_path)] = tuple(_probe_dim(spec[i] if i < len(spec) else None) for i in range(len(leaf.shape)))
    return out


def _probe_dim(entry: Any) -> int | None:
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    if len(axes) != 1 or not axes[0].startswith(_PROBE_AXIS):
        return None
    return int(axes[0][len(_PROBE_AXIS):])


__all__ = ["OptimizerAxesWarning", "Slot", "attach_slots", "candidate_dims", "optimizer_state", "slots",
           "state_with_slots"]
