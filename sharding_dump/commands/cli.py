"""The `sharding-dump` command.

    sharding-dump --model M --topology T --rule R [--num-slices N] [KEY=VALUE ...] [--golden-dir DIR]
    sharding-dump --all [--cases FILE ...] [--golden-dir DIR]
    sharding-dump list models|topologies|rules|settings
    sharding-dump diff OLD NEW [--format text|markdown|json] [--max-chars N]
    sharding-dump check (CASE | --all [--cases FILE ...]) [--replicated-tolerance F]
    sharding-dump show CASE
    sharding-dump verify (CASE | --all) [--format text|markdown|json] [--tpu] [--record]
    sharding-dump --version

The golden folder, the case files and extra rule and card folders come from `[tool.sharding-dump]` in
the nearest pyproject.toml (sharding_dump/zoo/project.py); --golden-dir and --cases override it.

CASE is --model M --topology T --rule R [--num-slices N] [KEY=VALUE ...], as for a dump.
Exit status: 0 on success (diff: no difference; check: no finding), 1 when `diff` finds a difference
or `check` a finding, 2 on bad input (one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from sharding_dump.errors import BadInput, UnevenSplitWarning, one_line

if TYPE_CHECKING:  # the commands import what they need when they run
    from sharding_dump.zoo.case import Case
    from sharding_dump.zoo.project import Project

# The command needs no accelerator and must give the same bytes whatever JAX's environment says
# (JAX_PLATFORMS=cuda on a machine without GPUs, JAX_NUMPY_DTYPE_PROMOTION=strict, ... would crash it):
# these JAX options are forced before any backend starts, and XLA_FLAGS (flags for compiling, which
# the command never does; an unknown one aborts the process) is dropped.
JAX_OPTIONS = {"jax_platforms": "cpu", "jax_enable_x64": False, "jax_numpy_dtype_promotion": "standard",
               "jax_disable_jit": False}
DROPPED_ENVIRONMENT = ("XLA_FLAGS",)


def _force_jax_options() -> None:
    """Set in the environment, which jax reads when it is imported (a command that needs no jax, like
    `diff`, never imports it); applied to jax's config too when it is imported already."""
    for name, value in JAX_OPTIONS.items():
        os.environ[name.upper()] = str(value).lower() if isinstance(value, bool) else value
    for name in DROPPED_ENVIRONMENT:
        os.environ.pop(name, None)
    if "jax" in sys.modules:
        import jax

        for name, value in JAX_OPTIONS.items():
            jax.config.update(name, value)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one BadInput line like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise BadInput(f"{message} (see {self.prog} --help)")


def _whole_number(text: str) -> int:
    """argparse type for counts: the bounds are checked where the count is used."""
    from sharding_dump.errors import shown
    from sharding_dump.resources import MAX_DIGITS

    digits = text.strip().lstrip("+-")
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a whole number")
    if len(digits) > MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"{shown(text)}: more than {MAX_DIGITS} digits, beyond any bound")
    return int(text)


def _add_case_options(parser: argparse.ArgumentParser, all_help: str | None) -> None:
    """The options that name one case (and, when `all_help` is given, --all for the whole matrix)."""
    parser.add_argument("--model", help="model card name (sharding-dump list models) or path to a card .yml")
    parser.add_argument("--topology", help="accelerator name, e.g. v5p-16, tpu7x-2048, a3, cpu-8")
    parser.add_argument("--rule", help="rule file name (sharding-dump list rules) or path to a .yml rule file")
    parser.add_argument("--num-slices", type=_whole_number, default=1, help="number of slices (DCN), default 1")
    if all_help:
        parser.add_argument("--all", action="store_true", help=all_help)
        parser.add_argument("--cases", action="append", metavar="FILE",
                            help="case file for --all (repeatable; default: cases of [tool.sharding-dump] in "
                                 "pyproject.toml, else the package's own matrix)")


def _add_settings_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="setting overrides, e.g. ici_fsdp_parallelism=-1 (sharding-dump list settings)")


# One line per command for `sharding-dump --help` (each command's own --help says the rest).
SUMMARIES = {
    "dump": "write one case's golden JSON (or --all: every case); the default command, options below",
    "list": "list models, topologies, rules or settings",
    "diff": "compare two case folders or golden trees: tensors changed, added, removed; memory per device",
    "check": "lint a case: indivisible splits, unknown axes, replicated parameters, memory above HBM",
    "show": "print one case as a table: path, shape, logical axes, spec, per-device shape and bytes",
    "verify": "compile a case's training step on fake CPU devices (or --tpu): remats, memory, collectives",
}


