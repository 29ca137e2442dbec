"""What a program decides, the harness reads (sharding_dump/core/handback.py): its own mesh, the
layout it takes its batch in, and the layout of the state its step hands back. A change of any of
these fails the program's golden test, naming what changed.

The programs are the examples: an Equinox LM that builds its own concrete mesh and runs its step as
`jit(in_shardings=..., out_shardings=...)` (examples/eqx_lm.py, after Levanter), a linen LM whose
trainer places the whole state and the batch by its own strategy and constrains the state at the end
of its step (examples/fsdp_trainer.py, after Kauldron), and the pure-JAX Llama with its step jitted
to hand the state back on rules of its own (examples/pure_jax_llama.py, after jax-llm-examples).
Each one's expected placement is computed from its own code."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import FSDP, JITTED, REPO, golden_after, program_case
from sharding_dump.core.handback import HandBack, check_mesh
from sharding_dump.errors import BadInput, ProgramLayoutWarning
from sharding_dump.golden import codec
from sharding_dump.zoo import dump
from sharding_dump.zoo.case import Case



def goldens(case: Case) -> dict[str, bytes]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProgramLayoutWarning)
        return codec.render(dump.dump_case(case))


# --- the bytes a leaf handed back in another layout moves ----------------------------------------------

@pytest.mark.parametrize("went, came, moved", [
    (["x", None], [None, None], 3 * 16 * 8),  # gathers the three quarters it lacks, drops them again
    ([None, None], ["x", None], 3 * 16 * 8),  # keeps its quarter, gathers the rest when the next step takes it
    (["x", None], [None, "x"], 2 * (16 * 8 - 16 * 2)),  # 16 rows for 2 columns (16 x 2 in both), and back
    (["x", "y"], [["x", "y"], None], 2 * (16 * 2 - 4 * 2)),  # a 16 x 2 block for 4 whole rows (4 x 2 in both)
    (["x", None], [["x", "y"], None], 3 * 4 * 8),  # a quarter of its rows, then the other three quarters back
])
def test_moved_bytes(went, came, moved):
    back = HandBack("w", (64, 8), "int8", went, came, {"x": 4, "y": 4})
    assert back.moved_bytes == moved


# --- the program's own mesh --------------------------------------------------------------------------------

def test_a_mesh_of_the_programs_own_is_refused_naming_both():
    """A sharding on a mesh of other sizes than the case's is refused in one line naming both meshes and
    where the program names it; one on the case's mesh, or a trace outside any mesh, passes."""
    case = AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def init_on(mesh):
        return lambda: jax.jit(lambda: jnp.zeros((8, 8)), out_shardings=NamedSharding(mesh, P("data")))()

    own = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.sharding.use_abstract_mesh(case):
        closed = jax.make_jaxpr(init_on(own))()
        check_mesh(jax.make_jaxpr(init_on(case))(), case, "the program's init")
    with pytest.raises(BadInput, match=r"^the program's init places its arrays on its own mesh data=2 x model=4 "
                                       r"\(jit <lambda>\), not on the case's mesh data=4 x model=2: "):
        check_mesh(closed, case, "the program's init")
    check_mesh(closed, jax.sharding.get_abstract_mesh(), "the program's init")  # no mesh: nothing to hold it to


def test_a_mesh_over_every_device_of_a_process_with_too_few_says_how_many_to_start_with():
    """A program that builds its mesh over `jax.devices()` (Kauldron's DEVICES_MESH) in a process with
    fewer devices than the case (pytest, where no command adds them) is told the XLA_FLAGS that start
    the process with the case's count; the same mesh given abstractly is not a process's devices."""
    import flax.linen as nn
    import numpy as np

    devices = jax.device_count()
    case = AbstractMesh((2 * devices,), ("devices",), axis_types=(AxisType.Auto,))
    model = nn.Dense(16)

    def init_on(mesh):
        def init():
            params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((2, 8)))
            shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
            return jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), jnp.ones((2, 8)))
        return init

    concrete = jax.sharding.Mesh(np.asarray(jax.devices()), ("devices",))
    hint = (f"this process has {devices} device{'s' * (devices != 1)} and the program's mesh spans all of them: "
            f"start it with XLA_FLAGS=--xla_force_host_platform_device_count={2 * devices} ")
    with jax.sharding.use_abstract_mesh(case):
        closed = jax.make_jaxpr(init_on(concrete))()
        abstract = jax.make_jaxpr(init_on(concrete.abstract_mesh))()
    with pytest.raises(BadInput, match=rf"not on the case's mesh devices={2 * devices}: .*; {re.escape(hint)}"):
        check_mesh(closed, case, "the program's init")
    with pytest.raises(BadInput) as refused:
        check_mesh(abstract, case, "the program's init")
    assert "XLA_FLAGS" not in str(refused.value)


