"""What changed between two golden documents, per tensor, in a form a reviewer reads at a glance.

A document is two levels deep (tensor -> field -> value; header key -> value or a mapping of them),
so the differences are found by comparing those two levels: each changed field is shown with its
whole old and new value (a partition spec is read as a whole). Entries that only mirror another one are folded under it: optimizer
slots under their parameter, a backward activation under its forward one, when they changed alike.

>>> old = {"kind": "named", "tensors": {"params/w": {"shape": [8], "partition_spec": ["fsdp"]}}}
>>> new = {"kind": "named", "tensors": {"params/w": {"shape": [8], "partition_spec": [None]}}}
>>> print(format_diff("named_shardings.json", diff_documents(old, new)))
named_shardings.json: 1 tensor changed, 0 added, 0 removed
  params/w
      partition_spec  golden ["fsdp"]  now [null]
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Container, Iterable, Iterator, Mapping, Sequence

from sharding_dump.core import specs
from sharding_dump.golden import sizes


@dataclasses.dataclass
class DocumentDiff:
    """Differences between a golden document (old) and a fresh dump (new)."""

    kind: str = ""
    header: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    changed: dict[str, dict[str, tuple[Any, Any]]] = dataclasses.field(default_factory=dict)
    added: dict[str, Any] = dataclasses.field(default_factory=dict)
    removed: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.header or self.changed or self.added or self.removed)


def _same(old: Any, new: Any) -> bool:
    """Equal as JSON: 1 and 1.0, or true and 1, which Python calls equal, are a difference here."""
    return old == new and compact(old) == compact(new)


def _differing(old: Mapping[str, Any], new: Mapping[str, Any]) -> Iterator[str]:
    """The keys of either mapping whose values differ, one only holds included."""
    missing = object()
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, missing), new.get(key, missing)
        if a is missing or b is missing or not _same(a, b):
            yield key


def diff_documents(old: Mapping[str, Any], new: Mapping[str, Any]) -> DocumentDiff:
    """Groups the differences by tensor and field (and header field, `a.b` inside a header mapping)."""
    out = DocumentDiff(kind=str(new.get("kind", old.get("kind", ""))))
    old_t, new_t = old.get("tensors", {}), new.get("tensors", {})
    for name in _differing(old_t, new_t):
        if name not in old_t:
            out.added[name] = new_t[name]
        elif name not in new_t:
            out.removed[name] = old_t[name]
        elif isinstance(old_t[name], Mapping) and isinstance(new_t[name], Mapping):
            out.changed[name] = {field: (old_t[name].get(field), new_t[name].get(field))
                                 for field in _differing(old_t[name], new_t[name])}
        else:
            out.changed[name] = {"(entry)": (old_t[name], new_t[name])}
    old_h = {k: v for k, v in old.items() if k != "tensors"}
    new_h = {k: v for k, v in new.items() if k != "tensors"}
    for key in _differing(old_h, new_h):
        old_v, new_v = old_h.get(key, {}), new_h.get(key, {})  # a mapping one side lacks: each of its keys
        if isinstance(old_v, Mapping) and isinstance(new_v, Mapping):
            for sub in _differing(old_v, new_v):
                out.header[f"{key}.{sub}"] = (_get(old_h, [key, sub]), _get(new_h, [key, sub]))
        else:
            out.header[key] = (_get(old_h, [key]), _get(new_h, [key]))
    return out


def _get(doc: Mapping[str, Any], path: list[Any]) -> Any:
    value: Any = doc
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return "(absent)"
        value = value[key]
    return value


def compact(value: Any) -> str:
    """One-line JSON: `["fsdp",null]`."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def slot_parameter(name: str, known: Container[str]) -> tuple[str, str] | None:
    """The entry of `known` that `name` mirrors, and how to call it when folded under that entry:
    an optimizer leaf of any optimizer whose path ends in a parameter's path (the longest such)
    `opt_state/0/mu/x/y` -> ('params/x/y', 'opt_state/0/mu'); the gradient of an activation
    `backward/m/a` -> ('forward/m/a', 'backward').

    >>> slot_parameter("opt_state/0/v_row/x/y", {"params/x/y", "params/y"})
    ('params/x/y', 'opt_state/0/v_row')
    >>> slot_parameter("optimizer/opt_state/0/mu/x/y", {"model/x/y"})  # an NNX state's
    ('model/x/y', 'optimizer/opt_state/0/mu')
    """
    parts = name.split("/")
    if parts[0] in specs.OPTIMIZER_PARTS:
        owner = specs.PARAMETER_PARTS[specs.OPTIMIZER_PARTS.index(parts[0])]
        for start in range(1, len(parts)):
            mirror = f"{owner}/" + "/".join(parts[start:])
            if mirror in known:
                return mirror, "/".join(parts[:start])
        return None
    if len(parts) > 1 and parts[0] == "backward":
        return "forward/" + "/".join(parts[1:]), "backward"
    return None


def fold_slots(changed: dict[str, Any]) -> dict[str, tuple[Any, list[str]]]:
    """Groups optimizer slots whose change equals their parameter's change under that parameter."""
    folded: dict[str, tuple[dict, list[str]]] = {}
    for name in sorted(changed):
        mirror = slot_parameter(name, changed)
        if mirror and changed[mirror[0]] == changed[name]:
            continue
        folded[name] = (changed[name], [])
    for name in sorted(changed):
        mirror = slot_parameter(name, changed)
        if mirror and mirror[0] in folded and changed[mirror[0]] == changed[name]:
            folded[mirror[0]][1].append(mirror[1])
    return folded


_INDEX = re.compile(r"(?<=[/_])\d+(?=/|$)")  # a layer index: a path element, or `_<n>` ending one
MIN_GROUP = 3  # names differing only in their indices that are grouped into one (wi_0 and wi_1 stay two)
FULL_HINT = "run pytest with -vv to list every one"


