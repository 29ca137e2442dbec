"""Options shared by the subcommands: one builder per option group, so every command spells a case,
its settings, the golden folder and a report format the same way.

>>> parser = Parser(prog="sharding-dump show")
>>> add_case_options(parser)
>>> add_settings_argument(parser)
>>> args = parser.parse_args(["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "pure-fsdp",
...                           "ici_fsdp_parallelism=-1"])
>>> args.model, args.topology, args.settings
('llama2-7b', 'v5p-16', ['ici_fsdp_parallelism=-1'])
>>> parser.parse_args(["--num-slices", "two"])
Traceback (most recent call last):
sharding_dump.errors.BadInput: argument --num-slices: 'two' is not a whole number (see sharding-dump show --help)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from sharding_dump.errors import DEVICE_COUNT_FLAG, BadInput, DeviceCountError, one_line, shown
from sharding_dump.resources import MAX_DIGITS

if TYPE_CHECKING:  # the commands import what they need when they run
    from sharding_dump.zoo.case import Case
    from sharding_dump.zoo.project import Project

REPORT_FORMATS = ("text", "markdown", "json")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one BadInput line like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise BadInput(f"{message} (see {self.prog} --help)")


def whole_number(text: str) -> int:
    """argparse type for counts: the bounds are checked where the count is used."""
    digits = text.strip().lstrip("+-")
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a whole number")
    if len(digits) > MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"{shown(text)}: more than {MAX_DIGITS} digits, beyond any bound")
    return int(text)


def add_case_options(parser: argparse.ArgumentParser, all_help: str | None = None) -> None:
    """The options that name one case (and, when `all_help` is given, --all for the whole matrix)."""
    parser.add_argument("--model", help="model card name (sharding-dump list models), path to a card .yml, or "
                                        "package.module:factory")
    parser.add_argument("--topology", help="accelerator name, e.g. v5p-16, tpu7x-2048, a3, cpu-8")
    parser.add_argument("--rule", help="rule file name (sharding-dump list rules) or path to a .yml rule file")
    parser.add_argument("--num-slices", type=whole_number, help="number of slices (DCN), default 1")
    parser.add_argument("--maxtext-config", metavar="RUN.yml",
                        help="a MaxText run configuration (its base_config chain, the model config model_name "
                             "names, then MaxText KEY=VALUE), instead of --model and --rule: model_name names the "
                             "card, custom_mesh_and_rule the rule, compile_topology the topology; every key is "
                             "honoured, ignored as layout-neutral or refused (data/maxtext_keys.yml)")
    add_time_limit_option(parser)
    add_traceback_option(parser)
    if all_help:
        parser.add_argument("--all", action="store_true", help=all_help)
        parser.add_argument("--cases", action="append", metavar="FILE",
                            help="case file for --all (repeatable; default: cases of [tool.sharding-dump] in "
                                 "pyproject.toml, else the package's own matrix)")


TIME_LIMIT_HELP = ("seconds each call into the user's code (import, factory, init, model call, train_step, "
                   "optimizer) and each verify compile may take; then one error line, exit 2 (default: time-limit "
                   "of [tool.sharding-dump], else user_code_seconds of sharding_dump/data/time_limits.yml)")


def seconds(text: str) -> float:
    """argparse type for a time limit: a number of seconds above 0 (bounded by core.boundary)."""
    from sharding_dump.core.boundary import check_seconds

    try:
        return check_seconds(text, "")
    except BadInput as err:
        raise argparse.ArgumentTypeError(str(err).strip()) from None


def add_time_limit_option(parser: argparse.ArgumentParser) -> None:
    """--time-limit: the bound on each call into the user's code and on each compile."""
    parser.add_argument("--time-limit", type=seconds, metavar="SECONDS", help=TIME_LIMIT_HELP)


def add_traceback_option(parser: argparse.ArgumentParser) -> None:
    """--traceback: the whole traceback of a failure in the user's code, above its one error line."""
    parser.add_argument("--traceback", action="store_true",
                        help="when the user's code fails, print its whole traceback on stderr before the one error "
                             "line (which names the file and line it raised at); the exit status stays 2")


