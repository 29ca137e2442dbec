"""MoE models: published sizes, card checks and real forward passes (routing, MLA, sinks, windows)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding_dump.core.state import parameter_count
from sharding_dump.errors import BadInput
from sharding_dump.models.attention import causal_attention
from sharding_dump.models.moe import route
from sharding_dump.zoo import cards, state
from sharding_dump.zoo.cards import check_card_consistency


@pytest.mark.parametrize("model,published,tolerance", [
    ("deepseek2-16b", 15.7e9, 0.01),  # DeepSeek-V2-Lite
    ("deepseek3-671b", 671e9, 0.01),  # DeepSeek-V3 without the multi-token-prediction module
    ("gpt-oss-20b", 20.9e9, 0.03),
])
def test_parameter_count_matches_published_size(model, published, tolerance):
    count = parameter_count(state.abstract_state(cards.load_config(model)))
    assert abs(count - published) / published < tolerance, f"{model}: {count:,} parameters"


@pytest.mark.parametrize("change,message", [
    ({"first_num_dense_layers": 27}, "first_num_dense_layers: 27 leaves no MoE layer"),
    ({"num_experts_per_tok": 65}, "num_experts_per_tok: 65 is more than num_experts \\(64\\)"),
    ({"inhomogeneous_layer_cycle_interval": 2},
     "inhomogeneous_layer_cycle_interval: 2 does not divide num_decoder_layers \\(27\\)"),
    ({"mlp_activations": ["silu"]}, "mlp_activations: .* names exactly two activations, not 1"),
    ({"mlp_activations_limit": 7.0}, "mlp_activations_limit: the clamped gated unit"),
])
def test_inconsistent_moe_card_is_bad_input(change, message):
    card = {"num_decoder_layers": 27, "first_num_dense_layers": 1, "num_experts": 64, "num_experts_per_tok": 6,
            "num_query_heads": 16, "num_kv_heads": 16,
            "mlp_activations": ["silu", "linear"], **change}
    with pytest.raises(BadInput, match=f"model card x.yml: field {message}"):
        check_card_consistency(card, "model card x.yml")


TINY = {"emb_dim": 64, "num_query_heads": 4, "num_kv_heads": 4, "mlp_dim": 96, "moe_mlp_dim": 32,
        "vocab_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "dtype": "float32"}


@pytest.mark.compile
@pytest.mark.parametrize("model,change", [
    ("deepseek2-16b", {"num_decoder_layers": 3, "first_num_dense_layers": 1, "kv_lora_rank": 16,
                       "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}),
    ("deepseek3-671b", {"num_decoder_layers": 3, "first_num_dense_layers": 1, "q_lora_rank": 24,
                        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}),
    ("gpt-oss-20b", {"num_decoder_layers": 4, "num_kv_heads": 2, "head_dim": 16, "sliding_window_size": 2}),
])
def test_forward_pass_is_real_and_causal(model, change):
    """A scaled-down card runs on real arrays: finite logits, and no position sees a later token
    (routing, MLA, sinks and sliding windows all respect causality)."""
    cfg = dataclasses.replace(cards.load_config(model), **{**TINY, **change})
    net = cards.build_model(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    # Rows are independent (dropless routing), so the original and the altered sequences share a batch.
    batch = jnp.concatenate([tokens, tokens.at[:, 5:].set((tokens[:, 5:] + 1) % cfg.vocab_size)])
    positions = jnp.broadcast_to(jnp.arange(8), batch.shape)
    # Weights drawn on the host: compiling flax's random initialisers costs far more than the forward.
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.2, s.shape), s.dtype),
                          jax.eval_shape(net.init, jax.random.key(0), batch, positions))
    logits = jax.jit(net.apply)(params, batch, positions)
    assert logits.shape == (4, 8, cfg.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))
    original, changed = logits[:2], logits[2:]
    assert jnp.allclose(original[:, :5], changed[:, :5], atol=1e-5)
    assert not jnp.allclose(original[:, 5:], changed[:, 5:], atol=1e-3)


@pytest.mark.compile
def test_routing_weights():
    routed = jax.jit(route, static_argnums=0)  # one compilation rather than one per operation
    logits = jax.random.normal(jax.random.key(0), (1, 3, 8))
    ds3 = cards.load_config("deepseek3-671b")
    cfg = dataclasses.replace(ds3, num_experts=8, num_experts_per_tok=2)
    bias = jnp.zeros(8).at[7].set(100.0)
    weights, indices = routed(cfg, logits, bias)
    assert bool(jnp.all(indices[..., 0] == 7))  # the bias steers the choice ...
    assert jnp.allclose(weights.sum(-1), cfg.routed_scaling_factor)  # ... but not the weights
    oss = dataclasses.replace(cards.load_config("gpt-oss-20b"), num_experts=8, num_experts_per_tok=2)
    weights, indices = routed(oss, logits, None)
    assert jnp.allclose(weights.sum(-1), 1.0)
    assert bool(jnp.all(indices == jax.lax.top_k(logits, 2)[1]))


def test_attention_scores_in_the_activation_dtype():
    """MaxText's dot-product attention keeps its (b, kv_heads, group, t, s) scores in the activations'
    dtype (float32_qk_product, float32_logits false): float32 ones would double a compiled step's
    largest buffers. The bfloat16 result still matches float32 attention."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape, np.float32) for shape in [(1, 6, 4, 8), (1, 6, 2, 8), (1, 6, 2, 8)])
    attend = functools.partial(causal_attention, scale=8**-0.5)
    low = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    jaxpr = jax.make_jaxpr(attend)(*low)
    # the scores and their exponentials (jnp's sum still accumulates them in float32, fused by XLA)
    scores = {(eqn.primitive.name, str(var.aval.dtype)) for eqn in jaxpr.eqns for var in eqn.outvars
              if var.aval.ndim == 5 and eqn.primitive.name in ("dot_general", "exp")}
    assert scores == {("dot_general", "bfloat16"), ("exp", "bfloat16")}
    # both attentions in one compiled function (op by op, each of their ~40 operations compiles alone)
    got, want = jax.jit(lambda low, full: (attend(*low).astype(jnp.float32),
                                           jax.nn.dot_product_attention(*full, is_causal=True)))(low, (q, k, v))
    assert np.allclose(got, want, atol=0.05)


@pytest.mark.compile
def test_attention_sinks_and_window():
    attend = jax.jit(causal_attention, static_argnames=("scale", "sliding_window"))
    query, key = jnp.zeros((1, 4, 2, 2)), jnp.zeros((1, 4, 1, 2))  # two query heads share one kv head
    value = jnp.ones((1, 4, 1, 2))
    assert jnp.allclose(attend(query, key, value, scale=1.0), 1.0)  # without sinks the weights sum to one
    sunk = attend(query, key, value, scale=1.0, sinks=jnp.array([0.0, 50.0]))
    # Head 0 at position 0: the sink (logit 0) takes half of the mass; head 1: a large sink takes it all.
    assert jnp.allclose(sunk[0, 0, 0], 0.5) and jnp.allclose(sunk[..., 1, :], 0.0, atol=1e-6)
    ramp = jnp.arange(4.0).reshape(1, 4, 1, 1)
    windowed = attend(jnp.zeros((1, 4, 1, 1)), jnp.zeros((1, 4, 1, 1)), ramp, scale=1.0, sliding_window=2)
    assert jnp.allclose(windowed[0, :, 0, 0], jnp.array([0.0, 0.5, 1.5, 2.5]))  # mean of the last two
