"""The `sharding-dump` command.

    sharding-dump --model M --topology T --rule R [--num-slices N] [KEY=VALUE ...] [--golden-dir DIR]
    sharding-dump --maxtext-config RUN.yml [--topology T] [--num-slices N] [MAXTEXT_KEY=VALUE ...]
    sharding-dump --all [--cases FILE ...] [--golden-dir DIR]
    sharding-dump list models|topologies|rules|settings
    sharding-dump diff OLD NEW [--format text|markdown|json] [--max-chars N]
    sharding-dump check (CASE | --all [--cases FILE ...]) [--replicated-tolerance F]
    sharding-dump show CASE
    sharding-dump verify (CASE | --all [-j N]) [--format text|markdown|json] [--tpu] [--record]
    sharding-dump --version

The golden folder, the case files and extra rule and card folders come from `[tool.sharding-dump]` in
the nearest pyproject.toml (:mod:`sharding_dump.zoo.project`); --golden-dir and --cases override it. Each
subcommand is a module of this package with `add_arguments(parser)` and `run(args) -> exit status`;
the options they share are built by :mod:`sharding_dump.commands.options`.

CASE is --model M --topology T --rule R [--num-slices N] [KEY=VALUE ...], as for a dump, or a MaxText
run configuration: --maxtext-config RUN.yml [--topology T] [KEY=VALUE ...] (:mod:`sharding_dump.zoo.maxtext_config`).
Exit status: 0 on success (diff: no difference; check: no finding), 1 when `diff` finds a difference
or `check` a finding, 2 on bad input (one line on stderr, nothing written; the user's code failing,
exiting or running past --time-limit is bad input too), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import os
import signal
import sys
import warnings
from typing import Iterable, Iterator, Sequence

from sharding_dump.commands.options import Parser
from sharding_dump.core.gc_policy import fewer_collections
from sharding_dump.errors import BadInput, UnevenSplitWarning, one_line

# The command needs no accelerator and must give the same bytes whatever JAX's environment says
# (JAX_PLATFORMS=cuda on a machine without GPUs, JAX_NUMPY_DTYPE_PROMOTION=strict, ... would crash it):
# these JAX options are forced before any backend starts. XLA_FLAGS stays the user's: no dump starts a
# backend, and a program that does (a mesh built from jax.devices()) gets the case's device count as CPU
# devices on top of them (options.give_cpu_devices).
JAX_OPTIONS = {"jax_platforms": "cpu", "jax_enable_x64": False, "jax_numpy_dtype_promotion": "standard",
               "jax_disable_jit": False}


def _force_jax_options() -> None:
    """Set in the environment, which jax reads when it is imported (a command that needs no jax, like
    `diff`, never imports it); applied to jax's config too when it is imported already."""
    for name, value in JAX_OPTIONS.items():
        os.environ[name.upper()] = str(value).lower() if isinstance(value, bool) else value
    if "jax" in sys.modules:
        import jax

        for name, value in JAX_OPTIONS.items():
            jax.config.update(name, value)

# Hugging Face transformers logs advisories on stderr when a user's factory builds a Flax model (that
# its Flax classes are deprecated, ...): a command's stderr is its warning and error lines, so the
# library's own logger shows errors only while a command runs (its level put back after).
QUIET_LOGGERS = {"TRANSFORMERS_VERBOSITY": "transformers"}


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """Each logger of QUIET_LOGGERS at ERROR: by the environment variable the library reads when it
    configures its logger on first use, and on the logger itself when that already happened."""
    saved = {name: (os.environ.get(name), logging.getLogger(logger).level) for name, logger in QUIET_LOGGERS.items()}
    for name, logger in QUIET_LOGGERS.items():
        os.environ.setdefault(name, "error")
        logging.getLogger(logger).setLevel(max(logging.ERROR, logging.getLogger(logger).level))
    try:
        yield
    finally:
        for name, (value, level) in saved.items():
            if value is None:
                os.environ.pop(name, None)
            logging.getLogger(QUIET_LOGGERS[name]).setLevel(level)


# Command -> (module, what it does): the module is imported only when its command runs, so `diff`
# never loads jax. `dump` is also what runs when no command word is given.
COMMANDS = {
    "dump": ("dump", "write one case's golden JSON (or --all: every case); the default command"),
    "list": ("listing", "list the model cards, topologies, rule files or settings"),
    "diff": ("diff", "compare two case folders or two golden trees, per tensor (text, markdown or json)"),
    "check": ("check", "lint a case: uneven splits, unknown axes, replicated parameters, memory above HBM"),
    "show": ("show", "print one case as a table of every leaf's layout and the totals per device"),
    "verify": ("verify", "compile a case's training step on fake devices (or a TPU topology) and check it"),
}
DEFAULT = "dump"


