"""Stale goldens: reported with their paths, failing the run the same way with and without
pytest-xdist, and removed (by one process) under --sharding-update."""

import re
import textwrap

from sharding_dump.golden import stale
from sharding_dump.zoo.case import Case, golden_dir

CASE_ARGS = [("llama2-7b", "v5p-16", "pure-fsdp", 1), ("llama2-7b", "v5p-16", "default", 1),
             ("qwen3-0.6b", "a3", "default", 2)]
CASES = [Case.make(*args) for args in CASE_ARGS]


def make_project(root):
    """A tiny project that uses the plugin (by its entry point: no conftest): three cases whose golden
    folders exist, plus stale ones. The cases are made in the test, so that only the xdist worker that
    runs it imports the harness (and JAX)."""
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "test_tree.py").write_text(textwrap.dedent(f"""\
        import pytest

        def test_no_stale_goldens(sharding_golden):
            from sharding_dump.zoo.case import Case

            sharding_golden.check_stale([Case.make(*args) for args in {CASE_ARGS!r}])

        @pytest.mark.parametrize("n", range(4))
        def test_other(n):
            pass
    """))
    for case in CASES:
        folder = golden_dir(case, root / "golden")
        folder.mkdir(parents=True)
        (folder / "named_shardings.json").write_text("{}\n")
    extra = root / "golden/llama2-7b/v5p-16/slice_1/rule_extra"
    extra.mkdir()
    (extra / "named_shardings.json").write_text("{}\n")
    (root / "golden/gone-model/v5p-16/slice_1/rule_default").mkdir(parents=True)
    (root / "golden/llama2-7b/notes.txt").write_text("x\n")
    return ["golden/gone-model/", "golden/llama2-7b/notes.txt", "golden/llama2-7b/v5p-16/slice_1/rule_extra/"]


def run_pytest(pytester, *args):
    """pytest in this process (pytester's in-process run); with -n 2 its two workers are processes of
    their own, as in any xdist run."""
    result = pytester.runpytest("-p", "no:cacheprovider", "-q", *args)
    return result.ret, "\n".join(result.outlines)


def failure_block(output):
    """The stale report as pytest printed it (from the count line to the fix)."""
    match = re.search(r"^\d+ golden paths? that no case or golden test uses.*?^    pytest --sharding-update$", output, re.M | re.S)
    return match.group(0) if match else None


def test_stale_report_is_the_same_with_and_without_xdist_and_update_removes(pytester):
    root = pytester.path
    stale_paths = make_project(root)
    (serial_status, serial), (parallel_status, parallel) = run_pytest(pytester), run_pytest(pytester, "-n", "2")
    assert serial_status == parallel_status == 1, serial + parallel
    report = failure_block(serial)
    assert report is not None, serial
    assert report.splitlines()[1:4] == [f"    {p}" for p in stale_paths]
    assert failure_block(parallel) == report
    assert "FAILED test_tree.py::test_no_stale_goldens" in serial
    assert "FAILED test_tree.py::test_no_stale_goldens" in parallel
    assert "1 failed, 4 passed" in serial and "1 failed, 4 passed" in parallel

    updated_status, updated = run_pytest(pytester, "-n", "2", "--sharding-update")
    assert updated_status == 0, updated
    # what the worker did reaches the controller's summary line
    assert "sharding-dump goldens: 0 updated, 0 created, 0 unchanged, 3 deleted" in updated
    assert not any((root / p.rstrip("/")).exists() for p in stale_paths)
    for case in CASES:
        assert (golden_dir(case, root / "golden") / "named_shardings.json").is_file()
    # the next run passes
    assert stale.stale_paths(root / "golden", [golden_dir(c, root / "golden") for c in CASES]) == []


def test_stale_paths_are_the_largest_unclaimed_ones(tmp_path):
    cases = CASES
    assert stale.stale_paths(tmp_path / "missing", [golden_dir(c, tmp_path / "missing") for c in cases]) == []
    for case in cases:
        golden_dir(case, tmp_path).mkdir(parents=True)
        (golden_dir(case, tmp_path) / "named_shardings.json").write_text("")
        (golden_dir(case, tmp_path) / "stray.tmp").write_text("")  # inside a case folder: no case writes it
    (tmp_path / "qwen3-0.6b/a3/slice_1").mkdir()
    (tmp_path / "README.md").write_text("")
    found = [p.relative_to(tmp_path).as_posix() for p in stale.stale_paths(tmp_path, [golden_dir(c, tmp_path) for c in cases])]
    assert found == ["README.md", "llama2-7b/v5p-16/slice_1/rule_default/stray.tmp",
                     "llama2-7b/v5p-16/slice_1/rule_pure-fsdp/stray.tmp", "qwen3-0.6b/a3/slice_1",
                     "qwen3-0.6b/a3/slice_2/rule_default/stray.tmp"]
    stale.remove(stale.stale_paths(tmp_path, [golden_dir(c, tmp_path) for c in cases]))
    assert stale.stale_paths(tmp_path, [golden_dir(c, tmp_path) for c in cases]) == []
    assert all((golden_dir(c, tmp_path) / "named_shardings.json").is_file() for c in cases)