def print_traceback(err: BaseException) -> None:
    """The whole traceback of the user's code behind `err` on stderr (nothing when the error is the
    harness's own: bad input has its one line only)."""
    from sharding_dump.errors import traceback_text

    text = traceback_text(err)
    if text:
        print(text, end="", file=sys.stderr, flush=True)


def time_limit_of(seconds: float | None, project: bool = True) -> ContextManager[None]:
    """The block within which each call into the user's code may take `seconds` (--time-limit,
    pytest's --sharding-time-limit); None: `time-limit` of [tool.sharding-dump] (when `project`),
    else the default of data/time_limits.yml."""
    from sharding_dump.core.boundary import time_limit
    from sharding_dump.zoo.project import load_project

    if seconds is None and project:
        seconds = load_project().time_limit
    return time_limit(seconds)


def add_settings_argument(parser: argparse.ArgumentParser) -> None:
    """The trailing KEY=VALUE setting overrides of a case."""
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="setting overrides, e.g. ici_fsdp_parallelism=-1 (sharding-dump list settings)")


def add_golden_dir_option(parser: argparse.ArgumentParser, what: str, *aliases: str) -> None:
    """--golden-dir: the root of the golden tree, `what` the command does with it."""
    parser.add_argument("--golden-dir", *aliases, dest="golden_dir", metavar="DIR",
                        help=f"root of the golden tree {what} (default: golden-dir of [tool.sharding-dump] in "
                             "pyproject.toml, else golden/)")


def add_format_option(parser: argparse.ArgumentParser, html: bool = False) -> None:
    """--format of a report: text for a terminal, markdown for a pull-request comment, json for tools
    (and, where the command writes one, html: a standalone page for a CI artifact)."""
    parser.add_argument("--format", choices=REPORT_FORMATS + ("html",) * html, default="text",
                        help="text (terminal), markdown (pull-request comment)" + (", json or html (a standalone "
                             "page, e.g. a CI artifact)" if html else " or json") + "; default text")


def project_of(args: argparse.Namespace) -> Project:
    """[tool.sharding-dump] of the nearest pyproject.toml, with --cases and --golden-dir applied."""
    from sharding_dump.golden.engine import check_root
    from sharding_dump.zoo.project import load_project

    golden_dir = getattr(args, "golden_dir", None)
    if golden_dir is not None:
        check_root(golden_dir)  # as given: an empty --golden-dir is refused, not read as "here"
    return load_project().with_overrides(getattr(args, "cases", None), golden_dir)


def cases_of(args: argparse.Namespace, verb: str, project: Project) -> list[Case]:
    """The case the options name, or every case of the project's case files under --all; all of them
    validated (mesh, settings, model) so that every bad input surfaces before any work or output."""
    from sharding_dump.zoo.case import Case
    from sharding_dump.zoo.dump import setup_case
    from sharding_dump.zoo.matrix import load_project_cases
    from sharding_dump.zoo.settings import parse_assignments

    if getattr(args, "all", False):
        if args.model or args.topology or args.rule or args.settings or args.num_slices is not None \
                or args.maxtext_config:
            raise BadInput(f"--all {verb} the whole case matrix: it takes no --model/--topology/--rule/--num-slices/"
                           f"--maxtext-config/KEY=VALUE")
        cases = load_project_cases(project)
    elif args.maxtext_config:
        cases = [_maxtext_case(args, verb, project)]
    else:
        missing = [flag for flag, value in (("--model", args.model), ("--topology", args.topology),
                                            ("--rule", args.rule)) if not value]
        if missing:
            raise BadInput(f"missing {', '.join(missing)}" + (" (or use --all)" if hasattr(args, "all") else ""))
        if getattr(args, "cases", None):
            raise BadInput("--cases names the case files of --all: give --all, or drop --cases")
        overrides, notes = _layout_neutral(parse_assignments(args.settings))
        if verb == "verifies":
            for note in notes:
                print(f"sharding-dump: warning: {one_line(note)}", file=sys.stderr, flush=True)
        cases = [Case.make(project.resolve("model", args.model), args.topology, project.resolve("rule", args.rule),
                           1 if args.num_slices is None else args.num_slices, overrides, project=False)]
    counts = [count for count in map(cpu_devices, cases) if count is not None]
    if counts:  # the first program case's: `--all` dumps each other count in a process of its own
        give_cpu_devices(counts[0])
    for case in cases:
        setup_case(case)
    return cases


