"""What changed between two golden documents, per tensor, in a form a reviewer reads at a glance.

deepdiff finds the differences; this module only groups them by tensor and field and prints the
whole old and new value of each changed field (a partition spec is read as a whole, not as the one
list item deepdiff points at). Entries that only mirror another one are folded under it: optimizer
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
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # imported on the first difference: equal documents never need it (it loads numpy)
    from deepdiff import DeepDiff

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


def _top_keys(tree: DeepDiff) -> list[list[Any]]:
    paths = []
    for levels in tree.values():
        for level in levels:
            paths.append(level.path(output_format="list"))
    return paths


def _deepdiff(old: Any, new: Any) -> DeepDiff:
    # threshold_to_diff_deeper=0: always report per key. By default deepdiff reports two mappings
    # that share under a third of their keys as one changed value, which names no tensor.
    from deepdiff import DeepDiff

    return DeepDiff(old, new, view="tree", threshold_to_diff_deeper=0)


def diff_documents(old: Mapping[str, Any], new: Mapping[str, Any]) -> DocumentDiff:
    """Groups deepdiff's findings by tensor and field (and header field)."""
    out = DocumentDiff(kind=str(new.get("kind", old.get("kind", ""))))
    old_t, new_t = old.get("tensors", {}), new.get("tensors", {})
    for path in _top_keys(_deepdiff(old_t, new_t)):
        name = path[0]
        if name not in old_t:
            out.added[name] = new_t[name]
        elif name not in new_t:
            out.removed[name] = old_t[name]
        else:
            field = path[1] if len(path) > 1 else "(entry)"
            if field == "(entry)":
                out.changed.setdefault(name, {})[field] = (old_t[name], new_t[name])
            else:
                out.changed.setdefault(name, {})[field] = (old_t[name].get(field), new_t[name].get(field))
    old_h = {k: v for k, v in old.items() if k != "tensors"}
    new_h = {k: v for k, v in new.items() if k != "tensors"}
    for path in _top_keys(_deepdiff(old_h, new_h)):
        key = path[0] if len(path) == 1 else f"{path[0]}.{path[1]}"
        out.header[key] = (_get(old_h, path[:2]), _get(new_h, path[:2]))
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


def slot_parameter(name: str) -> tuple[str, str] | None:
    """The entry `name` mirrors, and how to call it when folded under that entry:
    `opt_state/0/mu/x/y` -> ('params/x/y', 'opt_state/0/mu'), an optimizer slot of a parameter;
    `backward/m/a` -> ('forward/m/a', 'backward'), the gradient of an activation."""
    parts = name.split("/")
    if len(parts) > 3 and parts[0] == "opt_state" and parts[2] in ("mu", "nu"):
        return "params/" + "/".join(parts[3:]), "/".join(parts[:3])
    if len(parts) > 1 and parts[0] == "backward":
        return "forward/" + "/".join(parts[1:]), "backward"
    return None


def fold_slots(changed: dict[str, Any]) -> dict[str, tuple[Any, list[str]]]:
    """Groups optimizer slots whose change equals their parameter's change under that parameter."""
    folded: dict[str, tuple[dict, list[str]]] = {}
    for name in sorted(changed):
        mirror = slot_parameter(name)
        if mirror and mirror[0] in changed and changed[mirror[0]] == changed[name]:
            continue
        folded[name] = (changed[name], [])
    for name in sorted(changed):
        mirror = slot_parameter(name)
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
