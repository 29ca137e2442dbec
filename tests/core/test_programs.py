"""Training programs: a model and how to call it (ModelProgram), the user's own init and step
(TrainProgram), explicit sharding for user models, and every failure of the interface as one line.

The models are flax's lm1b (examples/flax_lm1b/models.py, vendored unmodified) in training mode and
examples/nnx_gemma.py (a Gemma 3 style NNX model with its own ShardingConfig), at small sizes; the
full-size parameter counts are checked abstractly."""

from __future__ import annotations

import json
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import sharding_dump as sd
from helpers import REPO, assert_bad_input
from sharding_dump.commands import cli
from sharding_dump.core import capture
from sharding_dump.core.step import token_loss

LM1B_ARGS = ["--topology", "cpu-8", "--rule", "examples/lm1b_rules.yml", "ici_fsdp_parallelism=4",
             "ici_tensor_parallelism=2", "per_device_batch_size=2", "max_target_length=64"]
GEMMA_ARGS = ["--topology", "cpu-4", "--rule", "examples/gemma_rules.yml", "ici_fsdp_parallelism=2",
              "ici_tensor_parallelism=2", "per_device_batch_size=2", "max_target_length=64"]


def dump(tmp_path, monkeypatch, model: str, args: list[str]) -> dict[str, dict]:
    monkeypatch.chdir(REPO)
    assert cli.main(["--model", model, *args, "--output-dir", str(tmp_path)]) == 0
    (folder,) = [p for p in (tmp_path / model.replace(":", "-")).rglob("*") if (p / "named_shardings.json").exists()]
    return {p.name: json.loads(p.read_text()) for p in folder.iterdir()}


def param_count(named: dict) -> int:
    return sum(math.prod(t["shape"]) for path, t in named["tensors"].items() if "params/" in path)


# --- lm1b: a linen model in training mode, both levels ---------------------------------------------------

def test_lm1b_training_model_with_dropout(tmp_path, monkeypatch):
    """The training model (deterministic=False) dumps: dropout gets its stream, positions go to
    `inputs_positions`, the segmentation is a batch field placed like the tokens."""
    from examples import lm1b

    docs = dump(tmp_path, monkeypatch, "examples.lm1b:small_lm1b", LM1B_ARGS)
    program = lm1b.small_lm1b()
    assert program.position_keyword(program.model) == "inputs_positions"
    own = jax.eval_shape(program.model.init, {"params": jax.random.key(0), "dropout": jax.random.key(1)},
                         jnp.zeros((1, 8), jnp.int32))["params"]
    assert param_count(docs["named_shardings.json"]) == sum(math.prod(x.shape) for x in jax.tree.leaves(own))
    named = docs["named_shardings.json"]["tensors"]
    assert named["params/decoder/encoderdecoderblock_0/MlpBlock_0/Dense_0/kernel"]["partition_spec"] == ["fsdp", "tensor"]
    acts = docs["activation_shardings.json"]["tensors"]
    assert acts["forward/inputs_segmentation"]["partition_spec"] == [["data", "fsdp"], None]
    assert acts["forward/inputs_segmentation"]["logical_axes"] == ["batch", "length"]


def test_lm1b_step_runs_dropout():
    """The traced step draws dropout masks (the training model, not the eval model, is what ran)."""
    from examples import lm1b

    program = lm1b.small_lm1b()
    model = program.model_of()
    state = sd.abstract_train_state(model.build_params())
    batch = {name: f.abstract(4, 16) for name, f in program.batch_fields().items()}
    jaxpr = jax.make_jaxpr(program.train_step(model, sd.default_optimizer(), None, None))(state, batch)
    assert any(eqn.primitive.name == "random_bits" for eqn, _ in capture.equations(jaxpr))
    eval_model = sd.ModelProgram(lm1b.models.TransformerLM(lm1b.config(**lm1b.SMALL, deterministic=True)),
                                 inputs=lm1b.PACKED).model_of()
    jaxpr = jax.make_jaxpr(program.train_step(eval_model, sd.default_optimizer(), None, None))(state, batch)
    assert not any(eqn.primitive.name == "random_bits" for eqn, _ in capture.equations(jaxpr))


