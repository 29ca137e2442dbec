"""models/layers.py (named test_layer_stacks: tests/integration/test_layers.py holds the layering rule): how a
stack names the layer dimension of a weight declared with no logical axes."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from sharding_dump.models.layers import RMSNorm, scan_layers
from sharding_dump.zoo import cards


def stacked_names(axes: tuple, nnx_stack: bool) -> tuple:
    """The logical names of a norm scale declared with `axes`, scanned over 3 layers."""
    cfg = cards.load_config("qwen3-0.6b")

    class Layer(nn.Module):
        cfg: object

        @nn.compact
        def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
            return RMSNorm(self.cfg, axes, name="norm")(x).astype(x.dtype), None

    stack = scan_layers(Layer, 3, "layers", nnx_stack=nnx_stack)(cfg)
    x = jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)
    positions = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    variables = jax.eval_shape(lambda: stack.init(jax.random.key(0), x, positions))
    box = variables["params"]["norm"]["scale"]
    assert box.value.shape == (8, 3)
    return tuple(box.names)


@pytest.mark.parametrize("axes,nnx_stack,expected", [
    ((), False, (None, "layers")),  # linen's scan (flax pads the names), MaxText's scanned decoder
    ((), True, ()),  # as nnx.vmap stacks MaxText's pipeline stages: an empty sharding gains no name
    ((None,), True, (None, "layers")),
    (("norm",), True, ("norm", "layers")),
])
def test_a_weight_declared_without_axes_gains_none_from_an_nnx_stack(axes, nnx_stack, expected):
    assert stacked_names(axes, nnx_stack) == expected
