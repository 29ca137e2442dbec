"""The boundary where the harness calls the user's code (sharding_dump/core/boundary.py): every way
out of a call is one line, a call has a time limit (main thread: a timer; another thread: an
exception posted to it), a real Ctrl-C passes through, and what a call changes in the process
(working directory, environment, jax options) is put back. The CLI-level probes are in
tests/integration/test_hostile_programs.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import pytest

from sharding_dump.core import boundary
from sharding_dump.core.boundary import UserCodeError, bounded_search, guard, time_limit
from sharding_dump.errors import BadInput


class Custom(BaseException):
    pass


def loop() -> None:
    while True:
        pass


HERE = f"at {os.path.relpath(__file__)}:"  # the line names where the user's code (here: this file) raised


@pytest.mark.parametrize("body, words", [
    (lambda: (_ for _ in ()).throw(SystemExit(0)), "exited with SystemExit(0) " + HERE),
    (lambda: exec("import sys; sys.exit(3)"), "exited with SystemExit(3) " + HERE),
    (lambda: exec("raise SystemExit('bye')"), "exited with SystemExit('bye') " + HERE),
    (lambda: exec("raise KeyboardInterrupt"), "raised KeyboardInterrupt with no Ctrl-C " + HERE),
    (lambda: (_ for _ in ()).throw(Custom("odd")), "failed with Custom: odd " + HERE),
    (lambda: (_ for _ in ()).throw(GeneratorExit()), "failed with GeneratorExit " + HERE),
    (lambda: (_ for _ in ()).throw(MemoryError("no room")), "failed with MemoryError: no room " + HERE),
    (lambda: (_ for _ in ()).throw(ValueError("two\nlines")), "failed with ValueError: two " + HERE),
    (lambda: (_ for _ in ()).throw(ModuleNotFoundError("Error resolving the config:\n\n  in cfg.model\n"
                                                        "No module named 'dialog'")),
     "failed with ModuleNotFoundError: Error resolving the config: in cfg.model No module named 'dialog' " + HERE),
], ids=["SystemExit-0", "sys.exit-3", "SystemExit-text", "KeyboardInterrupt-raised", "BaseException",
        "GeneratorExit", "MemoryError", "multi-line", "cause-on-third-line"])
def test_every_exit_is_one_line_naming_the_call(body, words):
    with pytest.raises(UserCodeError) as caught:
        with guard("the factory f", "passed x"):
            body()
    assert str(caught.value).startswith("the factory f ") and words in str(caught.value)
    assert "\n" not in str(caught.value)
    assert "(passed x)" in str(caught.value) or "SystemExit" in str(caught.value)
    assert caught.value.__cause__ is not None  # kept, for --traceback and pytest --tb=long


def test_bad_input_of_a_nested_call_passes_through_unchanged():
    with pytest.raises(BadInput, match="^inner$"):
        with guard("outer"):
            with guard("inner call"):
                raise BadInput("inner")


@pytest.mark.parametrize("body", [loop, lambda: time.sleep(60)], ids=["python-loop", "sleep"])
def test_a_call_past_its_time_limit_is_one_line_naming_the_limit(body):
    with time_limit(0.3), pytest.raises(UserCodeError, match=r"^the step s did not finish within the time limit "
                                                             r"of 0.3 s \(--time-limit"):
        with guard("the step s"):
            body()


def test_a_limit_that_runs_out_while_the_call_is_being_set_up_is_the_same_one_line():
    """--time-limit 0.000001: the timer fires while the harness arms it (starting the watchdog), before
    the user's code is reached; that too is the call's one line, and no call is left on the stack."""
    for _ in range(50):
        with time_limit(1e-6), pytest.raises(UserCodeError, match="^the factory f did not finish within"):
            with guard("the factory f"):
                loop()
        assert not boundary._thread.calls


def test_a_call_that_silences_the_timer_is_ended_by_the_watchdog():
    """The user's code ignores SIGALRM and cancels the timer, then loops: the watchdog a second later."""
    with time_limit(0.3), pytest.raises(UserCodeError, match="^the factory f did not finish within the time limit"):
        with guard("the factory f"):
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            signal.setitimer(signal.ITIMER_REAL, 0)
            loop()


def test_the_limit_runs_per_outermost_call_and_a_shorter_inner_limit_wins():
    with time_limit(0.3), pytest.raises(UserCodeError, match="^outer did not finish within .* 0.3 s"):
        with guard("outer"):
            with guard("inner, given more", limit=100):
                loop()
    with time_limit(100), pytest.raises(UserCodeError, match="^inner did not finish within .* 0.2 s"):
        with guard("outer"):
            with guard("inner", limit=0.2):
                loop()


def test_a_call_in_another_thread_is_bounded_too():
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with time_limit(0.3), guard("the threaded call"):
                loop()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], UserCodeError), errors
    assert "the threaded call did not finish within the time limit of 0.3 s" in str(errors[0])


