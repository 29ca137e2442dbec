#!/usr/bin/env python3
"""Compare one of our golden case folders with a MaxText reference dump of the same case.

    python tools/compare_maxtext.py REFERENCE_CASE_DIR OUR_CASE_DIR

e.g. `tests/data/maxtext/goldens/deepseek2-16b/tpu7x-16/slice_1/rule_default` against
`golden/deepseek2-16b/tpu7x-16/slice_1/rule_default`.

The two name every leaf by the same path, written in two syntaxes: the reference keys each entry
by its pytree key path as jax writes it (`.params/['params']/['decoder']/['pipeline_module']/...`,
`.opt_state/[0]/.mu/['params']/...`), with the mesh repeated in every entry; we write the same
path as names (`params/decoder/pipeline_module/...`, `opt_state/0/mu/...`), read from jax's syntax by
the package's own `sharding_dump.core.specs.leaf_path` (no table of names). Leaves are matched by
path, and every leaf whose (shape, partition_spec) differs, or that exists on one side only, is
printed (logical axes as written: `[]`, a leaf with none, is not one null per dimension). As a
check that does not depend on names at all, the multisets of (shape,
partition_spec) over all leaves must also cancel exactly. The mesh and, when both folders have
them, the logical axes are compared the same way. What is left here is only what differs in file
format: the key syntax, the mesh per leaf, and the logical axes under `partition_spec`.

A dump of MaxText's NNX build (`['model']/['decoder']/.../.value`, `['optimizer']/['opt_state']/[0]/['mu']/...`)
reads the same way (an NNX variable's trailing `.value` is no level, as a flax box's value is none) and
compares with our golden of the same case written as that build (`pure_nnx`, data/maxtext_releases.yml), by
path, RNG-state leaves included. Its logical file holds mesh specs again, not logical axes: keep only its
named file.

Exit status: 0 when everything matches, 1 when something differs, 2 on bad input (one line).
Reads JSON only: no JAX import, so it runs in a fraction of a second. `main(argv)` (the command line)
and `compare()` also run inside a caller's own process: the tests load this file with runpy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a script run from a checkout finds the package beside it; loaded, sys.path stays
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sharding_dump.core.specs import leaf_path, spec_to_json  # noqa: E402  (jax-free: the package's normalisers)

NAMED, LOGICAL = "named_shardings.json", "logical_shardings.json"

Leaf = tuple[tuple[int, ...], str]  # (shape, canonical spec text)


class BadInput(Exception):
    """A missing or unreadable input: reported as one line, exit status 2."""


def spec_text(spec: list[Any]) -> str:
    return json.dumps(spec, separators=(",", ":"))


def read_json(folder: Path, name: str, required: bool = True) -> dict[str, Any] | None:
    path = folder / name
    if not path.is_file():
        if required:
            raise BadInput(f"{path}: no such file (expected a case folder holding {name})")
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadInput(f"{path}: not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise BadInput(f"{path}: expected a JSON object")
    return doc


def entry_text(spec: Any, rank: int, exact: bool) -> str:
    """A spec as compared: padded to the rank (a partition spec), or as written (logical axes: `[]`,
    no logical axes, is not `[null, null]`, two unnamed dimensions)."""
    if exact:
        if not isinstance(spec, list):
            raise ValueError(spec)
        return spec_text(spec)
    return spec_text(spec_to_json(spec, rank))


def reference_leaves(doc: dict[str, Any], spec_key: str, where: Path, exact: bool = False) -> dict[str, Leaf]:
    """The reference's leaves by our path."""
    leaves = {}
    for path, entry in doc.items():
        try:
            key = leaf_path(path)
        except ValueError as err:
            raise BadInput(f"{where}: leaf {err}") from None
        if key in leaves:
            raise BadInput(f"{where}: leaf {path!r} reads as {key!r}, the path of an earlier leaf")
        try:
            shape = tuple(int(d) for d in entry["shape"])
            leaves[key] = (shape, entry_text(entry[spec_key], len(shape), exact))
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{where}: leaf {path!r} has no readable shape/{spec_key}") from None
    return leaves


def our_leaves(doc: dict[str, Any], spec_key: str, where: Path, exact: bool = False) -> dict[str, Leaf]:
    """Our leaves by path."""
    leaves = {}
    for path, entry in doc.get("tensors", {}).items():
        try:
            shape = tuple(int(d) for d in entry["shape"])
            leaves[path] = (shape, entry_text(entry[spec_key], len(shape), exact))
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{where}: tensor {path!r} has no readable shape/{spec_key}") from None
    return leaves


