"""Every state leaf takes the sharding its own program gives it (sharding_dump/core/placement.py), and a
change to the program's own sharding fails its golden, naming the tensor, in every style: linen boxes,
NNX variables, the older API's params_axes, path regexes and sharding in types.

The programs are the examples: a pure-JAX Llama-style LM that places everything itself
(examples/pure_jax_llama.py), a t5x-style `param_with_axes` decoder (examples/t5x_style.py), the linen
and NNX LMs (examples/linen_lm.py, nnx_lm.py), a regex-placed Llama (examples/regex_llama.py) and
Hugging Face's Flax Llama (examples/hf_llama.py). Each one's expected placement is computed from its
own code (its rules, its params_axes), not written here."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sharding_dump as sd
from helpers import REPO, golden_after, program_case
from sharding_dump.commands import cli
from sharding_dump.core import documents
from sharding_dump.core.layout import resolve
from sharding_dump.core.placement import declared_specs
from sharding_dump.golden import codec
from sharding_dump.zoo import dump, model_ref
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.rules import load_rule

SMALL = {"per_device_batch_size": 2, "max_target_length": 64}
PURE_JAX = ("examples.pure_jax_llama:small_llama", "cpu-4", "examples/pure_jax_rules.yml",
            {"ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2, "shard_mode": "explicit", **SMALL})
T5X = ("examples.t5x_style:small_decoder", "cpu-8", "examples/t5x_rules.yml",
       {"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 2, **SMALL})
T5X_TRAIN = ("examples.t5x_style:small_decoder_train",) + T5X[1:]
LINEN = ("examples.linen_lm:small_lm", "cpu-8", "examples/rules.yml", {"ici_fsdp_parallelism": 4,
                                                                        "ici_tensor_parallelism": 2, **SMALL})
NNX = ("examples.nnx_lm:small_lm",) + LINEN[1:]
REGEX = ("examples.regex_llama:small_llama", "cpu-8", "examples/regex_llama.yml",
         {"ici_fsdp_parallelism": 4, "ici_mp_parallelism": 2, **SMALL})


def layouts_of(spec: tuple) -> dict[str, sd.TensorLayout]:
    return {t.path: t for t in dump.case_layouts(program_case(spec))[1]}


def state_goldens(case: Case) -> dict[str, bytes]:
    """The case's state golden files (named and logical shardings), as the dump writes them; the
    step's activations are another engineer's document and cost a trace of the step."""
    setup, layouts = dump.case_layouts(case)
    return codec.render(documents.golden_documents(layouts, setup.plan.abstract_mesh(), header=dump.header(setup)))


# --- what init declares, read from its jaxpr ------------------------------------------------------------

@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_declared_specs_from_jit_reshard_device_put(axis_type):
    """Each way a program places what its init returns is read, on an Auto mesh as on an Explicit one;
    a leaf it leaves alone is None, one it declares replicated is P()."""
    mesh = AbstractMesh((2, 2), ("x", "y"), axis_types=(axis_type,) * 2)

    def init():
        m = jax.sharding.get_abstract_mesh()
        jitted = jax.jit(lambda: (jnp.zeros((8, 4)), jnp.zeros(4)),
                         out_shardings=(NamedSharding(m, P("x", "y")), NamedSharding(m, P())))()
        put = jax.device_put(jnp.zeros((8, 4)), NamedSharding(m, P(None, "y")))
        placed = (jax.sharding.reshard(jnp.zeros((8, 4)), P("y")) if axis_type == AxisType.Explicit else
                  jax.lax.with_sharding_constraint(jnp.zeros((8, 4)), NamedSharding(m, P("y"))))
        return jitted + (put, placed, jnp.zeros(3))

    with jax.sharding.use_abstract_mesh(mesh):
        found = declared_specs(jax.make_jaxpr(init)())
    assert [None if s is None else strip(s) for s in found] == [("x", "y"), (), (None, "y"), ("y",), None]


def strip(spec) -> tuple:
    """A spec's entries without trailing Nones (jax versions differ in padding them)."""
    entries = tuple(spec)
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return entries


