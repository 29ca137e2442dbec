"""Fixtures of the tests that edit an example program and dump it again."""

import pytest

from helpers import forget_programs


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A monkeypatch for editing an example program: every program built before or while it is used is
    forgotten, so each dump builds the program as it is edited (and, after the test, as it was)."""
    forget_programs()
    yield monkeypatch
    monkeypatch.undo()
    forget_programs()
