#!/usr/bin/env python3
"""Benchmark: wall time and peak memory of every case, cold (fresh process) and warm (in-process).

    python tools/bench.py            # every case of the matrix
    python tools/bench.py --cases 3  # the first three
    python tools/bench.py --model deepseek2-16b --model deepseek3-671b   # only these models' cases
    python tools/bench.py --verify --model llama2-7b --cases 1   # `sharding-dump verify` per case instead
    python tools/bench.py --suite    # each CI step (pytest -n 2, -m compile, -m sweep, -m package, the docs site): wall time
    python tools/bench.py --suite-cpu   # the default suite: CPU seconds per test, per file, per process's start
    python tools/bench.py --table    # the speed table: each figure beside its floor and goal, paired in one run
    python tools/bench.py --table --no-suite   # the same without the test suite (minutes less)
    python tools/bench.py --maxtext MAXTEXT/tests/utils/sharding_dump.py   # run with a Python that has MaxText

Cold = `python -m sharding_dump.commands.cli <case> --output-dir TMP` in a new process (imports included), and
the same for `check --all`, `diff golden golden` and `show` of the first case, beside the time of
importing jax, flax.linen and optax alone (what any cold figure includes, which varies by machine);
peak RSS from wait4. Warm = render_case() again in this process after one run of each case; peak is
this process's max RSS growth. Figures are printed, never asserted. The package's modules are compiled
first, as installing its wheel compiles them (and the floor's, by their own installs): a checkout
installed editable where the environment sets PYTHONDONTWRITEBYTECODE would otherwise compile them
again in every process (0.1 s of a 1.1 s cold dump).

--table: the four figures of the speed table, each beside its floor, in one run: a cold dump of
llama2-7b v5p-16 pure-fsdp against `import jax, flax.linen, optax` (runs alternate, medians); `--all`
with the default parallelism against the sum of its unique traces (each distinct training step traced
once, in this process, divided by the cores); `diff golden golden` against starting Python; the default
suite with -n 2 in a bare copy of the checkout (the files git tracks, as the working tree holds them: no
compiled modules, as in a fresh clone) against its golden tests alone (`pytest -n 2 pyproject.toml`, run
after it in the same copy): what any suite that recomputes every golden costs. Wall and CPU seconds (user
+ system, children included): on a shared machine the CPU figure is what a quiet one's wall time would be.
--maxtext SCRIPT: the cases of tests/data/maxtext/program/cases.yml (ten; --cases N the first N) through
the installed MaxText's own code, as the pair: MaxText's own dump SCRIPT (its tests/utils/sharding_dump.py,
one process per case, writing under a temporary MAXTEXT_REPO_ROOT) and `python -m sharding_dump.maxtext
--cases` (one process for all of them, MaxText imported once): wall time per case of each, in one run.

--verify: per case, `sharding-dump verify` in a new process; the CPU seconds (user + system) and peak
RSS of the child that compiles the step, as its first output line reports them, and the wall time.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sharding_dump.zoo.dump import render_case  # noqa: E402
from sharding_dump.zoo.matrix import load_matrix  # noqa: E402

# The child reports its own peak RSS (VmHWM of its memory map): ru_maxrss from wait4 would not do,
# since Linux carries a parent's peak RSS across fork+exec into the child's figure.
_CHILD = """
import atexit, runpy, sys
def _peak():
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    sys.stderr.write(f"\\nbench-peak-kib {kib}\\n")
atexit.register(_peak)
sys.argv = ["sharding-dump", *sys.argv[1:]]
runpy.run_module("sharding_dump.commands.cli", run_name="__main__")
"""


def run_child(args: list[str], ok_exits: tuple[int, ...] = (0,)) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one CLI process; an exit status outside `ok_exits` stops the run."""
    wall, _, peak = timed([sys.executable, "-c", _CHILD, *args], ok_exits)
    return wall, peak


