"""Activations read from the traced step itself (`sharding_dump.core.capture`), whatever API placed them:
small real programs, pure jax and linen, on Explicit and Auto abstract meshes."""

from __future__ import annotations

import json
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import AbstractMesh, AxisType, NamedSharding, auto_axes, reshard
from jax.sharding import PartitionSpec as P

import sharding_dump as sd
from helpers import REPO, forget_programs, program_case
from sharding_dump.commands import cli
from test_placement import PURE_JAX, T5X_TRAIN

EXPLICIT = AbstractMesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
AUTO = AbstractMesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def typed(shape: tuple[int, ...], spec: P) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(EXPLICIT, spec))


def found(fn, *args, mesh=EXPLICIT, rules=()) -> dict[str, tuple]:
    return {c.key: (c.shape, tuple(c.partition_spec), c.logical_axes)
            for c in sd.record_activations(fn, *args, mesh=mesh, rules=rules)}


# --- pure jax with sharding in types ----------------------------------------------------------------------

def project(x, w):
    return jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", "model"))


def loss(x, w1, w2):
    h = project(x, w1)
    h = reshard(h, P(None, "model"))
    h = auto_axes(lambda t: jnp.tanh(t), out_sharding=P("data", None))(h)
    return (project(h, w2) ** 2).sum()


def test_einsum_reshard_and_auto_axes_forward_and_backward():
    """Each placement is an activation keyed by its call site; the helper `project` called from two lines
    gives two keys (its callers tell them apart); the backward entry is the cotangent's type."""
    x, w1, w2 = typed((8, 4), P("data", None)), typed((4, 6), P(None, "model")), typed((6, 6), P(None, "model"))
    unknown = (None, None)
    expected = {}
    for pass_ in ("forward", "backward"):
        expected |= {f"{pass_}/dot_general-loss-L1.project-L1": ((8, 6), ("data", "model"), unknown),
                     f"{pass_}/reshard-loss-L2": ((8, 6), (None, "model"), unknown),
                     f"{pass_}/reshard-loss-L3": ((8, 6), ("data", None), unknown),  # auto_axes' out_sharding
                     f"{pass_}/dot_general-loss-L4.project-L1": ((8, 6), ("data", "model"), unknown)}
    assert found(jax.grad(loss, argnums=(0, 1, 2)), x, w1, w2) == expected


def scanned(x, w):
    @jax.checkpoint
    def body(carry, _):
        return jax.jit(lambda c: jnp.einsum("bd,df->bf", c, w, out_sharding=P("data", None)))(carry), None

    return (jax.lax.scan(body, x, length=3)[0] ** 2).sum()


def test_typed_placements_inside_scan_remat_and_jit():
    x, w = typed((8, 4), P("data", None)), typed((4, 4), P(None, None))
    site = "dot_general-scanned._locals_.body._locals_._lambda_-L0"
    assert found(jax.grad(scanned, argnums=(0, 1)), x, w) == {
        f"{p}/{site}": ((8, 4), ("data", None), (None, None)) for p in ("forward", "backward")}


def test_jax_own_shardings_and_scalars_are_left_out():
    """softmax broadcasts its row maxima with the input's sharding, jnp.where its mask, and grad seeds a
    scalar: none of these is a placement the program gave (the function it called takes no sharding)."""

    def f(x, mask):
        return (jax.nn.softmax(jnp.where(mask, x, 0.0), axis=-1) * x).sum()

    x = typed((8, 2, 4), P("data", "model", None))
    mask = jax.ShapeDtypeStruct((8, 2, 1), jnp.bool_, sharding=NamedSharding(EXPLICIT, P("data", "model", None)))
    assert found(jax.grad(f), x, mask) == {}


