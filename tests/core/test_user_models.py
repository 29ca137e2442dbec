"""Bring your own model: the public API and `--model package.module:factory` on a linen and an NNX
causal LM written outside the package (examples/), plus the activation capture's edges."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import sharding_dump as sd
from helpers import REPO, assert_bad_input
from sharding_dump.commands import cli
from sharding_dump.core import capture

EXAMPLE_ARGS = ["--topology", "cpu-8", "--rule", "examples/rules.yml", "ici_fsdp_parallelism=4",
                "ici_tensor_parallelism=2"]
CASE = "cpu-8/slice_1/rule_rules_ici_fsdp_parallelism=4_ici_tensor_parallelism=2"


def dump_example(tmp_path, monkeypatch, factory: str) -> dict[str, dict]:
    monkeypatch.chdir(REPO)
    assert cli.main(["--model", factory, *EXAMPLE_ARGS, "--output-dir", str(tmp_path)]) == 0
    folder = tmp_path / (factory.split("=")[0] if "=" in factory else factory.replace(":", "-")) / CASE
    return {p.name: json.loads(p.read_text()) for p in folder.iterdir()}


def params_of(named: dict) -> int:
    return sum(math.prod(t["shape"]) for path, t in named["tensors"].items() if path.startswith("params/"))


def test_linen_model_by_factory(tmp_path, monkeypatch):
    docs = dump_example(tmp_path, monkeypatch, "examples.linen_lm:small_lm")
    from examples.linen_lm import small_lm

    own = jax.eval_shape(small_lm().init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    assert params_of(docs["named_shardings.json"]) == sum(math.prod(x.shape) for x in jax.tree.leaves(own))
    named = docs["named_shardings.json"]["tensors"]
    assert named["params/block_0/up/kernel"]["partition_spec"] == ["fsdp", "tensor"]
    assert named["opt_state/0/mu/block_0/up/kernel"]["partition_spec"] == ["fsdp", "tensor"]
    assert docs["logical_shardings.json"]["tensors"]["params/embedder/embedding"]["logical_axes"] == ["vocab", "embed"]
    acts = docs["activation_shardings.json"]["tensors"]
    hidden = acts["forward/block_1/batch.length.mlp"]
    assert hidden["logical_axes"] == ["batch", "length", "mlp"]
    assert hidden["partition_spec"] == [["data", "fsdp"], None, "tensor"] and hidden["per_device_shape"] == [24, 2048, 2048]
    assert acts["backward/block_1/batch.length.mlp"]["partition_spec"] == hidden["partition_spec"]
    assert acts["forward/batch.length.vocab"]["partition_spec"] == [["data", "fsdp"], None, "tensor"]


def test_nnx_model_by_factory(tmp_path, monkeypatch):
    docs = dump_example(tmp_path, monkeypatch, "examples.nnx_lm:small_lm")
    from examples.nnx_lm import small_lm

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(small_lm)
    own = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert params_of(docs["named_shardings.json"]) == own
    named = docs["named_shardings.json"]["tensors"]
    assert named["params/blocks/up/kernel"]["partition_spec"] == [None, "fsdp", "tensor"]  # scanned: layers first
    assert docs["logical_shardings.json"]["tensors"]["params/blocks/up/kernel"]["logical_axes"] == ["layers", "embed", "mlp"]
    acts = docs["activation_shardings.json"]["tensors"]
    # NNX keeps no module stack: its constraints are keyed by their logical axes (or call site) alone
    assert acts["forward/batch.length.mlp"]["partition_spec"] == [["data", "fsdp"], None, "tensor"]
    assert "backward/batch.length.embed" in acts


def test_example_rule_edit_changes_the_dump(tmp_path, monkeypatch):
    """The example's golden bites: mapping `mlp` to nothing changes the MLP kernels and activations."""
    monkeypatch.chdir(REPO)
    rules = (REPO / "examples/rules.yml").read_text().replace("- [mlp, tensor]", "- [mlp, null]")
    edited = tmp_path / "rules.yml"
    edited.write_text(rules)
    model = sd.as_model(__import__("examples.linen_lm", fromlist=["small_lm"]).small_lm())
    mesh = AbstractMesh((1, 4, 2), ("data", "fsdp", "tensor"))
    before = sd.tensor_layouts(sd.abstract_train_state(model.abstract_params()), mesh,
                               [("mlp", "tensor"), ("embed", "fsdp")])
    after = sd.tensor_layouts(sd.abstract_train_state(model.abstract_params()), mesh,
                              [("mlp", None), ("embed", "fsdp")])
    changed = {a.path for a, b in zip(before, after) if a.partition_spec != b.partition_spec}
    assert "params/block_0/up/kernel" in changed and "opt_state/0/nu/block_3/down/kernel" in changed


