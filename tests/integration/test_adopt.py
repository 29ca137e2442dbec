"""Adopting sharding-dump in another repository: a folder holding only a pyproject.toml with
[tool.sharding-dump], a rule file with mesh axes of its own naming and a case file. Plain `pytest`
(the plugin by its entry point, no conftest, no test file) runs one test per case; a missing golden
fails with the command that writes it where the project keeps its goldens; --sharding-update creates
them and says so; a one-line rule change fails exactly the cases that use the rule, naming tensors.

pytest runs in this process (pytester), so the cases share one traced model.
"""

from __future__ import annotations

import shlex
import textwrap

import pytest

from helpers import ADOPT_CASES as CASES
from helpers import ADOPT_FILES, ADOPT_TABLE
from helpers import ADOPT_TP_RULE as TP_RULE
from sharding_dump.commands import cli

TP_CASE = "qwen3-0.6b/cpu-8/slice_1/rule_tp_ici_model_parallelism=2"
DP_CASE = "qwen3-0.6b/cpu-8/slice_1/rule_dp_ici_replica_parallelism=-1"


@pytest.fixture
def project(mini_project) -> pytest.Pytester:
    return mini_project(ADOPT_FILES, table=ADOPT_TABLE)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # -p names the plugin only for a checkout that is not installed: with the entry point it is a no-op.
    return pytester.runpytest("-p", "sharding_dump.pytest_plugin", "-p", "no:cacheprovider", *args)


def test_pyproject_alone_is_a_test_suite(project: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    first = run(project)
    first.assert_outcomes(failed=2, passed=1)  # two cases without goldens; nothing stale
    out = first.stdout.str()
    assert f"FAILED pyproject.toml::{TP_CASE}" in out and f"FAILED pyproject.toml::{DP_CASE}" in out
    assert f"missing in sharding/goldens/{TP_CASE})" in out
    command = next(line.strip() for line in first.stdout.lines
                   if line.strip().startswith("sharding-dump --model") and "rule_tp" not in line and "tp.yml" in line)
    assert command == "sharding-dump --model qwen3-0.6b --topology cpu-8 --rule sharding/rules/tp.yml ici_model_parallelism=2"

    # The printed command, run in the project, writes the golden where the project keeps them.
    assert cli.main(shlex.split(command)[1:]) == 0
    assert "sharding/goldens/" + TP_CASE in capsys.readouterr().out
    assert (project.path / "sharding/goldens" / TP_CASE / "named_shardings.json").is_file()

    updated = run(project, "--sharding-update")
    updated.assert_outcomes(passed=3)
    updated.stdout.fnmatch_lines(["sharding-dump goldens: 0 updated, 1 created, 1 unchanged, 0 deleted"])
    run(project).assert_outcomes(passed=3)

    # One rule line changed: exactly the case using that rule file fails, naming the tensors.
    rule = project.path / "sharding/rules/tp.yml"
    rule.write_text(TP_RULE.replace("  - [mlp, model]\n", "  - [mlp, []]\n"))
    broken = run(project)
    broken.assert_outcomes(failed=1, passed=2)
    out = broken.stdout.str()
    assert f"FAILED pyproject.toml::{TP_CASE}" in out and DP_CASE not in out.split("short test summary")[1]
    assert "model/decoder/layers/mlp/wi_0/kernel  (and optimizer/opt_state/0/mu, optimizer/opt_state/0/nu)" in out
    assert 'partition_spec    golden [null,null,"model"]  now [null,null,null]' in out


def test_ini_options_override_the_table(project: pytest.Pytester) -> None:
    (project.path / "other.yml").write_text(CASES.split("\n  - ")[0] + "\n  - " + CASES.split("\n  - ")[2])
    result = run(project, "--collect-only", "-q", "-o", "sharding_dump_cases=other.yml",
                 "-o", "sharding_dump_golden_dir=elsewhere")
    assert result.stdout.lines[:2] == [f"pyproject.toml::{DP_CASE}", "pyproject.toml::no stale goldens"]


def test_bad_project_configuration_is_one_line(project: pytest.Pytester) -> None:
    pyproject = project.path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('golden-dir = "sharding/goldens"', "golden-dir = 3"))
    result = run(project)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "sharding-dump: error: " in result.stderr.str() and "golden-dir" in result.stderr.str()
    assert "Traceback" not in result.stderr.str()


