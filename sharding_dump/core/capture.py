"""Activation placements read from the traced step itself, whatever API placed them.

The step is traced once (`jax.make_jaxpr`) and its equations are read, in nested jaxprs too (scan,
remat, jit, custom_vjp, shard_map, cond bodies). An equation places an activation when it is

* a `sharding_constraint` (`jax.lax.with_sharding_constraint`, flax's `nn.with_logical_constraint`,
  :func:`constrain` on an Auto mesh): the layout is the constraint's;
* on a mesh with Explicit axes (sharding in types), a `reshard` (`jax.sharding.reshard`, the way out of
  `auto_axes`/`explicit_axes`), or any operation given an output sharding (`dot_general` of an
  `einsum(..., out_sharding=)`, the `gather` of `.at[].get(out_sharding=)`, a `reshape` or
  `broadcast_in_dim` with one): the layout is its output's type.

Forward and backward are told apart by the equations' name stacks (`transpose(...)`, except forward work
rematerialised there). A constraint's backward entry is the transposed constraint; a typed placement's
is the type of its cotangent (the first transposed equation of the same call site that consumes an
array of the output's shape and dtype).

**Keys**, `<pass>/<module path>/<name>`:

* module path: while a recording is open every linen module method runs under a named scope holding
  the module's path (`flax.linen.intercept_methods`, a public API); a placement outside any linen
  module (pure functions, NNX modules, which keep no module stack) has none;
* name: the one given to :func:`constrain`; for flax's `with_logical_constraint` whose logical axes are
  written as a literal at the call, those axes joined by '.' (`batch.length.mlp`); otherwise the call
  site, `<primitive>-<function>-L<n>` (the qualified name of the innermost function outside jax and flax
  that placed it and its line counted from that function's first line, read from the equation's
  source info), so distinct call sites are distinct keys, independent of call order and of code moved
  elsewhere. One name with several layouts gets `-2`, `-3`, ... in trace order.

Left out: constraints flax places when a parameter is read or created (boxed parameters,
`param_with_axes`, `shard_value`), found by flax's frames in the equation's traceback; scalars; and
typed equations jax places for itself with no program frame on the stack (a gradient's seed).

Nothing is patched: :func:`recording` only installs a linen method interceptor (`nn.intercept_methods`)
for the module scopes, and :func:`constrain` marks its own calls with a named scope carrying the
recording's token, so that a jit-ed function traced under another recording (whose shardings were
resolved under other rules) is refused rather than misread.

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

import ast
import contextlib
import contextvars
import dataclasses
import functools
import itertools
import linecache
import os
import re
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import quote, unquote

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump.core.legacy_mesh import legacy_mesh

FORWARD, BACKWARD = "forward", "backward"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_MARKER = re.compile(r"activation:[A-Za-z0-9_.-]+@(\d+)\.(\d+)")
_MODULE_SCOPE = "sharding_dump.module:"
_MODULE = re.compile(re.escape(_MODULE_SCOPE) + r"([^/()]*)")
_REMAT_RECOMPUTE = "rematted_computation"  # jax's name-stack entry for forward work redone in the backward pass
_TYPED_PARAMS = ("dst_sharding", "out_sharding", "sharding")  # where an equation keeps the sharding it gives
_CARRIERS = frozenset({"transpose", "convert_element_type", "copy"})  # what a call may do to a placed output
_LOGICAL_CALLS = frozenset({"with_logical_constraint", "with_sharding_constraint"})  # flax's, by any import


@dataclasses.dataclass(frozen=True)
class CallSite:
    """A :func:`constrain` call: its given name and logical axes, whether flax resolved them under the
    trace's own rules (not under rules the program set for a block of its own), and the rank of the
    array it placed (a transform such as vmap adds dimensions, and mesh axes, to the placement)."""

    name: str
    logical_axes: tuple[str | None, ...]
    traced_rules: bool = False
    ndim: int = -1


@dataclasses.dataclass
class Recording:
    """The :func:`constrain` calls noted during one trace, numbered in call order, the trace's logical
    axis rules, and whether they reached the trace otherwise than as the specs of constrain() calls
    (see :func:`resolved`): read by anything else, or a constrain() placement that is not their
    resolution of its logical axes (transformed, e.g. by vmap), as :func:`read_constraints` finds."""

    token: int
    sites: list[CallSite] = dataclasses.field(default_factory=list)
    rules: tuple[tuple[str, Any], ...] | None = None
    rules_read: bool = False

    def note(self, site: CallSite) -> int:
        self.sites.append(site)
        return len(self.sites) - 1


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One activation placement of a traced function, deduplicated by (pass, module, name)."""

    module: str
    name: str
    pass_: str  # forward | backward
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...]
    partition_spec: PartitionSpec
    resolvable: bool = False  # a constrain() call's constraint under the trace's rules: its spec is theirs
    vmapped: int = 0  # the leading dimensions a transform (vmap) added to the array a constrain() call placed

    @property
    def key(self) -> str:
        """`<pass>/<module path>/<name>`, e.g. `forward/decoder/layers/self_attention/query`."""
        return "/".join(part for part in (self.pass_, self.module, self.name) if part)


