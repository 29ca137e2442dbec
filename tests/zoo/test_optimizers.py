"""Any optax optimizer: every optimizer leaf laid out by the axes it derives from its parameter, for
the core API, a built-in card and a factory; MaxText's `opt_type` for the zoo; bad optimizers."""

from __future__ import annotations

import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import sharding_dump as sd
from helpers import LINEN_ARGS, REPO, assert_bad_input
from sharding_dump.commands import cli
from sharding_dump.core import optimizer as core_opt
from sharding_dump.core.layout import resolve
from sharding_dump.core.specs import spec_to_json
from sharding_dump.golden import diff
from sharding_dump.zoo.rules import load_rule


def boxed(shape, names):
    return nn.Partitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names=names)


def slot_axes(tx, params) -> dict[str, tuple]:
    return {path: s.names for path, s in core_opt.slots(core_opt.optimizer_state(tx, params)).items()}


def test_adafactor_factored_moments_keep_the_axes_of_the_dimensions_they_keep():
    params = {"up": boxed((512, 2048), ("embed", "mlp")), "stack": boxed((4, 512, 256), ("layers", "embed", "mlp")),
              "norm": boxed((512,), ("norm",))}
    axes = slot_axes(optax.adafactor(1e-3), params)
    assert axes["0/v_row/up"] == ("embed",) and axes["0/v_col/up"] == ("mlp",)
    # optax factors the two largest dimensions: v_row drops the largest (embed, 512), v_col the other (mlp)
    assert axes["0/v_row/stack"] == ("layers", "mlp") and axes["0/v_col/stack"] == ("layers", "embed")
    assert axes["0/v/norm"] == ("norm",)  # too small to factor: a full second moment
    assert axes["0/v/up"] == (None,) and axes["0/v_row/norm"] == (None,)  # size-1 placeholders
    assert "0/count" not in axes


def test_a_square_kernel_is_told_apart_by_the_optimizer_own_update():
    """(1024,) could keep either dimension of a (1024, 1024) kernel: the probe trace of Adafactor's
    update says v_row keeps the first and v_col the second, as optax factors it."""
    params = {"wq": boxed((1024, 1024), ("embed", "heads"))}
    with warnings.catch_warnings():
        warnings.simplefilter("error", core_opt.OptimizerAxesWarning)
        axes = slot_axes(optax.adafactor(1e-3), params)
    assert axes == {"0/v_row/wq": ("embed",), "0/v_col/wq": ("heads",), "0/v/wq": (None,)}
    state = core_opt.optimizer_state(optax.sm3(1e-3), params)  # one accumulator per dimension
    assert {p: s.names for p, s in core_opt.slots(state).items() if "/mu/" in p} == {
        "0/mu/wq/0": ("embed",), "0/mu/wq/1": ("heads",)}


def row_sums() -> optax.GradientTransformation:
    """Keeps one vector per square matrix and updates it through a matrix product: the probe cannot
    trace the contraction, so which dimension the vector keeps stays unknown."""
    def init(params):
        return jax.tree.map(lambda p: jnp.zeros(p.shape[:1], p.dtype), params)

    def update(grads, state, params=None):
        return grads, jax.tree.map(lambda g, s: s + ((g @ g.T).sum(axis=1) if g.ndim == 2 else g * g), grads, state)

    return optax.GradientTransformation(init, update)


def test_an_ambiguous_leaf_is_said_aloud_and_written_replicated():
    params = {"w": boxed((64, 64), ("embed", "mlp"))}
    with pytest.warns(core_opt.OptimizerAxesWarning, match=r"1 optimizer leaf could keep more than one set of their "
                      r"parameter's dimensions .* e.g. optimizer leaf w \(64,\) of w \(64, 64\); written with no"):
        axes = slot_axes(row_sums(), params)
    assert axes == {"w": (None,)}


def test_candidate_dims():
    assert core_opt.candidate_dims((4, 256), (4, 256, 512)) == [(0, 1)]
    assert core_opt.candidate_dims((4, 512), (4, 256, 512)) == [(0, 2)]
    assert core_opt.candidate_dims((1, 512), (4, 256, 512)) == [(None, 2)]
    assert core_opt.candidate_dims((512, 4), (4, 256, 512)) == []  # order is kept


def test_multisteps_chain_lion_and_contrib_follow_their_parameter():
    params = {"k": boxed((256, 1024), ("embed", "mlp"))}
    multi = slot_axes(optax.MultiSteps(optax.adamw(1e-4), 4), params)
    assert multi == {"acc_grads/k": ("embed", "mlp"), "inner_opt_state/0/mu/k": ("embed", "mlp"),
                     "inner_opt_state/0/nu/k": ("embed", "mlp")}
    chained = slot_axes(optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4)), params)
    assert chained == {"1/0/mu/k": ("embed", "mlp")}
    assert set(slot_axes(optax.contrib.schedule_free_adamw(1e-3), params).values()) == {("embed", "mlp")}


