"""A case as a test builds it (sharding_dump/zoo/case.py): `Case.make` resolves names through the
project's [tool.sharding-dump] table as the CLI does."""

from __future__ import annotations

import pytest

from sharding_dump.errors import BadInput
from sharding_dump.zoo.case import Case, golden_dir


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.sharding-dump]\nrule-dirs = ["sharding/rules"]\n'
                                             'models = {tiny = "mypkg.models:make_tiny"}\n')
    (tmp_path / "sharding/rules").mkdir(parents=True)
    (tmp_path / "sharding/rules/tp.yml").write_text("mesh_axes: [model]\nlogical_axis_rules:\n  - [mlp, model]\n")
    (tmp_path / "tests").mkdir()
    monkeypatch.chdir(tmp_path / "tests")  # a test runs anywhere in the project
    return tmp_path


def test_case_make_reads_the_models_and_rule_dirs_the_cli_reads(project):
    case = Case.make("tiny", "cpu-8", "tp")
    assert case.model == "tiny=mypkg.models:make_tiny" and case.rule == str(project / "sharding/rules/tp.yml")
    assert case.label == "tiny/cpu-8/slice_1/rule_tp"
    assert golden_dir(case, "g").as_posix() == "g/tiny/cpu-8/slice_1/rule_tp"


def test_case_make_without_the_project_takes_names_as_given(project):
    with pytest.raises(BadInput, match="unknown rule 'tp'"):
        Case.make("qwen3-0.6b", "cpu-8", "tp", project=False)
    assert Case.make("qwen3-0.6b", "cpu-8", "default").rule == "default"  # a packaged rule, not shadowed
