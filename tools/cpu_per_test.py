"""A pytest plugin for `tools/bench.py --suite-cpu`: the CPU seconds of every test and of each
worker's start, written where the environment variable CPU_PER_TEST_DIR says (one file per process,
so each xdist worker writes its own). Loaded with `-p cpu_per_test` and tools/ on PYTHONPATH.

CPU, not wall: on a machine other people share, a test's CPU seconds (user + system, of the process
and of the child processes it waited for: a CLI run in a subprocess, pytester's xdist workers) are
what its wall time would be on a quiet machine. Each line is tab-separated:

    start    <CPU s of the process from its start to the end of collection>
    test     <CPU s in the process>  <CPU s of its children>  <wall s>  <node id>
    end      <CPU s of the process, start to end>
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import IO, Iterator

import pytest

DIR_VARIABLE = "CPU_PER_TEST_DIR"
_out: IO[str] | None = None


def cpu_seconds() -> tuple[float, float]:
    """(user + system CPU seconds of this process, of its waited-for children)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def pytest_configure(config: pytest.Config) -> None:
    """Opens this process's file: the controller's, or an xdist worker's (named after the worker)."""
    global _out
    folder = os.environ.get(DIR_VARIABLE)
    if folder:
        name = os.environ.get("PYTEST_XDIST_WORKER", "controller")
        _out = (Path(folder) / f"{name}.tsv").open("w", encoding="utf-8")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the process spent before its first test: interpreter, imports, conftest, collection."""
    if _out is not None:
        _out.write(f"start\t{cpu_seconds()[0]:.3f}\n")
        _out.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """One line per test: setup, call and teardown together (a module fixture counts in its first test)."""
    own, children = cpu_seconds()
    start = time.perf_counter()
    yield
    if _out is not None:
        own_after, children_after = cpu_seconds()
        _out.write(f"test\t{own_after - own:.3f}\t{children_after - children:.3f}\t"
                   f"{time.perf_counter() - start:.3f}\t{item.nodeid}\n")
        _out.flush()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The process's own CPU seconds in all, then the file is closed."""
    if _out is not None:
        _out.write(f"end\t{cpu_seconds()[0]:.3f}\n")
        _out.close()
