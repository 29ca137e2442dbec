"""pytest plugin: golden checks for sharding cases, registered by the `pytest11` entry point.

With `[tool.sharding-dump]` in the project's pyproject.toml (see :mod:`sharding_dump.zoo.project`) naming
case files, `pytest` collects one test per case of them from that pyproject.toml, with no test code:
the dump must equal its golden, byte for byte; plus one test for stale goldens. `--sharding-update`
rewrites what differs, creates what is missing, deletes the stale paths, and prints how many goldens
it updated, created, left unchanged and deleted (under pytest-xdist too). The ini options
`sharding_dump_cases` and `sharding_dump_golden_dir` override the table.

The `sharding_golden` fixture does the same for hand-written tests::

    def test_mine(sharding_golden):
        sharding_golden.check(Case.make("tiny", "cpu-8", "tp"))  # names resolved as the CLI resolves them

    @pytest.mark.parametrize("case", load_matrix("cases.yml"), ids=lambda c: c.label)
    def test_golden(case, sharding_golden):
        sharding_golden.check(case)

    def test_no_stale_goldens(sharding_golden):
        sharding_golden.check_stale(load_matrix("cases.yml"))

One golden world: a golden folder that any check of the run used (a case of the case files, a
fixture test's case) is used; stale means used by no test. When the run holds fixture tests beside
the stale check, the stale verdict waits for the end of the run, when every test has said which
goldens it used: then it fails the run (exit status 1), is a warning under `--sharding-warn-unused`
(syrupy's `--snapshot-warn-unused`), or, under `--sharding-update` with no failed test, deletes them.

A missing golden is a failure, never a skip. A failure in the user's code is its one line (file and
line of the raise); `--tb=long` or `--tb=native` adds its whole traceback. Importing this module
imports no JAX and changes no environment variable: everything heavy is imported when a golden is
checked.

`--sharding-verify` (off by default) also compiles every checked case's training step on fake CPU
devices (`sharding-dump verify`) and fails the case on any verify failure.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import pytest

if TYPE_CHECKING:
    from sharding_dump.golden.engine import Outcome
    from sharding_dump.zoo.case import Case
    from sharding_dump.zoo.project import Project

SUMMARY_KEY = "sharding_dump_goldens"  # user_properties entry: (key, (kind, count))
USED_KEY = "sharding_dump_used"  # (key, case folder): a golden check used that folder
DEFERRED_KEY = "sharding_dump_stale_check"  # (key, (root, case folders, left out)): a stale check left to the end
FIXTURE = "sharding_golden"
REPLACED = "replaced "  # a kind that names a golden path an update replaced without reading it


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sharding-dump")
    group.addoption("--sharding-update", action="store_true", default=False,
                    help="rewrite golden files that differ from the dump, create missing ones, delete stale "
                         "ones (same bytes as the CLI writes)")
    group.addoption("--sharding-verify", action="store_true", default=False,
                    help="also compile each checked case's training step on fake CPU devices (sharding-dump "
                         "verify): fail on remats, large replicated values or compiled shardings unlike the golden")
    group.addoption("--sharding-warn-unused", action="store_true", default=False,
                    help="golden paths no test of the run used (stale) are a warning at the end of the run, not a "
                         "failure (pytest --sharding-update deletes them)")
    from sharding_dump.commands.options import TIME_LIMIT_HELP, seconds

    group.addoption("--sharding-time-limit", type=seconds, default=None, metavar="SECONDS",
                    help=TIME_LIMIT_HELP.replace("; then one error line, exit 2", "; then the case's test fails"))
    parser.addini("sharding_dump_cases", type="paths",
                  help="sharding-dump case files (overrides cases of [tool.sharding-dump])")
    parser.addini("sharding_dump_golden_dir", type="string", default=None,
                  help="root of the golden tree, relative to the ini file (overrides golden-dir of [tool.sharding-dump])")


def project_of(config: pytest.Config) -> "Project":
    """The project configuration for this run: [tool.sharding-dump] of the project the paths given to
    pytest are in (a pyproject.toml named on the command line is its own project), else the nearest one
    at or above pytest's ini file (its rootdir when there is none), else at or above the invocation
    folder; then the ini options. So `pytest repo/`, `pytest repo/pyproject.toml::CASE` and a run from
    `repo/tests` find the same cases. Bad configuration is a usage error (one line, no traceback)."""
    cached = getattr(config, "_sharding_dump_project", None)
    if cached is not None:
        return cached
    from sharding_dump.errors import BadInput
    from sharding_dump.zoo.project import find_pyproject, load_project

    base = Path(config.inipath).parent if config.inipath else Path(config.rootpath)
    invocation = Path(config.invocation_params.dir)
    try:
        around = sorted({source for path in _arg_paths(config)
                         if (source := find_pyproject(path if path.is_dir() else path.parent))})
        if len(around) > 1:
            raise BadInput(f"the paths given are in {len(around)} projects with [tool.sharding-dump] "
                           f"({', '.join(map(str, around))}): run one project per pytest run")
        source = next(iter(around), None) or find_pyproject(base.resolve()) or find_pyproject(invocation.resolve())
        project = load_project(source.parent if source else invocation)
        project = project.with_overrides(config.getini("sharding_dump_cases") or None,
                                         config.getini("sharding_dump_golden_dir") or None, base)
    except BadInput as err:
        raise pytest.UsageError(f"sharding-dump: error: {err}") from None
    config._sharding_dump_project = project  # type: ignore[attr-defined]
    return project


def _arg_paths(config: pytest.Config) -> list[Path]:
    """The existing paths among the run's collection arguments (`path::test` ids cut to the path)."""
    invocation = Path(config.invocation_params.dir)
    paths = [(invocation / arg.split("::", 1)[0]).resolve() for arg in config.args]
    return [path for path in paths if path.exists()]


