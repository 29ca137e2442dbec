"""Pipeline parallelism over the `stage` mesh axis, for any decoder's layer stack, laid out as MaxText
lays it out.

With `ici_pipeline_parallelism` x `dcn_pipeline_parallelism` = N > 1 stages, the first
`pipeline_parallel_layers` = P layers (all by default; DeepSeek: all MoE layers) are cut into N
stages of `num_layers_per_pipeline_stage` = K layers (default 1), repeated
`num_pipeline_repeats` = R times round the ring (circular pipelining; default -1: R = P / (N K)).
MaxText's consistency rule holds: N x R x K = P. The batch is cut into `num_pipeline_microbatches` = M
microbatches that move through the stages one iteration at a time. Layers left out of the pipeline
run as a plain scan with `stage` acting as one more data axis for their activations: after the
pipeline (logical layer axis `layers_outside_pipeline`), or, for DeepSeek, before it together with
the dense layers (layer axis `moe_layers`). MaxText's NNX builds name them otherwise (`ModelConfig.outside_pipeline`:
DeepSeek's `moe_layers_outside_pipeline`; e591f30's keeps the layer axis `layers` after the pipeline).

Weights (what the goldens see), at MaxText's paths: the pipeline is `decoder/pipeline_module`, its
stacked stage `layers`; a stage's weights get the stage at axis 0, named `layers` (mapped to `stage`
by the rules), and the repeat before it, named `circular_repeats` (when R > 1). A stage of one layer
has no further layer axis; a stage of K > 1 layers holds `layers_0` .. `layers_<K-1>` (or, with
`scan_layers_per_stage=true`, one scan `scanned_layers` whose layer axis `layers_per_stage` sits at
position 1)::

    K = 1:        decoder/pipeline_module/layers/mlp/wi_0/kernel                [R,] N, embed, mlp
    K > 1:        decoder/pipeline_module/layers/layers_<k>/mlp/wi_0/kernel     [R,] N, embed, mlp
    K > 1, scan:  decoder/pipeline_module/layers/scanned_layers/mlp/wi_0/kernel [R,] N, embed, K, mlp

The layers left out are `decoder/layers_outside_pipeline` (DeepSeek: `decoder/moe_layers`), or as
`cfg.outside_pipeline` names them.

P and K count the units of the pipelined stack as MaxText does, whatever a unit holds, and P
defaults to the card's `num_decoder_layers` (less the layers of the other stacks): where the unit
is a scanned block of k layers (gpt-oss 2, olmo3, llama4, qwen3-next 4, gemma4 6), the pipelined run
builds k times the model's layers, as MaxText's does (`DecoderLM.pipeline_stacks`; `check` reports
it). Gemma 3 pipelines single layers.

Step (what the traced jaxpr holds), per iteration t of M R + N - 1:

* stage 0 reads microbatch t from `state_io` [N, M/N, ...] (or, on a later repeat, from the circular
  storage [N, M, ...], or straight from the shift when M = N); stage s > 0 reads the shift;
* every stage runs its layers at once (vmap over the stage axis, `spmd_axis_name="stage"`), with the
  weights of the repeat it is on (and, given segment ids, those of the microbatch it is on);
* the outputs move one stage on: a `jax.lax.ppermute` ring shift inside `jax.shard_map` over `stage`;
  `state_io` moves one stage back the same way, the last stage's output entering at the end.

All stage buffers are constrained with `activation_stage` at axis 0. As in MaxText, a pipelined run
puts `stage` first in the `activation_embed_and_logits_batch` rule (`zoo.pipeline_plan.pipeline_rules`, which
also plans the schedule from the settings).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sharding_dump.core.capture import constrain, module_prefix
from sharding_dump.core.specs import entry_axes
from sharding_dump.models.attention import current_segment_ids, segment_ids
from sharding_dump.models.config import ModelConfig
from sharding_dump.models.layers import NNX_STACK, scan_layers

STAGE_AXIS = "stage"  # the mesh axis
STAGE_LOGICAL = "layers"  # the logical name of a weight's stage dimension
REPEAT_LOGICAL = "circular_repeats"
LAYERS_PER_STAGE_LOGICAL = "layers_per_stage"
OUTSIDE_LOGICAL = "layers_outside_pipeline"  # name and layer axis of the layers left out (no rule: unsharded)
PIPELINE_NAME, STAGES_NAME = "pipeline_module", "layers"  # MaxText's module names: decoder/pipeline_module/layers
Rules = tuple[tuple[str, Any], ...]  # logical axis rules, as flax holds them
STAGE_BUFFER_AXES = ("activation_stage", "activation_batch", "activation_length", "activation_embed")
@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A validated pipeline schedule (the zoo builds it: `zoo.pipeline_plan.plan_pipeline`)."""

    num_stages: int
    num_microbatches: int
    num_repeats: int
    num_layers: int  # layers inside the pipeline
    layers_per_stage: int = 1
    scan_layers_per_stage: bool = False

    @property
    def microbatches_per_stage(self) -> int:
        return self.num_microbatches // self.num_stages

    @property
    def num_iterations(self) -> int:
        """Until the last microbatch of the last repeat has left the last stage."""
        return self.num_microbatches * self.num_repeats + self.num_stages - 1

    @property
    def uses_circular_storage(self) -> bool:
        """With more microbatches than stages, a microbatch waits between repeats in a buffer."""
        return self.num_repeats > 1 and self.num_microbatches > self.num_stages


