"""Tables as the review commands print them: aligned text for a terminal, GitHub markdown for a
pull-request comment. tabulate lays the tables out; this module only fixes the styles (byte sizes:
:mod:`sharding_dump.golden.sizes`).

>>> print(render(["tensor", "bytes"], [["params/w", "3.0 MiB"]], "text", right=(1,)))
tensor      bytes
--------  -------
params/w  3.0 MiB
>>> print(render(["tensor", "spec"], [["a|b", code('["fsdp",null]')]], "markdown"))
| tensor   | spec            |
|:---------|:----------------|
| a\\|b     | `["fsdp",null]` |
"""

from __future__ import annotations

import re
from typing import Sequence

from tabulate import tabulate

STYLES = {"text": "simple", "markdown": "pipe"}


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
