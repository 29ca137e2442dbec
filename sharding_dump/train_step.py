"""The training step of a zoo case, traced on the case's abstract mesh (see :mod:`sharding_dump.core.step`).

One step as a trainer runs it: the token batch constrained to the rule's input layout, the token
cross entropy differentiated through the whole model (scanned, rematerialised layers included) and
AdamW's update. Nothing is compiled or allocated.
"""

from __future__ import annotations

from typing import Any

import optax
from jax.extend.core import ClosedJaxpr

from sharding_dump import activations, models, rules
from sharding_dump.batch import BatchPlan
from sharding_dump.core import capture
from sharding_dump.core.state import as_model
from sharding_dump.core.step import BATCH_FIELDS, Step, next_token_step  # noqa: F401
from sharding_dump.core.step import abstract_batch as _abstract_batch
from sharding_dump.mesh import MeshPlan


def make_step(model: Any, tx: optax.GradientTransformation, input_axes: tuple[str, ...]) -> Step:
    """state, batch -> (new state, loss) for a Flax model (linen or NNX): forward, backward, update."""
    return next_token_step(as_model(model).apply, tx, input_axes)


def abstract_batch(batch: BatchPlan) -> dict[str, Any]:
    """The token batch as abstract int32 arrays (global_batch_size, max_target_length)."""
    return _abstract_batch(batch.shape)


def trace_step(config: models.ModelConfig, state: dict[str, Any], plan: MeshPlan, rule_set: rules.RuleSet,
               batch: BatchPlan, tx: optax.GradientTransformation) -> tuple[ClosedJaxpr, activations.Recording]:
    """The jaxpr of one training step of `config` on the plan's abstract mesh, and its recording."""
    step = make_step(models.build_model(config), tx, batch.logical_axes)
    return capture.trace(step, state, abstract_batch(batch), mesh=plan.abstract_mesh(), rules=rule_set)


def trace_activations(config: models.ModelConfig, state: dict[str, Any], plan: MeshPlan,
                      rule_set: rules.RuleSet, batch: BatchPlan,
                      tx: optax.GradientTransformation) -> list[activations.Constraint]:
    """Every activation constraint of one training step of `config` on the plan's mesh."""
    return activations.read_constraints(*trace_step(config, state, plan, rule_set, batch, tx))
