"""Progress over cases: on a terminal a status line (what is worked on, for how long, how many are
left), erased before each finished line and cut to the terminal's width; in CI or when not a
terminal, the finished lines only."""

from __future__ import annotations

import io

import pytest

from sharding_dump.commands.cli import main
from sharding_dump.commands.progress import ERASE, Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("COLUMNS", "60")
    return Terminal()


def test_status_line_names_the_case_and_what_is_left(terminal, capsys):
    with Progress(3, "dumping", terminal) as progress:
        progress.start("llama2-7b/v5p-16/slice_1/rule_default_with_a_long_override_name=1")
        first = terminal.getvalue()
        progress.finish("golden/llama2-7b/...: wrote named_shardings.json")
        progress.start("gemma-7b/v5p-16/slice_1/rule_default")
        second = terminal.getvalue()[len(first):]
    assert first.startswith(ERASE + "[1/3] dumping llama2-7b/v5p-16/") and first.endswith("...")
    assert len(first) - len(ERASE) == 59  # cut to the terminal's 60 columns, less one
    assert second.startswith(ERASE + ERASE + "[2/3] dumping gemma-7b/v5p-16/slice_1/rule_default 0s, 1")
    with Progress(3, "dumping", io.StringIO()) as progress:  # the whole line, at full width
        progress.start("a")
        progress.finish("a")
        progress.start("b")
        assert progress.line().startswith("[2/3] dumping b 0s, 1 left after it, ~0s to go")
    assert terminal.getvalue().endswith(ERASE)  # nothing left on the line at the end
    assert capsys.readouterr().out.startswith("[1/3] golden/llama2-7b/...: wrote named_shardings.json (0.0")


@pytest.mark.parametrize("env", [{"CI": "true"}, {"TERM": "dumb"}, {}])
def test_quiet_in_ci_and_off_a_terminal(env, terminal, monkeypatch, capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    status = terminal if env else io.StringIO()
    with Progress(2, "verifying", status) as progress:
        progress.start("a")
        progress.finish("a: ok", timed=False)
    assert status.getvalue() == "" and capsys.readouterr().out == "[1/2] a: ok\n"


def test_dump_draws_its_status_line_on_a_terminal(terminal, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("sys.stderr", terminal)
    case = ["--model", "qwen3-0.6b", "--topology", "cpu-8", "--rule", "default"]
    assert main([*case, "--golden-dir", str(tmp_path)]) == 0
    assert terminal.getvalue().startswith(ERASE + "[1/1] dumping qwen3-0.6b/cpu-8/slice_1/rule_default ")
    assert terminal.getvalue().endswith(ERASE)
    assert capsys.readouterr().out.startswith(f"{tmp_path.as_posix()}/qwen3-0.6b/cpu-8/slice_1/rule_default/: wrote ")