def test_case_file_errors_name_the_file(project: pytest.Pytester) -> None:
    (project.path / "sharding/cases.yml").write_text(textwrap.dedent("""\
        cases:
          - {model: qwen3-0.6b, topology: cpu-8, rule: nowhere.yml}
    """))
    result = run(project)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["sharding-dump: error: *: rule file */sharding/nowhere.yml: No such file or directory*"])
    (project.path / "sharding/cases.yml").write_text("cases:\n  - {model: qwen3-0.6b, rule: tp}\n")
    result = run(project)
    result.stdout.fnmatch_lines(["*sharding-dump: error: case matrix *cases.yml: field cases/0: "
                                 "'topology' is a required property*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED


def collected(result: pytest.RunResult) -> list[str]:
    """The test ids of a `--collect-only -q` run, as pytest prints them (relative to its rootdir)."""
    return [line for line in result.stdout.lines if "::" in line]


def test_golden_tests_are_found_from_anywhere(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest's rootdir and ini file, not the working folder, say where [tool.sharding-dump] is: from a
    parent folder, with the project's pyproject.toml::CASE as the argument, or from a subfolder with no
    argument (as an IDE runs it), the same golden tests are collected."""
    (project.path / "tests").mkdir()
    (project.path / "tests/test_plain.py").write_text("def test_plain():\n    pass\n")
    expected = [f"pyproject.toml::{TP_CASE}", f"pyproject.toml::{DP_CASE}", "pyproject.toml::no stale goldens"]
    here = run(project, "--collect-only", "-q")
    assert collected(here) == expected + ["tests/test_plain.py::test_plain"]

    monkeypatch.chdir(project.path.parent)
    assert collected(run(project, "--collect-only", "-q", str(project.path))) == collected(here)
    one = run(project, "--collect-only", "-q", f"{project.path}/pyproject.toml::{DP_CASE}")
    assert collected(one) == [f"pyproject.toml::{DP_CASE}"]

    monkeypatch.chdir(project.path / "tests")
    assert collected(run(project, "--collect-only", "-q")) == ["tests/test_plain.py::test_plain"] + expected

    # and they run from there: the case has no golden yet, so it fails with a command that works from there
    monkeypatch.chdir(project.path.parent)
    result = run(project, str(project.path), "-k", "rule_dp or stale")
    result.assert_outcomes(failed=1, passed=1, deselected=2)
    where = project.path.name
    result.stdout.fnmatch_lines([f"*missing in {where}/sharding/goldens/{DP_CASE}).",
                                 f"*--rule {where}/sharding/rules/dp.yml * --golden-dir {where}/sharding/goldens"])


def test_configured_cases_left_out_are_said(project: pytest.Pytester) -> None:
    (project.path / "tests").mkdir()
    (project.path / "tests/test_plain.py").write_text("def test_plain():\n    pass\n")
    result = run(project, "tests")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"sharding-dump: warning: no golden test ran: {project.path}/pyproject.toml "
                                 "configures sharding cases, but it is not among the paths given: add pyproject.toml to them*"])
    run(project, "-k", "plain").stdout.fnmatch_lines(["sharding-dump: warning: no golden test ran: * configures "
                                                     "sharding cases, but -k/-m deselected all of them"])
    assert "no golden test ran" not in run(project, "--collect-only", "-q").stdout.str()


def test_paths_in_two_projects_are_one_line(project: pytest.Pytester) -> None:
    other = project.path / "other"
    other.mkdir()
    (other / "pyproject.toml").write_text('[tool.sharding-dump]\ncases = ["cases.yml"]\n')
    result = run(project, "--collect-only", str(project.path / "sharding"), str(other))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert ("sharding-dump: error: the paths given are in 2 projects with [tool.sharding-dump] "
            f"({project.path}/other/pyproject.toml, {project.path}/pyproject.toml): run one project per pytest run"
            ) in result.stderr.str()


def test_the_plugin_is_named_sharding_dump_and_its_options_are_namespaced(project: pytest.Pytester) -> None:
    """Every command-line option of the plugin is --sharding-*, so it starts beside plugins that name
    theirs plainly (pytest-golden's --update-goldens, a dev extra); the entry point is `sharding_dump`,
    so `-p no:sharding_dump` turns the plugin off, and an old `pytest_plugins` line naming the module
    is a no-op, not a second registration."""
    ours = pytester_help_section(project.runpytest("--help", "-p", "no:cacheprovider").stdout.lines)
    assert ours and all(option.startswith("--sharding-") for option in ours), ours
    assert {"--sharding-update", "--sharding-verify"} <= set(ours)

    golden_ids = [f"pyproject.toml::{TP_CASE}", f"pyproject.toml::{DP_CASE}", "pyproject.toml::no stale goldens"]
    assert collected(project.runpytest("--collect-only", "-q", "-p", "no:cacheprovider")) == golden_ids
    off = project.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:sharding_dump")
    assert off.ret == pytest.ExitCode.NO_TESTS_COLLECTED and collected(off) == []
    assert project.runpytest("-p", "no:sharding_dump", "--sharding-update").ret == pytest.ExitCode.USAGE_ERROR

    (project.path / "conftest.py").write_text('pytest_plugins = ["sharding_dump.pytest_plugin"]\n')
    assert collected(project.runpytest("--collect-only", "-q", "-p", "no:cacheprovider")) == golden_ids
    pytest.importorskip("pytest_golden")  # the dev extra installs it
    beside = project.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", "--update-goldens")
    assert beside.ret == pytest.ExitCode.OK and collected(beside) == golden_ids


def pytester_help_section(lines: list[str]) -> list[str]:
    """The options `pytest --help` lists under the plugin's group, `sharding-dump:`."""
    start = lines.index("sharding-dump:") + 1
    section = lines[start:next((i for i in range(start, len(lines)) if not lines[i].startswith(" ")), len(lines))]
    return [line.split()[0].rstrip(",") for line in section if line.startswith("  -")]


FAILING_MODEL = '''\
import flax.linen as nn


class Broken(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        raise RuntimeError("no attention kernel for this shape")


def make_broken():
    return Broken()
'''
FIXTURE_TEST = '''\
from sharding_dump import Case


def test_broken(sharding_golden):
    sharding_golden.check(Case.make("broken_lm:make_broken", "cpu-8", "tp", overrides={"ici_model_parallelism": 2}))
'''


def test_a_failing_model_is_one_line_and_its_traceback_is_there_under_tb_long(mini_project) -> None:
    """A fixture test whose model raises in its own __call__: the failure is the CLI's one line, naming
    the file and line of the raise; under --tb=long (and --tb=native) the whole traceback follows it."""
    project = mini_project({**ADOPT_FILES, "broken_lm.py": FAILING_MODEL, "tests/test_broken.py": FIXTURE_TEST},
                           table=ADOPT_TABLE.replace('cases = ["sharding/cases.yml"]\n', ""))
    project.syspathinsert()
    short = run(project, "tests")
    short.assert_outcomes(failed=1)
    short.stdout.fnmatch_lines(["sharding-dump: error: broken_lm:make_broken/cpu-8/slice_1/rule_tp_ici_model_parallelism=2: the "
                                "model call failed with RuntimeError: no attention kernel for this shape at "
                                "broken_lm.py:7 in Broken.__call__ (the harness passed Broken(int32*))"])
    assert "Traceback" not in short.stdout.str() and "The above exception" not in short.stdout.str()
    for style in ("long", "native"):
        full = run(project, "tests", f"--tb={style}")
        full.assert_outcomes(failed=1)
        full.stdout.fnmatch_lines(["*sharding-dump: error: *at broken_lm.py:7 in Broken.__call__*", "",
                                   "The user's code raised:", "Traceback (most recent call last):", "*",
                                   '*raise RuntimeError("no attention kernel for this shape")',
                                   "RuntimeError: no attention kernel for this shape"])


MINE_CASE = "qwen3-0.6b/cpu-8/slice_1/rule_tp_ici_model_parallelism=4"
MINE_TEST = '''\
from sharding_dump import Case


def test_mine(sharding_golden):
    sharding_golden.check(Case.make("qwen3-0.6b", "cpu-8", "tp", overrides={"ici_model_parallelism": 4}))
'''


def test_the_fixture_and_the_matrix_share_one_golden_world(project: pytest.Pytester) -> None:
    """A repository with both documented flows: the case files' golden tests and a hand-written test
    using the `sharding_golden` fixture (its `tp` found in the project's rule-dirs, as the CLI finds it).
    A golden either writes is used; --sharding-update writes all three and deletes none, and plain
    pytest stays green after it, with or without pytest-xdist. A golden no test uses any more is stale:
    a failing exit status, a warning under --sharding-warn-unused, deleted by --sharding-update."""
    (project.path / "tests").mkdir()
    (project.path / "tests/test_mine.py").write_text(MINE_TEST)
    updated = run(project, "--sharding-update")
    updated.assert_outcomes(passed=4)
    updated.stdout.fnmatch_lines(["sharding-dump goldens: 0 updated, 3 created, 0 unchanged, 0 deleted"])
    mine = project.path / "sharding/goldens" / MINE_CASE / "named_shardings.json"
    assert mine.is_file()
    for args in ((), ("-n", "2")):
        green = run(project, *args)
        green.assert_outcomes(passed=4)
        assert green.ret == pytest.ExitCode.OK and "stale" not in green.stdout.str().split("passed")[-1]
    again = run(project, "--sharding-update")
    again.stdout.fnmatch_lines(["sharding-dump goldens: 0 updated, 0 created, 3 unchanged, 0 deleted"])
    assert mine.is_file() and run(project).ret == pytest.ExitCode.OK
    # -k leaves the fixture test out: its golden is not judged (nor deleted) by a run that did not ask it
    partial = run(project, "--sharding-update", "-k", "not test_mine")
    partial.assert_outcomes(passed=3, deselected=1)
    assert partial.ret == pytest.ExitCode.OK and mine.is_file()
    partial.stdout.fnmatch_lines(["sharding-dump: warning: 1 golden path(s) no test of this run used, left alone: 1 "
                                  "test(s) using the sharding_golden fixture were deselected"])

    (project.path / "tests/test_mine.py").write_text("def test_other(sharding_golden):\n    pass\n")
    for args in ((), ("-n", "2")):
        stale = run(project, *args)
        stale.assert_outcomes(passed=4)
        assert stale.ret == pytest.ExitCode.TESTS_FAILED
        stale.stdout.fnmatch_lines(["sharding-dump: error: 1 golden path that no case or golden test uses (stale):",
                                    "    sharding/goldens/qwen3-0.6b/cpu-8/slice_1/rule_tp_ici_model_parallelism=4/"])
    warned = run(project, "--sharding-warn-unused")
    assert warned.ret == pytest.ExitCode.OK
    warned.stdout.fnmatch_lines(["sharding-dump: warning: 1 golden path that no case or golden test uses (stale):"])
    deleted = run(project, "--sharding-update")
    deleted.stdout.fnmatch_lines(["sharding-dump goldens: 0 updated, 0 created, 2 unchanged, 1 deleted"])
    assert not mine.parent.exists() and run(project).ret == pytest.ExitCode.OK


def test_no_golden_test_ran_is_not_said_after_a_fixture_golden_test(project: pytest.Pytester) -> None:
    """`pytest tests` runs the fixture's golden test but not the case files': the warning says that,
    not that no golden test ran."""
    (project.path / "tests").mkdir()
    (project.path / "tests/test_mine.py").write_text(MINE_TEST)
    result = run(project, "tests", "--sharding-update")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "no golden test ran" not in out
    result.stdout.fnmatch_lines(["sharding-dump: warning: the golden tests of the case files did not run: "
                                 f"{project.path}/pyproject.toml configures sharding cases, but it is not among the "
                                 "paths given*"])