def _dump_parser() -> argparse.ArgumentParser:
    width = max(map(len, SUMMARIES))
    parser = _Parser(
        prog="sharding-dump", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Dump the sharding of a model's full training state for one case (or every case of\n"
                    "the matrix) as golden JSON.",
        epilog="commands (sharding-dump COMMAND --help for each):\n" + "\n".join(
            f"  {name:<{width}}  {line}" for name, line in SUMMARIES.items()))
    _add_case_options(parser, "dump every case of the case matrix")
    parser.add_argument("--golden-dir", "--output-dir", dest="golden_dir", metavar="DIR",
                        help="root of the golden tree (default: golden-dir of [tool.sharding-dump] in pyproject.toml, "
                             "else golden/)")
    parser.add_argument("--version", action="store_true",
                        help="print the versions of sharding-dump, jax, jaxlib, flax and optax, and exit")
    _add_settings_argument(parser)
    return parser


def _project(args: argparse.Namespace) -> Project:
    """[tool.sharding-dump] of the nearest pyproject.toml, with --cases and --golden-dir applied."""
    from sharding_dump.golden.engine import check_root
    from sharding_dump.zoo.project import load_project

    golden_dir = getattr(args, "golden_dir", None)
    if golden_dir is not None:
        check_root(golden_dir)  # as given: an empty --golden-dir is refused, not read as "here"
    return load_project().with_overrides(getattr(args, "cases", None), golden_dir)


def _cases(args: argparse.Namespace, verb: str, project: Project) -> list[Case]:
    """The case the options name, or every case of the project's case files under --all; all of them
    validated (mesh, settings, model) so that every bad input surfaces before any work or output."""
    from sharding_dump.zoo import case as case_mod
    from sharding_dump.zoo import settings
    from sharding_dump.zoo.dump import setup_case

    if getattr(args, "all", False):
        if args.model or args.topology or args.rule or args.settings or args.num_slices != 1:
            raise BadInput(f"--all {verb} the whole case matrix: it takes no --model/--topology/--rule/--num-slices/KEY=VALUE")
        cases = project.load_cases()
    else:
        missing = [flag for flag, value in (("--model", args.model), ("--topology", args.topology),
                                            ("--rule", args.rule)) if not value]
        if missing:
            raise BadInput(f"missing {', '.join(missing)}" + (" (or use --all)" if hasattr(args, "all") else ""))
        if getattr(args, "cases", None):
            raise BadInput("--cases names the case files of --all: give --all, or drop --cases")
        overrides = settings.parse_assignments(args.settings)
        cases = [case_mod.Case.make(project.resolve("model", args.model), args.topology,
                                    project.resolve("rule", args.rule), args.num_slices, overrides)]
    for case in cases:
        setup_case(case)
    return cases


def _progress(index: int, count: int, line: str, started: float) -> None:
    """One line per finished case, flushed so a CI log shows it at once; `[i/n]` when there are many."""
    prefix = f"[{index}/{count}] " if count > 1 else ""
    print(f"{prefix}{line} ({time.perf_counter() - started:.2f}s)", flush=True)


def _cmd_dump(argv: Sequence[str]) -> int:
    import collections

    from sharding_dump.golden import engine
    from sharding_dump.commands import diff

    from sharding_dump.golden.engine import check_root

    args = _dump_parser().parse_args(argv)
    if args.version:
        print(version())
        return 0
    project = _project(args)
    check_root(project.golden_dir)  # before any work: a bad --golden-dir is one line, nothing written
    cases = _cases(args, "dumps", project)
    total = time.perf_counter()
    tally: collections.Counter[str] = collections.Counter()
    for index, case in enumerate(cases, 1):
        start = time.perf_counter()
        outcome, kind = engine.update(case, project.golden_dir)
        tally[kind] += 1
        what = "; ".join([f"wrote {', '.join(outcome.files)}"] * bool(outcome.files) +
                         [f"removed {', '.join(outcome.removed)}"] * bool(outcome.removed)) or "unchanged"
        _progress(index, len(cases), f"{engine.display(outcome.folder)}/: {what}", start)
        for warning in _use_warnings(case, outcome.folder):
            print(f"sharding-dump: warning: {case.label}: {one_line(warning)}", file=sys.stderr, flush=True)
    if len(cases) > 1:
        print(f"{len(cases)} cases in {time.perf_counter() - total:.1f}s")
        print(diff.golden_summary(tally))
    return 0


