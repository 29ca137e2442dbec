"""One call from a user's model to its golden documents.

>>> import flax.linen as nn, jax.numpy as jnp
>>> from jax.sharding import AbstractMesh, AxisType
>>> class TinyLM(nn.Module):
...     @nn.compact
...     def __call__(self, tokens):
...         emb = self.param("embedding", nn.with_logical_partitioning(nn.initializers.normal(), ("vocab", "embed")),
...                          (64, 16))
...         x = nn.with_logical_constraint(jnp.take(emb, tokens, axis=0), ("batch", "length", "embed"))
...         return x @ emb.T
>>> docs = dump_model(TinyLM(), AbstractMesh((2, 2), ("data", "model"), (AxisType.Auto,) * 2),
...                   [("batch", "data"), ("vocab", "model")], batch_shape=(8, 32))
>>> docs["named_shardings.json"]["tensors"]["params/embedding"]["partition_spec"]
['model', None]
>>> docs["activation_shardings.json"]["tensors"]["forward/batch.length.embed"]["partition_spec"]
['data', None, None]
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import flax.linen as nn
import optax

from sharding_dump.core import capture, documents, layout, state, step
from sharding_dump.core.boundary import guard
from sharding_dump.core.gc_policy import fewer_collections


def dump_model(model: Any, mesh: Any, rules: Any, *, batch_shape: tuple[int, int] = (8, 128),
               input_axes: Sequence[str | None] | None = None,
               optimizer: optax.GradientTransformation | None = None,
               header: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The named, logical and activation documents of `model` (a linen module, an NNX module or a
    factory of either) trained with `optimizer` (default AdamW) on `mesh` under `rules`; the step is
    traced on a (batch, length) token batch of `batch_shape`, constrained to `input_axes` if given."""
    with fewer_collections():
        tx = optimizer or state.default_optimizer()
        lm = _guarded_model(model)
        train_state = state.abstract_train_state(lm.abstract_params(mesh, rules), tx)
        layouts = layout.tensor_layouts(train_state, mesh, rules)
        train_step = step.next_token_step(lm.apply, tx, input_axes)
        constraints = capture.record_activations(train_step, train_state, step.abstract_batch(batch_shape),
                                                 mesh=mesh, rules=rules)
        return documents.golden_documents(layouts, mesh, constraints, header=header)


def _guarded_model(model: Any) -> state.Model:
    """The user's model with its factory and every call of it (init's and the step's) run at the
    boundary (:func:`sharding_dump.core.boundary.guard`): what leaves them is one UserCodeError line."""
    built = None
    nnx = state.loaded_nnx()
    if not isinstance(model, nn.Module) and not (nnx is not None and isinstance(model, nnx.Module)):  # a factory
        with guard(f"the model factory {getattr(model, '__qualname__', type(model).__name__)}"):
            built = state.build_abstract(model)

    def call(module: Any, batch: dict[str, Any], rngs: dict[str, Any]) -> Any:
        with guard(f"the model call {type(module).__name__}(tokens)"):
            return state.tokens_call(module, batch, rngs)

    return state.as_model(model, call, built=built)
