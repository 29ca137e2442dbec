"""The command line in another repository: --version, --cases / --golden-dir, and the warnings for a
rule file that does not fit the model (exit status stays 0)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO
from sharding_dump.commands import cli

# Logical names of another codebase: nothing in the model carries them.
FOREIGN_RULE = """\
mesh_axes: [replica, model]
logical_axis_rules:
  - [batch, replica]
  - [hidden, model]
"""


def test_version_names_the_packages_a_golden_depends_on(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    import sharding_dump

    assert out.startswith(f"sharding-dump {sharding_dump.__version__} (jax ") and "flax " in out and "optax " in out


def test_rules_that_match_nothing_warn(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "foreign.yml").write_text(FOREIGN_RULE)
    status = cli.main(["--model", "qwen3-0.6b", "--topology", "cpu-8", "--rule", "foreign.yml",
                       "ici_replica_parallelism=-1", "--golden-dir", "out"])
    captured = capsys.readouterr()
    assert status == 0 and (tmp_path / "out/qwen3-0.6b/cpu-8/slice_1").is_dir()
    warnings = captured.err.splitlines()
    label = "qwen3-0.6b/cpu-8/slice_1/rule_foreign_ici_replica_parallelism=-1"
    assert warnings == [
        f"sharding-dump: warning: {label}: the rules of foreign.yml shard nothing: every tensor and activation is "
        "whole on each of the 8 devices (replica=8); do its logical names match the model's?",
        f"sharding-dump: warning: {label}: foreign.yml has rules for logical axes no tensor or activation of this "
        "dump carries: batch (line 3), hidden (line 4)",
    ]


def test_a_rule_file_with_no_rules_dumps_everything_whole_with_its_warning(tmp_path, capsys, monkeypatch):
    """`logical_axis_rules: []`: flax places nothing, so the model's named constraints resolve to no
    constraint, which is not a lost one (mutation: note the call in capture.constrain without rules too,
    and the dump fails with `constrain() was called for attention_out, ... but no such constraint reached
    the traced step`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bare.yml").write_text("mesh_axes: [fsdp]\nlogical_axis_rules: []\n")
    status = cli.main(["--model", "qwen3-0.6b", "--topology", "cpu-4", "--rule", "bare.yml", "max_target_length=16",
                       "per_device_batch_size=1", "--golden-dir", "out"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "the rules of bare.yml shard nothing: every tensor and activation is whole on each of the 4 devices " \
           "(fsdp=4)" in err, err
    # Qwen3's constraints resolve to none, not absent (mutation: drop the no-rules branch of rules.use_warnings)
    assert "the model placed no activation sharding constraint in its training step that resolves to a layout: " \
           "activation_shardings.json holds only the batch (bare.yml has no logical_axis_rules, so any constraint " \
           "in logical axes resolves to none)" in err
    (named,) = (tmp_path / "out").rglob("named_shardings.json")
    specs = {entry["partition_spec"].count(None) == len(entry["shape"])
             for entry in json.loads(named.read_text())["tensors"].values()}
    assert specs == {True}
def test_shipped_rule_does_not_warn(tmp_path, capsys):
    assert cli.main(["--model", "qwen3-0.6b", "--topology", "cpu-8", "--rule", "pure-fsdp",
                     "--golden-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


def test_cases_and_golden_dir_flags(tmp_path, capsys):
    cases = tmp_path / "mine.yml"
    cases.write_text("cases:\n  - {model: nope, topology: cpu-8, rule: default}\n")
    assert cli.main(["--all", "--cases", str(cases), "--golden-dir", str(tmp_path / "g")]) == 2
    assert f"case matrix {cases}: field cases/0: unknown model 'nope'" in capsys.readouterr().err
    assert cli.main(["--model", "qwen3-0.6b", "--topology", "cpu-8", "--rule", "default", "--cases", str(cases)]) == 2
    assert "--cases names the case files of --all" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


def test_importing_the_plugin_imports_no_jax_and_changes_no_environment():
    """The plugin loads in every pytest run of a repository that installs the package: it must not
    import JAX (nor move the user's other tests to CPU through JAX_PLATFORMS)."""
    code = ("import os, sys, sharding_dump; before = set(sys.modules); env = dict(os.environ)\n"
            "import sharding_dump.pytest_plugin\n"
            "new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax'))\n"
            "assert not new, new\n"
            "assert dict(os.environ) == env\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