def test_keys_stay_when_unrelated_code_moves():
    """A call site is its function's qualified name and its line counted from the function's first line:
    code added above the function renames nothing."""
    source = textwrap.dedent('''
        def step(x, w):
            h = jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", "model"))
            return reshard(h, P(None, "model")).sum()
    ''')
    keys = []
    for padding in ("", "\n" * 40 + "def unrelated():\n    return 1\n"):
        scope = {"jnp": jnp, "P": P, "reshard": reshard}
        exec(compile(padding + source, f"<moved {len(padding)}>", "exec"), scope)
        keys.append(sorted(found(jax.grad(scope["step"]), typed((8, 4), P("data", None)), typed((4, 6), P()))))
    assert keys[0] == keys[1] == ["backward/dot_general-step-L1", "backward/reshard-step-L2",
                                  "forward/dot_general-step-L1", "forward/reshard-step-L2"]


# --- linen: module paths, logical axes, parameter reads ---------------------------------------------------

class TypedBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.ones, (x.shape[-1], 6))
        return jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", "model"))


class TypedModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return TypedBlock(name="up")(x).sum() + TypedBlock(name="gate")(x).sum()


def test_linen_placements_keyed_by_module_path():
    """A linen module's placements go under its path: one call site in two modules is two keys."""
    model, x = TypedModel(), typed((8, 4), P("data", None))
    key = jax.eval_shape(jax.random.key, 0)
    with jax.sharding.use_abstract_mesh(EXPLICIT):
        params = jax.eval_shape(model.init, key, x)["params"]
    keys = sorted(found(jax.grad(lambda p, x: model.apply({"params": p}, x), argnums=1), params, x))
    assert keys == [f"{p}/{m}/dot_general-TypedBlock.__call__-L3" for p in ("backward", "forward") for m in ("gate", "up")]


class ModelWithHelper(TypedModel):
    def prepare(self, x):  # a method of the model the step calls on the unbound module, outside `apply`
        return reshard(x, P(None, "model"))


def test_a_method_called_on_an_unbound_module_is_keyed_by_its_caller():
    """A step may call a method of its unbound model (Kauldron's does): it has no module path, so its
    placements go under its caller's (mutation: read `context.module.path` for it too, and the trace
    fails with flax's `Can't access module paths on unbound modules`)."""
    model, x = ModelWithHelper(), typed((8, 4), P("data", None))
    key = jax.eval_shape(jax.random.key, 0)
    with jax.sharding.use_abstract_mesh(EXPLICIT):
        params = jax.eval_shape(model.init, key, x)["params"]
    step = jax.grad(lambda p, x: model.apply({"params": p}, model.prepare(x)), argnums=1)
    assert sorted(found(step, params, x)) == [f"{p}/{k}" for p in ("backward", "forward") for k in (
        "gate/dot_general-TypedBlock.__call__-L3", "reshard-ModelWithHelper.prepare-L1",
        "up/dot_general-TypedBlock.__call__-L3")]


AXES = ("batch", "embed")
RULES = [("batch", "data"), ("embed", "model"), ("mlp", None), ("heads", "model"), ("kv", None)]


def test_logical_axes_kept_when_written_at_the_call():
    """flax's logical constraint keeps its axes when the call writes them (any flax import, over several
    lines); given through a variable they are not in the jaxpr, so the key is the call site."""

    def f(x):
        a = nn.with_logical_constraint(x, ("batch", "embed"))
        b = nn_partitioning.with_sharding_constraint(
            x * 2,
            ("batch", None),
        )
        c = nn.with_logical_constraint(x * 3, AXES)
        return a, b, c

    assert found(f, jax.ShapeDtypeStruct((8, 4), jnp.float32), mesh=AUTO, rules=RULES) == {
        "forward/batch.embed": ((8, 4), ("data", "model"), ("batch", "embed")),
        "forward/batch._": ((8, 4), ("data", None), ("batch", None)),
        "forward/sharding_constraint-test_logical_axes_kept_when_written_at_the_call._locals_.f-L6":
            ((8, 4), ("data", "model"), (None, None)),
    }