def stage_as_data(rules: Rules) -> Rules:
    """Rules for layers outside the pipeline: `stage` is dropped everywhere and inserted just before
    `data` wherever `data` appears, so those layers split their batch over the stages too."""
    out = []
    for name, axes in rules:
        axes = tuple(a for a in entry_axes(axes) if a != STAGE_AXIS)
        if "data" in axes:
            at = axes.index("data")
            axes = axes[:at] + (STAGE_AXIS,) + axes[at:]
        out.append((name, axes))
    return tuple(out)


class SequentialLayers(nn.Module):
    """`count` copies of `layer` applied one after another, named `layers_<i>`: a stage of several
    layers that is not scanned. Subclassed per (layer, count) by :func:`_stage_module`."""

    cfg: ModelConfig
    layer: ClassVar[type[nn.Module]]
    count: ClassVar[int]

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        for index in range(self.count):
            x, _ = self.layer(self.cfg, name=f"layers_{index}")(x, positions)
        return x, None


@functools.cache
def _sequential(layer: type[nn.Module], count: int) -> type[nn.Module]:
    return type(f"Sequential{layer.__name__}", (SequentialLayers,), {"layer": layer, "count": count})


class ScannedLayers(nn.Module):
    """`count` copies of `layer` scanned as `scanned_layers` (MaxText's name for a stage's scan):
    a stage of several scanned layers. Subclassed per (layer, count) by :func:`_stage_module`."""

    cfg: ModelConfig
    layer: ClassVar[type[nn.Module]]
    count: ClassVar[int]

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        scanned = scan_layers(self.layer, self.count, LAYERS_PER_STAGE_LOGICAL, nnx_stack=True)
        return scanned(self.cfg, name="scanned_layers")(x, positions)


@functools.cache
def _scanned(layer: type[nn.Module], count: int) -> type[nn.Module]:
    return type(f"Scanned{layer.__name__}", (ScannedLayers,), {"layer": layer, "count": count})


def _stage_module(layer: type[nn.Module], pp: PipelineConfig) -> type[nn.Module]:
    """The layers of one stage as a module class: the layer itself, `layers_<i>`, or a scan of them."""
    if pp.layers_per_stage == 1:
        return layer
    if pp.scan_layers_per_stage:
        return _scanned(layer, pp.layers_per_stage)
    return _sequential(layer, pp.layers_per_stage)


def _stacked_stages(layer: type[nn.Module], pp: PipelineConfig) -> type[nn.Module]:
    """The weight holder: a stage's layers, vmapped over stages (and repeats). MaxText stacks them
    with `nnx.vmap`, which names no dimension of a weight declared with no logical axes."""
    stacked = nn.vmap(_stage_module(layer, pp), variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(0, 0), metadata_params={nn.PARTITION_NAME: STAGE_LOGICAL, NNX_STACK: True})
    if pp.num_repeats > 1:
        stacked = nn.vmap(stacked, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=(0, 0),
                          metadata_params={nn.PARTITION_NAME: REPEAT_LOGICAL, NNX_STACK: True})
    return stacked


def _ring_shift(x: jax.Array, offset: int, num_stages: int) -> jax.Array:
    """Moves block s of `x` (axis 0, one block per stage) to stage (s + offset) mod N: a ppermute
    over the `stage` axis inside shard_map, every other mesh axis left to the partitioner."""
    perm = [(s, (s + offset) % num_stages) for s in range(num_stages)]
    return jax.shard_map(functools.partial(jax.lax.ppermute, axis_name=STAGE_AXIS, perm=perm),
                         in_specs=PartitionSpec(STAGE_AXIS), out_specs=PartitionSpec(STAGE_AXIS),
                         axis_names={STAGE_AXIS})(x)