def test_a_mesh_the_program_sets_as_a_context_is_held_against_the_case():
    """A program that takes its mesh from the context (haliax's named_jit) gives it as TrainProgram(mesh=...),
    or sets it with jax.set_mesh around the harness's call: either, other than the case's, is refused in
    one line naming both; the same mesh passes. Setting it inside init, where jax refuses, says what to do."""
    import numpy as np
    import sharding_dump as sd
    from sharding_dump.core.program import ProgramError

    def init(key):
        return {"w": jax.jit(lambda: jnp.zeros((8, 8)), out_shardings=NamedSharding(jax.sharding.get_abstract_mesh(), P()))()}

    def step(state, batch):
        return state, {}

    devices = jax.device_count()
    concrete = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
    case = AbstractMesh((devices,), ("data",), axis_types=(AxisType.Auto,))
    other = AbstractMesh((2 * devices,), ("data",), axis_types=(AxisType.Auto,))
    with jax.sharding.use_abstract_mesh(case):
        sd.TrainProgram(init, step, mesh=concrete).placed_state(jax.random.key(0))
        with pytest.raises(BadInput, match=rf"^the program runs on its own mesh data={2 * devices} "
                                           rf"\(TrainProgram\(mesh=\.\.\.\)\), not on the case's mesh data={devices}: "):
            sd.TrainProgram(init, step, mesh=other).placed_state(jax.random.key(0))
        with pytest.raises(BadInput, match=r"own mesh data=\d+ \(Explicit axes\) \(TrainProgram\(mesh=\.\.\.\)\), not "
                                           r"on the case's mesh data=\d+ \(Auto axes\): give the case the program's axis"):
            sd.TrainProgram(init, step, mesh=case.update_axis_types({"data": AxisType.Explicit})).placed_state(
                jax.random.key(0))
    renamed = AbstractMesh((devices,), ("model",), axis_types=(AxisType.Auto,))  # jax keeps the size set_mesh set
    with jax.set_mesh(concrete), jax.sharding.use_abstract_mesh(renamed):
        with pytest.raises(BadInput, match=rf"^the program runs on its own mesh data={devices} \(set with "
                                           rf"jax.set_mesh\), not on the case's mesh model={devices}: "):
            sd.TrainProgram(init, step).placed_state(jax.random.key(0))

    def init_in_context(key):
        with jax.set_mesh(concrete):
            return init(key)

    with jax.sharding.use_abstract_mesh(case), pytest.raises(ProgramError, match=(
            r"failed with ValueError: `set_mesh` can only be used outside of `jax.jit`\. at .*test_handback.py:\d+ .*; "
            r"the harness traces init and the step, where jax sets no mesh: .* set it when "
            r"the program's module is imported .* or give it as TrainProgram\(mesh=\.\.\.\)")):
        sd.TrainProgram(init_in_context, step).placed_state(jax.random.key(0))
    with pytest.raises(ProgramError, match=r"^TrainProgram\(mesh='data'\): give the mesh the program runs on"):
        sd.TrainProgram(init, step, mesh="data")


# A program module that enters its mesh as the context of everything it runs, as Levanter's own entry
# points enter `trainer.use_device_mesh()` (haliax's named_jit takes the mesh from there), and names it
# nowhere else: no TrainProgram(mesh=...).
CONTEXT_MODULE = """
import dataclasses
import jax
from examples import eqx_lm

MESH = eqx_lm.MeshConfig(axes={axes!r})
jax.set_mesh(MESH.build())  # a global setter: the mesh of every later call, as `with trainer:` around a run


def small_lm():
    return dataclasses.replace(eqx_lm.program(MESH, context=True), mesh=None)
"""


