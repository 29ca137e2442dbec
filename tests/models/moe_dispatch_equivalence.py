"""Runs the routed experts with MaxText's sorted dispatch on 4 CPU devices and with the dense path on
one, and prints how far their outputs and gradients differ.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_DISABLE_MOST_OPTIMIZATIONS=1 \
        python tests/models/moe_dispatch_equivalence.py

Dropless dispatch changes where each product is computed, never its value: over fsdp alone, with
expert parallelism (ragged all-to-all there and back), and with the experts' hidden dimension split
over `tensor` (reduce-scattered), the block's output and the gradients of its input and of every
weight must equal the dense path's. One JSON line per mesh and card:
{"mesh": ..., "model": ..., "max_abs_diff": x, "scale": y, "primitives": [...]}.
"""

from __future__ import annotations

import dataclasses
import json

MESHES = (  # (fsdp, expert, tensor)
    (4, 1, 1),
    (2, 2, 1),
    (1, 2, 2),
)
RULES = (("activation_batch", ("fsdp", "expert")), ("activation_embed", "tensor"), ("exp", "expert"),
         ("mlp_no_fsdp", "tensor"), ("embed_moe", "fsdp"), ("mlp_moe", "tensor"), ("activation_mlp", "tensor"))
MODELS = (  # (card, block class, changes): gpt-oss has expert biases and the clamped unit
    ("gpt-oss-20b", "RoutedExperts", {}),
    ("deepseek2-16b", "RoutedAndSharedExperts", {"shared_experts": 1}),
)
SMALL = {"emb_dim": 16, "moe_mlp_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "dtype": "float32"}


def max_difference(model: str, block: str, changes: dict, fsdp: int, expert: int, tensor: int) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sharding_dump.core.legacy_mesh import legacy_mesh
    from sharding_dump.models import moe
    from sharding_dump.zoo import cards

    cfg = dataclasses.replace(cards.load_config(model), **SMALL, **changes)
    sparse, dense = (getattr(moe, block)(dataclasses.replace(cfg, sparse_matmul=s)) for s in (True, False))
    x = jnp.asarray(np.random.default_rng(1).normal(0.0, 1.0, (8, 6, cfg.emb_dim)), jnp.float32)
    shapes = nn.unbox(jax.eval_shape(dense.init, jax.random.key(0), x)["params"])
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(0.0, 0.3, a.shape).astype(a.dtype), shapes)

    def loss(module):
        return lambda p, inputs: jnp.sum(jnp.sin(module.apply({"params": p}, inputs)))

    def outputs(module):
        grad = jax.grad(loss(module), argnums=(0, 1))
        return lambda p, inputs: (module.apply({"params": p}, inputs), grad(p, inputs))

    mesh = jax.make_mesh((fsdp, expert, tensor), ("fsdp", "expert", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with jax.set_mesh(mesh), legacy_mesh(mesh), nn.logical_axis_rules(RULES):
        traced = jax.jit(outputs(sparse)).trace(params, x)
        got = traced.lower().compile()(params, x)
    want = jax.jit(outputs(dense))(params, x)
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), got, want))
    text = str(traced.jaxpr)
    return {"mesh": [fsdp, expert, tensor], "model": model, "max_abs_diff": max(diffs),
            "scale": float(np.max(np.abs(np.asarray(want[0])))),
            "primitives": sorted(p for p in ("ragged_dot", "ragged_all_to_all", "shard_map", "reduce_scatter")
                                 if p in text)}


def main() -> None:
    import jax

    assert jax.device_count() == 4, "set XLA_FLAGS=--xla_force_host_platform_device_count=4"
    for model, block, changes in MODELS:
        for mesh in MESHES:
            print(json.dumps(max_difference(model, block, changes, *mesh)), flush=True)


if __name__ == "__main__":
    main()
