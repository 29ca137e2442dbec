"""The package as a user gets it: the wheel `python -m build --wheel` makes, installed into a fresh
virtual environment beside the golden and snapshot plugins a training repository may already use
(pytest-golden, which has its own --update-goldens, syrupy and pytest-regressions), then the README's
pytest flow in a fresh repository: a missing golden fails, `pytest --sharding-update` writes it, and
a one-line rule change fails naming the tensor. The wheel carries the licence and the project URLs,
and `sharding-dump --version` says the installed version.

Marked `package` (a build and an install: about a minute from pip's cache): `.ci/run` runs it as a
step of its own on the pinned stack, `pytest -m package` here.
"""

from __future__ import annotations

import email.parser
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from helpers import ADOPT_FILES, ADOPT_TABLE, ADOPT_TP_RULE, REPO

pytestmark = pytest.mark.package

OTHER_PLUGINS = {"syrupy": "--snapshot-update", "pytest-regressions": "--force-regen",
                 "pytest-golden": "--update-goldens"}
TP_CASE = "qwen3-0.6b/cpu-8/slice_1/rule_tp_ici_model_parallelism=2"


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=1200, env=env)


def build_wheel(out: Path) -> Path:
    result = run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(REPO)], cwd=out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = out.glob("sharding_dump-*.whl")
    return wheel


def test_the_wheel_in_a_fresh_repository_beside_other_golden_plugins(tmp_path: Path) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wheel = build_wheel(tmp_path)

    # the metadata: licence (the file itself and its SPDX expression), every project URL, the version
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
        (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert archive.read(licence) == (REPO / "LICENSE").read_bytes()
    assert metadata["License-Expression"] == project["license"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert sorted(metadata.get_all("Project-URL")) == sorted(f"{k}, {v}" for k, v in project["urls"].items())
    assert metadata["Version"] == project["version"]
    assert not [n for n in names if n.startswith(("examples/", "tests/"))]  # the package alone

    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path).returncode == 0
    python = venv / "bin" / "python"
    install = run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel),
                   *OTHER_PLUGINS, "-c", str(REPO / "constraints.txt")], cwd=tmp_path)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    # beside Levanter's pins (jax<0.12, optax<0.2.7): pyproject.toml's ranges hold a set for them (it held one
    # optax release, 0.2.8)
    beside = run([str(python), "-m", "pip", "install", "--dry-run", "--disable-pip-version-check", str(wheel),
                  "optax<0.2.7", "jax<0.12"], cwd=tmp_path)
    assert beside.returncode == 0 and "optax-0.2.6" in beside.stdout, beside.stdout[-3000:] + beside.stderr[-3000:]
    version = run([str(venv / "bin" / "sharding-dump"), "--version"], cwd=tmp_path)
    assert version.stdout.startswith(f"sharding-dump {project['version']} (jax "), version.stdout + version.stderr

    repo = tmp_path / "my-trainer"  # a repository of its own: no conftest, no test file, no checkout on the path
    for name, text in {"pyproject.toml": f'[project]\nname = "my-trainer"\nversion = "0"\n\n'
                                         f'[tool.sharding-dump]\n{ADOPT_TABLE}\n', **ADOPT_FILES}.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}

    def pytest_in_repo(*args: str) -> subprocess.CompletedProcess:
        return run([str(python), "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=repo, env=env)

    helped = pytest_in_repo("--help")
    assert helped.returncode == 0, helped.stdout[-2000:] + helped.stderr[-2000:]
    assert all(option in helped.stdout for option in [*OTHER_PLUGINS.values(), "--sharding-update"]), helped.stdout

    missing = pytest_in_repo()
    assert missing.returncode == 1, missing.stdout[-3000:] + missing.stderr[-3000:]
    assert f"FAILED pyproject.toml::{TP_CASE}" in missing.stdout
    assert f"missing in sharding/goldens/{TP_CASE})" in missing.stdout

    updated = pytest_in_repo("--sharding-update")
    assert updated.returncode == 0, updated.stdout[-3000:]
    assert "sharding-dump goldens: 0 updated, 2 created, 0 unchanged, 0 deleted" in updated.stdout
    assert (repo / "sharding/goldens" / TP_CASE / "named_shardings.json").is_file()
    assert pytest_in_repo().returncode == 0

    (repo / "sharding/rules/tp.yml").write_text(ADOPT_TP_RULE.replace("  - [mlp, model]\n", "  - [mlp, []]\n"))
    broken = pytest_in_repo()
    assert broken.returncode == 1 and f"FAILED pyproject.toml::{TP_CASE}" in broken.stdout, broken.stdout[-3000:]
    assert "model/decoder/layers/mlp/wi_0/kernel  (and optimizer/opt_state/0/mu, optimizer/opt_state/0/nu)" in broken.stdout
    assert 'partition_spec    golden [null,null,"model"]  now [null,null,null]' in broken.stdout
