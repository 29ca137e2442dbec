"""What a traced program decides about its own arrays, read from its jaxpr: the mesh its shardings
live on, the layout it demands of its inputs, and the layout of what it hands back.

A program decides these where the harness would otherwise decide for it:

* **its mesh**: a program that builds its own concrete mesh (`jax.make_mesh(...)` over
  `jax.devices()`, Levanter's `trainer.mesh`, Kauldron's sharding) places its arrays on that mesh, in
  `jit` in/out shardings, constraints, `reshard` and `device_put`. :func:`meshes` reads every mesh a
  traced function names; :func:`check_mesh` refuses, in one line naming both, a mesh other than the
  case's (dumped on the case's mesh, its specs would describe another program).
* **the layout it takes its inputs in**: its step's `jit(in_shardings=...)`, or a constraint,
  `reshard` or `device_put` the input meets first (:func:`demanded`).
* **the layout it hands its state back in**: the step's `jit(out_shardings=...)`, a constraint on
  what it returns, or (on an Explicit mesh) the sharding in the output's type (:func:`returned`). A
  leaf that comes back in another layout than it went in is resharded every step:
  :class:`HandBack` says how many bytes one device moves for it.

Any traced function whose outputs are the next value of some of its inputs (a training step's state,
a serving step's KV cache) is read the same way. A worked example: a step that returns its weight
replicated where it took it split over `x` (a `jit(out_shardings=...)` of its own):

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
>>> mesh = AbstractMesh((4,), ("x",), axis_types=(AxisType.Explicit,))
>>> def step(w, batch):
...     m = jax.sharding.get_abstract_mesh()
...     batch = jax.sharding.reshard(batch, P(None, "x"))                   # its own batch layout
...     return jax.jit(lambda w, b: (w + b.sum(), b.mean()),
...                    out_shardings=(NamedSharding(m, P()), NamedSharding(m, P())))(w, batch)
>>> w, batch = (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("x")))
...             for shape in ((64, 8), (8, 8)))
>>> with jax.sharding.use_abstract_mesh(mesh):
...     closed = jax.make_jaxpr(step)(w, batch)
>>> [(name, size) for name, size in meshes(closed)[0][0]]
[('x', 4)]
>>> {index: tuple(spec) for index, spec in demanded(closed, [1]).items()}
{1: (None, 'x')}
>>> back = hand_backs(returned(closed, 1), [("w", (64, 8), "float32", P("x"))], {"x": 4})
>>> [(b.path, b.went_in, b.came_back, b.moved_bytes) for b in back]
[('w', ['x', None], [None, None], 1536)]

Each device gathers the three quarters of `w` it lacks (1536 of its 2048 bytes) at the end of every
step, and drops them again when the next step takes `w` split over `x`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxprs_in_params
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump.core import specs
from sharding_dump.errors import DEVICE_COUNT_FLAG, BadInput, DeviceCountError

MeshShape = tuple[tuple[str, int], ...]  # ((axis name, size), ...) in the mesh's order
_JIT = ("pjit", "jit")  # the jit primitive's name before and after jax 0.12
_PLACING = {"sharding_constraint": "sharding", "reshard": "dst_sharding"}  # primitive -> its sharding param


# --- the mesh -------------------------------------------------------------------------------------------

def mesh_shape(mesh: Any) -> MeshShape:
    """((axis name, size), ...) of a concrete or abstract mesh."""
    return tuple((str(name), int(size)) for name, size in mesh.shape.items())


def axis_kinds(mesh: Any) -> tuple[str, ...]:
    """Each axis's type (`Auto`, `Explicit`, `Manual`) of a concrete or abstract mesh, in its order."""
    return tuple(getattr(kind, "name", str(kind)) for kind in getattr(mesh, "axis_types", None) or ())


def mesh_text(shape: MeshShape, kinds: Sequence[str] = ()) -> str:
    """`data=2 x model=4`, with its axis types when given: `data=2 x model=4 (Explicit axes)`, or each
    axis's own when they differ (`data=2 (Explicit) x model=4 (Auto)`)."""
    if len(set(kinds)) > 1:
        return " x ".join(f"{name}={size} ({kind})" for (name, size), kind in zip(shape, kinds))
    text = " x ".join(f"{name}={size}" for name, size in shape)
    return f"{text} ({kinds[0]} axes)" if kinds else text


def _same_kinds(found: Sequence[str], want: Sequence[str]) -> bool:
    """Axis types that agree: a Manual axis (inside a `shard_map`) is the mesh's own axis made manual
    there, whatever type it has outside."""
    return all(a == b or "Manual" in (a, b) for a, b in zip(found, want))


