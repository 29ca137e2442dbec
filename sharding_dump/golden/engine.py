"""Check-or-update: the one engine through which every golden is compared or (re)written.

:func:`check_or_update_folder` takes any documents (the user's own, from :func:`sharding_dump.dump_model`);
:func:`check_or_update` is the zoo's case-by-case client. The pytest plugin calls them with
update=False (or True under --sharding-update); the CLI with update=True. A golden folder is
rewritten as a whole (:func:`sharding_dump.golden.store.write_case_folder`), never through a symbolic
link inside the golden tree. This module imports no jax until a case is rendered.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, Mapping

from sharding_dump.core.format import GOLDEN_FILE_NAMES
from sharding_dump.errors import BadInput, os_error
from sharding_dump.golden import codec, diff, memory, store

UPDATE_HINT = "(or pytest --sharding-update)"
MAX_REPORT_LINES = 60  # of a failing golden test's report by default (pytest -vv: every tensor)
SUMMARY_KINDS = ("updated", "created", "unchanged", "deleted")  # what an update run did to each golden


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What check-or-update found or did for one golden folder."""

    label: str
    folder: Path
    status: str  # match | differs | missing | written
    report: str = ""
    files: tuple[str, ...] = ()  # golden files written
    removed: tuple[str, ...] = ()  # stray names removed from the case folder
    replaced: tuple[str, ...] = ()  # golden paths replaced unread, each with what it was (update's repair)
    case: Any = None  # the zoo Case, when the folder belongs to one
    full_report: str = ""  # the report with every changed tensor (`report` is cut to MAX_REPORT_LINES)

    @property
    def ok(self) -> bool:
        return self.status in ("match", "written")


def display(path: Path) -> str:
    """A path as a user would type it: relative to the working directory when inside it."""
    try:
        return Path(path).resolve().relative_to(Path.cwd()).as_posix()
    except ValueError:
        return Path(path).as_posix()



def check_root(root: str | Path) -> Path:
    """The golden tree's root, refused (BadInput naming it and why) when it cannot hold a golden:
    empty, a regular file, below a regular file, or on a read-only or unwritable file system.
    Nothing is created."""
    if str(root) == "" or "\0" in str(root):
        raise BadInput(f"golden root {str(root)!r}: give the path of a folder (e.g. golden)")
    root = Path(root)
    probe = root
    while True:
        try:
            info = os.stat(probe)
        except FileNotFoundError:
            if probe.parent == probe:
                break
            probe = probe.parent
            continue
        except OSError as err:
            raise os_error("golden root", probe, err) from None
        code = None
        if not stat.S_ISDIR(info.st_mode):
            code = errno.ENOTDIR
        elif not os.access(probe, os.W_OK | os.X_OK):
            code = errno.EROFS if os.statvfs(probe).f_flag & os.ST_RDONLY else errno.EACCES
        if code is not None:
            where = "" if probe == root else f" ({probe})"
            raise BadInput(f"golden root {root}{where}: {os.strerror(code)} ({errno.errorcode[code]})")
        break
    return root



def _golden_bytes(path: Path) -> bytes | None:
    """A golden file's bytes, None when absent; anything but a readable regular file is BadInput."""
    if not os.path.lexists(path):
        return None
    return codec.read_regular(path)


