"""Gemma 3 text decoder (4B, 12B, 27B): five sliding-window layers then one global layer, repeated.
MaxText scans blocks of those six layers (`layers`, layer axis at position 1) and runs the layers
left over (34 = 5 x 6 + 4 for the 4B) as one unscanned block, `layers_remainder`. Each layer is
Gemma 2's sandwich (norms before and after attention and MLP) with query and key RMS norms always
on; local layers rotate with `local_rope_max_timescale`, global ones with `rope_max_timescale` and
positions divided by `rope_linear_scaling_factor`. Output through the tied embedding.

Parameter tree (k = 0..5 within a block)::

    token_embedder/embedding                                         (vocab, embed_vocab)
    decoder/layers/layers_<k>/{pre,post}_self_attention_norm/scale   (norm, layers)
    decoder/layers/layers_<k>/self_attention/{query,key,value,out}/kernel  as the dense decoder
    decoder/layers/layers_<k>/self_attention/{query,key}_norm/scale  (norm, layers)
    decoder/layers/layers_<k>/{pre,post}_ffw_norm/scale              (norm, layers)
    decoder/layers/layers_<k>/mlp/{wi_0,wi_1,wo}/kernel              as the dense decoder
    decoder/layers_remainder/layers_<k>/...                          the same without the layer axis
    decoder/decoder_norm/scale                                       (norm)

Pipelined, MaxText stacks single layers instead (`num_decoder_layers` of them, each sliding-window,
its layer's default), so the stages hold `decoder/layers/stages/{self_attention,mlp,...}`.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from sharding_dump.core.capture import constrain
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.decoder import DecoderLM, Stack
from sharding_dump.models.gemma2 import sandwich_block
from sharding_dump.models.layers import BLE

PATTERN = 6  # layers per scanned block: the last one global, the others sliding-window


class Gemma3DecoderLayer(nn.Module):
    """One layer: sliding-window attention, or global for the last layer of a pattern."""

    cfg: ModelConfig
    sliding_window: int = 0

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = constrain(x, BLE, "layer_input")
        return sandwich_block(self.cfg, x, positions, sliding_window=self.sliding_window, qk_norm=True)


class Gemma3PipelineLayer(Gemma3DecoderLayer):
    """The unit MaxText pipelines: one layer, sliding-window (its layer's default attention type)."""

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        x = constrain(x, BLE, "layer_input")
        return sandwich_block(self.cfg, x, positions, sliding_window=self.cfg.sliding_window_size, qk_norm=True), None


class Gemma3Block(nn.Module):
    """`num_layers` consecutive layers of the pattern, named layers_0 ..."""

    cfg: ModelConfig
    num_layers: int = PATTERN

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        for index in range(self.num_layers):
            window = self.cfg.sliding_window_size if index % PATTERN != PATTERN - 1 else 0
            x = Gemma3DecoderLayer(self.cfg, window, name=f"layers_{index}")(x, positions)
        return x, None


class Gemma3DecoderLM(DecoderLM):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    decoder_block = "gemma3"
    card_fields = (
        "head_dim", "mlp_activations", "logits_via_embedding", "rope_max_timescale", "sliding_window_size",
        "use_post_attn_norm", "use_post_ffw_norm", "attn_logits_soft_cap", "final_logits_soft_cap",
        "local_rope_max_timescale", "rope_linear_scaling_factor")

    @classmethod
    def stacks(cls, cfg: ModelConfig) -> tuple[Stack, ...]:
        full, rest = divmod(cfg.num_decoder_layers, PATTERN)
        stacks = (Stack(Gemma3Block, full, "layers", pipelined=True, unit_layers=PATTERN),) if full else ()
        if rest:
            stacks += (Stack(Gemma3Block, 1, "layers_remainder", scanned=False, options=(("num_layers", rest),),
                             unit_layers=rest),)
        return stacks

    @classmethod
    def pipeline_stacks(cls, cfg: ModelConfig) -> tuple[Stack, ...]:
        """MaxText pipelines Gemma 3 one layer at a time (every one sliding-window), with no remainder."""
        return (Stack(Gemma3PipelineLayer, cfg.num_decoder_layers, "layers", pipelined=True),)
