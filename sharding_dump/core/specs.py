"""Partition specs in one canonical form, without importing jax.

A spec entry may arrive as None, (), a mesh axis name, a tuple or list of names (from a
`PartitionSpec`, YAML, JSON or a MaxText dump). :func:`entry_axes` turns one entry into a tuple of
mesh axes; every other spec function in the package is built on it.

>>> entry_axes(None), entry_axes("fsdp"), entry_axes(["data", "fsdp"])
((), ('fsdp',), ('data', 'fsdp'))
>>> spec_axes(("fsdp", None), 3)
(('fsdp',), (), ())
>>> spec_to_json((("fsdp",), ("data", "expert")), 3)
['fsdp', ['data', 'expert'], None]
>>> spec_to_json(["fsdp", ["tensor", "expert"]], 2, sizes={"fsdp": 4, "tensor": 1, "expert": 2})
['fsdp', 'expert']
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

SpecJson = list[None | str | list[str]]
SpecAxes = tuple[tuple[str, ...], ...]


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one spec entry names, as a tuple (empty for None or ())."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def rule_axes(value: Any) -> None | str | tuple[str, ...]:
    """A rule's right-hand side as flax's resolver wants it: None, one axis name, or a tuple (YAML
    and JSON give lists)."""
    return value if value is None or isinstance(value, str) else tuple(value)


def spec_axes(spec: Sequence[Any] | None, ndim: int, sizes: Mapping[str, int] | None = None) -> SpecAxes:
    """One tuple of mesh axes per dimension (a short spec is padded); with `sizes`, axes of size 1
    are dropped (what a device actually splits over)."""
    entries = tuple(spec or ())
    out = []
    for dim in range(ndim):
        axes = entry_axes(entries[dim] if dim < len(entries) else None)
        if sizes is not None:
            axes = tuple(a for a in axes if sizes.get(a, 1) != 1)
        out.append(axes)
    return tuple(out)


def spec_to_json(spec: Sequence[Any] | None, ndim: int, sizes: Mapping[str, int] | None = None) -> SpecJson:
    """The golden JSON form: per dimension null, an axis name, or a list of two or more names."""
    return [None if not axes else axes[0] if len(axes) == 1 else list(axes)
            for axes in spec_axes(spec, ndim, sizes)]


def shards(spec: Sequence[Any] | None, dim: int, sizes: Mapping[str, int]) -> int:
    """How many pieces dimension `dim` is split into."""
    return math.prod(sizes[a] for a in spec_axes(spec, dim + 1)[dim])


_BITS = re.compile(r"(\d+)")
# Bytes per element of the dtypes whose name holds no bit width: bool, and JAX's typed PRNG keys (an
# extended dtype: the bytes of each key's uint32 data, threefry's 2 words, rbg's and unsafe_rbg's 4).
# Any other extended dtype a layout meets is noted by :func:`note_itemsize`.
_ITEMSIZE = {"bool": 1, "key<fry>": 8, "key<rbg>": 16, "key<urbg>": 16}


def note_itemsize(dtype: str, size: int) -> None:
    """Bytes per element of an extended dtype's name (a PRNG implementation of the program's own, ...),
    from the dtype itself, so the dtype's name sizes it here as numpy's names size theirs."""
    _ITEMSIZE.setdefault(dtype, size)


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (float32, bfloat16, int8, float8_e4m3fn, ...), without jax.

    >>> itemsize("bfloat16"), itemsize("float32"), itemsize("float8_e4m3fn"), itemsize("bool")
    (2, 4, 1, 1)
    """
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    match = _BITS.search(dtype)
    if match is None:
        raise ValueError(f"dtype {dtype!r}: no bit width in its name")
    return max(1, int(match.group(1)) // 8)


@dataclasses.dataclass(frozen=True)
class PathRule:
    """Places a parameter that carries no logical axes by its path, as `[(regex, PartitionSpec)]`
    trainers do: the first rule whose `pattern` `re.search`-es the parameter's path (as the goldens
    write it, without `params/`) gives, per dimension, mesh axes (`spec`) or logical names resolved by
    the logical axis rules (`logical`). A shorter spec leaves the last dimensions whole, as a
    PartitionSpec does. `where` names the rule in messages (e.g. `rules.yml:12`)."""

    pattern: str
    spec: tuple[Any, ...] | None = None
    logical: tuple[str | None, ...] | None = None
    where: str = ""

    @property
    def entries(self) -> tuple[Any, ...]:
        return self.logical if self.logical is not None else tuple(self.spec or ())


def match_path_rule(path_rules: Sequence[PathRule], path: str) -> int | None:
    """Index of the first rule whose regex is found in `path`, or None.

    >>> match_path_rule([PathRule("attention/w[qkv]/kernel"), PathRule(".*")], "h/0/attention/wq/kernel")
    0
    """
    from sharding_dump.core.boundary import bounded_regexes

    with bounded_regexes() as search:  # the searches of one path, bounded: a rule file's regex may backtrack
        return next((i for i, r in enumerate(path_rules)
                     if search(r.pattern, path, f"partition rule {r.where or repr(r.pattern)}")), None)


# A leaf's path as the goldens write it: the train state's pytree path, '/'-joined, each element by its
# name (dict key, attribute or index). A trainer that dumps `jax.tree_util` key paths as text (MaxText's
# sharding dump: `"/".join(str(key) for key in path)`) writes the same elements in jax's key syntax:
# `.attribute`, `['key']`, `[index]`.
_PATH_ELEMENT = re.compile(r"""\.(?P<attr>[A-Za-z_]\w*)|\[(?P<index>-?\d+)\]|\[(?P<q>['"])(?P<key>.*?)(?P=q)\]""")
# The parts of a train state that hold the parameters and the optimizer: a Linen TrainState's `params` and
# `opt_state`, an NNX one's `model` (its parameters and other variables) and `optimizer` (`opt_state`, `step`).
PARAMETER_PARTS = ("params", "model")
OPTIMIZER_PARTS = ("opt_state", "optimizer")
NNX_RNGS = "rngs"  # an NNX module's nnx.Rngs in its state: RNG state (count, key per stream), no parameter
COLLECTION = "params"  # a linen model's variable collection, which the goldens' paths do not repeat
VARIABLE_VALUE = "value"  # an NNX variable's (and a flax box's) value attribute: no level of a path


def leaf_path(key_text: str) -> str:
    """The golden path of a leaf whose jax key path is written as text (`/`-joined `str()` of its keys).

    Each element is written by its name; a dict key `params` right under an attribute (`TrainState.params`,
    an optimizer slot such as `.mu`) is a linen variable collection holding the modules, not a module,
    and is no level of the path; nor is a last `.value`, an NNX variable's value (as a flax box's value
    is none: tree.path_text). Raises ValueError naming the element that is not jax's key syntax.

    >>> leaf_path(".opt_state/[0]/.mu/['params']/['decoder']/['pipeline_module']/['layers']/['mlp']")
    'opt_state/0/mu/decoder/pipeline_module/layers/mlp'
    >>> leaf_path(".step"), leaf_path("['params']/['params']/['dense']")  # under a dict key it is a level
    ('step', 'params/params/dense')
    >>> leaf_path("['optimizer']/['opt_state']/[0]/['mu']/['decoder']/['scale']/.value")  # MaxText's NNX state
    'optimizer/opt_state/0/mu/decoder/scale'
    """
    if key_text.endswith("/"):
        raise ValueError(f"{key_text!r}: ends with '/' (no element after it)")
    names: list[str] = []
    under_attribute = False
    at = 0
    while at < len(key_text):
        match = _PATH_ELEMENT.match(key_text, at)
        if match is None or (match.end() < len(key_text) and key_text[match.end()] != "/"):
            raise ValueError(f"{key_text!r}: element at character {at} is not a jax key (.name, ['key'] or [index])")
        name = match.group("attr") or match.group("index") or match.group("key")
        variable_value = match.group("attr") == VARIABLE_VALUE and match.end() == len(key_text) and names
        if not (under_attribute and match.group("key") == COLLECTION) and not variable_value:
            names.append(name)
        under_attribute = match.group("attr") is not None
        at = match.end() + 1
    return "/".join(names)
