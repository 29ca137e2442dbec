"""The token batch: global size from per_device_batch_size, sequence length, and both input layouts."""

import pytest
from jax.sharding import PartitionSpec as P

from sharding_dump.errors import BadInput
from sharding_dump.zoo import rules
from sharding_dump.zoo.batch import plan_batch
from sharding_dump.zoo.mesh import plan_mesh
from sharding_dump.zoo.settings import parse_overrides, resolve
from sharding_dump.zoo.topology import load_topology


def plan(rule, topology, **overrides):
    r = rules.load_rule(rule)
    values = resolve(parse_overrides(overrides))
    return plan_batch(r, plan_mesh(r, load_topology(topology), values), values)


def test_batch_defaults_and_fractional_batch_under_context_parallelism():
    batch = plan("default", "v5p-16")
    assert (batch.per_device_batch_size, batch.shape) == (12, (96, 2048))
    assert batch.logical_axes == ("activation_embed_and_logits_batch", "activation_norm_length")
    cp = plan("ep-as-cp", "tpu7x-16", ici_expert_parallelism=2, per_device_batch_size=0.5, max_target_length=4096)
    assert cp.shape == (8, 4096) and cp.pipeline_spec == P(("data", "stage", "fsdp"), "expert")


@pytest.mark.parametrize("rule,overrides,message", [
    ("default", {"per_device_batch_size": 0.3}, r"per_device_batch_size=0.3 x 8 devices = 2.4: the global batch must be a whole number"),
    ("default", {"per_device_batch_size": 0}, r"= 0: the global batch must be a whole number >= 1"),
    ("default", {"per_device_batch_size": 0.5}, r"global batch 4 \(per_device_batch_size x devices\) does not split evenly over the data pipeline's layout .*: fsdp=8 makes 8 shards"),
    ("ep-as-cp", {"ici_expert_parallelism": 2, "max_target_length": 1001},
     r"max_target_length=1001 does not split evenly over .*: expert=2 makes 2 shards; it must be a multiple of 2"),
])
def test_bad_batch(rule, overrides, message):
    with pytest.raises(BadInput, match=message):
        plan(rule, "v5p-16", **overrides)


def test_rule_with_wrong_number_of_input_axes(tmp_path):
    path = tmp_path / "mine.yml"
    path.write_text("mesh_axes: [fsdp]\ninput_data_sharding_logical_axes: [activation_batch]\n"
                    "logical_axis_rules: [[activation_batch, fsdp]]\n")
    r = rules.load_rule(str(path))
    values = resolve(())
    with pytest.raises(BadInput, match="field input_data_sharding_logical_axes: names 1 logical axes; it must name 2"):
        plan_batch(r, plan_mesh(r, load_topology("v5p-16"), values), values)
