"""Runs a small decoder pipelined and plain on 4 CPU devices and prints how far their logits differ.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_DISABLE_MOST_OPTIMIZATIONS=1 python tests/models/pipeline_equivalence.py

(XLA's optimizations are off: they cost most of the compile time and change no value compared here.)

The pipeline's weights, reordered into one scanned stack (repeat, then stage, then layer within the
stage; the layers left outside the pipeline last), must give the plain model's logits exactly: the
schedule (state_io, circular storage, ppermute shifts) only moves activations, it never changes the
arithmetic, whatever the stage layout (one layer, `layers_<k>`, or a scan of layers per stage).
One JSON line per schedule: {"schedule": [...], "max_abs_diff": x, "ppermute": bool}.
"""

from __future__ import annotations

import dataclasses
import json

SCHEDULES = (  # (stages, microbatches, repeats, layers per stage, scan them, model layers)
    (2, 4, 1, 2, True, 4),  # plain GPipe-style, two scanned layers per stage
    (2, 8, 2, 1, False, 6),  # circular with storage (M > N), one layer per stage, two layers outside
    (4, 4, 1, 2, False, 8),  # M = N, two unscanned layers per stage (layers_0, layers_1)
)
RULES = (("layers", "stage"), ("activation_stage", "stage"), ("embed", "fsdp"), ("activation_batch", "fsdp"))


def max_difference(stages: int, microbatches: int, repeats: int, per_stage: int, scanned: bool, layers: int) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sharding_dump.models.pipeline import PipelineConfig
    from sharding_dump.zoo import cards

    plain = dataclasses.replace(cards.load_config("qwen3-0.6b"), emb_dim=16, num_query_heads=2, num_kv_heads=1,
                                head_dim=8, mlp_dim=32, num_decoder_layers=layers, vocab_size=64, dtype="float32")
    pipelined = stages * repeats * per_stage
    schedule = PipelineConfig(stages, microbatches, repeats, pipelined, per_stage, scanned)
    mesh = jax.make_mesh((stages, 4 // stages), ("stage", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, plain.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    pipe_model, plain_model = cards.build_model(plain, schedule), cards.build_model(plain)
    # Random weights from numpy: compiling flax's init costs more than the whole comparison.
    shapes = nn.unbox(jax.eval_shape(pipe_model.init, jax.random.key(0), tokens, positions)["params"])
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(0.0, 0.3, a.shape).astype(a.dtype), shapes)  # numpy: no eager compiles

    lead = 2 if repeats > 1 else 1  # [R,] N leading dims of every pipeline weight

    def as_scan(w: np.ndarray) -> np.ndarray:  # [R,] N, a, K, ... -> a, R N K, ...
        w = np.moveaxis(w, tuple(range(lead)), tuple(range(1, lead + 1)))
        return w.reshape((w.shape[0], -1) + w.shape[lead + 2:])

    decoder = dict(params["decoder"])
    stages_tree = decoder.pop("pipeline_module")["layers"]
    if per_stage == 1:  # [R,] N, a, ...: no layer axis of its own
        stages_tree = jax.tree.map(lambda w: np.expand_dims(w, lead + 1), stages_tree)
    elif scanned:  # scanned_layers/... [R,] N, a, K, ...
        stages_tree = stages_tree["scanned_layers"]
    else:  # layers_<k>/... each [R,] N, a, ...: stack them at the scan position
        stages_tree = jax.tree.map(lambda *ws: np.stack(ws, axis=lead + 1),
                                   *(stages_tree[f"layers_{k}"] for k in range(per_stage)))
    stack = jax.tree.map(as_scan, stages_tree)
    if "layers_outside_pipeline" in decoder:
        stack = jax.tree.map(lambda a, b: np.concatenate([a, b], axis=1), stack,
                             decoder.pop("layers_outside_pipeline"))
    plain_params = {**params, "decoder": {**decoder, "layers": stack}}

    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        traced = jax.jit(pipe_model.apply).trace({"params": params}, tokens, positions)  # traced once
        got = traced.lower().compile()({"params": params}, tokens, positions)
    want = jax.jit(plain_model.apply)({"params": plain_params}, tokens, positions)
    return {"schedule": [stages, microbatches, repeats, per_stage, scanned, layers],
            "max_abs_diff": float(np.max(np.abs(np.asarray(got) - np.asarray(want)))), "scale": float(np.max(np.abs(want))),
            "ppermute": "ppermute" in str(traced.jaxpr)}


def main() -> None:
    import jax

    assert jax.device_count() == 4, "set XLA_FLAGS=--xla_force_host_platform_device_count=4"
    for schedule in SCHEDULES:
        print(json.dumps(max_difference(*schedule)), flush=True)


if __name__ == "__main__":
    main()