def _layout_neutral(assignments: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """maxtext_config.layout_neutral, read (with MaxText's key table) only when KEY=VALUE are given:
    a plain `--model` dump reads no MaxText data."""
    if not assignments:
        return {}, []
    from sharding_dump.zoo import maxtext_config

    return maxtext_config.layout_neutral(assignments)


def xla_flags(flags: str, cpu_devices: int | None) -> str:
    """`flags` (an XLA_FLAGS value) with its CPU device count replaced by `cpu_devices` (none: left out);
    every other flag kept as given."""
    kept = [flag for flag in flags.split() if not flag.startswith(DEVICE_COUNT_FLAG)]
    return " ".join(kept + [f"{DEVICE_COUNT_FLAG}={cpu_devices}"] * (cpu_devices is not None))


def cpu_devices(case: Case) -> int | None:
    """The CPU devices a case's process starts with: the topology's device count for a user's program,
    which may build its concrete mesh from `jax.devices()` (Levanter's trainer, Kauldron's DEVICES_MESH
    do); None for the zoo's cases, which never start a backend (a 16384-device topology's count would
    make a later program's jax.devices() start that many)."""
    if case.model_ref.kind != "factory":
        return None
    from sharding_dump.zoo.topology import load_topology

    return load_topology(case.topology, case.num_slices).num_devices


def give_cpu_devices(count: int) -> None:
    """`count` CPU devices, after the user's own XLA_FLAGS: XLA reads it when the CPU backend starts,
    which no dump does itself (so the count costs nothing otherwise); once a backend runs, its devices
    stay what they are, so a process serves one count (`--all` dumps the cases of each other count in
    a process of its own)."""
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), count)


def _backend_started() -> bool:
    """Whether jax's backend runs in this process (asking starts none)."""
    from jax._src import xla_bridge  # jax has no public question that leaves the backend unstarted

    return xla_bridge.backends_are_initialized()


def serves(count: int) -> bool:
    """Whether a program run in this process sees `count` devices when it asks for them: jax's backend
    started with that many, or not started yet with XLA_FLAGS asking for that many CPU devices (one
    without the flag). Asking starts no backend."""
    if _backend_started():
        import jax

        return jax.device_count() == count
    given = [flag.partition("=")[2] for flag in os.environ.get("XLA_FLAGS", "").split()
             if flag.startswith(f"{DEVICE_COUNT_FLAG}=")]
    return (given[-1] if given else "1") == str(count)


def start_cpu_worker(count: int) -> None:
    """A worker process's start (a pool's initializer): `count` CPU devices, on the CPU whatever the
    parent's JAX_PLATFORMS (the case's devices are CPU devices)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    give_cpu_devices(count)


_WORKERS: dict[int, Any] = {}  # device count -> the pool of one worker started with that count


def _device_worker(count: int) -> Any:
    """A worker process started with `count` CPU devices (spawned: jax does not survive a fork), kept
    for this process's later cases of that count."""
    if count not in _WORKERS:
        import multiprocessing
        from concurrent.futures.process import ProcessPoolExecutor  # the module pickle finds it in

        _WORKERS[count] = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                              initializer=start_cpu_worker, initargs=(count,))
    return _WORKERS[count]


