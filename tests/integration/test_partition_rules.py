"""Weights placed by parameter-path regexes (`partition_rules`), constraints gated on the legacy
`with mesh:` environment, and what is said when a weight, a regex or a constraint is lost."""

from __future__ import annotations

import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import yaml
from flax import nnx
from jax.interpreters import pxla
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from helpers import REPO, assert_bad_input, run_cli
from sharding_dump.commands import check, cli
from sharding_dump.core.legacy_mesh import current_legacy_mesh, legacy_mesh
from sharding_dump.golden import diff
from sharding_dump.zoo.case import Case

LLAMA = ["--model", "examples.regex_llama:small_llama", "--topology", "cpu-8", "--rule", "examples/regex_llama.yml",
         "ici_mp_parallelism=2"]


def dump(tmp_path, args: list[str]) -> dict[str, dict]:
    assert cli.main([*args, "--output-dir", str(tmp_path)]) == 0
    (folder,) = {p.parent for p in tmp_path.rglob("named_shardings.json")}
    return {p.name: json.loads(p.read_text()) for p in folder.iterdir()}


def regex_spec(rule_file, param: str) -> list:
    """The spec of the first partition rule whose regex is found in the parameter's path, as a
    PartitionSpec gives it (padded with null), written here from the rule file alone."""
    for pattern, spec in yaml.safe_load(rule_file.read_text())["partition_rules"]:
        if re.search(pattern, param):
            return spec
    raise AssertionError(f"no rule for {param}")


def plain(docs: dict, pass_: str, module: str) -> list[dict]:
    """The plain (unnamed) constraints a module placed in one pass, whatever their source location."""
    return [e for e in docs["activation_shardings.json"]["tensors"].values()
            if e["pass"] == pass_ and e["module"] == module and e["name"].startswith("sharding_constraint")]


def assert_placed_by_regexes(docs: dict, rule_file) -> None:
    named = docs["named_shardings.json"]["tensors"]
    params = {p for p in named if p.startswith("params/")}
    for path, entry in named.items():
        owner = diff.slot_parameter(path, params) if path.startswith("opt_state/") else None
        if path in params:
            spec = regex_spec(rule_file, path[len("params/"):])
            assert entry["partition_spec"] == spec + [None] * (len(entry["shape"]) - len(spec)), path
        elif owner and entry["shape"] == named[owner[0]]["shape"]:
            assert entry["partition_spec"] == named[owner[0]]["partition_spec"], path
    assert len(params) > 10


def test_a_regex_placed_llama_gated_on_with_mesh(tmp_path, monkeypatch, capsys):
    """The EasyLM-style LLaMA: every weight (and its AdamW moments) on its regex's spec, every
    constraint of its gated helper recorded forward and backward, and nothing to warn about."""
    monkeypatch.chdir(REPO)
    docs = dump(tmp_path, LLAMA)
    assert capsys.readouterr().err == ""
    assert_placed_by_regexes(docs, REPO / "examples/regex_llama.yml")
    named = docs["named_shardings.json"]["tensors"]
    assert named["params/transformer/h_1/attention/wo/kernel"]["partition_spec"] == ["mp", "fsdp"]
    assert named["opt_state/0/nu/transformer/wte/embedding"]["partition_spec"] == ["mp", "fsdp"]
    assert docs["logical_shardings.json"]["tensors"]["params/lm_head/kernel"]["logical_axes"] == [None, None]
    (hidden,) = plain(docs, "forward", "transformer/h_0/feed_forward")
    assert hidden["partition_spec"] == [["dp", "fsdp"], None, "mp"] and hidden["per_device_shape"] == [24, 2048, 704]
    (grad,) = plain(docs, "backward", "transformer/h_0/feed_forward")
    assert grad["partition_spec"] == hidden["partition_spec"]
    (logits,) = plain(docs, "forward", "")
    assert logits["shape"] == [96, 2048, 8192]
    for layer in ("h_0", "h_1"):  # every module with a gated constraint, both passes
        for module in (f"transformer/{layer}", f"transformer/{layer}/attention", f"transformer/{layer}/feed_forward"):
            assert plain(docs, "forward", module) and plain(docs, "backward", module), module


