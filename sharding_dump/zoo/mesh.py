"""The device mesh of a case: ICI (within a slice) x DCN (across slices) parallelism per axis.

Sizes come from the `ici_<axis>_parallelism` / `dcn_<axis>_parallelism` settings of the axes the
rule file declares, whatever their names (MaxText's `stage` axis keeps its `ici_pipeline_parallelism`
name); unset ones are 1, and one `-1` per kind fills what is left. The result is a
`jax.sharding.AbstractMesh`: no devices, no backend, any size.

On a TPU slice the ICI mesh must also fit the slice's physical torus, as MaxText's device mesh
requires: each axis size a product of whole physical axes (chip grid x, y, z and the chip's cores)
that no other axis uses. The check runs JAX's own device-mesh builder over stand-in devices with the
slice's coordinates (:func:`check_torus`); `cpu-N` and GPU hosts take any shape.

>>> from sharding_dump.zoo.rules import load_rule
>>> from sharding_dump.zoo.topology import load_topology
>>> from sharding_dump.zoo.settings import resolve
>>> plan = plan_mesh(load_rule("pure-fsdp"), load_topology("tpu7x-16384"), resolve(()))
>>> plan.axis_names, plan.shape
(('fsdp',), (16384,))
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Mapping, Sequence

import jax
from jax._src import (
    mesh_utils,  # the builder MaxText's create_device_mesh calls; pinned jax version
)
from jax.sharding import AbstractMesh, AxisType

from sharding_dump.errors import BadInput
from sharding_dump.zoo.rules import RuleSet
from sharding_dump.zoo.settings import parallelism_axis, parallelism_key, value_of
from sharding_dump.zoo.topology import Topology


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Axis names and their ICI and DCN sizes; the mesh shape is their product."""

    axis_names: tuple[str, ...]
    ici: tuple[int, ...]
    dcn: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(i * d for i, d in zip(self.ici, self.dcn))

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape))

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def abstract_mesh(self, explicit: bool = False) -> AbstractMesh:
        """An AbstractMesh of this shape, with Auto (default) or Explicit axis types."""
        kind = AxisType.Explicit if explicit else AxisType.Auto
        return AbstractMesh(self.shape, self.axis_names, axis_types=(kind,) * len(self.axis_names))


