"""From a Case to its golden documents: topology -> rule -> mesh -> model -> state -> JSON.

>>> from sharding_dump.case import Case
>>> docs = dump_case(Case.make("qwen3-0.6b", "tpu7x-16", "pure-fsdp"))
>>> sorted(docs)
['activation_shardings.json', 'logical_shardings.json', 'named_shardings.json']
>>> docs["named_shardings.json"]["tensors"]["params/token_embedder/embedding"]["partition_spec"]
[None, 'fsdp']
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from sharding_dump import models, rules, serialize, settings, state, train_step
from sharding_dump.batch import BatchPlan, plan_batch
from sharding_dump.case import Case
from sharding_dump.errors import BadInput
from sharding_dump.models.pipeline import plan_pipeline
from sharding_dump.mesh import MeshPlan, plan_mesh
from sharding_dump.models.config import card_path
from sharding_dump.topology import Topology, load_topology

from sharding_dump.core import documents
from sharding_dump.core.documents import ACTIVATIONS_FILE, LOGICAL_FILE, NAMED_FILE  # noqa: F401


@dataclasses.dataclass(frozen=True)
class CaseSetup:
    """Everything resolved for one case (in explicit mode, after a check of the traced init)."""

    case: Case
    topology: Topology
    rule_set: rules.RuleSet  # the rule file with the model card's rules merged in
    values: dict[str, Any]  # effective settings
    plan: MeshPlan
    config: models.ModelConfig
    batch: BatchPlan

    @property
    def explicit(self) -> bool:
        """shard_mode=explicit: the state is traced on an Explicit-axis mesh."""
        return self.values["shard_mode"] == "explicit"


def setup_case(case: Case) -> CaseSetup:
    """Resolves topology, rules, settings, mesh and model config; BadInput on anything invalid."""
    topology = load_topology(case.topology, case.num_slices)
    rule_set = rules.load_rule(case.rule)
    mesh_defaults = rule_set.mesh_settings_for(topology.name)
    values = settings.resolve(case.overrides, mesh_defaults)
    explicit = frozenset(mesh_defaults) | frozenset(k for k, _ in case.overrides)
    plan = plan_mesh(rule_set, topology, values, explicit)
    config = models.load_config(case.model, weight_dtype=values["weight_dtype"])
    rule_set = rules.with_overrides(rule_set, config.logical_axis_rules, source=card_path(case.model))
    pipeline = plan_pipeline(values, plan, rule_set, config.pipelined_stack_layers)
    config = dataclasses.replace(config, pipeline=pipeline)
    if values["shard_optimizer_over_data"] and state.DATA_AXIS not in plan.axis_names:
        raise BadInput(f"shard_optimizer_over_data=true: rule '{rule_set.name}' has no 'data' mesh axis "
                       f"(mesh_axes: {', '.join(plan.axis_names)})")
    batch = plan_batch(rule_set, plan, values)
    if pipeline is not None:
        pipeline.check_batch(batch.global_batch_size)
    setup = CaseSetup(case, topology, rule_set, values, plan, config, batch)
    if setup.explicit:
        _check_even_splits(setup)
    return setup


def _check_even_splits(setup: CaseSetup) -> None:
    """Explicit mode rejects a dimension that does not split evenly over its mesh axes (auto mode
    pads it): say which one, before anything is traced on the Explicit mesh."""
    layouts = state.tensor_layouts(_abstract_state(setup.config), setup.plan, setup.rule_set,
                                   setup.values["shard_optimizer_over_data"])
    params_first = sorted(state.indivisible(layouts), key=lambda item: not item[0].path.startswith("params/"))
    for layout, dim in params_first[:1]:
        spec = serialize.spec_to_json(layout.partition_spec, len(layout.shape))[dim]
        raise BadInput(f"shard_mode=explicit: {layout.path} dimension {dim} (size {layout.shape[dim]}) does not "
                       f"split evenly over {spec} ({layout.shards(dim)} shards); explicit mode needs even "
                       f"splits (shard_mode=auto pads them)")


@functools.lru_cache(maxsize=16)
def _abstract_state(config: models.ModelConfig) -> dict[str, Any]:
    # Shapes only depend on the config; cases of one model share the traced init.
    return state.abstract_state(config)


def header(setup: CaseSetup) -> dict[str, Any]:
    """The part every golden file of the case starts with."""
    return {
        "case": setup.case.header(),
        "mesh": {"axis_names": list(setup.plan.axis_names), "axis_sizes": list(setup.plan.shape),
                 "shard_mode": setup.values["shard_mode"]},
    }


def case_layouts(case: Case) -> tuple[CaseSetup, list[state.TensorLayout]]:
    """The resolved case and the layout of every leaf of its training state (auto mode: from the
    rules; explicit mode: read from the state traced on an Explicit-axis mesh)."""
    setup = setup_case(case)
    over_data = setup.values["shard_optimizer_over_data"]
    if setup.explicit:
        return setup, state.explicit_tensor_layouts(setup.config, setup.plan, setup.rule_set, over_data)
    return setup, state.tensor_layouts(_abstract_state(setup.config), setup.plan, setup.rule_set, over_data)


def dump_case(case: Case) -> dict[str, dict[str, Any]]:
    """Every golden document of `case`, keyed by file name."""
    setup, layouts = case_layouts(case)
    constraints = train_step.trace_activations(setup.config, _abstract_state(setup.config), setup.plan,
                                               setup.rule_set, setup.batch, state.optimizer())
    return documents.golden_documents(layouts, setup.plan.abstract_mesh(), constraints, header=header(setup),
                                      activation_header={"batch": setup.batch.header()})


def render_case(case: Case) -> dict[str, bytes]:
    """The exact bytes of every golden file of `case`."""
    return serialize.render(dump_case(case))
