"""The golden documents of a layout: named (physical), logical and activation shardings.

>>> import jax, flax.linen as nn
>>> from jax.sharding import AbstractMesh
>>> from sharding_dump.core.layout import tensor_layouts
>>> mesh = AbstractMesh((4,), ("fsdp",))
>>> state = {"w": nn.Partitioned(jax.ShapeDtypeStruct((8, 2), "float32"), names=("embed", None))}
>>> docs = golden_documents(tensor_layouts(state, mesh, [("embed", "fsdp")]), mesh)
>>> sorted(docs)
['logical_shardings.json', 'named_shardings.json']
>>> docs["named_shardings.json"]["tensors"]["w"]["partition_spec"]
['fsdp', None]
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from sharding_dump.core import specs
from sharding_dump.core.capture import Constraint
from sharding_dump.core.format import (
    ACTIVATIONS_FILE,
    LOGICAL_FILE,
    NAMED_FILE,
    document,
)
from sharding_dump.core.layout import TensorLayout, mesh_sizes, per_device_totals


def mesh_header(mesh: Any, shard_mode: str = "auto") -> dict[str, Any]:
    """The `mesh` part of every document's header."""
    sizes = mesh_sizes(mesh)
    return {"mesh": {"axis_names": list(sizes), "axis_sizes": list(sizes.values()), "shard_mode": shard_mode}}


def named_entries(layouts: Sequence[TensorLayout]) -> dict[str, dict[str, Any]]:
    """Per leaf: shape, dtype, partition spec, per-device shape and bytes."""
    return {t.path: {"shape": list(t.shape), "dtype": t.dtype,
                     "partition_spec": specs.spec_to_json(t.partition_spec, len(t.shape)),
                     "per_device_shape": list(t.per_device_shape), "per_device_bytes": t.per_device_bytes}
            for t in layouts}


def logical_entries(layouts: Sequence[TensorLayout]) -> dict[str, dict[str, Any]]:
    """Per leaf: shape and logical axes."""
    return {t.path: {"shape": list(t.shape), "logical_axes": list(t.logical_axes)} for t in layouts}


def activation_entries(constraints: Sequence[Constraint], mesh: Any) -> dict[str, dict[str, Any]]:
    """Per activation, keyed `<pass>/<module>/<name>`: shape, dtype, logical axes, spec, per-device shape."""
    sizes = mesh_sizes(mesh)
    entries = {}
    for c in constraints:
        layout = TensorLayout(c.key, c.shape, c.dtype, c.logical_axes, c.partition_spec, sizes)
        entries[c.key] = {"module": c.module, "name": c.name, "pass": c.pass_, "shape": list(c.shape),
                          "dtype": c.dtype, "logical_axes": list(c.logical_axes),
                          "partition_spec": specs.spec_to_json(c.partition_spec, len(c.shape)),
                          "per_device_shape": list(layout.per_device_shape)}
    return entries


def golden_documents(layouts: Sequence[TensorLayout], mesh: Any,
                     activations: Sequence[Constraint] | None = None,
                     header: Mapping[str, Any] | None = None,
                     activation_header: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Every golden document of one layout, keyed by file name (the activation document only when
    `activations` is given). `header` goes at the top of each (default: the mesh)."""
    head = dict(header) if header is not None else mesh_header(mesh)
    docs = {
        NAMED_FILE: document("named", {**head, "per_device_bytes": per_device_totals(layouts)},
                                       named_entries(layouts)),
        LOGICAL_FILE: document("logical", head, logical_entries(layouts)),
    }
    if activations is not None:
        docs[ACTIVATIONS_FILE] = document("activations", {**head, **(activation_header or {})},
                                                    activation_entries(activations, mesh))
    return docs