class OldStyleAttention(nn.Module):
    """t5x's style: weights declared with `param_with_axes` (flax constrains each on every read), q/k/v
    read in one module, activations constrained with `nn_partitioning.with_sharding_constraint`."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.ones
        q, k, v = (nn_partitioning.param_with_axes(n, init, (4, 2, 2), axes=("embed", "heads", "kv"))
                   for n in ("query", "key", "value"))
        x = nn_partitioning.with_sharding_constraint(x, ("batch", "embed"))
        scores = jnp.einsum("bd,dhk->bhk", x, q) * jnp.einsum("bd,dhk->bhk", x, k)
        out = jnp.einsum("bhk,dhk->bd", scores, v)
        return nn_partitioning.with_sharding_constraint(out, ("batch", "embed")).sum()


def test_parameter_reads_left_out_for_every_api():
    """Constraints flax places on weight reads (`param_with_axes`, boxed parameters) are no activations:
    only the module's two activation constraints are recorded (one key, one layout), forward and back."""
    model = OldStyleAttention()
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    with jax.sharding.use_abstract_mesh(AUTO), nn.logical_axis_rules(RULES):
        params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    got = found(jax.grad(lambda p, x: model.apply({"params": p}, x), argnums=(0, 1)), params, x, mesh=AUTO,
                rules=RULES)
    assert got == {f"{p}/batch.embed": ((8, 4), ("data", "model"), ("batch", "embed"))
                   for p in ("forward", "backward")}


# --- a program's own activation sharding moves: its golden fails, naming the activation -------------------

PROGRAM = '''
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P, reshard

import sharding_dump as sd

HIDDEN = {hidden}


def train_program():
    tx = optax.sgd(0.1)

    def init(key):
        params = {{"embed": jnp.zeros((64, 16)), "up": jnp.zeros((16, 32)), "down": jnp.zeros((32, 16))}}
        return {{"params": params, "opt_state": tx.init(params)}}

    def loss_fn(params, tokens):
        x = params["embed"].at[tokens].get(out_sharding=P("fsdp", None, None))
        h = jax.nn.gelu(jnp.einsum("btd,df->btf", x, params["up"], out_sharding=HIDDEN))
        y = reshard(jnp.einsum("btf,fd->btd", h, params["down"]), P("fsdp", None, None))
        return (y ** 2).mean()

    def train_step(state, batch):
        grads = jax.grad(loss_fn)(state["params"], batch["inputs"])
        updates, opt_state = tx.update(grads, state["opt_state"])
        return {{"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}}, {{}}

    return sd.TrainProgram(init, train_step, batch={{"inputs": sd.Input()}})
'''


def test_a_programs_own_activation_sharding_fails_its_golden(tmp_path, monkeypatch, capsys):
    """The same pure-JAX program dumped twice, its hidden activation's `out_sharding=` moved from
    `tensor` to unsharded in between: `diff` of the two goldens fails and names that activation."""
    for name, hidden in (("before", 'P("fsdp", None, "tensor")'), ("after", 'P("fsdp", None, None)')):
        (tmp_path / f"program_{name}.py").write_text(PROGRAM.format(hidden=hidden))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rules.yml").write_text("mesh_axes: [fsdp, tensor]\ndata_sharding: [[fsdp]]\n"
                                        "logical_axis_rules:\n  - [batch, fsdp]\n")
    folders = []
    for name in ("before", "after"):
        model = f"program_{name}:train_program"
        assert cli.main(["--model", model, "--topology", "cpu-4", "--rule", "rules.yml", "ici_fsdp_parallelism=2",
                         "ici_tensor_parallelism=2", "shard_mode=explicit", "per_device_batch_size=1",
                         "max_target_length=8", "--golden-dir", str(tmp_path / name)]) == 0
        (folder,) = {p.parent for p in (tmp_path / name).rglob("activation_shardings.json")}
        folders.append(folder)
    acts = json.loads((folders[0] / "activation_shardings.json").read_text())["tensors"]
    hidden = "forward/dot_general-train_program._locals_.loss_fn-L2"
    assert acts[hidden]["partition_spec"] == ["fsdp", None, "tensor"]
    assert {"forward/reshard-train_program._locals_.loss_fn-L1", "forward/reshard-train_program._locals_.loss_fn-L3",
            f"backward{hidden[7:]}"} <= set(acts)
    capsys.readouterr()
    assert cli.main(["diff", str(folders[0]), str(folders[1])]) == 1
    report = capsys.readouterr().out
    assert hidden in report and "reshard-" not in report


