"""A MaxText case's golden folder, checked or rewritten by the same engine as the zoo's goldens
(the same two calls as :mod:`sharding_dump.zoo.goldens`, so the pytest plugin runs either)."""

from __future__ import annotations

from pathlib import Path

from sharding_dump.golden.engine import UPDATE_HINT, Outcome, check_or_update_folder, read_folder, replaceable
from sharding_dump.maxtext.case import MaxTextCase


def check_or_update(case: MaxTextCase, root: str | Path, update: bool, repair: bool = False) -> Outcome:
    """The case dumped through the installed MaxText, compared with (or written as) its golden;
    `repair` (with update) replaces a golden path that cannot be read as one."""
    from sharding_dump.maxtext.program import maxtext

    folder = case.folder(root)
    unread = replaceable(folder) if update and repair else {}
    current = read_folder(folder, unread)  # a bad golden file is refused before MaxText runs
    return check_or_update_folder(folder, maxtext().documents(case), update, label=case.label,
                                  command=f"{case.command(str(root))}\n{UPDATE_HINT}", current=current,
                                  replaced=unread)


def update(case: MaxTextCase, root: str | Path, repair: bool = False) -> tuple[Outcome, str]:
    """check_or_update(update=True), and what it did: created, updated or unchanged."""
    folder = case.folder(root)
    existed = any(data is not None for data in read_folder(folder, replaceable(folder) if repair else {}).values())
    outcome = check_or_update(case, root, update=True, repair=repair)
    return outcome, "unchanged" if outcome.status == "match" else "updated" if existed else "created"
