"""MaxText cases without MaxText: their names and folders, case files, and what a process without
MaxText says (one line, exit 2, nothing written)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO
from sharding_dump.errors import BadInput
from sharding_dump.maxtext.case import MaxTextCase, load_cases

CASES = REPO / "tests" / "data" / "maxtext" / "program" / "cases.yml"
GUIDE = REPO / "docs" / "guide" / "guard-your-maxtext.md"


def test_folder_is_the_zoo_layout_and_a_later_word_wins():
    case = MaxTextCase.parse(["model_name=llama2-7b", "compile_topology=v5p-8", "ici_tensor_parallelism=2",
                              "ici_tensor_parallelism=4", "custom_mesh_and_rule=pure-fsdp"])
    assert case.folder("g").as_posix() == "g/llama2-7b/v5p-8/slice_1/rule_pure-fsdp_ici_tensor_parallelism=4"
    assert case.header()["overrides"] == {"ici_tensor_parallelism": 4}
    assert case.argv("base.yml")[-1] == "compile_topology_num_slices=1"  # MaxText's own default is none


@pytest.mark.parametrize("words, says", [
    (["model_name=llama2-7b"], "no compile_topology="),
    (["model_name=llama2-7b", "compile_topology=v5p-8", "oops"], "'oops': expected KEY=VALUE"),
    (["model_name=../x", "compile_topology=v5p-8"], "model_name='../x': expected a name"),
])
def test_bad_words_are_one_line(words, says):
    with pytest.raises(BadInput, match=says.replace("(", r"\(")):
        MaxTextCase.parse(words)


def test_the_sample_case_file_reads(tmp_path):
    cases = load_cases(CASES)
    assert len(cases) == 10 and len({c.label for c in cases}) == 10
    (tmp_path / "c.yml").write_text("cases:\n  - {args: [model_name=a, compile_topology=b]}\n"
                                    "  - {args: [compile_topology=b, model_name=a]}\n")
    with pytest.raises(BadInput, match="cases/1: same case as cases/0"):
        load_cases(tmp_path / "c.yml")


def test_without_maxtext_one_line_exit_2(tmp_path):
    """This stack has no MaxText: the command says so in one line and writes nothing."""
    pytest.importorskip("sharding_dump")
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('maxtext') is not None)"
    if subprocess.run([sys.executable, "-c", code]).returncode:
        pytest.skip("MaxText is installed here (tests/maxtext/test_program.py runs it)")
    out = subprocess.run([sys.executable, "-m", "sharding_dump.maxtext", "model_name=llama2-7b",
                          "compile_topology=v5p-8", "--golden-dir", str(tmp_path / "g")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(
        "sharding-dump: error: MaxText is not importable here (No module named 'maxtext')"), out.stderr
    assert not (tmp_path / "g").exists()
    assert out.stderr.strip() in GUIDE.read_text()  # the guide shows the line as it is


def test_the_plugin_collects_maxtext_cases(pytester):
    """`maxtext-cases` in [tool.sharding-dump]: one golden test per case; here, without MaxText, each
    fails in one line saying so (a golden test never passes unchecked), and the stale check runs."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('maxtext') is not None)"
    if subprocess.run([sys.executable, "-c", code]).returncode:
        pytest.skip("MaxText is installed here (tests/maxtext/test_program.py runs it)")
    pytester.makepyprojecttoml('[tool.sharding-dump]\ngolden-dir = "golden"\nmaxtext-cases = ["maxtext.yml"]\n')
    pytester.makefile(".yml", maxtext="cases:\n  - {args: [model_name=llama2-7b, compile_topology=v5p-8]}\n")
    result = pytester.runpytest("-p", "sharding_dump.pytest_plugin", "-p", "no:cacheprovider", "-q", "pyproject.toml")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*sharding-dump: error: llama2-7b/v5p-8/slice_1/rule_default: MaxText is not importable here*"])