def test_the_activations_page_example_prints_what_it_shows(capsys, tmp_path, monkeypatch):
    """docs/activations.md: its example, run as a file, prints the keys the page shows."""
    import re
    import runpy

    page = (REPO / "docs/activations.md").read_text()
    code = re.findall(r"```python\n(.*?)```", page, re.S)[0]
    shown = re.findall(r"```\n((?:forward|backward)/.*?)```", page, re.S)[0]
    (tmp_path / "example.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(tmp_path / "example.py"))
    assert capsys.readouterr().out == shown


# --- the example programs of each style, placed by their own code ------------------------------------------

# forward()'s lines that place an activation, and the logical axes it gives each (examples/pure_jax_llama.py)
PURE_JAX_SITES = {"reshard-forward-L3": ("batch", "sequence", "act_embed"),  # the embedding gather
                  **{f"dot_general-forward-L{n}": ("batch", "sequence", "act_heads", None) for n in (8, 9, 10)},
                  "dot_general-forward-L14": ("batch", "sequence", "act_embed"),
                  "dot_general-forward-L16": ("batch", "sequence", "act_mlp"),
                  "dot_general-forward-L17": ("batch", "sequence", "act_mlp"),
                  "dot_general-forward-L18": ("batch", "sequence", "act_embed"),
                  "dot_general-forward-L21": ("batch", "sequence", None)}


def test_pure_jax_llama_activations_as_its_own_rules_place_them(fresh):
    """Every `out_sharding=` of the pure-JAX Llama's forward, forward and backward, with the spec its
    own ShardingRules give, and the batch it reshards in its step."""
    from examples import pure_jax_llama as pj
    from sharding_dump.zoo.dump import dump_case

    acts = dump_case(program_case(PURE_JAX))["activation_shardings.json"]["tensors"]
    own = {f"{p}/{site}": [e for e in pj.spec(pj.RULES, *axes)] for site, axes in PURE_JAX_SITES.items()
           for p in ("forward", "backward")}
    assert {key: acts[key]["partition_spec"] for key in own} == own
    assert {"forward/reshard-program._locals_.train_step-L1", "forward/reshard-program._locals_.train_step-L2"} <= set(acts)
    assert len(acts) == len(own) + 4  # and the batch fields as the harness places them (inputs, targets)


def test_pure_jax_llama_activation_rule_edit_fails_its_golden(fresh, tmp_path):
    """The program's own rule for `act_mlp` moved: its golden fails, naming the gate and up activations."""
    from examples import pure_jax_llama as pj
    from sharding_dump.golden.engine import check_or_update_folder
    from sharding_dump.zoo.dump import render_case

    case = program_case(PURE_JAX)
    folder = tmp_path / "golden"
    assert check_or_update_folder(folder, render_case(case), update=True).status == "written"
    fresh.setattr(pj, "RULES", pj.dataclasses.replace(pj.RULES, act_mlp=None))
    forget_programs()
    outcome = check_or_update_folder(folder, render_case(case), update=False)
    assert outcome.status == "differs"
    assert "forward/dot_general-forward-L16  (and backward)" in outcome.report
    assert "forward/dot_general-forward-L17  (and backward)" in outcome.report
    assert "dot_general-forward-L18" not in outcome.report and "named_shardings.json" not in outcome.report


def test_t5x_style_records_its_activation_constraints_and_no_weight_read(fresh):
    """t5x's API: `param_with_axes` constrains every weight where it is read; none of those is an entry.
    The activations keep the logical axes the model writes, under each layer's module path."""
    from sharding_dump.zoo.dump import dump_case

    acts = dump_case(program_case(T5X_TRAIN))["activation_shardings.json"]["tensors"]
    layers = [f"{p}/layers_{i}/batch.length.{a}" for p in ("forward", "backward") for i in (0, 1) for a in ("embed", "mlp")]
    batch = [f"forward/{field}" for field in ("inputs", "targets")]
    assert sorted(acts) == sorted(layers + batch + ["forward/batch.length.embed", "backward/batch.length.embed"])
    assert all(entry["logical_axes"][0] == "batch" for entry in acts.values())


# --- one trace for every rule file: rules read only by constrain() are resolved after the trace ----------

RULES_A = (("batch", "data"), ("embed", "model"))
RULES_B = (("embed", "data"), ("batch", "model"))  # the same names, the other way round
FIXED = (("embed", "model"),)  # rules a program sets for a block of its own, whatever the trace's


def constrained(x):
    """constrain() calls only: one under the trace's rules, one inside a rules block of the program's own."""
    h = sd.constrain(x * 2, ("batch", "embed"), "hidden")
    with nn.logical_axis_rules(FIXED):
        h = sd.constrain(h + 1, ("batch", "embed"), "fixed_block")
    return (h ** 2).sum()


def traced_under(fn, rules):
    from sharding_dump.core.capture import read_constraints, trace

    closed, rec = trace(jax.grad(fn), jax.ShapeDtypeStruct((8, 4), jnp.float32), mesh=AUTO, rules=rules)
    return read_constraints(closed, rec), rec


@pytest.mark.parametrize("reads", [
    lambda x: nn.with_logical_constraint(x, ("batch", "embed")),  # flax's own, called by the program
    lambda x: jax.lax.with_sharding_constraint(x, nn.logical_to_mesh_axes(("batch", "embed"))),  # axes resolved by hand
    lambda x: x * len(nn.get_logical_axis_rules()),  # the rules read to decide something
    lambda x: jax.vmap(lambda row: sd.constrain(row, ("embed",), "row"), spmd_axis_name="data")(x),  # placed otherwise
], ids=["with_logical_constraint", "logical_to_mesh_axes", "get_logical_axis_rules", "vmap_spmd_axis"])
def test_a_rule_read_outside_constrain_is_noted(reads):
    """The recording says whether the trace's rules reached it otherwise than as constrain()'s specs (read
    by anything else, or a constrain() placement a transform changed): only if not may a trace stand for
    another rule file's."""
    assert not traced_under(constrained, RULES_A)[1].rules_read
    assert traced_under(lambda x: constrained(reads(x)), RULES_A)[1].rules_read


def test_resolved_gives_what_a_trace_under_the_other_rules_reads():
    """A trace under rules A, its constrain() specs resolved under B, reads as the trace under B: the
    specs change where the rules do, and the block under the program's own rules keeps its spec."""
    from sharding_dump.core.capture import resolved

    under_a, _ = traced_under(constrained, RULES_A)
    under_b, rec = traced_under(constrained, RULES_B)
    assert not rec.rules_read
    assert resolved(under_a, RULES_B) == tuple(under_b)
    specs = {c.key: tuple(c.partition_spec) for c in resolved(under_a, RULES_B)}
    assert specs == {"forward/hidden": ("model", "data"), "backward/hidden": ("model", "data"),
                     "forward/fixed_block": (None, "model"), "backward/fixed_block": (None, "model")}
    assert {c.key: tuple(c.partition_spec) for c in under_a}["forward/hidden"] == ("data", "model")


def test_vmapped_counts_the_dimensions_a_vmap_added_not_the_logical_axes_left_free():
    """`Constraint.vmapped`: the traced rank less the rank constrain() saw. Fewer logical axes than dimensions
    leave the last ones free (Qwen3-Next's attention output), which is no transform's doing."""
    rules = (("batch", "data"), ("embed", "model"))

    def step(x):
        free = sd.constrain(x, ("batch",), "free_tail")  # 1 logical axis for 2 dimensions
        rows = jax.vmap(lambda row: sd.constrain(row, ("embed",), "row"))(free)  # vmap adds the first
        return (rows ** 2).sum()

    out = {c.key: (c.shape, c.vmapped) for c in sd.record_activations(
        jax.grad(step), jax.ShapeDtypeStruct((8, 4), jnp.float32), mesh=AUTO, rules=rules)}
    assert out["forward/free_tail"] == ((8, 4), 0)
    assert out["forward/row"] == ((8, 4), 1)
