"""The one decoder every family builds: token embedding, the family's layer stacks, final norm and
output logits. A family is its layer (the unit a stack repeats) and, when it has more than one
stack, the list of them (:meth:`DecoderLM.stacks`).

>>> from sharding_dump.zoo.cards import load_config
>>> from sharding_dump.models.deepseek import DeepSeekDecoderLM
>>> [(s.name, s.length, s.pipelined) for s in DeepSeekDecoderLM.stacks(load_config("deepseek2-16b"))]
[('dense_layers', 1, False), ('moe_layers', 26, True)]
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax

from sharding_dump.core.capture import constrain
from sharding_dump.models import attention
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.layers import BLE, Embed, RMSNorm, output_logits
from sharding_dump.models.pipeline import PipelineConfig, apply_layer_stack, stage_as_data


@dataclasses.dataclass(frozen=True)
class Stack:
    """`length` copies of `layer` ((x, positions) -> (x, None)), stacked by nn.scan as `name`, which
    also names their layer axis (MaxText's `layers`, `dense_layers`, `moe_layers`).

    `pipelined`: the stack a pipeline cuts into stages (at most one per decoder; the others then run
    with `stage` as one more data axis). `outside_first`: the layers a pipeline leaves out run before
    it (DeepSeek) rather than after. `scanned=False`: one module applied once (a remainder block that
    does not fill a scanned unit), built with `options` as keyword arguments."""

    layer: type[nn.Module]
    length: int
    name: str = "layers"
    axis: str | None = None  # the logical name of the layer axis, when not `name` (Gemma 4's scanned_blocks)
    pipelined: bool = False
    outside_first: bool = False
    scanned: bool = True
    options: tuple[tuple[str, Any], ...] = ()
    unit_layers: int = 1  # the model's layers in one copy of `layer` (a scanned block holds several)

    @property
    def model_layers(self) -> int:
        """The decoder layers the stack holds, as the card counts them."""
        return self.length * self.unit_layers


class LayerCycle(nn.Module):
    """One scanned unit of `inhomogeneous_layer_cycle_interval` layers, named layers_0 ... as MaxText's
    scannable blocks name them; layer k is `layer(cfg, **options(k))`, (x, positions) -> x."""

    cfg: ModelConfig
    layer: ClassVar[type[nn.Module]]
    prefix: ClassVar[str] = "layers_"  # MaxText's Qwen3-Next names them layer_0 ...

    def options(self, index: int) -> dict[str, Any]:
        """Keyword arguments of layer `index` (which kind of attention or MLP it has)."""
        return {}

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        for index in range(self.cfg.inhomogeneous_layer_cycle_interval):
            x = self.layer(self.cfg, name=f"{self.prefix}{index}", **self.options(index))(x, positions)
        return x, None


class Decoder(nn.Module):
    """The stacks in order, the final norm and the output projection (through `shared_embedding`
    when the card ties them)."""

    cfg: ModelConfig
    stacks: tuple[Stack, ...]
    pipeline: PipelineConfig | None = None
    shared_embedding: Embed | None = None
    norm: type[nn.Module] = RMSNorm  # the final norm's module, built with cfg

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        if self.cfg.trainable_position_size > 0:  # learned absolute positions (MaxText's GPT-3)
            table = Embed(self.cfg, self.cfg.trainable_position_size, name="position_embedder")
            x = x + table(positions)
        for stack in self.stacks:
            if not stack.scanned:
                x, _ = stack.layer(self.cfg, name=stack.name, **dict(stack.options))(x, positions)
            elif stack.pipelined or self.pipeline is None:
                x = apply_layer_stack(self.cfg, self.pipeline if stack.pipelined else None, stack.layer, stack.length,
                                      x, positions, name=stack.name, axis=stack.axis, outside_first=stack.outside_first)
            else:
                # As in MaxText, a stack the pipeline does not cut splits its batch over `stage` like data.
                with nn.logical_axis_rules(stage_as_data(nn.get_logical_axis_rules())):
                    x = apply_layer_stack(self.cfg, None, stack.layer, stack.length, x, positions, name=stack.name,
                                          axis=stack.axis)
        return output_logits(self.cfg, x, self.shared_embedding, self.norm)


class DecoderLM(nn.Module):
    """Token ids (batch, length) -> logits (batch, length, vocab). A family sets `layer`, the unit of
    its one stack (`inhomogeneous_layer_cycle_interval` layers), or overrides :meth:`stacks`.

    A subclass in a module of this package that sets `decoder_block` is that block: cards naming it
    build it, and may set the common card fields (data/blocks.yml) and its `card_fields` (any other
    field away from its default is refused); a card of it must set `required_fields`, and the pairs
    of `equal_fields` must hold one value (the block builds both from it)."""

    cfg: ModelConfig
    pipeline: PipelineConfig | None = None
    layer: ClassVar[type[nn.Module]]
    decoder_block: ClassVar[str]
    card_fields: ClassVar[tuple[str, ...]] = ()
    required_fields: ClassVar[tuple[str, ...]] = ()
    equal_fields: ClassVar[tuple[tuple[str, str], ...]] = ()
    final_norm: ClassVar[type[nn.Module]] = RMSNorm

    @classmethod
    def stacks(cls, cfg: ModelConfig) -> tuple[Stack, ...]:
        """The decoder's layer stacks, in order."""
        cycle = cfg.inhomogeneous_layer_cycle_interval
        return (Stack(cls.layer, cfg.num_decoder_layers // cycle, pipelined=True, unit_layers=cycle),)

    @classmethod
    def pipeline_stacks(cls, cfg: ModelConfig) -> tuple[Stack, ...]:
        """The stacks of a pipelined run, as MaxText builds them: its `pipeline_parallel_layers` (and the
        layers it leaves outside the pipeline) count the pipelined stack's unit, whatever that unit holds,
        and default to `num_decoder_layers` less the layers of the other stacks (DeepSeek: its MoE layers).
        So where the unit is a scanned block of k layers, the pipelined run builds k times the model's
        layers of that stack (gemma4-31b: 60 blocks of 6 layers, 360 layers)."""
        stacks = cls.stacks(cfg)
        others = sum(s.model_layers for s in stacks if not s.pipelined)
        return tuple(dataclasses.replace(s, length=cfg.num_decoder_layers - others) if s.pipelined else s
                     for s in stacks)

    def setup(self) -> None:
        self.token_embedder = Embed(self.cfg)
        shared = self.token_embedder if self.cfg.logits_via_embedding else None
        stacks = self.stacks(self.cfg) if self.pipeline is None else self.pipeline_stacks(self.cfg)
        self.decoder = Decoder(self.cfg, stacks, self.pipeline, shared, self.final_norm)

    def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """`segment_ids` (batch, length): every attention masks and constrains them (the config's
        `segment_ids`, MaxText's NNX build; ignored otherwise)."""
        x = constrain(self.token_embedder(tokens), BLE, "embedded_inputs")
        with attention.segment_ids(segment_ids if self.cfg.segment_ids else None):
            return self.decoder(x, positions)


def pipelined_stack(family: type, cfg: ModelConfig) -> Stack | None:
    """The stack a pipeline cuts into stages, its length in MaxText's count of its units (None: the
    family has none)."""
    stacks = getattr(family, "pipeline_stacks", None)
    found = [s for s in stacks(cfg) if s.pipelined] if stacks is not None else []
    return found[0] if found else None


def pipelined_length(family: type, cfg: ModelConfig) -> int | None:
    """Length of the stack a pipeline cuts into stages, in units (None: the family has none)."""
    stack = pipelined_stack(family, cfg)
    return None if stack is None else stack.length


def built_layers(family: type, cfg: ModelConfig, pipelined: bool) -> int:
    """The decoder layers the family builds for `cfg`, as the card counts them: the card's
    `num_decoder_layers` without a pipeline; with one, what MaxText's count of units builds."""
    stacks = family.pipeline_stacks(cfg) if pipelined else family.stacks(cfg)
    return sum(s.model_layers for s in stacks)
