"""Activation sharding constraints: the single helper every model calls.

`constrain(x, logical_axes, name)` applies flax's logical sharding constraint (a no-op when no mesh
and rules are active, e.g. while parameters are initialised) so that the traced step carries the
same constraints as a training run.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax


def constrain(x: jax.Array, logical_axes: Sequence[str | None], name: str) -> jax.Array:
    """Constrains activation `x` to `logical_axes`; `name` says what it is at the call site."""
    if len(logical_axes) != x.ndim:
        raise ValueError(f"activation {name!r}: {len(logical_axes)} logical axes for a rank-{x.ndim} array")
    return nn.with_logical_constraint(x, tuple(logical_axes))
