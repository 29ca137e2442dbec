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
    return StepParts(dump.case_step(setup), abstract, untyped(dump.case_batch(setup)),
                     {t.path: t.partition_spec for t in layouts}, setup.batch.pipeline_spec,
                     setup.plan.axis_names, setup.plan.ici, setup.plan.dcn, setup.rule_set.logical_axis_rules,
                     stacks, bool(setup.values["allow_split_physical_axes"]), setup.step_explicit)


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