def reference_mesh(doc: dict[str, Any]) -> list[tuple[str, int]] | None:
    meshes = {json.dumps([(n, e["mesh"]["shape"][n]) for n in e["mesh"]["axis_names"]])
              for e in doc.values() if isinstance(e, dict) and "mesh" in e}
    if len(meshes) > 1:
        raise BadInput(f"reference: leaves disagree about the mesh ({len(meshes)} different meshes)")
    return [tuple(x) for x in json.loads(meshes.pop())] if meshes else None


def show(leaf: Leaf | None) -> str:
    return "(absent)" if leaf is None else f"shape {spec_text(list(leaf[0]))} spec {leaf[1]}"


def params_first(path: str) -> tuple[bool, str]:
    """Parameters (a Linen state's `params/`, an NNX state's `model/`) before optimizer slots: the parameter is
    what a reader looks for."""
    return (not path.startswith(("params/", "model/")), path)


def compare_leaves(label: str, ref: dict[str, Leaf], ours: dict[str, Leaf]) -> list[str]:
    """Report lines for one file kind; empty when every leaf matches and the multisets cancel."""
    lines = []
    differ = sorted((p for p in ref.keys() & ours.keys() if ref[p] != ours[p]), key=params_first)
    only_ref = sorted(ref.keys() - ours.keys(), key=params_first)
    only_ours = sorted(ours.keys() - ref.keys(), key=params_first)
    for path in differ:
        lines.append(f"  {path}\n      reference {show(ref[path])}\n      ours      {show(ours[path])}")
    for path in only_ref:
        lines.append(f"  only in reference: {path}  {show(ref[path])}")
    for path in only_ours:
        lines.append(f"  only in ours: {path}  {show(ours[path])}")
    left_ref = Counter(ref.values()) - Counter(ours.values())
    left_ours = Counter(ours.values()) - Counter(ref.values())
    for leaf, n in sorted(left_ref.items()):
        lines.append(f"  multiset remainder, reference x{n}: {show(leaf)}")
    for leaf, n in sorted(left_ours.items()):
        lines.append(f"  multiset remainder, ours x{n}: {show(leaf)}")
    matched = len(ref.keys() & ours.keys()) - len(differ)
    head = (f"{label}: {len(ref)} reference leaves, {len(ours)} ours; {matched} match by path, "
            f"{len(differ)} differ, {len(only_ref)} only in reference, {len(only_ours)} only in ours; "
            f"(shape, spec) multiset remainder {sum(left_ref.values())} + {sum(left_ours.values())}")
    return [head] + lines


def compare(reference: Path, ours: Path) -> tuple[bool, str]:
    """(everything matches, report text)."""
    for folder in (reference, ours):
        if not folder.is_dir():
            raise BadInput(f"{folder}: no such case folder")
    ref_named, our_named = read_json(reference, NAMED), read_json(ours, NAMED)
    report = [f"reference {reference}", f"ours      {ours}"]
    ok = True
    ref_mesh = reference_mesh(ref_named)
    our_mesh = list(zip(our_named.get("mesh", {}).get("axis_names", []),
                        our_named.get("mesh", {}).get("axis_sizes", [])))
    if ref_mesh is not None and ref_mesh != our_mesh:
        ok = False
        report.append(f"mesh differs: reference {ref_mesh}  ours {our_mesh}")
    else:
        report.append("mesh: " + " ".join(f"{n}={s}" for n, s in our_mesh))
    lines = compare_leaves(NAMED, reference_leaves(ref_named, "partition_spec", reference / NAMED),
                           our_leaves(our_named, "partition_spec", ours / NAMED))
    ok &= len(lines) == 1
    report += lines
    ref_logical, our_logical = read_json(reference, LOGICAL, required=False), read_json(ours, LOGICAL, required=False)
    if ref_logical is not None and our_logical is not None:
        lines = compare_leaves(LOGICAL, reference_leaves(ref_logical, "partition_spec", reference / LOGICAL, True),
                               our_leaves(our_logical, "logical_axes", ours / LOGICAL, True))
        ok &= len(lines) == 1
        report += lines
    report.append("MATCH" if ok else "DIFFERENT")
    return ok, "\n".join(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path, help="a MaxText reference case folder")
    parser.add_argument("ours", type=Path, help="our golden folder of the same case")
    args = parser.parse_args(argv)
    try:
        ok, text = compare(args.reference, args.ours)
    except BadInput as err:
        print(f"compare_maxtext: error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
