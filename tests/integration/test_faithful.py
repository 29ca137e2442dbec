"""Behaviours that follow MaxText's source (commit e591f30) rather than our earlier guesses: attention
activation names, the gpt-oss router axes, custom rule files replacing the rules, the torus check of
the ICI mesh and the warning on uneven splits. Pipeline layout and ZeRO-1 are pinned in
test_pipeline.py and test_shard_modes.py."""

import functools

import pytest

from helpers import assert_bad_input, committed_golden, mesh_plan
from sharding_dump.commands import cli
from sharding_dump.core.layout import leaves
from sharding_dump.errors import BadInput
from sharding_dump.zoo import cards, state
from sharding_dump.zoo import releases
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.dump import dump_case, setup_case
from sharding_dump.zoo.matrix import load_matrix
from sharding_dump.zoo.rules import load_rule
from sharding_dump.zoo.topology import load_topology, topology_names

ATTN_INPUT = ["activation_batch_attn", "activation_input_length_attn", "activation_embed_attn"]
ATTN_QKV = ["activation_kv_batch", "activation_length_attn", "activation_kv_heads", "activation_kv_head_dim"]
ATTN_OUT = ["activation_batch_attn", "activation_length_attn", "activation_heads", "activation_kv"]
MLA_INPUT = ["activation_batch_attn", "activation_length", "activation_embed"]
MLA_QKV = ["activation_kv_batch", "activation_length", "activation_kv_heads", "activation_kv_head_dim"]


@functools.cache
def activations_of(model: str, topology: str, rule: str, **overrides) -> dict:
    """The activation tensors of a case: a matrix case's committed golden (the golden tests prove it
    equals a fresh dump), any other case dumped."""
    case = Case.make(model, topology, rule, overrides=overrides)
    if case in load_matrix():
        return committed_golden(case, "activation_shardings.json")["tensors"]
    return dump_case(case)["activation_shardings.json"]["tensors"]


def entry(tensors: dict, key: str) -> dict:
    return tensors[f"forward/{key}"]


@pytest.mark.parametrize("model,attention,out", [
    ("qwen3-0.6b", "decoder/layers/self_attention", "attention_out"),
    ("gpt-oss-20b", "decoder/layers/layers_0/GptOssAttention", "out"),
])
def test_standard_attention_uses_the_attn_names(model, attention, out):
    """MaxText's attention layer constrains inputs, q/k/v and its output with the `_attn` names."""
    tensors = activations_of(model, "tpu7x-16", "default")
    for name in ("inputs_q", "inputs_kv"):
        assert entry(tensors, f"{attention}/{name}")["logical_axes"] == ATTN_INPUT
    for name in ("query", "key", "value"):
        assert entry(tensors, f"{attention}/{name}")["logical_axes"] == ATTN_QKV
    assert entry(tensors, f"{attention}/{out}")["logical_axes"] == ATTN_OUT


def test_latent_attention_keeps_the_older_names():
    tensors = activations_of("deepseek2-16b", "tpu7x-16", "default")
    assert entry(tensors, "decoder/moe_layers/self_attention/inputs_q")["logical_axes"] == MLA_INPUT
    assert entry(tensors, "decoder/moe_layers/self_attention/query")["logical_axes"] == MLA_QKV


def test_custom_rules_without_an_input_length_rule_leave_attention_inputs_whole():
    """cp-as-ep has no activation_input_length_attn rule: the attention inputs keep their whole sequence
    while q/k/v (activation_length_attn) and the layer input split it over context."""
    tensors = activations_of("qwen3-0.6b", "tpu7x-8", "cp-as-ep", ici_fsdp_parallelism=-1,
                             ici_context_parallelism=2, ici_expert_parallelism=2)
    attention = "decoder/layers/self_attention"
    assert entry(tensors, f"{attention}/inputs_q")["partition_spec"][1] is None
    assert entry(tensors, f"{attention}/query")["partition_spec"][1] == "context"
    assert entry(tensors, "decoder/layers/layer_input")["partition_spec"][1] == "context"


@functools.cache
def logical_axes(model: str) -> dict:
    return {path: axes for path, _, axes in leaves(state.abstract_state(cards.load_config(model)))}


def test_gpt_oss_router_kernel_is_on_embed_and_deepseeks_on_embed_moe():
    gpt = logical_axes("gpt-oss-20b")["params/decoder/layers/layers_0/GptOssMlp/gate/kernel"]
    assert gpt == ("embed", "layers", None)
    deepseek = logical_axes("deepseek2-16b")["params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel"]
    assert deepseek == ("embed_moe", "moe_layers", None)


def test_card_rules_apply_on_the_base_rules_only():
    """llama2-7b's card maps norm to fsdp: merged into the default rules, not into a custom rule file
    (MaxText's custom mesh-and-rule file replaces logical_axis_rules wholesale)."""
    default = setup_case(Case.make("llama2-7b", "v5p-16", "default")).rule_set
    assert dict(default.logical_axis_rules)["norm"] == "fsdp"
    custom = setup_case(Case.make("llama2-7b", "v5p-16", "pure-fsdp")).rule_set
    assert custom.logical_axis_rules == load_rule("pure-fsdp", releases.release_of({}).rules_dir).logical_axis_rules
    case = Case.make("llama2-7b", "v5p-16", "pure-fsdp")
    assert case in load_matrix()  # so its golden is checked against a fresh dump
    named = committed_golden(case, "named_shardings.json")["tensors"]
    assert named["model/decoder/decoder_norm/scale"]["partition_spec"] == [None]