class Mixed(nn.Module):
    """One logical constraint, one plain jax constraint, one named one, and a boxed parameter."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")), (4, 8))
        x = nn.with_logical_constraint(x, ("batch", "embed"))
        y = jax.lax.with_sharding_constraint(x @ w, P("data", None))
        return sd.constrain(y, ("batch", "mlp"), "hidden")


MESH = AbstractMesh((2, 2), ("data", "model"), (AxisType.Auto,) * 2)  # jax 0.12 defaults to Explicit
RULES = [("batch", "data"), ("mlp", "model"), ("embed", None)]


def test_capture_of_flax_jax_and_named_constraints():
    module = Mixed()
    with jax.sharding.use_abstract_mesh(MESH):  # a plain P(...) constraint needs a mesh, at init too
        params = jax.eval_shape(module.init, jax.random.key(0), jax.ShapeDtypeStruct((8, 4), jnp.float32))["params"]

    def loss(p, x):  # boxed parameters: flax constrains `w` when it is read; that is not an activation
        return module.apply({"params": p}, x).sum()

    found = {c.key: c for c in sd.record_activations(jax.grad(loss), params, jax.ShapeDtypeStruct((8, 4), jnp.float32),
                                                     mesh=MESH, rules=RULES)}
    # Gradients flow to the parameter only, so the input's constraint has no backward twin.
    plain = "sharding_constraint-Mixed.__call__-L4"  # the function that placed it and its line from the decorator
    assert set(found) == {"forward/batch.embed", f"forward/{plain}", "forward/hidden",
                          f"backward/{plain}", "backward/hidden"}
    assert found["forward/batch.embed"].logical_axes == ("batch", "embed")
    assert tuple(found["forward/batch.embed"].partition_spec) == ("data", None)
    assert found[f"forward/{plain}"].logical_axes == (None, None)
    assert tuple(found["forward/hidden"].partition_spec) == ("data", "model")
    assert all(c.shape != (4, 8) for c in found.values()), "a parameter read was taken for an activation"


def test_a_recording_replaces_no_function():
    """Activations are read from the jaxpr: nothing of jax or flax is replaced, even while recording."""
    from flax.linen import spmd

    def current():
        return (spmd._with_sharding_constraint_one_fallback, spmd.with_logical_constraint,
                jax.lax.with_sharding_constraint, jax.sharding.reshard, nn.Dense.__call__, nnx.Linear.__call__)

    before = current()
    with capture.recording():
        assert current() == before
    assert current() == before


def test_derived_names_that_collide_are_numbered():
    def f(x):
        a = nn.with_logical_constraint(x, ("batch", "embed"))
        b = nn.with_logical_constraint(x[:4], ("batch", "embed"))
        return a.sum() + b.sum()

    keys = [c.key for c in sd.record_activations(f, jax.ShapeDtypeStruct((8, 4), jnp.float32), mesh=MESH, rules=RULES)]
    assert keys == ["forward/batch.embed", "forward/batch.embed-2"]


def test_a_named_factory_is_filed_under_its_name(tmp_path, monkeypatch):
    """`models = {small = "examples.linen_lm:small_lm"}` (or `--model small=examples.linen_lm:small_lm`):
    the golden folder and the case's name are `small`, so moving the factory renames no golden."""
    from sharding_dump.zoo.case import golden_dir
    from sharding_dump.zoo.matrix import load_project_cases
    from sharding_dump.zoo.project import load_project

    (tmp_path / "pyproject.toml").write_text('[tool.sharding-dump]\ncases = "cases.yml"\n'
                                             'models = {small = "examples.linen_lm:small_lm"}\n')
    (tmp_path / "cases.yml").write_text(f"cases:\n  - {{model: small, topology: cpu-8, rule: {REPO}/examples/rules.yml}}\n")
    (case,) = load_project_cases(load_project(tmp_path))
    assert golden_dir(case, tmp_path / "golden") == tmp_path / "golden/small/cpu-8/slice_1/rule_rules"
    assert case.label == "small/cpu-8/slice_1/rule_rules" and case.header()["model"] == "small"
    assert case.command().startswith("sharding-dump --model small=examples.linen_lm:small_lm --topology cpu-8")

    # the same dump as the factory's own, under its name
    named = dump_example(tmp_path, monkeypatch, "small=examples.linen_lm:small_lm")
    plain = dump_example(tmp_path / "plain", monkeypatch, "examples.linen_lm:small_lm")
    assert sorted(named) == sorted(plain) and all(named[name]["case"]["model"] == "small" for name in named)
    assert named == {name: doc | {"case": doc["case"] | {"model": "small"}} for name, doc in plain.items()}