ITERATION_INPUT = "iteration_input"  # the checkpoint name MaxText saves of each pipeline iteration


def _stage_ids(num_stages: int, ndim: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (num_stages,) + (1,) * (ndim - 1), 0)


def _select_repeat(weights: Any, repeat_ids: jax.Array) -> Any:
    """[R, N, ...] weights -> [N, ...]: stage s takes the weights of repeat `repeat_ids[s]`."""
    pick = jax.vmap(lambda w, r: jax.lax.dynamic_index_in_dim(w, r, 0, keepdims=False),
                    in_axes=(1, 0), spmd_axis_name=STAGE_AXIS)
    return jax.tree.map(lambda w: pick(w, repeat_ids), weights)


def run_pipeline(pp: PipelineConfig, stage_fn: Callable[[Any, jax.Array, jax.Array], jax.Array], weights: Any,
                 x: jax.Array, positions: jax.Array) -> jax.Array:
    """Runs `stage_fn(stage weights, inputs, positions)` over the pipeline schedule; x: [batch, length, embed]."""
    n, m, k, r = pp.num_stages, pp.num_microbatches, pp.microbatches_per_stage, pp.num_repeats
    micro_shape = (x.shape[0] // m,) + x.shape[1:]
    state_io = constrain(x.reshape((n, k) + micro_shape), (STAGE_BUFFER_AXES[0], None) + STAGE_BUFFER_AXES[1:],
                         "pipeline_state_io")
    micro_positions = positions.reshape((m, micro_shape[0]) + positions.shape[1:])
    segments = current_segment_ids()  # each stage's attentions take those of the microbatch it is on
    micro_segments = None if segments is None else segments.reshape((m, micro_shape[0]) + segments.shape[1:])
    shift = constrain(jnp.zeros((n,) + micro_shape, x.dtype), STAGE_BUFFER_AXES, "pipeline_shift")
    circ = None
    if pp.uses_circular_storage:
        circ = constrain(jnp.zeros((n, m) + micro_shape, x.dtype), (STAGE_BUFFER_AXES[0], None) + STAGE_BUFFER_AXES[1:],
                         "pipeline_circular_storage")
    stage_ids = _stage_ids(n, shift.ndim)

    def stage_with_segments(stage_weights: Any, inputs: jax.Array, stage_positions: jax.Array,
                            stage_segments: jax.Array | None) -> jax.Array:
        with segment_ids(stage_segments):
            return stage_fn(stage_weights, inputs, stage_positions)

    stage_run = jax.vmap(stage_with_segments, spmd_axis_name=STAGE_AXIS)

    def iteration(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
        state_io, shift, circ = carry
        column = jax.lax.dynamic_index_in_dim(state_io, t % k, axis=1, keepdims=False)
        first = column
        if circ is not None:
            # shift[0] holds the last stage's output of microbatch (t - N) mod M: park it until its next repeat.
            circ = jax.lax.dynamic_update_index_in_dim(circ, shift, (t - n) % m, axis=1)
            circ = constrain(circ, (STAGE_BUFFER_AXES[0], None) + STAGE_BUFFER_AXES[1:], "pipeline_circular_storage")
            first = jnp.where(t < m, column, jax.lax.dynamic_index_in_dim(circ, t % m, axis=1, keepdims=False))
        elif r > 1:
            first = jnp.where(t < m, column, shift)
        inputs = constrain(jnp.where(stage_ids == 0, first, shift), STAGE_BUFFER_AXES, "pipeline_stage_inputs")
        inputs = jax.ad_checkpoint.checkpoint_name(inputs, ITERATION_INPUT)
        ages = t - jnp.arange(n)  # microbatch-steps each stage is into the schedule
        stage_positions = jnp.take(micro_positions, ages % m, axis=0)
        stage_segments = None if micro_segments is None else jnp.take(micro_segments, ages % m, axis=0)
        stage_weights = weights if r == 1 else _select_repeat(weights, jnp.clip(ages // m, 0, r - 1))
        outputs = constrain(stage_run(stage_weights, inputs, stage_positions, stage_segments), STAGE_BUFFER_AXES,
                            "pipeline_stage_outputs")
        shift = constrain(_ring_shift(outputs, 1, n), STAGE_BUFFER_AXES, "pipeline_shift")
        column = jnp.where(stage_ids == n - 1, outputs, _ring_shift(column, -1, n))
        state_io = jax.lax.dynamic_update_index_in_dim(state_io, column, t % k, axis=1)
        state_io = constrain(state_io, (STAGE_BUFFER_AXES[0], None) + STAGE_BUFFER_AXES[1:], "pipeline_state_io")
        return (state_io, shift, circ), None

    # As MaxText (set_remat_policy_on_pipeline_iterations): each iteration is rematerialised in the
    # backward pass, keeping only the stages' inputs, so no iteration's activations outlive it.
    body = jax.checkpoint(iteration, policy=jax.checkpoint_policies.save_only_these_names(ITERATION_INPUT),
                          prevent_cse=False)
    (state_io, _, _), _ = jax.lax.scan(body, (state_io, shift, circ), jnp.arange(pp.num_iterations))
    # Microbatch a*K + b left the last stage into column (b + N - 1) mod K and was shifted back to stage a.
    return jnp.roll(state_io, -(n - 1), axis=1).reshape(x.shape)


class Pipeline(nn.Module):
    """`layer` stacked into the stages of `schedule`; (x, positions) -> x."""

    cfg: ModelConfig
    schedule: PipelineConfig
    layer: type[nn.Module]

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        pp = self.schedule
        lead = (pp.num_repeats, pp.num_stages) if pp.num_repeats > 1 else (pp.num_stages,)
        if self.is_initializing():
            # Creates the stacked weights; the schedule itself only runs in apply.
            stages = _stacked_stages(self.layer, pp)(self.cfg, name=STAGES_NAME)
            stages(jnp.broadcast_to(x, lead + x.shape), jnp.broadcast_to(positions, lead + positions.shape))
            return x
        # Reading a boxed weight applies its logical constraint, as flax does for self.param.
        weights = nn.meta.unbox(self.variables["params"][STAGES_NAME])
        stage_stack = _stage_module(self.layer, pp)(self.cfg)
        stage_path = tuple(self.path) + (STAGES_NAME,)

        def stage_fn(stage_weights: Any, inputs: jax.Array, stage_positions: jax.Array) -> jax.Array:
            # The stage stack runs detached from this module: keep its activations under our path.
            with module_prefix(stage_path):
                return stage_stack.apply({"params": stage_weights}, inputs, stage_positions)[0]

        return run_pipeline(pp, stage_fn, weights, x, positions)


def apply_layer_stack(cfg: ModelConfig, schedule: PipelineConfig | None, layer: type[nn.Module], num_layers: int,
                      x: jax.Array, positions: jax.Array, name: str = "layers", axis: str | None = None,
                      outside_first: bool = False) -> jax.Array:
    """`num_layers` copies of `layer` over x, scanned, or pipelined by `schedule`.

    Call it from a parent's compact `__call__`: the stack is created in the parent's scope as `name`,
    or, pipelined, as MaxText names it: `pipeline_module`, with the layers the pipeline leaves out as
    `layers_outside_pipeline` (or `name` when `outside_first`), unless `cfg.outside_pipeline` names the
    module and layer axis of stack `name`'s left-out layers. Scanned weights carry the logical name
    `axis` (default `name`) on their layer dimension (e.g. `moe_layers` for DeepSeek's MoE stack), as
    MaxText names a scanned stack's axis; pipelined ones carry `layers` (on `stage`). The layers a
    pipeline leaves out run under :func:`stage_as_data` rules, after the pipeline with layer axis
    `layers_outside_pipeline`, or before it with layer axis `axis` when `outside_first` (DeepSeek, as
    MaxText orders them)."""
    axis = axis or name
    if schedule is None:
        x, _ = scan_layers(layer, num_layers, axis)(cfg, name=name)(x, positions)
        return x
    rest = num_layers - schedule.num_layers

    def outside(x: jax.Array, stack_name: str, axis: str) -> jax.Array:
        with nn.logical_axis_rules(stage_as_data(nn.get_logical_axis_rules())):
            x, _ = scan_layers(layer, rest, axis)(cfg, name=stack_name)(x, positions)
        return x

    left_out = {stack: (module, layer_axis) for stack, module, layer_axis in cfg.outside_pipeline}
    if rest and outside_first:
        x = outside(x, *left_out.get(name, (name, axis)))
    x = Pipeline(cfg, schedule, layer, name=PIPELINE_NAME)(x, positions)
    if rest and not outside_first:
        x = outside(x, *left_out.get(name, (OUTSIDE_LOGICAL, OUTSIDE_LOGICAL)))
    return x
