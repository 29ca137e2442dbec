"""`sharding-dump verify`: the real training step compiled on fake CPU devices, on a tiny qwen3 batch.

Two compiles: a provoked rule file (tests/data/verify/) that XLA can only partition by rebuilding a
value whole (an involuntary full rematerialization, logged from C++ on fd 2), and a clean one whose
compiled shardings equal its golden. Everything else is bad input, checked before any compile.
"""

import json

import pytest

from helpers import REPO, run_cli
from sharding_dump import verify
from sharding_dump.cli import main

DATA = REPO / "tests/data/verify"
SMALL = ["per_device_batch_size=1", "max_target_length=256"]


def case_args(rule: str, *extra: str) -> list[str]:
    return ["--model", "qwen3-0.6b", "--topology", "cpu-4", "--rule", str(DATA / f"{rule}.yml"), *SMALL, *extra]


REMAT_MESH = ["ici_tensor_parallelism=2"]


def dump_golden(tmp_path, rule: str, *extra: str):
    """Writes the case's golden under tmp_path/golden and returns its named document's path."""
    result = run_cli(*case_args(rule, *extra), "--output-dir", str(tmp_path / "golden"))
    assert result.returncode == 0, result.stderr
    (named,) = (tmp_path / "golden").rglob("named_shardings.json")
    return named


def test_provoked_rule_reports_the_remat_and_a_golden_that_drifted(tmp_path):
    named = dump_golden(tmp_path, "remat", *REMAT_MESH)
    doc = json.loads(named.read_text())
    drifted = "params/decoder/decoder_norm/scale"
    doc["tensors"][drifted]["partition_spec"] = ["fsdp"]  # the golden claims a layout the rules do not give
    named.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    result = run_cli("verify", *case_args("remat", *REMAT_MESH), "--golden-dir", str(tmp_path / "golden"), "--format", "json",
                     "--replicated-threshold", "128MiB")
    assert result.returncode == 1, result.stderr
    (case,) = json.loads(result.stdout)["cases"]
    remats = case["involuntary_rematerializations"]
    assert remats, case
    assert all(r["from_sharding"].startswith("{") and r["to_sharding"].startswith("{") and r["shape"] for r in remats)
    # the layer axis on fsdp: whole stacks of 28 layers gathered at once, which XLA does not warn about
    stacks = [v for v in case["replicated_values"] if v["where"] == "all-gather" and v["shape"].startswith("f32[28,")]
    assert stacks and all(v["bytes"] >= 128 * 2**20 for v in stacks), case["replicated_values"]
    assert [m["tensor"] for m in case["sharding_mismatches"]] == [drifted]
    assert case["sharding_mismatches"][0]["golden"] == ["fsdp"]
    assert any("involuntary full rematerialization" in f for f in case["failures"])


def test_clean_case_exits_0_and_records_its_figures(tmp_path):
    dump_golden(tmp_path, "clean")
    result = run_cli("verify", *case_args("clean"), "--golden-dir", str(tmp_path / "golden"), "--record")
    assert result.returncode == 0, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("qwen3-0.6b/cpu-4/slice_1/rule_clean_per_device_batch_size=1_max_target_length=256: ok (cpu, 4 devices")
    assert "XLA:CPU estimate" in result.stdout and "no HBM limit" in result.stdout
    (recorded,) = (tmp_path / "golden").rglob("compiled_cpu_jax-*.json")
    figures = json.loads(recorded.read_text())
    assert figures["backend"] == "cpu" and figures["devices"] == 4
    assert figures["involuntary_rematerializations"] == 0 and figures["replicated_values"] == 0
    # arguments: the whole state and the batch, split four ways; all of the state is donated
    memory = figures["memory_per_device"]
    assert memory["alias"] > 0.99 * memory["output"] and memory["argument"] > memory["alias"]
    # the 28 scanned layers each gather their weights: the loop's trip count multiplies them
    assert figures["collectives_per_step"]["all-gather"]["count"] >= 28


def test_recorded_figures_that_differ_fail_the_case(tmp_path):
    """Comparison with recorded figures, on figures as the child reports them (no compile needed)."""
    from sharding_dump.case import Case

    case = Case.make("qwen3-0.6b", "cpu-4", str(DATA / "clean.yml"))
    result = verify.CaseResult(case.label, "cpu", 4, None, memory={"argument": 8, "output": 4, "alias": 4, "temp": 16},
                               collectives={"all-gather": verify.Traffic(28, 1024)}, jax_version="0.10.2")
    options = verify.Options(2**30, tmp_path, record=True)
    verify._compare_figures(case, options, result)
    assert result.figures_written and not result.failures
    result.figures_written = False
    result.memory["temp"] = 32
    verify._compare_figures(case, verify.Options(2**30, tmp_path), result)
    assert result.figures_changed == [("memory_per_device.temp", 16, 32)]
    assert result.failures == [f"compiled figures differ from {result.figures_file} (rerun with --record if intended)"]
    other = verify.CaseResult(case.label, "tpu", 4, None, memory=result.memory, jax_version="0.10.2")
    verify._compare_figures(case, verify.Options(2**30, tmp_path), other)
    assert not other.figures_changed  # another backend's figures are never compared


@pytest.mark.parametrize("extra, message", [
    (["--replicated-threshold", "lots"], "--replicated-threshold 'lots': give a size such as 256MiB"),
    (["--tpu"], "--tpu: "),
    (["--format", "yaml"], "argument --format: invalid choice: 'yaml'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, message):
    status = main(["verify", *case_args("clean"), "--golden-dir", str(tmp_path), *extra])
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert list(tmp_path.iterdir()) == []


def test_recorded_figures_survive_a_golden_update_and_are_not_stale(tmp_path):
    """verify --record's file lives in the case folder: a rewrite of the goldens keeps it, and the
    stale check does not call it stray."""
    from sharding_dump import golden, serialize, stale
    from sharding_dump.case import Case, golden_dir

    case = Case.make("qwen3-0.6b", "cpu-4", str(DATA / "clean.yml"))
    folder = golden_dir(case, tmp_path)
    folder.mkdir(parents=True)
    recorded = folder / "compiled_cpu_jax-0.10.2.json"
    recorded.write_bytes(serialize.canonical_bytes({"memory_per_device": {"temp": 1}}))
    outcome = golden.check_or_update(case, tmp_path, update=True)
    assert outcome.status == "written" and recorded.read_bytes().startswith(b"{")
    assert stale.stale_paths(tmp_path, [case]) == []
    (folder / "notes.txt").write_text("by hand")
    assert [p.name for p in stale.stale_paths(tmp_path, [case])] == ["notes.txt"]
