"""The abstract training state (params + optimizer state + step) and the layout of every leaf.

`jax.eval_shape` runs the model's `init` and the optimizer's without allocating or compiling
anything; every optimizer leaf takes the logical axes it derives from its parameter
(:mod:`sharding_dump.core.optimizer`). Two ways to get each leaf's physical layout on the case's mesh:

* auto (:func:`tensor_layouts`): the logical axes resolved by the rules;
* explicit (:func:`typed_state_layouts`): the state traced again on an Explicit-axis mesh, the
  parameters placed by the rules, everything else left to JAX's sharding-in-types, and each leaf's
  sharding read from the traced output.

With ZeRO-1 (`shard_optimizer_over_data`), the optimizer state is also split over `data`
(:func:`over_data`), as MaxText does for every optimizer leaf.

>>> from sharding_dump.zoo import cards
>>> from sharding_dump.core.state import parameter_count
>>> state = abstract_state(cards.load_config("qwen3-0.6b"))
>>> parameter_count(state)
596049920
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump import models
from sharding_dump.core import specs
from sharding_dump.core.layout import PartitionRuleError, TensorLayout, resolve, typed_layouts
from sharding_dump.core.layout import tensor_layouts as core_tensor_layouts
from sharding_dump.core.optimizer import Slot
from sharding_dump.core.specs import entry_axes
from sharding_dump.core.state import (
    abstract_key,
    abstract_train_state,
    as_model,
    default_optimizer,
)
from sharding_dump.core.tree import is_box, path_text, unbox
from sharding_dump.errors import BadInput
from sharding_dump.models.pipeline import PipelineConfig
from sharding_dump.zoo import cards, rules
from sharding_dump.zoo.mesh import MeshPlan

INIT_SHAPE = (1, 8)  # parameter shapes do not depend on the batch used to initialise
DATA_AXIS = "data"
TENSOR_AXIS = "tensor"  # ZeRO-1 never adds data to a dimension split over it


def abstract_params(cfg: models.ModelConfig, pipeline: PipelineConfig | None = None) -> Any:
    """The boxed abstract parameters of a zoo model alone (no optimizer traced): enough to count them."""
    return as_model(cards.build_model(cfg, pipeline)).abstract_params()


def abstract_state(cfg: models.ModelConfig, tx: optax.GradientTransformation | None = None,
                   pipeline: PipelineConfig | None = None) -> dict[str, Any]:
    """The boxed abstract state {'step', 'params', 'opt_state'} of a zoo model trained with `tx`
    (default: the core's AdamW), its layers pipelined by `pipeline`, via jax.eval_shape."""
    return abstract_train_state(abstract_params(cfg, pipeline), tx or default_optimizer())


def is_optimizer_leaf(path: str) -> bool:
    """True for a leaf of the optimizer state (`opt_state/...`; NNX: `optimizer/...`): what ZeRO-1 splits
    over `data`, as MaxText adds `data` to every optimizer leaf (a scalar has no dimension to add it to)."""
    return path.startswith(("opt_state/", NNX_OPTIMIZER + "/"))


# MaxText's NNX state (common/train_state_nnx.py TrainStateNNX): the model's variables under `model` (its
# parameters by the same names as the Linen build's, beside the RNG state of the modules that keep an
# nnx.Rngs), nnx.Optimizer's `opt_state` and `step` under `optimizer`.
NNX_MODEL, NNX_OPTIMIZER, NNX_RNGS = "model", "optimizer", specs.NNX_RNGS
# The logical axes of a stacked layer dimension (the zoo's scans and pipeline stacks, sharding_dump/models),
# outermost first (a pipeline's repeats hold its stages, which hold a stage's layers; a scanned block holds
# its inner scan): a module's RNG state is stacked over the same scans, in that order.
STACK_AXES = ("circular_repeats", "layers", "dense_layers", "moe_layers", "layers_outside_pipeline", "layers_per_stage",
              "local_layers")


def _module_paths(params: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every module (nested dict) of a parameter tree by its path, root included."""
    out = {prefix: params}
    for name, sub in params.items():
        if isinstance(sub, Mapping):
            out.update(_module_paths(sub, prefix + (name,)))
    return out


def _stack_order(dim: tuple[int, str | None]) -> int:
    return STACK_AXES.index(dim[1]) if dim[1] in STACK_AXES else len(STACK_AXES)


def _stack_shape(module: Mapping[str, Any]) -> tuple[int, ...]:
    """The scan lengths a module's variables are stacked over: the sizes of the stacked-layer dimensions
    every boxed parameter of it has (a module outside any scan has parameters with none)."""
    stacks = [tuple(size for size, name in sorted(zip(leaf.value.shape, leaf.names), key=_stack_order)
                    if name in STACK_AXES) for leaf in jax.tree.leaves(module, is_leaf=is_box) if is_box(leaf) and leaf.names]
    return min(stacks, key=len, default=())


def rng_modules(params: Mapping[str, Any], patterns: Sequence[str]) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{module path: stack shape} of the modules whose MaxText NNX class keeps an nnx.Rngs: each pattern
    (data/maxtext_releases.yml, `/`-separated, `*` for one name) names modules of the parameter tree, or a
    module without parameters (a Dropout) inside one that has them, stacked as that module is. Patterns
    joined by `|` are the places one shared nnx.Rngs may be written, in NNX's order: it is written once, at
    the first of them the tree has."""
    modules = _module_paths(params)

    def matching(parts: tuple[str, ...]) -> list[tuple[str, ...]]:
        return [path for path in modules if len(path) == len(parts)
                and all(fnmatch.fnmatchcase(n, p) for n, p in zip(path, parts))]

    def holders(pattern: str) -> dict[tuple[str, ...], tuple[int, ...]]:
        parts = tuple(pattern.split("/"))
        found = {path: _stack_shape(modules[path]) for path in matching(parts)}
        if not found and "*" not in parts[-1]:
            found = {parent + parts[-1:]: _stack_shape(modules[parent]) for parent in matching(parts[:-1])}
        return found

    out = {}
    for pattern in patterns:
        found = next(filter(None, map(holders, pattern.split("|"))), {})
        out.update({path: stack for path, stack in found.items() if path not in out or path in modules})
    return dict(sorted(out.items()))


def rng_paths(state: Mapping[str, Any]) -> list[str]:
    """The path of every RNG-state leaf of an NNX state (:func:`nnx_state`)."""
    return [f"{NNX_MODEL}/{path}" for path in (path_text(k) for k, _ in
                                               jax.tree_util.tree_leaves_with_path(state[NNX_MODEL], is_leaf=is_box))
            if NNX_RNGS in path.split("/")]


def rng_state(stack: tuple[int, ...], streams: Sequence[str], impl: str) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """One module's nnx.Rngs as its state holds it: per stream a `count` (uint32) and a typed `key` of PRNG
    implementation `impl` (MaxText's: `key<urbg>` for unsafe_rbg), stacked over `stack`, never placed
    (MaxText replicates them)."""
    key = abstract_key(impl)
    return {stream: {"count": jax.ShapeDtypeStruct(stack, jnp.uint32),
                     "key": jax.ShapeDtypeStruct(stack + key.shape, key.dtype)} for stream in streams}


def _copy(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


ROUTED_BIAS = "gate/bias"  # a router's per-expert bias (sharding_dump/models/moe.py Router)


def routed_biases(params: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The path of every router's bias in a parameter tree."""
    *parent, leaf = ROUTED_BIAS.split("/")
    return [path + (leaf,) for path, module in _module_paths(params).items()
            if path[-len(parent):] == tuple(parent) and leaf in module]


def model_state_bias(params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters without their routed biases, which MaxText 0.2.5 keeps as model state of DeepSeek3 and
    Kimi (moe.py MoEBiasVar: no nnx.Param, so nnx.Optimizer keeps no moments of it): the tree the
    optimizer is initialised over."""
    out = _copy(params)
    for path in routed_biases(params):
        node = out
        for name in path[:-1]:
            node = node[name]
        del node[path[-1]]
    return out


def _layer_first(box: nn.Partitioned) -> nn.Partitioned:
    """A stacked variable that is no nnx.Param, as an NNX scan stacks it: its stacked-layer dimensions first.
    A leaf traced on an Explicit mesh keeps its placement, its dimensions moved with it."""
    order = sorted(range(len(box.names)), key=lambda i: _stack_order((0, box.names[i])))
    sharding = getattr(box.value, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(box.names) - len(sharding.spec))
        sharding = sharding.update(spec=PartitionSpec(*(spec[i] for i in order)))
    value = jax.ShapeDtypeStruct(tuple(box.value.shape[i] for i in order), box.value.dtype, sharding=sharding)
    return box.replace(value=value, names=tuple(box.names[i] for i in order))


def nnx_state(state: Mapping[str, Any], rngs: Mapping[tuple[str, ...], tuple[int, ...]],
              streams: Sequence[str], key_impl: str, bias_state: bool = False, opt_state: Any = None) -> dict[str, Any]:
    """MaxText's NNX state of the zoo's boxed state {'params', 'opt_state', 'step'}: {'model': the
    parameters with the RNG state of each module of `rngs` ({path: stack shape}; streams `streams`, keys of
    PRNG implementation `key_impl`), 'optimizer':
    {'opt_state', 'step'}}. The same parameter and optimizer leaves (the optimizer's slots still name
    their parameter), so every placement is the rules' as before. `bias_state`: the routed biases are
    model state, stacked layer first, and `opt_state` the optimizer's over the other parameters
    (:func:`model_state_bias`)."""
    model = _copy(state["params"])
    if bias_state:
        for path in routed_biases(model):
            node = model
            for name in path[:-1]:
                node = node[name]
            node[path[-1]] = _layer_first(node[path[-1]])
    for path, stack in rngs.items():
        node = model
        for name in path:
            node = node.setdefault(name, {})
        node[NNX_RNGS] = rng_state(stack, streams, key_impl)
    step = state["step"]  # nnx.Optimizer's is uint32 (flax/nnx/training/optimizer.py), a Linen TrainState's int32
    return {NNX_MODEL: model, NNX_OPTIMIZER: {"opt_state": state["opt_state"] if opt_state is None else opt_state,
                                              "step": jax.ShapeDtypeStruct(step.shape, jnp.uint32,
                                                                           sharding=getattr(step, "sharding", None))}}


def nnx_path(path: str) -> str:
    """Where MaxText's NNX state (:func:`nnx_state`) holds the leaf at `path` of the Linen build's
    {'params', 'opt_state', 'step'}.

    >>> nnx_path("params/decoder/layers/mlp/wi_0/kernel"), nnx_path("opt_state/0/count"), nnx_path("step")
    ('model/decoder/layers/mlp/wi_0/kernel', 'optimizer/opt_state/0/count', 'optimizer/step')
    """
    head, _, rest = path.partition("/")
    place = {"params": NNX_MODEL, "opt_state": f"{NNX_OPTIMIZER}/opt_state", "step": f"{NNX_OPTIMIZER}/step"}
    return place.get(head, head) + (f"/{rest}" if rest else "")


def over_data(spec: PartitionSpec, shape: Sequence[int], sizes: dict[str, int]) -> PartitionSpec:
    """ZeRO-1 as MaxText adds `data` to an optimizer leaf: `data` becomes the outermost mesh axis of the
    first dimension whose shard still splits evenly over it and whose axes do not include `tensor` (even
    a size-1 `tensor`), so each data-parallel replica keeps (and updates) a slice of the moments.
    Unchanged when `data` is already used or no dimension qualifies. A leaf whose layout does not
    split evenly is refused (BadInput), as MaxText cannot shard it."""
    entries = [spec[i] if i < len(spec) else None for i in range(len(shape))]
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        shards = math.prod(sizes[a] for a in entry_axes(entry))
        if size % shards:
            raise BadInput(f"shard_optimizer_over_data=true: a dimension of size {size} (shape {tuple(shape)}) "
                           f"does not split evenly over {'x'.join(entry_axes(entry))} ({shards} shards); ZeRO-1 "
                           f"needs even splits of the optimizer state")
    if any(DATA_AXIS in entry_axes(e) for e in entries):
        return spec
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        axes = entry_axes(entry)
        shard = size // math.prod(sizes[a] for a in axes)
        if shard % sizes[DATA_AXIS] == 0 and TENSOR_AXIS not in axes:
            entries[dim] = (DATA_AXIS,) + axes
            return PartitionSpec(*entries)
    return spec


def without_size_one(spec: PartitionSpec, ndim: int, sizes: Mapping[str, int]) -> PartitionSpec:
    """`spec` without its size-1 mesh axes, as MaxText's NNX build writes every spec of its state
    (sharding.remove_size_one_mesh_axis)."""
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in specs.spec_to_json(spec, ndim, sizes)))


def state_spec(spec: PartitionSpec, shape: Sequence[int], sizes: Mapping[str, int], nnx: bool,
               over: bool) -> PartitionSpec:
    """The spec MaxText places a state leaf on, given the rules' `spec`: its NNX build first drops the size-1
    mesh axes (sharding.logical_to_mesh_axes), then ZeRO-1 (`over`, an optimizer leaf) adds `data`
    (add_data_to_sharding), so a size-1 `tensor` no longer keeps `data` off its dimension there. The same in
    either shard mode: MaxText's get_abstract_state computes the state's shardings with no shard-mode branch,
    and its dump of a ZeRO-1 case with shard_mode=explicit equals the auto one
    (tests/integration/test_maxtext_releases.py)."""
    if nnx:
        spec = without_size_one(spec, len(shape), sizes)
    if over:
        spec = over_data(spec, shape, sizes)
    return spec


def tensor_layouts(state: dict[str, Any], plan: MeshPlan, rule_set: rules.RuleSet,
                   optimizer_over_data: bool = False,
                   declared: Mapping[str, PartitionSpec] | None = None) -> list[TensorLayout]:
    """Every leaf's logical axes resolved to a NamedSharding on the plan's abstract mesh (the
    optimizer state also over `data` with `optimizer_over_data`); a leaf the program placed itself
    (`declared`, {path: spec}: a user's own init) keeps that spec. MaxText's NNX state (:func:`nnx_state`)
    has its specs without size-1 mesh axes, and ZeRO-1 adds `data` to those (add_data_to_sharding runs
    after the size-1 axes are gone, so a size-1 `tensor` no longer keeps `data` off its dimension)."""
    sizes = plan.sizes
    nnx = isinstance(state, Mapping) and NNX_OPTIMIZER in state
    if nnx:  # MaxText places its RNG state itself, replicated
        declared = {**(declared or {}), **{path: PartitionSpec() for path in rng_paths(state)}}

    def transform(path: str, shape: tuple[int, ...], spec: PartitionSpec) -> PartitionSpec:
        return state_spec(spec, shape, sizes, nnx, optimizer_over_data and is_optimizer_leaf(path))

    try:
        return core_tensor_layouts(state, plan.abstract_mesh(), rule_set,
                                   transform if nnx or optimizer_over_data else None, declared)
    except PartitionRuleError as err:  # a rule file's partition rule that does not fit the model
        raise BadInput(str(err)) from None


def explicit_state(cfg: models.ModelConfig, plan: MeshPlan, rule_set: rules.RuleSet,
                   optimizer_over_data: bool = False, tx: optax.GradientTransformation | None = None,
                   pipeline: PipelineConfig | None = None, nnx: bool = False) -> dict[str, Any]:
    """The boxed state traced on the plan's Explicit-axis abstract mesh: every leaf carries the sharding
    JAX gives it. Parameters are placed by the rules (`jax.sharding.reshard`: flax's init cannot run
    under an Explicit mesh), and so is every optimizer leaf that derives logical axes from its
    parameter, as a trainer places its state by its logical annotations (AdamW's moments already follow
    their parameter); ZeRO-1 then reshards the optimizer leaves over `data`, after the size-1 mesh axes
    are gone for MaxText's NNX build (`nnx`), as in auto mode (:func:`state_spec`)."""
    model = cards.build_model(cfg, pipeline)
    tx = tx or default_optimizer()
    template = abstract_state(cfg, tx, pipeline)["opt_state"]  # every optimizer leaf's derived axes
    mesh = plan.abstract_mesh(explicit=True)

    def place(box: nn.Partitioned | jax.Array, over: bool = False) -> nn.Partitioned | jax.Array:
        if not is_box(box):  # a parameter without logical axes (Qwen3-Next's decay) stays replicated
            return box
        spec = state_spec(resolve(box.names, rule_set), box.value.shape, plan.sizes, nnx, over)
        return box.replace_boxed(jax.sharding.reshard(box.value, NamedSharding(mesh, spec)))

    def slot(boxed: Any, leaf: Any) -> Any:
        if not isinstance(boxed, Slot):
            return leaf
        return place(boxed.replace_boxed(leaf), optimizer_over_data)

    def init(key: jax.Array) -> dict[str, Any]:
        tokens = jnp.zeros(INIT_SHAPE, jnp.int32)
        params = jax.tree.map(place, model.init(key, tokens, tokens)["params"], is_leaf=is_box)
        opt_state = jax.tree.map(slot, template, tx.init(unbox(params)), is_leaf=is_box)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state}

    key = abstract_key()
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.eval_shape(init, key)


def typed_state_layouts(traced: dict[str, Any], plan: MeshPlan) -> list[TensorLayout]:
    """Explicit mode: every leaf's PartitionSpec as read from :func:`explicit_state`'s outputs (a scalar
    JAX leaves unannotated is replicated); MaxText's NNX state (:func:`nnx_state`) without size-1 mesh axes."""
    layouts = typed_layouts(traced, plan.sizes)
    if not (isinstance(traced, Mapping) and NNX_OPTIMIZER in traced):
        return layouts
    rngs = set(rng_paths(traced))  # placed by MaxText itself, replicated
    return [dataclasses.replace(t, partition_spec=without_size_one(t.partition_spec, len(t.shape), plan.sizes),
                                source="type" if t.path in rngs else t.source) for t in layouts]
