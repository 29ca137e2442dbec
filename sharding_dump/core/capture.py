"""Activation constraints met while tracing any function, with their logical axes.

Inside :func:`recording`, every sharding constraint a model places is noted at its call site:

* flax's `nn.with_logical_constraint` (the usual way, linen or NNX): logical axes known;
* :func:`constrain` (the same, with an explicit stable name);
* plain `jax.lax.with_sharding_constraint`: logical axes unknown (null per dimension).

Each noted call is wrapped in a named scope carrying its number, so every `sharding_constraint`
equation that comes from it (forward, its rematerialised copy, the transposed one on the cotangent)
can be matched back to the call site by :func:`read_constraints`. Constraints flax places when a
parameter is read or created are parameter layouts, not activations: they are marked and left out.

The hooks are installed only while a recording is open (and restored after), and they do nothing but
pass through when the current thread or task has no recording. The notes live in one recording
object (a context variable), so one trace never sees another's.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> from jax.sharding import AbstractMesh, use_abstract_mesh
>>> def f(x):
...     return nn.with_logical_constraint(x * 2, ("batch", "embed"))
>>> with use_abstract_mesh(AbstractMesh((2,), ("data",))), nn.logical_axis_rules([("batch", "data")]):
...     with recording() as rec:
...         jaxpr = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((8, 4), jnp.float32))
>>> [(c.key, c.logical_axes, tuple(c.partition_spec)) for c in read_constraints(jaxpr, rec)]
[('forward/batch.embed', ('batch', 'embed'), ('data', None))]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import re
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params
from jax.sharding import PartitionSpec

from sharding_dump.core.legacy_mesh import legacy_mesh

FORWARD, BACKWARD = "forward", "backward"
PLAIN_NAME = "sharding_constraint"  # the name of a plain jax.lax.with_sharding_constraint call
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_MARKER = re.compile(r"activation:[A-Za-z0-9_.-]+@(\d+)\.(\d+)")
_PARAM_SCOPE = "sharding_dump_parameter_read"
_REMAT_RECOMPUTE = "rematted_computation"  # jax's name-stack entry for forward work redone in the backward pass


@dataclasses.dataclass(frozen=True)
class CallSite:
    """Where a constraint was placed: module path ('' at top level), name, logical axes, and whether
    the name was given (`constrain`) or derived."""

    module: str
    name: str
    logical_axes: tuple[str | None, ...]
    named: bool = False


@dataclasses.dataclass
class Recording:
    """The call sites noted during one trace, numbered in call order."""

    token: int
    sites: list[CallSite] = dataclasses.field(default_factory=list)
    nnx_paths: dict[int, str] = dataclasses.field(default_factory=dict)  # id(nnx module) -> path
    nnx_type_paths: dict[type, list[str]] = dataclasses.field(default_factory=dict)  # module class -> paths

    def note(self, site: CallSite) -> int:
        self.sites.append(site)
        return len(self.sites) - 1


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One activation constraint of a traced function, deduplicated by (pass, module, name)."""

    module: str
    name: str
    pass_: str  # forward | backward
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...]
    partition_spec: PartitionSpec

    @property
    def key(self) -> str:
        """`<pass>/<module path>/<name>`, e.g. `forward/decoder/layers/self_attention/query`."""
        return "/".join(part for part in (self.pass_, self.module, self.name) if part)