def test_a_mesh_the_program_module_sets_is_read_without_mesh_argument(tmp_path):
    """The program's module sets its mesh with jax.set_mesh when it is imported and places everything on
    the context's mesh: the command gives it its 8 devices and dumps it; the module's mesh changed
    (data 4 x model 2 -> data 2 x model 4, Levanter's `trainer.mesh.axes model: 2 -> 4`) is refused in
    one line naming both meshes (mutation: handback.check_context_mesh reads no jax.sharding.get_mesh(),
    and the changed program dumps the same golden)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "sharding_dump.commands.cli", "--model", "context_lm:small_lm", "--topology",
               "cpu-8", "--rule", str(REPO / "examples/eqx_rules.yml"), "ici_data_parallelism=4",
               "ici_model_parallelism=2", "per_device_batch_size=2", "max_target_length=32", "--golden-dir", "out"]
    results = []
    for axes in ((("data", 4), ("model", 2)), (("data", 2), ("model", 4))):
        (tmp_path / "context_lm.py").write_text(CONTEXT_MODULE.format(axes=axes))
        results.append(subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600))
    assert results[0].returncode == 0, results[0].stderr[-3000:]
    (named,) = (tmp_path / "out").rglob("named_shardings.json")
    tensors = json.loads(named.read_text())["tensors"]  # (embed, qkv, heads, head_dim): embed -> data, heads -> model
    assert tensors["model/blocks/0/qkv/weight"]["partition_spec"] == ["data", None, "model", None]
    assert results[1].returncode == 2 and results[1].stderr.count("\n") == 1, results[1].stderr[-3000:]
    assert results[1].stderr.startswith(
        "sharding-dump: error: the program runs on its own mesh data=2 x model=4 (set with jax.set_mesh), not on the "
        "case's mesh data=4 x model=2: give the case the program's mesh"), results[1].stderr


# --- a program that places its own batch and constrains its whole state at the end of its step -----------

def fsdp_specs(strategy) -> dict[str, tuple]:
    """Every leaf's spec computed from the program's own strategy on the case's mesh."""
    from examples import fsdp_trainer as ft
    from sharding_dump.core.tree import path_text

    mesh = dump.setup_case(program_case(FSDP)).plan.abstract_mesh()
    model = ft.MLPLM()
    shapes = jax.eval_shape(lambda k: model.init(k, jnp.zeros((1, 8), "int32"))["params"], jax.random.key(0))
    return {"params/" + path_text(k): tuple(strategy.fsdp(leaf.shape, mesh))
            for k, leaf in jax.tree_util.tree_leaves_with_path(shapes)}


def test_fsdp_trainer_every_leaf_as_its_strategy_places_it(fresh):
    from examples import fsdp_trainer as ft

    case = program_case(FSDP)
    layouts = {t.path: t for t in dump.case_layouts(case)[1]}
    expected = fsdp_specs(ft.STRATEGY)
    assert len(expected) == 9 and sum(any(expected[p]) for p in expected) == 9
    for path, spec in expected.items():
        assert tuple(layouts[path].partition_spec) == spec, path
        assert layouts[path].source == "type", path
        for slot in ("mu", "nu"):
            assert tuple(layouts["opt_state/0/" + slot + path[len("params"):]].partition_spec) == spec
    activations = dump.dump_case(case)["activation_shardings.json"]
    assert activations["batch"]["program_spec"] == {"inputs": ["fsdp", None], "targets": ["fsdp", None]}
    assert "returned" not in activations  # the step hands everything back as init placed it


