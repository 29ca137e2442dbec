"""Check-or-update: the one function through which every golden is compared or (re)written.

The pytest plugin calls it with update=False (or True under --update-goldens); the CLI calls it with
update=True. Either way the bytes on disk are exactly :func:`sharding_dump.dump.render_case`, and a
case folder is rewritten as a whole (:func:`sharding_dump.serialize.write_case_folder`), never
through a symbolic link inside the golden tree.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from pathlib import Path

import jax

from sharding_dump import diff, serialize
from sharding_dump.case import Case, golden_dir
from sharding_dump.dump import render_case
from sharding_dump.errors import BadInput, os_error

GOLDEN_FILE_NAMES = tuple(serialize.FILE_KINDS)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What check_or_update found or did for one case."""

    case: Case
    folder: Path
    status: str  # match | differs | missing | written
    report: str = ""
    files: tuple[str, ...] = ()  # golden files written
    removed: tuple[str, ...] = ()  # stray names removed from the case folder

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


def case_folder(case: Case, root: str | Path) -> Path:
    """golden_dir, refusing a symbolic link or a regular file on the way from `root` (excluded) to
    the case folder (included): a golden is never read or written through a link out of the tree."""
    root = Path(root)
    folder = golden_dir(case, root)
    path = root
    for part in folder.relative_to(root).parts:
        path = path / part
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            break
        except OSError as err:
            raise os_error("golden folder", path, err) from None
        if stat.S_ISLNK(info.st_mode):
            raise BadInput(f"golden folder {path}: a symbolic link inside the golden tree; refusing to "
                           "write through it (replace it with a real folder)")
        if not stat.S_ISDIR(info.st_mode):
            raise BadInput(f"golden folder {path}: {os.strerror(errno.ENOTDIR)} (ENOTDIR)")
    return folder


def _golden_bytes(path: Path) -> bytes | None:
    """A golden file's bytes, None when absent; anything but a readable regular file is BadInput."""
    if not os.path.lexists(path):
        return None
    return serialize.read_regular(path)


def _extras(folder: Path) -> list[str]:
    """Names in a case folder that no case writes there (hand-made files, leftover temps)."""
    try:
        return sorted(name for name in os.listdir(folder) if name not in GOLDEN_FILE_NAMES)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise os_error("golden folder", folder, err) from None


def compare(case: Case, folder: Path, fresh: dict[str, bytes],
            current: dict[str, bytes | None] | None = None) -> Outcome:
    """Compares fresh bytes with the golden folder (`current`: its files, read already); on a
    difference, a per-tensor report."""
    if current is None:
        current = {name: _golden_bytes(folder / name) for name in fresh}
    missing = [name for name in fresh if current.get(name) is None]
    if missing:
        return Outcome(case, folder, "missing",
                       f"no golden for {case.label} ({', '.join(missing)} missing in {display(folder)}).\n"
                       f"Create it with:\n    {case.command()}")
    stale = [name for name in GOLDEN_FILE_NAMES if name not in fresh and os.path.lexists(folder / name)]
    reports = []
    for name, data in fresh.items():
        path = folder / name
        if current[name] == data:
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
    reports += [f"{name}: not a golden file (remove it, or run pytest --update-goldens)" for name in _extras(folder)]
    if not reports:
        return Outcome(case, folder, "match")
    text = (f"{case.label}: the dump differs from the golden in {display(folder)}\n" + "\n".join(reports) +
            f"\nIf the change is intended, update the golden with:\n    {case.command()}"
            f"\n(or pytest --update-goldens)")
    return Outcome(case, folder, "differs", text)


def _normal_mode(path: Path) -> bool:
    """Whether a golden file has the mode a new file gets under the umask (an older version of this
    tool left 0600 files behind)."""
    umask = os.umask(0)
    os.umask(umask)
    return stat.S_IMODE(os.lstat(path).st_mode) == 0o666 & ~umask


def render(case: Case) -> dict[str, bytes]:
    """The case's golden bytes, traced under JAX's standard dtype promotion whatever the environment
    sets (JAX_NUMPY_DTYPE_PROMOTION=strict would otherwise reject the model's mixed-precision ops)."""
    with jax.numpy_dtype_promotion("standard"):
        return render_case(case)


def check_or_update(case: Case, root: str | Path, update: bool) -> Outcome:
    """Compares `case` with its golden under `root`, or (update=True) rewrites it when it differs.

    A rewrite replaces the whole case folder in one step: golden files the case no longer produces,
    stray files and temps left by a killed run go with the old folder."""
    folder = case_folder(case, root)
    current = {name: _golden_bytes(folder / name) for name in GOLDEN_FILE_NAMES}  # refused before any work
    fresh = render(case)
    if not update:
        return compare(case, folder, fresh, current)
    try:
        serialize.recover_leftovers(folder)
    except OSError as err:
        raise os_error("golden folder", folder, err) from None
    extras = _extras(folder)
    written = sorted(name for name, data in fresh.items() if current[name] != data or not _normal_mode(folder / name))
    if not written and not extras:
        return Outcome(case, folder, "match")
    check_root(root)
    serialize.write_case_folder(folder, fresh)
    return Outcome(case, folder, "written", files=tuple(written), removed=tuple(extras))
