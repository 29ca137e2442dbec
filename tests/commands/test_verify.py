"""`sharding-dump verify`: the real training step compiled on fake CPU devices, on a tiny Qwen3 card
(tests/data/verify/tiny-qwen3.yml: every block of qwen3-0.6b, small enough to compile in seconds).

Three compiles: a provoked rule file (tests/data/verify/remat.yml) with the two mistakes an abstract
dump calls clean (two splits of embed that XLA can only reconcile by rebuilding a value whole, and a
layer stack split on its layer axis), through the CLI and through pytest's --sharding-verify; and a
clean one whose compiled shardings equal its golden. Everything else is bad input, checked before
any compile, or figures compared without a compile.
"""

import json
import re

import pytest

from helpers import REPO, run_cli
from sharding_dump.commands.cli import main
from sharding_dump.commands.verify import figures, hlo, xla_log
from sharding_dump.commands.verify.render import render_case
from sharding_dump.commands.verify.result import CaseResult
from sharding_dump.commands.verify.settings import Options

DATA = REPO / "tests/data/verify"
TINY = str(DATA / "tiny-qwen3.yml")
SMALL = ["per_device_batch_size=1", "max_target_length=256"]
REMAT_MESH = ["ici_data_parallelism=2", "ici_tensor_parallelism=2"]


def case_args(rule: str, *extra: str, topology: str = "cpu-4") -> list[str]:
    return ["--model", TINY, "--topology", topology, "--rule", str(DATA / f"{rule}.yml"), *SMALL, *extra]


def dump_golden(tmp_path, args: list[str]):
    """Writes the case's golden under tmp_path/golden and returns its named document's path."""
    result = run_cli(*args, "--output-dir", str(tmp_path / "golden"))
    assert result.returncode == 0, result.stderr
    (named,) = (tmp_path / "golden").rglob("named_shardings.json")
    return named


def _split_dims(hlo_sharding: str, shape: str) -> list[int]:
    """The dimensions an HLO sharding such as `{devices=[4,1,1]0,2,1,3}` splits, for a value of `shape`
    (`bf16[2,256,256]`); a trailing replication dimension is not one of them."""
    rank = shape.count(",") + 1
    tiles = re.match(r"\{devices=\[([0-9,]+)\]", hlo_sharding)
    assert tiles, hlo_sharding
    return [d for d, n in enumerate(int(t) for t in tiles.group(1).split(",")[:rank]) if n > 1]


@pytest.mark.compile
def test_provoked_rule_reports_the_remat_the_gathered_stacks_and_a_golden_that_drifted(tmp_path):
    args = case_args("remat", *REMAT_MESH, topology="cpu-8")
    named = dump_golden(tmp_path, args)
    doc = json.loads(named.read_text())
    drifted = "model/decoder/decoder_norm/scale"
    doc["tensors"][drifted]["partition_spec"] = ["fsdp"]  # the golden claims a layout the rules do not give
    named.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    result = run_cli("verify", *args, "--golden-dir", str(tmp_path / "golden"), "--format", "json",
                     "--replicated-threshold", "1MiB")
    assert result.returncode == 1, result.stderr
    (case,) = json.loads(result.stdout)["cases"]
    remats = case["involuntary_rematerializations"]
    # The layer's activations split their batch over (data, fsdp), the attention's only over data with
    # fsdp on embed: inside a decoder layer XLA cannot go from the batch split to the embed split and
    # rebuilds the value whole. The op it names is not stable: the collective the partitioner adds
    # carries the metadata of the op it feeds with jax 0.10 (self_attention/out/dot_general, backward
    # pass), of the op it reads with jax 0.12 (the layer's constraint on the attention's result); the
    # partitioned program is the same.
    assert any("/decoder/" in r["op_name"] and "/layers/" in r["op_name"]
               and _split_dims(r["from_sharding"], r["shape"]) == [0]
               and _split_dims(r["to_sharding"], r["shape"]) == [2] for r in remats), remats
    assert all(r["from_sharding"].startswith("{") and r["to_sharding"].startswith("{") and r["shape"] for r in remats)
    # the layer axis on data: every whole stack of 8 layers gathered, which XLA does not warn about
    stacks = [v for v in case["replicated_values"] if v["where"] == "all-gather" and v["shape"].startswith("f32[8,")]
    assert stacks and all(v["bytes"] >= 2**20 for v in stacks), case["replicated_values"]
    assert [m["tensor"] for m in case["sharding_mismatches"]] == [drifted]
    assert case["sharding_mismatches"][0]["golden"] == ["fsdp"]
    assert any("involuntary full rematerialization" in f for f in case["failures"])


