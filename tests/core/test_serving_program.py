"""sd.ServingProgram: every argument checked where it is given (one line naming it), and the traced
steps of a tiny server read as the program places its state and hands it back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sharding_dump as sd
from sharding_dump.core.serving import init_state, trace_steps

SETTINGS = sd.ServingSettings(slots=4, max_prefill_length=8, max_length=16)
MESH = AbstractMesh((2,), ("x",), (AxisType.Explicit,))


def tiny_init(key, settings):
    mesh = jax.sharding.get_abstract_mesh()
    return jax.jit(lambda: {"weights": jnp.zeros((8, 4)), "cache": jnp.zeros((settings.slots, settings.max_length, 4))},
                   out_shardings={"weights": NamedSharding(mesh, P()), "cache": NamedSharding(mesh, P("x"))})()


def write(state, inputs, settings):
    update = jax.sharding.reshard(jnp.ones((settings.slots, 1, 4)), P("x"))
    new = jax.lax.dynamic_update_slice(state["cache"], update, (0, 0, 0))
    return {**state, "cache": new}, {"next": inputs["tokens"] + 1}


@pytest.mark.parametrize("build, message", [
    (lambda: sd.ServingSettings(0, 8, 16), r"^ServingSettings\(slots=0\): give a whole number >= 1$"),
    (lambda: sd.ServingSettings(4, 32, 16), r"max_prefill_length=32\): longer than the cache \(max_length=16\)"),
    (lambda: sd.ServingSettings(4, 8, 16, page_size=5),
     r"page_size=5\): give 0 \(no pages\) or a whole number that divides"),
    (lambda: sd.ServingSettings(4, 8, 16, cache_dtype="fp8"), r"cache_dtype='fp8'\): give one of auto, bfloat16"),
    (lambda: sd.ServingStep(write, {"tokens": sd.Input(("batch", 1))}),
     r"field 'tokens' shape entry 'batch': a serving input's sizes are ints or one of slots"),
    (lambda: sd.ServingStep(write, requests=0), r"ServingStep\(requests=0\): give a whole number >= 1 or one of"),
    (lambda: sd.ServingProgram(tiny_init, {}), r"ServingProgram\(steps=\{\}\): give a non-empty mapping"),
    (lambda: sd.ServingProgram(tiny_init, {"write": write}, mesh="x"),
     r"^ServingProgram\(mesh='x'\): give the mesh the program runs on, a jax.sharding.Mesh"),
    (lambda: sd.ServingProgram(tiny_init, {"insert": sd.ServingStep(write, takes="prefill")}),
     r"step 'insert' takes the outputs of 'prefill', which is not an earlier step \(none\)"),
    (lambda: sd.ServingProgram(tiny_init, {"bad name": write}), r"step name 'bad name': give letters, digits"),
])
def test_a_bad_argument_is_one_line_naming_it(build, message):
    with pytest.raises(sd.ProgramError, match=message):
        build()


def traced(program):
    key = jax.eval_shape(lambda: jax.random.key(0))
    with jax.sharding.use_abstract_mesh(MESH):
        shapes, _ = init_state(program, SETTINGS, key)
        held = {"weights": P(), "cache": P("x")}
        state = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(MESH, held[k]))
                 for k, v in shapes.items()}
        return trace_steps(program, SETTINGS, state, held, MESH, lambda field: P())


def test_a_step_is_read_as_it_hands_the_state_back():
    generate = sd.ServingStep(write, {"tokens": sd.Input(("slots", 1))})
    (step,) = traced(sd.ServingProgram(tiny_init, {"generate": generate}))
    assert step.state_in == {"weights": P(), "cache": P("x")}
    assert step.state_out["cache"] == P("x", None, None) and step.requests == 4
    outputs = {k: (tuple(v.shape), tuple(spec)) for k, (v, spec) in step.outputs.items()}
    assert outputs == {"next": ((4, 1), (None, None))}


def test_a_step_handing_back_another_tree_is_one_line():
    def drops(state, inputs, settings):
        return {"weights": state["weights"]}, {}

    with pytest.raises(sd.ProgramError, match=r"the program's generate step returned a state of another tree than "
                                              r"init's: missing leaf cache; the interface expects"):
        traced(sd.ServingProgram(tiny_init, {"generate": drops}))


def test_an_init_without_the_cache_key_is_one_line():
    with pytest.raises(sd.ProgramError, match=r"returned a state without 'cache' \(its top-level keys: kv, weights\); "
                                              r"ServingProgram\(cache=...\) names the keys"):
        traced(sd.ServingProgram(lambda key, s: {"weights": jnp.zeros(2), "kv": jnp.zeros(2)}, {"generate": write}))


def test_an_insert_takes_the_prefill_outputs_as_they_came_out():
    """MaxEngine's order: a prefill of one prompt hands its cache out (split over its sequence), an insert
    takes it (takes='prefill') and writes it into a slot of the state's cache (split over slots)."""

    def prefill(state, inputs, settings):
        prefix = jax.sharding.reshard(jnp.zeros((1, settings.max_length, 4)), P(None, "x"))
        return state, {"cache": prefix}

    def insert(state, inputs, settings):
        prefix = jax.sharding.reshard(inputs["prefill"]["cache"], P())  # the program's own reshard
        update = jax.sharding.reshard(jnp.broadcast_to(prefix, state["cache"].shape), P("x"))
        return {**state, "cache": jax.lax.dynamic_update_slice(state["cache"], update, (0, 0, 0))}, {}

    steps = {"prefill": sd.ServingStep(prefill, {"tokens": sd.Input((1, "prefill_length"))}, requests=1),
             "insert": sd.ServingStep(insert, takes="prefill"),
             "generate": sd.ServingStep(write, {"tokens": sd.Input(("slots", 1))})}
    program_steps = traced(sd.ServingProgram(tiny_init, steps))
    first, second, _ = program_steps
    (leaf, spec), = first.outputs.values()
    assert tuple(leaf.shape) == (1, 16, 4) and spec == P(None, "x", None) and first.requests == 1
    assert second.takes == "prefill" and set(second.inputs) == {"prefill/cache"}
    # the prompt's cache reaches the state's layout only through the insert's reshard: a hand-off of one
    # request's 256 bytes, of which the device that moves most receives its other half (128 bytes)
    from sharding_dump.core.layout import TensorLayout
    from sharding_dump.zoo import serving

    layouts = tuple(TensorLayout(path, shape, "float32", (None,) * len(shape), spec, {"x": 2})
                    for path, shape, spec in (("weights", (8, 4), P()), ("cache", (4, 16, 4), P("x"))))
    moved = serving.handoffs(serving.Traced(SETTINGS, layouts, tuple(program_steps), ("cache",)), {"x": 2})
    assert {pair: [(m.path, m.bytes_per_request, m.back.moved_bytes) for m in found] for pair, found in moved.items()} \
        == {"prefill.insert": [("prefill/cache", 256, 128)], "insert.generate": [], "generate.generate": []}


def test_a_step_whose_jit_takes_the_cache_in_another_layout_records_it():
    """A generate step jitted with in_shardings of its own takes the cache replicated where the state
    holds it split over x: its `in` is the step's layout, so the golden and the hand-off see it."""

    def generate(state, inputs, settings):
        mesh = jax.sharding.get_abstract_mesh()
        whole = NamedSharding(mesh, P())
        step = jax.jit(lambda s: s, in_shardings=({"weights": whole, "cache": whole},))
        return step(state), {}

    (step,) = traced(sd.ServingProgram(tiny_init, {"generate": generate}))
    assert step.state_in == {"weights": P(), "cache": P()}
