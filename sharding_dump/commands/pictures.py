"""Pictures for a reviewer, drawn from a layout alone (no devices, no jax): a tensor's split over the
mesh as a text grid (`sharding-dump show --tensor`), and memory per device before and after as a
mermaid bar chart GitHub renders in a pull-request comment (`sharding-dump diff --format markdown`)
or an inline SVG for the HTML report (`--format html`).

A block of a split dimension is named by the coordinates of the mesh axes that split it, the first
axis of a spec entry the major one (as JAX lays blocks out); the devices that differ only on the other
mesh axes hold the same block.

>>> print(split_grid("w", [8, 6], "float32", ["embed", "mlp"], ["fsdp", "tensor"], {"fsdp": 2, "tensor": 3}))
w: float32[8,6], spec ["fsdp","tensor"] on mesh fsdp=2 x tensor=3 (6 devices)
  dim 0 (embed): 8 split 2 ways over fsdp, 4 per device
  dim 1 (mlp): 6 split 3 ways over tensor, 2 per device
each device holds float32[4,2] (32 Bytes); each block is on 1 device
<BLANKLINE>
+-----------------+----------+----------+----------+
| dim 0 \\ dim 1   | 0:2      | 2:4      | 4:6      |
+=================+==========+==========+==========+
| 0:4             | fsdp 0   | fsdp 0   | fsdp 0   |
|                 | tensor 0 | tensor 1 | tensor 2 |
+-----------------+----------+----------+----------+
| 4:8             | fsdp 1   | fsdp 1   | fsdp 1   |
|                 | tensor 0 | tensor 1 | tensor 2 |
+-----------------+----------+----------+----------+
>>> print(memory_chart({"params": (2**30, 3 * 2**30), "opt_state": (2 * 2**30, 6 * 2**30), "step": (4, 4)}))
```mermaid
%%{init: {"xyChart": {"yAxis": {"showLabel": false, "showTick": false}}, "themeVariables": {"xyChart": {"plotColorPalette": "#9e9e9e, #1e88e5"}}}}%%
xychart-beta horizontal
    title "Memory per device, before (grey) and after (blue)"
    x-axis ["params before 1.0 GiB", "params after 3.0 GiB", "opt_state before 2.0 GiB", "opt_state after 6.0 GiB"]
    y-axis "GiB per device, from 0" 0 --> 6.00
    bar [1.00, 0, 2.00, 0]
    bar [0, 3.00, 0, 6.00]
```
"""

from __future__ import annotations

import html
import math
from typing import Mapping, Sequence

from tabulate import tabulate

from sharding_dump.core import specs
from sharding_dump.golden import diff
from sharding_dump.golden.sizes import format_bytes

MAX_BLOCKS = 8  # blocks drawn per direction of the grid; the middle ones of a longer split are elided
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("Bytes", 1))


def _shown(count: int, limit: int = MAX_BLOCKS) -> list[int | None]:
    """Block indices to draw: all of them, or the first ones, None (elided) and the last."""
    if count <= limit:
        return list(range(count))
    return [*range(limit - 2), None, count - 1]


