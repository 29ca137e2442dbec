"""Activation constraints met while tracing any function, with their logical axes.

Inside :func:`recording`, every sharding constraint a model places is noted at its call site:

* flax's `nn.with_logical_constraint` (the usual way, linen or NNX): logical axes known;
* :func:`constrain` (the same, with an explicit stable name);
* plain `jax.lax.with_sharding_constraint`: logical axes unknown (null per dimension), named by
  its source location (see below);
* on a mesh whose axes are Explicit (sharding in types): `jax.sharding.reshard`, and a call of a
  module method (NNX or linen) given `out_sharding=`, such as `nnx.Linear(...)(x, out_sharding=P(...))`
  or `embed.attend(x, out_sharding=P(...))`: the sharding the output carries in its type, forward,
  and the sharding its cotangent carries in the backward pass.

A plain constraint or a reshard is named `sharding_constraint-<function>-L<n>` (`reshard-...`):
the qualified name of the function that placed it and its line counted from that function's first
line, so the name does not depend on call order and stays put when other code moves. A typed module
call is named by its method (`__call__`, `attend`) under the module's path.

Each noted call is wrapped in a named scope carrying its number, so every `sharding_constraint`
equation that comes from it (forward, its rematerialised copy, the transposed one on the cotangent)
can be matched back to the call site by :func:`read_constraints`. Constraints flax places when a
parameter is read or created are parameter layouts, not activations: they are marked and left out.

The hooks are installed only while a recording is open (and restored after), and they do nothing but
pass through when the current thread or task has no recording. The notes live in one recording
object (a context variable), so one trace never sees another's.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> from jax.sharding import AbstractMesh, AxisType, use_abstract_mesh
>>> def f(x):
...     return nn.with_logical_constraint(x * 2, ("batch", "embed"))
>>> with use_abstract_mesh(AbstractMesh((2,), ("data",), (AxisType.Auto,))), nn.logical_axis_rules([("batch", "data")]):
...     with recording() as rec:
...         jaxpr = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((8, 4), jnp.float32))
>>> [(c.key, c.logical_axes, tuple(c.partition_spec)) for c in read_constraints(jaxpr, rec)]
[('forward/batch.embed', ('batch', 'embed'), ('data', None))]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import os
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


@dataclasses.dataclass(frozen=True)
class TypedOutput:
    """What a typed call site's output carries in its type: shape, dtype and partition spec."""

    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec


@dataclasses.dataclass
class Recording:
    """The call sites noted during one trace, numbered in call order."""

    token: int
    sites: list[CallSite] = dataclasses.field(default_factory=list)
    nnx_paths: dict[int, str] = dataclasses.field(default_factory=dict)  # id(nnx module) -> path
    nnx_type_paths: dict[type, list[str]] = dataclasses.field(default_factory=dict)  # module class -> paths
    typed: dict[int, TypedOutput] = dataclasses.field(default_factory=dict)  # site index -> its output's type
    patched: list[tuple[type, str]] = dataclasses.field(default_factory=list)  # NNX methods wrapped for it

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
_INSIDE_TYPED: contextvars.ContextVar[bool] = contextvars.ContextVar("sharding_dump_inside_typed", default=False)
_TOKENS = itertools.count(1)  # tells one recording's markers from another's
_HOOKS_LOCK = threading.Lock()
_HOOKS: dict[str, Any] = {"count": 0}
_PATCHED: dict[tuple[type, str], list[Any]] = {}  # (class, method) -> [own attribute, had one, users]


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Notes every activation constraint placed inside the block (i.e. during one trace)."""
    import flax.linen as nn

    rec = Recording(next(_TOKENS))
    _install_hooks()
    reset = _CURRENT.set(rec)
    try:
        with nn.intercept_methods(_linen_interceptor):
            yield rec
    finally:
        _CURRENT.reset(reset)
        _unpatch_methods(rec)
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
    for cls in list(rec.nnx_type_paths):
        _patch_methods(rec, cls)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], name: str) -> jax.Array:
    """`nn.with_logical_constraint(x, logical_axes)` whose golden key ends in `name` (letters, digits,
    '_', '.', '-') instead of a name derived from the logical axes. On a mesh whose axes are
    Explicit (where a constraint is an assertion) `x` is resharded to the resolved spec instead.

    >>> import jax.numpy as jnp
    >>> constrain(jnp.ones((2, 3)), ("batch", "embed"), "layer_input").shape  # no rules: a no-op
    (2, 3)
    """
    import flax.linen as nn

    axes = tuple(logical_axes)
    if len(axes) > x.ndim:  # fewer leave the last dimensions free, as flax does (MaxText's Qwen3-Next)
        raise ValueError(f"activation {name!r}: {len(axes)} logical axes for a rank-{x.ndim} array")
    _check_name(name)
    if explicit_mesh():
        return _reshard_named(x, nn.logical_to_mesh_axes(axes + (None,) * (x.ndim - len(axes))), name, axes)
    reset = _GIVEN_NAME.set(name)
    try:
        return nn.with_logical_constraint(x, axes)
    finally:
        _GIVEN_NAME.reset(reset)


def constrain_spec(x: jax.Array, spec: PartitionSpec, name: str) -> jax.Array:
    """`x` placed on the physical `spec` (a constraint, or a reshard on an Explicit-axis mesh), noted
    under `name` with unknown logical axes: for a layout given in mesh axes, such as the data
    pipeline's."""
    _check_name(name)
    if explicit_mesh():
        return _reshard_named(x, spec, name, (None,) * x.ndim)
    reset = _GIVEN_NAME.set(name)
    try:
        return jax.lax.with_sharding_constraint(x, spec)
    finally:
        _GIVEN_NAME.reset(reset)