def _fill(kind: str, axes: tuple[str, ...], values: Mapping[str, Any], target: int, what: str) -> tuple[int, ...]:
    keys = [parallelism_key(kind, a) for a in axes]
    sizes = [int(value_of(values, k)) for k in keys]
    fillers = [k for k, s in zip(keys, sizes) if s == -1]
    if len(fillers) > 1:
        raise BadInput(f"{' and '.join(f'{k}=-1' for k in fillers)}: at most one {kind} parallelism may be -1")
    known = math.prod(s for s in sizes if s != -1)
    listing = " x ".join(f"{a}={s}" for a, s in zip(axes, sizes) if s != 1) or "all 1"
    if fillers:
        if target % known:
            raise BadInput(f"{kind} parallelism {listing}: {known} does not divide the {target} {what}")
        sizes = [target // known if s == -1 else s for s in sizes]
    elif known != target:
        hint = f" (set one {kind}_*_parallelism to -1 to fill)" if kind == "dcn" or known < target else ""
        raise BadInput(f"{kind} parallelism {listing}: product {known} must equal the {target} {what}{hint}")
    return tuple(sizes)


def plan_mesh(rule_set: RuleSet, topology: Topology, values: Mapping[str, Any],
              explicit_keys: frozenset[str] = frozenset()) -> MeshPlan:
    """Sizes every mesh axis of `rule_set` on `topology` from the effective settings `values`.

    `explicit_keys` are the settings the case (or a mesh rule) set on purpose: setting one for an axis
    the rule file does not declare is an error rather than silently ignored."""
    axes = rule_set.mesh_axes
    own = {parallelism_key(kind, a) for kind in ("ici", "dcn") for a in axes}
    for key in sorted(explicit_keys):
        axis = parallelism_axis(key)
        if axis is not None and key not in own and value_of(values, key) != 1:
            raise BadInput(f"{key}={value_of(values, key)}: rule '{rule_set.name}' has no '{axis}' mesh axis "
                           f"(mesh_axes: {', '.join(axes)})")
    ici = _fill("ici", axes, values, topology.devices_per_slice, f"devices per slice of {topology.name}")
    dcn = _fill("dcn", axes, values, topology.num_slices, "slices (--num-slices)")
    plan = MeshPlan(axes, ici, dcn)
    check_torus(plan, topology, bool(value_of(values, "allow_split_physical_axes")))
    return plan


@dataclasses.dataclass(frozen=True, eq=False)
class _StandInDevice:
    """What JAX's device-mesh builder reads of a TPU device: kind, chip coordinates, core on the chip."""

    id: int
    coords: tuple[int, int, int]
    core_on_chip: int
    device_kind: str
    platform: str = "tpu"
    slice_index: int = 0


def device_grid(ici: Sequence[int], devices: Sequence[Any], allow_split: bool = False) -> Any:
    """One slice's devices laid out as the ICI mesh, as MaxText's create_device_mesh does: whole
    physical axes per mesh axis, or (allow_split_physical_axes) parts of them."""
    if allow_split:
        return mesh_utils.create_device_mesh(list(ici), devices, contiguous_submeshes=False,
                                             allow_split_physical_axes=True)
    return mesh_utils.create_device_mesh(list(ici), devices)


@functools.cache
def _torus_failure(device_kind: str, torus: tuple[int, ...], cores: int, ici: tuple[int, ...],
                   allow_split: bool = False) -> str | None:
    """None when `jax.experimental.mesh_utils.create_device_mesh(ici, devices)` succeeds on one slice of
    this torus, else its complaint. `allow_split`: as MaxText calls it with allow_split_physical_axes."""
    x, y, z = torus
    devices = [_StandInDevice(index, (i, j, k), core, device_kind)
               for index, (k, j, i, core) in enumerate((k, j, i, c) for k in range(z) for j in range(y)
                                                       for i in range(x) for c in range(cores))]
    try:
        device_grid(ici, devices, allow_split)
    except (NotImplementedError, ValueError, AssertionError) as err:
        return str(err)
    return None


def check_torus(plan: MeshPlan, topology: Topology, allow_split: bool = False) -> None:
    """BadInput when the plan's ICI mesh cannot be laid on one slice of a TPU topology (MaxText would
    fail to build its device mesh); names the axis that found no physical axes left. `allow_split`
    (the setting allow_split_physical_axes) lets an axis take part of a physical axis, as MaxText does."""
    if topology.platform != "tpu" or topology.torus is None:
        return
    failure = _torus_failure(topology.device_kind, topology.torus, topology.devices_per_chip, plan.ici, allow_split)
    if failure is None:
        return
    physical = list(topology.torus) + ([topology.devices_per_chip] if topology.devices_per_chip > 1 else [])
    listing = " x ".join(f"{a}={s}" for a, s in zip(plan.axis_names, plan.ici) if s != 1) or "all 1"
    match = re.search(r"logical_axis_index (\d+) of size (\d+)", failure)
    culprit = f"{plan.axis_names[int(match.group(1))]}={match.group(2)}" if match else "an axis"
    raise BadInput(f"ici parallelism {listing}: does not fit the {topology.name} torus "
                   f"({'x'.join(map(str, physical))} physical axes): {culprit} is not a product of physical axes "
                   f"left free by the later mesh axes (each ICI axis size must be a product of whole physical axes"
                   f"{'' if allow_split else '; allow_split_physical_axes=true lets an axis split one'})")


def use_mesh(plan: MeshPlan, explicit: bool = False):
    """Context manager that makes the plan's abstract mesh current for tracing."""
    return jax.sharding.use_abstract_mesh(plan.abstract_mesh(explicit))