def _ranges(values: Iterable[int]) -> str:
    """`0..31`, `0..3,5,7..8`: sorted integers as runs."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def group_layers(names: Sequence[str], key: Callable[[str], Any] = lambda name: None) -> list[tuple[str, list[str]]]:
    """Names that differ only in their layer indices and have the same `key` (their change), as one
    name with the indices written as ranges, in order of first appearance: 32 unscanned layers'
    kernels changed alike read `layers_0..31/mlp/wi_0/kernel`; groups of fewer than MIN_GROUP names
    stay apart.

    >>> names = [f"params/layers/{i}/mlp/wi_0/kernel" for i in range(32)] + ["params/h_1/w", "params/h_2/w"]
    >>> groups = group_layers(names)
    >>> [(name, len(members)) for name, members in groups]
    [('params/layers/0..31/mlp/wi_0/kernel', 32), ('params/h_1/w', 1), ('params/h_2/w', 1)]
    """
    groups: dict[tuple[str, Any], list[str]] = {}
    for name in names:
        groups.setdefault((_INDEX.sub("#", name), key(name)), []).append(name)
    out: list[tuple[str, list[str]]] = []
    for (template, _), members in groups.items():
        if len(members) < MIN_GROUP:
            out += [(name, [name]) for name in members]
            continue
        columns = list(zip(*(map(int, _INDEX.findall(name)) for name in members)))
        pieces = template.split("#")
        shown = pieces[0] + "".join(_ranges(col) + piece for col, piece in zip(columns, pieces[1:]))
        out.append((shown, members))
    order = {name: i for i, name in enumerate(names)}
    return sorted(out, key=lambda group: order[group[1][0]])


def _shown(field: str, value: Any, mesh_sizes: Mapping[str, int] | None) -> str:
    """A field's value as a report writes it: bytes in human units, a spec without mesh axes of size 1
    (when the mesh is known)."""
    if field == "per_device_bytes" and isinstance(value, int) and not isinstance(value, bool):
        return sizes.format_bytes(value)
    if field == "partition_spec" and mesh_sizes and isinstance(value, list):
        return compact(specs.spec_to_json(value, len(value), mesh_sizes))
    return compact(value)


def field_lines(fields: Mapping[str, tuple[Any, Any]], mesh_sizes: Mapping[str, int] | None = None) -> list[str]:
    """One line per changed field, `golden` and `now` values as :func:`_shown` writes them (raw JSON
    when the short forms would read the same)."""
    width = max(len(f) for f in fields)
    out = []
    for field, (old, new) in sorted(fields.items()):
        a, b = _shown(field, old, mesh_sizes), _shown(field, new, mesh_sizes)
        if a == b:
            a, b = compact(old), compact(new)
        out.append(f"      {field:<{width}}  golden {a}  now {b}")
    return out


def format_diff(file_name: str, diff: DocumentDiff, max_lines: int | None = None,
                mesh_sizes: Mapping[str, int] | None = None) -> str:
    """The report of one file: a count line, then the changed tensors (parameters and forward
    activations first, their optimizer slots / backward mirrors folded in when they changed the same
    way), tensors that changed alike listed over one set of field lines. At most `max_lines` lines,
    repeated layers grouped (:func:`group_layers`), the rest counted on the last; None: every
    tensor by its own name. Memory per device is the caller's (the `per_device_bytes` header is left out here)."""
    noun = "activation" if diff.kind == "activations" else "tensor"
    lines = [f"{file_name}: {_plural(len(diff.changed), noun)} changed, "
             f"{len(diff.added)} added, {len(diff.removed)} removed"]
    for key, (old, new) in sorted(diff.header.items()):
        if not key.startswith("per_device_bytes"):
            lines.append(f"  header {key}  golden {compact(old)}  now {compact(new)}")
    folded = fold_slots(diff.changed)
    changes: dict[str, tuple[str, list[str], list[str]]] = {}  # name -> (change key, slots, field lines)
    for name in sorted(folded, key=lambda n: (not n.startswith(("params/", "forward/")), n)):
        fields, slots = folded[name]
        changes[name] = (compact([fields, slots]), slots, field_lines(fields, mesh_sizes))
    for label, entries in (("added", diff.added), ("removed", diff.removed)):
        for name in sorted(entries):
            changes[f"{label} {name}"] = (compact([label, entries[name]]), [], [f"      {compact(entries[name])}"])
    blocks: dict[str, tuple[list[str], list[str]]] = {}  # change key -> (name lines, field lines)
    count = {}  # name line -> tensors it stands for
    grouped = group_layers(list(changes), key=lambda n: changes[n][0]) if max_lines is not None else \
        [(name, [name]) for name in changes]  # the full report names every tensor
    for shown, members in grouped:
        key, slots, fields = changes[members[0]]
        notes = [f"{len(members)} {noun}s"] * (len(members) > 1) + [f"and {', '.join(slots)}"] * bool(slots)
        line = f"  {shown}" + (f"  ({', '.join(notes)})" if notes else "")
        blocks.setdefault(key, ([], fields))[0].append(line)
        count[line] = len(members)
    left = None if max_lines is None else max(max_lines - len(lines) - 1, 1)
    rest = 0
    for names, fields in blocks.values():
        if left is not None and len(fields) + 1 > left:
            rest += sum(count[n] for n in names)
            left = 0
            continue
        take = names if left is None else names[:left - len(fields)]
        lines += take + fields
        rest += sum(count[n] for n in names[len(take):])
        if left is not None:
            left -= len(take) + len(fields)
    if rest:
        lines.append(f"  ... and {_plural(rest, noun)} more ({FULL_HINT})")
    return "\n".join(lines)