def _called(fn: Callable[..., Any], limit: float, where: tuple[str, list[str]],
            args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """`fn(*args)` in a worker, in the parent's working folder and import path as they are now (the
    worker outlives the call it was started for), under its time limit, with the warnings it raised."""
    import warnings

    from sharding_dump.core.boundary import time_limit

    os.chdir(where[0])
    sys.path[:] = where[1]
    with time_limit(limit), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        out = fn(*args)
    return out, tuple(caught)


def in_device_worker(count: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` (a module-level function) in a worker process started with `count` CPU devices: its
    result, its BadInput raised here, its warnings shown here."""
    import warnings
    from concurrent.futures.process import BrokenProcessPool

    from sharding_dump.core.boundary import current_limit

    try:
        out, caught = _device_worker(count).submit(_called, fn, current_limit(), (os.getcwd(), list(sys.path)),
                                                   args).result()
    except BrokenProcessPool:
        forget_worker(count)
        raise BadInput(f"the worker process started with {count} CPU devices for the case ended before it answered "
                       "(killed, or out of memory)") from None
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return out


def where_served(count: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` for a case of `count` devices (None: a zoo case, which starts no backend) here, where
    a program that builds its mesh over `jax.devices()` sees that count; where this process cannot give
    it (its backend runs with another, or pytest's, which the plugin never changes), here first (a
    program that asks for no devices is dumped as well here, where the user's edits of it hold), and
    again in a worker process started with the count, whose answer stands, when the count may be why
    it failed here: its mesh spans this process's devices (DeviceCountError), or its own code failed
    after asking the backend for something (its devices: Levanter's trainer builds its mesh of them),
    whether it started the backend or an earlier case or test had. A failure of the program's own code
    that the worker repeats word for word is told as it happened here (where --traceback shows it).

    >>> where_served(None, len, "four")  # a zoo case is served where it is asked
    4
    """
    if count is None or serves(count):
        return fn(*args)
    started, uses = _backend_started(), _backend_uses()
    try:
        return fn(*args)
    except DeviceCountError:
        failure = None
    except BadInput as err:
        if not _backend_started():
            raise  # it never asked for devices: the failure is its own, whatever the count
        if started and (_backend_uses() == uses or not _raised_by_the_program(err)):
            raise  # it asked the running backend nothing, or the harness refused it (a time limit, a check)
        failure = err
    try:
        return in_device_worker(count, fn, *args)
    except BadInput as err:
        if failure is None or str(err) != str(failure):
            raise
    raise failure


def _backend_uses() -> int:
    """How many times this process has asked jax's backend for anything (its devices, a concrete array)
    so far; abstract evaluation and tracing ask it nothing. A jax without the count gives a new number
    each call: every failure then counts as having asked."""
    from jax._src import xla_bridge  # jax has no public count: its backend cache's, read, never changed

    info = getattr(xla_bridge.get_backend, "cache_info", None)
    return info().hits if callable(info) else next(_UNCOUNTED)


_UNCOUNTED = itertools.count(-1, -1)


def _raised_by_the_program(err: BadInput) -> bool:
    """Whether the user's own code raised `err`'s cause (not its time limit, nor a check of the harness)."""
    from sharding_dump.core.boundary import TimeLimitExceeded, UserCodeError

    return isinstance(err, UserCodeError) and not isinstance(err.__cause__, TimeLimitExceeded)


def forget_worker(count: int) -> None:
    """The worker of `count` shut down (it died, or the run is over): the next case starts another."""
    pool = _WORKERS.pop(count, None)
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def close_workers() -> None:
    """Every worker of :func:`_device_worker` shut down."""
    for count in list(_WORKERS):
        forget_worker(count)


def _maxtext_case(args: argparse.Namespace, verb: str, project: Project) -> Case:
    """The case of --maxtext-config (KEY=VALUE are MaxText keys); verify says which layout-neutral keys
    it compiles otherwise than the configuration asks."""
    from sharding_dump.zoo import maxtext_config

    if args.model or args.rule or getattr(args, "cases", None):
        raise BadInput("--maxtext-config names the model (model_name) and the rule (custom_mesh_and_rule): "
                       "drop --model/--rule/--cases")
    read = maxtext_config.read_case(args.maxtext_config, args.settings, args.topology, args.num_slices,
                                    project.resolve)
    if verb == "verifies":
        for note in read.compiled_notes:
            print(f"sharding-dump: warning: {one_line(note)}", file=sys.stderr, flush=True)
    return read.case