def _anchor(config: pytest.Config) -> Path | None:
    """The file the generated tests hang under: the pyproject.toml with [tool.sharding-dump] (or the
    ini file naming the case files); None when no case file is configured."""
    project = project_of(config)
    if config.getini("sharding_dump_cases") and config.inipath:
        return Path(config.inipath).resolve()
    if project.source is None or not (project.cases or project.maxtext_cases):
        return None
    return project.source


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.name in ("pyproject.toml", "pytest.ini", "tox.ini", "setup.cfg", ".pytest.ini") \
            and file_path.resolve() == _anchor(parent.config):
        return CaseMatrix.from_parent(parent, path=file_path)
    return None


class CaseMatrix(pytest.File):
    """The configured case files as tests: one per case, then the stale-golden check."""

    def collect(self) -> Iterator[pytest.Item]:
        from sharding_dump.errors import BadInput
        from sharding_dump.zoo.matrix import load_project_cases

        from sharding_dump.maxtext.case import load_cases

        project = project_of(self.config)
        try:
            cases = load_project_cases(project) if project.cases or not project.maxtext_cases else []
            cases += [case for path in project.maxtext_cases for case in load_cases(path)]
        except BadInput as err:
            raise self.CollectError(f"sharding-dump: error: {err}") from None
        for case in cases:
            yield CaseItem.from_parent(self, name=case.label, case=case)
        yield StaleItem.from_parent(self, name="no stale goldens", cases=cases)


class CaseItem(pytest.Item):
    """One case: its dump must equal its golden (or, under --sharding-update, becomes it)."""

    def __init__(self, *, case: "Case", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case = case

    def runtest(self) -> None:
        from sharding_dump.errors import BadInput

        try:
            checker_for(self.config, self).check(self.case)
        except BadInput as err:  # a rule or card file of the case: one line, as the CLI says it
            fail(self.config, str(err), err)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, pytest.fail.Exception):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, None, str]:
        return self.path, None, f"sharding golden {self.name}"


