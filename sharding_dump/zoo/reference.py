"""Checking our activation dump against a reference trainer's activation dump (MaxText's format).

MaxText writes `input_shardings.json`: a list of one-key objects, the key `<scope>/<name>: <dtype>[<shape>]`,
the value the logical axes as a Python tuple string (or `Unknown`) and the PartitionSpec as a Python
`P(...)` string with size-1 mesh axes dropped. Our names differ from MaxText's, so an entry is matched
on what is layout: every reference entry whose logical axes are known must appear in our
`activation_shardings.json` with the same shape, dtype and logical axes, and with the same partition
spec once size-1 mesh axes are dropped from ours. Our dump may hold more entries.

>>> ref = [{"deepseek/inputs: bfloat16[8,16]": {"logic_axes": "('activation_batch', None)",
...                                              "PartitionSpec": "P('fsdp', None)"}}]
>>> ours = {"mesh": {"axis_names": ["data", "fsdp"], "axis_sizes": [1, 4]},
...         "tensors": {"forward/x": {"pass": "forward", "shape": [8, 16], "dtype": "bfloat16",
...                                   "logical_axes": ["activation_batch", None],
...                                   "partition_spec": [["data", "fsdp"], None]}}}
>>> compare(parse_reference(ref, "ref"), ours).mismatches
[]
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from sharding_dump.core import specs
from sharding_dump.errors import BadInput
from sharding_dump.golden import codec
from sharding_dump.resources import DATA_DIR, load_yaml, validate

REFERENCE_FILE = "input_shardings.json"
# `name: dtype[4,2048]`; in explicit mode a dimension carries its mesh axes too (`6@fsdp`).
# A PRNG key array's dtype is written `key<impl>` (`key<urbg>[16,2]`).
_KEY = re.compile(r"(?P<name>.+): (?P<dtype>[A-Za-z0-9_]+(?:<[A-Za-z0-9_]+>)?)\[(?P<shape>[0-9A-Za-z_@, ]*)\]")
NormalSpec = specs.SpecAxes
# A dimension left to the partitioner (`P.UNCONSTRAINED`, printed bare): read as this name, which no mesh
# axis of ours has, so such an entry never equals a spec of ours.
UNCONSTRAINED = "UNCONSTRAINED"
_UNCONSTRAINED = re.compile(r"\bUNCONSTRAINED\b")


@dataclasses.dataclass(frozen=True)
class ReferenceEntry:
    """One constraint of the reference dump."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...] | None  # None: the reference did not know them
    spec: NormalSpec

    def describe(self) -> str:
        axes = "Unknown" if self.logical_axes is None else list(self.logical_axes)
        return f"{self.name}: {self.dtype}{list(self.shape)} logical {axes}"


@dataclasses.dataclass
class Comparison:
    """What the check found: how many reference entries were checked, and what did not match."""

    checked: int = 0
    unknown: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)
    missing: str = ""  # why there was nothing of ours to compare with

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.missing

    def report(self, title: str) -> str:
        if self.missing:
            return f"{title}: {self.missing}"
        head = (f"{title}: {self.checked - len(self.mismatches)}/{self.checked} reference activations match "
                f"({self.unknown} with unknown logical axes skipped)")
        return "\n".join([head] + [f"  {line}" for line in self.mismatches])