def test_dump_model_api_matches_the_cli(tmp_path, monkeypatch):
    """The one-call API and the CLI give the same named layout for the same model, mesh and rules."""
    from examples.linen_lm import small_lm
    from sharding_dump.zoo.rules import load_rule

    docs = dump_example(tmp_path, monkeypatch, "examples.linen_lm:small_lm")
    users_policy, session_policy = (1234, 5, 6), gc.get_threshold()
    gc.set_threshold(*users_policy)
    try:
        api = sd.dump_model(small_lm(), AbstractMesh((1, 4, 2), ("data", "fsdp", "tensor"), (AxisType.Auto,) * 3),
                            load_rule("examples/rules.yml"), batch_shape=(96, 2048), input_axes=("batch", "length"))
        assert gc.get_threshold() == users_policy  # the dump's own collection policy is given back
    finally:
        gc.set_threshold(*session_policy)
    assert api["named_shardings.json"]["tensors"] == docs["named_shardings.json"]["tensors"]
    assert api["activation_shardings.json"]["tensors"] == docs["activation_shardings.json"]["tensors"]


@pytest.mark.parametrize("model, message", [
    ("no_such_module:factory", "cannot import no_such_module"),
    ("examples.linen_lm:no_such_factory", "has no attribute 'no_such_factory'"),
    ("examples.linen_lm:small_lm:x", "a factory is written package.module:function"),
    ("examples/linen_lm.py:small_lm", "unknown model"),
    ("examples.linen_lm:" + "x" * 300, "at most 200 characters"),
    ("my*lm=examples.linen_lm:small_lm", "or NAME=package.module:function"),
    ("llama2-7b=examples.linen_lm:small_lm", "'llama2-7b' is the name of a model card; name the factory differently"),
])
def test_bad_factory_references(tmp_path, capsys, monkeypatch, model, message):
    monkeypatch.chdir(REPO)
    assert_bad_input(tmp_path, capsys, f"--model {model} --topology cpu-8 --rule examples/rules.yml", message)


@pytest.mark.parametrize("setting", ["weight_dtype=bfloat16", "num_pipeline_microbatches=4"])
def test_card_only_settings_are_refused_for_factories(tmp_path, capsys, monkeypatch, setting):
    monkeypatch.chdir(REPO)
    assert_bad_input(tmp_path, capsys, f"--model examples.linen_lm:small_lm --topology cpu-8 "
                                       f"--rule examples/rules.yml {setting}", "applies to built-in models only")


