"""Rule files, the schemas, settings and the flax resolver."""

import json

import pytest

from helpers import REPO
from sharding_dump.core.layout import resolve
from sharding_dump.errors import BadInput
from sharding_dump.resources import SCHEMAS_DIR, schema_validator
from sharding_dump.zoo import rules
from sharding_dump.zoo.settings import format_value, parse_overrides

REPO_GOLDEN = REPO / "golden"

SHIPPED = ["cp-as-ep", "default", "ep-as-cp", "ep-as-dp", "inference", "pipeline-large-moe", "pure-fsdp",
           "shard-exp-on-fsdp"]


def test_shipped_rules():
    assert rules.rule_names() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_rule_loads_and_names_only_its_axes(name):
    r = rules.load_rule(name)
    for _, axes in r.logical_axis_rules:
        for axis in [axes] if isinstance(axes, str) else axes or ():
            assert axis in r.mesh_axes


@pytest.mark.parametrize("schema", sorted(p.name.split(".")[0] for p in SCHEMAS_DIR.glob("*.schema.json")))
def test_schemas_are_valid(schema):
    """Each shipped schema passes its metaschema (the package does not check its own files at run time)."""
    import jsonschema_rs

    schema_validator(schema)  # builds, its $refs resolved
    jsonschema_rs.meta.validate(json.loads((SCHEMAS_DIR / f"{schema}.schema.json").read_text()))


def test_flax_resolver_fallbacks():
    # default has two `embed` rules: the first wants fsdp_transpose, taken by `mlp` first -> fallback.
    r = rules.load_rule("default")
    spec = resolve(("embed", "mlp"), r)
    assert spec[0] == ("fsdp", "context", "context_usp_ulysses", "expert")
    assert spec[1] == ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")


def test_model_card_rules_override_by_name():
    r = rules.with_overrides(rules.load_rule("default"), [("norm", "fsdp")])
    assert [a for n, a in r.logical_axis_rules if n == "norm"] == ["fsdp"]
    assert r.logical_axis_rules[-1] == ("norm", "fsdp")


def write(tmp_path, text, name="mine.yml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,message", [
    ("mesh_axes: [fsdp\n", "not valid YAML"),
    ("[1, 2]\n", "field \\(top level\\): must be an object"),
    ("mesh_axes: [fsdp]\nlogical_axis_rules: [[embed, tensor]]\n", "mesh axis 'tensor' is not in mesh_axes"),
    ("mesh_axes: [fsdp]\nlogical_axis_rules: [[embed, 3]]\n", "logical_axis_rules/0/1"),
    ("mesh_axes: [stage, pipeline]\nlogical_axis_rules: [[embed, stage]]\n",
     "'stage' and 'pipeline' are both sized by ici_pipeline_parallelism"),
    ("mesh_axes: [fsdp]\nextra: 1\nlogical_axis_rules: [[embed, fsdp]]\n", "Additional properties"),
    ("mesh_axes: [fsdp]\nlogical_axis_rules: [[embed, fsdp]]\nmesh_rules: [{match: '(', settings: {}}]\n",
     "not a regular expression"),
    ("mesh_axes: [fsdp]\nlogical_axis_rules: [[embed, fsdp]]\nmesh_rules: [{match: v5, settings: {x: 1}}]\n",
     "unknown setting 'x'"),
    ("!!python/object/apply:os.system ['true']\n", "not valid YAML"),
])
def test_bad_rule_files(tmp_path, text, message):
    with pytest.raises(BadInput, match=message):
        rules.load_rule(write(tmp_path, text))


def test_user_rule_file_and_mesh_rules(tmp_path):
    path = write(tmp_path, "mesh_axes: [data, fsdp]\nlogical_axis_rules: [[embed, fsdp]]\n"
                           "mesh_rules:\n  - {match: '^v5p-', settings: {ici_data_parallelism: 2}}\n")
    r = rules.load_rule(path)
    assert r.name == "mine" and r.mesh_settings_for("v5p-16") == {"ici_data_parallelism": 2}
    assert r.mesh_settings_for("tpu7x-16") == {}


@pytest.mark.parametrize("ref,message", [
    ("nope", "unknown rule"), ("../x", "must end in .yml"), ("/etc/passwd", "must end in .yml"),
    ("/tmp/no-such-rule.yml", "No such file or directory"), ("a b/c d.yml", "a rule name is letters"),
])
def test_bad_rule_refs(ref, message):
    with pytest.raises(BadInput, match=message):
        rules.load_rule(ref)


def test_settings_canonical():
    assert parse_overrides({"ici_expert_parallelism": "2", "ici_fsdp_parallelism": "-1"}) \
        == (("ici_fsdp_parallelism", -1), ("ici_expert_parallelism", 2))
    assert format_value(True) == "true" and format_value(0.5) == "0.5"
    with pytest.raises(BadInput, match="unknown setting"):
        parse_overrides({"nope": 1})
    with pytest.raises(BadInput, match="must be one of float32, bfloat16"):
        parse_overrides({"weight_dtype": "int4"})


def test_golden_schema_rejects_bad_document():
    from sharding_dump.golden.codec import check_document
    with pytest.raises(BadInput, match="field tensors/params/x: 'per_device_shape' is a required property"):
        check_document({"format_version": 1, "kind": "named",
                        "case": {"model": "m", "topology": "t", "num_slices": 1, "rule": "r", "overrides": {}},
                        "mesh": {"axis_names": ["fsdp"], "axis_sizes": [8], "shard_mode": "auto"},
                        "tensors": {"params/x": {"shape": [8], "dtype": "float32", "partition_spec": ["fsdp"]}}},
                       "doc")
    assert json.dumps(None) == "null"


def test_named_format_2_requires_per_device_bytes_and_format_1_still_reads():
    import copy

    from sharding_dump.golden.codec import check_document, read_document
    doc = read_document(REPO_GOLDEN / "llama2-7b/v5p-16/slice_1/rule_pure-fsdp/named_shardings.json")
    assert doc["format_version"] == 2 and doc["per_device_bytes"]["model"] == 3370141628  # parameters and RNG state (unsafe_rbg keys)
    assert doc["tensors"]["model/decoder/layers/mlp/wi_0/kernel"]["per_device_bytes"] == 512 * 32 * 11008 * 4
    for drop in (("per_device_bytes",), ("tensors", "optimizer/step", "per_device_bytes")):
        broken = copy.deepcopy(doc)
        *parents, last = drop
        target = broken
        for key in parents:
            target = target[key]
        del target[last]
        with pytest.raises(BadInput, match="'per_device_bytes' is a required property"):
            check_document(broken, "doc")
        check_document({**broken, "format_version": 1}, "doc")  # written before bytes were recorded