# --- sharding in types: a pure-JAX program with its own rules -------------------------------------------

def own_specs(rules) -> dict[str, tuple]:
    """Every weight's spec computed from the program's own code: its shapes' logical axes, its rules."""
    from examples import pure_jax_llama as pj

    infos = pj.shapes(pj.Config(rules=rules))
    flat = jax.tree_util.tree_flatten_with_path(infos, is_leaf=pj._is_info)[0]
    return {"params/" + sd.core.tree.path_text(k): tuple(pj.spec(rules, *info[1])) for k, info in flat}


def test_pure_jax_every_weight_as_the_program_places_it(fresh):
    from examples import pure_jax_llama as pj

    layouts = layouts_of(PURE_JAX)
    expected = own_specs(pj.RULES)
    assert len(expected) == 21
    for path, spec in expected.items():
        t = layouts[path]
        assert tuple(t.partition_spec) + (None,) * (len(t.shape) - len(t.partition_spec)) == \
            spec + (None,) * (len(t.shape) - len(spec)), path
        assert t.source == "type", path
        for slot in ("mu", "nu"):  # AdamW's moments follow their weight
            assert layouts["opt_state/0/" + slot + path[len("params"):]].partition_spec == t.partition_spec
    assert sum(any(e is not None for e in spec) for spec in expected.values()) == 16  # the norms stay whole


def test_pure_jax_rule_edit_fails_its_golden(fresh, tmp_path):
    """The program's own rule for `mlp` moved: its golden fails, naming the MLP weights."""
    from examples import pure_jax_llama as pj

    report = golden_after(tmp_path, PURE_JAX, state_goldens,
                          lambda: fresh.setattr(pj, "RULES", dataclasses.replace(pj.RULES, mlp=None)))
    assert "params/layers/0/w_up" in report and "params/layers/1/w_down" in report
    assert "params/layers/0/q" not in report


def test_check_says_where_a_listed_weight_was_placed(fresh):
    """`check` names the program as the source of a weight it lists, and its spec."""
    from sharding_dump.commands import check

    (finding,) = check.lint_case(program_case(PURE_JAX), tolerance=0.0)
    at = finding.details.index("params/final_norm  256 Bytes")
    assert finding.details[at + 1].startswith("  placed by the program itself: its init's own sharding")
    assert finding.details[at + 2] == "  spec [None]"


def test_auto_mesh_reads_the_declared_out_shardings(fresh):
    """On an Auto mesh the types carry no sharding, yet the weights are placed as init's jit declares."""
    spec = PURE_JAX[:3] + ({**PURE_JAX[3], "shard_mode": "auto"},)
    program = model_ref.factory_program(spec[0])
    plan = dump.setup_case(program_case(spec)).plan
    with jax.sharding.use_abstract_mesh(plan.abstract_mesh()):
        state, declared = program.placed_state(sd.core.state.abstract_key())
    assert tuple(declared["params/layers/0/w_up"]) == ("fsdp", "tensor")
    assert layouts_of(spec)["params/layers/0/w_up"].partition_spec == P("fsdp", "tensor")


def test_init_is_traced_once(fresh):
    """Explicit mode's even-split check and the dump read one trace of the program's init."""
    from examples import pure_jax_llama as pj

    calls = []
    real = pj.init_weights
    fresh.setattr(pj, "init_weights", lambda key, cfg: calls.append(1) or real(key, cfg))
    dump.case_layouts(program_case(PURE_JAX))  # the even-split check of explicit mode, then the layouts
    assert len(calls) == 1


# --- params_axes: the older flax partitioning API -------------------------------------------------------

def params_axes_specs(module) -> dict[str, tuple]:
    """Each parameter's own params_axes names, resolved by the example's logical rules."""
    variables = jax.eval_shape(lambda: module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                                                   jnp.ones((1, 8), jnp.int32)))
    names = nn_partitioning.get_axis_names(variables["params_axes"])
    rules = load_rule(str(REPO / T5X[2]))
    flat = jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: isinstance(x, P))[0]
    return {"params/" + sd.core.tree.path_text(k): tuple(resolve(tuple(axes), rules)) for k, axes in flat}


