"""Topologies and meshes: device counts, -1 filling, DCN x ICI, and every error path."""

import pytest

from sharding_dump.errors import BadInput
from sharding_dump.zoo.mesh import plan_mesh
from sharding_dump.zoo.rules import load_rule
from sharding_dump.zoo.settings import parse_overrides, resolve
from sharding_dump.zoo.topology import load_topology, topology_names


def plan(rule, topo, num_slices=1, **overrides):
    parsed = parse_overrides(overrides)
    return plan_mesh(load_rule(rule), load_topology(topo, num_slices), resolve(parsed),
                     frozenset(k for k, _ in parsed))


@pytest.mark.parametrize("name,devices,hbm_gib", [
    ("v5p-16", 8, 95), ("v4-8", 4, 32), ("v5e-256", 256, 16), ("v6e-16", 16, 32),
    ("tpu7x-16", 16, 96), ("tpu7x-16384", 16384, 96), ("a3", 8, 80), ("a3-ultra", 8, 141), ("a4", 8, 180),
])
def test_topology_table(name, devices, hbm_gib):
    t = load_topology(name)
    assert (t.devices_per_slice, t.hbm_bytes_per_device) == (devices, hbm_gib * 2**30)


def test_every_reference_accelerator_is_known():
    names = set(topology_names())
    assert {"v4-4096", "v5p-17920", "v5e-1", "v6e-256", "tpu7x-2", "a3"} <= names
    assert len([n for n in names if n.startswith(("v4-", "v5p-", "v5e-", "v6e-", "tpu7x-"))]) == 223


def test_cpu_topology_and_slices():
    t = load_topology("cpu-8", num_slices=3)
    assert (t.platform, t.num_devices, t.hbm_bytes_per_device) == ("cpu", 24, None)


@pytest.mark.parametrize("name", ["v5p-99", "cpu-0", "cpu-x", "../v5p-16", ""])
def test_unknown_topology(name):
    with pytest.raises(BadInput, match="topology"):
        load_topology(name)


def test_default_mesh_fills_fsdp():
    p = plan("default", "v5p-16")
    assert p.sizes["fsdp"] == 8 and p.num_devices == 8
    assert p.axis_names[:4] == ("diloco", "data", "stage", "fsdp")


def test_dcn_data_fills_slices():
    p = plan("default", "v5p-16", num_slices=2)
    assert (p.sizes["data"], p.sizes["fsdp"], p.num_devices) == (2, 8, 16)
    assert p.dcn[p.axis_names.index("data")] == 2


def test_pipeline_setting_sizes_stage_axis():
    p = plan("default", "v5p-8", ici_pipeline_parallelism=2)
    assert (p.sizes["stage"], p.sizes["fsdp"]) == (2, 2)


def test_16384_devices():
    p = plan("default", "tpu7x-16384", ici_fsdp_parallelism=-1)
    assert p.sizes["fsdp"] == 16384
    assert p.abstract_mesh().size == 16384


@pytest.mark.parametrize("overrides,message", [
    ({"ici_fsdp_parallelism": -1, "ici_tensor_parallelism": -1}, "at most one ici parallelism may be -1"),
    ({"ici_fsdp_parallelism": 3}, "product 3 must equal the 8 devices"),
    ({"ici_tensor_parallelism": 3}, "does not divide"),
    ({"ici_fsdp_parallelism": 0}, "-1 \\(fill\\) or a whole number"),
])
def test_bad_parallelism(overrides, message):
    with pytest.raises(BadInput, match=message):
        plan("default", "v5p-16", **overrides)


def test_axis_missing_from_rule():
    with pytest.raises(BadInput, match="rule 'pure-fsdp' has no 'tensor' mesh axis"):
        plan("pure-fsdp", "v5p-16", ici_tensor_parallelism=2)


def test_multislice_without_dcn_axis():
    with pytest.raises(BadInput, match="2 slices"):
        plan("pure-fsdp", "v5p-16", num_slices=2)
    assert plan("pure-fsdp", "v5p-16", num_slices=2, dcn_fsdp_parallelism=-1).sizes == {"fsdp": 16}


def own_rule(tmp_path, text="mesh_axes: [replica, model, seq]\nlogical_axis_rules:\n  - [embed, replica]\n"):
    path = tmp_path / "own.yml"
    path.write_text(text)
    return str(path)


def test_any_mesh_axis_names_are_sized_by_their_settings(tmp_path):
    """A repository's own axis names: ici_<axis>_parallelism / dcn_<axis>_parallelism, default 1."""
    rule = own_rule(tmp_path)
    p = plan(rule, "v5p-16", 2, ici_model_parallelism=2, ici_replica_parallelism=-1, dcn_seq_parallelism=-1)
    assert (p.axis_names, p.ici, p.dcn) == (("replica", "model", "seq"), (4, 2, 1), (1, 1, 2))
    with pytest.raises(BadInput, match="product 1 must equal the 8 devices per slice of v5p-16 "
                                       r"\(set one ici_\*_parallelism to -1 to fill\)"):
        plan(rule, "v5p-16")
    with pytest.raises(BadInput, match="ici_replica_parallelism=-1 and ici_seq_parallelism=-1: at most one"):
        plan(rule, "v5p-16", ici_replica_parallelism=-1, ici_seq_parallelism=-1)
    with pytest.raises(BadInput, match="ici_fsdp_parallelism=2: rule 'own' has no 'fsdp' mesh axis"):
        plan(rule, "v5p-16", ici_replica_parallelism=-1, ici_fsdp_parallelism=2)
    with pytest.raises(BadInput, match="ici_tensr_parallelism=2: rule 'own' has no 'tensr' mesh axis"):
        plan(rule, "v5p-16", ici_replica_parallelism=-1, ici_tensr_parallelism=2)


def test_maxtext_axis_names_keep_their_setting_names(tmp_path):
    p = plan("default", "v5p-16", ici_pipeline_parallelism=2)
    assert p.sizes["stage"] == 2 and p.sizes["fsdp"] == 4
    # the user's own `pipeline` axis is sized by the same key; beside `stage` it would be ambiguous
    assert plan(own_rule(tmp_path, "mesh_axes: [pipeline, x]\nlogical_axis_rules: [[embed, x]]\n"),
                "v5p-16", ici_pipeline_parallelism=2, ici_x_parallelism=-1).sizes == {"pipeline": 2, "x": 4}
    with pytest.raises(BadInput, match="'stage' and 'pipeline' are both sized by ici_pipeline_parallelism"):
        load_rule(own_rule(tmp_path, "mesh_axes: [stage, pipeline]\nlogical_axis_rules: [[embed, stage]]\n"))


def test_overrides_of_own_axes_are_canonical():
    assert parse_overrides({"ici_seq_parallelism": 2, "ici_model_parallelism": "4", "weight_dtype": "bfloat16"}) == (
        ("weight_dtype", "bfloat16"), ("ici_model_parallelism", 4), ("ici_seq_parallelism", 2))
    with pytest.raises(BadInput, match="ici_model_parallelism=0"):
        parse_overrides({"ici_model_parallelism": 0})