class StaleItem(pytest.Item):
    """Golden paths no configured case produces: a failure naming them, deleted under --sharding-update."""

    def __init__(self, *, cases: list["Case"], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cases = cases

    def runtest(self) -> None:
        checker_for(self.config, self).check_stale(self.cases)

    repr_failure = CaseItem.repr_failure

    def reportinfo(self) -> tuple[Path, None, str]:
        return self.path, None, "stale goldens"


class GoldenChecker:
    """Checks (or, under --sharding-update, rewrites) one case's golden folder, and notes on the test
    item what it did for the summary line."""

    def __init__(self, root: Path, update: bool, item: pytest.Item | None = None, verify: bool = False,
                 time_limit: float | None = None) -> None:
        self.root = root
        self.update = update
        self.item = item
        self.config = item.config if item is not None else None
        self.verify = verify
        self.time_limit = time_limit  # seconds per call into the user's code and per compile (None: default)

    def _note(self, kind: str, count: int = 1) -> None:
        if self.item is not None and count:
            self.item.user_properties.append((SUMMARY_KEY, (kind, count)))

    def check(self, case: "Case") -> "Outcome":
        """Fails the test (one line, or the diff) unless the case's dump equals its golden; every call
        into the user's code it makes is bounded by the time limit. The case's golden folder counts as
        used by a test of this run (never stale), whatever the outcome."""
        from sharding_dump.commands.options import time_limit_of

        if self.item is not None:
            self.item.user_properties.append((USED_KEY, str(golden_folder(case, self.root))))

        with time_limit_of(self.time_limit, project=False):  # the project's limit is in self.time_limit
            return self._check(case)

    def _check(self, case: "Case") -> "Outcome":
        from sharding_dump.errors import BadInput, one_line

        try:
            outcome, kind = _golden_where_served(case, self.root, self.update)
            if self.update:
                self._note(kind)
                for what in outcome.replaced:  # the summary says what the update replaced unread
                    from sharding_dump.golden.engine import display

                    self._note(f"{REPLACED}{display(outcome.folder)}/{what}")
                return outcome
        except BadInput as err:  # a damaged golden tree, the user's code failing: one line, like the CLI
            fail(self.config, f"{case.label}: {one_line(str(err))}", err)
        if not outcome.ok:  # -vv: every changed tensor, else a report of at most MAX_REPORT_LINES lines
            verbose = self.item is not None and self.item.config.get_verbosity() >= 2
            pytest.fail(outcome.full_report if verbose and outcome.full_report else outcome.report, pytrace=False)
        if self.verify:  # --sharding-verify: the compiled step too
            from sharding_dump.commands.verify.render import render_case
            from sharding_dump.commands.verify.run import verify_case
            from sharding_dump.commands.verify.settings import Options, default_threshold

            try:
                result = verify_case(case, Options(default_threshold(), self.root))
            except BadInput as err:  # the program failed in the compiling process: its own line
                fail(self.config, f"{case.label}: {one_line(str(err))}", err)
            if result.failures:
                pytest.fail(render_case(result), pytrace=False)
        return outcome

    def check_stale(self, cases: Iterable["Case"]) -> list[Path]:
        """Fails naming every golden path that neither a case of `cases` nor any golden check of this
        run uses; under --sharding-update removes them and returns what it removed. When another test
        of the run checks goldens with the `sharding_golden` fixture (or under --sharding-warn-unused),
        the verdict is the run's: given at its end, from every golden folder its tests used (under
        pytest-xdist too), as a failing exit status, a warning, or the deletion; left open, with a
        warning, when a test using the fixture was deselected or the run stopped early."""
        from sharding_dump.golden import stale

        folders = [golden_folder(case, self.root) for case in cases]
        if self.item is not None and (self.config.getoption("--sharding-warn-unused") or self._fixture_tests()):
            left_out = getattr(self.config, "_sharding_dump_deselected", 0)
            self.item.user_properties.append((DEFERRED_KEY, (str(self.root), [str(f) for f in folders], left_out)))
            return []
        paths = stale.stale_paths(self.root, folders)
        if paths and not self.update:
            pytest.fail(stale.report(paths), pytrace=False)
        stale.remove(paths)
        self._note("deleted", len(paths))
        return paths


    def _fixture_tests(self) -> bool:
        """True when a test of this run other than this one checks goldens with the fixture (or one
        was deselected): the goldens it writes are known only once it has run."""
        return getattr(self.config, "_sharding_dump_deselected", 0) > 0 or any(
            item is not self.item and FIXTURE in getattr(item, "fixturenames", ()) for item in self.item.session.items)


def _golden(case: "Case", root: Path, update: bool) -> tuple["Outcome", str]:
    """The case's golden checked, or (update) rewritten with what the update did, in this process."""
    from sharding_dump.maxtext.case import MaxTextCase

    if isinstance(case, MaxTextCase):  # run through the installed MaxText's own code
        from sharding_dump.maxtext import goldens
    else:
        from sharding_dump.zoo import goldens
    if update:
        return goldens.update(case, root, repair=True)
    return goldens.check_or_update(case, root, update=False), ""


def _golden_where_served(case: "Case", root: Path, update: bool) -> tuple["Outcome", str]:
    """:func:`_golden`, for a user's program in a worker process started with the case's device count
    when this process has another and the check fails here (a program may build its mesh over
    `jax.devices()`): the plugin never changes the user's process (its XLA_FLAGS, its backend)."""
    from sharding_dump.commands import options
    from sharding_dump.maxtext.case import MaxTextCase

    count = None if isinstance(case, MaxTextCase) else options.cpu_devices(case)
    return options.where_served(count, _golden, case, root, update)


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Counts the deselected tests that use the fixture (-k, -m, --deselect, pytest-split's groups):
    the goldens they would have used are unknown, so the run's stale verdict is left undecided."""
    if items:
        config = items[0].config
        left_out = sum(FIXTURE in getattr(item, "fixturenames", ()) for item in items)
        config._sharding_dump_deselected = getattr(config, "_sharding_dump_deselected", 0) + left_out  # type: ignore[attr-defined]


def golden_folder(case: Any, root: Path) -> Path:
    """A case's golden folder under `root`: a zoo case's, or one run through the installed MaxText."""
    from sharding_dump.maxtext.case import MaxTextCase
    from sharding_dump.zoo.case import golden_dir

    return case.folder(root) if isinstance(case, MaxTextCase) else golden_dir(case, root)


def fail(config: pytest.Config | None, line: str, err: BaseException) -> None:
    """Fails the test with the error's one line, as the CLI prints it; under `--tb=long` or
    `--tb=native`, with the whole traceback of the user's code that failed below it."""
    from sharding_dump.errors import traceback_text

    __tracebackhide__ = True
    text = f"sharding-dump: error: {line}"
    if config is not None and config.getoption("tbstyle", "auto") in ("long", "native") and traceback_text(err):
        text += f"\n\nThe user's code raised:\n{traceback_text(err).rstrip()}"
    raise pytest.fail.Exception(text, pytrace=False) from None  # the chain is told above, or not asked for


def checker_for(config: pytest.Config, item: pytest.Item | None) -> GoldenChecker:
    project = project_of(config)
    limit = config.getoption("--sharding-time-limit")
    return GoldenChecker(project.golden_dir, config.getoption("--sharding-update"), item,
                         config.getoption("--sharding-verify"), project.time_limit if limit is None else limit)


@pytest.fixture
def sharding_golden(request: pytest.FixtureRequest) -> GoldenChecker:
    """The golden checker for this project's golden folder and mode."""
    return checker_for(request.config, request.node)


# --- the summary line (tallied where reports arrive: the only process, or xdist's controller) -------

class _Tally:
    """Counts what --sharding-update did, from the reports: each item notes its outcome in its
    user_properties, which pytest-xdist carries from the workers to the controller."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.used: set[str] = set()  # every golden case folder a check of this run used
        self.deferred: dict[str, set[str]] = {}  # golden root -> case folders of the stale checks left to the end
        self.stale: list[Path] = []
        self.kept = ""  # why --sharding-update did not delete the stale paths (a test failed, or did not run)
        self.left_out = 0  # tests using the fixture that the run deselected

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        for key, value in report.user_properties:
            if key == SUMMARY_KEY:
                kind, count = value
                self.counts[kind] += count
            elif key == USED_KEY:
                self.used.add(value)
            elif key == DEFERRED_KEY:
                root, folders, left_out = value
                self.deferred.setdefault(root, set()).update(folders)
                self.left_out = max(self.left_out, left_out)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """The stale checks left to the end: a golden path is stale when no test of the run used it."""
        if not self.deferred or hasattr(session.config, "workerinput"):
            return
        from sharding_dump.golden import stale

        for root, folders in sorted(self.deferred.items()):
            inside = [Path(f) for f in sorted(folders | self.used) if Path(f).is_relative_to(root)]
            self.stale += stale.stale_paths(root, inside)
        undecided = ""  # tests that did not run may use them: the verdict is left open, said as a warning
        if self.left_out:
            undecided = f"{self.left_out} test(s) using the {FIXTURE} fixture were deselected"
        elif session.shouldstop or session.shouldfail:
            undecided = "the run stopped before every test ran"
        if self.stale and (undecided or (session.config.getoption("--sharding-update") and session.testsfailed)):
            self.kept = undecided or "a test failed, so the goldens it uses are not known"
            return
        if session.config.getoption("--sharding-update"):
            stale.remove(self.stale)
            self.counts["deleted"] += len(self.stale)
            self.stale = []
        elif self.stale and not session.config.getoption("--sharding-warn-unused") \
                and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_report_collectionfinish(self, config: pytest.Config, items: list[pytest.Item]) -> str | None:
        """Under --sharding-update, what the run will work on before it starts (pytest's progress
        then counts the cases done; -v names each case as it is dumped)."""
        cases = sum(1 for item in items if isinstance(item, CaseItem))
        if not config.getoption("--sharding-update") or not cases:
            return None
        from sharding_dump.golden.engine import display

        how = "" if config.get_verbosity() > 0 else " (-v names each case as it is dumped)"
        return f"sharding-dump: updating the goldens of {cases} case{'s' * (cases != 1)} in " \
               f"{display(project_of(config).golden_dir)}{how}"

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        if self.kept:  # stale paths left undecided, or not deleted
            terminalreporter.write_line(f"sharding-dump: warning: {len(self.stale)} golden path(s) no test of this run "
                                        f"used, left alone: {self.kept}", yellow=True, bold=True)
        elif self.stale:
            from sharding_dump.golden import stale

            warn = config.getoption("--sharding-warn-unused")
            terminalreporter.write_line(f"sharding-dump: {'warning' if warn else 'error'}: {stale.report(self.stale)}",
                                        yellow=warn, red=not warn, bold=True)
        if config.getoption("--sharding-update") and sum(self.counts.values()):
            from sharding_dump.golden.engine import summary_line

            for kind in sorted(k for k in self.counts if k.startswith(REPLACED)):
                terminalreporter.write_line(f"sharding-dump: {kind} by the dump")
            terminalreporter.write_line(summary_line({k: n for k, n in self.counts.items()
                                                      if not k.startswith(REPLACED)}))


class _Collected:
    """Says so when a project configures cases but none of its golden tests is selected (a CI job
    that runs `pytest tests/` would otherwise pass while checking no golden)."""

    def __init__(self, anchor: Path, rootpath: Path, in_paths: bool) -> None:
        self.anchor = anchor
        self.rootpath = rootpath
        self.in_paths = in_paths
        self.seen = False
        self.fixture_ran = False  # a hand-written test checked a golden with the sharding_golden fixture

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.seen = self.seen or any(isinstance(item, (CaseItem, StaleItem)) for item in session.items)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.fixture_ran = self.fixture_ran or any(key == USED_KEY for key, _ in report.user_properties)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        # under pytest-xdist the workers collect: the controller sees their selected test ids
        self.seen = self.seen or any((self.rootpath / i.split("::", 1)[0]).resolve() == self.anchor
                                     for i in ids if "::" in i)

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        if self.seen or hasattr(config, "workerinput") or self._failed_to_collect(terminalreporter):
            return
        why = ("-k/-m deselected all of them" if self.in_paths else
               f"it is not among the paths given: add {self.anchor.name} to them, or run pytest without paths")
        what = ("the golden tests of the case files did not run" if self.fixture_ran else  # only the fixture's did
                "no golden test ran")
        terminalreporter.write_line(f"sharding-dump: warning: {what}: {self.anchor} configures "
                                    f"sharding cases, but {why}", yellow=True, bold=True)


    def _failed_to_collect(self, terminalreporter: Any) -> bool:
        # its own error line (a case file that cannot be read) already says why no golden test ran
        return any((self.rootpath / getattr(report, "nodeid", "").split("::", 1)[0]).resolve() == self.anchor
                   for report in terminalreporter.stats.get("error", []))


class _Working:
    """Under --sharding-update on a terminal (no -v, no xdist, not CI): while a case is dumped, the
    case and how many are left, after the progress dots, erased before the case's own letter. Written
    around pytest's accounting (save cursor, text, restore; then erase to the line's end), so its
    percentages stay where they are."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.writer: Any = None
        self.cases: list[str] = []
        self.shown = False

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        writer = self.config.get_terminal_writer()
        if writer.hasmarkup:  # pytest found a terminal (or was told to colour)
            self.writer = writer
            self.cases = [item.nodeid for item in session.items if isinstance(item, CaseItem)]

    @pytest.hookimpl(trylast=True)  # after pytest wrote the file's name
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        if nodeid not in self.cases:
            return
        index = self.cases.index(nodeid)
        label = nodeid.split("::", 1)[-1]
        text = f" dumping {label} ({index + 1} of {len(self.cases)}, {len(self.cases) - index - 1} left after it)"
        room = self.writer.fullwidth - max(self.writer.width_of_current_line, 0) - 12  # " [100%]" and the letters
        if room < 20:
            return
        text = text if len(text) <= room else text[:room - 3] + "..."
        self._raw(f"\x1b7{text}\x1b8")
        self.shown = True

    @pytest.hookimpl(tryfirst=True)  # before pytest writes the case's letter
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.shown:
            self._raw("\x1b[K")
            self.shown = False

    def _raw(self, text: str) -> None:
        """Bytes past pytest's line accounting: TerminalWriter.write_raw where pytest has it, else its stream."""
        if hasattr(self.writer, "write_raw"):
            self.writer.write_raw(text, flush=True)
        else:  # pytest 8.1
            self.writer._file.write(text)
            self.writer._file.flush()


def _covered(anchor: Path, paths: Iterable[Path]) -> bool:
    return any(path == anchor or path in anchor.parents for path in paths)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The worker processes golden checks started (one per device count) shut down with the run."""
    import sys

    options = sys.modules.get("sharding_dump.commands.options")
    if options is not None:
        options.close_workers()


def pytest_configure(config: pytest.Config) -> None:
    project_of(config)  # a bad [tool.sharding-dump] is a usage error before anything runs
    config.pluginmanager.register(_Tally(), "sharding-dump-tally")
    if config.getoption("--sharding-update") and config.get_verbosity() <= 0 and not hasattr(config, "workerinput") \
            and getattr(config.option, "dist", "no") == "no":
        from sharding_dump.commands.progress import line_based

        if not line_based():
            config.pluginmanager.register(_Working(config), "sharding-dump-working")
    anchor = _anchor(config)
    if anchor is None:
        return
    # A run without paths (from a subfolder, or with testpaths that leave it out) runs the project's
    # golden tests too; paths given explicitly are respected, and a warning says what they left out.
    in_paths = _covered(anchor, _arg_paths(config))
    if config.args_source is not pytest.Config.ArgsSource.ARGS and not in_paths:
        config.args.append(str(anchor))
        in_paths = True
    config.pluginmanager.register(_Collected(anchor, Path(config.rootpath), in_paths), "sharding-dump-collected")