def test_factored_moments_of_regex_placed_weights_follow_the_kept_dimensions(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    named = dump(tmp_path, [*LLAMA, "optimizer=examples.optimizers:adafactor"])["named_shardings.json"]["tensors"]
    for weight in ("feed_forward/w1/kernel", "attention/wq/kernel"):  # [fsdp, mp]; wq is square: the probe
        assert named[f"opt_state/0/v_row/transformer/h_0/{weight}"]["partition_spec"] == ["fsdp"], weight
        assert named[f"opt_state/0/v_col/transformer/h_0/{weight}"]["partition_spec"] == ["mp"], weight
    # w2 [mp, fsdp] is (1408, 512): v_row drops its largest dimension, the first
    assert named["opt_state/0/v_row/transformer/h_0/feed_forward/w2/kernel"]["partition_spec"] == ["fsdp"]


# --- an unseen model of the same kind: scanned layers, other names, NamedSharding on the legacy mesh -------

def constrain(x: jax.Array, *spec) -> jax.Array:
    """Another trainer's gate: only with a mesh, and by a NamedSharding over that very mesh."""
    mesh = pxla.thread_resources.env.physical_mesh
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PS(*spec)))


class GPTBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm(name="ln_1")(x)
        qkv = nn.Dense(3 * x.shape[-1], name="c_attn")(h)
        q, k, v = (constrain(t, ("replica", "fsdp"), None, "model") for t in jnp.split(qkv, 3, axis=-1))
        weights = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 8.0, axis=-1)
        x = x + nn.Dense(x.shape[-1], name="c_proj")(jnp.einsum("bqk,bkd->bqd", weights, v))
        hidden = constrain(nn.gelu(nn.Dense(4 * x.shape[-1], name="c_fc")(nn.LayerNorm(name="ln_2")(x))),
                           ("replica", "fsdp"), None, "model")
        return x + nn.Dense(x.shape[-1], name="mlp_proj")(hidden), None


