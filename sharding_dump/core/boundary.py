"""The boundary where the harness calls the user's code: every way out of it becomes one line.

The user's code (a module import, a factory, a model call, an init, a step, a rule file's regex) may
raise anything, call `sys.exit`, loop forever or be interrupted. :func:`guard` runs one such call:

* any exception, `SystemExit` (whatever its code) or other `BaseException` becomes a
  :class:`UserCodeError` (a one-line BadInput, exit status 2) naming the call;
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
    late = delay - max(deadline - time.monotonic(), 1e-6)

    def fire() -> None:
        with lock:
            if calls and time.monotonic() >= min(c.deadline for c in calls) + late - 0.001:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(TimeLimitExceeded))

    _thread.watchdog = threading.Timer(delay, fire)
    _thread.watchdog.daemon = True
    _thread.watchdog.start()


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
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)
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


def interrupted() -> bool:
    """True when a Ctrl-C (SIGINT) arrived during the current or last guarded call."""
    return _thread.interrupted


@contextlib.contextmanager
def guard(what: str, detail: str = "", limit: float | None = None, hint: str = LIMIT_HINT,
          error: type[BadInput] = UserCodeError, user: bool = True) -> Iterator[None]:
    """Runs a call into the user's code, `what` naming it ("the model factory make_lm"); `detail`
    (what was passed, what the interface expects) follows the reason in parentheses. Everything
    that leaves the call but a BadInput of a nested guard and a real Ctrl-C becomes `error` (one
    line); `limit` replaces the time limit, `hint` says where it is set. `user=False` is for a bounded
    block of the harness's own (regex searches): nothing is put back after it, and any
    KeyboardInterrupt in it is Ctrl-C."""
    seconds = current_limit() if limit is None else limit
    now = time.monotonic()
    call = _Call(what, seconds, now + seconds)
    outermost = not _thread.calls
    if outermost:
        _enter_outermost(user)
    suffix = f" ({detail})" if detail else ""
    try:  # the timer may fire as soon as it is set (a limit of a millisecond): inside the try
        _thread.calls.append(call)
        _arm(min(c.deadline for c in _thread.calls))
        yield
    except BadInput:
        raise
    except TimeLimitExceeded:
        if any(c.deadline < call.deadline for c in _thread.calls[:-1]):
            raise  # the time of an enclosing call ran out: it says so
        raise error(one_line(f"{what} did not finish within the time limit of {seconds_text(seconds)} "
                             f"({hint})")) from None
    except KeyboardInterrupt as err:
        if _thread.interrupted or not user:
            raise  # Ctrl-C: the run ends (exit 130)
        raise error(one_line(f"{what} raised {first_line(err)} with no Ctrl-C{suffix}")) from None
    except SystemExit as err:
        raise error(one_line(f"{what} exited with SystemExit({err.code!r}) (sys.exit, exit() or quit() ends "
                             f"the process; the harness's calls must return)")) from None
    except BaseException as err:  # noqa: BLE001: anything the user's code raises is one line, not a traceback
        raise error(one_line(f"{what} failed with {first_line(err)}{suffix}")) from None
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
