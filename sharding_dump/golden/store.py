"""Case folders on disk, changed atomically as a whole.

A case folder changes as a whole (:func:`write_case_folder`): the new folder is written beside the old
one under a temp name and the two are swapped in one step, so a reader, or a process killed at any
moment, sees the old folder or the new one, never a mix. Temp names are `.<name>.<new|old>-<pid>-<random>`;
one whose process is gone is a leftover, cleaned by the next write of that case and reported by the
stale check.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp()) / "case"
>>> write_case_folder(folder, {"a.json": b"{}"})
>>> write_case_folder(folder, {"b.json": b"[]"})
>>> sorted(p.name for p in folder.iterdir())
['b.json']
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import secrets
import shutil
import signal
from pathlib import Path
from typing import Any, Mapping

from sharding_dump.errors import os_error

# Files `sharding-dump verify --record` keeps beside a case's goldens: part of the case folder, carried
# over when the goldens are rewritten, never reported as stray.
COMPANION_NAME = re.compile(r"compiled_[A-Za-z0-9]+_jax-[0-9A-Za-z.+-]+\.json")


def is_companion(name: str) -> bool:
    """True for a file verify's --record writes beside the goldens (compiled_<backend>_jax-<version>.json)."""
    return COMPANION_NAME.fullmatch(name) is not None


TEMP_NAME = re.compile(r"\.(?P<name>.+)\.(?P<role>new|old|tmp)-(?P<pid>[0-9]+)-[0-9a-f]{8}")
FAULT_ENV = "SHARDING_DUMP_FAULT_AT"  # test hook: kill this process at the N-th step of a golden write
NO_EXCHANGE_ENV = "SHARDING_DUMP_NO_EXCHANGE"  # test hook: use the two-rename fallback of the swap

_steps = 0


def fault_point() -> None:
    """Test hook for the fault tests: with SHARDING_DUMP_FAULT_AT=N in the environment, the N-th call
    in this process kills it (SIGKILL, no clean-up), between any two steps of a golden write."""
    global _steps
    at = os.environ.get(FAULT_ENV, "")
    if not at.isdigit():
        return
    _steps += 1
    if _steps == int(at):
        os.kill(os.getpid(), signal.SIGKILL)

def temp_name(name: str, role: str) -> str:
    """A fresh temp name beside `name`, owned by this process."""
    return f".{name}.{role}-{os.getpid()}-{secrets.token_hex(4)}"

def is_leftover(name: str) -> bool:
    """A temp name whose owning process is gone (killed mid-write): safe to delete."""
    match = TEMP_NAME.fullmatch(name)
    if match is None:
        return False
    pid = int(match["pid"])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False

def is_temp(name: str) -> bool:
    """Any golden-write temp name (live or left over)."""
    return TEMP_NAME.fullmatch(name) is not None

def _write_new_file(path: Path, data: bytes) -> None:
    """Creates `path` (which must not exist) with the umask's normal mode and `data`, synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)

def write_atomic(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temp file in the same folder and a rename: readers see
    either the old file or the new one, never half of either. The file gets the umask's mode."""
    path = Path(path)
    tmp = path.parent / temp_name(path.name, "tmp")
    try:
        _write_new_file(tmp, data)
        os.replace(tmp, path)
    except OSError as err:
        remove_tree(tmp)
        raise os_error("cannot write", path, err) from None
    except BaseException:
        remove_tree(tmp)
        raise

def remove_tree(path: Path) -> None:
    """Deletes a file or folder tree, whatever is there (nothing when nothing is)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function

def exchange(a: Path, b: Path) -> bool:
    """Swaps two existing paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the
    system or file system cannot, so the caller falls back to two renames."""
    if os.environ.get(NO_EXCHANGE_ENV):
        return False
    try:
        function = _renameat2()
    except OSError:
        return False
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), os.fsdecode(a))

def recover_leftovers(folder: Path) -> list[Path]:
    """Finishes or undoes what a killed writer left beside `folder`: a case folder renamed away and
    not replaced is put back (so it is entirely old), every other leftover temp of it is deleted.
    Returns what it removed."""
    parent = folder.parent
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        match = TEMP_NAME.fullmatch(name)
        if match is None or match["name"] != folder.name or not is_leftover(name):
            continue
        path = parent / name
        if match["role"] == "old" and not os.path.lexists(folder):
            os.rename(path, folder)
            continue
        remove_tree(path)
        removed.append(path)
    return removed

def write_case_folder(folder: Path, files: Mapping[str, bytes]) -> None:
    """Makes `folder` hold exactly `files`, atomically as a whole: the new folder is written beside
    the old one and swapped in (RENAME_EXCHANGE where the system has it, else rename the old one
    away and the new one in; a kill between the two is undone by :func:`recover_leftovers`). Files
    and folders get the umask's normal mode. An OSError is BadInput naming the path."""
    folder = Path(folder)
    parent = folder.parent
    step_path = parent
    created = [p for p in (parent, *parent.parents) if not os.path.lexists(p)]
    try:
        parent.mkdir(parents=True, exist_ok=True)
        recover_leftovers(folder)
        new = parent / temp_name(folder.name, "new")
        step_path = new
        os.mkdir(new, 0o777)
        fault_point()
        try:
            for name, data in sorted(files.items()):
                step_path = new / name
                _write_new_file(new / name, data)
                fault_point()
            step_path = folder
            if not os.path.lexists(folder):
                os.rename(new, folder)
                fault_point()
            elif exchange(new, folder):
                fault_point()
                remove_tree(new)  # the old folder, now under the temp name
            else:
                old = parent / temp_name(folder.name, "old")
                os.rename(folder, old)
                fault_point()
                os.rename(new, folder)
                fault_point()
                remove_tree(old)
        except BaseException:
            remove_tree(new)
            raise
        fault_point()
        _fsync_dir(parent)
    except OSError as err:
        for path in created:  # the folders this call made, innermost first: nothing is left behind
            try:
                os.rmdir(path)
            except OSError:
                break
        raise os_error("cannot write golden", err.filename or step_path, err) from None

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