@pytest.mark.parametrize("factory", ["small_lm", "small_lm_data_sharding"])
def test_fsdp_trainer_batch_layout_edit_fails_its_golden(fresh, tmp_path, factory):
    """The trainer's own batch layout (Kauldron's `ShardingStrategy(batch=REPLICATED)`), constrained at
    the top of its step or delivered so by its own data pipeline (`Input(sharding=...)`): the golden
    fails naming the batch, and the dump says it differs from the rule file's data_sharding."""
    from examples import fsdp_trainer as ft

    spec = (f"examples.fsdp_trainer:{factory}",) + FSDP[1:]
    report = golden_after(tmp_path, spec, goldens,
                          lambda: fresh.setattr(ft, "STRATEGY", ft.ShardingStrategy(batch=ft.REPLICATED)))
    assert 'header batch.program_spec  golden {"inputs":["fsdp",null],"targets":["fsdp",null]}  now ' \
           '{"inputs":[null,null],"targets":[null,null]}' in report
    with pytest.warns(ProgramLayoutWarning, match=r"takes batch field 'inputs' on \[None, None\], where the rule "
                                                  r"file's data_sharding places it on \['fsdp', None\]"):
        dump.dump_case(program_case(spec))


def test_fsdp_trainer_end_of_step_constraint_edit_fails_its_golden(fresh, tmp_path):
    """The constraint the step puts on the state it returns moved (the optimizer state replicated):
    the golden fails naming each leaf handed back otherwise, and `check` lists them with the bytes."""
    from examples import fsdp_trainer as ft
    from sharding_dump.commands import check

    replicated = ft.ShardingStrategy(state=None)
    report = golden_after(tmp_path, FSDP, goldens,
                          lambda: fresh.setattr(ft, "STEP_STRATEGY", replicated))
    assert 'header returned.params/up_0/kernel  golden "(absent)"  now [null,null]' in report
    findings = [f for f in check.lint_case(program_case(FSDP)) if f.lint == "handback"]
    (up,) = [f for f in findings if f.subject.startswith("params/up_0/kernel")]
    assert up.subject == "params/up_0/kernel (and opt_state/0/mu, opt_state/0/nu)"
    # [64, 256] float32 split 8 ways on its columns, handed back whole: 7/8 of 64 KiB gathered per step
    assert up.message == ('the step hands it back on [null,null] where the state holds it on [null,"fsdp"]: 56.0 KiB moved '
                          "per device per step for each")


# --- a step that hands its state back in another layout (jit out_shardings) -----------------------------

def test_jitted_step_out_shardings_edit_fails_its_golden(fresh, tmp_path):
    """The pure-JAX Llama's jitted step hands its MLP weights back on other rules than init's: the golden
    fails naming them (and only them), and `check` says what it costs per step."""
    from examples import pure_jax_llama as pj
    from sharding_dump.commands import check

    assert "returned" not in dump.dump_case(program_case(JITTED))["activation_shardings.json"]
    report = golden_after(tmp_path, JITTED, goldens,
                          lambda: fresh.setattr(pj, "OUT_RULES", dataclasses.replace(pj.RULES, mlp=None)))
    assert 'header returned.params/layers/0/w_up  golden "(absent)"  now ["fsdp",null]' in report
    assert 'header returned.opt_state/0/nu/layers/1/w_down  golden "(absent)"  now [null,"fsdp"]' in report
    assert "returned.params/layers/0/q" not in report
    findings = {f.subject: f.message for f in check.lint_case(program_case(JITTED)) if f.lint == "handback"}
    assert len(findings) == 6
    # [64, 128] float32 on fsdp x tensor (8 KiB a device) handed back on fsdp only (16 KiB): 8 KiB gathered
    assert findings["params/layers/0/w_up (and opt_state/0/mu, opt_state/0/nu)"] == (
        'the step hands it back on ["fsdp",null] where the state holds it on ["fsdp","tensor"]: 8.0 KiB moved per device '
        "per step for each")


def test_jitted_step_state_equals_the_unjitted_programs(fresh):
    """Jitting the step changes nothing the state golden holds: same init, same placement."""
    plain = ("examples.pure_jax_llama:small_llama",) + JITTED[1:]
    named = [dump.dump_case(program_case(spec))["named_shardings.json"]["tensors"] for spec in (plain, JITTED)]
    assert named[0] == named[1]


# --- a program that builds its own concrete mesh ----------------------------------------------------------

