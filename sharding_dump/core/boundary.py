"""The boundary where the harness calls the user's code: every way out of it becomes one line.

The user's code (a module import, a factory, a model call, an init, a step, a rule file's regex) may
raise anything, call `sys.exit`, loop forever or be interrupted. :func:`guard` runs one such call:

* any exception, `SystemExit` (whatever its code) or other `BaseException` becomes a
  :class:`UserCodeError` (a one-line BadInput, exit status 2) naming the call, the user's file and
  line it was raised at (:func:`raised_at`: the innermost frame that is not jax, flax, Python's own
  library or this package) and, where flax says so, the parameter or module being built; the
  exception stays chained as its `__cause__`, so `sharding-dump --traceback`, `pytest --tb=long` and
  an uncaught error in the Python API show the whole traceback;
* the call gets a time limit (:func:`time_limit`, default `data/time_limits.yml`): when it runs out,
  a UserCodeError names the call and the limit. The time runs per outermost call; a call nested
  in another runs on what is left of the outer one's time, or its own shorter limit;
* what the call changes in the process that decides where and what the harness reads and writes
  is put back when it returns: the working directory, the environment, jax's numeric
  configuration (`KEPT_JAX_OPTIONS`) and `sys.stdout` / `sys.stderr`, so a factory that calls
  `os.chdir` moves no path and one that silences stderr hides no error line;
* Ctrl-C (SIGINT) still ends the run: a `KeyboardInterrupt` the terminal sent passes through (the
  CLI exits 130); one the user's code raised itself is a UserCodeError like any other.

In the main thread the limit is a SIGALRM timer (it interrupts sleeps and regex matching too),
backed a second later by a watchdog thread; in another thread, the watchdog alone (an exception
posted to that thread when the time is up). Handlers and timers are installed for the call only and
restored after it: importing this module changes nothing.

>>> with time_limit(5):
...     with guard("the factory make_lm"):
...         raise SystemExit(3)
Traceback (most recent call last):
sharding_dump.core.boundary.UserCodeError: the factory make_lm exited with SystemExit(3) (sys.exit, exit() or quit() ends the process; the harness's calls must return)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator

from sharding_dump.errors import BadInput, one_line, shown

LIMIT_HINT = ("--time-limit, pytest --sharding-time-limit, time-limit of [tool.sharding-dump], default in "
              "sharding_dump/data/time_limits.yml")


class UserCodeError(BadInput):
    """A call into the user's code failed, exited or ran out of time: one line, exit status 2."""


class TimeLimitExceeded(BaseException):
    """Raised inside the user's code when its time is up: a BaseException, so that the user's own
    `except Exception` cannot swallow it."""


@functools.cache
def _defaults() -> dict[str, float]:
    from sharding_dump.resources import DATA_DIR, load_yaml

    path = DATA_DIR / "time_limits.yml"
    data = load_yaml(path, "time limits")
    out = {}
    for key in ("user_code_seconds", "regex_seconds"):
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
            raise BadInput(f"time limits {path}: field {key}: give a number of seconds in (0, {MAX_SECONDS}]")
        out[key] = float(value)
    return out


MAX_SECONDS = 10**7  # about 115 days: a bound a timer can hold


def check_seconds(value: Any, what: str) -> float:
    """A time limit as given (`--time-limit 2.5`): a positive number of seconds, at most MAX_SECONDS."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not 0 < seconds <= MAX_SECONDS:
        raise BadInput(f"{what} {shown(value)}: give a number of seconds greater than 0 and at most {MAX_SECONDS}")
    return seconds


_configured: list[float] = []  # the limits of the enclosing time_limit() blocks


def current_limit() -> float:
    """Seconds each call into the user's code (and each verify compile) may take."""
    return _configured[-1] if _configured else _defaults()["user_code_seconds"]


