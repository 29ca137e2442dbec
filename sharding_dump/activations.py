"""Activation sharding constraints: the one helper every model calls, and reading them back from a trace.

A model constrains an activation with `constrain(x, logical_axes, name)`. Outside a recording it is
flax's logical constraint and nothing more (a no-op while no rules are active, e.g. during `init`).
Inside :func:`recording`, each call also notes its call site (flax module path, name, logical axes)
and wraps the constraint in a named scope that carries the note's number. Every `sharding_constraint`
equation of the traced step that comes from that call (the forward one, its rematerialised copy, the
transposed one on the cotangent) keeps the scope in its name stack, so :func:`read_constraints` can
give each equation its logical axes back. Equations without the scope are the constraints flax adds
when a parameter is read: they are not activations and are left out.

The notes live in the recording object of one trace (a context variable), never in module state, so
one trace cannot see another's notes; a marker from any other recording is an error, not a silent
mismatch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import re
from typing import Iterator, Sequence

import flax.linen as nn
import jax
from flax.linen import module as flax_module
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params
from jax.sharding import PartitionSpec

FORWARD, BACKWARD = "forward", "backward"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_MARKER = re.compile(r"activation:[A-Za-z0-9_.-]+@(\d+)\.(\d+)")
_REMAT_RECOMPUTE = "rematted_computation"  # jax's name-stack entry for forward work redone in the backward pass


@dataclasses.dataclass(frozen=True)
class CallSite:
    """Where `constrain` was called: flax module path ('' at top level), name, logical axes."""

    module: str
    name: str
    logical_axes: tuple[str | None, ...]


@dataclasses.dataclass
class Recording:
    """The call sites noted during one trace, numbered in call order."""

    token: int
    sites: list[CallSite] = dataclasses.field(default_factory=list)

    def note(self, site: CallSite) -> int:
        self.sites.append(site)
        return len(self.sites) - 1


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One activation constraint of the traced step, deduplicated by (pass, module, name)."""

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


_CURRENT: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("activation_recording", default=None)
_TOKENS = itertools.count(1)  # tells one recording's markers from another's


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Notes every `constrain` call made inside the block (i.e. during one trace)."""
    rec = Recording(next(_TOKENS))
    reset = _CURRENT.set(rec)
    try:
        yield rec
    finally:
        _CURRENT.reset(reset)


_PREFIX: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("activation_module_prefix", default=())


@contextlib.contextmanager
def module_prefix(path: Sequence[str]) -> Iterator[None]:
    """Call sites inside the block get `path` in front of their module path: for modules run by a
    detached `Module.apply` (a pipeline stage), whose own paths start again from the root."""
    reset = _PREFIX.set(_PREFIX.get() + tuple(path))
    try:
        yield
    finally:
        _PREFIX.reset(reset)


def _module_path() -> str:
    # flax keeps the module whose method is running on this stack (None at the bottom: no module).
    module = flax_module._context.module_stack[-1]
    return "/".join(_PREFIX.get() + (() if module is None else tuple(module.path)))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], name: str) -> jax.Array:
    """Constrains activation `x` to `logical_axes`; `name` says what it is at the call site."""
    axes = tuple(logical_axes)
    if len(axes) != x.ndim:
        raise ValueError(f"activation {name!r}: {len(axes)} logical axes for a rank-{x.ndim} array")
    if not _NAME.fullmatch(name):
        raise ValueError(f"activation name {name!r}: use letters, digits, '_', '.' or '-'")
    rec = _CURRENT.get()
    if rec is None:
        return nn.with_logical_constraint(x, axes)
    index = rec.note(CallSite(_module_path(), name, axes))
    with jax.named_scope(f"activation:{name}@{rec.token}.{index}"):
        return nn.with_logical_constraint(x, axes)


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


def _constraint_eqns(jaxpr: Jaxpr, stack: tuple[str, ...]) -> Iterator[tuple[JaxprEqn, tuple[str, ...]]]:
    """Every sharding_constraint equation with its full name stack."""
    return ((eqn, full) for eqn, full in equations(jaxpr, stack) if eqn.primitive.name == "sharding_constraint")


def unrecorded_constraints(closed: ClosedJaxpr) -> list[tuple[tuple[int, ...], str, str]]:
    """(shape, dtype, name stack) of every sharding constraint that carries no call-site marker:
    in a traced step, flax's constraints on parameters as they are read."""
    out = []
    for eqn, stack in _constraint_eqns(closed.jaxpr, ()):
        joined = "/".join(stack)
        if not _MARKER.search(joined):
            aval = eqn.invars[0].aval
            out.append((tuple(aval.shape), aval.dtype.name, joined))
    return out


def _pass_of(parts: list[str]) -> str:
    """Backward when under a transpose, unless it is forward work rematerialised there."""
    if _REMAT_RECOMPUTE in parts:
        return FORWARD
    return BACKWARD if any(p.startswith("transpose(") for p in parts) else FORWARD


def read_constraints(closed: ClosedJaxpr, rec: Recording) -> list[Constraint]:
    """The activation constraints of a jaxpr traced inside `rec`, sorted by key.

    The same call site met several times (a forward constraint and its rematerialised copy, a
    layer body traced twice by scan) gives one entry; two different layouts under one key, or a
    noted call site none of whose constraints reached the jaxpr, is an error in the model code."""
    found: dict[str, Constraint] = {}
    for eqn, stack in _constraint_eqns(closed.jaxpr, ()):
        parts = "/".join(stack).split("/")
        marks = [m for m in map(_MARKER.search, parts) if m]
        if not marks:
            continue  # flax's constraint on a parameter as it is read
        token, index = int(marks[-1].group(1)), int(marks[-1].group(2))
        if token != rec.token or index >= len(rec.sites):
            raise RuntimeError(f"sharding_constraint at {'/'.join(stack)} carries the marker of another trace: "
                               "a jit-ed function calling constrain() was reused from jax's trace cache, with "
                               "shardings resolved under whatever rules were active then; do not jit it")
        site = rec.sites[index]
        aval = eqn.invars[0].aval
        entry = Constraint(site.module, site.name, _pass_of(parts), tuple(aval.shape), aval.dtype.name,
                           site.logical_axes, eqn.params["sharding"].spec)
        seen = found.setdefault(entry.key, entry)
        if seen != entry:
            raise ValueError(f"activation {entry.key}: constrained twice with different layouts "
                             f"({seen.shape} {seen.logical_axes} vs {entry.shape} {entry.logical_axes}); "
                             "give each constrain() call in a module its own name")
    traced = {(c.module, c.name) for c in found.values()}
    lost = sorted("/".join(filter(None, site)) for site in {(s.module, s.name) for s in rec.sites} - traced)
    if lost:
        raise ValueError(f"constrain() was called for {', '.join(lost)} but no such constraint reached the "
                         "traced step (is its result unused?)")
    return sorted(found.values(), key=lambda c: c.key)