@pytest.mark.parametrize("spec", [T5X, T5X_TRAIN], ids=["model", "train"])
def test_params_axes_place_each_weight_and_its_slots(fresh, spec):
    from examples import t5x_style

    layouts = layouts_of(spec)
    expected = params_axes_specs(t5x_style.Decoder())
    assert len(expected) == 19
    assert "partition_rules" not in (REPO / spec[2]).read_text()  # no axis written twice
    for path, own in expected.items():
        t = layouts[path]
        assert tuple(t.partition_spec) == own and t.source == "params_axes", path
        assert layouts["opt_state/0/mu" + path[len("params"):]].partition_spec == t.partition_spec
        assert layouts["opt_state/0/nu" + path[len("params"):]].source == "params_axes"


def test_params_axes_edit_fails_its_golden(fresh, tmp_path):
    """One param_with_axes axis name changed in the model: its golden fails, naming the weights."""
    from examples import t5x_style

    report = golden_after(tmp_path, T5X, state_goldens,
                          lambda: fresh.setattr(t5x_style, "MLP_AXES", ("embed", "kv")))
    assert "params/layers_0/wi/kernel" in report and "params/layers_1/wo/kernel" in report


# --- boxes, NNX variables, regexes: the program's own sharding edited ----------------------------------

def test_linen_box_edit_fails_its_golden(fresh, tmp_path):
    from examples import linen_lm

    real = linen_lm.dense
    edited = lambda features, axes, name: real(features, ("embed", None) if name == "up" else axes, name)  # noqa: E731
    report = golden_after(tmp_path, LINEN, state_goldens,
                          lambda: fresh.setattr(linen_lm, "dense", edited))
    assert "params/block_0..3/up/kernel  (4 tensors, and opt_state/0/mu, opt_state/0/nu)" in report  # 4 layers alike
    assert "/down/kernel" not in report


def test_nnx_variable_edit_fails_its_golden(fresh, tmp_path):
    from examples import nnx_lm

    real = nnx_lm.linear
    edited = lambda d_in, d_out, axes, rngs: real(d_in, d_out, tuple(reversed(axes)), rngs)  # noqa: E731
    report = golden_after(tmp_path, NNX, state_goldens,
                          lambda: fresh.setattr(nnx_lm, "linear", edited))
    assert "params/blocks/up/kernel" in report


def test_regex_edit_fails_its_golden(fresh, tmp_path):
    """The rule file's regex for the MLP's input kernels moved to the other dimension."""
    text = (REPO / REGEX[2]).read_text()
    rule = '  - ["feed_forward/(w1|w3)/kernel", [fsdp, mp]]'
    copy = tmp_path / "regex_llama.yml"
    copy.write_text(text)
    spec = (REGEX[0], REGEX[1], str(copy), REGEX[3])
    report = golden_after(tmp_path, spec, state_goldens,
                          lambda: copy.write_text(text.replace(rule, rule.replace("fsdp, mp", "mp, fsdp"))))
    assert "feed_forward/w1/kernel" in report and "feed_forward/w2/kernel" not in report


# --- any program shape ------------------------------------------------------------------------------------

PROGRAM = '''
import jax, jax.numpy as jnp, optax
import sharding_dump as sd
from jax.sharding import NamedSharding, PartitionSpec as P


def program():
    tx = optax.sgd(0.1)

    def init(key):
        mesh = jax.sharding.get_abstract_mesh()
        weights = jax.jit(lambda: {"w": jnp.zeros((64, 32))}, out_shardings={"w": NamedSharding(mesh, P("fsdp"))})()
        return {"weights": weights, "sgd": tx.init(weights)}

    def train_step(state, batch):
        grads = jax.grad(lambda w: (jnp.take(w["w"], batch["inputs"], axis=0) ** 2).sum())(state["weights"])
        updates, sgd = tx.update(grads, state["sgd"])
        return {"weights": optax.apply_updates(state["weights"], updates), "sgd": sgd}, {}

    return sd.TrainProgram(init, train_step, batch={"inputs": sd.Input()})
'''