def test_lm1b_own_step_gives_the_same_state_layout(tmp_path, monkeypatch):
    """lm1b's own init and train_step (a TrainState, its AdamW, its loss) traced as a TrainProgram:
    the same layouts as the harness's step over the same model, and its batch placed per field."""
    model = dump(tmp_path / "a", monkeypatch, "examples.lm1b:small_lm1b", LM1B_ARGS)
    own = dump(tmp_path / "b", monkeypatch, "examples.lm1b:small_lm1b_train", LM1B_ARGS)
    assert own["named_shardings.json"]["tensors"] == model["named_shardings.json"]["tensors"]
    acts = own["activation_shardings.json"]["tensors"]
    assert set(acts) == {"forward/inputs", "forward/inputs_position", "forward/inputs_segmentation"}


def test_full_size_parameter_counts():
    """flax's lm1b (default config) and the Gemma 3 1B shapes, abstractly: 49,653,040 and 738,225,280."""
    from examples import lm1b, nnx_gemma

    assert sd.parameter_count(lm1b.lm1b().model_of().build_params()) == 49_653_040
    with nnx.use_eager_sharding(False):
        gemma = nnx.eval_shape(lambda: nnx_gemma.Transformer(nnx_gemma.gemma3_1b(), rngs=nnx.Rngs(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(gemma, nnx.Param))) == 738_225_280


# --- Gemma: NNX with sharding in types ------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_docs(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    try:
        return dump(tmp_path_factory.mktemp("gemma"), monkeypatch, "examples.nnx_gemma:small_gemma",
                    GEMMA_ARGS + ["shard_mode=explicit"])
    finally:
        monkeypatch.undo()


def test_gemma_weights_follow_its_sharding_config(gemma_docs):
    named = gemma_docs["named_shardings.json"]
    assert named["mesh"]["shard_mode"] == "explicit"
    tensors = named["tensors"]
    assert tensors["params/embedder/embedding"]["partition_spec"] == ["tensor", "fsdp"]
    assert tensors["params/layers/0/mlp/down_proj/kernel"]["partition_spec"] == ["tensor", "fsdp"]
    assert tensors["opt_state/0/nu/layers/1/attn/q_einsum/kernel"]["partition_spec"] == ["tensor", "fsdp", None]
    logical = gemma_docs["logical_shardings.json"]["tensors"]
    assert logical["params/layers/0/mlp/gate_proj/kernel"]["logical_axes"] == ["fsdp", "tensor"]


def test_gemma_activation_specs_forward_and_backward(gemma_docs):
    """Every `out_sharding=` of the model is an activation, forward and backward, read from the traced
    step and keyed by its call site (NNX keeps no module stack; the layers share their call sites)."""
    acts = gemma_docs["activation_shardings.json"]["tensors"]
    btd, btf = ["fsdp", None, "tensor"], ["fsdp", None, "tensor"]
    for site, spec in (("FeedForward.__call__-L1", btf),  # gate_proj and up_proj, on one line
                       ("FeedForward.__call__-L2", btd),  # down_proj
                       ("Attention.__call__-L20", btd),  # attn_vec_einsum
                       ("Attention.__call__-L3", ["fsdp", None, "tensor", None]),  # q_einsum
                       ("Attention.__call__-L4", [None, "fsdp", None, None, None])):  # kv_einsum
        for pass_ in ("forward", "backward"):
            assert acts[f"{pass_}/dot_general-{site}"]["partition_spec"] == spec, (pass_, site)
    assert acts["forward/dot_general-Transformer.__call__-L6"]["shape"] == [8, 64, 512]  # embedder.attend
    assert acts["backward/reshard-ScaledEmbed.__call__-L1"]["partition_spec"] == btd  # the embedding lookup
    assert acts["forward/inputs"]["partition_spec"] == ["fsdp", None]  # no input axes: data_sharding
    assert not [key for key in acts if "broadcast_in_dim" in key]  # jnp.where's own broadcast is jax's choice


def test_gemma_activation_spec_edit_changes_the_dump(monkeypatch):
    """Move one activation spec of the ShardingConfig: its entries change, forward and backward."""
    from examples import nnx_gemma

    def traced(shd):
        program = nnx_gemma.program(nnx_gemma.gemma3_1b(num_layers=1, global_every=1, num_embed=64, embed_dim=16,
                                                        hidden_dim=32, num_heads=2, head_dim=8, shd=shd))
        mesh = AbstractMesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
        model = program.model_of()
        state = sd.core.state.explicit_train_state(model, mesh, [("fsdp", "fsdp"), ("tensor", "tensor")])
        sharding = jax.sharding.NamedSharding(mesh, P("fsdp", None))
        batch = {n: jax.ShapeDtypeStruct((4, 8), jnp.int32, sharding=sharding) for n in program.batch_fields()}
        step = program.train_step(model, sd.default_optimizer(), None, P("fsdp"))
        return {c.key: tuple(c.partition_spec) for c in sd.record_activations(step, state, batch, mesh=mesh, rules=())}

    shd = nnx_gemma.ShardingConfig.fsdp_tp()
    import dataclasses

    before, after = traced(shd), traced(dataclasses.replace(shd, act_btf=P("fsdp", None, None)))
    for pass_ in ("forward", "backward"):
        key = f"{pass_}/dot_general-FeedForward.__call__-L1"
        assert before[key] == ("fsdp", None, "tensor") and after[key] == ("fsdp", None, None)


def test_gemma_needs_explicit_mode(tmp_path, capsys, monkeypatch):
    """On an Auto mesh its `out_sharding=` calls fail inside the model: one line naming the call."""
    monkeypatch.chdir(REPO)
    assert_bad_input(tmp_path, capsys, "--model examples.nnx_gemma:small_gemma " + " ".join(GEMMA_ARGS),
                     "the model call failed with")


# --- plain and typed constraints --------------------------------------------------------------------------

MESH = AbstractMesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)  # jax 0.12: Explicit unless said
EXPLICIT = AbstractMesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def place_twice(x):
    a = jax.lax.with_sharding_constraint(x, P("data", None))
    b = jax.lax.with_sharding_constraint(x * 2, P("data", None))
    return a, b