_CURRENT: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("sharding_dump_recording", default=None)
_RESOLVING: contextvars.ContextVar[bool] = contextvars.ContextVar("sharding_dump_resolving", default=False)
_PREFIX: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("sharding_dump_module_prefix", default=())
_TOKENS = itertools.count(1)  # tells one recording's markers from another's


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Notes the :func:`constrain` calls of the block (i.e. of one trace) and marks every linen module
    method called in it with its module path."""
    import flax.linen as nn

    rec = Recording(next(_TOKENS))
    reset = _CURRENT.set(rec)
    try:
        with nn.intercept_methods(_module_scope):
            yield rec
    finally:
        _CURRENT.reset(reset)


@contextlib.contextmanager
def module_prefix(path: Sequence[str]) -> Iterator[None]:
    """Placements inside the block get `path` in front of their module path: for modules run by a
    detached `Module.apply` (e.g. a pipeline stage), whose own paths start again from the root."""
    reset = _PREFIX.set(_PREFIX.get() + tuple(path))
    try:
        if _CURRENT.get() is None:
            yield
        else:
            with jax.named_scope(_module_scope_name(())):
                yield
    finally:
        _PREFIX.reset(reset)


def note_nnx_modules(root: Any) -> None:
    """Kept for programs written against earlier releases: it does nothing. NNX modules keep no module
    stack, so their placements are keyed by call site (see the module docstring)."""
    del root


def _module_scope_name(path: Sequence[Any]) -> str:
    full = _PREFIX.get() + tuple(str(p) for p in path)
    return _MODULE_SCOPE + "|".join(quote(p, safe="") for p in full)


def _module_scope(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    """Runs a linen module method under a named scope holding the module's path. A method called on an
    unbound module (no scope, so no path: a helper of the model called outside `apply`, as Kauldron's
    training step does) runs in the scope of its caller."""
    if _CURRENT.get() is None or context.module.scope is None:
        return next_fun(*args, **kwargs)
    with jax.named_scope(_module_scope_name(context.module.path)):
        return next_fun(*args, **kwargs)


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
    reset = _RESOLVING.set(True)  # the trace's rules, read here, are read again by resolved()
    try:
        rules = nn.get_logical_axis_rules()
        traced = isinstance(rules, _TraceRules) and rules.recording is _CURRENT.get()
        if explicit_mesh():
            return _named(lambda: jax.sharding.reshard(x, nn.logical_to_mesh_axes(axes + (None,) * (x.ndim - len(axes)))),
                          name, axes, ndim=x.ndim)
        if not rules:  # flax places nothing without rules: no constraint to note, none lost
            return x
        return _named(lambda: nn.with_logical_constraint(x, axes), name, axes, traced, x.ndim)
    finally:
        _RESOLVING.reset(reset)


def constrain_spec(x: jax.Array, spec: PartitionSpec | NamedSharding, name: str) -> jax.Array:
    """`x` placed on the physical `spec` (a constraint, or a reshard on an Explicit-axis mesh), noted
    under `name` with unknown logical axes: for a layout given in mesh axes, such as the data
    pipeline's (a NamedSharding: on its mesh)."""
    _check_name(name)
    if explicit_mesh():
        return _named(lambda: jax.sharding.reshard(x, spec), name, (None,) * x.ndim, ndim=x.ndim)
    return _named(lambda: jax.lax.with_sharding_constraint(x, spec), name, (None,) * x.ndim, ndim=x.ndim)