_CURRENT: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("sharding_dump_recording", default=None)
_PREFIX: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("sharding_dump_module_prefix", default=())
_GIVEN_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("sharding_dump_given_name", default=None)
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("sharding_dump_inside_hook", default=False)
_TOKENS = itertools.count(1)  # tells one recording's markers from another's
_HOOKS_LOCK = threading.Lock()
_HOOKS: dict[str, Any] = {"count": 0}


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Notes every activation constraint placed inside the block (i.e. during one trace)."""
    rec = Recording(next(_TOKENS))
    _install_hooks()
    reset = _CURRENT.set(rec)
    try:
        yield rec
    finally:
        _CURRENT.reset(reset)
        _remove_hooks()


@contextlib.contextmanager
def module_prefix(path: Sequence[str]) -> Iterator[None]:
    """Call sites inside the block get `path` in front of their module path: for modules run by a
    detached `Module.apply` (e.g. a pipeline stage), whose own paths start again from the root."""
    reset = _PREFIX.set(_PREFIX.get() + tuple(path))
    try:
        yield
    finally:
        _PREFIX.reset(reset)


def note_nnx_modules(root: Any) -> None:
    """Lets constraints inside NNX modules be keyed by module path: call it on the merged root
    module inside the traced function (NNX keeps no module stack of its own)."""
    rec = _CURRENT.get()
    if rec is None:
        return
    from flax import nnx

    for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Module):
            text = "/".join(str(p) for p in path)
            rec.nnx_paths[id(node)] = text
            rec.nnx_type_paths.setdefault(type(node), []).append(text)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], name: str) -> jax.Array:
    """`nn.with_logical_constraint(x, logical_axes)` whose golden key ends in `name` (letters, digits,
    '_', '.', '-') instead of a name derived from the logical axes.

    >>> import jax.numpy as jnp
    >>> constrain(jnp.ones((2, 3)), ("batch", "embed"), "layer_input").shape  # no rules: a no-op
    (2, 3)
    """
    import flax.linen as nn

    axes = tuple(logical_axes)
    if len(axes) != x.ndim:
        raise ValueError(f"activation {name!r}: {len(axes)} logical axes for a rank-{x.ndim} array")
    if not _NAME.fullmatch(name):
        raise ValueError(f"activation name {name!r}: use letters, digits, '_', '.' or '-'")
    reset = _GIVEN_NAME.set(name)
    try:
        return nn.with_logical_constraint(x, axes)
    finally:
        _GIVEN_NAME.reset(reset)


# --- the hooks --------------------------------------------------------------------------------------

def _param_codes() -> frozenset[Any]:
    """Code objects of the flax functions that constrain a parameter as it is read or created."""
    from flax.core import meta
    from flax.core import spmd as core_spmd
    from flax.linen import spmd as linen_spmd

    return frozenset({meta.Partitioned.unbox.__code__, linen_spmd.LogicallyPartitioned.unbox.__code__,
                      core_spmd.shard_value.__code__})


def _caller_frames() -> Iterator[Any]:
    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _is_parameter_constraint() -> bool:
    codes = _HOOKS["param_codes"]
    return any(f.f_code in codes for f in _caller_frames())


def _module_path(rec: Recording) -> str:
    from flax.linen import module as flax_module

    stack = flax_module._context.module_stack
    module = stack[-1] if stack else None
    if module is not None:
        return "/".join(_PREFIX.get() + tuple(module.path))
    if rec.nnx_paths:
        for frame in _caller_frames():
            owner = frame.f_locals.get("self")
            if owner is None:
                continue
            # A module rebuilt inside an NNX transform (scan, vmap, remat) is a new object: it is known
            # by its class when the model has one module of that class (e.g. a scanned block stack).
            path = rec.nnx_paths.get(id(owner))
            if path is None and len(rec.nnx_type_paths.get(type(owner), ())) == 1:
                path = rec.nnx_type_paths[type(owner)][0]
            if path is not None:
                return "/".join(_PREFIX.get() + tuple(filter(None, [path])))
    return "/".join(_PREFIX.get())


def _derived_name(logical_axes: Sequence[Any]) -> str:
    text = ".".join("_" if a is None else str(a) for a in logical_axes) or "scalar"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def _marked(rec: Recording, site: CallSite, call: Callable[[], Any]) -> Any:
    index = rec.note(site)
    reset = _INSIDE.set(True)
    try:
        with jax.named_scope(f"activation:{site.name}@{rec.token}.{index}"):
            return call()
    finally:
        _INSIDE.reset(reset)


def _logical_hook(axis_resources: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for flax's per-leaf logical constraint while a recording is open."""
    original = _HOOKS["logical"]
    rec = _CURRENT.get()
    if rec is None or _INSIDE.get():
        return original(axis_resources, x, *args, **kwargs)
    if _is_parameter_constraint():
        with jax.named_scope(_PARAM_SCOPE):
            return original(axis_resources, x, *args, **kwargs)
    axes = tuple(axis_resources) if axis_resources is not None else (None,) * getattr(x, "ndim", 0)
    given = _GIVEN_NAME.get()
    site = CallSite(_module_path(rec), given or _derived_name(axes), axes, named=given is not None)
    return _marked(rec, site, lambda: original(axis_resources, x, *args, **kwargs))