def timed(command: list[str], ok_exits: tuple[int, ...] = (0,)) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of the process and its children, peak RSS MiB when it is a CLI child
    reporting it, else 0) of one process; an exit status outside `ok_exits` stops the run."""
    proc, wall, cpu = measured(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if proc.returncode not in ok_exits:
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(command[3:] or command)}: {proc.stderr}")
    peak = [line for line in proc.stderr.splitlines() if line.startswith("bench-peak-kib ")]
    return wall, cpu, int(peak[-1].split()[1]) / 1024 if peak else 0.0


def measured(command: list[str], cwd: Path | None = REPO,
             **run: Any) -> tuple[subprocess.CompletedProcess, float, float]:
    """(the finished process, its wall seconds, the CPU seconds of it and its children) of `command` run
    in `cwd` (None: this process's; `run`: subprocess.run's other arguments; output as text)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, text=True, **run)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def last_line(output: str) -> str:
    """pytest's summary: the last line of its output, without its rule of `=`."""
    lines = output.strip().splitlines()
    return lines[-1].strip("= ") if lines else ""


def cli(*args: str) -> list[str]:
    """The command line of one CLI child (reporting its peak RSS)."""
    return [sys.executable, "-c", _CHILD, *args]


def unique_traces(cases: list) -> tuple[int, float]:
    """(distinct training steps, seconds to trace each once): what `--all` cannot do in less time on
    one core. Each case's setup and abstract state are built first and not counted. Steps are told
    apart as `--all` tells them apart: by their inputs, without the rule file where the trace's rules
    reached it only as constrain()'s specs (sharding_dump.zoo.dump.step_reading). A serving case counts
    the trace of its steps (prefill, insert, generate), once."""
    import jax

    from sharding_dump.core.capture import read_constraints
    from sharding_dump.zoo import serving
    from sharding_dump.zoo.dump import abstract_state_of, setup_case, trace_case

    seconds: dict[tuple, float] = {}
    with jax.numpy_dtype_promotion("standard"):
        for case in cases:
            setup = setup_case(case)
            if serving.serves(case):
                start = time.perf_counter()
                serving.traced_of(setup)
                seconds[("serving", case.label)] = time.perf_counter() - start
                continue
            free = setup.shared_step_inputs()
            if setup.step_inputs() in seconds or free in seconds:
                continue
            abstract_state_of(setup)
            start = time.perf_counter()
            closed, rec = trace_case(setup)
            took = time.perf_counter() - start
            read_constraints(closed, rec)  # notes a constrain() placement a transform changed
            seconds[free if free is not None and not rec.rules_read else setup.step_inputs()] = took
    return len(seconds), sum(seconds.values())


def bench_table(cases: list, suite: bool, repeat: int) -> None:
    """The speed table: each figure beside its floor and its goal, paired in this one run."""
    from sharding_dump.commands.dump import default_jobs

    jobs = default_jobs()
    print(f"{len(cases)} cases, {jobs} cores usable, python {sys.version.split()[0]}, load average "
          f"{os.getloadavg()[0]:.1f} (wall seconds; CPU seconds in brackets)", flush=True)
    row = "{:<54} {:>17} {:>26} {:>8} {:>10}"
    print(row.format("figure", "measured", "floor", "ratio", "goal"))

    def pair(figure: tuple[float, float], floor: tuple[float, float]) -> str:
        return f"{figure[0] / floor[0]:.2f}x [{figure[1] / floor[1]:.2f}x]"

    with tempfile.TemporaryDirectory() as tmp:
        dumps, floors = [], []
        for _ in range(repeat):  # alternating, so both see the same load
            floors.append(timed([sys.executable, "-c", "import jax, flax.linen, optax"])[:2])
            dumps.append(timed(cli("--model", "llama2-7b", "--topology", "v5p-16", "--rule", "pure-fsdp",
                                   "--golden-dir", tmp))[:2])
        dump = tuple(statistics.median(d[i] for d in dumps) for i in (0, 1))
        floor = tuple(statistics.median(f[i] for f in floors) for i in (0, 1))
        print(row.format("cold dump, llama2-7b v5p-16 pure-fsdp", f"{dump[0]:.2f} [{dump[1]:.2f}]",
                         f"{floor[0]:.2f} [{floor[1]:.2f}] import jax+flax+optax", pair(dump, floor), "<= 1.3x"),
              flush=True)
        count, traces = unique_traces(cases)
        wall, cpu, _ = timed(cli("--all", "--golden-dir", tmp))
        per_case = f"{wall / len(cases):.2f}/case"
        print(row.format(f"sharding-dump --all (-j {jobs}), {per_case}", f"{wall:.1f} [{cpu:.1f}]",
                         f"{traces / jobs:.1f} {count} traces/{jobs} cores", f"{wall / (traces / jobs):.2f}x",
                         f"{0.2 * len(cases):.1f} s"), flush=True)
    diff = timed(cli("diff", "golden", "golden"), ok_exits=(0, 1))[:2]
    start = timed([sys.executable, "-c", "pass"])[:2]
    print(row.format("sharding-dump diff golden golden", f"{diff[0]:.2f} [{diff[1]:.2f}]",
                     f"{start[0]:.2f} [{start[1]:.2f}] python -c pass", pair(diff, start), "0.5 s"), flush=True)
    if suite:
        with tempfile.TemporaryDirectory() as tmp:
            clone = bare_copy(Path(tmp) / "clone")
            whole, last = pytest_run(clone)
            goldens, _ = pytest_run(clone, "pyproject.toml")  # after the whole suite: modules compiled
        print(row.format("default suite, pytest -n 2, bare copy", f"{whole[0]:.1f} [{whole[1]:.1f}]",
                         f"{goldens[0]:.1f} [{goldens[1]:.1f}] golden tests alone", pair(whole, goldens), "60 s")
              + f"  ({last})", flush=True)


