"""pytest plugin: golden checks for sharding cases.

Adds `--update-goldens` and the `sharding_golden` fixture. A test hands it a Case; the fixture runs
check-or-update against `<rootdir>/golden/` and fails with the per-tensor report (or, for a missing
golden, the exact command that creates it). A missing golden is a failure, never a skip.

    @pytest.mark.parametrize("case", load_matrix(), ids=lambda c: c.label)
    def test_golden(case, sharding_golden):
        sharding_golden.check(case)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sharding_dump.case import Case
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
        outcome = check_or_update(case, self.root, self.update)
        if not outcome.ok:
            pytest.fail(outcome.report, pytrace=False)
        return outcome


@pytest.fixture
def sharding_golden(request: pytest.FixtureRequest) -> GoldenChecker:
    """The golden checker for this session's root and mode."""
    config = request.config
    return GoldenChecker(Path(config.rootpath) / GOLDEN_DIR_NAME, config.getoption("--update-goldens"))