def explicit_mesh() -> bool:
    """True while the current abstract mesh has Explicit axes (sharding in types)."""
    return _explicit(jax.sharding.get_abstract_mesh())


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"activation name {name!r}: use letters, digits, '_', '.' or '-'")


def _reshard_named(x: jax.Array, spec: PartitionSpec, name: str, axes: tuple[str | None, ...]) -> jax.Array:
    original = _HOOKS.get("reshard", jax.sharding.reshard)
    rec = _CURRENT.get()
    if rec is None:
        return original(x, spec)
    return _typed(rec, _module_path(rec), name, lambda: original(x, spec), axes, named=True)


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
            path = _nnx_path(rec, owner)
            if path is not None:
                return "/".join(_PREFIX.get() + tuple(filter(None, [path])))
    return "/".join(_PREFIX.get())


def _nnx_path(rec: Recording, owner: Any) -> str | None:
    """The path of an NNX module object: by identity, or by its class when the model has one module
    of that class (a module rebuilt inside an NNX transform is a new object)."""
    path = rec.nnx_paths.get(id(owner))
    if path is None and len(rec.nnx_type_paths.get(type(owner), ())) == 1:
        path = rec.nnx_type_paths[type(owner)][0]
    return path


def _location() -> str:
    """`<function>-L<n>` of the innermost caller outside jax, flax and this module: the qualified name
    of the function and the line's offset from its first line (letters, digits, '_', '.', '-')."""
    for frame in _caller_frames():
        if frame.f_code.co_filename.startswith(_library_dirs()):
            continue
        code = frame.f_code
        text = f"{code.co_qualname}-L{frame.f_lineno - code.co_firstlineno}"
        return re.sub(r"[^A-Za-z0-9_.-]", "_", text)
    return "unknown"


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    import flax
    import jaxlib

    return tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib, flax)) + (__file__,)


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
    given = _GIVEN_NAME.get()
    site = CallSite(_module_path(rec), given or f"{PLAIN_NAME}-{_location()}", (None,) * getattr(leaf, "ndim", 0),
                    named=given is not None)
    return _marked(rec, site, lambda: original(x, shardings, *args, **kwargs))


