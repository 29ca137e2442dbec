"""Check-or-update: the one function through which every golden is compared or (re)written.

The pytest plugin calls it with update=False (or True under --update-goldens); the CLI calls it with
update=True. Either way the bytes on disk are exactly :func:`sharding_dump.dump.render_case`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from typing import TYPE_CHECKING, Any, Mapping

from sharding_dump import diff, serialize
from sharding_dump.errors import BadInput

if TYPE_CHECKING:
    from sharding_dump.case import Case

# The file names of every golden document kind (sharding_dump.core.documents builds them).
GOLDEN_FILE_NAMES = ("named_shardings.json", "logical_shardings.json", "activation_shardings.json")
UPDATE_HINT = "(or pytest --update-goldens)"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What check-or-update found or did for one golden folder."""

    label: str
    folder: Path
    status: str  # match | differs | missing | written
    report: str = ""
    files: tuple[str, ...] = ()
    case: Any = None  # the zoo Case, when the folder belongs to one

    @property
    def ok(self) -> bool:
        return self.status in ("match", "written")


def display(path: Path) -> str:
    """A path as a user would type it: relative to the working directory when inside it."""
    try:
        return Path(path).resolve().relative_to(Path.cwd()).as_posix()
    except ValueError:
        return Path(path).as_posix()


def update_command(case: Case, root: str | Path | None) -> str:
    """The command that rewrites `case`'s golden under `root`: with --golden-dir unless `root` is
    where `sharding-dump` run here writes anyway (the project's golden folder)."""
    from sharding_dump.project import load_project

    if root is None or Path(root).resolve() == load_project().golden_dir:
        return case.command()
    return case.command(str(Path(root).resolve()))


def compare(folder: Path, fresh: Mapping[str, bytes], label: str, command: str) -> Outcome:
    """Compares fresh bytes with the golden folder; on a difference, a per-tensor report.
    `command` is what a user runs to accept the change."""
    missing = [name for name in fresh if not (folder / name).is_file()]
    if missing:
        return Outcome(label, folder, "missing",
                       f"no golden for {label} ({', '.join(missing)} missing in {display(folder)}).\n"
                       f"Create it with:\n    {command}")
    stale = [p.name for p in sorted(folder.iterdir()) if p.name in GOLDEN_FILE_NAMES and p.name not in fresh]
    reports = []
    for name, data in fresh.items():
        path = folder / name
        if path.read_bytes() == data:
            continue
        try:
            old = serialize.read_document(path)
        except BadInput as err:
            reports.append(f"{name}: the golden file is not a valid golden document ({err})")
            continue
        changes = diff.diff_documents(old, json.loads(data))
        reports.append(diff.format_diff(name, changes) if changes else
                       f"{name}: same content, different bytes (not canonical JSON; rewrite it)")
    reports += [f"{name}: golden file that this case no longer produces" for name in stale]
    if not reports:
        return Outcome(label, folder, "match")
    text = (f"{label}: the dump differs from the golden in {display(folder)}\n" + "\n".join(reports) +
            f"\nIf the change is intended, update the golden with:\n    {command}")
    return Outcome(label, folder, "differs", text)


def check_or_update_folder(folder: str | Path, documents: Mapping[str, Any], update: bool, label: str | None = None,
                           command: str = UPDATE_HINT) -> Outcome:
    """The one check-or-update engine: compares `documents` ({file name: JSON document, or its
    canonical bytes}) with the golden `folder`, or (update=True) rewrites the files that differ and
    removes golden files no longer produced.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp()) / "tiny"
    >>> doc = {"format_version": 1, "kind": "logical", "mesh": {"axis_names": ["fsdp"], "axis_sizes": [4],
    ...        "shard_mode": "auto"}, "tensors": {"params/w": {"shape": [8], "logical_axes": ["embed"]}}}
    >>> check_or_update_folder(folder, {"logical_shardings.json": doc}, update=False).status
    'missing'
    >>> check_or_update_folder(folder, {"logical_shardings.json": doc}, update=True).files
    ('logical_shardings.json',)
    >>> check_or_update_folder(folder, {"logical_shardings.json": doc}, update=False).status
    'match'
    """
    folder = Path(folder)
    label = label or display(folder)
    fresh = {name: data if isinstance(data, bytes) else None for name, data in documents.items()}
    to_render = {name: doc for name, doc in documents.items() if fresh[name] is None}
    fresh.update(serialize.render(to_render))
    fresh = dict(sorted(fresh.items()))
    if not update:
        return compare(folder, fresh, label, command)
    written = []
    for name, data in fresh.items():
        path = folder / name
        if not path.is_file() or path.read_bytes() != data:
            serialize.write_atomic(path, data)
            written.append(name)
    for name in GOLDEN_FILE_NAMES:
        if name not in fresh and (folder / name).is_file():
            (folder / name).unlink()
            written.append(name)
    return Outcome(label, folder, "written" if written else "match", files=tuple(written))


def check_or_update(case: Case, root: str | Path, update: bool) -> Outcome:
    """Compares a zoo `case` with its golden under `root`, or (update=True) rewrites it."""
    from sharding_dump.case import golden_dir
    from sharding_dump.dump import render_case

    outcome = check_or_update_folder(golden_dir(case, root), render_case(case), update, label=case.label,
                                     command=f"{update_command(case, root)}\n{UPDATE_HINT}")
    return dataclasses.replace(outcome, case=case)


def update(case: Case, root: str | Path) -> tuple[Outcome, str]:
    """check_or_update(update=True), and what it did to the golden: created, updated or unchanged
    (for the summary line after an update)."""
    from sharding_dump.case import golden_dir

    existed = any((golden_dir(case, root) / name).is_file() for name in GOLDEN_FILE_NAMES)
    outcome = check_or_update(case, root, update=True)
    return outcome, "unchanged" if outcome.status == "match" else "updated" if existed else "created"
