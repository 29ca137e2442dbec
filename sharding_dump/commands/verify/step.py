"""The training step verify compiles, built by the zoo exactly as the dump traces it."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from sharding_dump.commands.verify.hlo import stack_dims
from sharding_dump.commands.verify.settings import stack_axes


@dataclasses.dataclass
class StepParts:
    """What the child compiles: the step, its abstract inputs and their layouts on the case's mesh."""

    step: Any  # (state, batch) -> (new state, loss)
    state: Any  # abstract state, unboxed
    batch: dict[str, Any]  # abstract batch
    state_specs: dict[str, Any]  # leaf path -> PartitionSpec
    batch_spec: Any  # PartitionSpec of every batch field, as the data pipeline delivers it
    axis_names: tuple[str, ...]
    ici: tuple[int, ...]  # per axis, within a slice
    dcn: tuple[int, ...]  # per axis, across slices
    logical_axis_rules: Any  # made current while the step is traced
    stacks: frozenset[tuple[int, ...]]  # sorted dims of every state leaf stacked over layers (stack_dims)
    allow_split: bool  # allow_split_physical_axes: how the TPU device mesh is built
    explicit: bool = False  # the step runs on a mesh whose axes are Explicit (a user's program in explicit mode)
    golden_paths: dict[str, str] = dataclasses.field(default_factory=dict)  # a state leaf's golden path, where
    #                                                                          it differs from its own
    uncompiled: frozenset[str] = frozenset()  # golden leaves the step does not take (MaxText's NNX RNG state)


def build_step(case: Any) -> StepParts:
    """The case's training step from the harness: setup, abstract state, step function, layouts."""
    import jax

    from sharding_dump.core.tree import unbox
    from sharding_dump.zoo import dump, serving

    def untyped(tree: Any) -> Any:  # the compile's in_shardings place them, on the concrete mesh
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

    setup, layouts = dump.case_layouts(case)
    if serving.serves(case):
        return _serving_step(setup, layouts)
    abstract = untyped(unbox(dump.abstract_state_of(setup)))
    stacks = stack_dims(layouts, stack_axes())
    state_specs, golden_paths, uncompiled = _step_specs(abstract, layouts)
    return StepParts(dump.case_step(setup), abstract, untyped(dump.case_batch(setup)),
                     state_specs, setup.batch.pipeline_spec,
                     setup.plan.axis_names, setup.plan.ici, setup.plan.dcn, setup.rule_set.logical_axis_rules,
                     stacks, bool(setup.values["allow_split_physical_axes"]), setup.step_explicit,
                     golden_paths, uncompiled)


def _step_specs(state: Any, layouts: Sequence[Any]) -> tuple[dict[str, Any], dict[str, str], frozenset[str]]:
    """The spec of every leaf of the state the step takes, from the golden's layouts: the leaf's own, or,
    for MaxText's NNX build (whose state the zoo's step takes as {'params', 'opt_state', 'step'}), that of
    its leaf in the NNX state (`model/...`, `optimizer/opt_state/...`, `optimizer/step`). A leaf the NNX
    build holds otherwise (a routed bias kept as model state, stacked layer first, and its moments, which
    that build has not) is compiled replicated and not compared. Also {leaf path: golden path} where they
    differ, and the golden's leaves the step does not take (the NNX build's RNG state).

    >>> import jax
    >>> from jax.sharding import PartitionSpec as P
    >>> from sharding_dump.core.layout import TensorLayout
    >>> state = {"params": {"w": jax.ShapeDtypeStruct((4, 8), "float32")}, "step": jax.ShapeDtypeStruct((), "int32")}
    >>> sizes = {"fsdp": 4}
    >>> nnx = [TensorLayout("model/w", (4, 8), "float32", ("embed", "mlp"), P("fsdp", None), sizes),
    ...        TensorLayout("model/rngs/params/key", (), "key<urbg>", (), P(), sizes),
    ...        TensorLayout("optimizer/step", (), "uint32", (), P(), sizes)]
    >>> specs, golden_paths, uncompiled = _step_specs(state, nnx)
    >>> {path: tuple(spec) for path, spec in specs.items()}, golden_paths, sorted(uncompiled)
    ({'params/w': ('fsdp', None), 'step': ()}, {'params/w': 'model/w', 'step': 'optimizer/step'}, ['model/rngs/params/key'])
    """
    import jax
    from jax.sharding import PartitionSpec

    from sharding_dump.zoo.state import NNX_MODEL, nnx_path

    by_path = {t.path: t for t in layouts}
    leaves = {leaf_path(key): leaf for key, leaf in jax.tree_util.tree_leaves_with_path(state)}
    if not any(path.startswith(NNX_MODEL + "/") for path in by_path) or any(path in by_path for path in leaves):
        return {t.path: t.partition_spec for t in layouts}, {}, frozenset()
    specs, golden_paths = {}, {}
    for path, leaf in leaves.items():
        layout = by_path.get(nnx_path(path))
        if layout is not None and tuple(layout.shape) == tuple(leaf.shape):
            specs[path], golden_paths[path] = layout.partition_spec, layout.path
        else:
            specs[path] = PartitionSpec()
    return specs, golden_paths, frozenset(by_path) - set(golden_paths.values())


def _serving_step(setup: Any, layouts: Any) -> StepParts:
    """A serving case's last step (generate: the one a server runs most), on the state init builds at
    the case's slots and lengths, its inputs handed in replicated (as the dump traces them)."""
    import jax
    from jax.sharding import PartitionSpec

    from sharding_dump.core.tree import unbox
    from sharding_dump.errors import BadInput
    from sharding_dump.zoo import serving

    program = serving.program_of(setup)
    settings = serving.settings_of(setup.values, setup.batch.global_batch_size)
    name, step = list(program.steps.items())[-1]
    if step.takes is not None:
        raise BadInput(f"verify compiles a serving case's last step, {name!r}, and it takes the outputs of "
                       f"{step.takes!r}: give the program a last step that takes the state and its own inputs")
    raw = serving.init_layouts(serving.program_key(setup), setup.plan, setup.rule_set, setup.explicit, settings,
                               True)[0]
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), unbox(raw))
    inputs = {field: spec.sized(settings.sizes()) for field, spec in step.inputs.items()}
    return StepParts(lambda s, i: step.fn(s, i, settings), state, inputs, {t.path: t.partition_spec for t in layouts},
                     PartitionSpec(), setup.plan.axis_names, setup.plan.ici, setup.plan.dcn,
                     setup.rule_set.logical_axis_rules, frozenset(), bool(setup.values["allow_split_physical_axes"]),
                     setup.explicit)


def leaf_path(key_path: Sequence[Any]) -> str:
    """A state leaf's path as the goldens write it."""
    from sharding_dump.core.tree import path_text

    return path_text(key_path)
