"""Routed mixture of experts: a router picks `num_experts_per_tok` experts per token, each expert is
a gated MLP, and the token's output is the router-weighted sum of its experts' outputs.

Parameters (before the layer axis is inserted at position 1 by the scan)::

    gate/kernel        (embed, None)               router (DeepSeek's: (embed_moe, None))
    gate/bias          (None,)                     [routed_bias]
    wi_0, wi_1         (exp, embed_moe, mlp_moe)   expert up-projections
    wo                 (exp, mlp_moe, embed_moe)   expert down-projection
    wi_0_bias, wi_1_bias (exp, activation_mlp); wo_bias (exp, activation_embed)   [mlp_bias]

The run's `sparse_matmul` setting picks how tokens reach the experts, as MaxText's does: true (its
default) the sorted dispatch of :mod:`sharding_dump.models.moe_dispatch` (tokens sorted by expert,
grouped matmuls, a ragged all-to-all under expert parallelism); false its dense path, einsums over the
`exp` axis for every token weighted by a combine matrix that is zero outside each token's chosen
experts (dropless: no capacity). Both have the same parameters; the constraints each places on the
tokens and gate logits are MaxText's for that path.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharding_dump.core.capture import constrain
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.dense import MlpBlock
from sharding_dump.models.layers import activation, weight_param
from sharding_dump.models.moe_dispatch import sorted_dispatch

ROUTER_AXES = ("activation_batch", "activation_norm_length", None)
# MaxText's dense_matmul constrains the gate logits and the tokens on its MoE activation axes.
DENSE_LOGIT_AXES = ("activation_batch_moe", "activation_length_moe", None)
DENSE_INPUT_AXES = ("activation_batch_moe", "activation_norm_length_moe", "activation_embed_moe")
GPT_OSS_GLU_ALPHA = 1.702  # gpt-oss's x * sigmoid(alpha * x) gate


def expert_init() -> nn.initializers.Initializer:
    """Fan-in scaling per expert: the expert axis is a batch of independent matrices."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                            batch_axis=(0,))


