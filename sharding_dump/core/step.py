"""A next-token training step for any causal LM, as a trainer runs it.

The batch is placed on the input layout, the loss (token cross entropy over the logits) is
differentiated through the whole model, and the optimizer updates the parameters. Traced with
:func:`sharding_dump.core.capture.trace` on an abstract mesh it holds every constraint a training
run carries, forward and backward, and nothing is compiled or allocated. On a mesh whose axes are
Explicit the batch is resharded rather than constrained, and the loss is written so that sharding
in types can follow it (a gather over a vocabulary split across devices needs an output sharding).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from sharding_dump.core.capture import constrain, constrain_spec, explicit_mesh
from sharding_dump.core.layout import unbox
from sharding_dump.core.state import ApplyFn

BATCH_FIELDS = ("inputs", "inputs_position", "targets")
Step = Callable[[Any, dict[str, jax.Array]], tuple[Any, Any]]
Logits = Callable[[Any, dict[str, jax.Array]], jax.Array]  # (model output, batch) -> logits [batch, length, vocab]


def place_batch(batch: Mapping[str, jax.Array], input_axes: Sequence[str | None] | None = None,
                input_spec: PartitionSpec | None = None,
                own_axes: Mapping[str, Sequence[str | None] | None] | None = None) -> dict[str, jax.Array]:
    """Every batch field placed as the trainer's input layout says, each noted under its field name:
    on its own logical axes (`own_axes`), else on `input_axes` (batch, sequence), else on the
    physical `input_spec` the data pipeline delivers; unplaced when none is given. A field of higher
    rank keeps its other dimensions whole."""
    out = {}
    for name, x in batch.items():
        axes = (own_axes or {}).get(name) or input_axes
        if axes is not None:
            out[name] = constrain(x, _padded(axes, x.ndim), name)
        elif input_spec is not None:
            out[name] = constrain_spec(x, PartitionSpec(*_padded(tuple(input_spec), x.ndim)), name)
        else:
            out[name] = x
    return out


def _padded(axes: Sequence[Any], ndim: int) -> tuple[Any, ...]:
    return (tuple(axes) + (None,) * ndim)[:ndim]


def token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross entropy. On an Explicit-axis mesh through a one-hot product (sharding in
    types can follow it over a split vocabulary), else optax's integer-label form."""
    logits = logits.astype(jnp.float32)
    if explicit_mesh():
        one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
        return -(one_hot * jax.nn.log_softmax(logits)).sum(-1).mean()
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def next_token_step(apply: ApplyFn, optimizer: optax.GradientTransformation,
                    input_axes: Sequence[str | None] | None = None, *, input_spec: PartitionSpec | None = None,
                    logits: Logits | None = None, streams: Sequence[str] = ()) -> Step:
    """state, batch -> (new state, loss): forward, backward and optimizer update.

    `apply(params, batch, rng keys)` runs the model; `logits(output, batch)` picks the logits out of
    what it returns (default: the output itself). The batch is placed by :func:`place_batch`
    (`input_axes`, else `input_spec`). `streams` name the RNG streams the model gets a key for (one
    per step, folded from the step count). The state may be boxed (as :func:`abstract_train_state`
    returns it): the step works on the values, so flax adds no constraints for parameter reads."""

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
        state = unbox(state)
        batch = place_batch(batch, input_axes, input_spec)
        rngs = {}
        if streams:
            base = jax.random.fold_in(jax.random.key(0), state["step"])
            rngs = {name: jax.random.fold_in(base, i) for i, name in enumerate(streams)}

        def loss_fn(params: Any) -> jax.Array:
            output = apply(params, batch, rngs)
            return token_loss(logits(output, batch) if logits is not None else output, batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state}
        return new_state, loss

    return step


def abstract_batch(shape: tuple[int, int]) -> dict[str, jax.ShapeDtypeStruct]:
    """The token batch (batch, length) as abstract int32 arrays."""
    return {f: jax.ShapeDtypeStruct(tuple(shape), jnp.int32) for f in BATCH_FIELDS}