def regex_limit() -> float:
    """Seconds one search of a rule file's regex may take (a path is short: a sane regex takes
    microseconds, a backtracking one forever)."""
    return _defaults()["regex_seconds"]


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Within this block, each call into the user's code may take `seconds` (None: the default)."""
    if seconds is None:
        yield
        return
    _configured.append(check_seconds(seconds, "time limit"))
    try:
        yield
    finally:
        _configured.pop()


def seconds_text(seconds: float) -> str:
    return f"{seconds:g} s"


# --- the calls in progress --------------------------------------------------------------------------

@dataclasses.dataclass
class _Call:
    what: str
    limit: float
    deadline: float


# jax options that change what a trace produces; a user's call that sets one has it undone after.
KEPT_JAX_OPTIONS = ("jax_enable_x64", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion",
                    "jax_default_matmul_precision", "jax_default_prng_impl", "jax_disable_jit")


class _Thread(threading.local):
    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.saved: tuple[Any, ...] = ()
        self.process: tuple[Any, ...] = ()  # working directory, environment, jax options before the call
        self.interrupted = False  # a SIGINT arrived while a call ran
        self.watchdog: threading.Timer | None = None
        self.lock = threading.Lock()
        self.posted: list[bool] = []  # the watchdog posted TimeLimitExceeded to this thread (it writes from its own)


_thread = _Thread()


def _signals_bound_calls() -> bool:
    """True where signals can bound a call: the main thread, on a system with SIGALRM timers (not
    Windows, where every thread gets the watchdog)."""
    return hasattr(signal, "setitimer") and threading.get_ident() == threading.main_thread().ident


def _on_alarm(signum: int, frame: Any) -> None:
    if _thread.calls and time.monotonic() >= min(c.deadline for c in _thread.calls) - 0.001:
        raise TimeLimitExceeded()


def _on_interrupt(signum: int, frame: Any) -> None:
    _thread.interrupted = True
    previous = _thread.saved[1] if _thread.saved else signal.default_int_handler
    if callable(previous):
        previous(signum, frame)
    raise KeyboardInterrupt


BACKUP_SECONDS = 1.0  # after the timer, the watchdog: a call that reset SIGALRM is ended all the same


def _arm(deadline: float) -> None:
    """Sets the timer (main thread) to fire at `deadline`, and the watchdog (other threads; in the
    main thread, for the user's code, a second later, should the code have reset the timer)."""
    delay = max(deadline - time.monotonic(), 1e-6)
    if _signals_bound_calls():
        signal.setitimer(signal.ITIMER_REAL, delay)
        if not _thread.process:  # a bounded block of the harness's own: the timer is enough
            return
        delay += BACKUP_SECONDS
    if _thread.watchdog is not None:
        _thread.watchdog.cancel()
    ident = threading.get_ident()
    calls = _thread.calls
    lock = _thread.lock
    posted = _thread.posted
    late = delay - max(deadline - time.monotonic(), 1e-6)

    def fire() -> None:
        with lock:
            if calls and time.monotonic() >= min(c.deadline for c in calls) + late - 0.001:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(TimeLimitExceeded))
                posted.append(True)

    _thread.watchdog = threading.Timer(delay, fire)
    _thread.watchdog.daemon = True
    _thread.watchdog.start()


def _take_posted() -> None:
    """Takes a TimeLimitExceeded the watchdog posted as the call ended, before it reaches the harness.

    It is delivered, not withdrawn: Python 3.11 withdraws one (`PyThreadState_SetAsyncExc(id, NULL)`)
    but leaves its pending flag set, and under a tracer or profiler (coverage, pdb, cProfile) every
    later function call then spins on that flag forever. A delivered one clears it; a function call
    is where Python delivers it."""
    try:
        for _ in range(3):
            _delivery_point()
    except TimeLimitExceeded:
        pass


def _delivery_point() -> None:
    """A function call: where Python raises an exception posted to the thread."""