def place_twice_swapped(x):
    b = jax.lax.with_sharding_constraint(x * 2, P("data", None))
    a = jax.lax.with_sharding_constraint(x, P("data", None))
    return a, b


def test_plain_constraints_keyed_by_call_site():
    """Two plain constraints with one layout are two keys; the keys name the call sites, not the order."""
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    keys = [c.key for c in sd.record_activations(place_twice, x, mesh=MESH, rules=())]
    assert keys == ["forward/sharding_constraint-place_twice-L1", "forward/sharding_constraint-place_twice-L2"]
    swapped = [c.key for c in sd.record_activations(place_twice_swapped, x, mesh=MESH, rules=())]
    assert swapped == ["forward/sharding_constraint-place_twice_swapped-L1",
                       "forward/sharding_constraint-place_twice_swapped-L2"]


def test_reshard_recorded_forward_and_backward():
    def loss(x):
        y = jax.sharding.reshard(x * 3, P(None, "model"))
        return (y ** 2).sum()

    x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=jax.sharding.NamedSharding(EXPLICIT, P("data", None)))
    found = {c.key: tuple(c.partition_spec) for c in sd.record_activations(jax.grad(loss), x, mesh=EXPLICIT, rules=())}
    assert found == {"forward/reshard-test_reshard_recorded_forward_and_backward._locals_.loss-L1": (None, "model"),
                     "backward/reshard-test_reshard_recorded_forward_and_backward._locals_.loss-L1": (None, "model")}


def test_typed_hooks_are_removed_after_a_recording():
    before = (jax.sharding.reshard, nnx.Linear.__call__, "__call__" in nnx.Linear.__dict__)

    def f(x):
        module = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        capture.note_nnx_modules(module)
        return module(x, out_sharding=P())

    with jax.sharding.use_abstract_mesh(EXPLICIT):
        sd.record_activations(f, jax.ShapeDtypeStruct((2, 4), jnp.float32), mesh=EXPLICIT, rules=())
    assert (jax.sharding.reshard, nnx.Linear.__call__, "__call__" in nnx.Linear.__dict__) == before


# --- the batch without input axes -------------------------------------------------------------------------

