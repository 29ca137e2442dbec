"""Faults: a golden write killed at any point leaves every case folder entirely old or entirely new,
and the next run leaves no temp behind.

The kill comes from the SHARDING_DUMP_FAULT_AT=N test hook (SIGKILL at the N-th step of a golden
write: after the temp folder is made, after each file, after the swap), so every point between two
steps is hit, including between the files of one case. The library is killed at every point (with
the one-step swap and with the two-rename fallback); `sharding-dump --all` and
`pytest --sharding-update` are killed as whole processes, on two cases of the matrix (so that their
new bytes are the committed goldens, which the golden tests hold to a fresh dump).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import process
from pathlib import Path

import pytest

from sharding_dump.commands import cli
from sharding_dump.golden import store
from sharding_dump.zoo import goldens
from sharding_dump.zoo.case import Case, golden_dir

REPO = Path(__file__).resolve().parents[2]
CASE_ARGS = [("qwen3-0.6b", "tpu7x-16", "default"), ("llama2-7b", "v5p-16", "pure-fsdp")]  # two quick traces
CASES = [Case.make(*args) for args in CASE_ARGS]
OLD = {"named_shardings.json": b"old named\n", "logical_shardings.json": b"old logical\n",
       "activation_shardings.json": b"old activations\n", "notes.txt": b"left by hand\n"}


def state(folder: Path) -> dict[str, bytes] | None:
    """A case folder's files and bytes (None when it is not there)."""
    if not folder.is_dir():
        return None
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def temps(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if store.is_temp(p.name))


def killed_write(n: int, folder: Path, files: dict[str, bytes], fallback: bool) -> bool:
    """Writes `files` into `folder` in a forked child killed at step `n`; True when it was killed."""
    pid = os.fork()
    if pid == 0:  # the child does file system calls only, then dies or exits
        try:
            os.environ[store.FAULT_ENV] = str(n)
            if fallback:
                os.environ[store.NO_EXCHANGE_ENV] = "1"
            store._steps = 0
            store.write_case_folder(folder, files)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


# The forked child only makes file-system calls and dies: JAX's threads are never needed in it (JAX
# warns of the fork, and so does Python 3.12+).
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two-renames"])
def test_a_case_folder_is_old_or_new_after_a_kill_at_every_step(tmp_path, fallback):
    new = {"named_shardings.json": b"new named\n", "logical_shardings.json": b"new logical\n",
           "activation_shardings.json": b"new activations\n"}
    n = 0
    while True:
        n += 1
        folder = tmp_path / f"kill{n}" / "model/topo/slice_1/rule_x"
        store.write_case_folder(folder, OLD)
        killed = killed_write(n, folder, new, fallback)
        if fallback and state(folder) is None:  # killed between the two renames: the old one is aside
            assert [t.split(".")[-1].split("-")[0] for t in temps(folder.parent)] == ["new", "old"]
        else:
            assert state(folder) in (OLD, new), (n, state(folder))
        store.recover_leftovers(folder)
        assert state(folder) in (OLD, new) and temps(tmp_path / f"kill{n}") == [], n
        store.write_case_folder(folder, new)  # the next run
        assert state(folder) == new and temps(tmp_path / f"kill{n}") == []
        if not killed:
            break
    assert n >= 6  # made the temp folder, three files, swapped (two renames in the fallback), synced


def plant_old(root: Path) -> None:
    for case in CASES:
        store.write_case_folder(golden_dir(case, root), OLD)


def check_killed_tree(root: Path, fresh: dict[Case, dict[str, bytes]]) -> list[str]:
    """Every case folder entirely old or new; then the next run (in-process) makes all new and leaves
    no temp. Returns which cases were new after the kill."""
    after_kill = []
    for case in CASES:
        found = state(golden_dir(case, root))
        assert found in (OLD, fresh[case]), (case.label, sorted(found or {}))
        after_kill.append("new" if found == fresh[case] else "old")
    for case in CASES:
        goldens.check_or_update(case, root, update=True)
        assert state(golden_dir(case, root)) == fresh[case]
    assert temps(root) == []
    return after_kill


def pytest_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")
    # loads the plugin when the checkout is not installed; a no-op beside the entry point
    (project / "conftest.py").write_text('pytest_plugins = ["sharding_dump.pytest_plugin"]\n')
    (project / "test_cases.py").write_text(textwrap.dedent(f"""\
        import pytest
        from sharding_dump.zoo.case import Case

        CASES = [Case.make(*args) for args in {CASE_ARGS!r}]

        @pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
        def test_golden(case, sharding_golden):
            sharding_golden.check(case)
    """))
    return project


def test_killed_cli_all_and_pytest_update_goldens_leave_whole_folders(tmp_path, monkeypatch, capsys):
    fresh = {case: state(golden_dir(case, REPO / "golden")) for case in CASES}
    case_file = tmp_path / "cases.yml"
    case_file.write_text("cases:\n" + "".join(f"  - {{model: {m}, topology: {t}, rule: {r}}}\n"
                                               for m, t, r in CASE_ARGS))
    project = pytest_project(tmp_path)
    # Step 9: between the second and third file of the second case, the first case done (the library
    # test above kills at every step).
    runs = {}
    root = tmp_path / "cli9"
    plant_old(root)
    env = {**os.environ, "PYTHONPATH": str(REPO), store.FAULT_ENV: "9"}
    runs[root] = subprocess.Popen([sys.executable, "-m", "sharding_dump.commands.cli", "--all", "-j", "1",
                                   "--cases", str(case_file), "--output-dir", str(root)],
                                  env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    plant_old(project / "golden")
    env = {**os.environ, "PYTHONPATH": str(REPO), store.FAULT_ENV: "4"}
    runs[project / "golden"] = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--sharding-update"],
        cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # -j 2 at step 4, from here: each case in a worker of its own, killed in its first write. The command
    # says so in one line, and has ended its worker pools when it returns: a pool thread still ending
    # when the interpreter exits races the exit's own wakeup of it, which prints a traceback below the line.
    root = tmp_path / "cli4"
    plant_old(root)
    monkeypatch.setenv(store.FAULT_ENV, "4")  # the spawned workers' environment; this process writes nothing
    assert cli.main(["--all", "-j", "2", "--cases", str(case_file), "--output-dir", str(root)]) == 1
    monkeypatch.delenv(store.FAULT_ENV)
    assert capsys.readouterr().err.splitlines()[-1].startswith("sharding-dump: error: a worker process died")
    assert [t for t in threading.enumerate() if isinstance(t, process._ExecutorManagerThread)] == []
    # The next run writes the bytes the cases render to without tracing them again here: what it
    # recovers from a kill is the store's doing, whatever made the bytes.
    monkeypatch.setattr(goldens, "render", fresh.__getitem__)
    seen = {"cli4": check_killed_tree(root, fresh)}
    for root, running in runs.items():
        out, err = running.communicate(timeout=600)
        if root.name == "golden":
            assert running.returncode != 0, out.decode()[-2000:]  # the worker running the write died
        else:
            assert running.returncode == -9, err.decode()[-2000:]
        seen[root.name] = check_killed_tree(root, fresh)
    assert seen == {"cli9": ["new", "old"], "cli4": ["old", "old"], "golden": ["old", "old"]}
