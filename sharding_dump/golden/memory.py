"""Memory per device, per part of a case, read from its golden documents: what a reviewer looks at
first, in a failing golden test, `sharding-dump diff` and its charts.

The parts are the top-level parts of the training state as the named document totals them
(`params`, `opt_state`, `step`, any other), plus `activations`: the sum, over every activation the
traced step records (forward and backward entries, each call site once), of the bytes one device
holds of it. That sum is an index that moves with the activations' layout, not a peak: a layer body
that a scan or a Python loop runs 32 times is one call site and counted once, and XLA frees and
rematerialises as it sees fit (`sharding-dump verify` measures the compiled step's peak).

>>> named = {"kind": "named", "per_device_bytes": {"params": 8, "opt_state": 16, "step": 4, "total": 28}}
>>> acts = {"kind": "activations", "tensors": {"forward/x": {"dtype": "bfloat16", "per_device_shape": [2, 4]}}}
>>> per_device({"named_shardings.json": named, "activation_shardings.json": acts})
{'params': 8, 'opt_state': 16, 'activations': 16, 'step': 4}
>>> print("\\n".join(lines(compare({"named_shardings.json": named}, {"named_shardings.json": named}))))
memory per device  golden    now       change
  params           8 Bytes   8 Bytes   0
  opt_state        16 Bytes  16 Bytes  0
  step             4 Bytes   4 Bytes   0
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from sharding_dump.core import specs
from sharding_dump.core.format import ACTIVATIONS_FILE, NAMED_FILE
from sharding_dump.errors import BadInput
from sharding_dump.golden import sizes

ACTIVATIONS = "activations"
ORDER = ("params", "model", "opt_state", "optimizer", ACTIVATIONS)  # then any other part, by name (NNX: model, optimizer)
TOTAL = "total"  # the named document's sum of the state's parts (activations not in it)

Memory = dict[str, tuple["int | None", "int | None"]]  # part -> (bytes before, bytes after) per device


def entry_bytes(entry: Mapping[str, Any] | None) -> int | None:
    """Bytes one device holds of a tensor; for an activation (no byte count recorded), from its
    per-device shape and dtype."""
    if entry is None:
        return None
    if "per_device_bytes" in entry:
        return entry["per_device_bytes"]
    return math.prod(entry["per_device_shape"]) * specs.itemsize(entry["dtype"])


def ordered(parts: Any) -> list[str]:
    """Part names in report order: params (NNX: model), opt_state (optimizer), activations, then the others by
    name."""
    return sorted(parts, key=lambda p: (ORDER.index(p) if p in ORDER else len(ORDER), p))


def per_device(docs: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """Bytes per device per part of one case, from its golden documents by file name (a part whose
    document is absent is absent)."""
    found = {part: n for part, n in docs.get(NAMED_FILE, {}).get("per_device_bytes", {}).items() if part != TOTAL}
    activations = docs.get(ACTIVATIONS_FILE)
    if activations is not None:
        found[ACTIVATIONS] = sum(entry_bytes(e) or 0 for e in activations.get("tensors", {}).values())
    return {part: found[part] for part in ordered(found)}


def compare(old_docs: Mapping[str, Mapping[str, Any]], new_docs: Mapping[str, Mapping[str, Any]]) -> Memory:
    """Every part of either side, before and after (None on the side that lacks it)."""
    old, new = per_device(old_docs), per_device(new_docs)
    return {part: (old.get(part), new.get(part)) for part in ordered({*old, *new})}


def moved(memory: Memory) -> bool:
    return any(old != new for old, new in memory.values())


def rows(memory: Memory) -> list[list[str]]:
    """One row per part: name, before, after, change in bytes and %."""
    return [[part, sizes.format_bytes(old), sizes.format_bytes(new), sizes.format_change(old, new)]
            for part, (old, new) in memory.items()]


def lines(memory: Memory, before: str = "golden", after: str = "now") -> list[str]:
    """The memory table as aligned text lines, the heading first (how a failing golden test starts)."""
    table = [["memory per device", before, after, "change"], *[["  " + r[0], *r[1:]] for r in rows(memory)]]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[3]]).rstrip() for r in table]


# --- thresholds: `--fail-on-growth PART:LIMIT` ------------------------------------------------------

_THRESHOLD = re.compile(r"(?P<part>[A-Za-z_][\w.-]*|\*):(?P<limit>.+)")


def parse_threshold(text: str, option: str = "--fail-on-growth") -> tuple[str, float | None, int | None]:
    """`activations:10%` -> ('activations', 10.0, None); `params:256MiB` -> ('params', None, 268435456);
    `*:5%` applies to every part. BadInput naming the option and what is valid otherwise."""
    match = _THRESHOLD.fullmatch(text.strip())
    if match is None:
        raise BadInput(f"{option} {text!r}: give PART:LIMIT, e.g. activations:10% or params:256MiB "
                       f"(PART: {', '.join(ORDER)}, another part of the state, or * for every part)")
    part, limit = match.group("part"), match.group("limit").strip()
    if limit.endswith("%"):
        try:
            pct = float(limit[:-1])
        except ValueError:
            pct = -1.0
        if not math.isfinite(pct) or pct < 0:
            raise BadInput(f"{option} {text!r}: {limit!r} is not a percentage >= 0 (e.g. 10%)")
        return part, pct, None
    return part, None, sizes.parse_bytes(limit, f"{option} {text!r}: limit")


def exceeded(memory: Memory, threshold: tuple[str, float | None, int | None]) -> list[str]:
    """The parts of `memory` whose growth is above the threshold, each as `part old -> new (change)`."""
    part, pct, limit = threshold
    out = []
    for name, (old, new) in memory.items():
        if part not in ("*", name) or old is None or new is None or new <= old:
            continue
        grew = (new - old) * 100 > pct * old if pct is not None else new - old > limit
        if grew:
            out.append(f"{name} {sizes.format_bytes(old)} -> {sizes.format_bytes(new)} "
                       f"({sizes.format_change(old, new)})")
    return out