def _use_warnings(case: Case, folder: Path) -> list[str]:
    """The rule file's warnings for a dump just written (see rules.use_warnings)."""
    from sharding_dump.commands import check
    from sharding_dump.zoo import rules
    from sharding_dump.golden import codec

    docs = {path.name: codec.read_document(path) for path in sorted(folder.glob("*.json"))}
    return rules.use_warnings(rules.load_rule(case.rule), docs, check.lint_settings().known_logical_axes)


def _cmd_diff(argv: Sequence[str]) -> int:
    from sharding_dump.commands import diff

    parser = _Parser(prog="sharding-dump diff",
                     description="Compare two case folders (e.g. one model under two rules) or two golden trees "
                                 "(e.g. a checkout of main and the working tree): per case, tensors changed, added "
                                 "and removed, with old and new spec and per-device bytes. Exit 1 when anything "
                                 "differs, 0 when nothing does.")
    parser.add_argument("old", metavar="OLD", help="case folder or golden tree before the change")
    parser.add_argument("new", metavar="NEW", help="case folder or golden tree after the change")
    parser.add_argument("--format", choices=diff.FORMATS, default="text",
                        help="text (terminal), markdown (pull-request comment) or json; default text")
    parser.add_argument("--max-chars", type=int, metavar="N",
                        help=f"cut the text or markdown report to N characters, keeping the summary table "
                             f"(markdown default: {diff.GITHUB_COMMENT_CHARS:,}, what a GitHub comment takes)")
    args = parser.parse_args(argv)
    if args.max_chars is not None and (args.format == "json" or args.max_chars < 1000):
        raise BadInput(f"--max-chars {args.max_chars}: takes a number >= 1000, with --format text or markdown")
    limit = args.max_chars
    if limit is None and args.format == "markdown":
        limit = diff.GITHUB_COMMENT_CHARS
    reports = diff.compare(args.old, args.new)
    sys.stdout.write(diff.render(reports, args.format, limit))
    return 1 if any(r.status != "identical" for r in reports) else 0


def _cmd_check(argv: Sequence[str]) -> int:
    from sharding_dump.commands import check

    parser = _Parser(prog="sharding-dump check",
                     description="Lint one case (or every case of the matrix): indivisible splits, rules naming "
                                 "absent mesh axes or unknown logical axes, replicated parameters, memory per "
                                 "device above HBM. Each finding names the tensor and the rule line behind it. "
                                 "Exit 1 on any finding, 0 when clean.")
    _add_case_options(parser, "check every case of the case matrix")
    parser.add_argument("--replicated-tolerance", metavar="F",
                        help="largest share of parameter bytes that may be replicated on every device, as a "
                             "fraction or a percentage (default: data/lint.yml, 2%%)")
    _add_settings_argument(parser)
    args = parser.parse_args(argv)
    tolerance = None if args.replicated_tolerance is None else check.parse_tolerance(args.replicated_tolerance)
    cases = _cases(args, "checks", _project(args))
    check.lint_settings()  # a broken data/lint.yml is bad input before any output
    found = 0
    for index, case in enumerate(cases, 1):
        start = time.perf_counter()
        findings = check.lint_case(case, tolerance)
        found += len(findings)
        text = check.render_findings(case, findings)
        head, _, rest = text.partition("\n")
        _progress(index, len(cases), head, start)
        if rest:
            print(rest, flush=True)
    if len(cases) > 1:
        print(f"{len(cases)} cases checked, {found} finding{'' if found == 1 else 's'}")
    return 1 if found else 0


def _cmd_show(argv: Sequence[str]) -> int:
    from sharding_dump.commands.show import render_case_table

    parser = _Parser(prog="sharding-dump show",
                     description="Print one case as a table: every leaf's path, shape, logical axes, partition "
                                 "spec, per-device shape and bytes, then the totals per device. Writes nothing.")
    _add_case_options(parser, None)
    parser.add_argument("--full-specs", action="store_true",
                        help="print partition specs exactly as the golden holds them (with mesh axes of size 1)")
    _add_settings_argument(parser)
    args = parser.parse_args(argv)
    (case,) = _cases(args, "shows", _project(args))
    sys.stdout.write(render_case_table(case, full_specs=args.full_specs))
    return 0