def _listing(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    except OSError as err:
        raise os_error("golden folder", folder, err) from None


def _extras(folder: Path) -> list[str]:
    """Names in a case folder that no case writes there (hand-made files, leftover temps)."""
    return [name for name in _listing(folder) if name not in GOLDEN_FILE_NAMES and not store.is_companion(name)]


def compare(folder: Path, fresh: Mapping[str, bytes], label: str, command: str,
            current: Mapping[str, bytes | None] | None = None) -> Outcome:
    """Compares fresh bytes with the golden folder (`current`: its files, read already); on a
    difference, a per-tensor report. `command` is what a user runs to accept the change."""
    if current is None:
        current = {name: _golden_bytes(folder / name) for name in fresh}
    missing = [name for name in fresh if current.get(name) is None]
    if missing:
        return Outcome(label, folder, "missing",
                       f"no golden for {label} ({', '.join(missing)} missing in {display(folder)}).\n"
                       f"Create it with:\n    {command}")
    stale = [name for name in GOLDEN_FILE_NAMES if name not in fresh and os.path.lexists(folder / name)]
    trailer = [f"{name}: golden file that this case no longer produces" for name in stale]
    trailer += [f"{name}: not a golden file (remove it, or run pytest --sharding-update)" for name in _extras(folder)]
    if not trailer and all(current[name] == data for name, data in fresh.items()):
        return Outcome(label, folder, "match")  # equal bytes: nothing parsed
    old_docs, new_docs, changes, broken = {}, {}, {}, []
    for name, data in fresh.items():  # every document, for the memory of both sides
        new_docs[name] = json.loads(data)
        if current[name] == data:
            old_docs[name] = new_docs[name]
            continue
        try:
            old_docs[name] = codec.read_document(folder / name)
        except BadInput as err:
            broken.append(f"{name}: the golden file is not a valid golden document ({err})")
            continue
        changes[name] = diff.diff_documents(old_docs[name], new_docs[name])
    head = [f"{label}: the dump differs from the golden in {display(folder)}"]
    if changes:  # memory per device first: what a reviewer weighs before any tensor
        head += memory.lines(memory.compare(old_docs, new_docs))
    tail = ["If the change is intended, update the golden with:", f"    {command}"]

    def report(max_lines: int | None) -> str:
        lines = head + broken
        fixed = len(lines) + len(trailer) + len(tail) + command.count("\n")
        budget = None if max_lines is None else max_lines - fixed
        for name, found in changes.items():
            if not found:
                lines.append(f"{name}: same content, different bytes (not canonical JSON; rewrite it)")
                continue
            mesh = new_docs[name].get("mesh", {})  # the full report writes specs as the goldens do
            mesh_sizes = dict(zip(mesh.get("axis_names", ()), mesh.get("axis_sizes", ()))) if max_lines else None
            text = diff.format_diff(name, found, budget, mesh_sizes)
            lines += text.split("\n")
            if budget is not None:
                budget = max(budget - text.count("\n") - 1, 2)
        return "\n".join(lines + trailer + tail)

    return Outcome(label, folder, "differs", report(MAX_REPORT_LINES), full_report=report(None))


def _normal_mode(path: Path) -> bool:
    """Whether a golden file has the mode a new file gets under the umask (an older version of this
    tool left 0600 files behind)."""
    umask = os.umask(0)
    os.umask(umask)
    return stat.S_IMODE(os.lstat(path).st_mode) == 0o666 & ~umask



def read_folder(folder: Path, unread: Mapping[str, str] | None = None) -> dict[str, bytes | None]:
    """The golden files of a folder (None where absent); anything but readable regular files is
    BadInput, before any work is done. Names in `unread` (what :func:`replaceable` found) are not
    read: they hold b"", which no dump equals."""
    return {name: b"" if name in (unread or {}) else _golden_bytes(folder / name) for name in GOLDEN_FILE_NAMES}


def replaceable(folder: Path) -> dict[str, str]:
    """Golden paths of a case folder that an update replaces without reading them, name -> what is
    there: a folder where a golden file belongs, or a regular file above the size limit (a check
    refuses both; an update writes the dump in their place). A link, FIFO or device stays refused."""
    out = {}
    for name in GOLDEN_FILE_NAMES:
        try:
            info = os.lstat(folder / name)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode):
            out[name] = "a folder"
        elif stat.S_ISREG(info.st_mode) and info.st_size > codec.GOLDEN_MAX_BYTES:
            out[name] = f"a file of {info.st_size} bytes, above the limit of {codec.GOLDEN_MAX_BYTES}"
    return out


def check_or_update_folder(folder: str | Path, documents: Mapping[str, Any], update: bool, label: str | None = None,
                           command: str = UPDATE_HINT, current: Mapping[str, bytes | None] | None = None,
                           replaced: Mapping[str, str] | None = None) -> Outcome:
    """The one check-or-update engine: compares `documents` ({file name: JSON document, or its
    canonical bytes}) with the golden `folder`, or (update=True) replaces the folder as a whole when
    anything differs (golden files no longer produced, stray files and temps of a killed run go
    with the old folder). `current` is the folder as :func:`read_folder` read it, if already read;
    `replaced` what it left unread (:func:`replaceable`), which the outcome names.

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
    if current is None:
        current = read_folder(folder)
    fresh = {name: data for name, data in documents.items() if isinstance(data, bytes)}
    fresh.update(codec.render({name: doc for name, doc in documents.items() if not isinstance(doc, bytes)}))
    fresh = dict(sorted(fresh.items()))
    for name, data in fresh.items():  # what equals its golden passed its schema when it was written
        if current.get(name) != data:
            doc = documents[name]
            codec.check_bytes(data, name, None if isinstance(doc, bytes) else doc)
    if not update:
        return compare(folder, fresh, label, command, current)
    try:
        store.recover_leftovers(folder)
    except OSError as err:
        raise os_error("golden folder", folder, err) from None
    extras = _extras(folder)
    stale = [name for name in GOLDEN_FILE_NAMES if name not in fresh and current.get(name) is not None]
    written = sorted(name for name, data in fresh.items()
                     if current.get(name) != data or not _normal_mode(folder / name))
    if not written and not extras and not stale:
        return Outcome(label, folder, "match")
    check_root(folder)
    carried = {name: codec.read_regular(folder / name) for name in _listing(folder) if store.is_companion(name)}
    store.write_case_folder(folder, {**carried, **fresh})
    return Outcome(label, folder, "written", files=tuple(written + stale), removed=tuple(extras),
                   replaced=tuple(f"{name} ({what})" for name, what in sorted((replaced or {}).items())))


def summary_line(counts: Mapping[str, int]) -> str:
    """What an update did to the goldens, one line (`sharding-dump goldens: 1 updated, 2 created, ...`).

    >>> summary_line({"created": 2, "unchanged": 5})
    'sharding-dump goldens: 0 updated, 2 created, 5 unchanged, 0 deleted'
    """
    return "sharding-dump goldens: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in SUMMARY_KINDS)
