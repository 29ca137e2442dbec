"""Mixtral: the Llama decoder with every MLP replaced by routed experts (8 experts, 2 per token,
softmax over the chosen router logits, no shared expert).

Parameter tree, as MaxText's Mixtral layer names it (layer axis `layers` at position 1)::

    token_embedder/embedding                                   (vocab, embed_vocab)
    decoder/layers/{pre,post}_self_attention_layer_norm/scale  (norm, layers)
    decoder/layers/self_attention/{query,key,value,out}/kernel as the dense decoder (models/dense.py)
    decoder/layers/MoeBlock_0/gate/kernel                      (embed, layers, None)
    decoder/layers/MoeBlock_0/{wi_0,wi_1}                      (exp, layers, embed_moe, mlp_moe)
    decoder/layers/MoeBlock_0/wo                               (exp, layers, mlp_moe, embed_moe)
    decoder/decoder_norm/scale, decoder/logits_dense/kernel    [untied embeddings]

Qwen3-MoE (models/qwen3_moe.py) is the same layer with q/k norms and the experts under `moe_block`.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax

from sharding_dump.core.capture import constrain
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM
from sharding_dump.models.dense import Attention
from sharding_dump.models.layers import BLE, RMSNorm
from sharding_dump.models.moe import RoutedExperts


class MixtralDecoderLayer(nn.Module):
    """Pre-norm residual block: grouped-query attention, then routed experts."""

    cfg: ModelConfig
    experts_name: ClassVar[str] = "MoeBlock_0"

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        x = constrain(x, BLE, "layer_input")
        h = constrain(RMSNorm(cfg, name="pre_self_attention_layer_norm")(x), BLE, "pre_attention_norm")
        h = constrain(Attention(cfg, name="self_attention")(h, positions), BLE, "attention_result")
        x = x + h
        h = constrain(RMSNorm(cfg, name="post_self_attention_layer_norm")(x), BLE, "post_attention_norm")
        h = constrain(RoutedExperts(cfg, name=self.experts_name)(h), BLE, "mlp_output")
        return constrain(x + h, BLE, "layer_output"), None


class MixtralDecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "mixtral"
    card_fields = (
        "head_dim", "mlp_activations", "logits_via_embedding", "rope_max_timescale", "num_experts",
        "num_experts_per_tok", "moe_mlp_dim")
    required_fields = ("num_experts", "num_experts_per_tok", "moe_mlp_dim")
    equal_fields = (("moe_mlp_dim", "mlp_dim"),)

    layer = MixtralDecoderLayer
