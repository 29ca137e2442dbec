"""Serving cases: jax-llm-examples' Llama 3 (examples/llama3_serving.py) through sd.ServingProgram, its
committed golden, and the three layout regressions a server meets: a cache rule changed, a prefill
that hands the cache back replicated, a generate step that keeps it in another layout than prefill."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import REPO, cache_resharded, forget_programs
from sharding_dump.golden.engine import check_or_update_folder
from sharding_dump.zoo import dump, serving
from sharding_dump.zoo.case import golden_dir
from sharding_dump.zoo.matrix import load_matrix

CASES = REPO / "examples/serving_cases.yml"


def example_case():
    (case,) = load_matrix(CASES)
    return case


def golden_report(case) -> str:
    """The committed golden against a fresh dump: '' when equal, else the report."""
    outcome = check_or_update_folder(golden_dir(case, REPO / "golden"), dump.render_case(case), update=False)
    return "" if outcome.status == "match" else outcome.report


def test_the_example_dumps_through_the_serving_interface(fresh):
    """Weights and int8 cache as llama3_jax's own rules place them; both steps hand the cache back as
    they took it, so no hand-off moves anything."""
    docs = dump.dump_case(example_case())
    named = docs["named_shardings.json"]
    assert named["tensors"]["cache/k/0/quant"]["partition_spec"] == ["x", "y", None, None]  # batch, kv_heads
    assert named["tensors"]["cache/k/0/quant"]["dtype"] == "int8"
    assert set(named["per_device_bytes"]) == {"weights", "cache", "total"}
    steps = docs["serving_steps.json"]
    assert list(steps["steps"]) == ["prefill", "generate"]
    assert steps["serving"] == {"slots": 8, "max_prefill_length": 16, "max_length": 64, "page_size": 0,
                                "cache_dtype": "int8"}
    assert steps["tensors"]["prefill/input/tokens"]["shape"] == [8, 16]
    assert steps["tensors"]["generate/state/cache/v/1/quant"] == {"in": ["x", "y", None, None],
                                                                  "out": ["x", "y", None, None]}
    assert all(h["leaves_moved"] == 0 for h in steps["handoffs"].values())
    assert steps["cache_bytes"]["per_device"] == named["per_device_bytes"]["cache"]
    assert any(key.startswith("generate/activation/forward/") for key in steps["tensors"])
    assert golden_report(example_case()) == ""


def test_a_change_of_the_cache_rule_fails_the_golden(fresh):
    """llama3_jax's own rule for kv_heads removed: the cache is no longer split over y."""
    from examples import llama3_serving as ls

    fresh.setattr(ls, "RULES", dataclasses.replace(ls.RULES, kv_heads=None))
    report = golden_report(example_case())
    assert "cache/k/0/quant" in report and 'golden ["x","y",null,null]  now ["x",null,null,null]' in report


def test_a_prefill_that_returns_the_cache_replicated_fails_the_golden(fresh):
    from examples import llama3_serving as ls

    fresh.setattr(ls, "prefill", cache_resharded(ls.prefill, P()))
    report = golden_report(example_case())
    assert "prefill/state/cache/k/0/quant" in report and "now [null,null,null,null]" in report
    assert "handoff/prefill.generate/cache/k/0/quant" in report  # the hand-off now moves the cache
    assert "generate/state/cache/k/0/quant" not in report


def test_a_generate_step_keeping_the_cache_in_another_layout_fails_the_golden(fresh):
    from examples import llama3_serving as ls

    fresh.setattr(ls, "generate", cache_resharded(ls.generate, P(None, "y")))
    report = golden_report(example_case())
    assert "generate/state/cache/k/0/quant" in report and "handoff/generate.generate/cache/k/0/quant" in report
    assert "prefill/state/cache" not in report