def _typed(rec: Recording, module: str, name: str, call: Callable[[], Any],
           logical_axes: tuple[str | None, ...] = (), named: bool = False) -> Any:
    """Runs a call whose output's sharding is given in its type, marked like a constraint; notes the
    output's type when it is one array on a mesh with Explicit axes."""
    index = rec.note(CallSite(module, name, logical_axes, named))
    reset = _INSIDE_TYPED.set(True)
    try:
        with jax.named_scope(f"activation:{name}@{rec.token}.{index}"):
            out = call()
    finally:
        _INSIDE_TYPED.reset(reset)
    leaves = jax.tree.leaves(out)
    if len(leaves) == 1:
        aval = jax.typeof(leaves[0])
        sharding = getattr(aval, "sharding", None)
        if sharding is not None and _explicit(sharding.mesh):
            rec.typed[index] = TypedOutput(tuple(aval.shape), aval.dtype.name, sharding.spec)
    return out


def _explicit(mesh: Any) -> bool:
    return any(kind == jax.sharding.AxisType.Explicit for kind in getattr(mesh, "axis_types", ()))


def _reshard_hook(x: Any, out_shardings: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for `jax.sharding.reshard` while a recording is open."""
    original = _HOOKS["reshard"]
    rec = _CURRENT.get()
    if rec is None or _INSIDE_TYPED.get() or len(jax.tree.leaves(x)) != 1 or _is_parameter_constraint():
        return original(x, out_shardings, *args, **kwargs)
    return _typed(rec, _module_path(rec), f"reshard-{_location()}",
                  lambda: original(x, out_shardings, *args, **kwargs))


def _out_sharding_given(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    if kwargs.get("out_sharding") is not None:
        return True
    try:
        return inspect.signature(fn).bind(*args, **kwargs).arguments.get("out_sharding") is not None
    except (TypeError, ValueError):
        return False


def _linen_interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    """A linen module method called with `out_sharding=` is a typed call site."""
    rec = _CURRENT.get()
    if rec is None or _INSIDE_TYPED.get() or kwargs.get("out_sharding") is None:
        return next_fun(*args, **kwargs)
    module = "/".join(_PREFIX.get() + tuple(context.module.path))
    return _typed(rec, module, context.method_name, lambda: next_fun(*args, **kwargs))


def _typed_method(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _CURRENT.get()
        if rec is None or _INSIDE_TYPED.get() or not _out_sharding_given(original, (self, *args), kwargs):
            return original(self, *args, **kwargs)
        path = _nnx_path(rec, self)
        module = "/".join(_PREFIX.get() + tuple(filter(None, [path]))) if path is not None else _module_path(rec)
        return _typed(rec, module, name, lambda: original(self, *args, **kwargs))

    method._sharding_dump_original = original  # type: ignore[attr-defined]
    return method


@functools.cache
def _typed_method_names(cls: type) -> tuple[str, ...]:
    """The methods of an NNX module class that take `out_sharding` (e.g. `__call__`, `attend`)."""
    names = []
    for name in dir(cls):
        if name.startswith("_") and name != "__call__":
            continue
        fn = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(fn):
            continue
        try:
            if "out_sharding" in inspect.signature(fn).parameters:
                names.append(name)
        except (TypeError, ValueError):
            continue
    return tuple(names)


def _patch_methods(rec: Recording, cls: type) -> None:
    """Wraps the class's `out_sharding` methods for this recording (counted: recordings may overlap)."""
    with _HOOKS_LOCK:
        for name in _typed_method_names(cls):
            key = (cls, name)
            if key in rec.patched:
                continue
            entry = _PATCHED.get(key)
            if entry is None:
                own = name in cls.__dict__
                entry = _PATCHED[key] = [cls.__dict__.get(name), own, 0]
                setattr(cls, name, _typed_method(getattr(cls, name), name))
            entry[2] += 1
            rec.patched.append(key)


def _unpatch_methods(rec: Recording) -> None:
    with _HOOKS_LOCK:
        for key in rec.patched:
            entry = _PATCHED[key]
            entry[2] -= 1
            if entry[2] == 0:
                cls, name = key
                if entry[1]:
                    setattr(cls, name, entry[0])
                else:
                    delattr(cls, name)
                del _PATCHED[key]
        rec.patched.clear()


def _install_hooks() -> None:
    from flax.linen import spmd as linen_spmd

    with _HOOKS_LOCK:
        if _HOOKS["count"] == 0:
            _HOOKS["param_codes"] = _param_codes()
            _HOOKS["logical"] = linen_spmd._with_sharding_constraint_one_fallback
            _HOOKS["lax"] = jax.lax.with_sharding_constraint
            _HOOKS["reshard"] = jax.sharding.reshard
            linen_spmd._with_sharding_constraint_one_fallback = _logical_hook
            jax.lax.with_sharding_constraint = _lax_hook
            jax.sharding.reshard = _reshard_hook
        _HOOKS["count"] += 1


def _remove_hooks() -> None:
    from flax.linen import spmd as linen_spmd

    with _HOOKS_LOCK:
        _HOOKS["count"] -= 1
        if _HOOKS["count"] == 0:
            linen_spmd._with_sharding_constraint_one_fallback = _HOOKS.pop("logical")
            jax.lax.with_sharding_constraint = _HOOKS.pop("lax")
            jax.sharding.reshard = _HOOKS.pop("reshard")


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

    def add(index: int, entry: Constraint) -> None:
        variants = found.setdefault((entry.pass_, entry.module, entry.name), [])
        layout = dataclasses.replace(entry, pass_="")
        if any(dataclasses.replace(seen, pass_="") == layout for _, seen in variants):
            return
        if variants and rec.sites[index].named:
            seen = variants[0][1]
            raise ValueError(f"activation {entry.key}: constrained twice with different layouts "
                             f"({seen.shape} {seen.logical_axes} vs {entry.shape} {entry.logical_axes}); "
                             "give each constrain() call in a module its own name")
        variants.append((index, entry))

    for eqn, stack in _constraint_eqns(closed.jaxpr):
        parts = stack.split("/")
        marks = [_site_index(m, rec, stack) for m in map(_MARKER.search, parts) if m]
        if not marks or marks[-1] in rec.typed:
            continue  # a parameter read, a constraint the hooks did not see, or inside a typed call
        site = rec.sites[marks[-1]]
        aval = eqn.invars[0].aval
        add(marks[-1], Constraint(site.module, site.name, _pass_of(parts), tuple(aval.shape), aval.dtype.name,
                                  site.logical_axes, eqn.params["sharding"].spec))
    for index, entry in _typed_outputs(closed, rec):
        add(index, entry)
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


def _site_index(mark: re.Match[str], rec: Recording, stack: str) -> int:
    token, index = int(mark.group(1)), int(mark.group(2))
    if token != rec.token or index >= len(rec.sites):
        raise RuntimeError(f"sharding_constraint at {stack} carries the marker of another trace: a jit-ed "
                           "function placing constraints was reused from jax's trace cache, with shardings "
                           "resolved under whatever rules were active then; do not jit it")
    return index


def _typed_outputs(closed: ClosedJaxpr, rec: Recording) -> Iterator[tuple[int, Constraint]]:
    """The typed call sites: forward, the output's type as noted at the call; backward, the type of its
    cotangent, read from the first transposed equation of the call that consumes an array of the
    output's shape and dtype."""
    if not rec.typed:
        return
    for index, out in sorted(rec.typed.items()):
        site = rec.sites[index]
        yield index, Constraint(site.module, site.name, FORWARD, out.shape, out.dtype,
                                site.logical_axes or (None,) * len(out.shape), out.spec)
    pending = dict(rec.typed)
    for eqn, full in equations(closed.jaxpr):
        parts = "/".join(full).split("/")
        if _pass_of(parts) != BACKWARD:
            continue
        for index in {i for i in (_site_index(m, rec, "/".join(full)) for m in map(_MARKER.search, parts) if m)
                      if i in pending}:
            out = pending[index]
            for var in eqn.invars:
                aval = getattr(var, "aval", None)
                sharding = getattr(aval, "sharding", None)
                if (sharding is not None and tuple(getattr(aval, "shape", ())) == out.shape
                        and aval.dtype.name == out.dtype and _explicit(sharding.mesh)):
                    site = rec.sites[index]
                    del pending[index]
                    yield index, Constraint(site.module, site.name, BACKWARD, out.shape, out.dtype,
                                            site.logical_axes or (None,) * len(out.shape), sharding.spec)
                    break
        if not pending:
            return


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
