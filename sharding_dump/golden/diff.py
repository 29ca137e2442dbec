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
from typing import Any, Container, Iterator, Mapping

MAX_TENSORS = 60  # per file in one report; the rest is counted


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
    """
    parts = name.split("/")
    if parts[0] == "opt_state":
        for start in range(1, len(parts)):
            mirror = "params/" + "/".join(parts[start:])
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


def format_diff(file_name: str, diff: DocumentDiff, limit: int = MAX_TENSORS) -> str:
    """The report of one file: a count line, then one block per changed tensor (parameters and
    forward activations first, their optimizer slots / backward mirrors folded in when they changed
    the same way)."""
    noun = "activation" if diff.kind == "activations" else "tensor"
    lines = [f"{file_name}: {_plural(len(diff.changed), noun)} changed, "
             f"{len(diff.added)} added, {len(diff.removed)} removed"]
    for key, (old, new) in sorted(diff.header.items()):
        lines.append(f"  header {key}  golden {compact(old)}  now {compact(new)}")
    folded = fold_slots(diff.changed)
    order = sorted(folded, key=lambda n: (not n.startswith(("params/", "forward/")), n))
    shown = 0
    for name in order[:limit]:
        fields, slots = folded[name]
        lines.append(f"  {name}" + (f"  (and {', '.join(slots)})" if slots else ""))
        width = max(len(f) for f in fields)
        for field, (old, new) in sorted(fields.items()):
            lines.append(f"      {field:<{width}}  golden {compact(old)}  now {compact(new)}")
        shown += 1
    rest = len(order) - shown
    for label, entries in (("added", diff.added), ("removed", diff.removed)):
        for name in sorted(entries):
            if shown >= limit:
                rest += 1
                continue
            lines.append(f"  {label} {name}  {compact(entries[name])}")
            shown += 1
    if rest > 0:
        lines.append(f"  ... and {rest} more {noun}s")
    return "\n".join(lines)