def _parser(name: str, word_given: bool) -> Parser:
    """The parser of one command, its description the one line of COMMANDS; the dump's `--help` when
    no command word was given lists every command."""
    module, summary = COMMANDS[name]
    if word_given:
        parser = Parser(prog=f"sharding-dump {name}", description=summary[0].upper() + summary[1:] + ".")
    else:
        width = max(map(len, COMMANDS))
        listing = "\n".join(f"  {command:<{width}}  {text}" for command, (_, text) in COMMANDS.items())
        parser = Parser(prog="sharding-dump", formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Dump the sharding of a model's full training state for one case (or every "
                                    "case of\nthe matrix) as golden JSON.",
                        epilog=f"commands (sharding-dump COMMAND --help for each):\n{listing}")
    importlib.import_module(f"sharding_dump.commands.{module}").add_arguments(parser)
    return parser


def run(argv: Sequence[str]) -> int:
    """Parses `argv` and runs its command; BadInput on bad input."""
    word_given = bool(argv) and argv[0] in COMMANDS
    name = argv[0] if word_given else DEFAULT
    # KEY=VALUE settings anywhere among the options (`--golden-dir DIR shard_mode=explicit` too)
    args = _parser(name, word_given).parse_intermixed_args(argv[1:] if word_given else argv)
    from sharding_dump.commands.options import time_limit_of

    try:
        with time_limit_of(getattr(args, "time_limit", None), hasattr(args, "time_limit")):
            return importlib.import_module(f"sharding_dump.commands.{COMMANDS[name][0]}").run(args)
    except BadInput as err:
        if getattr(args, "traceback", False):  # --traceback: what the user's code raised, in full
            from sharding_dump.commands.options import print_traceback

            print_traceback(err)
        raise


_SHOW_WARNING = warnings.showwarning


def _warning_line(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> None:
    """Our warnings (any category this package defines: an uneven split, an optimizer leaf whose axes
    are ambiguous) as one `sharding-dump: warning: ...` line on stderr (the exit status is unchanged)."""
    if issubclass(category, UnevenSplitWarning) or category.__module__.startswith("sharding_dump."):
        print(f"sharding-dump: warning: {one_line(str(message))}", file=sys.stderr, flush=True)
    else:
        _SHOW_WARNING(message, category, *args, **kwargs)  # type: ignore[arg-type]


def version() -> str:
    """`sharding-dump X.Y.Z (jax 0.10.2, jaxlib 0.10.2, flax 0.12.8, optax 0.2.8)`: this package's
    version and those a golden depends on, read from the installed distributions' metadata (nothing
    imported), the one source `sharding_dump.__version__` reads too."""
    from importlib import metadata

    def of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{name} {of(name)}" for name in ("jax", "jaxlib", "flax", "optax"))
    return f"sharding-dump {of('sharding-dump')} ({deps})"


class _Stdout:
    """Standard output that turns a failed write (closed, /dev/full, a reader gone) into BadInput. The
    rest of the file API (isatty, fileno, encoding, buffer, ...) is the stream's own: a user's program
    may ask it (tqdm_loggable asks `sys.stdout.isatty()` when it is imported)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __getattr__(self, name: str) -> object:
        return getattr(self.__dict__["stream"], name)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

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


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _exit_now(status: int, stdout: object) -> None:
    """Ends the process at once (after flushing what was printed), skipping the interpreter's
    teardown: every file the run wrote is complete or gone by now."""
    for stream in (stdout, sys.stderr):
        try:
            stream.flush()  # type: ignore[attr-defined]
        except (OSError, ValueError):
            pass
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit status."""
    whole_process = argv is None  # the command itself (not a call from Python code in a larger program)
    argv = list(sys.argv[1:] if argv is None else argv)
    xla_flags = os.environ.get("XLA_FLAGS")  # the user's, given back when a call from Python code returns
    _force_jax_options()
    warnings.simplefilter("always", UnevenSplitWarning)
    shown_before = warnings.showwarning
    warnings.showwarning = _warning_line
    stdout = sys.stdout
    guard = sys.stdout = _Stdout(stdout)
    # Ctrl-C ends a run even when SIGINT came in ignored (a job started in the background of a
    # script inherits SIG_IGN, and Python then never raises KeyboardInterrupt).
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN and _main_thread()
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with fewer_collections(), _quiet_libraries():  # this process traces models from start to end
            status = run(argv)
        sys.stdout.flush()
        return status
    except BadInput as err:
        print(f"sharding-dump: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a golden is swapped in whole or not at all: nothing is half-written
        print("sharding-dump: interrupted", file=sys.stderr)
        if whole_process:  # jax's teardown at exit takes a second or more: the user asked to stop now
            _exit_now(INTERRUPTED, stdout)
        return INTERRUPTED
    finally:
        if xla_flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = xla_flags
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        warnings.showwarning = shown_before
        if guard.stream is not None:  # after a failed write, stdout stays /dev/null to the end
            sys.stdout = stdout
        if whole_process:  # the process ends next: its exit then skips the full collections over the heap
            gc.freeze()    # that jax and the traced models built (0.3 s CPU of a 1.4 s one-case dump)


if __name__ == "__main__":
    sys.exit(main())
