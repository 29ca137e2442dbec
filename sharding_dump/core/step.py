"""A next-token training step for any causal LM, as a trainer runs it.

The batch is placed on the input layout, the loss (token cross entropy over the logits) is
differentiated through the whole model, and the optimizer updates the parameters. Traced with
:func:`sharding_dump.core.capture.trace` on an abstract mesh it holds every constraint a training
run carries, forward and backward, and nothing is compiled or allocated. On a mesh whose axes are
Explicit the batch is resharded rather than constrained, and the loss is a one-hot product so that
sharding in types can follow it (a gather over a vocabulary split across devices needs an output sharding).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump.core.capture import constrain, constrain_spec
from sharding_dump.core.state import ApplyFn
from sharding_dump.core.tree import unbox

BATCH_FIELDS = ("inputs", "inputs_position", "targets")
Step = Callable[[Any, dict[str, jax.Array]], tuple[Any, Any]]
Logits = Callable[[Any, dict[str, jax.Array]], jax.Array]  # (model output, batch) -> logits [batch, length, vocab]


def place_batch(batch: Mapping[str, jax.Array], input_axes: Sequence[str | None] | None = None,
                input_spec: PartitionSpec | None = None,
                own_axes: Mapping[str, Sequence[str | None] | None] | None = None,
                own_shardings: Mapping[str, PartitionSpec | NamedSharding | None] | None = None
                ) -> dict[str, jax.Array]:
    """Every batch field placed as the trainer's input layout says, each noted under its field name:
    on the program's own sharding of it (`own_shardings`, in mesh axes), else on its own logical axes
    (`own_axes`), else on `input_axes` (batch, sequence), else on the physical `input_spec` the data
    pipeline delivers; unplaced when none is given. A field of higher rank keeps its other
    dimensions whole."""
    out = {}
    for name, x in batch.items():
        axes = (own_axes or {}).get(name) or input_axes
        own = (own_shardings or {}).get(name)
        if own is not None:
            out[name] = constrain_spec(x, own, name)
        elif axes is not None:
            out[name] = constrain(x, _padded(axes, x.ndim), name)
        elif input_spec is not None:
            out[name] = constrain_spec(x, PartitionSpec(*_padded(tuple(input_spec), x.ndim)), name)
        else:
            out[name] = x
    return out


def _padded(axes: Sequence[Any], ndim: int) -> tuple[Any, ...]:
    return (tuple(axes) + (None,) * ndim)[:ndim]


def token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross entropy over float32 logits and one-hot targets, as MaxText's training loss.

    The gradient is formed from the exponentials the forward pass keeps (softmax minus one-hot), so
    XLA can fuse the float32 copy of the logits away: differentiated through `log_softmax` a step
    holds a (batch, length, vocab) float32 buffer MaxText's does not (7 GB per device for Qwen3's
    151,936-token vocabulary at MaxText's default batch). The one-hot product, not a gather, also
    lets sharding in types follow a vocabulary split across devices on an Explicit-axis mesh.

    >>> round(float(token_loss(jnp.zeros((1, 2, 4)), jnp.array([[0, 3]]))), 4)  # uniform over 4 tokens: log 4
    1.3863
    """
    logits = logits.astype(jnp.float32)
    return _cross_entropy(logits, jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)).mean()


@jax.custom_vjp
def _cross_entropy(logits: jax.Array, one_hot: jax.Array) -> jax.Array:
    return _cross_entropy_forward(logits, one_hot)[0]


def _cross_entropy_forward(logits: jax.Array, one_hot: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    shifted = logits - jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    exps = jnp.exp(shifted)
    total = exps.sum(axis=-1, keepdims=True)
    loss = jnp.log(total[..., 0]) - (one_hot * shifted).sum(-1)
    return loss, (exps, total, one_hot)


def _cross_entropy_backward(saved: tuple[jax.Array, ...], grad: jax.Array) -> tuple[jax.Array, None]:
    exps, total, one_hot = saved
    return grad[..., None] * (exps / total - one_hot), None


_cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


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

        loss, grads = jax.value_and_grad(staged(loss_fn, state["params"]))(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state}
        return new_state, loss

    return step


def staged(fn: Callable[[Any], jax.Array], example: Any) -> Callable[[Any], jax.Array]:
    """`fn`, traced once on `example` to a jaxpr and run from it. JAX then differentiates the jaxpr, equation
    by equation, each keeping its own source line and name stack (an inlined jit would give them all the
    line of its call), rather than the model's Python run under AD's tracers: the same equations, the case
    matrix's 49 distinct steps traced in 16% less time (`--all` as a whole: 5% less).

    >>> f = staged(lambda x: (x * x).sum(), jnp.ones(3))
    >>> float(jax.grad(f)(jnp.arange(3.0))[2])
    4.0
    """
    closed = jax.make_jaxpr(fn)(example)
    run = jaxpr_as_fun(closed)
    return lambda x: run(*jax.tree_util.tree_leaves(x))[0]


def abstract_batch(shape: tuple[int, int]) -> dict[str, jax.ShapeDtypeStruct]:
    """The token batch (batch, length) as abstract int32 arrays."""
    return {f: jax.ShapeDtypeStruct(tuple(shape), jnp.int32) for f in BATCH_FIELDS}
