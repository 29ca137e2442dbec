"""A serving program: weights and a KV cache built for the slots and lengths it serves, and named steps.

A training program has one state and one step; a server has a state built for the traffic it takes
(the KV cache holds `slots` requests of `max_length` tokens each) and several steps that hand the
cache on to each other: a prefill that writes a prompt's keys and values, an insert that moves a
prefilled request into a decode slot, a generate step that extends every slot by one token. Each
step is the user's own function, traced abstractly on the case's mesh; what it takes and what it
hands back is read from the traced step itself.

* :class:`ServingSettings`: the serving settings, passed to the program's `init` (so the cache is
  built at the slots, lengths, page size and dtype of the case, never at sizes fixed in the program).
* :class:`ServingStep`: one step, `fn(state, inputs, settings) -> (new state, outputs)`, the inputs it takes
  (:class:`~sharding_dump.core.program.Input`, whose shapes may name `slots`, `prefill_length`,
  `max_length`), how many requests one call serves, and the earlier step whose outputs it takes.
* :class:`ServingProgram`: `init(key, settings) -> state` and its steps, in the order a request
  meets them.

:func:`trace_program` traces init and every step once and returns, per step, the layout each state
leaf is taken in and handed back in, the layout of its outputs, and its activation placements.

>>> import jax, jax.numpy as jnp
>>> def init(key, s):
...     return {"weights": jnp.zeros((8, 4)), "cache": jnp.zeros((s.slots, s.max_length, 4))}
>>> def generate(state, inputs, settings):
...     return state, {"next": inputs["tokens"] + 1}
>>> program = ServingProgram(init, {"generate": ServingStep(generate, {"tokens": Input(("slots", 1))})})
>>> list(program.steps), program.steps["generate"].requests
(['generate'], 'slots')
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
from jax.extend.core import ClosedJaxpr
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump.core.capture import Constraint, explicit_mesh, read_constraints, recording
from sharding_dump.core.handback import check_context_mesh, check_mesh, demanded, returned
from sharding_dump.core.tree import path_text, unbox
from sharding_dump.core.program import (ArgName, Input, ProgramError, ServingProgram, ServingSettings, ServingStep, call_text,
                                        describe, user_code)

@dataclasses.dataclass(frozen=True)
class StepTrace:
    """One step as traced: per state leaf path the spec it is taken in (its jit's in_shardings, else the
    state's: a server passes the state it holds) and handed back in (None: not placed, the compiler
    decides), its inputs' and outputs' abstract values (outputs with the spec the step gives them), and
    its activation placements."""

    name: str
    requests: int
    state_in: dict[str, PartitionSpec | None]
    state_out: dict[str, PartitionSpec | None]
    inputs: dict[str, jax.ShapeDtypeStruct]
    outputs: dict[str, tuple[jax.ShapeDtypeStruct, PartitionSpec | None]]
    activations: tuple[Constraint, ...]
    takes: str | None = None


def init_state(program: ServingProgram, settings: ServingSettings, key: Any) -> tuple[Any, ClosedJaxpr]:
    """`init(key, settings)` traced once (call it inside the case's mesh and rules): its abstract state
    and jaxpr. The program's `mesh=`, or a mesh it set with `jax.set_mesh`, in other axis names or
    sizes than the case's is refused first (:func:`~sharding_dump.core.handback.check_context_mesh`;
    init is traced on either mode's mesh, so its axis types are held by :func:`trace_steps`)."""
    check_context_mesh(program.mesh, jax.sharding.get_abstract_mesh(), "ServingProgram(mesh=...)", types=False)
    with user_code("the program's init", call_text("init", [key, settings]),
                   "init(key, settings) returns the serving state: weights and KV cache"):
        closed, shapes = jax.make_jaxpr(lambda k: program.init(k, settings), return_shape=True)(key)
    if not jax.tree.leaves(shapes):
        raise ProgramError(f"the program's init returned {describe(shapes)}, a state with no "
                           "arrays; the interface expects the serving state: weights and KV cache")
    missing = [c for c in program.cache if not (isinstance(shapes, Mapping) and c in shapes)]
    if missing:
        have = ", ".join(map(str, shapes)) if isinstance(shapes, Mapping) else type(shapes).__name__
        raise ProgramError(f"the program's init returned a state without {missing[0]!r} "
                           f"(its top-level keys: {have}); ServingProgram(cache=...) names the keys holding the KV "
                           "cache")
    return shapes, closed


def _flat(tree: Any) -> list[tuple[str, Any]]:
    return [(path_text(k), v) for k, v in jax.tree_util.tree_leaves_with_path(tree)]


def trace_steps(program: ServingProgram, settings: ServingSettings, state: Any, state_in: Mapping[str, PartitionSpec],
                mesh: Any, input_spec: Callable[[Input], PartitionSpec]) -> list[StepTrace]:
    """Every step traced once on `state` (abstract; on an Explicit mesh each leaf carries its layout in
    its type), in order; call inside the case's mesh and rules. `state_in`: {leaf path: the spec the
    server holds it in}; `input_spec` places an input field on an Explicit mesh (a server hands its
    inputs in with some layout). The program's own mesh (`mesh=`, `jax.set_mesh`) is held against
    `mesh` first, axis types too."""
    check_context_mesh(program.mesh, mesh, "ServingProgram(mesh=...)")
    traces: list[StepTrace] = []
    outputs_of: dict[str, Any] = {}
    state = unbox(state)
    for name, step in program.steps.items():
        inputs: dict[str, Any] = {}
        for field, spec in step.inputs.items():
            abstract = spec.sized(settings.sizes())
            if explicit_mesh():
                abstract = jax.ShapeDtypeStruct(abstract.shape, abstract.dtype,
                                                sharding=NamedSharding(mesh, input_spec(spec)))
            inputs[field] = abstract
        if step.takes is not None:
            inputs[step.takes] = outputs_of[step.takes]
        with user_code(f"the program's {name} step", call_text(name, [ArgName("state"), inputs, settings]),
                       f"{name}(state, inputs, settings) returns (new state, outputs)"), recording() as rec:
            closed, (new_state, outputs) = _traced(step.fn, state, inputs, settings, name)
        _check_state(name, state, new_state)
        check_mesh(closed, mesh, f"the program's {name} step")
        count = len(jax.tree.leaves(new_state))
        specs = returned(closed, count + len(jax.tree.leaves(outputs)))
        out_state = {path: spec for (path, _), spec in zip(_flat(new_state), specs[:count])}
        out_leaves = {path: (jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), spec)
                      for (path, leaf), spec in zip(_flat(outputs), specs[count:])}
        outputs_of[name] = jax.tree.map(
            lambda leaf, spec: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))
            if spec is not None and explicit_mesh() else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype),
            outputs, jax.tree.unflatten(jax.tree.structure(outputs), specs[count:]),
            is_leaf=lambda x: x is None)
        try:
            activations = tuple(read_constraints(closed, rec))
        except ValueError as err:
            raise ProgramError(f"the program's {name} step: {err}") from None
        own = demanded(closed, range(len(jax.tree.leaves(state))), placements=False)  # its jit's in_shardings
        taken = {path: own.get(index, state_in.get(path)) for index, (path, _) in enumerate(_flat(state))}
        traces.append(StepTrace(name, step.request_count(settings), taken, out_state,
                                {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _flat(inputs)},
                                out_leaves, activations, step.takes))
    return traces