def _block_range(index: int, size: int, pieces: int) -> str:
    per = -(-size // pieces)
    return f"{min(index * per, size)}:{min((index + 1) * per, size)}"


def _coordinates(index: int, axes: Sequence[str], sizes: Mapping[str, int]) -> list[str]:
    """`['fsdp 1', 'tensor 0']`: the mesh coordinates of block `index` of a dimension split over `axes`."""
    out = []
    for axis in reversed(axes):
        index, coordinate = divmod(index, sizes[axis])
        out.append(f"{axis} {coordinate}")
    return out[::-1]


def split_grid(path: str, shape: Sequence[int], dtype: str, logical_axes: Sequence[str | None],
               spec: Sequence[object] | None, sizes: Mapping[str, int]) -> str:
    """How one tensor is split over the mesh, as text: per dimension the mesh axes that split it, what
    one device holds, and a grid of the blocks of the first two split dimensions (rows and columns),
    each cell naming the mesh coordinates that hold it. Mesh axes of size 1 split nothing and are
    left out. Like `jax.debug.visualize_array_sharding`, but from the layout, so any rank and mesh."""
    ndim = len(shape)
    axes = specs.spec_axes(spec, ndim, sizes)
    pieces = [math.prod(sizes[a] for a in dim_axes) for dim_axes in axes]
    per_device = [-(-n // k) for n, k in zip(shape, pieces)]
    devices = math.prod(sizes.values())
    held_by = devices // math.prod(pieces)
    mesh = " x ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "a single device"
    spec_json = specs.spec_to_json(spec, ndim, sizes)
    lines = [f"{path}: {dtype}{diff.compact(list(shape))}, spec {diff.compact(spec_json)} on mesh {mesh} "
             f"({devices} device{'s' * (devices != 1)})"]
    for dim, (size, dim_axes) in enumerate(zip(shape, axes)):
        name = f"dim {dim}" + (f" ({logical_axes[dim]})" if dim < len(logical_axes) and logical_axes[dim] else "")
        how = (f"split {pieces[dim]} ways over {', '.join(dim_axes)}, {per_device[dim]} per device" if dim_axes
               else "whole")
        lines.append(f"  {name}: {size} {how}")
    replicas = [f"{a}={n}" for a, n in sizes.items() if n > 1 and not any(a in d for d in axes)]
    spread = f"each block is on {held_by} device{'s' * (held_by != 1)}" + (
        f" (replicated over {' x '.join(replicas)})" if replicas else "")
    held = math.prod(per_device) * specs.itemsize(dtype)
    lines.append(f"each device holds {dtype}{diff.compact(per_device)} ({format_bytes(held)}); {spread}")
    split = [dim for dim in range(ndim) if axes[dim]]
    if not split:
        return "\n".join(lines)
    row_dim, col_dim = split[0], (split[1] if len(split) > 1 else None)
    if len(split) > 2:
        lines.append("each cell is further split over " + ", ".join(
            f"dim {d} ({pieces[d]} ways over {', '.join(axes[d])})" for d in split[2:]))
    columns = _shown(pieces[col_dim]) if col_dim is not None else [0]
    header = [f"dim {row_dim}" + (f" \\ dim {col_dim}" if col_dim is not None else "")]
    if col_dim is None:
        header.append("held by")
    else:
        header += ["..." if c is None else _block_range(c, shape[col_dim], pieces[col_dim]) for c in columns]
    rows = []
    for r in _shown(pieces[row_dim]):
        label = "..." if r is None else _block_range(r, shape[row_dim], pieces[row_dim])
        cells = []
        for c in columns:
            if r is None or c is None:
                cells.append("...")
                continue
            where = _coordinates(r, axes[row_dim], sizes)
            if col_dim is not None:
                where += _coordinates(c, axes[col_dim], sizes)
            cells.append("\n".join(where))
        rows.append([label, *cells])
    grid = tabulate(rows, headers=header, tablefmt="grid", disable_numparse=True)
    return "\n".join([*lines, "", grid])


def _unit(largest: int) -> tuple[str, int]:
    return next(((name, size) for name, size in UNITS if largest >= size), UNITS[-1])


BEFORE, AFTER = "#9e9e9e", "#1e88e5"  # the colours of the bars before (grey) and after (blue)


def _chart_groups(memory: Mapping[str, tuple[int | None, int | None]]) -> dict[str, tuple[int, int]] | None:
    """The parts to chart (params, opt_state, activations, any other; parts below 0.5% of the largest
    left out), in report order; None when nothing moved or a side has no byte counts."""
    values = {g: pair for g, pair in memory.items() if g != "total"}
    if not values or all(old == new for old, new in values.values()) or any(None in pair for pair in values.values()):
        return None
    largest = max(max(pair) for pair in values.values()) or 1  # type: ignore[type-var]
    return {g: pair for g, pair in values.items() if max(pair) >= largest / 200}  # type: ignore[misc]


def _label(part: str) -> str:
    """A part's name inside a mermaid label: no quote or line break to end it."""
    return " ".join(part.replace('"', "'").split())


def memory_svg(memory: Mapping[str, tuple[int | None, int | None]]) -> str | None:
    """The same figures as :func:`memory_chart`, as an inline SVG of horizontal bars from zero (before
    grey, after blue), each labelled with its size: for the HTML report, which needs no script to show
    it."""
    values = _chart_groups(memory)
    if values is None:
        return None
    largest = max(max(pair) for pair in values.values()) or 1
    row, label, bar = 22, 150, 300
    rows = [(f"{g} {side}", v, side) for g, pair in values.items() for side, v in zip(("before", "after"), pair)]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label + bar + 110}" height="{row * len(rows) + 4}" '
           f'role="img" aria-label="memory per device, before and after">']
    for i, (name, v, side) in enumerate(rows):
        y, width = i * row + 2, round(bar * v / largest)
        colour = BEFORE if side == "before" else AFTER
        out += [f'<text x="0" y="{y + 15}" font-size="13">{html.escape(name)}</text>',
                f'<rect x="{label}" y="{y + 3}" width="{width}" height="{row - 6}" fill="{colour}"/>',
                f'<text x="{label + width + 6}" y="{y + 15}" font-size="13">{format_bytes(v)}</text>']
    return "".join(out) + "</svg>"


def memory_chart(memory: Mapping[str, tuple[int | None, int | None]]) -> str | None:
    """A mermaid `xychart-beta` bar chart of memory per device per part (params, opt_state,
    activations, ...), a bar before (grey) and a bar after (blue) each, horizontal, on a value axis
    from 0 to the largest figure, each bar's label carrying its size (tests/commands/test_mermaid.py
    renders it with mermaid and measures the bars); None when nothing moved or a
    side has no byte counts. GitHub renders it in a comment; elsewhere it reads as a code block.

    The two colours are two bar series over the same labels, each 0 where the other has its bar
    (mermaid draws the bars of every series at the same place)."""
    values = _chart_groups(memory)
    if values is None:
        return None
    name, size = _unit(max(max(pair) for pair in values.values()))  # type: ignore[type-var]
    labels = ", ".join(f'"{_label(g)} {side} {format_bytes(v)}"' for g, pair in values.items()
                       for side, v in zip(("before", "after"), pair))
    figures = [f"{v / size:.2f}" for pair in values.values() for v in pair]
    before = ", ".join(f if i % 2 == 0 else "0" for i, f in enumerate(figures))
    after = ", ".join(f if i % 2 == 1 else "0" for i, f in enumerate(figures))
    top = math.ceil(max(max(pair) for pair in values.values()) / size * 100) / 100  # type: ignore[type-var]
    # No tick labels on the value axis: mermaid pads that axis by half a label's width and draws bars
    # from the plot's edge, which would add the padding to every bar (and show the 0 of the other
    # series as a stub); without them the bars start at the axis, at 0. The sizes are in the labels.
    init = ('{"xyChart": {"yAxis": {"showLabel": false, "showTick": false}}, '
            '"themeVariables": {"xyChart": {"plotColorPalette": "%s, %s"}}}' % (BEFORE, AFTER))
    return "\n".join(["```mermaid", f"%%{{init: {init}}}%%", "xychart-beta horizontal",
                      '    title "Memory per device, before (grey) and after (blue)"',
                      f"    x-axis [{labels}]", f'    y-axis "{name} per device, from 0" 0 --> {top:.2f}',
                      f"    bar [{before}]", f"    bar [{after}]", "```"])
