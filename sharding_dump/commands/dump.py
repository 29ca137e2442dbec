"""`sharding-dump --model M --topology T --rule R` (or `--all`): write the golden files of cases.

Each case folder is rewritten as a whole when anything in it differs (:mod:`sharding_dump.zoo.goldens`);
with `--all`, one line per case as it finishes, then the summary line of what changed.

With `-j N` (default: the cores this process may use), `--all` dumps in N worker processes; the cases
of one model go to one worker, which builds the model's state once for all of them (as one process
does). The lines come in the cases' order and the goldens are the same bytes for any N.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from sharding_dump.commands import options
from sharding_dump.commands.progress import Progress
from sharding_dump.errors import BadInput, one_line

if TYPE_CHECKING:
    from sharding_dump.zoo.case import Case


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_case_options(parser, "dump every case of the case matrix")
    options.add_golden_dir_option(parser, "to write", "--output-dir")
    parser.add_argument("--version", action="store_true",
                        help="print the versions of sharding-dump, jax, jaxlib, flax and optax, and exit")
    parser.add_argument("-j", "--jobs", type=options.whole_number, default=None, metavar="N",
                        help="with --all, dump in N worker processes (default: the cores this process may "
                             "use; the output is the same for any N)")
    options.add_settings_argument(parser)


def default_jobs() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class Dumped:
    """What dumping one case did, as its progress line and the summary report it."""

    folder: Path
    files: tuple[str, ...]
    removed: tuple[str, ...]
    kind: str  # created, updated or unchanged
    seconds: float
    use_warnings: tuple[str, ...]
    caught: tuple[warnings.WarningMessage, ...] = ()  # Python warnings a worker process caught, shown here


def dump_one(case: Case, golden_dir: Path) -> Dumped:
    """Writes one case's golden folder (unchanged bytes are not rewritten)."""
    from sharding_dump.zoo import goldens

    start = time.perf_counter()
    outcome, kind = goldens.update(case, golden_dir)
    return Dumped(outcome.folder, tuple(outcome.files), tuple(outcome.removed), kind, time.perf_counter() - start,
                  tuple(_use_warnings(case, outcome.folder)))


def _dump_group(cases: list[Case], golden_dir: Path, limit: float) -> list[Dumped]:
    """A worker's share: cases of one model, in order, under the parent's time limit; the warnings
    they raise are handed back to be shown in the cases' order."""
    from sharding_dump.core.boundary import time_limit

    out = []
    with time_limit(limit):
        for case in cases:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("default")
                dumped = dump_one(case, golden_dir)
            out.append(dataclasses.replace(dumped, caught=tuple(caught)))
    return out


