"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention with RMS-normed queries and keys, every MLP
replaced by routed experts (128 experts, 8 per token, top-k probabilities renormalised).

Parameters as MaxText's Qwen3-MoE layer names them: the Mixtral tree (models/mixtral.py) with
`self_attention/{query,key}_norm/scale` (norm, layers) and the experts under `moe_block`::

    decoder/layers/moe_block/gate/kernel       (embed, layers, None)
    decoder/layers/moe_block/{wi_0,wi_1}, wo   (exp, layers, embed_moe, mlp_moe), (exp, layers, mlp_moe, embed_moe)

Renormalising the softmax over the chosen experts (Qwen3's `norm_topk_prob`) equals a softmax over
the chosen logits, which is what `routed_score_func: none` computes.
"""

from __future__ import annotations

from typing import ClassVar

from sharding_dump.models.mixtral import MixtralDecoderLayer, MixtralDecoderLM


class Qwen3MoeDecoderLayer(MixtralDecoderLayer):
    """Attention (q/k norms as the card says) and routed experts named `moe_block`."""

    experts_name: ClassVar[str] = "moe_block"


class Qwen3MoeDecoderLM(MixtralDecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "qwen3_moe"
    card_fields = MixtralDecoderLM.card_fields + ("use_qk_norm",)

    layer = Qwen3MoeDecoderLayer
