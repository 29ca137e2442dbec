"""The one error type users see, and the helpers that keep its message to one short line.

Anything a user can get wrong (a name, a file, a value) raises :class:`BadInput` with a single line
that names the file, field or value and says what would be valid. The CLI prints that line and exits
with status 2; nothing is written once a BadInput has been raised.

>>> shown("x" * 100, limit=10)
"'xxxxxxxxx... (100 characters)"
>>> one_line("a\\nb")
'a\\\\nb'
"""

from __future__ import annotations

import os
import re
import traceback
from typing import Any

SHOWN_CHARS = 80  # an echoed user value longer than this is cut
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_LONG_WORD = re.compile(r"\S{121,}")


class BadInput(Exception):
    """A user-facing input error: one line, no traceback, exit status 2."""


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"  # the XLA_FLAGS entry that sets a process's CPU devices


class DeviceCountError(BadInput):
    """The program's own mesh spans every device of this process, whose count is not the case's: a
    process started with the case's count answers otherwise (the command and the plugin ask one)."""


class UnevenSplitWarning(UserWarning):
    """A dumped case has leaves that do not split evenly over their mesh axes: XLA pads the last shard.
    The dump still succeeds (exit 0); the CLI prints it as one `sharding-dump: warning:` line."""


class ProgramLayoutWarning(UserWarning):
    """The program decides a layout otherwise than the case does: its step takes its batch in another
    layout than the rule file's data_sharding, or hands state back in another layout than it took it
    in. The golden records the program's; the CLI prints it as one `sharding-dump: warning:` line."""


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)`, cut to `limit` characters plus its length when longer: a message never
    echoes a 100,000-character name back in full."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, (str, bytes)) else ""
    return f"{text[:limit]}...{size}"


def one_line(message: str, word_limit: int = SHOWN_CHARS) -> str:
    """A message as exactly one printable line: control characters escaped, any word longer than
    120 characters (a path, a value) cut to `word_limit` characters around '...'."""
    message = _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), message)
    head, tail = word_limit * 3 // 4, word_limit // 4
    return _LONG_WORD.sub(lambda m: f"{m.group(0)[:head]}...{m.group(0)[-tail:]}", message)


def os_error(what: str, path: Any, err: OSError) -> BadInput:
    """An OSError on `path` as BadInput: names the path and the system's own reason (strerror)."""
    reason = err.strerror or type(err).__name__
    if err.errno is not None and err.strerror:
        reason = f"{reason} ({_errno_name(err.errno)})"
    return BadInput(f"{what} {os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else path}: {reason}")


def _errno_name(number: int) -> str:
    import errno

    return errno.errorcode.get(number, str(number))


def cause_of(err: BaseException) -> BaseException | None:
    """The exception of the user's code behind a BadInput (through the BadInputs that re-tell it):
    what `--traceback` and `pytest --tb=long` show; None when the error is the harness's own."""
    seen = set()
    cause = err.__cause__
    while isinstance(cause, BadInput) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__
    return cause


class TracebackText(Exception):
    """The traceback of the user's code as text, from another process (verify's compiling process):
    chained to the BadInput that tells it, it is what :func:`traceback_text` gives."""


def traceback_text(err: BaseException) -> str:
    """The whole traceback of the user's code behind `err` (empty when there is none)."""
    cause = cause_of(err)
    if isinstance(cause, TracebackText):
        return str(cause)
    return "".join(traceback.format_exception(cause)) if cause is not None else ""