def explicit_mesh() -> bool:
    """True while the current abstract mesh has Explicit axes (sharding in types)."""
    return _explicit(jax.sharding.get_abstract_mesh())


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"activation name {name!r}: use letters, digits, '_', '.' or '-'")


def _named(place: Callable[[], Any], name: str, axes: tuple[str | None, ...], traced_rules: bool = False,
           ndim: int = -1) -> Any:
    """Runs `place` under a named scope that marks its equations as the named call site."""
    rec = _CURRENT.get()
    if rec is None:
        return place()
    index = rec.note(CallSite(name, axes, traced_rules, ndim))
    with jax.named_scope(f"activation:{name}@{rec.token}.{index}"):
        return place()


def _explicit(mesh: Any) -> bool:
    return any(kind == jax.sharding.AxisType.Explicit for kind in getattr(mesh, "axis_types", ()))


# --- reading the jaxpr --------------------------------------------------------------------------------

def equations(jaxpr: Jaxpr | ClosedJaxpr, stack: tuple[str, ...] = ()) -> Iterator[tuple[JaxprEqn, tuple[str, ...]]]:
    """Every equation, in nested jaxprs too (scan, remat, jit, shard_map, custom_vjp, cond), with its
    full name stack (a child's stack is relative to its parent's)."""
    for eqn, full, _, _ in _equations(jaxpr, stack):
        yield eqn, full


