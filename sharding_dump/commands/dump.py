"""`sharding-dump --model M --topology T --rule R` (or `--all`): write the golden files of cases.

Each case folder is rewritten as a whole when anything in it differs (:mod:`sharding_dump.zoo.goldens`);
with `--all`, one line per case as it finishes, then the summary line of what changed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sharding_dump.commands import options
from sharding_dump.errors import one_line

if TYPE_CHECKING:
    from sharding_dump.zoo.case import Case


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_case_options(parser, "dump every case of the case matrix")
    options.add_golden_dir_option(parser, "to write", "--output-dir")
    parser.add_argument("--version", action="store_true",
                        help="print the versions of sharding-dump, jax, jaxlib, flax and optax, and exit")
    options.add_settings_argument(parser)


def run(args: argparse.Namespace) -> int:
    from sharding_dump.commands.cli import version
    from sharding_dump.golden.engine import check_root, display, summary_line
    from sharding_dump.zoo import goldens

    if args.version:
        print(version())
        return 0
    project = options.project_of(args)
    check_root(project.golden_dir)  # before any work: a bad --golden-dir is one line, nothing written
    cases = options.cases_of(args, "dumps", project)
    total = time.perf_counter()
    tally: collections.Counter[str] = collections.Counter()
    for index, case in enumerate(cases, 1):
        start = time.perf_counter()
        outcome, kind = goldens.update(case, project.golden_dir)
        tally[kind] += 1
        what = "; ".join([f"wrote {', '.join(outcome.files)}"] * bool(outcome.files) +
                         [f"removed {', '.join(outcome.removed)}"] * bool(outcome.removed)) or "unchanged"
        options.progress(index, len(cases), f"{display(outcome.folder)}/: {what}", start)
        for warning in _use_warnings(case, outcome.folder):
            print(f"sharding-dump: warning: {case.label}: {one_line(warning)}", file=sys.stderr, flush=True)
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
    placed = {t.path for t in case_layouts(case)[1] if t.source == "type"} if case.model_ref.kind == "factory" else ()
    return rules.use_warnings(case.rule_set(), docs, check.lint_settings().known_logical_axes,
                              batch_fields(case), placed)