def gated_unit(cfg: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """act0(gate) * act1(up); with `mlp_activations_limit`, gpt-oss's clamped sigmoid-linear unit
    gate * sigmoid(1.702 gate) * (up + 1), gate clamped above and up clamped both ways."""
    if cfg.mlp_activations_limit:
        limit = cfg.mlp_activations_limit
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return gate * jax.nn.sigmoid(GPT_OSS_GLU_ALPHA * gate) * (up + 1)
    first, second = cfg.mlp_activations
    return activation(first, gate) * activation(second, up)


def route(cfg: ModelConfig, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(weights, expert indices), each (batch, length, num_experts_per_tok).

    With a score function (softmax or sigmoid) the bias only steers which experts are chosen
    (DeepSeek-V3's load balancing without an auxiliary loss) and the weights are the unbiased
    scores, renormalised for sigmoid and scaled by `routed_scaling_factor`. Without one, the bias is
    part of the logits and the weights are a softmax over the chosen logits (gpt-oss, Mixtral)."""
    logits = logits.astype(jnp.float32)
    if cfg.routed_score_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif cfg.routed_score_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = logits
    selection = scores if bias is None else scores + bias.astype(jnp.float32)
    chosen, indices = jax.lax.top_k(selection, cfg.num_experts_per_tok)
    if cfg.routed_score_func == "none":
        return jax.nn.softmax(chosen, axis=-1), indices
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if cfg.routed_score_func == "sigmoid":
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * cfg.routed_scaling_factor, indices


class Router(nn.Module):
    """Router logits (batch, length, num_experts) and its optional per-expert bias. The kernel's input
    axis is named by the caller: MaxText gives gpt-oss's router `embed`, DeepSeek's `embed_moe`."""

    cfg: ModelConfig
    embed_axis: str = "embed"

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        cfg = self.cfg
        kernel = weight_param(self, "kernel", (x.shape[-1], cfg.num_experts), (self.embed_axis, None), cfg)
        logits = jnp.tensordot(x.astype(jnp.float32), kernel.astype(jnp.float32), axes=1)
        bias = None
        if cfg.routed_bias:
            bias = weight_param(self, "bias", (cfg.num_experts,), (None,), cfg, nn.initializers.zeros)
        return logits, bias


class RoutedExperts(nn.Module):
    """Router plus `num_experts` gated MLPs of width `moe_mlp_dim`; `gate_embed_axis` names the
    router kernel's input axis."""

    cfg: ModelConfig
    gate_embed_axis: str = "embed"
    expert_scale: bool = False  # a learned output scale per expert (Gemma 4's per_expert_scale)

    @nn.compact
    def __call__(self, x: jax.Array, gate_inputs: jax.Array | None = None) -> jax.Array:
        """x routed by the router's reading of `gate_inputs` (default x)."""
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        experts, embed, width = cfg.num_experts, x.shape[-1], cfg.moe_mlp_dim
        if cfg.sparse_matmul:
            x = constrain(x, ROUTER_AXES, "inputs")
        logits, bias = Router(cfg, self.gate_embed_axis, name="gate")(x if gate_inputs is None else gate_inputs)
        logits = constrain(logits.astype(dtype), ROUTER_AXES if cfg.sparse_matmul else DENSE_LOGIT_AXES,
                           "gate_logits")
        router = {} if bias is None else {"bias": bias}
        if self.expert_scale:
            router["scale"] = weight_param(self, "per_expert_scale", (experts,), ("exp",), cfg, nn.initializers.ones)

        wi_axes, wo_axes = ("exp", "embed_moe", "mlp_moe"), ("exp", "mlp_moe", "embed_moe")
        w = {"wi_0": weight_param(self, "wi_0", (experts, embed, width), wi_axes, cfg, expert_init()),
             "wi_1": weight_param(self, "wi_1", (experts, embed, width), wi_axes, cfg, expert_init()),
             "wo": weight_param(self, "wo", (experts, width, embed), wo_axes, cfg, expert_init())}
        if cfg.mlp_bias:
            zeros, bias_axes = nn.initializers.zeros, ("exp", "activation_mlp")
            w["wi_0_bias"] = weight_param(self, "wi_0_bias", (experts, width), bias_axes, cfg, zeros)
            w["wi_1_bias"] = weight_param(self, "wi_1_bias", (experts, width), bias_axes, cfg, zeros)
            w["wo_bias"] = weight_param(self, "wo_bias", (experts, embed), ("exp", "activation_embed"), cfg, zeros)
        w = {name: value.astype(dtype) for name, value in w.items()}
        choose = functools.partial(routing_weights, cfg)
        if cfg.sparse_matmul:
            return sorted_dispatch(experts, cfg.num_experts_per_tok, dtype, choose, functools.partial(gated_unit, cfg),
                                   x.astype(dtype), logits, router, w)
        return dense_experts(cfg, x.astype(dtype), logits, router, w)


def routing_weights(cfg: ModelConfig, logits: jax.Array, router: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(weights, expert indices) of each token, the per-expert scale (Gemma 4) applied."""
    weights, indices = route(cfg, logits, router.get("bias"))
    if "scale" in router:
        weights = weights * jnp.take(router["scale"].astype(jnp.float32), indices)
    return weights, indices


def dense_experts(cfg: ModelConfig, x: jax.Array, logits: jax.Array, router: dict[str, jax.Array],
                  w: dict[str, jax.Array]) -> jax.Array:
    """MaxText's `dense_matmul` without a capacity (`sparse_matmul: false`, `capacity_factor` <= 0):
    every expert runs on every token, and each token's expert outputs (batch, length, experts, embed)
    are summed with its routing weights, zero outside its chosen experts, in float32."""
    dtype = x.dtype
    weights, indices = routing_weights(cfg, logits, router)
    combine = jnp.einsum("bske,bsk->bse", jax.nn.one_hot(indices, cfg.num_experts, dtype=jnp.float32), weights)
    x = constrain(x, DENSE_INPUT_AXES, "inputs")
    gate = jnp.einsum("bsd,edm->bsem", x, w["wi_0"])
    up = jnp.einsum("bsd,edm->bsem", x, w["wi_1"])
    if cfg.mlp_bias:
        gate, up = gate + w["wi_0_bias"], up + w["wi_1_bias"]
    out = jnp.einsum("bsem,emd->bsed", gated_unit(cfg, gate, up).astype(dtype), w["wo"])
    if cfg.mlp_bias:
        out = out + w["wo_bias"]
    return jnp.einsum("bsed,bse->bsd", out.astype(jnp.float32), combine).astype(dtype)


class RoutedAndSharedExperts(nn.Module):
    """Routed experts plus always-on shared experts (DeepSeek, Llama 4): MaxText's RoutedAndSharedMoE."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        out = RoutedExperts(cfg, gate_embed_axis=cfg.router_embed_axis, name="MoeBlock_0")(x)
        if cfg.shared_experts:
            out = out + MlpBlock(cfg, cfg.shared_experts * cfg.moe_mlp_dim, name="shared_experts")(x)
        return out