def _process_state() -> tuple[Any, ...]:
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # removed under us: nothing to go back to
        cwd = None
    jax = sys.modules.get("jax")
    options = {name: getattr(jax.config, name) for name in KEPT_JAX_OPTIONS
               if jax is not None and hasattr(jax.config, name)}
    return cwd, dict(os.environ), options, sys.stdout, sys.stderr


def _restore_process(saved: tuple[Any, ...]) -> None:
    if not saved:
        return
    cwd, environ, options, sys.stdout, sys.stderr = saved  # a call that silenced them cannot hide our line
    try:
        if cwd is not None and os.getcwd() != cwd:
            os.chdir(cwd)
    except OSError:
        os.chdir(cwd)  # the folder the call went to is gone: back to where the run is (or its error)
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    jax = sys.modules.get("jax")
    for name, value in options.items():
        if getattr(jax.config, name) != value:
            jax.config.update(name, value)


def _enter_outermost(user: bool) -> None:
    _thread.interrupted = False
    _thread.process = _process_state() if user else ()
    if _signals_bound_calls():
        alarm = signal.signal(signal.SIGALRM, _on_alarm)
        previous_timer = signal.setitimer(signal.ITIMER_REAL, 0)
        interrupt = signal.getsignal(signal.SIGINT) if user else signal.SIG_IGN
        if interrupt is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, _on_interrupt)
        _thread.saved = (alarm, interrupt, previous_timer, time.monotonic(), user)


def _leave_outermost() -> None:
    with _thread.lock:
        if _thread.watchdog is not None:
            _thread.watchdog.cancel()
            _thread.watchdog = None
        if _thread.posted:
            _thread.posted.clear()
            _take_posted()
    _restore_process(_thread.process)
    _thread.process = ()
    if _signals_bound_calls():
        signal.setitimer(signal.ITIMER_REAL, 0)
        alarm, interrupt, (delay, interval), started, _ = _thread.saved
        if interrupt is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGALRM, alarm)
        if delay > 0:  # someone else's timer (pytest-timeout's, say) runs on
            signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - started), 1e-6), interval)
        _thread.saved = ()


def first_line(err: BaseException) -> str:
    """`TypeError: the first line of its message` (the type alone when it has none)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0].strip()}" if lines else type(err).__name__


@functools.cache
def _told() -> dict[str, Any]:
    """data/user_code.yml: which frames are not the user's code, how much of a message the line holds."""
    from sharding_dump.resources import DATA_DIR, load_yaml, validate

    path = DATA_DIR / "user_code.yml"
    data = load_yaml(path, "user code settings")
    validate(data, "user_code", f"user code settings {path}")
    return data


def message(err: BaseException) -> str:
    """`Type: message` as the error line holds it: the first line of the message, and the lines after
    it when the first ends with ":" (`Error resolving the config:` introduces its cause, `No module
    named 'dialog'`, two lines down), cut at `message_chars` of data/user_code.yml; an explicit
    `raise ... from cause` adds the cause's first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    limit = _told()["message_chars"]
    if text.endswith(":"):
        for line in lines[1:]:
            if len(text) >= limit:
                break
            text = f"{text} {line}"
    if len(text) > limit:
        text = text[:limit - 3].rstrip() + "..."
    told = f"{type(err).__name__}: {text}" if text else type(err).__name__
    cause = err.__cause__
    if cause is not None and type(cause).__name__ != "UnfilteredStackTrace":  # jax's copy of the same error
        told += f" (from {first_line(cause)})"
    return told


def says(err: BaseException, name: str) -> bool:
    """True when `err`'s message holds the `says` of data/user_code.yml's hint named `name` (e.g. jax's
    refusal of `jax.set_mesh` inside a trace)."""
    return any(entry.get("name") == name and entry["says"] in str(err) for entry in _told().get("hints", ()))


def _hint(err: BaseException) -> str:
    """What data/user_code.yml's `hints` say to do about `err`'s message ("" when none holds it)."""
    text = str(err)
    return next((entry["hint"] for entry in _told().get("hints", ()) if entry["says"] in text), "")


@dataclasses.dataclass(frozen=True)
class Location:
    """Where the user's code raised: the innermost frame of the user's code, and the flax parameter
    or module being built there when flax's frames say so."""

    file: str
    line: int
    function: str
    parameter: str = ""  # `qkv/kernel`: flax's Module.param was creating it
    module: str = ""  # `block_2 (Block)`: the innermost bound linen module with a path

    def text(self) -> str:
        """`badlm.py:32 in RankLM.__call__, creating parameter qkv/kernel` (the file relative to the
        working directory when inside it)."""
        file = self.file
        try:
            relative = os.path.relpath(file)
            file = file if relative.startswith("..") else relative
        except ValueError:  # another drive (Windows)
            pass
        where = f"{file}:{self.line} in {self.function}"
        if self.parameter:
            return f"{where}, creating parameter {self.parameter}"
        return f"{where}, in module {self.module}" if self.module else where


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def _library_dirs() -> tuple[str, ...]:
    dirs = [_PACKAGE_DIR]
    for name in _told()["library_packages"]:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(dirs)


