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
import warnings
from typing import Any

from sharding_dump import models, rules, serialize, settings, state, train_step
from sharding_dump.batch import BatchPlan, plan_batch
from sharding_dump.case import Case
from sharding_dump.errors import BadInput, UnevenSplitWarning
from sharding_dump.models.pipeline import pipeline_rules, plan_pipeline
from sharding_dump.mesh import MeshPlan, plan_mesh
from sharding_dump.models.config import card_path
from sharding_dump.topology import Topology, load_topology

NAMED_FILE = "named_shardings.json"
LOGICAL_FILE = "logical_shardings.json"
ACTIVATIONS_FILE = "activation_shardings.json"


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
    if pipeline is not None:
        rule_set = pipeline_rules(rule_set)
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


def warn_uneven(setup: CaseSetup, layouts: list[state.TensorLayout]) -> None:
    """Warns (UnevenSplitWarning) when any leaf of the case splits unevenly, naming one (a parameter
    when there is one); `sharding-dump check` lists them all."""
    uneven = sorted(state.indivisible(layouts), key=lambda item: not item[0].path.startswith("params/"))
    if not uneven:
        return
    layout, dim = uneven[0]
    count = len({t.path for t, _ in uneven})
    over = " x ".join(f"{a}={setup.plan.sizes[a]}" for a in layout.axes(dim) if setup.plan.sizes[a] > 1)
    warnings.warn(UnevenSplitWarning(
        f"{setup.case.label}: {count} lea{'f does' if count == 1 else 'ves do'} not split evenly over their mesh "
        f"axes (the last shard is padded), e.g. {layout.path} dimension {dim} ({layout.logical_axes[dim]}) of "
        f"size {layout.shape[dim]} over {over} = {layout.shards(dim)} shards; `sharding-dump check` lists them"),
        stacklevel=2)


def dump_case(case: Case) -> dict[str, dict[str, Any]]:
    """Every golden document of `case`, keyed by file name (UnevenSplitWarning when a leaf splits unevenly)."""
    setup, layouts = case_layouts(case)
    warn_uneven(setup, layouts)
    named = {
        t.path: {
            "shape": list(t.shape),
            "dtype": t.dtype,
            "partition_spec": serialize.spec_to_json(t.partition_spec, len(t.shape)),
            "per_device_shape": list(t.per_device_shape),
            "per_device_bytes": t.per_device_bytes,
        }
        for t in layouts
    }
    logical = {t.path: {"shape": list(t.shape), "logical_axes": list(t.logical_axes)} for t in layouts}
    head = header(setup)
    # Per-device totals sit in the named header so a rule edit's memory change shows in the golden diff.
    named_head = {**head, "per_device_bytes": state.per_device_totals(layouts)}
    return {
        NAMED_FILE: serialize.document("named", named_head, named),
        LOGICAL_FILE: serialize.document("logical", head, logical),
        ACTIVATIONS_FILE: serialize.document("activations", {**head, "batch": setup.batch.header()},
                                             activation_entries(setup)),
    }


def activation_entries(setup: CaseSetup) -> dict[str, dict[str, Any]]:
    """One entry per activation constraint of the traced training step, keyed `<pass>/<module>/<name>`."""
    constraints = train_step.trace_activations(setup.config, _abstract_state(setup.config), setup.plan,
                                               setup.rule_set, setup.batch, state.optimizer())
    entries = {}
    for c in constraints:
        layout = state.TensorLayout(c.key, c.shape, c.dtype, c.logical_axes, c.partition_spec, setup.plan.sizes)
        entries[c.key] = {
            "module": c.module,
            "name": c.name,
            "pass": c.pass_,
            "shape": list(c.shape),
            "dtype": c.dtype,
            "logical_axes": list(c.logical_axes),
            "partition_spec": serialize.spec_to_json(c.partition_spec, len(c.shape)),
            "per_device_shape": list(layout.per_device_shape),
        }
    return entries


def render_case(case: Case) -> dict[str, bytes]:
    """The exact bytes of every golden file of `case`."""
    return serialize.render(dump_case(case))
