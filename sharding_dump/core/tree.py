"""Pytree leaves as the goldens name them: a key path as '/'-joined text, and the flax `Partitioned`
boxes the abstract state keeps logical axes in. The floor of the core's state modules (layout,
optimizer, placement, program), which import it and not each other for it.

>>> import jax, flax.linen as nn
>>> state = {"params": {"w": nn.Partitioned(jax.ShapeDtypeStruct((2,), "float32"), names=("embed",))}}
>>> [path_text(k) for k, _ in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_box)]
['params/w']
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax


def is_box(x: Any) -> bool:
    """A leaf boxed with its logical axes (flax `Partitioned`), as the abstract state holds parameters."""
    return isinstance(x, nn.Partitioned)


def _key_text(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    raise TypeError(f"unexpected pytree key {entry!r}")


def path_text(key_path: Sequence[Any]) -> str:
    """A pytree key path as the '/'-joined path the goldens use (a box's `value` is not a level)."""
    return "/".join(_key_text(k) for k in key_path
                    if not isinstance(k, jax.tree_util.GetAttrKey) or k.name != "value")


def unbox(state: Any) -> Any:
    """The state with every `Partitioned` box replaced by its value (no constraint applied)."""
    return jax.tree.map(lambda x: x.value if is_box(x) else x, state, is_leaf=is_box)
