"""Progress of a command over cases (`--all`, `check`, `verify`): one line per finished case on
stdout, as a CI log wants it, and on a terminal also a status line on stderr, rewritten in place
every second and cut to the terminal's width, naming the case being worked on, for how long, how
many are left and about how long they will take.

The status line is drawn only when stderr is a terminal and the environment is not a CI's (`CI` set
to true or 1) nor a dumb terminal; otherwise nothing but the finished lines is written. Plain ANSI
(carriage return, erase line): no progress library is imported.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from typing import IO, Any

ERASE = "\r\x1b[2K"  # back to the line's start, erase it


def line_based() -> bool:
    """Whether the environment wants plain lines only, whatever the stream: a CI (`CI` true or 1) or a
    dumb terminal."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes") or os.environ.get("TERM") == "dumb"


def live_terminal(stream: IO[str]) -> bool:
    """Whether a status line may be drawn on `stream`: a terminal, and not :func:`line_based`."""
    isatty = getattr(stream, "isatty", None)
    return not line_based() and bool(isatty and isatty())


def _clock(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """`with Progress(n, "verifying") as p:` then per case `p.start(label)` and `p.finish(line)`."""

    def __init__(self, count: int, verb: str, status: IO[str] | None = None) -> None:
        self.count = count
        self.verb = verb
        self.status = status or sys.stderr
        self.live = live_terminal(self.status)
        self.finished = 0
        self.began = time.perf_counter()
        self.case_began = self.began
        self.label = ""
        self._drawn = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            self._erase()

    def start(self, label: str) -> None:
        """The next case begins: on a terminal, the status line names it."""
        self.case_began = time.perf_counter()
        self.label = label
        if not self.live:
            return
        with self._lock:
            self._draw()
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="sharding-dump-progress", daemon=True)
            self._ticker.start()

    def finish(self, line: str, out: IO[str] | None = None, timed: bool = True, seconds: float | None = None) -> None:
        """The case is done: its line on `out` (stdout), `[i/n] ` before it when there are several
        cases and (`timed`) its time after it (`seconds`, as a worker process measured it, or the time
        since `start`), flushed at once."""
        self.finished += 1
        prefix = f"[{self.finished}/{self.count}] " if self.count > 1 else ""
        if seconds is None:
            seconds = time.perf_counter() - self.case_began
        took = f" ({seconds:.2f}s)" if timed else ""
        with self._lock:
            self._erase()
            print(f"{prefix}{line}{took}", file=out or sys.stdout, flush=True)

    def line(self) -> str:
        """The status line: `[3/51] verifying CASE 12s, 48 left after it, ~9m30s to go`."""
        now = time.perf_counter()
        text = f"[{self.finished + 1}/{self.count}] {self.verb} {self.label} {_clock(now - self.case_began)}"
        left = self.count - self.finished - 1
        if left > 0:
            text += f", {left} left after it"
            if self.finished:
                mean = (self.case_began - self.began) / self.finished
                text += f", ~{_clock(max(mean * (left + 1) - (now - self.case_began), 0))} to go"
        width = shutil.get_terminal_size((100, 24)).columns - 1
        return text if len(text) <= width else text[:max(width - 3, 0)] + "..."

    def _draw(self) -> None:
        self.status.write(ERASE + self.line())
        self.status.flush()
        self._drawn = True

    def _erase(self) -> None:
        if self._drawn:
            self.status.write(ERASE)
            self.status.flush()
            self._drawn = False

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                if self._drawn:
                    self._draw()
