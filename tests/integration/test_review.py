"""What a reviewer sees, in a fresh repository (pytester): memory per device first, activations
included, in a failing golden test, in `sharding-dump diff`'s summary and chart; a bounded report of
a rule edit on a 32-layer unscanned model, every changed tensor listed under `-vv`; `diff
--fail-on-growth` as the exit status."""

from __future__ import annotations

import re
import shutil
import textwrap

import pytest

from helpers import REPO
from sharding_dump.commands.cli import main
from sharding_dump.golden.engine import MAX_REPORT_LINES
from sharding_dump.zoo import releases

DEFAULT_RULE = (releases.release_of({}).rules_dir / "default.yml").read_text()  # the default release's
BATCH_LINE = "  - [activation_batch, [data, fsdp, fsdp_transpose, expert]]\n"
ACT_CASE = "qwen3-0.6b/cpu-8/slice_1/rule_mine"

DEEP_MODEL = textwrap.dedent("""\
    from examples.linen_lm import LinenLM


    def deep_lm() -> LinenLM:
        \"\"\"32 layers in a Python loop (block_0 ... block_31), no scan.\"\"\"
        return LinenLM(vocab=512, embed=64, layers=32, heads=4, mlp=256)
    """)
DEEP_CASES = textwrap.dedent("""\
    cases:
      - {model: "deep_lm:deep_lm", topology: cpu-8, rule: rules.yml,
         overrides: {ici_fsdp_parallelism: 4, ici_tensor_parallelism: 2}}
    """)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "sharding_dump.pytest_plugin", "-p", "no:cacheprovider", *args)


def failure_report(result: pytest.RunResult) -> list[str]:
    """The lines pytest prints for the one failing golden test, between its `___ sharding golden
    CASE ___` header and the short summary."""
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if re.match(r"_+ sharding golden .* _+$", line)) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("=") and "short test summary" in line)
    return lines[start:end]


@pytest.fixture
def activations_blown(mini_project, monkeypatch):
    """A repository with a copy of the default rule as its own, its golden written; then the rule's
    activation_batch emptied (`[]`): parameters keep their layout, every activation grows."""
    assert BATCH_LINE in DEFAULT_RULE
    cases = "cases:\n  - {model: qwen3-0.6b, topology: cpu-8, rule: rules/mine.yml}\n"
    project = mini_project({"rules/mine.yml": DEFAULT_RULE, "cases.yml": cases},
                           table='golden-dir = "goldens"\ncases = ["cases.yml"]')
    monkeypatch.chdir(project.path)
    update = run(project, "--sharding-update")
    update.assert_outcomes(passed=2)  # what it works on, said before it starts
    said = "sharding-dump: updating the goldens of 1 case in goldens (-v names each case as it is dumped)"
    assert said in update.stdout.lines
    shutil.copytree(project.path / "goldens", project.path / "main-goldens")  # what main holds
    (project.path / "rules/mine.yml").write_text(DEFAULT_RULE.replace(BATCH_LINE, "  - [activation_batch, []]\n"))
    return project


def test_activation_blow_up_leads_the_failing_test_and_the_comment(activations_blown, capsys):
    result = run(activations_blown)
    result.assert_outcomes(failed=1, passed=1)
    report = failure_report(result)
    assert report[0].startswith(f"{ACT_CASE}: the dump differs from the golden in goldens/{ACT_CASE}")
    assert report[1].split() == ["memory", "per", "device", "golden", "now", "change"]
    parts = {line.split()[0]: line.split()[1:] for line in report[2:6]}
    assert parts["model"][-1] == "0" and parts["optimizer"][-1] == "0"  # parameters did not move
    before, after = " ".join(parts["activations"][:2]), " ".join(parts["activations"][2:4])
    # every activation but the logits (their own batch rule) holds 8x the batch per device
    assert (before, after) == ("15.7 GiB", "22.9 GiB") and parts["activations"][4:] == ["+7.2", "GiB", "(+46%)"]
    assert len(report) <= MAX_REPORT_LINES

    # The comment: the summary table's activations column and the chart show the same figures.
    run(activations_blown, "--sharding-update").assert_outcomes(passed=2)
    capsys.readouterr()  # what the inner pytest runs printed
    assert main(["diff", "main-goldens", "goldens", "--format", "markdown"]) == 1
    comment = capsys.readouterr().out
    header, _, row = comment.split("\n\n")[1].splitlines()
    column = [c.strip() for c in header.split("|")].index("activations/device")
    assert [c.strip() for c in row.split("|")][column] == "15.7 GiB -> 22.9 GiB (+7.2 GiB, +46%)"
    chart = comment.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert '"activations before 15.7 GiB", "activations after 22.9 GiB"' in chart