def _equations(jaxpr: Jaxpr | ClosedJaxpr, stack: tuple[str, ...]) -> Iterator[tuple[JaxprEqn, tuple[str, ...],
                                                                                       list[JaxprEqn], int]]:
    """:func:`equations`, each with the equations of its own jaxpr and its index there."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    siblings = inner.eqns
    for index, eqn in enumerate(siblings):
        own = str(eqn.source_info.name_stack)
        full = stack + (own,) if own else stack
        yield eqn, full, siblings, index
        for sub in jaxprs_in_params(eqn.params):
            yield from _equations(sub, full)


def _result(eqn: JaxprEqn, siblings: list[JaxprEqn], index: int, chain: tuple[str, ...]) -> Any:
    """The output of the call that placed `eqn`: its own, or that of the equations right after it in the
    same call that carry it on (jnp.einsum contracts with `out_sharding` in the contraction's axis order
    and then transposes to the order asked for)."""
    out = eqn.outvars[0]
    for follower in siblings[index + 1:]:
        if (follower.primitive.name not in _CARRIERS or out not in follower.invars
                or _origin(follower).chain != chain):
            break
        out = follower.outvars[0]
    return out.aval


def _pass_of(parts: list[str]) -> str:
    """Backward when under a transpose, unless it is forward work rematerialised there."""
    if _REMAT_RECOMPUTE in parts:
        return FORWARD
    return BACKWARD if any(p.startswith("transpose(") for p in parts) else FORWARD


def _placement(eqn: JaxprEqn) -> tuple[bool, Any] | None:
    """(typed, sharding) of an equation that places its output: a constraint (typed False), or an
    equation giving its output a sharding on a mesh with Explicit axes (typed True)."""
    if eqn.primitive.name == "sharding_constraint":
        sharding = eqn.params.get("sharding")
        return (False, sharding) if isinstance(sharding, NamedSharding) else None
    params = eqn.params
    for name in _TYPED_PARAMS:
        sharding = params.get(name)
        if sharding is not None:
            if isinstance(sharding, NamedSharding) and _explicit(sharding.mesh):
                return True, sharding
            return None
    return None


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    import flax
    import jaxlib

    return tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib, flax)) + (__file__,)


@functools.lru_cache(maxsize=4096)
def _is_library(file_name: str) -> bool:
    """jax, jaxlib, flax, this module, and Python's own library (jax wraps some functions in a
    `contextlib` decorator), but not what is installed beside it (site-packages: a program may be)."""
    if file_name.startswith(_library_dirs()):
        return True
    return file_name.startswith(_STDLIB) and not any(d in file_name for d in ("site-packages", "dist-packages"))


_STDLIB = os.path.dirname(contextlib.__file__) + os.sep


@functools.cache
def _flax_dir() -> str:
    import flax

    return os.path.dirname(flax.__file__) + os.sep


@dataclasses.dataclass(frozen=True)
class _Origin:
    """What an equation's traceback says: the program frames that placed it, innermost first, each as
    `<function>-L<n>` (empty when only library frames are on the stack), the innermost one's file and
    line, whether flax was reading a parameter or placing a logical constraint, and whether the library
    function the program called takes an output sharding."""

    chain: tuple[str, ...]
    file: str | None
    line: int
    parameter: bool
    logical: bool
    sharding_argument: bool


_SHARDING_ARGUMENTS = frozenset({"out_sharding", "out_shardings", "sharding", "dst_sharding"})


def _origin(eqn: JaxprEqn) -> _Origin:
    traceback = eqn.source_info.traceback
    if traceback is None:
        return _Origin((), None, 0, False, False, False)
    codes, lastis = traceback.raw_frames()
    flax_dir = _flax_dir()
    chain: list[str] = []
    file, line, parameter, logical, argument, entered = None, 0, False, False, False, None
    for code, lasti in zip(codes, lastis):
        name = code.co_filename
        if _is_library(name):
            if name.startswith(flax_dir):
                parameter = parameter or _is_parameter_frame(name, code.co_qualname)
                logical = logical or code.co_name == "with_logical_constraint"
            if not chain:
                entered = code
            continue
        number = traceback.code_addr2line(code, lasti)
        if not chain:
            file, line = name, number
            argument = entered is not None and not _SHARDING_ARGUMENTS.isdisjoint(
                entered.co_varnames[:entered.co_argcount + entered.co_kwonlyargcount] + entered.co_freevars)
        chain.append(re.sub(r"[^A-Za-z0-9_.-]", "_", f"{code.co_qualname}-L{number - code.co_firstlineno}"))
    return _Origin(tuple(chain), file, line, parameter, logical, argument)


def _site_labels(chains: set[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """A label per call chain: its innermost call site, preceded by as many callers as it takes to tell
    it from the other chains through that site (a helper such as an `einsum` wrapper called from two
    places gives two labels, `attention-L9.einsum-L2` and `mlp-L3.einsum-L2`)."""
    labels = {}
    for chain in chains:
        others = [c for c in chains if c != chain and c[0] == chain[0]]
        depth = 1
        while depth < len(chain) and any(c[:depth] == chain[:depth] for c in others):
            depth += 1
        labels[chain] = ".".join(reversed(chain[:depth]))
    return labels


def _is_parameter_frame(file_name: str, function_name: str) -> bool:
    """flax constraining a parameter as it is read or created: a box's `unbox`, `shard_value`, or the
    older partitioning API (`param_with_axes`, `variable_with_axes`)."""
    return (function_name.rsplit(".", 1)[-1] in ("unbox", "shard_value")
            or file_name.endswith(os.path.join("linen", "partitioning.py")))


def _literal_axes(file_name: str, line: int) -> tuple[str | None, ...] | None:
    """The logical axes of the flax logical-constraint call at `file_name:line`, when the program writes
    them there as a literal (`nn.with_logical_constraint(h, ("batch", "length", "mlp"))`); else None."""
    linecache.checkcache(file_name)
    found = _logical_calls("".join(linecache.getlines(file_name)))
    spans = [(end - start, axes) for start, end, axes in found if start <= line <= end]
    if not spans:
        return None
    spans.sort(key=lambda s: s[0])
    if len(spans) > 1 and spans[0][0] == spans[1][0]:
        return None  # two such calls on one line: not told apart
    return spans[0][1]


@functools.lru_cache(maxsize=64)
def _logical_calls(source: str) -> tuple[tuple[int, int, tuple[str | None, ...] | None], ...]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name not in _LOGICAL_CALLS:
            continue
        given = node.args[1] if len(node.args) > 1 else next(
            (k.value for k in node.keywords if k.arg == "logical_axis_resources"), None)
        out.append((node.lineno, node.end_lineno or node.lineno, _axes_literal(given)))
    return tuple(out)


def _axes_literal(node: ast.AST | None) -> tuple[str | None, ...] | None:
    if node is None:
        return None
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return None
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _derived_name(logical_axes: Sequence[Any]) -> str:
    text = ".".join("_" if a is None else str(a) for a in logical_axes) or "scalar"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def _module_of(stack: str) -> str:
    found = _MODULE.findall(stack)
    return "/".join(unquote(p) for p in found[-1].split("|")) if found and found[-1] else ""


def _site_index(mark: re.Match[str], rec: Recording, stack: str) -> int:
    token, index = int(mark.group(1)), int(mark.group(2))
    if token != rec.token or index >= len(rec.sites):
        raise RuntimeError(f"sharding_constraint at {stack} carries the marker of another trace: a jit-ed "
                           "function placing constraints was reused from jax's trace cache, with shardings "
                           "resolved under whatever rules were active then; do not jit it")
    return index


def _spec_of(aval: Any) -> PartitionSpec | None:
    sharding = getattr(aval, "sharding", None)
    if sharding is None or not _explicit(getattr(sharding, "mesh", None)):
        return None
    return sharding.spec


@dataclasses.dataclass
class _Placed:
    """A placing equation met in the walk, before its call site is labelled."""

    pass_: str
    module: str
    site: Any  # the call chain (a tuple), or `@<index>` for a constrain() call
    name: str | None  # known for constrain() calls
    logical_axes: tuple[str | None, ...] | None
    primitive: str
    typed: bool
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec
    resolvable: bool = False  # a constrain() call's constraint resolved under the trace's rules
    vmapped: int = 0  # leading dimensions a transform added to the array the constrain() call placed


def read_constraints(closed: ClosedJaxpr, rec: Recording) -> list[Constraint]:
    """The activation placements of a jaxpr traced inside `rec`, sorted by key.

    The same call site met several times (a forward placement and its rematerialised copy, a layer body
    traced twice by scan, the layers of a Python loop) gives one entry. Two layouts under one derived
    name get `-2`, `-3`... in trace order; under one given name (:func:`constrain`) they are an error in
    the model code, and so is a named call site none of whose placements reached the jaxpr."""
    placed, transposed = _walk(closed, rec)
    labels = _site_labels({p.site for p in placed if isinstance(p.site, tuple)})
    found: dict[tuple[str, str, str], list[Constraint]] = {}
    typed: dict[tuple[str, Any], list[Constraint]] = {}  # call site -> its typed forward entries

    def add(entry: Constraint, named: bool) -> Constraint:
        variants = found.setdefault((entry.pass_, entry.module, entry.name), [])
        layout = dataclasses.replace(entry, pass_="")
        for seen in variants:
            if dataclasses.replace(seen, pass_="") == layout:
                return seen
        if variants and named:
            seen = variants[0]
            raise ValueError(f"activation {entry.key}: constrained twice with different layouts "
                             f"({seen.shape} {seen.logical_axes} vs {entry.shape} {entry.logical_axes}); "
                             "give each constrain() call in a module its own name")
        variants.append(entry)
        return entry

    for p in placed:
        name, axes = p.name, p.logical_axes
        if name is None:
            if axes is None:
                axes, name = (None,) * len(p.shape), f"{p.primitive}-{labels[p.site]}"
            else:
                name = _derived_name(axes)
        entry = add(Constraint(p.module, name, p.pass_, p.shape, p.dtype, axes, p.spec, p.resolvable, p.vmapped),
                    p.name is not None)
        if p.typed and p.pass_ == FORWARD and entry not in typed.setdefault((p.module, p.site), []):
            typed[(p.module, p.site)].append(entry)
    for entry, named in _cotangents(transposed, typed, rec):
        add(entry, named)
    return _numbered(found, rec)


def _walk(closed: ClosedJaxpr, rec: Recording) -> tuple[list[_Placed], list[tuple[JaxprEqn, str]]]:
    """The placing equations of the jaxpr in trace order, and the transposed equations that may carry
    a typed placement's cotangent."""
    placed: list[_Placed] = []
    transposed: list[tuple[JaxprEqn, str]] = []
    any_typed = False  # transposed equations matter only after a typed placement (they follow it)
    for eqn, full, siblings, index in _equations(closed, ()):
        found = _placement(eqn)
        if found is None and not (full and any_typed):
            continue
        stack = "/".join(full)
        parts = stack.split("/")
        pass_ = _pass_of(parts)
        if pass_ == BACKWARD and (found is None or found[0]):
            transposed.append((eqn, stack))
            continue
        if found is None:
            continue
        is_typed, sharding = found
        any_typed = any_typed or is_typed
        aval = eqn.outvars[0].aval
        shape = tuple(getattr(aval, "shape", ()))
        if not shape:
            continue  # a scalar (e.g. a gradient's seed) is no activation
        marks = [m for m in map(_MARKER.search, parts) if m]
        if marks:
            index = _site_index(marks[-1], rec, stack)
            site = rec.sites[index]
            placed.append(_Placed(pass_, _module_of(stack), f"@{index}", site.name, site.logical_axes,
                                  eqn.primitive.name, is_typed, shape, aval.dtype.name, sharding.spec,
                                  site.traced_rules and not is_typed and _resolves(site, sharding.spec, len(shape), rec),
                                  max(len(shape) - site.ndim, 0) if site.ndim >= 0 else 0))
            continue
        origin = _origin(eqn)
        if origin.parameter or not origin.chain or (is_typed and not origin.sharding_argument):
            continue  # a parameter read, or a sharding jax chose itself
        axes = None
        if origin.logical and not is_typed and origin.file is not None:
            axes = _literal_axes(origin.file, origin.line)
            axes = axes if axes is not None and len(axes) == len(shape) else None
        spec = sharding.spec
        if is_typed:
            aval = _result(eqn, siblings, index, origin.chain)
            shape, spec = tuple(aval.shape), _spec_of(aval)
            if spec is None:
                continue
        placed.append(_Placed(pass_, _module_of(stack), origin.chain, None, axes, eqn.primitive.name, is_typed,
                              shape, aval.dtype.name, spec))
    return placed, transposed


