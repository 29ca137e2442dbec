"""Tables and byte sizes as the review commands print them: aligned text for a terminal, GitHub
markdown for a pull-request comment. tabulate lays the tables out; this module only fixes the styles.

>>> print(render(["tensor", "bytes"], [["params/w", format_bytes(3 * 2**20)]], "text", right=(1,)))
tensor      bytes
--------  -------
params/w  3.0 MiB
>>> print(render(["tensor", "spec"], [["a|b", code('["fsdp",null]')]], "markdown"))
| tensor   | spec            |
|:---------|:----------------|
| a\\|b     | `["fsdp",null]` |
"""

from __future__ import annotations

from typing import Sequence

import humanize
from tabulate import tabulate

STYLES = {"text": "simple", "markdown": "pipe"}


def format_bytes(count: int | None) -> str:
    """`3.0 MiB`; a missing size is `-`."""
    if count is None:
        return "-"
    return humanize.naturalsize(count, binary=True, format="%.1f")


def format_delta(old: int | None, new: int | None) -> str:
    """The signed change between two byte counts: `+1.5 GiB`, `-512.0 KiB`, `0`."""
    if old is None or new is None or old == new:
        return "0" if old == new else "-"
    sign = "+" if new > old else "-"
    return sign + format_bytes(abs(new - old))


def code(text: str) -> str:
    """Inline code in markdown (spec lists read better in a fixed font)."""
    return f"`{text}`"


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], fmt: str, right: Sequence[int] = ()) -> str:
    """A table in `fmt` (text or markdown); columns whose index is in `right` are right-aligned.
    Cells are strings and printed as given (no number parsing)."""
    cells = [list(row) for row in rows]
    if fmt == "markdown":  # a '|' inside a cell would split the column
        cells = [[cell.replace("|", "\\|") for cell in row] for row in cells]
    align = ["right" if i in right else "left" for i in range(len(headers))]
    return tabulate(cells, headers=list(headers), tablefmt=STYLES[fmt], disable_numparse=True, colalign=align)