def pytest_run(folder: Path, *paths: str) -> tuple[tuple[float, float], str]:
    """((wall, CPU seconds), pytest's last line) of `pytest -n 2` in `folder`, over `paths` if given."""
    proc, wall, cpu = measured([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", *paths],
                               cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return (wall, cpu), last_line(proc.stdout)


def bare_copy(dest: Path) -> Path:
    """The files git tracks in this checkout, as they are in the working tree, copied to `dest`: what a
    clone of them holds (no compiled modules, no caches), where the issue measures the suite."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def case_args(case) -> list[str]:
    return case.command().split()[1:]


def bench_verify(cases) -> None:
    """CPU seconds and peak RSS of `sharding-dump verify` per case (findings are results, not failures)."""
    import re

    units = {"Bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    figures = re.compile(r": (ok|FAILED) \(\w+, \d+ devices, ([0-9.]+) s CPU, ([0-9.]+) (\w+) peak RSS\)$")
    print(f"{'case (sharding-dump verify)':<92} {'wall s':>7} {'CPU s':>7} {'peak MiB':>9} {'result':>7}")
    for case in cases:
        proc, wall, _ = measured([sys.executable, "-m", "sharding_dump.commands.cli", "verify", *case_args(case)],
                                 capture_output=True)
        match = figures.search(proc.stdout.splitlines()[0]) if proc.stdout else None
        if proc.returncode not in (0, 1) or not match:
            raise SystemExit(f"failed (exit {proc.returncode}): verify {case.label}: {proc.stdout[:500]}{proc.stderr}")
        status, cpu, size, unit = match.groups()
        peak = float(size) * units[unit] / 2**20
        print(f"{case.label:<92} {wall:>7.1f} {float(cpu):>7.1f} {peak:>9.0f} {status:>7}", flush=True)


SUITE_STEPS = (("default suite", []), ("compile checks", ["-m", "compile"]), ("sweeps", ["-m", "sweep"]),
               ("wheel", ["-m", "package"]))


def bench_suite(workers: int) -> None:
    """Wall time of each step CI runs on the pinned stack: the README's test command, then the compile
    checks and the sweeps, with the default suite's slowest tests (pytest's --durations), then the docs
    site's strict build; printed, not asserted."""
    print(f"({os.cpu_count()} cores, python {sys.version.split()[0]})", flush=True)
    for name, marks in SUITE_STEPS:
        command = [sys.executable, "-m", "pytest", "-n", str(workers), "-q", "-p", "no:cacheprovider", *marks]
        if not marks:
            command.append("--durations=15")
        proc, wall, _ = measured(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lines = proc.stdout.splitlines()
        durations = [i for i, line in enumerate(lines) if "slowest" in line and "durations" in line]
        if durations:
            print("\n".join(line for line in lines[durations[0]:-1] if line.strip() and not line.startswith("=" * 5)))
        print(f"{name + ': python ' + ' '.join(command[1:]):<92} {wall:>7.2f} s wall, exit {proc.returncode}: "
              f"{last_line(proc.stdout)}", flush=True)
    bench_docs()


def bench_suite_cpu(workers: int, top: int = 25) -> None:
    """The default suite with -n `workers`, each test's CPU seconds (tools/cpu_per_test.py): the
    whole run's wall and CPU, each process's start (imports, conftest, collection), the `top` tests and
    test files by CPU. On a shared machine CPU seconds are what wall seconds would be on a quiet one."""
    import collections

    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "CPU_PER_TEST_DIR": folder,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tools"), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "pytest", "-n", str(workers), "-q", "-p", "no:cacheprovider",
                   "-p", "cpu_per_test"]
        proc, wall, cpu = measured(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        rows = {path.stem: [line.rstrip("\n").split("\t") for line in path.open(encoding="utf-8")]
                for path in sorted(Path(folder).glob("*.tsv"))}
    print(f"default suite, python -m pytest -n {workers}: {wall:.1f} s wall, {cpu:.1f} s CPU, load average "
          f"{os.getloadavg()[0]:.1f} ({last_line(proc.stdout)})")
    for line in proc.stdout.splitlines():  # a failing test is said, not lost in the figures
        if line.startswith(("FAILED ", "ERROR ")):
            print(line)
    tests = [(float(r[1]) + float(r[2]), float(r[2]), r[4]) for lines in rows.values() for r in lines if r[0] == "test"]
    starts = ", ".join(f"{name} {r[1]} s" for name, lines in rows.items() for r in lines if r[0] == "start")
    ends = ", ".join(f"{name} {r[1]} s" for name, lines in rows.items() for r in lines if r[0] == "end")
    print(f"CPU before the first test (interpreter, imports, conftest, collection): {starts}; "
          f"each process in all: {ends}")
    print(f"tests: {sum(t[0] for t in tests):.1f} s CPU in {len(tests)} tests, "
          f"{sum(t[1] for t in tests):.1f} s of it in child processes")
    print(f"\n{'CPU s':>7} {'child':>7}  test (the {top} that cost most)")
    for total, child, node in sorted(tests, reverse=True)[:top]:
        print(f"{total:>7.2f} {child:>7.2f}  {node[:150]}")
    files: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for total, _, node in tests:
        files[node.split("::")[0]] += total
        counts[node.split("::")[0]] += 1
    print(f"\n{'CPU s':>7} {'tests':>6}  file (the {top} that cost most)")
    for name, total in files.most_common(top):
        print(f"{total:>7.2f} {counts[name]:>6}  {name}")


def bench_docs() -> None:
    """Wall time of CI's docs step, `mkdocs build --strict` (when the docs extra is installed)."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        print("docs site: skipped (pip install -e '.[docs]' -c constraints.txt)", flush=True)
        return
    with tempfile.TemporaryDirectory() as site:
        command = [str(mkdocs), "build", "--strict", "--quiet", "--site-dir", site]
        proc, wall, _ = measured(command, capture_output=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    print(f"{'docs site: mkdocs build --strict':<92} {wall:>7.2f} s wall, exit {proc.returncode}", flush=True)


def bench_maxtext(script: str, count: int) -> None:
    """Wall time per case: MaxText's own dump (a process per case) against one process for all cases."""
    import yaml

    from sharding_dump.maxtext.case import load_cases

    source = REPO / "tests" / "data" / "maxtext" / "program" / "cases.yml"
    cases = load_cases(source)[: count or None]
    base = subprocess.run([sys.executable, "-c", "from maxtext.utils.globals import MAXTEXT_PKG_DIR as d; print(d)"],
                          capture_output=True, text=True, check=True).stdout.strip() + "/configs/base.yml"
    print(f"{len(cases)} MaxText cases, {os.cpu_count()} cores, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        own = []
        for case in cases:
            root = Path(tmp) / f"own{len(own)}"
            proc, wall, _ = measured([sys.executable, script, *case.argv(base)[1:]], cwd=None, capture_output=True,
                                     env={**os.environ, "MAXTEXT_REPO_ROOT": str(root)})
            own.append(wall)
            wrote = len(list(root.rglob("named_shardings.json")))
            print(f"{'MaxText own dump ' + case.label:<110} {own[-1]:>7.2f} s, exit {proc.returncode}, "
                  f"{'wrote its files' if wrote else 'wrote nothing'}", flush=True)
        listed = Path(tmp) / "cases.yml"
        listed.write_text(yaml.safe_dump({"cases": [{"args": [f"{k}={v}" for k, v in c.words]} for c in cases]}))
        proc, ours, _ = measured([sys.executable, "-m", "sharding_dump.maxtext", "--cases", str(listed),
                                  "--golden-dir", str(Path(tmp) / "ours")], capture_output=True)
        for line in proc.stderr.splitlines():
            if line.startswith("sharding-dump:"):
                print(f"  {line}")
    print(f"{'MaxText own dump, one process per case: mean per case':<110} {statistics.mean(own):>7.2f} s "
          f"(total {sum(own):.1f} s)")
    print(f"{'python -m sharding_dump.maxtext --cases, one process: per case':<110} {ours / len(cases):>7.2f} s "
          f"(total {ours:.1f} s, exit {proc.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=0, help="only the first N cases (0: all)")
    parser.add_argument("--repeat", type=int, default=3, help="warm repetitions per case")
    parser.add_argument("--model", action="append", default=[], help="only cases of this model (repeatable)")
    parser.add_argument("--verify", action="store_true", help="benchmark `sharding-dump verify` per case instead")
    parser.add_argument("--suite", action="store_true", help="time the test suite (pytest -n WORKERS) instead")
    parser.add_argument("--suite-cpu", action="store_true",
                        help="the default suite (pytest -n WORKERS) with each test's CPU seconds (tools/cpu_per_test.py)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers for --suite, --suite-cpu (default 2)")
    parser.add_argument("--table", action="store_true", help="the speed table: each figure beside its floor")
    parser.add_argument("--no-suite", action="store_true", help="with --table, leave the test suite out")
    parser.add_argument("--maxtext", metavar="SCRIPT", help="MaxText's own dump against python -m sharding_dump.maxtext")
    args = parser.parse_args()
    compileall.compile_dir(str(REPO / "sharding_dump"), quiet=1)
    if args.maxtext:
        bench_maxtext(args.maxtext, args.cases)
        return
    if args.suite:
        bench_suite(args.workers)
        return
    if args.suite_cpu:
        bench_suite_cpu(args.workers)
        return
    if args.table:
        bench_table(load_matrix(), not args.no_suite, args.repeat)
        return
    unknown = sorted(set(args.model) - {c.model for c in load_matrix()})
    if unknown:
        parser.error(f"no case of model {', '.join(unknown)} in the case matrix")
    cases = [c for c in load_matrix() if not args.model or c.model in args.model]
    if args.cases:
        cases = cases[: args.cases]
    print(f"{len(cases)} cases, {os.cpu_count()} cores, python {sys.version.split()[0]}")
    if args.verify:
        bench_verify(cases)
        return
    print(f"{'case':<92} {'cold s':>7} {'cold MiB':>9} {'warm s':>7} {'warm +MiB':>9}")
    floor = timed([sys.executable, "-c", "import jax, flax.linen, optax"])[0]
    print(f"{'(import jax, flax.linen, optax alone: the floor under every cold figure)':<92} {floor:>7.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            cold, cold_mib = run_child(case_args(case) + ["--golden-dir", tmp])
            render_case(case)  # first in-process run: traces and caches
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                render_case(case)
                times.append(time.perf_counter() - start)
            grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
            print(f"{case.label:<92} {cold:>7.2f} {cold_mib:>9.0f} {statistics.median(times):>7.3f} {grown:>9.1f}")
        wall, mib = run_child(["--all", "--golden-dir", tmp])
    print(f"{'whole matrix (sharding-dump --all, one process)':<92} {wall:>7.2f} {mib:>9.0f}")
    first = case_args(cases[0])
    # check exits 1 when it has findings and diff when anything differs: both are results, not failures.
    for label, args in (("sharding-dump check --all", ["check", "--all"]),
                        ("sharding-dump diff golden golden (every case)", ["diff", "golden", "golden"]),
                        (f"sharding-dump show {' '.join(first)}", ["show", *first])):
        wall, mib = run_child(args, ok_exits=(0, 1))
        print(f"{label:<92} {wall:>7.2f} {mib:>9.0f}")


if __name__ == "__main__":
    main()
