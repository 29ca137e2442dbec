"""Planning a case's pipeline: the schedule MaxText derives from the pipeline settings, checked, and
the rule and mesh changes a pipelined run makes. The pipelined layer stack itself is Flax and lives
in :mod:`sharding_dump.models.pipeline`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from sharding_dump.core.layout import resolve
from sharding_dump.errors import BadInput
from sharding_dump.models.pipeline import STAGE_AXIS, STAGE_LOGICAL, PipelineConfig
from sharding_dump.zoo import rules as rules_mod
from sharding_dump.zoo import settings as settings_mod
from sharding_dump.zoo.mesh import MeshPlan

# Pipeline settings and their defaults (data/settings.yml): a run without a pipeline must leave them so.
PIPELINE_SETTINGS = {"num_pipeline_microbatches": -1, "num_pipeline_repeats": -1, "pipeline_parallel_layers": -1,
                     "num_layers_per_pipeline_stage": 1, "scan_layers_per_stage": False}
# MaxText's pipelined runs split the embedding and logits batch over these axes, `stage` first.
PIPELINE_LOGITS_BATCH = ("activation_embed_and_logits_batch", ("stage", "data", "fsdp", "fsdp_transpose", "expert"))


def plan_pipeline(values: Mapping[str, Any], plan: MeshPlan, rule_set: rules_mod.RuleSet,
                  num_layers: int | None) -> PipelineConfig | None:
    """The pipeline of a case (None when the `stage` axis is 1), or BadInput naming the setting at fault.

    `num_layers` is the length of the stack the decoder pipelines (all of a dense model's layers, the
    MoE layers of a model with leading dense ones; None: the model has no stack to pipeline). Defaults and the consistency rule are MaxText's:
    repeats = pipeline_parallel_layers / (stages x num_layers_per_pipeline_stage) when -1, and
    stages x repeats x num_layers_per_pipeline_stage = pipeline_parallel_layers."""
    stages = plan.sizes.get(STAGE_AXIS, 1)
    if stages == 1:
        given = [f"{key}={settings_mod.format_value(values[key])}" for key, default in PIPELINE_SETTINGS.items()
                 if values[key] != default]
        if given:
            where = ("the 'stage' mesh axis is 1" if STAGE_AXIS in plan.axis_names
                     else f"rule '{rule_set.name}' has no 'stage' mesh axis (mesh_axes: {', '.join(plan.axis_names)})")
            raise BadInput(f"{given[0]}: needs a pipeline (ici_pipeline_parallelism x dcn_pipeline_parallelism > 1), "
                           f"but {where}")
        return None
    if num_layers is None:
        raise BadInput(f"stage axis of size {stages}: the model's decoder has no layer stack a pipeline can cut "
                       f"into stages (size the stage axis 1)")
    for logical in (STAGE_LOGICAL, "activation_stage"):
        spec = resolve((logical,), rule_set)
        if spec[0] not in (STAGE_AXIS, (STAGE_AXIS,)):
            raise BadInput(f"rule '{rule_set.name}': a pipeline needs logical axis '{logical}' on mesh axis 'stage' "
                           f"(got {spec[0]!r})")
    micro, repeats, layers, per_stage = (int(values[key]) for key in list(PIPELINE_SETTINGS)[:4])
    if micro == -1:
        micro = stages
    if micro < 1 or micro % stages:
        raise BadInput(f"num_pipeline_microbatches={micro}: must be a multiple of the {stages} pipeline stages")
    if layers == -1:
        layers = num_layers
    if not 1 <= layers <= num_layers:
        raise BadInput(f"pipeline_parallel_layers={layers}: must be -1 (all) or between 1 and the "
                       f"{num_layers} layers the pipeline can take")
    if repeats == -1:
        repeats, remainder = divmod(layers, stages * per_stage)
        if remainder or not repeats:
            raise BadInput(f"num_layers_per_pipeline_stage={per_stage} x {stages} stages = {stages * per_stage} "
                           f"must divide pipeline_parallel_layers ({layers}; -1 means the {num_layers} layers the "
                           f"pipeline can take)")
    if stages * repeats * per_stage != layers:
        raise BadInput(f"num_pipeline_repeats={repeats}: stages x repeats x num_layers_per_pipeline_stage = "
                       f"{stages} x {repeats} x {per_stage} = {stages * repeats * per_stage} must equal "
                       f"pipeline_parallel_layers ({layers}; -1 means the {num_layers} layers the pipeline can take)")
    return PipelineConfig(stages, micro, repeats, layers, per_stage, bool(values["scan_layers_per_stage"]))


def pipeline_rules(rule_set: rules_mod.RuleSet) -> rules_mod.RuleSet:
    """The rules of a pipelined run: MaxText puts `stage` first in every `activation_embed_and_logits_batch`
    rule (axes this mesh lacks left out), so the embeddings, logits and input batch split over stages."""
    name, axes = PIPELINE_LOGITS_BATCH
    axes = tuple(a for a in axes if a in rule_set.mesh_axes)
    changed = tuple((n, axes if n == name else a) for n, a in rule_set.logical_axis_rules)
    # MaxText also moves `stage` to the front of the data pipeline's axes (configs/types.py).
    data = rule_set.data_sharding
    if STAGE_AXIS in data:
        data = (STAGE_AXIS,) + tuple(a for a in data if a != STAGE_AXIS)
    return dataclasses.replace(rule_set, logical_axis_rules=changed, data_sharding=data)


def stage_before_data(plan: MeshPlan) -> MeshPlan:
    """The mesh of a pipelined run: MaxText swaps `stage` in front of `data` when it comes after it
    (configs/types.py), so the devices of one stage are contiguous. Sizes move with their axes."""
    names = list(plan.axis_names)
    if STAGE_AXIS not in names or "data" not in names or names.index(STAGE_AXIS) < names.index("data"):
        return plan
    i, j = names.index(STAGE_AXIS), names.index("data")
    order = list(range(len(names)))
    order[i], order[j] = order[j], order[i]
    return dataclasses.replace(plan, axis_names=tuple(names[k] for k in order), ici=tuple(plan.ici[k] for k in order),
                               dcn=tuple(plan.dcn[k] for k in order))


def check_batch(pp: PipelineConfig, global_batch: int) -> None:
    """BadInput unless the batch splits into the pipeline's microbatches."""
    if global_batch % pp.num_microbatches:
        raise BadInput(f"num_pipeline_microbatches={pp.num_microbatches}: does not divide the global batch "
                       f"of {global_batch}")
