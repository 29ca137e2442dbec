"""The reference comparison: a MaxText-format input_shardings.json against our activation golden.

The reference entries below are written by hand, the way MaxText prints them (its own scope names,
Python tuple / P(...) strings, size-1 mesh axes dropped), from the default rule file on a 2048-device
slice with fsdp=256 and tensor=8: they are an independent expectation of what the dump must hold.
"""

import json
import shutil
import subprocess
import sys

import pytest

from helpers import NNX, REPO, linen_golden
from sharding_dump.errors import BadInput
from sharding_dump.golden import codec
from sharding_dump.zoo import reference

CASE = "llama2-7b/tpu7x-2048/slice_1/rule_default_ici_fsdp_parallelism=-1_ici_tensor_parallelism=8"
BLE = "('activation_batch', 'activation_norm_length', 'activation_embed')"
KV = "('activation_kv_batch', 'activation_length_attn', 'activation_kv_heads', 'activation_kv_head_dim')"
REFERENCE = {"Activation Sharding Dump": [
    {"llama2/inputs: bfloat16[24576,2048,4096]": {"logic_axes": BLE, "PartitionSpec": "P('fsdp', None, 'tensor')"}},
    {"attention/query: bfloat16[24576,2048,32,128]": {"logic_axes": KV, "PartitionSpec": "P('fsdp', None, 'tensor', None)"}},
    {"attention_op/arr: int32[2048]": {"logic_axes": "Unknown", "PartitionSpec": "P(None,)"}},
    {"linears/x: bfloat16[24576,2048,11008]": {
        "logic_axes": "('activation_batch', 'activation_length', 'activation_mlp')", "PartitionSpec": "P('fsdp', None, 'tensor')"}},
    {"decoder/logits: bfloat16[24576,2048,32000]": {
        "logic_axes": "('activation_embed_and_logits_batch', 'activation_length', 'activation_vocab')",
        "PartitionSpec": "P('fsdp', None, 'tensor')"}},
]}


@pytest.fixture
def ours():
    return codec.read_document(REPO / "golden" / CASE / "activation_shardings.json")


def test_hand_written_reference_matches_the_dense_golden(ours):
    result = reference.compare(reference.parse_reference(REFERENCE, "ref"), ours)
    assert (result.ok, result.checked, result.unknown) == (True, 4, 1), result.mismatches


def test_mismatches_are_named(ours):
    entries = json.loads(json.dumps(REFERENCE))["Activation Sharding Dump"]
    entries[0]["llama2/inputs: bfloat16[24576,2048,4096]"]["PartitionSpec"] = "P('fsdp', None, None)"
    entries.append({"moe/inputs: bfloat16[24576,2048,7168]": {"logic_axes": BLE, "PartitionSpec": "P('fsdp', None, None)"}})
    result = reference.compare(reference.parse_reference(entries, "ref"), ours)
    assert result.mismatches == [
        "llama2/inputs: bfloat16[24576, 2048, 4096] logical ['activation_batch', 'activation_norm_length', "
        "'activation_embed']: partition spec reference [\"fsdp\", null, null], ours [\"fsdp\", null, \"tensor\"] "
        "(forward/decoder/layers/attention_residual and 15 more; size-1 mesh axes dropped)",
        "moe/inputs: bfloat16[24576, 2048, 7168] logical ['activation_batch', 'activation_norm_length', "
        "'activation_embed']: no activation with this shape, dtype and logical axes",
    ]


@pytest.mark.parametrize("data,message", [
    ({"x": 1}, "expected a list"),
    ([{"a: bfloat16[2]": {"logic_axes": "Unknown"}}], "item 0"),
    ([{"a: bfloat16[2]": {"logic_axes": "('x',", "PartitionSpec": "P(None,)"}}], "is not a Python literal"),
    ([{"a: bfloat16[2]": {"logic_axes": "Unknown", "PartitionSpec": "None"}}], "is not P"),
])
def test_bad_reference(data, message):
    with pytest.raises(BadInput, match=message):
        reference.parse_reference(data, "ref")


