"""The zoo's cases through the golden engine: a case's folder, its bytes, its update command.

>>> import tempfile
>>> from sharding_dump.zoo.case import Case
>>> root = tempfile.mkdtemp()
>>> check_or_update(Case.make("qwen3-0.6b", "cpu-4", "default"), root, update=False).status
'missing'
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
from pathlib import Path

from sharding_dump.errors import BadInput, os_error
from sharding_dump.golden.engine import (
    UPDATE_HINT,
    Outcome,
    check_or_update_folder,
    read_folder,
    replaceable,
)
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.project import load_project


def update_command(case: Case, root: str | Path | None) -> str:
    """The command that rewrites `case`'s golden under `root`: with --golden-dir unless `root` is
    where `sharding-dump` run here writes anyway (the project's golden folder)."""
    if root is None or Path(root).resolve() == load_project().golden_dir:
        return case.command()
    return case.command(str(Path(root).resolve()))


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


def render(case: Case) -> dict[str, bytes]:
    """The case's golden bytes, traced under JAX's standard dtype promotion whatever the environment
    sets (JAX_NUMPY_DTYPE_PROMOTION=strict would otherwise reject the model's mixed-precision ops)."""
    import jax

    from sharding_dump.zoo.dump import render_case

    with jax.numpy_dtype_promotion("standard"):
        return render_case(case)


def check_or_update(case: Case, root: str | Path, update: bool, repair: bool = False) -> Outcome:
    """Compares a zoo `case` with its golden under `root`, or (update=True) rewrites its folder;
    `repair` (with update) replaces a golden path that cannot be read as one, a folder or a file
    above the size limit, instead of refusing it (:func:`replaceable`)."""
    folder = case_folder(case, root)
    unread = replaceable(folder) if update and repair else {}
    current = read_folder(folder, unread)  # a bad golden file is refused before any work
    outcome = check_or_update_folder(folder, render(case), update, label=case.label,
                                     command=f"{update_command(case, root)}\n{UPDATE_HINT}", current=current,
                                     replaced=unread)
    return dataclasses.replace(outcome, case=case)


def update(case: Case, root: str | Path, repair: bool = False) -> tuple[Outcome, str]:
    """check_or_update(update=True), and what it did to the golden: created, updated or unchanged
    (for the summary line after an update)."""
    folder = case_folder(case, root)
    existed = any(data is not None for data in read_folder(folder, replaceable(folder) if repair else {}).values())
    outcome = check_or_update(case, root, update=True, repair=repair)
    return outcome, "unchanged" if outcome.status == "match" else "updated" if existed else "created"
