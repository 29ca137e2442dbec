"""pytest plugin: golden checks for sharding cases.

Adds `--update-goldens` and the `sharding_golden` fixture. A test hands it a Case; the fixture runs
check-or-update against `<rootdir>/golden/` and fails with the per-tensor report (or, for a missing
golden, the exact command that creates it). A missing golden is a failure, never a skip.

    @pytest.mark.parametrize("case", load_matrix(), ids=lambda c: c.label)
    def test_golden(case, sharding_golden):
        sharding_golden.check(case)

    def test_no_stale_goldens(sharding_golden):
        sharding_golden.check_stale(load_matrix())

`check_stale` fails with every golden path that none of the cases produces; under --update-goldens
it deletes them instead. It is one test item, so under pytest-xdist exactly one worker scans (and
deletes) and the report is the same as without xdist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pytest

from sharding_dump import stale
from sharding_dump.case import Case
from sharding_dump.errors import BadInput, one_line
from sharding_dump.golden import Outcome, check_or_update

GOLDEN_DIR_NAME = "golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sharding-dump")
    group.addoption("--update-goldens", action="store_true", default=False,
                    help="rewrite golden files that differ from the dump (same bytes as the CLI writes)")


class GoldenChecker:
    """Checks (or, under --update-goldens, rewrites) one case's golden folder."""

    def __init__(self, root: Path, update: bool) -> None:
        self.root = root
        self.update = update

    def check(self, case: Case) -> Outcome:
        try:
            outcome = check_or_update(case, self.root, self.update)
        except BadInput as err:  # a damaged golden tree: one line, like the CLI
            pytest.fail(f"{case.label}: {one_line(str(err))}", pytrace=False)
        if not outcome.ok:
            pytest.fail(outcome.report, pytrace=False)
        return outcome

    def check_stale(self, cases: Iterable[Case]) -> list[Path]:
        """Fails naming every golden path no case of `cases` produces; under --update-goldens removes
        them and returns what it removed."""
        paths = stale.stale_paths(self.root, cases)
        if paths and not self.update:
            pytest.fail(stale.report(paths), pytrace=False)
        stale.remove(paths)
        return paths


@pytest.fixture
def sharding_golden(request: pytest.FixtureRequest) -> GoldenChecker:
    """The golden checker for this session's root and mode."""
    config = request.config
    return GoldenChecker(Path(config.rootpath) / GOLDEN_DIR_NAME, config.getoption("--update-goldens"))