def test_tool_compares_trees_and_exits_by_result(tmp_path):
    ref_root, golden_root = tmp_path / "ref", tmp_path / "golden"
    (ref_root / CASE).mkdir(parents=True)
    (ref_root / CASE / "input_shardings.json").write_text(json.dumps(REFERENCE))
    (golden_root / CASE).mkdir(parents=True)
    shutil.copy(REPO / "golden" / CASE / "activation_shardings.json", golden_root / CASE)
    tool = [sys.executable, str(REPO / "tools/compare_reference.py")]
    ok = subprocess.run(tool + ["--reference-root", str(ref_root), "--golden-root", str(golden_root)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{CASE}: 4/4 reference activations match (1 with unknown logical axes skipped)" in ok.stdout
    (ref_root / "other/case").mkdir(parents=True)
    (ref_root / "other/case/input_shardings.json").write_text(json.dumps(REFERENCE))
    missing = subprocess.run(tool + ["--reference-root", str(ref_root), "--golden-root", str(golden_root)],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "other/case: no activation_shardings.json" in missing.stdout
    bad = subprocess.run(tool + [str(tmp_path / "nope.json"), str(golden_root / CASE / "activation_shardings.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("compare_reference: error: ") and "no such file" in bad.stderr


@pytest.fixture(scope="module")
def ours_nnx():
    """The activation records of CASE in MaxText's NNX build (segment ids in every attention)."""
    from sharding_dump.zoo.case import Case
    from sharding_dump.zoo.dump import render_case

    model, topology = CASE.split("/")[:2]
    case = Case.make(model, topology, "default", overrides={"ici_fsdp_parallelism": -1, "ici_tensor_parallelism": 8, **NNX})
    assert case.label.replace("_maxtext_version=0.2.4", "") == CASE
    return json.loads(render_case(case)["activation_shardings.json"])


def test_by_name_a_record_is_matched_only_by_ours_of_its_call_sites_names(ours_nnx):
    """With the call-site table, `attentions/query` must be ours named `query`: another name (one the table
    is mutated to) does not do; a call site the table lacks is a mismatch, MaxText's
    `Unknown` is matched on layout alone, and a named record of unknown axes (`decoder_segment_ids`) on its
    shape, dtype and spec."""
    kv = "('activation_kv_batch', 'activation_length_attn', 'activation_kv_heads', 'activation_kv_head_dim')"
    entries = [
        {"attentions/query: bfloat16[24576,2048,32,128]": {"logic_axes": kv, "PartitionSpec": "P('fsdp', None, 'tensor', None)"}},
        {"attentions/key: bfloat16[24576,2048,32,128]": {"logic_axes": kv, "PartitionSpec": "P('fsdp', None, 'tensor', None)"}},
        {"Unknown: bfloat16[24576,2048,32,128]": {"logic_axes": kv, "PartitionSpec": "P('fsdp', None, 'tensor', None)"}},
        {"attentions/no_such_variable: bfloat16[24576,2048,32,128]": {"logic_axes": kv,
                                                                      "PartitionSpec": "P('fsdp', None, 'tensor', None)"}},
        {"attention_op/decoder_segment_ids: int32[24576,2048]": {"logic_axes": "Unknown", "PartitionSpec": "P('fsdp', None)"}},
        {"attention_op/arr: int32[2048]": {"logic_axes": "Unknown", "PartitionSpec": "P(UNCONSTRAINED,)"}},
        {"pipeline/inputs: key<urbg>[16,2]": {"logic_axes": "Unknown", "PartitionSpec": "P(UNCONSTRAINED, 'stage')"}},
    ]
    sites = reference.call_sites()
    result = reference.compare(reference.parse_reference(entries, "ref"), ours_nnx, sites)
    assert (result.checked, result.unknown) == (5, 2)
    assert result.mismatches == [
        "attentions/no_such_variable: bfloat16[24576, 2048, 32, 128] logical ['activation_kv_batch', "
        "'activation_length_attn', 'activation_kv_heads', 'activation_kv_head_dim']: MaxText call site "
        "'attentions/no_such_variable' has no zoo names in maxtext_call_sites.yml"]
    renamed = {**sites, "attentions/query": ("attention_out",)}  # the table names another constraint
    result = reference.compare(reference.parse_reference(entries[:1], "ref"), ours_nnx, renamed)
    assert result.mismatches == [
        "attentions/query: bfloat16[24576, 2048, 32, 128] logical ['activation_kv_batch', 'activation_length_attn', "
        "'activation_kv_heads', 'activation_kv_head_dim']: no activation named attention_out with this shape, dtype "
        "and logical axes"]
    assert reference.compare(reference.parse_reference(entries[:1], "ref"), ours_nnx).ok  # on layout alone it passes


def test_the_call_site_table_is_checked_against_its_schema(tmp_path, monkeypatch):
    bad = tmp_path / "sites.yml"
    bad.write_text("call_sites:\n  attentions/query: []\n")
    monkeypatch.setattr(reference, "CALL_SITES_FILE", bad)
    reference.call_sites.cache_clear()
    try:
        with pytest.raises(BadInput, match="MaxText call sites file .*sites.yml: .*attentions/query"):
            reference.call_sites()
    finally:
        reference.call_sites.cache_clear()


def test_maxtexts_published_dumps_match_our_goldens_by_name():
    """`compare_reference.py --by-name` over MaxText's published deepseek2-16b dumps: every record with known
    logical axes is found under the names of its call site, in every case."""
    references = REPO / "tests/data/maxtext/goldens"  # MaxText's Linen build: ours of it, helpers.linen_golden
    ours = [linen_golden(p.parent.relative_to(references).as_posix()) for p in references.rglob("input_shardings.json")]
    tool = [sys.executable, str(REPO / "tools/compare_reference.py"), "--by-name", "--reference-root",
            str(references), "--golden-root", str(ours[0].parents[3])]
    result = subprocess.run(tool, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("21/21 reference activations match") == 8 and result.stdout.endswith("8/8 cases match\n")