def _resolves(site: CallSite, spec: PartitionSpec, rank: int, rec: Recording) -> bool:
    """True when a constrain() placement made under the trace's rules is their resolution of its logical
    axes on an array of the rank it was called with: what :func:`resolved` computes again under other
    rules. Otherwise (a transform placed it otherwise) the rules reached the trace another way."""
    import flax.linen as nn

    from sharding_dump.core.specs import spec_to_json

    if rec.rules is not None and rank == site.ndim and len(spec) <= rank:
        plain = nn.logical_to_mesh_axes(site.logical_axes, rec.rules)
        if spec_to_json(plain, site.ndim) == spec_to_json(spec, site.ndim):
            return True
    rec.rules_read = True
    return False


def _cotangents(transposed: list[tuple[JaxprEqn, str]], typed: dict[tuple[str, Any], list[Constraint]],
                rec: Recording) -> Iterator[tuple[Constraint, bool]]:
    """The backward entries of typed placements: the type of the cotangent, read from the first
    transposed equation of the same call site that consumes an array of the output's shape and dtype."""
    pending = {(module, site, i): entry for (module, site), entries in typed.items() for i, entry in enumerate(entries)}
    for eqn, stack in transposed:
        if not pending:
            return
        shapes = {(c.shape, c.dtype) for c in pending.values()}
        inputs = {}
        for var in eqn.invars:
            aval = getattr(var, "aval", None)
            if aval is not None and hasattr(aval, "shape") and (tuple(aval.shape), aval.dtype.name) in shapes:
                inputs.setdefault((tuple(aval.shape), aval.dtype.name), _spec_of(aval))
        if not any(spec is not None for spec in inputs.values()):
            continue
        parts = stack.split("/")
        marks = [m for m in map(_MARKER.search, parts) if m]
        site: Any = f"@{_site_index(marks[-1], rec, stack)}" if marks else _origin(eqn).chain
        module = _module_of(stack)
        for key in [k for k in pending if k[0] == module and k[1] == site]:
            entry = pending[key]
            spec = inputs.get((entry.shape, entry.dtype))
            if spec is not None:
                del pending[key]
                yield dataclasses.replace(entry, pass_=BACKWARD, partition_spec=spec), bool(marks)