def _is_library(file_name: str, dirs: tuple[str, ...]) -> bool:
    if file_name.startswith("<"):  # <frozen importlib._bootstrap>, <string> of an exec
        return True
    path = os.path.abspath(file_name)
    return path.startswith(dirs) or (path.startswith(_STDLIB_DIR) and "site-packages" not in path
                                     and "dist-packages" not in path)


def _module_path(value: Any) -> tuple[str, ...] | None:
    """The path of a bound flax linen module (`("decoder", "block_2")`), None for anything else."""
    linen = sys.modules.get("flax.linen")
    if linen is None or not isinstance(value, linen.Module):
        return None
    try:
        scope = object.__getattribute__(value, "scope")
        return tuple(str(p) for p in scope.path) if scope is not None else None
    except Exception:  # noqa: BLE001: an unbound module or a scope of another flax version: nothing to say
        return None


def raised_at(err: BaseException) -> Location | None:
    """Where `err` was raised in the user's code, read from its traceback: the innermost frame that is
    not of data/user_code.yml's library packages, Python's own library or this package; None when
    every frame is (a call that failed at its entry: a wrong signature). The parameter flax's
    `Module.param` was creating, else the innermost bound linen module with a path, from their frames."""
    frames = list(traceback.walk_tb(err.__traceback__))
    dirs = _library_dirs()
    user = next(((frame, line) for frame, line in reversed(frames)
                 if not _is_library(frame.f_code.co_filename, dirs)), None)
    if user is None:
        return None
    parameter = module = ""
    for frame, _ in reversed(frames):
        path = _module_path(frame.f_locals.get("self"))
        if path is None:
            continue
        name = frame.f_locals.get("name")
        if frame.f_code.co_name in ("param", "variable") and isinstance(name, str) and not parameter:
            parameter = "/".join((*path, name))
        elif path and not module:
            module = f"{'/'.join(path)} ({type(frame.f_locals['self']).__name__})"
    frame, line = user
    return Location(frame.f_code.co_filename, line, frame.f_code.co_qualname, parameter, module)


def interrupted() -> bool:
    """True when a Ctrl-C (SIGINT) arrived during the current or last guarded call."""
    return _thread.interrupted


