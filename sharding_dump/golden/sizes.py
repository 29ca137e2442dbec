"""Byte sizes as every report writes and reads them, with one table of units: `3.0 MiB` in a failing
golden test, a `diff` table or a verify line, and `256MiB` or `1.5 GiB` read back from an option.

>>> [parse_bytes(format_bytes(n), "size") for n in (3 * 2**20, 1023)]
[3145728, 1023]
>>> format_change(2**30, 3 * 2**30), format_change(4, 4), format_change(0, 2**20)
('+2.0 GiB (+200%)', '0', '+1.0 MiB (new)')
"""

from __future__ import annotations

import re

from sharding_dump.errors import BadInput

BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")  # what format_bytes writes
# What parse_bytes reads: a bare number of bytes, B, the binary units, and decimal KB, MB, GB, TB.
SIZE_UNITS = {"": 1, "B": 1, **{unit: 2 ** (10 * (i + 1)) for i, unit in enumerate(BINARY_UNITS)},
              **{unit: 10 ** (3 * (i + 1)) for i, unit in enumerate(("KB", "MB", "GB", "TB"))}}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def format_bytes(count: int | None) -> str:
    """`3.0 MiB`, `1023 Bytes`; a missing size is `-`.

    >>> [format_bytes(n) for n in (None, 1, 1023, 1536, 5 * 2**40)]
    ['-', '1 Byte', '1023 Bytes', '1.5 KiB', '5.0 TiB']
    """
    if count is None:
        return "-"
    if abs(count) < 1024:
        return f"{count} Byte{'' if abs(count) == 1 else 's'}"
    unit = next((u for u in reversed(BINARY_UNITS) if abs(count) >= SIZE_UNITS[u]), BINARY_UNITS[0])
    return f"{count / SIZE_UNITS[unit]:.1f} {unit}"


def parse_bytes(text: str, what: str) -> int:
    """`256MiB`, `1.5 GiB`, `1000000`, what format_bytes writes -> bytes; BadInput naming `what` on
    anything else."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2) if match else None
    unit = "B" if unit in ("Byte", "Bytes") else unit
    if unit not in SIZE_UNITS:
        raise BadInput(f"{what} {text!r}: give a size such as 256MiB, 1.5GiB or a number of bytes "
                       f"(units: {', '.join(u for u in SIZE_UNITS if u)})")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def format_delta(old: int | None, new: int | None) -> str:
    """The signed change between two byte counts: `+1.5 GiB`, `-512.0 KiB`, `0`."""
    if old is None or new is None or old == new:
        return "0" if old == new else "-"
    sign = "+" if new > old else "-"
    return sign + format_bytes(abs(new - old))


def format_percent(old: int | None, new: int | None) -> str:
    """The change relative to `old`: `+1500%`, `-12%`, `+2.5%` (one decimal below 10%, two below 1%);
    `new` when there was nothing before, `-` when a side is unknown.

    >>> format_percent(100, 1600), format_percent(1000, 1025), format_percent(100, 88), format_percent(0, 5)
    ('+1500%', '+2.5%', '-12%', 'new')
    >>> format_percent(10**6, 10**6 + 280)
    '+0.03%'

    """
    if old is None or new is None:
        return "-"
    if old == 0:
        return "0%" if new == 0 else "new"
    pct = 100 * (new - old) / old
    digits = 2 if abs(pct) < 1 else 1 if abs(pct) < 10 else 0
    return f"{pct:+.{digits}f}%"


def format_change(old: int | None, new: int | None) -> str:
    """The change in bytes and in %: `+1.4 GiB (+1500%)`; `0` when equal."""
    if old is not None and old == new:
        return "0"
    return f"{format_delta(old, new)} ({format_percent(old, new)})"