def _numbered(found: dict[tuple[str, str, str], list[Constraint]], rec: Recording) -> list[Constraint]:
    out = []
    for variants in found.values():
        for rank, entry in enumerate(variants):
            out.append(entry if rank == 0 else dataclasses.replace(entry, name=f"{entry.name}-{rank + 1}"))
    traced = {c.name for c in out}
    lost = sorted(s.name for s in rec.sites if s.name not in traced)
    if lost:
        raise ValueError(f"constrain() was called for {', '.join(dict.fromkeys(lost))} but no such constraint "
                         "reached the traced step (is its result unused?)")
    return sorted(out, key=lambda c: c.key)


def record_activations(fn: Callable[..., Any], *args: Any, mesh: Any, rules: Any) -> list[Constraint]:
    """Every activation placement met while tracing `fn(*args)` on `mesh` (an `AbstractMesh` is
    enough) under the logical axis `rules`; `args` may be abstract (`jax.ShapeDtypeStruct`)."""
    closed, rec = trace(fn, *args, mesh=mesh, rules=rules)
    return read_constraints(closed, rec)


def trace(fn: Callable[..., Any], *args: Any, mesh: Any, rules: Any) -> tuple[ClosedJaxpr, Recording]:
    """The jaxpr of `fn(*args)` traced on `mesh` under `rules`, and its recording. The mesh is also the
    legacy `with mesh:` one (:mod:`sharding_dump.core.legacy_mesh`), so helpers gated on it constrain.
    The recording says whether anything but :func:`constrain` read the rules (see :func:`resolved`)."""
    import flax.linen as nn

    from sharding_dump.core.layout import rules_of

    abstract = mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh
    with jax.sharding.use_abstract_mesh(abstract), legacy_mesh(abstract), recording() as rec:
        rec.rules = rules_of(rules)
        with nn.logical_axis_rules(_TraceRules(rec.rules, rec)):
            closed = jax.make_jaxpr(fn)(*args)
    return closed, rec