def test_any_top_level_names_and_a_mesh_only_rule_file(fresh, tmp_path):
    """A state named `weights` and `sgd` dumps (per-part bytes for what is there) under a rule file that
    declares only the mesh; the program's own placement is the only one."""
    (tmp_path / "own_names.py").write_text(PROGRAM)
    (tmp_path / "mesh.yml").write_text("mesh_axes: [fsdp]\n")
    fresh.syspath_prepend(str(tmp_path))
    assert cli.main(["--model", "own_names:program", "--topology", "cpu-4", "--rule", str(tmp_path / "mesh.yml"),
                     "ici_fsdp_parallelism=4", "per_device_batch_size=1", "max_target_length=16",
                     "--output-dir", str(tmp_path / "out")]) == 0
    (named,) = (tmp_path / "out").rglob("named_shardings.json")
    doc = json.loads(named.read_text())
    assert sorted(doc["per_device_bytes"]) == ["total", "weights"]
    assert doc["tensors"]["weights/w"]["partition_spec"] == ["fsdp", None]


KEYS_PROGRAM = '''
import jax, jax.numpy as jnp
import sharding_dump as sd
from jax.sharding import NamedSharding, PartitionSpec as P


def program():
    def init(key):  # Levanter's way: a training key split from the one it is given, kept in the state
        mesh = jax.sharding.get_abstract_mesh()
        params_key, training_key = jax.random.split(key)
        per_row = jax.jit(lambda k: jax.random.split(k, 8), out_shardings=NamedSharding(mesh, P("fsdp")))(key)
        return {"params": {"w": jax.random.normal(params_key, (64, 32))}, "training_key": training_key,
                "row_keys": per_row}

    def train_step(state, batch):
        training_key, dropout = jax.random.split(state["training_key"])
        w = state["params"]["w"] * jax.random.bernoulli(dropout, 0.9, (64, 32))
        return {**state, "params": {"w": w}, "training_key": training_key}, {}

    return sd.TrainProgram(init, train_step, batch={"inputs": sd.Input()})
'''


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_typed_prng_keys_in_the_state_dump_as_keys(fresh, tmp_path, mode):
    """A typed PRNG key in the state (`jax.random.key`, an extended dtype) is a leaf of dtype `key<fry>`,
    its shape the key array's, its bytes those of its key data (2 uint32 per threefry key), placed as the
    program placed it (mutation: `jax.numpy.dtype(dtype).name` for it in layout.dtype_name, and the dump
    fails with `TypeError: Cannot interpret 'key<fry>' as a data type`)."""
    (tmp_path / "keyed.py").write_text(KEYS_PROGRAM)
    (tmp_path / "mesh.yml").write_text("mesh_axes: [fsdp]\n")
    fresh.syspath_prepend(str(tmp_path))
    assert cli.main(["--model", "keyed:program", "--topology", "cpu-4", "--rule", str(tmp_path / "mesh.yml"),
                     "ici_fsdp_parallelism=4", "per_device_batch_size=1", "max_target_length=16", f"shard_mode={mode}",
                     "--output-dir", str(tmp_path / "out")]) == 0
    (named,) = (tmp_path / "out").rglob("named_shardings.json")
    tensors = json.loads(named.read_text())["tensors"]
    assert {path: (e["dtype"], e["shape"], e["partition_spec"], e["per_device_bytes"]) for path, e in tensors.items()
            if path != "params/w"} == {"training_key": ("key<fry>", [], [], 8),
                                       "row_keys": ("key<fry>", [8], ["fsdp"], 2 * 8)}


