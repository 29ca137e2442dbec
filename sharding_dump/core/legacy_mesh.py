"""The legacy `with mesh:` resource environment, made to hold the case's mesh while tracing.

Much JAX training code still asks the pre-`jax.set_mesh` resource environment which mesh is current
(`jax.interpreters.pxla.thread_resources.env.physical_mesh`) and only places its sharding
constraints when that mesh is not empty or names the constraint's axes: the constraint helpers of
EasyLM-style trainers, models that build `NamedSharding(physical_mesh, spec)` or run `shard_map` on
it. Traced under an abstract mesh alone, those helpers see the empty mesh and constrain nothing. Inside
:func:`legacy_mesh` the environment holds the given mesh (an `AbstractMesh` for a dump, which has axis
names and sizes but no devices; the concrete `Mesh` for a compile), as `with mesh:` would.

This is the only module that touches that JAX-private state (`jax._src.mesh.thread_resources`,
`ResourceEnv`); on a JAX without it, the block runs unchanged (nothing can read it there either).

>>> import jax
>>> from jax.sharding import AbstractMesh
>>> with legacy_mesh(AbstractMesh((2, 4), ("data", "model"))):
...     current_legacy_mesh().axis_names
('data', 'model')
>>> current_legacy_mesh().empty
True
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


def _resources() -> tuple[Any, Any] | None:
    """(thread_resources, ResourceEnv) of this JAX, or None when it has no legacy environment."""
    try:
        from jax._src import mesh as mesh_lib

        return mesh_lib.thread_resources, mesh_lib.ResourceEnv
    except (ImportError, AttributeError):
        return None


@contextlib.contextmanager
def legacy_mesh(mesh: Any) -> Iterator[None]:
    """Inside the block, the legacy resource environment of this thread holds `mesh`."""
    found = _resources()
    if found is None:
        yield
        return
    resources, env_type = found
    previous = resources.env
    env = env_type(physical_mesh=mesh)
    resources.stack.append(env)
    resources.env = env
    try:
        yield
    finally:
        if resources.stack and resources.stack[-1] is env:
            resources.stack.pop()
        resources.env = previous


def current_legacy_mesh() -> Any:
    """The mesh the legacy environment holds now (an empty Mesh outside any `with mesh:`), or None
    on a JAX without one."""
    found = _resources()
    return None if found is None else found[0].env.physical_mesh


__all__ = ["current_legacy_mesh", "legacy_mesh"]