def _meshes_in(value: Any) -> Iterator[Any]:
    """The meshes a parameter value names: a NamedSharding's, a mesh itself (a `shard_map`'s, the
    context mesh a jit was traced under), inside tuples and lists too."""
    if isinstance(value, NamedSharding):
        yield value.mesh
    elif isinstance(value, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _meshes_in(item)


def _all_equations(jaxpr: Jaxpr | ClosedJaxpr) -> Iterator[Any]:
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    for eqn in inner.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _all_equations(sub)


def _named_meshes(closed: ClosedJaxpr) -> Iterator[tuple[Any, str]]:
    """Every mesh the traced function's own equations name, with the equation naming it (`jit create`,
    `sharding_constraint sharding`), in trace order."""
    for eqn in _all_equations(closed):
        for key, value in eqn.params.items():
            for mesh in _meshes_in(value):
                name = eqn.params.get("name") if eqn.primitive.name in _JIT else None
                yield mesh, f"{eqn.primitive.name} {name}" if name else f"{eqn.primitive.name} {key}"


def meshes(closed: ClosedJaxpr) -> list[tuple[MeshShape, str]]:
    """Every distinct mesh the traced function's own shardings name (a jit's in/out shardings, a
    constraint, `reshard`, `device_put`, an output sharding, a `shard_map`'s mesh, a mesh set with
    `jax.set_mesh`), each with the first equation naming it (`jit create`, `sharding_constraint
    sharding`), in trace order."""
    found: dict[MeshShape, str] = {}
    for mesh, where in _named_meshes(closed):
        shape = mesh_shape(mesh)
        if shape and shape not in found:  # an empty mesh is jax's own "no mesh"
            found[shape] = where
    return list(found.items())


def _device_hint(closed: ClosedJaxpr, shape: MeshShape, want: MeshShape) -> str:
    """What to do when the program's mesh is a concrete one over every device of this process (Kauldron's
    `DEVICES_MESH`, a mesh of `jax.devices()`) and the process has another count than the case: start it
    with the case's count. Only a concrete mesh asks, so the backend it counts has started already."""
    size, wanted = math.prod(n for _, n in shape), math.prod(n for _, n in want)
    concrete = any(isinstance(mesh, jax.sharding.Mesh) and mesh_shape(mesh) == shape
                   for mesh, _ in _named_meshes(closed))
    if not concrete or size == wanted or size != jax.device_count():
        return ""
    return (f"; this process has {size} device{'s' * (size != 1)} and the program's mesh spans all of them: start it "
            f"with XLA_FLAGS={DEVICE_COUNT_FLAG}={wanted} (the sharding-dump command and the "
            "pytest plugin give a program case its count, in a process of its own where theirs has another; "
            "Python code calling the harness itself needs it set before JAX starts)")


def check_mesh(closed: ClosedJaxpr, mesh: Any, what: str, case_mesh: str = "the case's mesh",
               types: bool = True) -> None:
    """BadInput, one line naming both meshes, when `what` (e.g. `the program's init`) places its arrays
    on a mesh whose axis names, sizes or types (`types` False: names and sizes) are not `mesh`'s: the
    dump would lay the program's specs on another mesh than the one it runs on."""
    seen: set[tuple[MeshShape, tuple[str, ...]]] = set()  # an abstract mesh's axis types are the case's
    # as the program's own `auto_axes` / `explicit_axes` region changed them: only a concrete mesh's are its own
    for found, where in _named_meshes(closed):
        key = (mesh_shape(found), axis_kinds(found))
        if key[0] and key not in seen:  # an empty mesh is jax's own "no mesh"
            seen.add(key)
            refuse_other_mesh(found, mesh, f"{what} places its arrays on its own mesh", where, case_mesh,
                              lambda shape=key[0]: ", or build the program's mesh with the case's device count "
                              "(jax.devices()) or from jax.sharding.get_abstract_mesh()"
                              + _device_hint(closed, shape, mesh_shape(mesh)),
                              types=types and isinstance(found, jax.sharding.Mesh))


def check_context_mesh(given: Any, mesh: Any, where: str, types: bool = True) -> None:
    """BadInput, one line naming both meshes, when the mesh a program runs on without naming it in its
    shardings is not `mesh` (the case's): `given` as the program gives it (`where`, e.g.
    `TrainProgram(mesh=...)`: a mesh set as a context, as Levanter's trainer and haliax's `named_jit`
    take it, which a traced init or step cannot set), or a mesh the program set with `jax.set_mesh`
    before the harness traced it. `types` False compares axis names and sizes only (`mesh` is a trace's
    of another mode than the case's). Call outside any trace (jax reads no set mesh inside one)."""
    for found, said in ((given, where), (jax.sharding.get_mesh(), "set with jax.set_mesh")):
        if found is not None and not found.empty:
            refuse_other_mesh(found, mesh, "the program runs on its own mesh", said, types=types)


def refuse_other_mesh(found: Any, mesh: Any, said: str, where: str, case_mesh: str = "the case's mesh",
                      hint: Callable[[], str] = str, types: bool = True) -> None:
    """BadInput, one line naming both meshes (`said` the program's mesh, `where` what names it), when the
    program's mesh `found` is not `mesh` in its axis names, sizes or types (shard_mode records the case's
    axis types in the golden, so a program that changes only its mesh's axis types fails its golden too);
    `hint()` adds to the remedy on other axis names or sizes; `types` False compares no axis types."""
    want, shape = mesh_shape(mesh), mesh_shape(found)
    if not want:  # traced outside any mesh: nothing to hold the program's against
        return
    if shape != want:
        spans = isinstance(found, jax.sharding.Mesh) and found.size == jax.device_count() != math.prod(
            n for _, n in want)  # a mesh over jax.devices(): this process's count decided it
        raise (DeviceCountError if spans else BadInput)(
            f"{said} {mesh_text(shape)} ({where}), not on {case_mesh} {mesh_text(want)}: give the case the "
            "program's mesh (the rule file's mesh_axes and the ici_/dcn_*_parallelism settings)" + hint())
    kinds, wanted = axis_kinds(found), axis_kinds(mesh)
    if types and not _same_kinds(kinds, wanted):
        raise BadInput(f"{said} {mesh_text(shape, kinds)} ({where}), not on {case_mesh} {mesh_text(want, wanted)}: "
                       "give the case the program's axis types (shard_mode=explicit for Explicit axes, "
                       "shard_mode=auto for Auto), or build the program's mesh with the case's "
                       "(jax.make_mesh(..., axis_types=...))")


# --- what the program declares --------------------------------------------------------------------------

def _given(sharding: Any) -> PartitionSpec | None:
    """The spec of a sharding a program gave explicitly (replicated included: it said so)."""
    return sharding.spec if isinstance(sharding, NamedSharding) else None


def producer_spec(jaxpr: Jaxpr, var: Any, made: dict[int, dict[int, tuple[Any, int]]]) -> PartitionSpec | None:
    """The spec the equation producing `var` declares (following it into a jit's body): a jit's
    `out_shardings`, a constraint, `reshard` or `device_put`; None for an input passed through or an
    equation that declares nothing. `made` holds each jaxpr's producers, by id, as they are needed."""
    if id(jaxpr) not in made:
        made[id(jaxpr)] = {id(out): (eqn, i) for eqn in jaxpr.eqns for i, out in enumerate(eqn.outvars)}
    found = made[id(jaxpr)].get(id(var))
    if found is None:
        return None
    eqn, index = found
    name, params = eqn.primitive.name, eqn.params
    if name in _JIT:
        inner = params["jaxpr"].jaxpr
        declared = _given(params["out_shardings"][index])
        return declared if declared is not None else producer_spec(inner, inner.outvars[index], made)
    if name in _PLACING:
        return _given(params[_PLACING[name]])
    if name == "device_put":
        return _given(params["devices"][index])
    return None


def _typed(aval: Any) -> PartitionSpec | None:
    """The sharding in an output's type on a mesh with Explicit axes (replicated included)."""
    sharding = getattr(aval, "sharding", None)
    kinds = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return sharding.spec if any(k == jax.sharding.AxisType.Explicit for k in kinds) else None


def returned(closed: ClosedJaxpr, count: int) -> list[PartitionSpec | None]:
    """Per each of the first `count` outputs, the layout the function hands it back in: what the
    equation producing it declares, else the sharding in its type on an Explicit mesh, else None
    (on an Auto mesh nothing was decided: the compiler chooses)."""
    made: dict[int, dict[int, tuple[Any, int]]] = {}
    out: list[PartitionSpec | None] = []
    for var in closed.jaxpr.outvars[:count]:
        if isinstance(var, jax.extend.core.Literal):
            out.append(None)
            continue
        declared = producer_spec(closed.jaxpr, var, made)
        out.append(declared if declared is not None else _typed(var.aval))
    return out


def demanded(closed: ClosedJaxpr, indices: Iterable[int], skip: str | None = None,
             placements: bool = True) -> dict[int, PartitionSpec]:
    """{input index: spec} of the inputs the function demands a layout of at its top: where the first
    equation to use the input places it (a constraint, `reshard` or `device_put` of it), or is a jit
    taking it with an `in_shardings` entry (else the same inside that jit's body). A placement whose
    name stack holds `skip` (the harness's own, made before the program runs) is followed through.
    With `placements` False only a jit's `in_shardings` count (the layout a step takes its state in).
    An input first used in a computation is taken as it comes: a reshard deep in the model (of the
    tokens before an embedding gather) is the model's work, not a layout the program demands."""
    found = {}
    uses: dict[int, dict[int, tuple[Any, int]]] = {}
    for index in indices:
        spec = _first_placement(closed.jaxpr, closed.jaxpr.invars[index], skip, placements, uses)
        if spec is not None:
            found[index] = spec
    return found


def _first_placement(jaxpr: Jaxpr, var: Any, skip: str | None, placements: bool,
                     uses: dict[int, dict[int, tuple[Any, int]]]) -> PartitionSpec | None:
    """The spec the first equation to use `var` places it on (see :func:`demanded`). `uses` holds each
    jaxpr's first use of every variable, by id, built once: a state of thousands of leaves is read in
    one pass over the step, not one pass per leaf."""
    if id(jaxpr) not in uses:
        first: dict[int, tuple[Any, int]] = {}
        for eqn in jaxpr.eqns:
            for i, v in enumerate(eqn.invars):
                first.setdefault(id(v), (eqn, i))
        uses[id(jaxpr)] = first
    found = uses[id(jaxpr)].get(id(var))
    if found is None:
        return None
    eqn, at = found
    name = eqn.primitive.name
    if name in _PLACING or name == "device_put":
        if skip is not None and skip in str(eqn.source_info.name_stack):
            return _first_placement(jaxpr, eqn.outvars[at], skip, placements, uses)
        sharding = eqn.params[_PLACING[name]] if name in _PLACING else eqn.params["devices"][at]
        return _given(sharding) if placements else None
    if name in _JIT:
        spec = _given(eqn.params["in_shardings"][at])
        if spec is not None:
            return spec
        inner = eqn.params["jaxpr"].jaxpr
        return _first_placement(inner, inner.invars[at], skip, placements, uses)
    return None


# --- what a leaf handed back in another layout costs ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HandBack:
    """A state leaf a step lays out otherwise than the state holds it (`went_in`): handed back in
    another layout (`came_back`), it is resharded at the end of every step and brought back to
    `went_in` when the next step takes it; taken in another layout (a jit's `in_shardings`, then also
    `came_back`), it is resharded at the start of every step and back at its end."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    went_in: specs.SpecJson
    came_back: specs.SpecJson
    sizes: Mapping[str, int]

    @property
    def moved_bytes(self) -> int:
        """Bytes the device that moves most receives per step for this leaf: what it lacks of its shard
        in the step's layout, then what it lacks of its shard in the state's layout again."""
        axes = sorted({a for spec in (self.went_in, self.came_back) for d in range(len(self.shape))
                       for a in specs.spec_axes(spec, len(self.shape))[d]})
        most = 0
        for coords in itertools.product(*(range(self.sizes[a]) for a in axes)):
            where = dict(zip(axes, coords))
            a, b = self._box(self.went_in, where), self._box(self.came_back, where)
            common = math.prod(max(0, min(x1, y1) - max(x0, y0)) for (x0, x1), (y0, y1) in zip(a, b))
            most = max(most, _size(a) + _size(b) - 2 * common)
        return most * specs.itemsize(self.dtype)

    def _box(self, spec: specs.SpecJson, where: Mapping[str, int]) -> list[tuple[int, int]]:
        """The index range of each dimension one device holds (ragged splits padded, as XLA does)."""
        box = []
        for dim, axes in zip(self.shape, specs.spec_axes(spec, len(self.shape))):
            index, count = 0, 1
            for axis in axes:
                index, count = index * self.sizes[axis] + where[axis], count * self.sizes[axis]
            chunk = -(-dim // count)
            box.append((min(dim, index * chunk), min(dim, (index + 1) * chunk)))
        return box


def _size(box: Sequence[tuple[int, int]]) -> int:
    return math.prod(hi - lo for lo, hi in box)


def hand_backs(back: Sequence[PartitionSpec | None], leaves: Sequence[tuple[str, tuple[int, ...], str, Any]],
               sizes: Mapping[str, int]) -> list[HandBack]:
    """The leaves (path, shape, dtype, the spec the state holds them on) whose spec in the step `back`
    (one per leaf, as :func:`returned` or :func:`demanded` read it; None: undecided) lays them out
    otherwise on a mesh of `sizes`; axes of size 1 split nothing, so a spec that differs only by them
    is the same layout."""
    out = []
    for spec, (path, shape, dtype, went) in zip(back, leaves):
        if spec is None:
            continue
        ndim = len(shape)
        if specs.spec_to_json(spec, ndim, sizes) != specs.spec_to_json(went, ndim, sizes):
            out.append(HandBack(path, tuple(shape), dtype, specs.spec_to_json(went, ndim),
                                specs.spec_to_json(spec, ndim), dict(sizes)))
    return out