def test_batch_follows_data_sharding_without_input_axes(tmp_path, monkeypatch):
    rules = (REPO / "examples/lm1b_rules.yml").read_text().replace("input_data_sharding_logical_axes: [batch, length]\n", "")
    (tmp_path / "nolayout.yml").write_text(rules)
    args = [a if a != "examples/lm1b_rules.yml" else str(tmp_path / "nolayout.yml") for a in LM1B_ARGS]
    docs = dump(tmp_path / "out", monkeypatch, "examples.lm1b:small_lm1b", args)
    doc = docs["activation_shardings.json"]
    assert doc["batch"]["data_pipeline_spec"] == [["data", "fsdp"], None]
    for field in ("inputs", "inputs_position", "inputs_segmentation", "targets"):
        assert doc["tensors"][f"forward/{field}"]["partition_spec"] == doc["batch"]["data_pipeline_spec"]
        assert doc["tensors"][f"forward/{field}"]["logical_axes"] == [None, None]


# --- every failure of the interface is one line -------------------------------------------------------

PROGRAMS = '''
import jax, jax.numpy as jnp, flax.linen as nn
from flax import nnx
import sharding_dump as sd
from examples import lm1b, nnx_gemma

class Dict(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return {"hidden": nn.Embed(64, 8)(tokens)}

def boom():
    raise RuntimeError("no GPU here")

def number():
    return 3

def gemma_plain():
    return nnx_gemma.Transformer(nnx_gemma.gemma3_1b(num_layers=1, num_embed=64, embed_dim=16, hidden_dim=32,
                                                             num_heads=2, head_dim=8), rngs=nnx.Rngs(0))

def no_logits():
    return Dict()

def hook_fails():
    return sd.ModelProgram(Dict(), call=lambda model, batch, rngs: model(batch["missing"]))

def input_fails():
    return sd.ModelProgram(Dict(), inputs={"mask": lambda batch: batch["nothing"]})

def bad_shape():
    return sd.ModelProgram(Dict(), inputs={"mask": sd.Input(("batch", "width"))})

def no_dropout_stream():
    return sd.ModelProgram(lm1b.models.TransformerLM(lm1b.config(**lm1b.SMALL)), rngs=())

def init_fails():
    return sd.TrainProgram(lambda key: 1 / 0, lambda state, batch: (state, {}))

def _state(key):
    return {"params": {"w": jnp.zeros((4, 4))}}

def step_fails():
    return sd.TrainProgram(_state, lambda state, batch: state["missing"])

def step_single():
    return sd.TrainProgram(_state, lambda state, batch: state)

def step_restructures():
    return sd.TrainProgram(_state, lambda state, batch: ({"params": state["params"], "extra": 1.0}, {}))
'''

FAILURES = [
    # inside the user's code: the file and line it raised at, and no hint about how the harness calls it
    ("boom", "the model factory programs_boom:boom failed with RuntimeError: no GPU here at programs_boom.py:13 in boom "
             "(the harness passed no arguments)"),
    ("number", "the model factory programs_number:number returned int; the interface expects a Flax linen or NNX module"),
    ("gemma_plain", "the model call failed with TypeError: Transformer.__call__() missing 2 required positional "
                    "arguments: 'cache' and 'attention_mask' (the harness passed Transformer(int32[16,64], "
                    "positions=int32[16,64], rngs=Rngs(dropout)); the model's call is Transformer.__call__(self, "
                    "last_tokens, positions, cache, attention_mask, rngs=None);"),
    ("no_logits", "the model's output {hidden: float32[16,64,8]} holds no float logits [batch, length, vocab]"),
    ("hook_fails", "the call hook hook_fails.<locals>.<lambda> failed with KeyError: 'missing' at "
                   "programs_hook_fails.py:26 in hook_fails.<locals>.<lambda> (the harness passed call(model, "
                   "{inputs: int32[1,8]"),
    ("input_fails", "computing input 'mask' with input_fails.<locals>.<lambda> failed with KeyError: 'nothing'"),
    ("bad_shape", "Input(shape=('batch', 'width')): give a tuple of sizes, each a whole number >= 0 or one of 'batch', 'length'"),
    ("no_dropout_stream", 'the model call failed with InvalidRngError: Dropout_0 needs PRNG for "dropout"'),
    ("init_fails", "the program's init init_fails.<locals>.<lambda> failed with ZeroDivisionError: division by zero "
                   "at programs_init_fails.py:38 in init_fails.<locals>.<lambda> (the harness passed init(key<fry>[]))"),
    ("step_fails", "the program's train_step step_fails.<locals>.<lambda> failed with KeyError: 'missing'"),
    ("step_single", "returned {params: {w: float32[4,4]}}; the interface expects a pair (new state, metrics)"),
    ("step_restructures", "returned a state of another tree than init's: new leaf extra"),
]