EQX_RUN = textwrap.dedent("""
    import json, sys, jax, warnings
    sys.path.insert(0, "tests")
    from examples import eqx_lm
    from helpers import forget_programs
    from sharding_dump.core.tree import path_text
    from sharding_dump.errors import BadInput
    from sharding_dump.golden import codec
    from sharding_dump.golden.engine import check_or_update_folder
    from sharding_dump.zoo import dump
    from sharding_dump.zoo.case import Case

    warnings.simplefilter("ignore")
    SETTINGS = {{"ici_data_parallelism": 4, "ici_model_parallelism": 2, "per_device_batch_size": 2,
                "max_target_length": 32}}
    case = Case.make("examples.eqx_lm:small_lm", "cpu-8", "examples/eqx_rules.yml", overrides=SETTINGS)
    context = Case.make("examples.eqx_lm:small_lm_context", "cpu-8", "examples/eqx_rules.yml", overrides=SETTINGS)
    FOLDER = {folder!r}

    def check(case=case, folder=FOLDER):
        forget_programs()
        try:
            outcome = check_or_update_folder(folder, codec.render(dump.dump_case(case)), update=False)
        except BadInput as err:
            return "error: " + str(err)
        return outcome.status + ": " + outcome.report

    out = {{"devices": jax.device_count()}}
    layouts = {{t.path: (list(t.partition_spec), t.source) for t in dump.case_layouts(case)[1]}}
    model = jax.eval_shape(eqx_lm.EqxLM, jax.random.key(0))
    own = {{path_text(k): list(eqx_lm.MESH.spec(leaf.axes)) for k, leaf in
           jax.tree_util.tree_leaves_with_path(model, is_leaf=lambda x: isinstance(x, eqx_lm.Linear))}}
    out["own"] = {{"model/" + path + "/weight": spec for path, spec in own.items()}}
    out["dumped"] = {{path: layouts[path] for path in out["own"]}}
    out["slots"] = {{path: layouts["opt_state/0/mu/" + path[len("model/"):]][0] for path in out["own"]}}
    out["written"] = check_or_update_folder(FOLDER, codec.render(dump.dump_case(case)), update=True).status
    out["unchanged"] = check()
    out["context_same"] = [(t.path, t.partition_spec) for t in dump.case_layouts(context)[1]] == \
        [(t.path, t.partition_spec) for t in dump.case_layouts(case)[1]]
    check_or_update_folder(FOLDER + "-context", codec.render(dump.dump_case(context)), update=True)
    eqx_lm.MESH = eqx_lm.MeshConfig(axes=(("data", 2), ("model", 4)))
    out["mesh"] = check()
    out["context_mesh"] = check(context, FOLDER + "-context")
    eqx_lm.MESH = eqx_lm.MeshConfig(axis_type=jax.sharding.AxisType.Explicit)
    out["kinds"] = check()
    out["context_kinds"] = check(context, FOLDER + "-context")
    eqx_lm.MESH = eqx_lm.MeshConfig(batch_mapping=(("batch", None),))
    out["batch"] = check()
    eqx_lm.MESH = eqx_lm.MeshConfig(step_mapping=(("embed", "data"), ("mlp", None), ("heads", "model"),
                                                  ("vocab", "model")))
    out["step"] = check()
    from sharding_dump.commands import check as lint
    out["findings"] = [(f.subject, f.message) for f in lint.lint_case(case) if f.lint == "handback"]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def eqx_run(tmp_path_factory):
    """The Equinox example dumped, checked, and checked again after each edit of its own mesh config,
    in a process with 8 CPU devices (the mesh the program builds over jax.devices())."""
    folder = tmp_path_factory.mktemp("eqx") / "golden"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", EQX_RUN.format(folder=str(folder))], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_own_mesh_program_every_weight_as_it_places_it(eqx_run):
    assert eqx_run["devices"] == 8
    assert len(eqx_run["own"]) == 15 and sum(any(s) for s in eqx_run["own"].values()) == 10  # the norms stay whole
    for path, spec in eqx_run["own"].items():
        dumped, source = eqx_run["dumped"][path]
        assert dumped + [None] * (len(spec) - len(dumped)) == spec and source == "type", path
        assert eqx_run["slots"][path] == dumped, path  # AdamW's moments keep the weight's names
    assert (eqx_run["written"], eqx_run["unchanged"]) == ("written", "match: ")


def test_own_mesh_edit_is_refused_naming_both_meshes(eqx_run):
    """The program's own mesh changed (Levanter's `trainer.mesh` model: 2 -> 4): one line naming both."""
    assert eqx_run["mesh"].startswith("error: the program's init ")
    assert "places its arrays on its own mesh data=2 x model=4 (jit make_state), not on the case's mesh " \
           "data=4 x model=2: give the case the program's mesh" in eqx_run["mesh"]


def test_own_mesh_axis_types_edit_is_refused_naming_both(eqx_run):
    """The program's own mesh with Explicit axes where the case's (shard_mode=auto, in the golden) has
    Auto ones: one line naming both meshes with their axis types."""
    assert "places its arrays on its own mesh data=4 x model=2 (Explicit axes) (jit make_state), not on the " \
           "case's mesh data=4 x model=2 (Auto axes): give the case the program's axis types" in eqx_run["kinds"]


def test_context_mesh_program_is_held_against_the_case(eqx_run):
    """A program that sets its mesh as a context (Levanter's `with trainer:`) and places everything on
    whatever mesh it finds there dumps as the one that names its own mesh; the mesh it gives as
    TrainProgram(mesh=...) changed, in sizes or in axis types, is refused naming both meshes."""
    assert eqx_run["context_same"]
    assert eqx_run["context_mesh"].startswith("error: the program runs on its own mesh data=2 x model=4 "
                                              "(TrainProgram(mesh=...)), not on the case's mesh data=4 x model=2: ")
    assert eqx_run["context_kinds"].startswith("error: the program runs on its own mesh data=4 x model=2 (Explicit "
                                               "axes) (TrainProgram(mesh=...)), not on the case's mesh data=4 x "
                                               "model=2 (Auto axes): ")


def test_own_mesh_batch_layout_edit_fails_its_golden(eqx_run):
    """The step's own in_shardings for the batch changed (its batch mapping): the golden names the batch."""
    assert eqx_run["batch"].startswith("differs: ")
    assert 'header batch.program_spec  golden {"inputs":["data",null],"targets":["data",null]}  now ' \
           '{"inputs":[null,null],"targets":[null,null]}' in eqx_run["batch"]


@pytest.mark.parametrize("kwargs, says", [
    ({"sharding": "fsdp"}, "Input(sharding='fsdp'): give None, a PartitionSpec of mesh axes"),
    ({"sharding": P("fsdp", None, None)}, "of at most one entry per dimension"),
    ({"logical_axes": ("batch", "length"), "sharding": P("fsdp")}, "give one of them: logical axes the rule file "
                                                                    "places, or the program's own sharding"),
])
def test_input_sharding_is_checked_where_it_is_written(kwargs, says):
    from sharding_dump.core.program import ProgramError
    import sharding_dump as sd

    with pytest.raises(ProgramError, match=re.escape(says)):
        sd.Input(**kwargs)


def test_own_mesh_step_mapping_edit_fails_its_golden(eqx_run):
    """The step's jit takes and returns the state on another mapping (Levanter's axis_resources) than
    init placed it on: the golden names every leaf taken and handed back otherwise, and `check` lists
    both ends with the bytes they move."""
    assert eqx_run["step"].startswith("differs: ")
    assert 'header taken.model/blocks/0/up/weight  golden "(absent)"  now ["data",null]' in eqx_run["step"]
    assert 'header returned.model/blocks/1/down/weight  golden "(absent)"  now [null,"data"]' in eqx_run["step"]
    assert "model/blocks/0/qkv" not in eqx_run["step"]
    # [64, 128] float32 on data=4 x model=2 (4 KiB a device) taken on data only (8 KiB): 4 KiB gathered
    assert ("model/blocks/0/up/weight", 'the step takes it on ["data",null] where the state holds it on '
            '["data","model"]: 4.0 KiB moved per device per step') in [tuple(f) for f in eqx_run["findings"]]
    assert len(eqx_run["findings"]) == 2 * 4 * 3  # taken and handed back: 4 MLP weights and their 2 moments