def test_import_is_light_and_changes_nothing():
    code = ("import os, sys; env = dict(os.environ); import sharding_dump; "
            "assert dict(os.environ) == env, 'environment changed'; "
            "heavy = sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_diff_runs_without_jax():
    """`sharding-dump diff golden golden` of the whole matrix (every golden read and schema-checked)
    loads no jax, flax, optax, OmegaConf or transformers."""
    heavy = ("jax", "flax", "optax", "omegaconf", "transformers")
    code = ("import sys; from sharding_dump.commands.cli import main; status = main(['diff', 'golden', 'golden']); "
            f"assert status == 0, status; print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_check_and_show_take_a_factory_model(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    case = ["--model", "examples.nnx_lm:small_lm", *EXAMPLE_ARGS]
    assert cli.main(["show", *case]) == 0
    table = capsys.readouterr().out
    assert "params/blocks/up/kernel" in table and '["layers","embed","mlp"]' in table
    assert cli.main(["check", *case]) == 0
    assert "clean" in capsys.readouterr().out


# --- a failure inside the user's model points at the user's line ----------------------------------------

FAILING_MODELS = '''\
import flax.linen as nn


def table():
    return nn.Embed(64, 16, embedding_init=nn.with_logical_partitioning(nn.initializers.normal(), ("vocab", "embed")))


def check_width(x):
    raise ValueError("width must be even:\\n\\n  got 15")


class Raises(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = table()(tokens)
        check_width(x)
        return x


class ThreeAxes(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = table()
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "heads", "kv"))
        x = nn.DenseGeneral((2, 8), kernel_init=init, name="qkv")(embed(tokens))
        return embed.attend(x.reshape(x.shape[:-2] + (16,)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        if self.name == "block_1":
            raise NotImplementedError("no second block")
        return x


class Stacked(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = table()(tokens)
        for i in range(2):
            x = Block(name=f"block_{i}")(x)
        return x


def raises():
    return Raises()


def stacked():
    return Stacked()


def three_axes():
    return ThreeAxes()
'''
FAILING_ARGS = ["--topology", "cpu-4", "--rule", "rules.yml", "per_device_batch_size=1", "max_target_length=8"]


@pytest.fixture
def failing_models(tmp_path, monkeypatch):
    (tmp_path / "failing_lm.py").write_text(FAILING_MODELS)
    (tmp_path / "rules.yml").write_text("mesh_axes: [fsdp, tensor]\nlogical_axis_rules:\n  - [batch, fsdp]\n"
                                        "  - [embed, fsdp]\n  - [heads, tensor]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "failing_lm", raising=False)  # this test's copy, not another test's
    return tmp_path


def test_a_raise_inside_the_models_call_names_its_file_and_line(failing_models, capsys):
    """The one line names where the user's code raised (not a frame of flax, jax or the harness), keeps
    the message's cause on its third line, and drops the call-signature hint (the call was made; the
    failure is inside it). --traceback prints the whole traceback above that line; exit 2 both ways."""
    args = ["--model", "failing_lm:raises", *FAILING_ARGS, "--output-dir", str(failing_models / "out")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err == ("sharding-dump: error: the model call failed with ValueError: width must be even: got 15 at "
                   "failing_lm.py:9 in check_width (the harness passed Raises(int32[1,8]))\n")
    assert cli.main(args + ["--traceback"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n") and err.endswith(
        "sharding-dump: error: the model call failed with ValueError: width must be even: got 15 at "
        "failing_lm.py:9 in check_width (the harness passed Raises(int32[1,8]))\n")
    assert 'failing_lm.py", line 16, in __call__\n    check_width(x)' in err
    assert 'raise ValueError("width must be even:' in err and "ValueError: width must be even:\n\n  got 15\n" in err
    assert not (failing_models / "out").exists()


def test_a_flax_parameter_that_fails_as_it_is_created_is_named(failing_models, capsys):
    """flax's DenseGeneral calls its kernel_init with the kernel flattened to two dimensions, so three
    logical axes fail with a rank error of jax that names no parameter: the line names qkv/kernel."""
    assert cli.main(["--model", "failing_lm:three_axes", *FAILING_ARGS]) == 2
    err = capsys.readouterr().err
    assert "is only valid for values of rank at least 3, but was applied to a value of rank 2" in err
    assert "at failing_lm.py:25 in ThreeAxes.__call__, creating parameter qkv/kernel (the harness passed" in err
    assert err.count("\n") == 1 and "the model's call is" not in err


def test_a_module_whose_own_import_fails_names_the_line_of_that_import(failing_models, capsys, monkeypatch):
    """The module named exists but imports what is not installed: not "cannot import the module" (it is
    there) but the ModuleNotFoundError of its own import statement, with its file and line."""
    (failing_models / "needs_dialog.py").write_text("import os\nimport dialog_not_installed\n")
    monkeypatch.delitem(sys.modules, "needs_dialog", raising=False)
    assert cli.main(["--model", "needs_dialog:make", *FAILING_ARGS]) == 2
    assert capsys.readouterr().err == (
        "sharding-dump: error: importing needs_dialog (for model needs_dialog:make) failed with ModuleNotFoundError: "
        "No module named 'dialog_not_installed' at needs_dialog.py:2 in <module>\n")


def test_a_raise_inside_a_submodule_names_the_module(failing_models, capsys):
    """The same line of code runs in two blocks: the line names the linen module that raised."""
    assert cli.main(["--model", "failing_lm:stacked", *FAILING_ARGS]) == 2
    assert capsys.readouterr().err == (
        "sharding-dump: error: the model call failed with NotImplementedError: no second block at failing_lm.py:33 "
        "in Block.__call__, in module block_1 (Block) (the harness passed Stacked(int32[1,8]))\n")


def test_the_python_api_keeps_the_traceback_behind_its_one_line(failing_models):
    """sd.dump_model on the failing model: a BadInput of one line, what the model raised its __cause__,
    and sd.traceback_text(err) the whole traceback (empty for bad input to the harness itself)."""
    from failing_lm import Raises

    mesh = AbstractMesh((4,), ("fsdp",), axis_types=(AxisType.Auto,))
    with pytest.raises(sd.BadInput) as caught:
        sd.dump_model(Raises(), mesh, sd.Rules((("batch", "fsdp"),)), batch_shape=(4, 8))
    assert "\n" not in str(caught.value) and "at failing_lm.py:9 in check_width" in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)
    text = sd.traceback_text(caught.value)
    assert text.startswith("Traceback (most recent call last):") and 'raise ValueError("width must be even:' in text
    assert sd.traceback_text(sd.BadInput("rule file x.yml: field mesh_axes: give a list")) == ""
