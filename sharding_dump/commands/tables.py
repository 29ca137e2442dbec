"""Tables and byte sizes as the review commands print them: aligned text for a terminal, GitHub
markdown for a pull-request comment. tabulate lays the tables out; this module only fixes the styles.
Byte sizes are written and read with one table of units (`format_bytes`, `parse_bytes`).

>>> print(render(["tensor", "bytes"], [["params/w", format_bytes(3 * 2**20)]], "text", right=(1,)))
tensor      bytes
--------  -------
params/w  3.0 MiB
>>> [parse_bytes(format_bytes(n), "size") for n in (3 * 2**20, 1023)]
[3145728, 1023]
>>> print(render(["tensor", "spec"], [["a|b", code('["fsdp",null]')]], "markdown"))
| tensor   | spec            |
|:---------|:----------------|
| a\\|b     | `["fsdp",null]` |
"""

from __future__ import annotations

import re
from typing import Sequence

from tabulate import tabulate

from sharding_dump.errors import BadInput

STYLES = {"text": "simple", "markdown": "pipe"}
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


def code(text: str) -> str:
    """Inline code in markdown (spec lists read better in a fixed font). A name may hold anything: its
    backticks get a longer fence (CommonMark) and a line break is written `\\n`, so neither ends the
    span or the table row early.

    >>> code("a`b"), code("`x"), code("a\\nb")
    ('``a`b``', '`` `x ``', '`a\\\\nb`')
    """
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], fmt: str, right: Sequence[int] = ()) -> str:
    """A table in `fmt` (text or markdown); columns whose index is in `right` are right-aligned.
    Cells are strings and printed as given (no number parsing)."""
    cells = [list(row) for row in rows]
    if fmt == "markdown":  # a '|' inside a cell would split the column
        cells = [[cell.replace("|", "\\|") for cell in row] for row in cells]
    align = ["right" if i in right else "left" for i in range(len(headers))]
    return tabulate(cells, headers=list(headers), tablefmt=STYLES[fmt], disable_numparse=True, colalign=align)