def test_calls_under_a_tracer_or_profiler_return(tmp_path):
    """Under a tracer (coverage, pdb) or a profiler (cProfile), guarded calls return and so does every
    call after them, the watchdog's included: Python 3.11 spun forever on the first function call after
    a guarded one, on the pending flag a withdrawn posted exception left set. In a fresh process, which
    faulthandler ends with its stack should it hang."""
    import subprocess
    import sys

    script = tmp_path / "traced.py"
    script.write_text(
        "import faulthandler, sys, threading\n"
        "faulthandler.dump_traceback_later(60, exit=True)\n"
        "from sharding_dump.core.boundary import UserCodeError, guard, time_limit\n"
        "def run(): \n"
        "    with guard('a call'):\n"
        "        pass\n"
        "    try:\n"
        "        with time_limit(0.2), guard('a loop'):\n"
        "            while True: pass\n"
        "    except UserCodeError:\n"
        "        pass\n"
        "    print('returned', flush=True)\n"
        "sys.settrace(lambda *a: None)\n"
        "run()\n"
        "thread = threading.Thread(target=run); thread.start(); thread.join()\n"
        "sys.settrace(None)\n"
        "import cProfile; cProfile.run('run()', str(sys.argv[1]))\n")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "prof")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["returned"] * 3, done.stdout + done.stderr


def test_a_real_ctrl_c_passes_through_and_handlers_and_timers_are_restored():
    # A process started in the background of a script (`pytest &`) ignores SIGINT from its start, and a
    # guarded call leaves an ignored SIGINT ignored: listen as a terminal's process does, for this test.
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)
    signal.setitimer(signal.ITIMER_REAL, 100)  # someone else's timer (pytest-timeout's) runs on after
    try:
        with pytest.raises(KeyboardInterrupt):
            with guard("the factory f"):
                os.kill(os.getpid(), signal.SIGINT)
                loop()
        assert boundary.interrupted()
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)) == before
        assert 90 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_what_a_call_changes_in_the_process_is_put_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDING_DUMP_PROBE", raising=False)
    x64 = jax.config.jax_enable_x64
    with guard("the factory f"):
        os.chdir("/")
        os.environ["SHARDING_DUMP_PROBE"] = "1"
        jax.config.update("jax_enable_x64", not x64)
    assert os.getcwd() == str(tmp_path) and "SHARDING_DUMP_PROBE" not in os.environ
    assert jax.config.jax_enable_x64 == x64


def test_a_backtracking_regex_is_bounded():
    with pytest.raises(BadInput, match=r"^partition rule r.yml:3: the regex .* did not finish within the time limit of "
                                       r"1 s \(regex_seconds .*\); a regex with nested repetition"):
        bounded_search(r"(\w+/?)+Z", "transformer/h/0/attention/wq/kernel", "partition rule r.yml:3")
    assert bounded_search("attention/w[qkv]", "transformer/h/0/attention/wq/kernel", "rule")


def test_ctrl_c_in_a_bounded_regex_block_passes_through(monkeypatch):
    """The block's own time limit is raised here: under a loaded machine a garbage collection of a
    worker's heap can outlast the 1 s limit before the Ctrl-C arrives, which is another test's case."""
    from sharding_dump.core import boundary
    from sharding_dump.core.boundary import bounded_regexes

    monkeypatch.setattr(boundary, "regex_limit", lambda: 60.0)
    with pytest.raises(KeyboardInterrupt):
        with bounded_regexes() as search:
            assert search("a", "ab", "rule")
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)


@pytest.mark.parametrize("value", [0, -1, "abc", float("nan"), float("inf"), True, 1e9])
def test_a_time_limit_is_a_positive_bounded_number(value):
    with pytest.raises(BadInput, match="give a number of seconds greater than 0"):
        with time_limit(value):
            pass


def test_the_python_api_calls_the_users_model_at_the_boundary():
    """sd.dump_model: a factory or a model call that exits, or runs past the time limit, is one
    UserCodeError line (the API's callers get BadInput, as the CLI's get exit 2)."""
    import sys

    import flax.linen as nn
    from jax.sharding import AbstractMesh, AxisType

    import sharding_dump as sd

    class Exits(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            sys.exit(5)

    class Loops(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            loop()

    def factory():
        raise SystemExit(1)

    mesh = AbstractMesh((2,), ("data",), (AxisType.Auto,))
    with pytest.raises(UserCodeError, match=r"^the model call Exits\(tokens\) exited with SystemExit\(5\)"):
        sd.dump_model(Exits(), mesh, [("batch", "data")], batch_shape=(2, 8))
    with pytest.raises(UserCodeError, match=r"^the model factory .*factory exited with SystemExit\(1\)"):
        sd.dump_model(factory, mesh, [("batch", "data")], batch_shape=(2, 8))
    with time_limit(0.3), pytest.raises(UserCodeError, match=r"^the model call Loops\(tokens\) did not finish within"):
        sd.dump_model(Loops(), mesh, [("batch", "data")], batch_shape=(2, 8))