@pytest.mark.parametrize("factory, message", FAILURES, ids=[f for f, _ in FAILURES])
def test_program_failures_are_one_line(tmp_path, capsys, monkeypatch, factory, message):
    module = f"programs_{factory}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PROGRAMS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    rules = tmp_path / "rules.yml"
    rules.write_text("mesh_axes: [data]\nlogical_axis_rules:\n  - [batch, data]\n")
    assert_bad_input(tmp_path, capsys, f"--model {module}:{factory} --topology cpu-2 --rule {rules} "
                                       "ici_data_parallelism=2 per_device_batch_size=8 max_target_length=64", message)


def test_token_loss_and_its_gradient_are_cross_entropy():
    """The step's loss (a custom gradient, so XLA keeps no float32 copy of the logits) against optax's."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 7)), jnp.bfloat16)
    targets = jnp.array([[1, 2, 6], [0, 0, 5]])
    reference_loss = lambda x: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        x.astype(jnp.float32), targets).mean()
    # both in one compiled function (op by op, each operation would compile alone)
    ours, reference = jax.jit(lambda x: (jax.value_and_grad(lambda y: token_loss(y, targets))(x),
                                         jax.value_and_grad(reference_loss)(x)))(logits)
    assert ours[1].dtype == jnp.bfloat16
    for got, want in zip(ours, reference):
        assert jnp.allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=1e-3)


@pytest.mark.compile
def test_verify_compiles_a_train_program(tmp_path, monkeypatch, capsys):
    """lm1b's own step, compiled on 4 fake devices with the golden's state shardings: they match."""
    args = ["--topology", "cpu-4", "--rule", "examples/lm1b_rules.yml", "ici_fsdp_parallelism=2",
            "ici_tensor_parallelism=2", "per_device_batch_size=1", "max_target_length=16"]
    dump(tmp_path, monkeypatch, "examples.lm1b:small_lm1b_train", args)
    status = cli.main(["verify", "--model", "examples.lm1b:small_lm1b_train", *args, "--golden-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "1 case verified, 0 failed" in out and "all-reduce" in out


def test_explicit_placement_follows_each_flavour_of_flax():
    """On an Explicit mesh an NNX variable is placed by NNX's rule application (a name without a rule
    is a mesh axis, as flax's Gemma relies on), a linen box by flax's logical resolver (no rule: whole)."""
    from examples import linen_lm, nnx_gemma

    gemma = nnx_gemma.small_gemma().model_of()
    linen = sd.as_model(linen_lm.small_lm())
    assert gemma.placement(("tensor", "fsdp"), [("batch", "fsdp")]) == P("tensor", "fsdp")
    assert gemma.placement(("vocab", "embed"), [("vocab", "tensor"), ("embed", "fsdp")]) == P("tensor", "fsdp")
    assert linen.placement(("tensor", "fsdp"), [("batch", "fsdp")]) == P(None, None)


def test_guide_shows_the_model_call_failure_as_printed(tmp_path, capsys, monkeypatch):
    """docs/guide/your-own-program.md's error line is what the CLI prints for flax's Gemma called plainly."""
    shown = next(line for line in (REPO / "docs/guide/your-own-program.md").read_text().splitlines()
                 if line.startswith("sharding-dump: error: the model call failed"))
    (tmp_path / "programs_gemma_plain.py").write_text(textwrap.dedent(PROGRAMS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    (tmp_path / "rules.yml").write_text("mesh_axes: [data]\nlogical_axis_rules:\n  - [batch, data]\n")
    assert cli.main(["--model", "programs_gemma_plain:gemma_plain", "--topology", "cpu-2", "--rule", "rules.yml",
                     "ici_data_parallelism=2", "per_device_batch_size=8", "max_target_length=64",
                     "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == shown + "\n"


def legacy_pjit_program() -> sd.TrainProgram:
    """A trainer in EasyLM's and t5x's style: `pjit` given bare PartitionSpecs for init and step, which
    take their mesh from the legacy `with mesh:` context the trainer enters around everything; the
    program gives that concrete mesh as `mesh=`."""
    from jax.experimental.pjit import pjit

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("fsdp",))
    partition = {"w": P("fsdp", None), "step": P()}
    init = pjit(lambda key: {"w": jax.random.normal(key, (8 * jax.device_count(), 4)), "step": jnp.zeros((), jnp.int32)},
                in_shardings=P(), out_shardings=partition)

    def train_step(state, batch):
        batch = jax.lax.with_sharding_constraint(batch, P("fsdp"))
        grads = jax.grad(lambda w: jnp.mean(batch["inputs"][..., None] * w[:1]))(state["w"])
        return {"w": state["w"] - grads, "step": state["step"] + 1}, {}

    step = pjit(train_step, in_shardings=(partition, P()), out_shardings=(partition, P()))
    return sd.TrainProgram(lambda key: init(jax.random.key_data(key)), step, mesh=mesh,
                           batch={"inputs": sd.Input(dtype=jnp.float32)})


def test_a_pjit_trainer_under_its_with_mesh_dumps_with_mesh_given(tmp_path):
    """pjit with bare PartitionSpecs needs a concrete mesh in the legacy context (jax: AssertionError on the
    abstract one, RuntimeError on none): the program's `mesh=` is that context while init and step are traced."""
    from sharding_dump.zoo import dump
    from sharding_dump.zoo.case import Case

    (tmp_path / "rules.yml").write_text("mesh_axes: [fsdp]\ndata_sharding: [[fsdp]]\n")
    case = Case.make("tests.core.test_programs:legacy_pjit_program", f"cpu-{jax.device_count()}",
                     str(tmp_path / "rules.yml"), overrides={"per_device_batch_size": 2, "max_target_length": 8})
    named = dump.dump_case(case)["named_shardings.json"]["tensors"]
    assert named["w"]["partition_spec"] == ["fsdp", None] and named["step"]["partition_spec"] == []