def test_a_server_on_its_own_context_mesh_is_held_against_the_case(fresh):
    """A server that sets its mesh as a context gives it as ServingProgram(mesh=...): the case's mesh
    dumps the committed golden; the program's mesh changed (x 2 -> 4, y 4 -> 2) is refused in one line
    naming both meshes, and so are its axis types (Auto where the case's, shard_mode=explicit, are Explicit)."""
    from jax.sharding import AbstractMesh, AxisType

    from examples import llama3_serving as ls
    from sharding_dump.errors import BadInput

    def on(sizes, kind=AxisType.Explicit):
        fresh.setattr(ls, "small_llama3", lambda: ls.program(ls.SMALL, mesh=AbstractMesh(
            sizes, ("x", "y", "z"), axis_types=(kind,) * 3)))
        forget_programs()

    on((2, 4, 1))
    assert golden_report(example_case()) == ""
    on((4, 2, 1))
    with pytest.raises(BadInput, match=r"^the program runs on its own mesh x=4 x y=2 x z=1 \(ServingProgram\(mesh="
                                       r"\.\.\.\)\), not on the case's mesh x=2 x y=4 x z=1: give the case"):
        dump.render_case(example_case())
    on((2, 4, 1), AxisType.Auto)
    with pytest.raises(BadInput, match=r"own mesh x=2 x y=4 x z=1 \(Auto axes\) \(ServingProgram\(mesh=\.\.\.\)\), "
                                       r"not on the case's mesh x=2 x y=4 x z=1 \(Explicit axes\)"):
        dump.render_case(example_case())


def test_serving_settings_on_a_training_case_are_bad_input():
    from sharding_dump.errors import BadInput
    from sharding_dump.zoo.case import Case

    with pytest.raises(BadInput, match="quantize_kvcache: applies to serving programs only"):
        dump.setup_case(Case.make("llama2-7b", "v5p-16", "default", overrides={"quantize_kvcache": True}))


def test_a_prompt_longer_than_the_cache_is_one_line(fresh):
    from sharding_dump.errors import BadInput

    case = dataclasses.replace(example_case(), overrides=tuple(
        (k, 128 if k == "max_prefill_predict_length" else v) for k, v in example_case().overrides))
    with pytest.raises(BadInput, match=r"^max_prefill_predict_length=\(128\): longer than the cache"):
        dump.case_layouts(case)


def own_mesh_server():
    """A server that builds its own concrete mesh over `jax.devices()`, with Explicit axes, as
    jax-llm-examples' llama3 main.py does (`jax.make_mesh(..., devices=jax.devices(), axis_types=...)`),
    and places its weights and cache on it with `jit(out_shardings=...)`."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    import sharding_dump as sd

    def init(key, settings):
        mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices(), 
                             axis_types=(jax.sharding.AxisType.Explicit,))
        return jax.jit(lambda: {"weights": jnp.zeros((8, 4)), "cache": jnp.zeros((settings.slots, settings.max_length, 4))},
                       out_shardings={"weights": NamedSharding(mesh, P()), "cache": NamedSharding(mesh, P("x"))})()

    def generate(state, inputs, settings):
        return state, {"next": inputs["tokens"] + 1}

    return sd.ServingProgram(init, {"generate": sd.ServingStep(generate, {"tokens": sd.Input(("slots", 1))})})


def test_a_server_on_its_own_explicit_mesh_dumps_in_explicit_mode(fresh, tmp_path):
    """shard_mode=explicit with a server whose own concrete mesh has Explicit axes: its init, also traced
    on the Auto mesh for the even-split check and the memory fit, is the case's (that trace compares no
    axis types); in shard_mode=auto the same mesh is still refused naming both axis types."""
    from sharding_dump.errors import BadInput
    from sharding_dump.zoo.case import Case

    (tmp_path / "rules.yml").write_text("mesh_axes: [x]\ndata_sharding: [[x]]\n")
    settings = {"per_device_batch_size": 1, "max_target_length": 16, "max_prefill_predict_length": 8,
                "ici_x_parallelism": -1}  # x spans the process's devices, however many an earlier test made

    def case(mode):
        return Case.make("tests.zoo.test_serving:own_mesh_server", f"cpu-{jax.device_count()}",
                         str(tmp_path / "rules.yml"), overrides={**settings, "shard_mode": mode})

    docs = dump.dump_case(case("explicit"))
    assert docs["named_shardings.json"]["tensors"]["cache"]["partition_spec"] == ["x", None, None]
    with pytest.raises(BadInput, match=r"\(Explicit axes\) \(jit <lambda>\), not on the case's mesh x=\d+ \(Auto axes\)"):
        dump.dump_case(case("auto"))