class _TraceRules(tuple):  # type: ignore[type-arg]
    """The logical axis rules of one trace, given to flax as they are (pairs of logical name and mesh
    axes), that note on the trace's recording any read other than :func:`constrain`'s own: flax's
    `with_logical_constraint` called by the program or by flax itself, `nn.logical_to_mesh_axes`
    (e.g. for a shard_map's specs), `nn.get_logical_axis_rules()` read to derive other rules. Every
    way to read a tuple subclass goes through its methods (CPython reads a tuple in place only when it
    is exactly `tuple`), each of which notes the read (:data:`_TUPLE_READS`)."""

    recording: Recording

    def __new__(cls, pairs: tuple[tuple[str, Any], ...], recording: Recording) -> "_TraceRules":
        made = super().__new__(cls, pairs)
        made.recording = recording
        return made

    def __radd__(self, other: Any) -> Any:  # `pairs + rules`: tuple has no __radd__ of its own
        return tuple(other) + tuple(self)


_TUPLE_READS = ("__iter__", "__getitem__", "__len__", "__contains__", "__eq__", "__ne__", "__lt__", "__le__",
                "__gt__", "__ge__", "__hash__", "__add__", "__mul__", "__rmul__", "__repr__", "__getnewargs__",
                "__reduce__", "__reduce_ex__", "count", "index")


def _noting(name: str) -> Callable[..., Any]:
    """`tuple.<name>`, noting on the trace's recording that its rules were read (outside constrain())."""
    read = getattr(tuple, name)

    def method(self: _TraceRules, *args: Any) -> Any:
        if not _RESOLVING.get():
            self.recording.rules_read = True
        return read(self, *args)

    method.__name__ = method.__qualname__ = name
    return method


for _name in _TUPLE_READS:
    setattr(_TraceRules, _name, _noting(_name))


def resolved(constraints: Sequence[Constraint], rules: Any) -> tuple[Constraint, ...]:
    """`constraints` read from a trace whose rules reached it only as the specs of constrain() calls
    (`Recording.rules_read` false after :func:`read_constraints`), as the same trace under `rules`
    gives them: the program took the same path whatever the rules, so only the spec of each such
    constraint changes, and that spec is flax's resolution of its logical axes, made again here under
    `rules`. Every other placement stays as traced."""
    import flax.linen as nn

    from sharding_dump.core.layout import rules_of

    pairs = rules_of(rules)
    return tuple(dataclasses.replace(c, partition_spec=nn.logical_to_mesh_axes(c.logical_axes, pairs))
                 if c.resolvable else c for c in constraints)
