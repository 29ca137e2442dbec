"""The case matrix split over CI machines (`examples/ci/sharding-dump-matrix.yml`, pytest-split): the
workflow's own pytest command, run for each group of its matrix on this repository, collects every
case and the stale-golden check exactly once, and the same groups every time."""

from __future__ import annotations

import shlex

import pytest
import yaml

from helpers import REPO
from sharding_dump.zoo.matrix import load_matrix, load_project_cases
from sharding_dump.zoo.project import load_project

WORKFLOW = REPO / "examples/ci/sharding-dump-matrix.yml"


def matrix_job() -> dict:
    (job,) = yaml.safe_load(WORKFLOW.read_text())["jobs"].values()
    return job


def group_args(job: dict, group: int) -> list[str]:
    """The pytest arguments the workflow's job `group` runs with (GitHub's expressions filled in)."""
    (run,) = [step["run"] for step in job["steps"] if "python -m pytest" in step.get("run", "")]
    total = len(job["strategy"]["matrix"]["group"])
    words = shlex.split(run.replace("${{ strategy.job-total }}", str(total)).replace("${{ matrix.group }}", str(group)))
    assert words[:3] == ["python", "-m", "pytest"], run
    return words[3:]


def test_workflow_is_a_matrix_of_groups() -> None:
    job = matrix_job()
    groups = job["strategy"]["matrix"]["group"]
    assert groups == list(range(1, len(groups) + 1)) and len(groups) == 3
    args = group_args(job, 1)
    assert args[0] == "pyproject.toml" and "--sharding-verify" in args
    assert args[args.index("--splits") + 1] == "3" and args[args.index("--splitting-algorithm") + 1] == "least_duration"
    assert (REPO / args[args.index("--durations-path") + 1]).is_file()


def test_three_groups_run_each_case_exactly_once(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)

    def collected(*args: str) -> list[str]:
        result = pytester.runpytest_inprocess(*args, "--collect-only", "-q", "-p", "no:cacheprovider")
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()
        return [line for line in result.stdout.lines if "::" in line]

    # every case of the repository's case files (their labels are unique), plus the stale check: the
    # plugin's test ids
    everything = [f"pyproject.toml::{case.label}" for case in load_project_cases(load_project(REPO))] + [
        "pyproject.toml::no stale goldens"]
    job = matrix_job()
    groups = [collected(*group_args(job, group)) for group in job["strategy"]["matrix"]["group"]]
    assert all(groups)
    assert sorted(sum(groups, [])) == sorted(everything)  # none lost, none twice
    assert [group.count("pyproject.toml::no stale goldens") for group in groups].count(1) == 1
    assert collected(*group_args(job, 2)) == groups[1]  # deterministic


def test_every_case_has_a_committed_duration() -> None:
    """.test_durations, which pytest-split balances the groups by, names every case of the matrix and
    nothing else (a case missing from it counts as the average, so the groups drift apart as cases are
    added; refresh it with the command in the workflow's header)."""
    import json

    durations = json.loads((REPO / ".test_durations").read_text())
    expected = {f"pyproject.toml::{case.label}" for case in load_matrix()} | {"pyproject.toml::no stale goldens"}
    assert set(durations) == expected, (sorted(expected - set(durations)), sorted(set(durations) - expected))
    assert all(isinstance(seconds, float) and seconds > 0 for seconds in durations.values())