@contextlib.contextmanager
def guard(what: str, detail: str = "", limit: float | None = None, hint: str = LIMIT_HINT,
          error: type[BadInput] = UserCodeError, user: bool = True, call_hint: str = "") -> Iterator[None]:
    """Runs a call into the user's code, `what` naming it ("the model factory make_lm"); `detail`
    (what was passed) follows the reason in parentheses, and `call_hint` (what the interface expects:
    the call's signature) too when the call failed at its entry, with no frame of the user's code on
    the traceback (inside the user's code, the file and line it raised at say more). Everything that
    leaves the call but a BadInput of a nested guard and a real Ctrl-C becomes `error` (one line),
    with what was raised chained as its cause; `limit` replaces the time limit, `hint` says where it
    is set. `user=False` is for a bounded block of the harness's own (regex searches): nothing is
    put back after it, and any KeyboardInterrupt in it is Ctrl-C."""
    seconds = current_limit() if limit is None else limit
    now = time.monotonic()
    call = _Call(what, seconds, now + seconds)
    outermost = not _thread.calls
    if outermost:
        _enter_outermost(user)

    def told(err: BaseException) -> str:
        location = raised_at(err)
        parts = [detail] + ([call_hint] if location is None else []) + [_hint(err)]
        suffix = "; ".join(p for p in parts if p)
        return (f" at {location.text()}" if location is not None else "") + (f" ({suffix})" if suffix else "")

    try:  # the timer may fire as soon as it is set (a limit of a millisecond): inside the try
        _thread.calls.append(call)
        _arm(min(c.deadline for c in _thread.calls))
        yield
    except BadInput:
        raise
    except TimeLimitExceeded as err:
        if any(c.deadline < call.deadline for c in _thread.calls[:-1]):
            raise  # the time of an enclosing call ran out: it says so
        location = raised_at(err)
        running = f"; it was running at {location.text()}" if location is not None else ""
        raise error(one_line(f"{what} did not finish within the time limit of {seconds_text(seconds)} "
                             f"({hint}){running}")) from err
    except KeyboardInterrupt as err:
        if _thread.interrupted or not user:
            raise  # Ctrl-C: the run ends (exit 130)
        raise error(one_line(f"{what} raised {message(err)} with no Ctrl-C{told(err)}")) from err
    except SystemExit as err:
        location = raised_at(err)
        at = f" at {location.text()}" if location is not None else ""
        raise error(one_line(f"{what} exited with SystemExit({err.code!r}){at} (sys.exit, exit() or quit() ends "
                             f"the process; the harness's calls must return)")) from err
    except BaseException as err:  # noqa: BLE001: anything the user's code raises is one line, not a traceback
        raise error(one_line(f"{what} failed with {message(err)}{told(err)}")) from err
    finally:
        if _thread.calls and _thread.calls[-1] is call:
            _thread.calls.pop()
        if _thread.calls:
            _arm(min(c.deadline for c in _thread.calls))
        else:
            _leave_outermost()


# --- regexes from rule files -------------------------------------------------------------------------

@dataclasses.dataclass
class _Search:
    where: str = ""
    pattern: str = ""
    text: str = ""


@contextlib.contextmanager
def bounded_regexes() -> Iterator[Callable[[str, str, str], bool]]:
    """A block of rule-file regex searches (those of one parameter path, or of one rule over a
    model's paths) bounded by the regex time limit as a whole: a sane regex takes microseconds. It
    yields `search(pattern, text, where)`, `re.search` that notes what it searches: a regex that backtracks without end (`(a+)+$`) on a long
    path is one line naming `where` (the rule), the regex and the text, instead of a hang."""
    now = _Search()

    def search(pattern: str, text: str, where: str) -> bool:
        now.where, now.pattern, now.text = where, pattern, text
        return re.search(pattern, text) is not None

    try:
        with guard("searching rule-file regexes", limit=regex_limit(),
                   hint="regex_seconds of sharding_dump/data/time_limits.yml", user=False):
            yield search
    except UserCodeError as err:
        if "did not finish" not in str(err):
            raise
        raise BadInput(one_line(f"{now.where}: the regex {shown(now.pattern)} on {shown(now.text)} did not finish "
                                f"within the time limit of {seconds_text(regex_limit())} (regex_seconds of "
                                "sharding_dump/data/time_limits.yml); a regex with nested repetition such as (a+)+ "
                                "backtracks without end: write it without nesting, e.g. a+")) from None


def bounded_search(pattern: str, text: str, where: str) -> bool:
    """One `re.search` within the regex time limit (see :func:`bounded_regexes`)."""
    with bounded_regexes() as search:
        return search(pattern, text, where)