def _traced(fn: Callable[..., Any], state: Any, inputs: dict[str, Any], settings: ServingSettings,
            name: str) -> tuple[ClosedJaxpr, Any]:
    closed, out = jax.make_jaxpr(lambda s, i: fn(s, i, settings), return_shape=True)(state, inputs)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ProgramError(f"the program's {name} step returned {describe(out)}; the interface expects a pair "
                           "(new state, outputs)")
    return closed, out


def _check_state(name: str, state: Any, new_state: Any) -> None:
    """ProgramError when a step hands back a state of another tree, shape or dtype than it took."""
    old, new = dict(_flat(state)), dict(_flat(new_state))
    expects = "the interface expects the new state to have the tree, shapes and dtypes of the state it was given"
    if old.keys() != new.keys():
        differs = sorted(old.keys() ^ new.keys())
        raise ProgramError(f"the program's {name} step returned a state of another tree than init's: "
                           f"{'missing' if differs[0] in old else 'new'} leaf {differs[0]}; {expects}")
    for path, leaf in old.items():
        if tuple(new[path].shape) != tuple(leaf.shape) or new[path].dtype != leaf.dtype:
            raise ProgramError(f"the program's {name} step returned {describe(new[path])} at {path}, where the state "
                               f"it was given holds {describe(leaf)}; {expects}")


__all__ = ["ServingProgram", "ServingSettings", "ServingStep", "StepTrace", "init_state",
           "trace_steps"]
