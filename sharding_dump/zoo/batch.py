"""The training batch of a case: its size, its sequence length and how it is laid over the mesh.

The global batch is `per_device_batch_size` x devices and must be a whole number; a fractional
per-device size is fine when context parallelism splits the sequence and leaves devices to spare.
The data pipeline hands each step batches split over the rule file's `data_sharding` axes, except
the `context_sharding` axis, which splits the sequence instead (under ep-as-cp that is `expert`).
Inside the step the batch is constrained to the rule's `input_data_sharding_logical_axes`; a rule
file without them leaves the batch on the data pipeline's layout (constrained to it, so the traced
step holds what the golden's `data_pipeline_spec` says). Both layouts must split the batch evenly: a
real input pipeline cannot build the global array otherwise.

>>> from sharding_dump.zoo.rules import load_rule
>>> from sharding_dump.zoo.mesh import plan_mesh
>>> from sharding_dump.zoo.settings import parse_overrides, resolve
>>> from sharding_dump.zoo.topology import load_topology
>>> rule = load_rule("ep-as-cp")
>>> overrides = parse_overrides({"ici_expert_parallelism": 2, "per_device_batch_size": 0.5})
>>> values = resolve(overrides)
>>> batch = plan_batch(rule, plan_mesh(rule, load_topology("tpu7x-8"), values), values)
>>> batch.shape, batch.header()["data_pipeline_spec"]
((4, 2048), [['data', 'stage', 'fsdp'], 'expert'])
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Mapping

from jax.sharding import PartitionSpec

from sharding_dump.core import layout, specs
from sharding_dump.core.specs import entry_axes
from sharding_dump.errors import BadInput
from sharding_dump.zoo import rules
from sharding_dump.zoo.mesh import MeshPlan


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Size and layouts of the token batch (global_batch_size, max_target_length)."""

    per_device_batch_size: int | float
    global_batch_size: int
    max_target_length: int
    logical_axes: tuple[str, str] | None  # the rule's input_data_sharding_logical_axes (None: it has none)
    pipeline_spec: PartitionSpec  # as the data pipeline delivers it

    @property
    def shape(self) -> tuple[int, int]:
        return (self.global_batch_size, self.max_target_length)

    def header(self) -> dict[str, Any]:
        """The batch as recorded at the top of activation_shardings.json."""
        return {
            "per_device_batch_size": self.per_device_batch_size,
            "global_batch_size": self.global_batch_size,
            "max_target_length": self.max_target_length,
            "data_pipeline_spec": specs.spec_to_json(self.pipeline_spec, 2),
        }


def _check_even(what: str, spec: PartitionSpec, shape: tuple[int, int], sizes: Mapping[str, int]) -> None:
    labels = ("global batch {} (per_device_batch_size x devices)", "max_target_length={}")
    for dim, (label, length) in enumerate(zip(labels, shape)):
        axes = entry_axes(spec[dim] if dim < len(spec) else None)
        ways = math.prod(sizes[a] for a in axes)
        if length % ways:
            split = " x ".join(f"{a}={sizes[a]}" for a in axes if sizes[a] != 1)
            raise BadInput(f"{label.format(length)} does not split evenly over {what}: {split} makes {ways} "
                           f"shards; it must be a multiple of {ways}")


def plan_batch(rule_set: rules.RuleSet, plan: MeshPlan, values: Mapping[str, Any]) -> BatchPlan:
    """The batch of a case from its effective settings; BadInput when it cannot be laid out."""
    per_device = values["per_device_batch_size"]
    total = Fraction(repr(per_device)) * plan.num_devices
    if total.denominator != 1 or total < 1:
        raise BadInput(f"per_device_batch_size={per_device} x {plan.num_devices} devices = {float(total):g}: "
                       "the global batch must be a whole number >= 1")
    logical = rule_set.input_data_sharding_logical_axes
    if logical and len(logical) != 2:
        raise BadInput(f"rule file {rule_set.path}: field input_data_sharding_logical_axes: names {len(logical)} "
                       "logical axes; it must name 2 (batch, sequence)")
    context = rule_set.context_sharding
    batch_axes = tuple(a for a in rule_set.data_sharding if a != context)
    pipeline = PartitionSpec(batch_axes or None, context)
    shape = (int(total), int(values["max_target_length"]))
    sizes = plan.sizes
    _check_even("the data pipeline's layout (data_sharding, context_sharding)", pipeline, shape, sizes)
    if not logical:
        return BatchPlan(per_device, shape[0], shape[1], None, pipeline)
    _check_even(f"the input layout ({', '.join(logical)})",
                layout.resolve(logical, rule_set), shape, sizes)
    return BatchPlan(per_device, shape[0], shape[1], (logical[0], logical[1]), pipeline)
