"""`sharding-dump verify`: compile a case's real training step and report what an abstract dump cannot see.

The dump proves the state's layout; it cannot tell whether XLA partitions the step well. `verify`
compiles one training step of the case (forward, backward, AdamW update) with
`jax.jit(step, in_shardings=state+batch, out_shardings=state+loss, donate the state)` in a child
process (:mod:`sharding_dump.commands.verify.child`), so that the number of fake CPU devices can be set before
jax starts, and reports per case:

- involuntary full rematerializations: XLA's partitioner could not reshard a value and replicated it
  (a failure). XLA writes these warnings from C++ to file descriptor 2, so the child's fd 2 goes to a
  file that is parsed here;
- values XLA keeps whole on every device after sharding propagation, above a size threshold (a
  failure), read from the module as it stands after propagation, before partitioning;
- per-device memory from XLA's own analysis (arguments, outputs, aliases, temporaries) and whether it
  fits the topology's HBM: on CPU an estimate (XLA:CPU schedules and fuses unlike a TPU), so
  informative; with `--tpu` XLA's own verdict for the real chip, a failure when it does not fit;
- collectives per step (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute),
  count and per-device bytes, loop bodies multiplied by their trip counts;
- that the compiled state shardings equal the golden's, leaf for leaf (a failure otherwise).

With `-j N`, N cases compile at once, each in its own child process (the compiles are CPU-bound and
single cases rarely fill a machine); the report lists the cases in their order whatever order they
finish in, so it is the same for any N.

With `--record`, the compiled figures are written beside the case's golden as
`compiled_<backend>_jax-<version>.json`; a later run on the same backend and jax version compares
with them (a failure when they differ, like a golden). Other backends' files are left alone.
"""


from __future__ import annotations

import argparse
import concurrent.futures
import sys

from sharding_dump.commands import options
from sharding_dump.commands.progress import Progress
from sharding_dump.commands.verify.render import render, render_case
from sharding_dump.commands.verify.run import (
    check_tpu_available,
    check_tpu_case,
    golden_specs,
    kill_children,
    verify_case,
)
from sharding_dump.commands.verify.settings import (
    SETTINGS_FILE,
    Options,
    default_threshold,
    parse_size,
)
from sharding_dump.errors import BadInput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_case_options(parser, "verify every case of the case matrix")
    options.add_format_option(parser)
    parser.add_argument("--replicated-threshold", metavar="SIZE",
                        help=f"smallest value (e.g. 64MiB) that may not be replicated on every device "
                             f"(default: {SETTINGS_FILE.name})")
    options.add_golden_dir_option(parser, "the compiled shardings are compared with")
    parser.add_argument("--record", action="store_true",
                        help="write the compiled figures beside each case's golden, keyed by backend and jax version")
    parser.add_argument("--tpu", action="store_true",
                        help="compile ahead of time for the case's real TPU topology (needs libtpu: "
                             "pip install 'sharding-dump[tpu]'; no TPU needed)")
    parser.add_argument("-j", "--jobs", type=options.whole_number, default=1, metavar="N",
                        help="compile N cases at once, each in a process of its own (default 1; the report "
                             "keeps the cases' order)")
    options.add_settings_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every case is clean, 1 on any failure."""
    if args.jobs < 1:
        raise BadInput(f"-j {args.jobs}: give the number of cases to compile at once, 1 or more")
    threshold = default_threshold() if args.replicated_threshold is None else parse_size(args.replicated_threshold)
    project = options.project_of(args)
    cases = options.cases_of(args, "verifies", project)
    if args.tpu:
        check_tpu_available()
        for case in cases:
            check_tpu_case(case)
    settings = Options(threshold, project.golden_dir, record=args.record, tpu=args.tpu)
    for case in cases:  # an unreadable golden is bad input before any compile
        golden_specs(case, settings.golden_dir)
    results = []
    # Threads only wait: each compile runs in a child process of its own. map() yields in the cases'
    # order, so each case is reported as soon as it and every case before it are done. One job runs
    # in this thread; with more, a Ctrl-C (which only this thread sees) ends the other threads' children.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) if args.jobs > 1 and len(cases) > 1 else None
    verified = (pool.map(lambda case: verify_case(case, settings), cases) if pool is not None else
                (verify_case(case, settings) for case in cases))
    try:
        with Progress(len(cases), "verifying") as progress:  # on a terminal, a status line of the case compiling
            progress.start(cases[0].label)
            for index, result in enumerate(verified, 1):
                results.append(result)
                if args.format == "text":
                    progress.finish(render_case(result, "text") + "\n", timed=False)
                else:  # stdout is the report to paste or parse; progress goes to stderr
                    status = "FAILED" if result.failures else "ok"
                    progress.finish(f"{result.label}: {status} ({result.wall_seconds:.1f}s)", sys.stderr, timed=False)
                if index < len(cases):
                    progress.start(cases[index].label)
    except BaseException:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
            kill_children()
        raise
    if pool is not None:
        pool.shutdown()
    if args.format == "text":
        failed = sum(1 for r in results if r.failures)
        print(f"{len(results)} case{'s' * (len(results) != 1)} verified, {failed} failed")
    else:
        sys.stdout.write(render(results, args.format))
    return 1 if any(r.failures for r in results) else 0