# Levanter's style: an Equinox module of haliax named arrays, placed by its own axis mapping (`hax.shard`, a
# sharding constraint on the case's mesh), or (`placed=False`) left to the rule file's logical rules.
NAMED_PROGRAM = '''
import equinox as eqx
import haliax as hax
import jax
import optax

import sharding_dump as sd

Embed, Mlp, Vocab = hax.Axis("embed", 64), hax.Axis("mlp", 256), hax.Axis("vocab", 128)
MAPPING = {"mlp": "tensor", "embed": "fsdp", "vocab": "tensor"}


class Lm(eqx.Module):
    embedding: hax.NamedArray
    up: hax.nn.Linear
    down: hax.nn.Linear


def program(placed=True):
    tx = optax.adamw(1e-3)

    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        model = Lm(hax.random.normal(k1, (Vocab, Embed)), hax.nn.Linear.init(Embed, Mlp, key=k2, use_bias=False),
                   hax.nn.Linear.init(Mlp, Embed, key=k3, use_bias=False))
        model = hax.shard(model, MAPPING) if placed else model
        return {"params": model, "opt_state": tx.init(model)}

    def train_step(state, batch):
        def loss(model):
            tokens = hax.named(batch["inputs"], ("batch", "position"))
            x = model.embedding.take("vocab", tokens)
            return model.down(hax.nn.relu(model.up(x))).sum().scalar()

        grads = jax.grad(loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {}

    return sd.TrainProgram(init, train_step, batch={"inputs": sd.Input()})


def by_rules():
    return program(placed=False)
'''


@pytest.mark.parametrize("function, rule", [("program", "mesh_axes: [fsdp, tensor]\n"),
                                            ("by_rules", "mesh_axes: [fsdp, tensor]\nlogical_axis_rules:\n"
                                                         "  - [embed, fsdp]\n  - [mlp, tensor]\n")])
def test_named_axes_are_logical_axes(fresh, tmp_path, function, rule):
    """A haliax program's weights and Adam moments carry their axis names: the logical golden holds them
    (it held `[]`), placed by the program's own axis mapping, or by the rule file's logical rules where
    it placed nothing (mutation: no `box_named_arrays` in zoo.dump.layout_view, and every leaf has `[]`,
    by_rules' weights whole on every device)."""
    (tmp_path / "named_lm.py").write_text(NAMED_PROGRAM)
    (tmp_path / "named.yml").write_text(rule)
    fresh.syspath_prepend(str(tmp_path))
    assert cli.main(["--model", f"named_lm:{function}", "--topology", "cpu-4", "--rule", str(tmp_path / "named.yml"),
                     "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "per_device_batch_size=1",
                     "max_target_length=16", "--output-dir", str(tmp_path / "out")]) == 0
    (folder,) = {p.parent for p in (tmp_path / "out").rglob("named_shardings.json")}
    logical = json.loads((folder / "logical_shardings.json").read_text())["tensors"]
    named = json.loads((folder / "named_shardings.json").read_text())["tensors"]
    names = {"embedding": ["vocab", "embed"], "up/weight": ["mlp", "embed"], "down/weight": ["embed", "mlp"]}
    for part in ("params/", "opt_state/0/mu/", "opt_state/0/nu/"):
        for weight, axes in names.items():
            (path,) = [p for p in logical if p.startswith(part + weight + "/")]  # the named array's own level
            assert logical[path]["logical_axes"] == axes, path
            mapping = {"vocab": "tensor"} if function == "program" else {}
            assert named[path]["partition_spec"] == [{"embed": "fsdp", "mlp": "tensor", **mapping}.get(a)
                                                     for a in axes], path


# --- Hugging Face Flax models as users hold them --------------------------------------------------------

