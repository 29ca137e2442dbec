"""Stale goldens: anything in the golden tree that no case produces (a case renamed or dropped from
the matrix, a folder copied by hand, a stray file inside a case folder, a temp left by a killed run).
Left alone it would be reviewed and kept forever without being checked by anything.

The expected paths come from the case folders alone (never from what is on disk), so a scan can run while
other processes write the goldens of those cases: inside a case folder it only looks for names no case
writes there, and a temp folder of a golden write still in progress (its process alive) is left alone.

>>> import tempfile
>>> root = Path(tempfile.mkdtemp())
>>> case_folder = root / "llama2-7b/v5p-16/slice_1/rule_pure-fsdp"
>>> case_folder.mkdir(parents=True)
>>> (root / "llama2-7b/v5p-16/slice_1/rule_old").mkdir()
>>> [p.relative_to(root).as_posix() for p in stale_paths(root, [case_folder])]
['llama2-7b/v5p-16/slice_1/rule_old']
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from sharding_dump.core.format import GOLDEN_FILE_NAMES
from sharding_dump.golden import store
from sharding_dump.golden.engine import display


def stale_paths(root: str | Path, case_folders: Iterable[Path]) -> list[Path]:
    """The largest files and folders under `root` that are neither one of `case_folders` (nor
    inside one) nor on the way to one, in sorted order."""
    root = Path(root)
    expected = {Path(folder).relative_to(root).parts for folder in case_folders}
    on_the_way = {parts[:n] for parts in expected for n in range(1, len(parts))}
    stale: list[Path] = []

    def walk(folder: Path, parts: tuple[str, ...]) -> None:
        for child in _children(folder):
            child_parts = parts + (child.name,)
            if store.is_temp(child.name) and not store.is_leftover(child.name):
                continue  # another process is writing this case right now
            if child_parts in expected:
                if child.is_dir() and not child.is_symlink():
                    stale.extend(p for p in _children(child)
                                 if p.name not in GOLDEN_FILE_NAMES and not store.is_companion(p.name))
                else:
                    stale.append(child)
            elif child_parts in on_the_way and child.is_dir() and not child.is_symlink():
                walk(child, child_parts)
            else:
                stale.append(child)

    if root.is_dir():
        walk(root, ())
    return stale


def _children(folder: Path) -> list[Path]:
    """The entries of a folder, sorted; none when it has just been swapped away by a writer."""
    try:
        return sorted(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def remove(paths: Iterable[Path]) -> None:
    """Deletes stale files and folders (whole folders: nothing in them belongs to a case)."""
    for path in paths:
        store.remove_tree(path)


def report(paths: list[Path]) -> str:
    """Names every stale path and how to remove them."""
    lines = [f"{len(paths)} golden path{'' if len(paths) == 1 else 's'} that no case or golden test uses (stale):"]
    lines += [f"    {display(p)}{'/' if p.is_dir() else ''}" for p in paths]
    lines += ["A case was renamed or dropped from the case matrix, a golden test removed, or a folder added by hand.",
              "Remove them with:", "    pytest --sharding-update"]
    return "\n".join(lines)