def test_a_factory_that_sets_its_mesh_is_run_as_it_is():
    """flax's Gemma trainer builds its model and optimizer under `jax.set_mesh(mesh)`, which jax refuses
    inside a trace: a factory doing so is run outside nnx.eval_shape (it failed with jax's `set_mesh can
    only be used outside of jax.jit`); one that sets no mesh still builds its NNX module abstractly."""
    from sharding_dump.core.program import as_program

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("fsdp",))

    def factory():
        with jax.set_mesh(mesh):
            shapes = jax.eval_shape(lambda: {"w": jnp.zeros((8, 4))})
        return sd.TrainProgram(lambda key: jax.tree.map(lambda s: jnp.zeros(s.shape), shapes),
                               lambda state, batch: (state, {}), mesh=mesh)

    assert as_program(factory).mesh is mesh
    built = as_program(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    assert isinstance(built.model.kernel.value, jax.ShapeDtypeStruct)


def test_a_failing_train_step_names_the_state_it_was_passed_by_name():
    """The error line shows the call as `train_step(state, {inputs: int32[...], ...})`: the state by its
    name, not as the quoted string 'state' (which read as if a str had been passed)."""
    from sharding_dump.core.program import ProgramError

    def init(key):
        return {"w": jnp.zeros((8, 4))}

    def train_step(state, batch):
        raise RuntimeError("boom")

    step = sd.TrainProgram(init, train_step, batch={"inputs": sd.Input()}).step(None, None)
    with pytest.raises(ProgramError, match=r"the harness passed train_step\(state, \{inputs: int32\[4,8\]\}\)"):
        step({"w": jnp.zeros((8, 4))}, {"inputs": jnp.zeros((4, 8), jnp.int32)})