HF = ("examples.hf_llama:small_llama", "cpu-8", "examples/hf_llama_rules.yml",
      {"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 2, **SMALL})


def test_hf_flax_llama_as_users_hold_it(fresh):
    """A FlaxPreTrainedModel dumps, called with input_ids, attention_mask, position_ids and dropout on,
    every weight placed by the rule file's regexes; its `.module` is the same program."""
    pytest.importorskip("transformers", minversion="4.57")
    from examples import hf_llama
    from sharding_dump.core.capture import equations
    from sharding_dump.core.program import as_program

    layouts = layouts_of(HF)
    params = [t for t in layouts.values() if t.group == "params"]
    assert len(params) == 21
    assert all(t.source == "regex" for t in params)
    assert layouts["params/model/layers/0/mlp/up_proj/kernel"].partition_spec == P("fsdp", "tensor")
    program = model_ref.factory_program(HF[0])
    assert program.kwargs == {"deterministic": False} and program.positions == "position_ids"
    assert set(program.inputs) == {"attention_mask"}
    closed, _ = dump.trace_case(dump.setup_case(program_case(HF)))
    assert any(eqn.primitive.name == "random_bits" for eqn, _ in equations(closed))  # dropout on
    module = as_program(hf_llama.small_llama_module)
    assert type(module.model) is type(program.model) and module.kwargs == program.kwargs


# --- parameter reads are not activations -----------------------------------------------------------------

def test_param_with_axes_reads_are_not_activations(fresh):
    """The weights' own constraints on their reads (same shape, same names as the weight) are the
    state's placement, already in the state's goldens: none is an activation entry."""
    from examples import t5x_style

    setup = dump.setup_case(program_case(T5X))
    weights = {(tuple(t.shape), t.logical_axes) for t in dump.case_layouts(program_case(T5X))[1] if t.group == "params"}
    assert len(params_axes_specs(t5x_style.Decoder())) == 19
    reads = [c.key for c in dump.trace_activations(setup) if (tuple(c.shape), tuple(c.logical_axes)) in weights]
    assert reads == []


# --- the compiled step agrees ----------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("spec", [PURE_JAX, T5X_TRAIN], ids=["pure-jax", "t5x-train"])
def test_verify_compiles_the_program_as_dumped(fresh, tmp_path, capsys, spec):
    """Each program's own step, compiled on fake devices with the golden's state shardings: they match."""
    model, topology, rule, overrides = spec
    args = ["--model", model, "--topology", topology, "--rule", rule, *(f"{k}={v}" for k, v in overrides.items()),
            "--golden-dir", str(tmp_path)]
    assert cli.main(args) == 0
    status = cli.main(["verify", *args])
    out = capsys.readouterr().out
    assert status == 0 and "1 case verified, 0 failed" in out, out


def test_explicit_mode_names_regex_placed_weights(fresh):
    """On an Explicit mesh the harness places a ModelProgram's weights itself (by its regexes): their
    source is the regex, not the type it put them in."""
    spec = REGEX[:3] + ({**REGEX[3], "shard_mode": "explicit"},)
    layouts = layouts_of(spec)
    assert layouts["params/transformer/h_0/feed_forward/w1/kernel"].source == "regex"
    assert layouts["opt_state/0/mu/transformer/h_0/feed_forward/w1/kernel"].source == "regex"


def test_a_state_object_holding_params_axes_boxes_its_parameters_and_their_moments():
    """t5x's FlaxOptimTrainState keeps `params_axes` as an attribute beside `_optimizer` (its target, the
    parameters, and its optimizer state): every array whose path ends in a parameter's path, at its rank,
    carries the parameter's names, as t5x's own `as_logical_axes()` gives them (they were [] in
    logical_shardings.json); a leaf of another rank (a count) is left as it was."""
    import flax.struct
    from flax.linen.partitioning import AxisMetadata

    from sharding_dump.core.placement import AxesBox, box_params_axes

    class OptimTrainState(flax.struct.PyTreeNode):
        _optimizer: dict
        params_axes: dict

    state = OptimTrainState(
        _optimizer={"target": {"mlp": {"wi": {"kernel": jnp.zeros((4, 8))}}},
                    "state": {"count": jnp.zeros(()), "mu": {"mlp": {"wi": {"kernel": jnp.zeros((4, 8))}}}}},
        params_axes={"mlp": {"wi": {"kernel_axes": AxisMetadata(names=("embed", "mlp"))}}})
    boxed = box_params_axes(state)
    target, mu = boxed._optimizer["target"]["mlp"]["wi"]["kernel"], boxed._optimizer["state"]["mu"]["mlp"]["wi"]["kernel"]
    assert isinstance(target, AxesBox) and target.names == ("embed", "mlp")
    assert isinstance(mu, AxesBox) and mu.names == ("embed", "mlp")
    assert not isinstance(boxed._optimizer["state"]["count"], AxesBox)