def test_fail_on_growth_decides_the_exit_status(activations_blown, capsys):
    run(activations_blown, "--sharding-update").assert_outcomes(passed=2)
    capsys.readouterr()
    diff = ["diff", "main-goldens", "goldens"]
    assert main([*diff, "--fail-on-growth", "activations:10%"]) == 1
    err = capsys.readouterr().err
    assert err == (f"sharding-dump diff: memory per device grew beyond --fail-on-growth: {ACT_CASE}: "
                   "activations 15.7 GiB -> 22.9 GiB (+7.2 GiB (+46%))\n")
    assert main([*diff, "--fail-on-growth", "activations:50%"]) == 0  # grew 46%: within
    assert main([*diff, "--fail-on-growth", "model:1%", "--fail-on-growth", "optimizer:0%"]) == 0  # did not move
    assert main([*diff, "--fail-on-growth", "*:7GiB"]) == 1 and main([*diff, "--fail-on-growth", "*:8GiB"]) == 0
    capsys.readouterr()
    for bad, message in [("activations", "give PART:LIMIT, e.g. activations:10%"),
                         ("activations:ten%", "'ten%' is not a percentage >= 0"),
                         ("activations:10parsecs", "give a size such as 256MiB"),
                         ("weights:10%", "no part 'weights' in these goldens (parts: model, optimizer, activations")]:
        assert main([*diff, "--fail-on-growth", bad]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and message in captured.err and captured.err.count("\n") == 1, bad


def test_rule_edit_on_32_unscanned_layers_is_a_short_report(mini_project, monkeypatch):
    rules = (REPO / "examples/rules.yml").read_text()
    project = mini_project({"deep_lm.py": DEEP_MODEL, "rules.yml": rules, "cases.yml": DEEP_CASES},
                           table='golden-dir = "goldens"\ncases = ["cases.yml"]')
    monkeypatch.syspath_prepend(str(project.path))
    monkeypatch.chdir(project.path)
    run(project, "--sharding-update").assert_outcomes(passed=2)
    (project.path / "rules.yml").write_text(rules.replace("  - [embed, fsdp]\n", "  - [embed, null]\n"))

    result = run(project)
    result.assert_outcomes(failed=1, passed=1)
    report = failure_report(result)
    assert len(report) <= MAX_REPORT_LINES
    assert "  params/block_0..31/up/kernel  (32 tensors, and opt_state/0/mu, opt_state/0/nu)" in report
    assert not any(re.search(r"\b\d{5,}\b", line) for line in report[:8])  # sizes in units, not raw bytes

    full = run(project, "-vv")  # the documented option: every changed tensor by its own name
    lines = set(failure_report(full))
    for i in range(32):
        for name in ("query", "key", "value", "out", "up", "down"):
            assert f"  params/block_{i}/{name}/kernel  (and opt_state/0/mu, opt_state/0/nu)" in lines


def test_update_on_a_terminal_names_the_case_it_dumps(activations_blown, monkeypatch):
    """--sharding-update on a terminal (pytest colours its output): while a case is dumped, its name and
    how many are left, after the progress dots, erased before its letter; nothing of it in CI."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("COLUMNS", "200")
    out = run(activations_blown, "--sharding-update", "--color=yes").stdout.str()
    assert f"\x1b7 dumping {ACT_CASE} (1 of 1, 0 left after it)\x1b8\x1b[K" in out
    monkeypatch.setenv("CI", "true")
    assert "\x1b7" not in run(activations_blown, "--sharding-update", "--color=yes").stdout.str()