class ScannedGPT(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(1024, 256, name="wte")
        x = embed(tokens)
        stack = nn.scan(GPTBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = stack(name="blocks")(x, None)
        return embed.attend(nn.LayerNorm(name="ln_f")(x))


def scanned_gpt() -> ScannedGPT:
    return ScannedGPT()


GPT_RULES = """\
mesh_axes: [replica, fsdp, model]
data_sharding: [[replica, fsdp]]
partition_rules:
  - [wte/embedding, [model, fsdp]]
  - ["blocks/(c_attn|c_fc)/kernel", [null, fsdp, model]]
  - ["blocks/(c_attn|c_fc)/bias", [null, model]]
  - ["blocks/(c_proj|mlp_proj)/kernel", [null, model, fsdp]]
  - ["(ln_[12f]|_proj)/(scale|bias)", []]
"""


def test_an_unseen_model_of_that_kind(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    rule = tmp_path / "gpt.yml"
    rule.write_text(GPT_RULES)
    docs = dump(tmp_path / "out", ["--model", "tests.integration.test_partition_rules:scanned_gpt", "--topology", "cpu-16",
                                   "--rule", str(rule), "ici_model_parallelism=2", "ici_replica_parallelism=2"])
    assert capsys.readouterr().err == ""
    assert_placed_by_regexes(docs, rule)
    named = docs["named_shardings.json"]["tensors"]
    assert named["params/blocks/c_fc/kernel"]["per_device_shape"] == [3, 64, 512]  # fsdp=4, model=2
    forward = plain(docs, "forward", "blocks")
    assert forward and all(e["partition_spec"] == [["replica", "fsdp"], None, "model"] for e in forward)
    assert plain(docs, "backward", "blocks")


def test_legacy_mesh_holds_the_mesh_only_inside_the_block():
    mesh = jax.sharding.AbstractMesh((2, 2), ("a", "b"))
    before = current_legacy_mesh()
    with legacy_mesh(mesh):
        assert pxla.thread_resources.env.physical_mesh is mesh
        with legacy_mesh(jax.sharding.AbstractMesh((4,), ("c",))):
            assert current_legacy_mesh().axis_names == ("c",)
        assert current_legacy_mesh() is mesh
    assert current_legacy_mesh() is before and before.empty


# --- what is said aloud -------------------------------------------------------------------------------

class Silent(nn.Module):
    """No logical axes, no constraint: nothing places anything."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(512, 64, name="embed")(tokens)
        x = nn.Dense(64, name="hidden")(x)
        return nn.Dense(512, name="head")(x)


def silent() -> Silent:
    return Silent()


class SilentPacked(nn.Module):
    @nn.compact
    def __call__(self, tokens, segment_ids):
        return Silent(name="lm")(tokens * (segment_ids > 0))


def silent_program():
    """A program whose extra batch field the harness places: that placement is no model constraint."""
    import sharding_dump as sd

    return sd.ModelProgram(SilentPacked(), inputs={"segment_ids": sd.Input()})


class Misnamed(nnx.Module):
    """A kernel with three logical names for two dimensions, one with one name for two, one with a
    logical axis no rule names (NNX: flax places nothing eagerly here, so the names reach the harness
    as written; linen refuses three names for two dimensions as soon as it initialises under a mesh)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.embed = nnx.Embed(512, 64, embedding_init=nnx.with_partitioning(nnx.initializers.normal(),
                                                                             ("vocab", "embed")), rngs=rngs)
        self.up = nnx.Linear(64, 64, use_bias=False, kernel_init=nnx.with_partitioning(init, ("embed", "mlp", "extra")),
                             rngs=rngs)
        self.down = nnx.Linear(64, 512, use_bias=False, kernel_init=nnx.with_partitioning(init, ("hidden",)), rngs=rngs)

    def __call__(self, tokens):
        x = self.down(self.up(self.embed(tokens)))
        return nn.with_logical_constraint(x, ("batch", None, "vocab"))


def misnamed() -> Misnamed:
    return Misnamed(nnx.Rngs(0))


SILENT_RULES = """\
mesh_axes: [data, model]
partition_rules:
  - [embed/embedding, [model, null]]
  - [no_such_layer/kernel, [model]]
"""


def test_unplaced_weights_unmatched_regexes_and_no_constraints_are_said(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    rule = tmp_path / "silent.yml"
    rule.write_text(SILENT_RULES)
    args = ["--model", "tests.integration.test_partition_rules:silent", "--topology", "cpu-8", "--rule", str(rule),
            "ici_model_parallelism=2", "ici_data_parallelism=-1"]
    dump(tmp_path / "out", args)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("sharding-dump: warning: ") for line in err), err
    assert "4 parameters carry no logical axes and match no partition rule" in err[0]
    assert "params/head/bias" in err[0]
    assert f"partition rule {rule}:4 ('no_such_layer/kernel') matches no parameter path of this model" in err[1]
    assert "the model placed no activation sharding constraint in its training step" in err[2]
    findings = {f.lint: f for f in check.lint_case(Case.make("tests.integration.test_partition_rules:silent", "cpu-8", str(rule),
                                                            overrides={"ici_model_parallelism": 2, "ici_data_parallelism": -1}))}
    assert findings["unplaced"].message.startswith("4 parameters carry no logical axes and match no partition rule")
    assert findings["unplaced"].details[0].startswith("params/head/kernel")
    assert findings["partition-rule"].details == (f"rule: {rule}:4",)


def test_a_program_whose_model_constrains_nothing_gets_the_notice_too(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    rule = tmp_path / "silent.yml"
    rule.write_text(SILENT_RULES.replace("embed/embedding", "lm/embed/embedding"))
    docs = dump(tmp_path / "out", ["--model", "tests.integration.test_partition_rules:silent_program", "--topology", "cpu-8",
                                   "--rule", str(rule), "ici_model_parallelism=2", "ici_data_parallelism=-1"])
    assert "forward/segment_ids" in docs["activation_shardings.json"]["tensors"]  # the harness's placement
    assert "the model placed no activation sharding constraint" in capsys.readouterr().err


def test_rank_mismatch_and_a_logical_axis_without_rule(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    rule = tmp_path / "named.yml"
    rule.write_text("mesh_axes: [data, model]\nlogical_axis_rules:\n  - [batch, data]\n  - [vocab, model]\n"
                    "  - [embed, data]\n  - [mlp, model]\n  - [activation_batch, data]\n")
    case = ["--model", "tests.integration.test_partition_rules:misnamed", "--topology", "cpu-8", "--rule", str(rule),
            "ici_model_parallelism=2", "ici_data_parallelism=-1"]
    dump(tmp_path / "out", case)
    err = capsys.readouterr().err
    assert "logical axes that do not fit the tensor's rank: params/down/kernel (1 names, rank 2), " \
           "params/up/kernel (3 names, rank 2)" in err
    findings = check.lint_case(Case.make("tests.integration.test_partition_rules:misnamed", "cpu-8", str(rule),
                                        overrides={"ici_model_parallelism": 2, "ici_data_parallelism": -1}))
    by = {(f.lint, f.subject): f for f in findings}
    assert by[("rank", "params/up/kernel")].message == "3 logical axes for a tensor of rank 2: the extra names are dropped"
    assert by[("rank", "params/down/kernel")].message.endswith("its last dimensions have no name and stay whole")
    assert by[("no-rule", "logical axis 'hidden'")].details == ("params/down/kernel  128.0 KiB",)
    # judged against this model only: MaxText's trainer defines activation_batch, this model does not
    unknown = by[("unknown-name", "logical axis 'activation_batch'")]
    assert "no weight or activation of model tests.integration.test_partition_rules:misnamed carries 'activation_batch'" in unknown.message
    assert ("unknown-name", "logical axis 'batch'") not in by  # an activation of the model carries it


def test_linen_example_check_is_judged_against_its_own_weights(monkeypatch):
    monkeypatch.chdir(REPO)
    case = Case.make("examples.linen_lm:small_lm", "cpu-8", "examples/rules.yml",
                     overrides={"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 2})
    (finding,) = check.lint_case(case)  # the shared rule file stacks `layers`: the NNX example's, not this one's
    assert finding.lint == "unknown-name" and finding.subject == "logical axis 'layers'"


@pytest.mark.parametrize("text,message", [
    ("mesh_axes: [fsdp]\npartition_rules:\n  - ['(', [fsdp]]\n", "field partition_rules/0: '(' is not a regular expression"),
    ("mesh_axes: [fsdp]\npartition_rules:\n  - [wte, [fsdp, tensor]]\n",
     "field partition_rules/0 ('wte'): mesh axis 'tensor' is not in mesh_axes [fsdp]"),
    ("mesh_axes: [fsdp]\npartition_rules:\n  - [wte, {logical: [embed], spec: x}]\n", "partition_rules/0/1"),
    ("mesh_axes: [fsdp]\npartition_rules:\n  - [wte, fsdp]\n", "partition_rules/0/1"),
    ("mesh_axes: [fsdp]\npartition_rules:\n  - [embed/embedding, [fsdp, null, null]]\n",
     "/bad.yml:3 ('embed/embedding'): 3 entries for parameter embed/embedding of rank 2 (512, 64); give at most 2"),
])
def test_bad_partition_rules_are_one_line_exit_2(tmp_path, capsys, monkeypatch, text, message):
    monkeypatch.chdir(REPO)
    rule = tmp_path / "bad.yml"
    rule.write_text(text)
    assert_bad_input(tmp_path, capsys, f"--model tests.integration.test_partition_rules:silent --topology cpu-8 --rule {rule}",
                     message)


@pytest.mark.compile
def test_verify_compiles_the_regex_placed_llama_with_its_gated_constraints(tmp_path, monkeypatch):
    """The compiled step's state shardings equal the regex-placed golden, and the gated constraints
    are in the compiled step too (its legacy mesh is the concrete one): without them XLA:CPU moves the
    activations with 21 all-to-alls instead of 2 (measured on this repository's pinned jax)."""
    monkeypatch.chdir(REPO)
    small = [*LLAMA, "per_device_batch_size=1", "max_target_length=128"]
    assert cli.main([*small, "--output-dir", str(tmp_path)]) == 0
    result = run_cli("verify", *small, "--golden-dir", str(tmp_path), "--format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    (case,) = json.loads(result.stdout)["cases"]
    assert case["sharding_mismatches"] == [] and case["involuntary_rematerializations"] == []
    assert case["collectives_per_step"]["all-to-all"]["count"] == 2


def test_partition_rules_through_the_core_api():
    import sharding_dump as sd
    from examples.regex_llama import LLaMAConfig, LLaMAForCausalLM

    model = LLaMAForCausalLM(LLaMAConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4))
    mesh = jax.sharding.AbstractMesh((1, 2, 2), ("dp", "fsdp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rules = sd.Rules(partition_rules=[("attention/(wq|wk|wv)/kernel", PS("fsdp", "mp")),
                                      sd.PathRule("feed_forward/w1/kernel", logical=("embed", "mlp")), (".*", PS())],
                     logical_axis_rules=[("embed", "fsdp"), ("mlp", "mp")])
    docs = sd.dump_model(model, mesh, rules, batch_shape=(4, 16))
    named = docs["named_shardings.json"]["tensors"]
    assert named["params/transformer/h_0/attention/wk/kernel"]["partition_spec"] == ["fsdp", "mp"]
    assert named["opt_state/0/mu/transformer/h_0/attention/wk/kernel"]["partition_spec"] == ["fsdp", "mp"]
    assert named["params/transformer/h_0/feed_forward/w1/kernel"]["partition_spec"] == ["fsdp", "mp"]
    assert docs["logical_shardings.json"]["tensors"]["opt_state/0/nu/transformer/h_0/feed_forward/w1/kernel"][
        "logical_axes"] == ["embed", "mlp"]
    assert named["params/lm_head/kernel"]["partition_spec"] == [None, None]
    assert plain(docs, "forward", "transformer/h_0/feed_forward")


def test_explicit_mode_places_regex_weights_and_their_factored_moments_as_auto_mode():
    """The state traced on an Explicit-axis mesh (core.state.explicit_train_state) carries, in its
    types, the layouts auto mode resolves: regex-placed weights, their moments, their factored moments."""
    import optax

    import sharding_dump as sd
    from examples.regex_llama import LLaMAConfig, LLaMAForCausalLM
    from sharding_dump.core.layout import typed_layouts
    from sharding_dump.core.state import explicit_train_state

    model = sd.as_model(LLaMAForCausalLM(LLaMAConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                                     num_hidden_layers=1, num_attention_heads=4)))
    rules = sd.Rules(partition_rules=yaml.safe_load((REPO / "examples/regex_llama.yml").read_text())["partition_rules"])
    sizes, names = (1, 2, 2), ("dp", "fsdp", "mp")
    layouts = {}
    for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
        mesh = jax.sharding.AbstractMesh(sizes, names, axis_types=(kind,) * 3)
        fresh = optax.GradientTransformation(  # moments made as fresh zeros: no sharding to inherit
            lambda params: jax.tree.map(lambda p: jnp.zeros(p.shape[:1], p.dtype), params), lambda g, s, p=None: (g, s))
        for opt, tx in (("adamw", optax.adamw(1e-4)), ("adafactor", optax.adafactor(1e-3)), ("fresh", fresh)):
            if kind == jax.sharding.AxisType.Auto:
                found = sd.tensor_layouts(sd.abstract_train_state(model.abstract_params(mesh, rules), tx), mesh, rules)
            else:
                found = typed_layouts(explicit_train_state(model, mesh, rules, tx), dict(zip(names, sizes)))
            layouts[kind, opt] = {t.path: tuple(t.partition_spec) + (None,) * (len(t.shape)
                                                         - len(t.partition_spec)) for t in found}
    for (kind, opt), specs in layouts.items():
        assert specs == layouts[jax.sharding.AxisType.Auto, opt], (kind, opt)
    assert len(layouts) == 6
    assert layouts[jax.sharding.AxisType.Explicit, "fresh"]["opt_state/transformer/h_0/feed_forward/w1/kernel"] == ("fsdp",)
    adafactor = layouts[jax.sharding.AxisType.Explicit, "adafactor"]
    assert adafactor["opt_state/0/v_col/transformer/h_0/feed_forward/w1/kernel"] == ("mp",)
    assert adafactor["params/transformer/h_0/attention/wo/kernel"] == ("mp", "fsdp")
