"""Fixtures shared by this repository's tests.

jax, flax and the harness are imported here, when the session starts: pytester's in-process runs
forget every module imported after the `pytester` fixture was set up, jaxlib's native extension
aborts the process when it is imported a second time, and a re-imported flax would make two
`nn.Module` classes.
"""

import sys

# Compiled modules are written, as on a developer's machine, even where the environment sets
# PYTHONDONTWRITEBYTECODE (container images do): the two workers and the fresh processes that tests
# start would otherwise each compile the package and rewrite the test modules again (50 CPU s of a
# 300 CPU s run in a bare clone). Set before the imports below; `.ci/run` unsets the variable.
sys.dont_write_bytecode = False

import gc  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Iterator  # noqa: E402

import flax.linen  # noqa: F401
import flax.nnx  # noqa: F401
import jax  # noqa: F401
import optax  # noqa: F401
import pytest  # noqa: E402

import sharding_dump.commands.verify  # noqa: F401
import sharding_dump.zoo.dump  # noqa: F401
from helpers import REPO, forget_programs  # noqa: E402
from sharding_dump.core.gc_policy import fewer_collections


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Iterator[None]:
    """Every test traces models, so the harness's own collection policy holds for the whole session
    (without it a worker of `pytest -n 2` spent 8 to 13 s of its 45 s collecting garbage). At the
    end the heap the session built (traced steps, cached states) is frozen: pytest's last collection
    and the interpreter's exit then skip it (3 s of teardown per run)."""
    with fewer_collections():
        yield
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    """`pytest -n N` schedules by group (xdist's loadgroup) rather than test by test, so that the tests
    of one case (below) run in one worker, which traces the case's step once for all of them. A worker
    reads the mode from its own command line (where `-n N` alone says `load`): the controller hands it
    over (:func:`pytest_configure_node`), else the workers name no group and each traces every case."""
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadgroup"
    worker = getattr(config, "workerinput", None)
    if worker is not None and worker.get(LOADGROUP):
        config.option.loadgroup = True


LOADGROUP = "sharding_dump_loadgroup"  # the workerinput key that tells a worker to name its tests' groups


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    """(xdist, in the controller) Each worker learns that the run schedules by group."""
    node.workerinput[LOADGROUP] = node.config.option.dist == "loadgroup"  # type: ignore[attr-defined]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test of one case of the matrix (its golden test, and any test parametrized by the Case)
    joins the case's xdist group; so does a test whose parameters name a case by its label (a MaxText
    release's or Linen build's comparison, whose id or folder holds `<model>/<topology>/slice_<n>/rule_...`):
    the case is traced once per run, by the one worker that runs its group. Any other test that uses a
    module-scoped fixture of its test module (a program dumped in a subprocess, a rule edit dumped
    once) joins that fixture's group, so the fixture is built once per run rather than once per worker
    (before xdist reads the groups)."""
    from sharding_dump.zoo.case import Case

    for item in items:
        case = getattr(item, "case", None)
        if case is None and hasattr(item, "callspec"):
            case = next((value for value in item.callspec.params.values() if isinstance(value, Case)), None)
        if isinstance(case, Case):
            item.add_marker(pytest.mark.xdist_group(case.label))
        elif label := case_label_in_id(item):
            item.add_marker(pytest.mark.xdist_group(label))
        elif shared := _shared_fixtures(item):
            item.add_marker(pytest.mark.xdist_group(shared[0]))


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_group_ids(config: pytest.Config, items: list[pytest.Item]) -> None:
    """(xdist worker, after xdist's own hook) Each grouped test's id ends in `@group`, which the
    controller's loadgroup scheduler reads. xdist 3.8 writes the suffix to `item._nodeid`, which pytest
    9.2's structured ids no longer read (pytest-xdist issue #1386): the id is set here where it did not
    take, so the groups above hold on the pinned stack as on the oldest."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # pytest before 9.2: xdist's suffix took
        return
    for item in items:
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})
        if names and not item.nodeid.endswith("@" + "_".join(names)):
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")  # type: ignore[attr-defined]


# A case's label (Case.label, its golden folder under the golden root) inside a parametrized test's id.
_CASE_LABEL = re.compile(r"[^/:\s\[\]]+/[^/\s]+/slice_\d+/rule_[^/\s\[\]]+")


def case_label_in_id(item: pytest.Item) -> str | None:
    """The case label a parametrized test's id names (`0.2.5:qwen3-0.6b/tpu7x-16/slice_1/rule_default`
    names `qwen3-0.6b/tpu7x-16/slice_1/rule_default`), else one its text or path parameters name (a
    MaxText dump's folder `.../maxtext/blocks/<label>`), else None."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    texts = [callspec.id] + [str(value) for value in callspec.params.values() if isinstance(value, (str, Path))]
    return next((found.group(0) for text in texts if (found := _CASE_LABEL.search(text))), None)


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """`module:fixture` of each fixture wider than a test that `item` uses and its own test module defines."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return sorted(f"{d[-1].baseid}:{name}" for name in getattr(item, "fixturenames", ())
                  if (d := defs.get(name)) and d[-1].scope != "function" and d[-1].baseid.endswith(".py"))


@pytest.fixture(autouse=True)
def _in_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts in the checkout, wherever pytest was started (`cd /tmp && pytest CHECKOUT`):
    the messages it reads name paths as a user in the checkout sees them."""
    monkeypatch.chdir(REPO)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """A monkeypatch for editing an example program: every program built before or while it is used is
    forgotten, so each dump builds the program as it is edited (and, after the test, as it was)."""
    forget_programs()
    yield monkeypatch
    monkeypatch.undo()
    forget_programs()


@pytest.fixture
def mutated_rule(tmp_path: Path) -> Callable[[str, str, str], Path]:
    """`mutated_rule(rule, line, new_line)`: a copy of a packaged rule file with one line changed (the
    line must be there exactly once, so a test notices when the rule file moves on). The copy keeps the
    file name, so its cases share the original's golden folders and a golden check must fail."""

    def mutate(rule: str, line: str, new_line: str) -> Path:
        text = (REPO / f"sharding_dump/rules/{rule}.yml").read_text()
        assert text.count(line) == 1, f"{rule}.yml no longer has the line {line!r}"
        copy = tmp_path / "mutated" / f"{rule}.yml"
        copy.parent.mkdir(exist_ok=True)
        copy.write_text(text.replace(line, new_line))
        return copy

    return mutate


@pytest.fixture
def mini_project(pytester: pytest.Pytester) -> Callable[..., pytest.Pytester]:
    """`mini_project(files, table)`: a repository that adopts sharding-dump, in pytester's folder: a
    pyproject.toml whose `[tool.sharding-dump]` table is `table`, and `files` ({path: text})."""

    def make(files: dict[str, str], table: str = 'cases = ["cases.yml"]') -> pytest.Pytester:
        pytester.makefile(".toml", pyproject=f'[project]\nname = "my-trainer"\nversion = "0"\n\n'
                                             f'[tool.sharding-dump]\n{table}\n')
        for name, text in files.items():
            path = pytester.path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return pytester

    return make