def test_dump_model_with_adafactor_through_the_core_api():
    from examples.linen_lm import LinenLM

    mesh = jax.sharding.AbstractMesh((2, 4), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = [("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("vocab", "tensor")]
    docs = sd.dump_model(LinenLM(vocab=512, embed=256, layers=1, heads=4, mlp=512), mesh, rules,
                         batch_shape=(8, 16), optimizer=optax.adafactor(1e-3))
    named = docs["named_shardings.json"]["tensors"]
    assert named["opt_state/0/v_row/block_0/up/kernel"]["partition_spec"] == ["fsdp"]
    assert named["opt_state/0/v_col/block_0/up/kernel"]["partition_spec"] == ["tensor"]
    assert named["opt_state/0/v_col/block_0/query/kernel"]["partition_spec"] == ["tensor"]  # square: the probe


def assert_every_slot_follows_its_parameter(folder, rule_ref: str) -> int:
    """Every optimizer leaf of a dump: logical axes those of its parameter's dimensions it keeps (by
    size, in order), or none for a size-1 placeholder; spec those axes resolved by the rules."""
    named = json.loads((folder / "named_shardings.json").read_text())
    logical = json.loads((folder / "logical_shardings.json").read_text())["tensors"]
    rules = load_rule(rule_ref).logical_axis_rules
    sizes = dict(zip(named["mesh"]["axis_names"], named["mesh"]["axis_sizes"]))
    params = {p for p in logical if p.startswith("params/")}
    checked = 0
    for path, entry in logical.items():
        if not path.startswith("opt_state/") or not entry["shape"]:
            continue
        owner = diff.slot_parameter(path, params)
        assert owner, f"{path}: no parameter"
        param = logical[owner[0]]
        pairs = iter(zip(param["shape"], param["logical_axes"]))
        if entry["shape"] == [1] and 1 not in param["shape"]:
            assert entry["logical_axes"] == [None], path
        else:  # (size, axis) per dimension: a sub-sequence of the parameter's
            assert all(dim in pairs for dim in zip(entry["shape"], entry["logical_axes"])), path
        spec = resolve(tuple(entry["logical_axes"]), rules)
        assert named["tensors"][path]["partition_spec"] == spec_to_json(spec, len(entry["shape"]), sizes) or \
            named["tensors"][path]["partition_spec"] == spec_to_json(spec, len(entry["shape"])), path
        checked += 1
    return checked


@pytest.mark.parametrize("optimizer", ["adafactor", "multisteps_adamw"])
@pytest.mark.parametrize("model,rule,extra", [
    ("qwen3-0.6b", "default", LINEN_ARGS),  # slots as the Linen state lays them out: every axis the rules name
    ("examples.linen_lm:small_lm", "examples/rules.yml", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
])
def test_a_card_and_a_factory_with_your_own_optimizer(tmp_path, monkeypatch, model, rule, extra, optimizer):
    monkeypatch.chdir(REPO)
    topology = "tpu7x-16" if ":" not in model else "cpu-8"
    args = ["--model", model, "--topology", topology, "--rule", rule, *extra,
            f"optimizer=examples.optimizers:{optimizer}", "--output-dir", str(tmp_path)]
    assert cli.main(args) == 0
    (folder,) = [p.parent for p in tmp_path.rglob("named_shardings.json")]
    assert f"optimizer=examples.optimizers-{optimizer}" in folder.name
    assert assert_every_slot_follows_its_parameter(folder, str(REPO / rule) if ":" in model else rule) > 10
    logical = json.loads((folder / "logical_shardings.json").read_text())["tensors"]
    header = json.loads((folder / "named_shardings.json").read_text())["case"]
    assert header["overrides"]["optimizer"] == f"examples.optimizers:{optimizer}"
    if optimizer == "adafactor" and ":" not in model:
        assert logical["opt_state/0/v_row/decoder/layers/mlp/wi_0/kernel"]["logical_axes"] == ["embed", "layers"]
        assert logical["opt_state/0/v_col/decoder/layers/mlp/wi_0/kernel"]["logical_axes"] == ["layers", "mlp"]
    if optimizer == "multisteps_adamw":
        key = "block_0/up/kernel" if ":" in model else "decoder/layers/mlp/wi_0/kernel"
        assert logical[f"opt_state/acc_grads/{key}"]["logical_axes"] == logical[f"params/{key}"]["logical_axes"]


def test_zoo_opt_types_change_the_state_as_in_maxtext(tmp_path):
    def dump(opt_type: str) -> dict:
        assert cli.main(["--model", "qwen3-0.6b", "--topology", "tpu7x-16", "--rule", "default",
                         f"opt_type={opt_type}", "--output-dir", str(tmp_path)]) == 0
        folder = tmp_path / f"qwen3-0.6b/tpu7x-16/slice_1/rule_default_opt_type={opt_type}"
        return json.loads((folder / "logical_shardings.json").read_text())["tensors"]

    sgd = dump("sgd")
    assert [p for p in sgd if p.startswith("optimizer/opt_state/")] == ["optimizer/opt_state/1/count"]
    pax = dump("adam_pax")
    assert {p.split("/")[2] for p in pax if p.startswith("optimizer/opt_state/")} == {"count", "mu", "nu"}
    muon = dump("muon")
    muon_part = "optimizer/opt_state/inner_states/muon/inner_state/0/mu/"
    adam_part = "optimizer/opt_state/inner_states/adam/inner_state/0/mu/"
    assert muon[muon_part + "decoder/layers/self_attention/query/kernel"]["logical_axes"] == \
        muon["model/decoder/layers/self_attention/query/kernel"]["logical_axes"]
    assert adam_part + "token_embedder/embedding" in muon and muon_part + "token_embedder/embedding" not in muon
    assert adam_part + "decoder/layers/self_attention/query_norm/scale" in muon


@pytest.mark.parametrize("args,message", [
    ("--model mixtral-8x7b --topology v5p-16 opt_type=muon", "opt_type=muon: MaxText has no Muon rules for decoder block 'mixtral'"),
    ("--model examples.linen_lm:small_lm --topology cpu-8 --rule examples/rules.yml opt_type=muon",
     "opt_type=muon: MaxText's Muon rules name its own decoder blocks' weights"),
    ("opt_type=sgd shard_optimizer_over_data=true ici_data_parallelism=2",
     "shard_optimizer_over_data=true: opt_type=sgd cannot be sharded over data"),
    ("opt_type=sgd optimizer=examples.optimizers:adafactor", "opt_type=sgd and optimizer=examples.optimizers:adafactor: give one"),
    ("optimizer=adafactor", "optimizer='adafactor': give package.module:function"),
    ("optimizer=no_such_module:adafactor", "optimizer 'no_such_module:adafactor': cannot import no_such_module"),
    ("optimizer=examples.optimizers:nope", "optimizer 'examples.optimizers:nope': examples.optimizers has no attribute 'nope'"),
    ("optimizer=examples.optimizers:__doc__", "is a str, not a callable returning an optimizer"),
    ("optimizer=tests.zoo.test_optimizers:raising", "optimizer=tests.zoo.test_optimizers:raising: calling raising() failed "
                                                "with ValueError: learning rate must be positive"),
    ("optimizer=tests.zoo.test_optimizers:not_an_optimizer", "not_an_optimizer() returned 'dict', not an optax optimizer"),
    ("optimizer=tests.zoo.test_optimizers:failing_init", "optimizer=tests.zoo.test_optimizers:failing_init: init(params) "
                                                     "failed with TypeError: expected a list of arrays at tests/zoo/test_optimizers.py:207 in "
                                                     "failing_init.<locals>.init (the harness passed"),
    ("optimizer=tests.zoo.test_optimizers:failing_update", "optimizer=tests.zoo.test_optimizers:failing_update: update(grads, "
                                                       "state, params) failed with ValueError: this optimizer needs a loss"),
])
def test_bad_optimizers_are_one_line_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(REPO)
    assert_bad_input(tmp_path, capsys, args, message)


def failing_init() -> optax.GradientTransformation:
    def init(params):
        raise TypeError("expected a list of arrays")
    return optax.GradientTransformation(init, lambda g, s, p=None: (g, s))


def failing_update() -> optax.GradientTransformation:
    def update(grads, state, params=None):
        raise ValueError("this optimizer needs a loss value")
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def raising() -> optax.GradientTransformation:
    raise ValueError("learning rate must be positive")


def not_an_optimizer() -> dict:
    return {"learning_rate": 1e-3}


def test_zero1_splits_every_optimizer_leaf_of_your_own_optimizer(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli.main(["--model", "qwen3-0.6b", "--topology", "tpu7x-16", "--rule", "default", "ici_data_parallelism=2",
                     "shard_optimizer_over_data=true", "optimizer=examples.optimizers:adafactor", *LINEN_ARGS,
                     "--output-dir", str(tmp_path)]) == 0
    (folder,) = [p.parent for p in tmp_path.rglob("named_shardings.json")]
    named = json.loads((folder / "named_shardings.json").read_text())["tensors"]
    v_row = named["opt_state/0/v_row/decoder/layers/mlp/wi_0/kernel"]["partition_spec"]
    assert "data" in json.dumps(v_row)
    assert "data" not in json.dumps(named["params/decoder/layers/mlp/wi_0/kernel"]["partition_spec"])


def test_ambiguous_leaves_are_one_warning_line_of_the_dump(tmp_path, monkeypatch, capsys):
    """The linen example's 16 square attention kernels under an optimizer whose update the probe
    cannot trace: one line for all of them, and the dump still succeeds."""
    monkeypatch.chdir(REPO)
    assert cli.main(["--model", "examples.linen_lm:small_lm", "--topology", "cpu-8", "--rule", "examples/rules.yml",
                     "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "optimizer=tests.zoo.test_optimizers:row_sums",
                     "--output-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sharding-dump: warning: 16 optimizer leaves could keep"), lines


def fresh_moments() -> optax.GradientTransformation:
    """One vector per parameter made as fresh zeros (no sharding to inherit on an Explicit mesh)."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(lambda p: jnp.zeros(p.shape[:1], p.dtype), params), lambda g, s, p=None: (g, s))


@pytest.mark.parametrize("optimizer", ["examples.optimizers:adafactor", "tests.zoo.test_optimizers:fresh_moments"])
def test_explicit_mode_places_optimizer_leaves_as_auto_mode_does(tmp_path, monkeypatch, optimizer):
    monkeypatch.chdir(REPO)

    def named(mode: str) -> dict:
        # MaxText 0.2.5 takes qwen3 in explicit mode (0.2.4 only llama2 and deepseek)
        assert cli.main(["--model", "qwen3-0.6b", "--topology", "tpu7x-16", "--rule", "default", f"shard_mode={mode}",
                         f"optimizer={optimizer}", "maxtext_version=0.2.5", "--output-dir", str(tmp_path)]) == 0
        (path,) = tmp_path.rglob(f"*shard_mode={mode}*/named_shardings.json")
        return json.loads(path.read_text())["tensors"]

    explicit = named("explicit")
    assert explicit == named("auto")
    kept = "optimizer/opt_state/0/v_row/" if "adafactor" in optimizer else "optimizer/opt_state/"  # 0.2.5: NNX
    assert explicit[kept + "decoder/layers/mlp/wi_0/kernel"]["partition_spec"][0] is not None


def adafactor_train_program():
    """A TrainProgram whose own init builds Adafactor's state over boxed parameters, as flax's
    TrainState.create does: optax carries each kernel's box onto its factored moments."""
    from flax.training import train_state

    import sharding_dump as sd
    from examples.linen_lm import LinenLM

    model = LinenLM(vocab=512, embed=256, layers=1, heads=4, mlp=512)
    tx = optax.adafactor(1e-3)

    def init(key):
        params = model.init(key, jnp.ones((1, 8), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return sd.TrainProgram(init, train_step, batch={"inputs": sd.Input(), "targets": sd.Input()})


def test_a_train_program_own_optimizer_state_follows_its_parameters(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = ["--model", "tests.zoo.test_optimizers:adafactor_train_program", "--topology", "cpu-8", "--rule",
            "examples/rules.yml", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]
    assert cli.main([*args, "--output-dir", str(tmp_path)]) == 0
    (folder,) = [p.parent for p in tmp_path.rglob("named_shardings.json")]
    logical = json.loads((folder / "logical_shardings.json").read_text())["tensors"]
    named = json.loads((folder / "named_shardings.json").read_text())["tensors"]
    assert logical["opt_state/0/v_row/block_0/up/kernel"]["logical_axes"] == ["embed"]  # not the kernel's two names
    assert named["opt_state/0/v_col/block_0/up/kernel"]["partition_spec"] == ["tensor"]
    assert logical["opt_state/0/v/block_0/up/kernel"]["logical_axes"] == [None]


def test_a_train_program_takes_no_optimizer_setting(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert_bad_input(tmp_path, capsys, "--model tests.zoo.test_optimizers:adafactor_train_program --topology cpu-8 "
                     "--rule examples/rules.yml optimizer=examples.optimizers:adafactor",
                     "optimizer=examples.optimizers:adafactor: model 'tests.zoo.test_optimizers:adafactor_train_program' "
                     "is a TrainProgram, whose own train_step runs its optimizer (set it there)")
