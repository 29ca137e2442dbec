"""The traced training step: gradients of a next-token loss under the case's abstract mesh and rules.

The goldens hold the state's layout; some guarantees live in the step instead (a pipeline's
`ppermute` shift, the `activation_stage` constraints on its buffers). `jax.make_jaxpr` on abstract
inputs shows them without devices, compilation or memory. The step is traced on the Auto-axis mesh in
either shard mode: an Explicit-mode step would need `out_sharding=` on every contraction of the model.
"""

from __future__ import annotations

from typing import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, jaxprs_in_params

from sharding_dump import models, state
from sharding_dump.dump import CaseSetup

PER_DEVICE_BATCH = 12  # sequences per device per step
SEQUENCE_LENGTH = 2048


def global_batch(setup: CaseSetup) -> int:
    """Sequences per step over the whole mesh."""
    return PER_DEVICE_BATCH * setup.plan.num_devices


def trace_step(setup: CaseSetup) -> ClosedJaxpr:
    """The jaxpr of d(loss)/d(params) for one global batch of the case."""
    model = models.build_model(setup.config)
    params = state.abstract_state(setup.config)["params"]
    batch = global_batch(setup)
    if setup.config.pipeline is not None:
        setup.config.pipeline.check_batch(batch)
    tokens = jax.ShapeDtypeStruct((batch, SEQUENCE_LENGTH), jnp.int32)

    def loss(params: dict, tokens: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits = model.apply({"params": params}, tokens, positions)
        targets = jnp.roll(tokens, -1, axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

    with jax.sharding.use_abstract_mesh(setup.plan.abstract_mesh()), \
            nn.logical_axis_rules(setup.rule_set.logical_axis_rules):
        return jax.make_jaxpr(jax.grad(loss))(params, tokens)


def equations(jaxpr: ClosedJaxpr | Jaxpr) -> Iterator[JaxprEqn]:
    """Every equation of `jaxpr` and of the jaxprs nested in it (scan, remat, jit, shard_map bodies)."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    for eqn in inner.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from equations(sub)