def plan(topology: str, num_slices: int = 1, rule: str = "default", **overrides):
    return mesh_plan(rule, topology, num_slices, **overrides)


def test_every_tpu_slice_knows_its_torus():
    for name in topology_names():
        t = load_topology(name)
        if t.platform == "tpu":
            assert t.torus and len(t.torus) == 3 and t.device_kind, name
            assert t.devices_per_chip * t.torus[0] * t.torus[1] * t.torus[2] == t.devices_per_slice, name
    assert load_topology("tpu7x-64").torus == (2, 4, 4) and load_topology("tpu7x-64").devices_per_chip == 2
    assert load_topology("v6e-16").torus == (4, 4, 1)


@pytest.mark.parametrize("topology,overrides,culprit", [
    ("v6e-16", {"ici_data_parallelism": 2}, "fsdp=8"),  # 4x4: a 2-way axis leaves no 8
    ("tpu7x-64", {"ici_fsdp_parallelism": 8, "ici_context_parallelism": 2, "ici_expert_parallelism": 4},
     "context=2"),
    ("tpu7x-2048", {"ici_tensor_parallelism": 4}, "tensor=4"),  # 8x8x16 chips x 2 cores: no 4
])
def test_a_mesh_off_the_torus_is_refused(topology, overrides, culprit):
    with pytest.raises(BadInput, match=f"does not fit the {topology} torus .*: {culprit} is not a product"):
        plan(topology, **overrides)


@pytest.mark.parametrize("topology,num_slices,overrides", [
    ("v6e-16", 1, {"ici_data_parallelism": 4}),
    ("v6e-8", 1, {"ici_data_parallelism": 2}),  # JAX lays any shape on an 8-chip v5e/v6e tray
    ("tpu7x-16", 1, {"ici_data_parallelism": 2, "ici_tensor_parallelism": 2}),  # and on small tpu7x slices
    ("tpu7x-2048", 1, {"ici_tensor_parallelism": 8}),
    ("v6e-16", 2, {"ici_data_parallelism": 4, "dcn_data_parallelism": 2}),
    # MaxText's allow_split_physical_axes: 2 x 8 on the 4x4 torus by splitting a physical axis
    ("v6e-16", 1, {"ici_data_parallelism": 2, "allow_split_physical_axes": True}),
    ("a3", 1, {"ici_tensor_parallelism": 8}),
    ("cpu-12", 1, {"ici_data_parallelism": 3}),
])
def test_meshes_on_the_torus_and_off_tpu_are_accepted(topology, num_slices, overrides):
    assert plan(topology, num_slices, **overrides).num_devices == load_topology(topology, num_slices).num_devices


def test_torus_refusal_is_one_line(tmp_path, capsys):
    assert_bad_input(tmp_path, capsys, "--topology v6e-16 ici_data_parallelism=2",
                     "ici parallelism data=2 x fsdp=8: does not fit the v6e-16 torus (4x4x1 physical axes): fsdp=8")


def test_uneven_splits_warn_on_stderr_and_still_dump(tmp_path, capsys):
    out = tmp_path / "out"
    status = cli.main(["--model", "deepseek3-671b", "--topology", "tpu7x-2048", "--rule", "default",
                       "--output-dir", str(out)])
    captured = capsys.readouterr()
    assert status == 0 and list(out.rglob("named_shardings.json"))
    (line,) = captured.err.splitlines()
    assert line.startswith("sharding-dump: warning: deepseek3-671b/tpu7x-2048/slice_1/rule_default: 66 leaves do "
                           "not split evenly"), line
    assert "model/decoder/dense_layers/mlp/wi_0/kernel dimension 0 (embed) of size 7168 over fsdp=2048" in line
    status = cli.main(["--model", "llama2-7b", "--topology", "v5p-8", "--rule", "default", "--output-dir", str(out)])
    assert status == 0 and capsys.readouterr().err == ""


def test_check_reports_the_uneven_embed():
    from sharding_dump.commands import check

    findings = [f for f in check.lint_case(Case.make("deepseek3-671b", "tpu7x-2048", "default"))
                if f.lint == "divisibility"]
    assert len(findings) == 22  # 22 parameters, their AdamW moments folded under them
    subjects = {f.subject for f in findings}
    assert "model/decoder/dense_layers/mlp/wi_0/kernel (and optimizer/opt_state/0/mu, optimizer/opt_state/0/nu)" in subjects
    assert any("dim 0 (embed) of size 7168 is split over fsdp=2048" in f.message for f in findings)


def test_pipelining_puts_stage_before_data_in_the_mesh_and_the_input_batch():
    """MaxText (configs/types.py) swaps `stage` in front of `data` and leads data_sharding with it."""
    from sharding_dump.zoo.case import Case
    from sharding_dump.zoo.dump import setup_case

    setup = setup_case(Case.make("llama2-7b", "v5p-8", "default", overrides={
        "ici_pipeline_parallelism": 2, "num_pipeline_microbatches": 8, "ici_data_parallelism": 2}))
    names = setup.plan.axis_names
    assert names.index("stage") < names.index("data") and setup.plan.sizes["stage"] == 2
    assert setup.batch.header()["data_pipeline_spec"][0][:2] == ["stage", "data"]
    plain = setup_case(Case.make("llama2-7b", "v5p-8", "default", overrides={"ici_data_parallelism": 2}))
    assert plain.plan.axis_names.index("data") < plain.plan.axis_names.index("stage")