def _cmd_list(argv: Sequence[str]) -> int:
    parser = _Parser(prog="sharding-dump list", description="List what exists.")
    parser.add_argument("what", choices=["models", "topologies", "rules", "settings"])
    args = parser.parse_args(argv)
    if args.what == "models":
        from sharding_dump import models
        from sharding_dump.zoo import state
        from sharding_dump.models.config import card_files
        from sharding_dump.resources import MODELS_DIR
        files = card_files()
        for name in models.model_names():
            cfg = models.load_config(name)
            count = state.parameter_count(state.abstract_state(cfg))
            source = "" if files[name].parent == MODELS_DIR else f"  (card {files[name]})"
            print(f"{name:<18} {cfg.decoder_block:<10} {count:>17,} parameters ({count / 1e9:.2f}B){source}")
        print(f"decoder blocks: {', '.join(sorted(models.decoder_blocks()))}")
    elif args.what == "topologies":
        from sharding_dump.zoo.topology import load_topology, topology_names
        for name in topology_names():
            t = load_topology(name)
            print(f"{name:<14} {t.platform:<4} {t.chip:<6} {t.devices_per_slice:>6} devices/slice "
                  f"{t.hbm_bytes_per_device / 2**30:>5.0f} GiB HBM/device")
        print("cpu-N          cpu  any N devices, no HBM limit")
    elif args.what == "rules":
        from sharding_dump.zoo.rules import load_rule, rule_names
        for name in rule_names():
            print(f"{name:<20} mesh_axes: {', '.join(load_rule(name).mesh_axes)}")
    else:
        from sharding_dump.zoo.settings import setting_specs, format_value
        for key, spec in setting_specs().items():
            print(f"{key:<42} default {format_value(spec.default):<8} {spec.help}")
        print(f"{'ici_<axis>_parallelism, dcn_<axis>_parallelism':<42} default {'1':<8} "
              f"size of any other mesh axis a rule file declares (-1: fill with what is left)")
    return 0


def _cmd_verify(argv: Sequence[str]) -> int:
    from sharding_dump.commands import verify

    return verify.command(argv)


_SHOW_WARNING = warnings.showwarning


def _warning_line(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> None:
    """Our warnings as one `sharding-dump: warning: ...` line on stderr (the exit status is unchanged)."""
    if issubclass(category, UnevenSplitWarning):
        print(f"sharding-dump: warning: {message}", file=sys.stderr, flush=True)
    else:
        _SHOW_WARNING(message, category, *args, **kwargs)  # type: ignore[arg-type]


def version() -> str:
    """`sharding-dump 0.1.0 (jax 0.10.2, jaxlib 0.10.2, flax 0.12.8, optax 0.2.8)`: the versions a
    golden depends on, read from the installed distributions (nothing imported)."""
    from importlib import metadata

    def of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{name} {of(name)}" for name in ("jax", "jaxlib", "flax", "optax"))
    return f"sharding-dump {of('sharding-dump')} ({deps})"


class _Stdout:
    """Standard output that turns a failed write (closed, /dev/full, a reader gone) into BadInput."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def _fail(self, err: OSError | None) -> BadInput:
        from sharding_dump.errors import os_error

        self.stream = None
        sys.stdout = open(os.devnull, "w")  # nothing more to write; no error again at exit
        if err is None:
            return BadInput("standard output: it is closed (Bad file descriptor)")
        return os_error("standard output:", "cannot write", err)

    def write(self, text: str) -> int:
        if self.stream is None:
            raise self._fail(None)
        try:
            return self.stream.write(text)
        except OSError as err:
            raise self._fail(err) from None

    def flush(self) -> None:
        if self.stream is None:
            return
        try:
            self.stream.flush()
        except OSError as err:
            raise self._fail(err) from None


COMMANDS = {"dump": _cmd_dump, "list": _cmd_list, "diff": _cmd_diff, "check": _cmd_check, "show": _cmd_show,
            "verify": _cmd_verify}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _force_jax_options()
    warnings.simplefilter("always", UnevenSplitWarning)
    shown_before = warnings.showwarning
    warnings.showwarning = _warning_line
    stdout = sys.stdout
    guard = sys.stdout = _Stdout(stdout)
    try:
        status = COMMANDS[argv[0]](argv[1:]) if argv and argv[0] in COMMANDS else _cmd_dump(argv)
        sys.stdout.flush()
        return status
    except BadInput as err:
        print(f"sharding-dump: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = shown_before
        if guard.stream is not None:  # after a failed write, stdout stays /dev/null to the end
            sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