def _literal(text: str, where: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise BadInput(f"{where}: {text!r} is not a Python literal") from None


def parse_reference(data: Any, where: str) -> list[ReferenceEntry]:
    """The entries of a reference `input_shardings.json` document (already JSON-decoded)."""
    items = data.get("Activation Sharding Dump") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise BadInput(f"{where}: expected a list of activations (or {{'Activation Sharding Dump': [...]}})")
    out = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or len(item) != 1:
            raise BadInput(f"{where}: item {index}: expected an object with one key")
        (key, value), = item.items()
        match = _KEY.fullmatch(key)
        if not match or not isinstance(value, dict) or not {"logic_axes", "PartitionSpec"} <= set(value):
            raise BadInput(f"{where}: item {index} ({key}): expected '<name>: <dtype>[<shape>]' with "
                           "logic_axes and PartitionSpec")
        try:
            shape = tuple(int(d.split("@", 1)[0]) for d in match["shape"].replace(" ", "").split(",") if d)
        except ValueError:
            raise BadInput(f"{where}: item {index} ({key}): shape {match['shape']!r} is not whole numbers") from None
        axes_text = value["logic_axes"]
        axes = None if axes_text == "Unknown" else tuple(_literal(axes_text, f"{where}: item {index} logic_axes"))
        spec_text = value["PartitionSpec"].strip()
        if not (spec_text.startswith("P(") and spec_text.endswith(")")):
            raise BadInput(f"{where}: item {index} PartitionSpec: {spec_text!r} is not P(...)")
        inner = _UNCONSTRAINED.sub(repr(UNCONSTRAINED), spec_text[2:-1])
        spec = _literal(f"[{inner}]", f"{where}: item {index} PartitionSpec")
        out.append(ReferenceEntry(match["name"], match["dtype"], shape, axes, specs.spec_axes(spec, len(shape))))
    return out


def load_reference(path: Path) -> list[ReferenceEntry]:
    """Reads a reference `input_shardings.json`."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except json.JSONDecodeError as err:
        raise BadInput(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None
    return parse_reference(data, str(path))


CALL_SITES_FILE = DATA_DIR / "maxtext_call_sites.yml"
UNNAMED = "Unknown"  # MaxText's name of a call site where it found no variable


@functools.cache
def call_sites() -> dict[str, tuple[str, ...]]:
    """data/maxtext_call_sites.yml: MaxText's `<file>/<variable>` of a constraint -> the zoo's names of it."""
    data = load_yaml(CALL_SITES_FILE, "MaxText call sites file")
    validate(data, "maxtext-call-sites", f"MaxText call sites file {CALL_SITES_FILE}")
    return {site: tuple(names) for site, names in data["call_sites"].items()}


def compare(reference: Sequence[ReferenceEntry], ours: Mapping[str, Any],
            sites: Mapping[str, Sequence[str]] | None = None) -> Comparison:
    """Checks every reference entry with known logical axes against our activation document: on its
    layout alone, or, given `sites` (MaxText call site -> our names, see :func:`call_sites`), by name too:
    a named entry is matched only by ours of those names, one whose call site the table lacks is a
    mismatch, and an entry with unknown logical axes whose call site the table has is checked on its
    shape, dtype and placement (MaxText's `Unknown` call sites stay matched on layout alone)."""
    sizes = dict(zip(ours["mesh"]["axis_names"], ours["mesh"]["axis_sizes"]))
    index: dict[tuple, list[tuple[str, NormalSpec]]] = {}
    forward_first = sorted(ours["tensors"].items(), key=lambda item: (item[1]["pass"] != "forward", item[0]))
    for key, entry in forward_first:
        spec = specs.spec_axes(entry["partition_spec"], len(entry["shape"]), sizes)
        layout = (tuple(entry["shape"]), entry["dtype"], tuple(entry["logical_axes"]))
        index.setdefault(layout, []).append((key, spec))
        if sites is not None:  # by name: (shape, dtype, name) for entries MaxText knows no axes of
            index.setdefault((tuple(entry["shape"]), entry["dtype"], entry["name"]), []).append((key, spec))
    result = Comparison()
    for ref in reference:
        named = sites is not None and ref.name != UNNAMED
        names = tuple(sites.get(ref.name, ())) if sites is not None else ()
        if ref.logical_axes is None and not names:
            result.unknown += 1
            continue
        result.checked += 1
        if named and not names:
            result.mismatches.append(f"{ref.describe()}: MaxText call site {ref.name!r} has no zoo names in "
                                     f"{CALL_SITES_FILE.name}")
            continue
        if ref.logical_axes is None:
            candidates = [c for name in names for c in index.get((ref.shape, ref.dtype, name), [])]
        else:
            candidates = index.get((ref.shape, ref.dtype, ref.logical_axes), [])
            if named:
                candidates = [c for c in candidates if c[0].rsplit("/", 1)[-1] in names]
        if not candidates:
            what = f"named {'/'.join(names)} " if named else ""
            result.mismatches.append(f"{ref.describe()}: no activation {what}with this shape, dtype and "
                                     f"{'placement' if ref.logical_axes is None else 'logical axes'}")
        elif not any(spec == ref.spec for _, spec in candidates):
            key, spec = candidates[0]
            more = f" and {len(candidates) - 1} more" if len(candidates) > 1 else ""
            result.mismatches.append(f"{ref.describe()}: partition spec reference {_show(ref.spec)}, "
                                     f"ours {_show(spec)} ({key}{more}; size-1 mesh axes dropped)")
    return result


def _show(spec: NormalSpec) -> str:
    return json.dumps([None if not axes else axes[0] if len(axes) == 1 else list(axes) for axes in spec])


def compare_trees(reference_root: Path, golden_root: Path, activation_file: str,
                  sites: Mapping[str, Sequence[str]] | None = None) -> dict[str, Comparison]:
    """Every `input_shardings.json` under `reference_root` against our activation file in the folder of
    the same relative path under `golden_root` (the folder naming is the same), by name with `sites`
    (see :func:`compare`); keyed by that path."""
    found = sorted(Path(reference_root).rglob(REFERENCE_FILE))
    if not found:
        raise BadInput(f"{reference_root}: no {REFERENCE_FILE} below it")
    results = {}
    for path in found:
        folder = path.parent.relative_to(reference_root)
        ours_path = Path(golden_root) / folder / activation_file
        if not ours_path.is_file():
            results[folder.as_posix()] = Comparison(missing=f"no {activation_file} in {ours_path.parent} "
                                                            "(is the case in the matrix?)")
            continue
        results[folder.as_posix()] = compare(load_reference(path), codec.read_document(ours_path), sites)
    return results
