"""The training step whose activation shardings are dumped, traced on the case's abstract mesh.

One step as a trainer runs it: the token batch is constrained to the rule's input layout, the loss
(token cross entropy over the model's logits) is differentiated through the whole model (scanned,
rematerialised layers included) and AdamW updates the parameters. `jax.make_jaxpr` traces it under
the case's mesh and logical axis rules: nothing is compiled or allocated, and every constraint the
step would carry in training is in the jaxpr, forward and backward.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.extend.core import ClosedJaxpr

from sharding_dump import activations, models, rules
from sharding_dump.batch import BatchPlan
from sharding_dump.mesh import MeshPlan, use_mesh

BATCH_FIELDS = ("inputs", "inputs_position", "targets")


def make_step(model: nn.Module, tx: optax.GradientTransformation,
              input_axes: tuple[str, ...]) -> Callable[[dict[str, Any], dict[str, jax.Array]], Any]:
    """state, batch -> (new state, loss): forward, backward and optimizer update."""

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
        tokens, positions, targets = (activations.constrain(batch[f], input_axes, f) for f in BATCH_FIELDS)

        def loss_fn(params: Any) -> jax.Array:
            logits = model.apply({"params": params}, tokens, positions)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state}
        return new_state, loss

    return step


def abstract_batch(batch: BatchPlan) -> dict[str, jax.ShapeDtypeStruct]:
    """The token batch as abstract int32 arrays (global_batch_size, max_target_length)."""
    return {f: jax.ShapeDtypeStruct(batch.shape, jnp.int32) for f in BATCH_FIELDS}


def trace_step(config: models.ModelConfig, state: dict[str, Any], plan: MeshPlan, rule_set: rules.RuleSet,
               batch: BatchPlan, tx: optax.GradientTransformation) -> tuple[ClosedJaxpr, activations.Recording]:
    """The jaxpr of one training step of `config` on the plan's abstract mesh, and its recording."""
    step = make_step(models.build_model(config), tx, batch.logical_axes)
    with use_mesh(plan), nn.logical_axis_rules(rule_set.logical_axis_rules), activations.recording() as rec:
        closed = jax.make_jaxpr(step)(state, abstract_batch(batch))
    return closed, rec


def trace_activations(config: models.ModelConfig, state: dict[str, Any], plan: MeshPlan,
                      rule_set: rules.RuleSet, batch: BatchPlan,
                      tx: optax.GradientTransformation) -> list[activations.Constraint]:
    """Every activation constraint of one training step of `config` on the plan's mesh."""
    return activations.read_constraints(*trace_step(config, state, plan, rule_set, batch, tx))
