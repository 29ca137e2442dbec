"""Llama 4 text decoder (Scout 17B-16E, Maverick 17B-128E): blocks of
`inhomogeneous_layer_cycle_interval` (4) layers, scanned. Within a block, layer k is MoE when
(k + 1) is a multiple of `interleave_moe_layer_step` (every layer for Scout, every second for
Maverick; the others have a dense MLP), and uses no position embedding (NoPE) when (k + 1) is a
multiple of `nope_layer_interval`; the other layers apply RoPE then, with `use_qk_norm`, a
parameter-free L2 norm to queries and keys. An MoE layer is routed experts plus shared experts,
under `Llama4MoEBlock_0` as MaxText names it.

Parameter tree (k = 0..3 within a block, layer axis `layers` at position 1)::

    token_embedder/embedding                                               (vocab, embed_vocab)
    decoder/layers/layers_<k>/{pre,post}_self_attention_layer_norm/scale   (norm, layers)
    decoder/layers/layers_<k>/self_attention/{query,key,value,out}/kernel  as the dense decoder
    decoder/layers/layers_<k>/Llama4MoEBlock_0/MoeBlock_0/gate/kernel      (embed_moe, layers, None)   [MoE layer]
    decoder/layers/layers_<k>/Llama4MoEBlock_0/MoeBlock_0/{wi_0,wi_1,wo}   routed experts (models/moe.py)
    decoder/layers/layers_<k>/Llama4MoEBlock_0/shared_experts/{wi_0,wi_1,wo}/kernel   like mlp
    decoder/layers/layers_<k>/mlp/{wi_0,wi_1,wo}/kernel                    (embed, layers, mlp) ...   [dense layer]
    decoder/decoder_norm/scale, decoder/logits_dense/kernel
"""

from __future__ import annotations

import flax.linen as nn
import jax

from sharding_dump.core.capture import constrain
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM, LayerCycle
from sharding_dump.models.dense import Attention, MlpBlock
from sharding_dump.models.layers import BLE, RMSNorm
from sharding_dump.models.moe import RoutedAndSharedExperts


def every(step: int, index: int) -> bool:
    """True for the layers (index + 1) = step, 2 step, ... (never when step is 0)."""
    return step > 0 and (index + 1) % step == 0


class Llama4DecoderLayer(nn.Module):
    """Pre-norm residual block: attention (RoPE or NoPE), then shared + routed experts or a dense MLP."""

    cfg: ModelConfig
    nope: bool = False
    moe: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = constrain(x, BLE, "layer_input")
        h = constrain(RMSNorm(cfg, name="pre_self_attention_layer_norm")(x), BLE, "pre_attention_norm")
        attention = Attention(cfg, qk_norm=False, use_rope=not self.nope, qk_l2_norm=cfg.use_qk_norm,
                              name="self_attention")
        x = x + constrain(attention(h, positions), BLE, "attention_result")
        h = constrain(RMSNorm(cfg, name="post_self_attention_layer_norm")(x), BLE, "post_attention_norm")
        if self.moe:
            h = RoutedAndSharedExperts(cfg, name="Llama4MoEBlock_0")(h)
        else:
            h = MlpBlock(cfg, cfg.mlp_dim, name="mlp")(h)
        return constrain(x + constrain(h, BLE, "mlp_output"), BLE, "layer_output")


class Llama4Block(LayerCycle):
    """One scanned unit: `inhomogeneous_layer_cycle_interval` layers, MoE and NoPE as the card's steps say."""

    layer = Llama4DecoderLayer

    def options(self, index: int) -> dict[str, bool]:
        return {"nope": every(self.cfg.nope_layer_interval, index), "moe": every(self.cfg.interleave_moe_layer_step, index)}


class Llama4DecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "llama4"
    card_fields = (
        "head_dim", "mlp_activations", "logits_via_embedding", "rope_max_timescale", "use_qk_norm",
        "inhomogeneous_layer_cycle_interval", "nope_layer_interval", "interleave_moe_layer_step", "num_experts",
        "num_experts_per_tok", "moe_mlp_dim", "shared_experts", "routed_score_func")
    required_fields = ("num_experts", "num_experts_per_tok", "moe_mlp_dim", "interleave_moe_layer_step")

    layer = Llama4Block
