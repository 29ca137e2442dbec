"""A next-token training step for any causal LM, as a trainer runs it.

The token batch is constrained to the input layout, the loss (token cross entropy over the logits)
is differentiated through the whole model, and the optimizer updates the parameters. Traced with
:func:`sharding_dump.core.capture.trace` on an abstract mesh it holds every constraint a training
run carries, forward and backward, and nothing is compiled or allocated.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from sharding_dump.core.capture import constrain
from sharding_dump.core.layout import unbox
from sharding_dump.core.state import ApplyFn

BATCH_FIELDS = ("inputs", "inputs_position", "targets")
Step = Callable[[dict[str, Any], dict[str, jax.Array]], tuple[dict[str, Any], jax.Array]]


def next_token_step(apply: ApplyFn, optimizer: optax.GradientTransformation,
                    input_axes: Sequence[str | None] | None = None) -> Step:
    """state, batch -> (new state, loss): forward, backward and optimizer update.

    `input_axes` are the logical axes the batch fields are constrained to inside the step (None: not
    constrained). The state may be boxed (as :func:`abstract_train_state` returns it): the step
    works on the values, so flax adds no constraints for parameter reads."""

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
        state = unbox(state)
        fields = [batch[f] for f in BATCH_FIELDS]
        if input_axes is not None:
            fields = [constrain(x, tuple(input_axes), f) for x, f in zip(fields, BATCH_FIELDS)]
        tokens, positions, targets = fields

        def loss_fn(params: Any) -> jax.Array:
            logits = apply(params, tokens, positions)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state}
        return new_state, loss

    return step


def abstract_batch(shape: tuple[int, int]) -> dict[str, jax.ShapeDtypeStruct]:
    """The token batch (batch, length) as abstract int32 arrays."""
    return {f: jax.ShapeDtypeStruct(tuple(shape), jnp.int32) for f in BATCH_FIELDS}