def dumped_in_order(cases: list[Case], golden_dir: Path, jobs: int) -> Iterator[Dumped]:
    """Each case dumped, in the cases' order: here, or with `jobs` > 1 in worker processes (spawned:
    jax does not survive a fork), a model's cases in one worker, the largest groups started first.
    User programs of several device counts (a process's CPU devices are fixed when its backend starts)
    are dumped in worker processes whatever `jobs`, a pool of workers started with each count (at
    least one worker a count); one count's cases here, or where this process cannot give the count
    (:func:`~sharding_dump.commands.options.where_served`)."""
    counts = {case: options.cpu_devices(case) for case in cases}
    several = len(set(counts.values()) - {None}) > 1
    if (jobs <= 1 or len(cases) <= 1) and not several:
        for case in cases:
            yield options.where_served(counts[case], dump_one, case, golden_dir)
        return
    from sharding_dump.core.boundary import current_limit

    groups: dict[tuple[str, int | None], list[int]] = {}
    for index, case in enumerate(cases):
        groups.setdefault((case.model, counts[case] if several else None), []).append(index)
    by_count: dict[int | None, list[list[int]]] = {}
    for (_, devices), group in sorted(groups.items(), key=lambda item: len(item[1]), reverse=True):
        by_count.setdefault(devices, []).append(group)
    done: dict[int, Dumped] = {}
    with contextlib.ExitStack() as stack:
        pools, futures = [], {}
        for devices, shares in by_count.items():
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(
                max_workers=max(1, min(jobs // len(by_count), len(shares))),
                mp_context=multiprocessing.get_context("spawn"),
                initializer=None if devices is None else options.start_cpu_worker,
                initargs=() if devices is None else (devices,)))
            pools.append(pool)
            futures.update({pool.submit(_dump_group, [cases[i] for i in group], golden_dir, current_limit()): group
                            for group in shares})
        try:
            next_index = 0
            for future in concurrent.futures.as_completed(futures):
                done.update(zip(futures[future], future.result()))
                while next_index in done:
                    dumped = done.pop(next_index)
                    for caught in dumped.caught:
                        warnings.warn_explicit(caught.message, caught.category, caught.filename, caught.lineno)
                    yield dumped
                    next_index += 1
        except BaseException as stopped:
            # An error (a dead worker, a case's own failure) waits for the pools' threads, which end the
            # workers: one still closing its pipe when the interpreter exits races the exit's wakeup
            # and prints a traceback below the one-line error. Ctrl-C does not wait.
            for pool in pools:
                pool.shutdown(wait=isinstance(stopped, Exception), cancel_futures=True)
            raise


def run(args: argparse.Namespace) -> int:
    from sharding_dump.commands.cli import version
    from sharding_dump.golden.engine import check_root, display, summary_line

    if args.version:
        print(version())
        return 0
    if args.jobs is not None and args.jobs < 1:
        raise BadInput(f"-j {args.jobs}: give the number of worker processes, 1 or more")
    if args.jobs is not None and not args.all:
        raise BadInput("-j dumps the cases of --all in parallel: give --all, or drop -j")
    project = options.project_of(args)
    check_root(project.golden_dir)  # before any work: a bad --golden-dir is one line, nothing written
    cases = options.cases_of(args, "dumps", project)
    total = time.perf_counter()
    tally: collections.Counter[str] = collections.Counter()
    jobs = default_jobs() if args.jobs is None else args.jobs
    with Progress(len(cases), "dumping") as progress:
        results = dumped_in_order(cases, project.golden_dir, jobs)
        try:
            for case in cases:
                progress.start(case.label)  # with -j N: the next case in order, whose result is awaited
                dumped = next(results)
                tally[dumped.kind] += 1
                what = "; ".join([f"wrote {', '.join(dumped.files)}"] * bool(dumped.files) +
                                 [f"removed {', '.join(dumped.removed)}"] * bool(dumped.removed)) or "unchanged"
                progress.finish(f"{display(dumped.folder)}/: {what}", seconds=dumped.seconds)
                for warning in dumped.use_warnings:
                    print(f"sharding-dump: warning: {case.label}: {one_line(warning)}", file=sys.stderr, flush=True)
            next(results, None)  # the workers are joined
        except concurrent.futures.BrokenExecutor:  # a worker process died (concurrent.futures.process is imported only with -j N)
            print("sharding-dump: error: a worker process died (killed, or out of memory); each golden folder is "
                  "whole, old or new: run again (-j 1 dumps in this process)", file=sys.stderr)
            return 1
    if len(cases) > 1:
        print(f"{len(cases)} cases in {time.perf_counter() - total:.1f}s")
        print(summary_line(tally))
    return 0


def _use_warnings(case: Case, folder: Path) -> list[str]:
    """The rule file's warnings for a dump just written (see rules.use_warnings)."""
    from sharding_dump.commands import check
    from sharding_dump.golden import codec
    from sharding_dump.zoo import rules
    from sharding_dump.zoo.dump import batch_fields, case_layouts

    docs = {path.name: codec.read_document(path) for path in sorted(folder.glob("*.json"))}
    layouts = case_layouts(case)[1] if case.model_ref.kind == "factory" else []
    return rules.use_warnings(case.rule_set(), docs, check.lint_settings().known_logical_axes,
                              batch_fields(case), {t.path for t in layouts if t.source == "type"},
                              {t.path for t in layouts if t.source == "none"})
