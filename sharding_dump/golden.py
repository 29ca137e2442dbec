"""Check-or-update: the one function through which every golden is compared or (re)written.

The pytest plugin calls it with update=False (or True under --update-goldens); the CLI calls it with
update=True. Either way the bytes on disk are exactly :func:`sharding_dump.dump.render_case`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from sharding_dump import diff, serialize
from sharding_dump.case import Case, golden_dir
from sharding_dump.dump import render_case
from sharding_dump.errors import BadInput

GOLDEN_FILE_NAMES = ("named_shardings.json", "logical_shardings.json", "activation_shardings.json")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What check_or_update found or did for one case."""

    case: Case
    folder: Path
    status: str  # match | differs | missing | written
    report: str = ""
    files: tuple[str, ...] = ()

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


def compare(case: Case, folder: Path, fresh: dict[str, bytes], root: str | Path | None = None) -> Outcome:
    """Compares fresh bytes with the golden folder; on a difference, a per-tensor report."""
    missing = [name for name in fresh if not (folder / name).is_file()]
    if missing:
        return Outcome(case, folder, "missing",
                       f"no golden for {case.label} ({', '.join(missing)} missing in {display(folder)}).\n"
                       f"Create it with:\n    {update_command(case, root)}")
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
        return Outcome(case, folder, "match")
    text = (f"{case.label}: the dump differs from the golden in {display(folder)}\n" + "\n".join(reports) +
            f"\nIf the change is intended, update the golden with:\n    {update_command(case, root)}"
            f"\n(or pytest --update-goldens)")
    return Outcome(case, folder, "differs", text)


def check_or_update(case: Case, root: str | Path, update: bool) -> Outcome:
    """Compares `case` with its golden under `root`, or (update=True) rewrites it when it differs.

    A rewrite writes each file atomically and removes golden files the case no longer produces."""
    folder = golden_dir(case, root)
    fresh = render_case(case)
    if not update:
        return compare(case, folder, fresh, root)
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
    return Outcome(case, folder, "written" if written else "match", files=tuple(written))


def update(case: Case, root: str | Path) -> tuple[Outcome, str]:
    """check_or_update(update=True), and what it did to the golden: created, updated or unchanged
    (for the summary line after an update)."""
    existed = any((golden_dir(case, root) / name).is_file() for name in GOLDEN_FILE_NAMES)
    outcome = check_or_update(case, root, update=True)
    return outcome, "unchanged" if outcome.status == "match" else "updated" if existed else "created"