def _lax_hook(x: Any, shardings: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for `jax.lax.with_sharding_constraint` while a recording is open."""
    original = _HOOKS["lax"]
    rec = _CURRENT.get()
    if rec is None or _INSIDE.get() or len(jax.tree.leaves(x)) != 1:
        return original(x, shardings, *args, **kwargs)
    if _is_parameter_constraint():
        with jax.named_scope(_PARAM_SCOPE):
            return original(x, shardings, *args, **kwargs)
    (leaf,) = jax.tree.leaves(x)
    site = CallSite(_module_path(rec), PLAIN_NAME, (None,) * getattr(leaf, "ndim", 0))
    return _marked(rec, site, lambda: original(x, shardings, *args, **kwargs))


def _install_hooks() -> None:
    from flax.linen import spmd as linen_spmd

    with _HOOKS_LOCK:
        if _HOOKS["count"] == 0:
            _HOOKS["param_codes"] = _param_codes()
            _HOOKS["logical"] = linen_spmd._with_sharding_constraint_one_fallback
            _HOOKS["lax"] = jax.lax.with_sharding_constraint
            linen_spmd._with_sharding_constraint_one_fallback = _logical_hook
            jax.lax.with_sharding_constraint = _lax_hook
        _HOOKS["count"] += 1


def _remove_hooks() -> None:
    from flax.linen import spmd as linen_spmd

    with _HOOKS_LOCK:
        _HOOKS["count"] -= 1
        if _HOOKS["count"] == 0:
            linen_spmd._with_sharding_constraint_one_fallback = _HOOKS.pop("logical")
            jax.lax.with_sharding_constraint = _HOOKS.pop("lax")


# --- reading them back ------------------------------------------------------------------------------

def equations(jaxpr: Jaxpr | ClosedJaxpr, stack: tuple[str, ...] = ()) -> Iterator[tuple[JaxprEqn, tuple[str, ...]]]:
    """Every equation, in nested jaxprs too (scan, remat, jit, shard_map, custom_vjp, cond), with its
    full name stack (a child's stack is relative to its parent's)."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    for eqn in inner.eqns:
        own = str(eqn.source_info.name_stack)
        full = stack + (own,) if own else stack
        yield eqn, full
        for sub in jaxprs_in_params(eqn.params):
            yield from equations(sub, full)


def _constraint_eqns(jaxpr: Jaxpr) -> Iterator[tuple[JaxprEqn, str]]:
    return ((eqn, "/".join(full)) for eqn, full in equations(jaxpr) if eqn.primitive.name == "sharding_constraint")


def unrecorded_constraints(closed: ClosedJaxpr) -> list[tuple[tuple[int, ...], str, str]]:
    """(shape, dtype, name stack) of every sharding constraint that is neither a noted activation
    nor a parameter read: constraints placed through a function bound before the recording began."""
    out = []
    for eqn, stack in _constraint_eqns(closed.jaxpr):
        if not _MARKER.search(stack) and _PARAM_SCOPE not in stack:
            aval = eqn.invars[0].aval
            out.append((tuple(aval.shape), aval.dtype.name, stack))
    return out


def _pass_of(parts: list[str]) -> str:
    """Backward when under a transpose, unless it is forward work rematerialised there."""
    if _REMAT_RECOMPUTE in parts:
        return FORWARD
    return BACKWARD if any(p.startswith("transpose(") for p in parts) else FORWARD


def read_constraints(closed: ClosedJaxpr, rec: Recording) -> list[Constraint]:
    """The activation constraints of a jaxpr traced inside `rec`, sorted by key.

    The same call site met several times (a forward constraint and its rematerialised copy, a layer
    body traced twice by scan) gives one entry. Two layouts under one derived name get `-2`, `-3`...
    in call order; under one given name (:func:`constrain`) they are an error in the model code, and
    so is a named call site none of whose constraints reached the jaxpr."""
    found: dict[tuple[str, str, str], list[tuple[int, Constraint]]] = {}
    for eqn, stack in _constraint_eqns(closed.jaxpr):
        parts = stack.split("/")
        marks = [m for m in map(_MARKER.search, parts) if m]
        if not marks:
            continue  # a parameter read, or a constraint the hooks did not see
        token, index = int(marks[-1].group(1)), int(marks[-1].group(2))
        if token != rec.token or index >= len(rec.sites):
            raise RuntimeError(f"sharding_constraint at {stack} carries the marker of another trace: a jit-ed "
                               "function placing constraints was reused from jax's trace cache, with shardings "
                               "resolved under whatever rules were active then; do not jit it")
        site = rec.sites[index]
        aval = eqn.invars[0].aval
        entry = Constraint(site.module, site.name, _pass_of(parts), tuple(aval.shape), aval.dtype.name,
                           site.logical_axes, eqn.params["sharding"].spec)
        variants = found.setdefault((entry.pass_, entry.module, entry.name), [])
        layout = dataclasses.replace(entry, pass_="")
        if any(dataclasses.replace(seen, pass_="") == layout for _, seen in variants):
            continue
        if variants and site.named:
            seen = variants[0][1]
            raise ValueError(f"activation {entry.key}: constrained twice with different layouts "
                             f"({seen.shape} {seen.logical_axes} vs {entry.shape} {entry.logical_axes}); "
                             "give each constrain() call in a module its own name")
        variants.append((index, entry))
    out = []
    for variants in found.values():
        for rank, (_, entry) in enumerate(sorted(variants, key=lambda v: v[0])):
            out.append(entry if rank == 0 else dataclasses.replace(entry, name=f"{entry.name}-{rank + 1}"))
    traced = {(c.module, c.name) for c in out}
    lost = sorted("/".join(filter(None, (s.module, s.name))) for s in rec.sites
                  if s.named and (s.module, s.name) not in traced)
    if lost:
        raise ValueError(f"constrain() was called for {', '.join(dict.fromkeys(lost))} but no such constraint "
                         "reached the traced step (is its result unused?)")
    return sorted(out, key=lambda c: c.key)


def record_activations(fn: Callable[..., Any], *args: Any, mesh: Any, rules: Any) -> list[Constraint]:
    """Every activation constraint met while tracing `fn(*args)` on `mesh` (an `AbstractMesh` is
    enough) under the logical axis `rules`; `args` may be abstract (`jax.ShapeDtypeStruct`)."""
    closed, rec = trace(fn, *args, mesh=mesh, rules=rules)
    return read_constraints(closed, rec)


def trace(fn: Callable[..., Any], *args: Any, mesh: Any, rules: Any) -> tuple[ClosedJaxpr, Recording]:
    """The jaxpr of `fn(*args)` traced on `mesh` under `rules`, and its recording. The mesh is also the
    legacy `with mesh:` one (:mod:`sharding_dump.core.legacy_mesh`), so helpers gated on it constrain."""
    import flax.linen as nn

    from sharding_dump.core.layout import rules_of

    abstract = mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh
    with jax.sharding.use_abstract_mesh(abstract), legacy_mesh(abstract), nn.logical_axis_rules(rules_of(rules)), \
            recording() as rec:
        closed = jax.make_jaxpr(fn)(*args)
    return closed, rec