@pytest.mark.compile
def test_clean_case_exits_0_and_records_its_figures(tmp_path):
    dump_golden(tmp_path, case_args("clean"))
    result = run_cli("verify", *case_args("clean"), "--golden-dir", str(tmp_path / "golden"), "--record",
                     "--replicated-threshold", "1MiB")
    assert result.returncode == 0, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("tiny-qwen3/cpu-4/slice_1/rule_clean_per_device_batch_size=1_max_target_length=256: ok (cpu, 4 devices")
    assert "XLA:CPU estimate" in result.stdout and "no HBM limit" in result.stdout
    (recorded,) = (tmp_path / "golden").rglob("compiled_cpu_jax-*.json")
    figures = json.loads(recorded.read_text())
    assert figures["backend"] == "cpu" and figures["devices"] == 4
    assert figures["involuntary_rematerializations"] == 0 and figures["replicated_values"] == 0
    # arguments: the whole state and the batch, split four ways; all of the state is donated
    memory = figures["memory_per_device"]
    assert memory["alias"] > 0.99 * memory["output"] and memory["argument"] > memory["alias"]
    # the 8 scanned layers each gather their weights: the loop's trip count multiplies them
    assert figures["collectives_per_step"]["all-gather"]["count"] >= 8


@pytest.mark.compile
def test_sharding_verify_fails_the_case_test_with_the_report(mini_project):
    """pytest --sharding-verify: a case whose golden is right but whose compiled step rematerializes
    fails its test with verify's report; without the option the same case passes."""
    pytester = mini_project({"cases.yml": (
        "cases:\n"
        f"  - {{model: {TINY}, topology: cpu-8, rule: {DATA / 'remat.yml'},\n"
        "     overrides: {per_device_batch_size: 1, max_target_length: 256, ici_data_parallelism: 2,\n"
        "                 ici_tensor_parallelism: 2}}\n")}, table='golden-dir = "goldens"\ncases = ["cases.yml"]')
    assert main(["--all", "--cases", str(pytester.path / "cases.yml"), "--golden-dir", str(pytester.path / "goldens")]) == 0
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "pyproject.toml").assert_outcomes(passed=2)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "pyproject.toml", "--sharding-verify")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAIL * involuntary full rematerialization*", "*[[]remat[]]*/decoder/*/layers/*"])


@pytest.mark.compile
def test_jobs_compile_cases_at_once_and_report_them_in_order(tmp_path):
    """`verify --all -j 2`: two cases, compiled by two child processes at once, are reported in the case
    file's order with the figures compiling one at a time gives (the time saved is tools/bench.py's)."""
    cases = tmp_path / "cases.yml"
    overrides = ", ".join(setting.replace("=", ": ") for setting in SMALL)
    cases.write_text("cases:\n" + "".join(f"  - {{model: {TINY}, topology: {topology}, rule: {DATA / 'clean.yml'}, "
                                           f"overrides: {{{overrides}}}}}\n" for topology in ("cpu-2", "cpu-4")))

    assert run_cli("--all", "--cases", str(cases), "--golden-dir", str(tmp_path / "g")).returncode == 0

    def report(*jobs: str) -> str:
        result = run_cli("verify", "--all", "--cases", str(cases), "--golden-dir", str(tmp_path / "g"),
                         "--format", "json", *jobs)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    one, two = report(), report("-j", "2")
    assert two == one  # the json report holds no timings: the same bytes
    labels = [case["case"] for case in json.loads(two)["cases"]]
    assert len(labels) == 2 and "/cpu-4/" in labels[1], labels


def test_recorded_figures_that_differ_fail_the_case(tmp_path):
    """Comparison with recorded figures, on figures as the child reports them (no compile needed)."""
    from sharding_dump.zoo.case import Case

    case = Case.make(TINY, "cpu-4", str(DATA / "clean.yml"))
    result = CaseResult(case.label, "cpu", 4, None, memory={"argument": 8, "output": 4, "alias": 4, "temp": 16},
                               collectives={"all-gather": hlo.Traffic(28, 1024)}, jax_version="0.10.2")
    options = Options(2**30, tmp_path, record=True)
    figures.compare_figures(case, options, result)
    assert result.figures_written and not result.failures
    result.figures_written = False
    result.memory["temp"] = 32
    figures.compare_figures(case, Options(2**30, tmp_path), result)
    assert result.figures_changed == [("memory_per_device.temp", 16, 32)]
    assert result.failures == [f"compiled figures differ from {result.figures_file} (rerun with --record if intended)"]
    other = CaseResult(case.label, "tpu", 4, None, memory=result.memory, jax_version="0.10.2")
    figures.compare_figures(case, Options(2**30, tmp_path), other)
    assert not other.figures_changed  # another backend's figures are never compared


@pytest.mark.parametrize("extra, message", [
    (["--replicated-threshold", "lots"], "--replicated-threshold 'lots': give a size such as 256MiB"),
    (["--tpu"], "--tpu: "),
    (["--format", "yaml"], "argument --format: invalid choice: 'yaml'"),
    (["-j", "0"], "-j 0: give the number of cases to compile at once, 1 or more"),
    (["--jobs", "two"], "argument -j/--jobs: 'two' is not a whole number"),
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
    from sharding_dump.golden import codec, stale
    from sharding_dump.zoo import goldens
    from sharding_dump.zoo.case import Case, golden_dir

    case = Case.make(TINY, "cpu-4", str(DATA / "clean.yml"))
    folder = golden_dir(case, tmp_path)
    folder.mkdir(parents=True)
    recorded = folder / "compiled_cpu_jax-0.10.2.json"
    recorded.write_bytes(codec.canonical_bytes({"memory_per_device": {"temp": 1}}))
    outcome = goldens.check_or_update(case, tmp_path, update=True)
    assert outcome.status == "written" and recorded.read_bytes().startswith(b"{")
    assert stale.stale_paths(tmp_path, [folder]) == []
    (folder / "notes.txt").write_text("by hand")
    assert [p.name for p in stale.stale_paths(tmp_path, [folder])] == ["notes.txt"]


def test_remats_of_the_partitioners_trials_are_listed_but_do_not_fail(tmp_path):
    """XLA also warns about scratch computations it partitions to try a strategy; their input is a
    `%fake_parameter`. Those are listed, marked, and not counted; a warning about the program is."""
    head = ("W1122 09:38:54.423001 8674 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. "
            "The compiler cannot go from sharding {devices=[16,1,1]<=[16]} to {devices=[1,1,8,2]<=[2,8]T(1,0) "
            "last_tile_dim_replicate} efficiently for HLO operation ")
    trial = head + "%fake_parameter.2 = f32[12,2048,4096]{2,1,0} parameter(2), sharding={devices=[16,1,1]<=[16]}. As the last resort"
    trial_gather = head + ("%gather = f32[4,4096,128]{2,1,0} gather(%fake_parameter.0, %all-gather), offset_dims={2}, "
                           "sharding={devices=[1,1,8]<=[8]}. As the last resort")
    real = head + ('%gather = f32[4,4096,128]{2,1,0} gather(%param, %all-gather), offset_dims={2}, '
                   'metadata={op_name="jit(step)/token_embedder/gather" stack_frame_id=23}. As the last resort')
    remats = xla_log.rematerializations("\n".join([trial, trial_gather, real]))
    assert [(r.trial, r.shape) for r in remats] == [(True, "f32[12,2048,4096]"), (True, "f32[4,4096,128]"),
                                                    (False, "f32[4,4096,128]")]
    result = CaseResult("c", "cpu", 16, None, remats=remats[:2], threshold=1)
    assert result.failures == [] and result.figures()["involuntary_rematerializations"] == 0
    assert "[remat, in a partitioner trial, not a failure]" in render_case(result)
    result.remats = remats
    assert result.failures == ["1 involuntary full rematerialization"]


TPU_STYLE_LOOP = """\
HloModule step

%cond (p: (s32[], f32[8,128])) -> pred[] {
  %constant.4 = s32[]{:T(128)} constant(6)
  %p = (s32[]{:T(128)}, f32[8,128]{1,0}) parameter(0)
  %get-tuple-element.1 = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt.1 = pred[]{:T(512)} compare(%get-tuple-element.1, %constant.4), direction=LT
}

%body (q: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %q = (s32[]{:T(128)}, f32[8,128]{1,0}) parameter(0)
  %get-tuple-element.2 = f32[8,128]{1,0} get-tuple-element(%q), index=1
  %all-gather-start.1 = (f32[8,128]{1,0}, f32[32,128]{1,0}) all-gather-start(%get-tuple-element.2), dimensions={0}
  %all-gather-done.1 = f32[32,128]{1,0} all-gather-done(%all-gather-start.1)
  ROOT %tuple.1 = (s32[]{:T(128)}, f32[8,128]{1,0}) tuple(%get-tuple-element.2, %get-tuple-element.2)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8,128]) -> f32[8,128] {
  %x = f32[8,128]{1,0} parameter(0)
  %all-reduce.1 = f32[8,128]{1,0} all-reduce(%x), to_apply=%add
  %tuple.2 = (s32[]{:T(128)}, f32[8,128]{1,0}) tuple(%x, %x)
  %while.1 = (s32[]{:T(128)}, f32[8,128]{1,0}) while(%tuple.2), condition=%cond, body=%body
  ROOT %get-tuple-element.3 = f32[8,128]{1,0} get-tuple-element(%while.1), index=1
}
"""


def test_collectives_multiply_loop_bodies_by_the_trip_count_written_or_read_from_the_condition():
    """XLA:CPU writes a loop's known_trip_count; XLA:TPU does not, so the bound of `counter < N` in
    the loop's condition is used. An async all-gather counts its result (4 x 8 x 128 floats)."""
    traffic = hlo.collectives(TPU_STYLE_LOOP)
    assert (traffic["all-gather"].count, traffic["all-gather"].bytes) == (6, 6 * 32 * 128 * 4)
    assert (traffic["all-reduce"].count, traffic["all-reduce"].bytes) == (1, 8 * 128 * 4)
    written = TPU_STYLE_LOOP.replace("body=%body\n", 'body=%body, backend_config={"known_trip_count":{"n":"3"}}\n')
    assert hlo.collectives(written)["all-gather"].count == 3


def every_dtype() -> list:
    """Every dtype jax can put in an array here: numpy's (without 64-bit, off in the command) and
    ml_dtypes' (bfloat16, every float8 and float4, the sub-byte integers)."""
    import ml_dtypes
    import numpy as np

    found = []
    for candidate in [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.float16,
                      np.float32, np.complex64] + [getattr(ml_dtypes, name) for name in sorted(dir(ml_dtypes))]:
        try:
            found.append(np.dtype(candidate))
        except (TypeError, ValueError):  # a function of ml_dtypes (finfo, ...), not a type
            continue
    return [dtype for dtype in found if dtype.kind != "O"]


def test_hlo_sizes_count_every_dtype_as_xla_does():
    """array_bytes of a compiled parameter's HLO type equals XLA's own count of its bytes
    (memory_analysis) for every dtype jax compiles: float8 and float4 arrays, packed sub-byte integers,
    pred. A dtype XLA's CPU client refuses (float6 on this jaxlib) is left out by XLA itself."""
    import jax

    compiled_dtypes = []
    for dtype in every_dtype():
        try:
            compiled = jax.jit(lambda a: a).lower(jax.ShapeDtypeStruct((4, 8), dtype)).compile()
        except Exception:  # noqa: BLE001 - jax cannot lower it (complex32) or XLA here refuses it (float6)
            continue
        (parameter,) = [line for line in compiled.as_text().splitlines() if "parameter(0)" in line]
        hlo_type = parameter.split(" = ", 1)[1].rpartition(" parameter(0)")[0]
        assert hlo.array_bytes(hlo_type) == compiled.memory_analysis().argument_size_in_bytes, (dtype, hlo_type)
        compiled_dtypes.append(dtype.name)
    assert {"float8_e4m3fn", "float8_e5m2", "int4", "uint4", "float4_e2m1fn", "bool", "bfloat16"} <= set(compiled_dtypes)


@pytest.mark.compile
def test_a_decode_step_compiles_on_an_explicit_mesh():
    """The serving example's generate step (jax-llm-examples' decode_step, which writes each slot's new
    keys and values with dynamic_update_slice) on an Explicit mesh: its stand-in state carries the
    state's own shardings, as the server's arrays do (unsharded stand-ins fail with `ShardingTypeError:
    dynamic_update_slice operand sharding must be equal to update sharding`), and its compiled cache
    layout is the golden's."""
    result = run_cli("verify", "--all", "--cases", str(REPO / "examples/serving_cases.yml"),
                     "--golden-dir", str(REPO / "golden"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("examples.llama3_serving:small_llama3/cpu-8/")
    assert ": ok (cpu, 8 devices" in result.stdout
    assert "memory per device (XLA:CPU estimate" in result.stdout


@pytest.mark.compile
def test_a_zoo_servers_generate_step_compiles_as_its_golden_lays_it_out(tmp_path):
    """A card served (serving=true, MaxText's inference rules): MaxEngine's generate step over the KV
    cache compiles on 8 CPU devices, and the compiled state (weights, cache, decode state) is laid out as
    the dump says."""
    args = ["--model", "qwen3-0.6b", "--topology", "tpu7x-8", "--rule", "inference", "serving=true",
            "per_device_batch_size=1", "max_target_length=256", "max_prefill_predict_length=128"]
    dump_golden(tmp_path, args)
    result = run_cli("verify", *args, "--golden-dir", str(tmp_path / "golden"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": ok (cpu, 8 devices" in result.stdout.splitlines()[0]
