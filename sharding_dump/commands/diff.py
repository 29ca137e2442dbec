"""`sharding-dump diff OLD NEW`: what a sharding change does, case by case, for a reviewer.

OLD and NEW are two case folders (say the same model under two rules) or two golden trees (say a
checkout of main and the working tree, paired by case folder). Every golden document is read and
schema-checked, then compared with :func:`sharding_dump.golden.diff.diff_documents`; this module only
gathers the findings per case and lays them out as text, GitHub markdown (ready to paste as a
pull-request comment, with a mermaid chart of memory per device before and after), a standalone HTML
page (a CI artifact, the chart as inline SVG) or JSON. Optimizer
slots that changed exactly like their parameter are folded under it, as in the pytest report.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from sharding_dump.commands import options, pictures, tables
from sharding_dump.core import specs
from sharding_dump.core.format import ACTIVATIONS_FILE, GOLDEN_FILE_NAMES, NAMED_FILE
from sharding_dump.errors import BadInput
from sharding_dump.golden import codec, diff, memory, sizes
from sharding_dump.golden.engine import display

LAYOUT_FIELDS = ("partition_spec", "per_device_shape", "per_device_bytes")  # shown as columns
CACHE_BYTES = "cache_bytes."  # a serving case's KV cache bytes (serving_steps.json), shown as their own line
MAX_ROWS = 100  # per case in text and markdown; JSON has every row
GITHUB_COMMENT_CHARS = 65_536  # the largest comment GitHub takes: markdown's default --max-chars


@dataclasses.dataclass
class Row:
    """One changed, added or removed tensor (with the optimizer slots folded under it)."""

    tensor: str
    slots: list[str]
    old_spec: Any
    new_spec: Any
    old_bytes: int | None
    new_bytes: int | None
    other: dict[str, tuple[Any, Any]]  # "file: field" -> (old, new), fields beyond the layout columns
    status: str  # changed | added | removed


@dataclasses.dataclass
class CaseReport:
    """The comparison of one case folder pair; `old`/`new` is None for a case on one side only."""

    label: str
    old: Path | None
    new: Path | None
    counts: dict[str, int]
    header: dict[str, tuple[Any, Any]]
    memory: dict[str, tuple[int | None, int | None]]  # per-device bytes per state group
    rows: list[Row]
    files_only: dict[str, str]  # golden file present on one side only -> "old" | "new"
    mesh_sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # of the new side (else the old)

    @property
    def status(self) -> str:
        if self.old is None:
            return "added"
        if self.new is None:
            return "removed"
        changed = any(self.counts.values()) or self.header or self.files_only
        return "changed" if changed else "identical"


def _golden_files(folder: Path) -> list[str]:
    # Anything under a golden file's name counts: a folder or FIFO there is refused when read.
    return [name for name in GOLDEN_FILE_NAMES if os.path.lexists(folder / name)]


def case_folders(root: Path) -> dict[str, Path]:
    """Every case folder (a folder holding golden files) under `root`, by relative path."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_dir() and _golden_files(path):
            found[path.relative_to(root).as_posix()] = path
    return found


def _pairs(old: Path, new: Path) -> list[tuple[str, Path | None, Path | None]]:
    for side, path in (("OLD", old), ("NEW", new)):
        if not path.is_dir():
            raise BadInput(f"{side} {path}: not a folder (give two case folders or two golden trees)")
    old_is_case, new_is_case = bool(_golden_files(old)), bool(_golden_files(new))
    if old_is_case and new_is_case:
        return [(f"{display(old)} -> {display(new)}", old, new)]
    if old_is_case != new_is_case:
        case_side, tree_side = ("OLD", "NEW") if old_is_case else ("NEW", "OLD")
        raise BadInput(f"{case_side} is a case folder but {tree_side} is not: give two case folders "
                       f"(holding {NAMED_FILE}) or two golden trees")
    old_cases, new_cases = case_folders(old), case_folders(new)
    if not old_cases and not new_cases:
        raise BadInput(f"no golden files under {old} or {new}: give two case folders or two golden trees")
    return [(label, old_cases.get(label), new_cases.get(label)) for label in sorted({*old_cases, *new_cases})]


def upgrade_named(doc: dict[str, Any]) -> dict[str, Any]:
    """A named document of format 1 (no byte counts) as format 2 would hold it, so comparing goldens
    from before and after the format change shows sharding changes only."""
    if doc.get("kind") != "named" or doc.get("format_version") != 1:
        return doc
    tensors = {path: {**entry, "per_device_bytes": math.prod(entry["per_device_shape"])
                      * specs.itemsize(entry["dtype"])} for path, entry in doc["tensors"].items()}
    totals: dict[str, int] = {}
    for path, entry in tensors.items():
        group = path.split("/", 1)[0]
        totals[group] = totals.get(group, 0) + entry["per_device_bytes"]
    totals["total"] = sum(totals.values())
    return {**doc, "format_version": 2, "per_device_bytes": dict(sorted(totals.items())), "tensors": tensors}


def _read(folder: Path | None) -> dict[str, dict[str, Any]]:
    if folder is None:
        return {}
    return {name: upgrade_named(codec.read_document(folder / name)) for name in _golden_files(folder)}


def compare_case(label: str, old: Path | None, new: Path | None) -> CaseReport:
    """Compares every golden document of one case folder pair."""
    old_docs, new_docs = _read(old), _read(new)
    files_only = {}
    if old is not None and new is not None:
        files_only = {name: ("old" if name in old_docs else "new") for name in set(old_docs) ^ set(new_docs)}
    changes: dict[str, dict[str, tuple[Any, Any]]] = {}  # tensor -> {"file: field": (old, new)}
    status: dict[str, str] = {}
    header: dict[str, tuple[Any, Any]] = {}
    for name in sorted(set(old_docs) | set(new_docs)):
        if name in files_only:
            continue
        if name in old_docs and name in new_docs and old_docs[name] == new_docs[name]:
            continue  # equal documents: nothing to find
        empty = {"tensors": {}}
        found = diff.diff_documents(old_docs.get(name, empty), new_docs.get(name, empty))
        for key, value in found.header.items():
            if not key.startswith("per_device_bytes"):  # shown as the memory line instead
                header.setdefault(key, value)
        for kind, entries in (("added", found.added), ("removed", found.removed)):
            for tensor, entry in entries.items():
                status[tensor] = kind
                changes.setdefault(tensor, {})[f"{name}: (entry)"] = (None, entry) if kind == "added" else (entry, None)
        for tensor, fields in found.changed.items():
            status.setdefault(tensor, "changed")
            for field, values in fields.items():
                changes.setdefault(tensor, {})[f"{name}: {field}"] = values
    rows = []
    for tensor, (fields, slots) in diff.fold_slots(changes).items():
        old_entry, new_entry = (_entry(docs, tensor) for docs in (old_docs, new_docs))
        other = {key: values for key, values in fields.items()
                 if key.split(": ", 1)[1] not in LAYOUT_FIELDS + ("(entry)",)}
        rows.append(Row(tensor, slots, (old_entry or {}).get("partition_spec"), (new_entry or {}).get("partition_spec"),
                        memory.entry_bytes(old_entry), memory.entry_bytes(new_entry), other, status[tensor]))
    rows.sort(key=lambda r: (not r.tensor.startswith("params/"), r.tensor))
    counts = {kind: sum(1 for s in status.values() if s == kind) for kind in ("changed", "added", "removed")}
    mesh = next((d["mesh"] for docs in (new_docs, old_docs) for d in docs.values() if "mesh" in d), {})
    return CaseReport(label, old, new, counts, header, memory.compare(old_docs, new_docs), rows, files_only,
                      dict(zip(mesh.get("axis_names", ()), mesh.get("axis_sizes", ()))))


def _entry(docs: dict[str, dict[str, Any]], tensor: str) -> dict[str, Any] | None:
    """A tensor's layout entry: from the named document, else (an activation) the activations'."""
    for name in (NAMED_FILE, ACTIVATIONS_FILE):
        entry = docs.get(name, {}).get("tensors", {}).get(tensor)
        if entry is not None:
            return entry
    return None


def compare(old: str | Path, new: str | Path) -> list[CaseReport]:
    """Compares two case folders or two golden trees; BadInput on anything that is neither."""
    return [compare_case(label, o, n) for label, o, n in _pairs(Path(old), Path(new))]


# --- rendering -------------------------------------------------------------------------------------

def _spec(spec: Any, mesh_sizes: dict[str, int] | None) -> str:
    """A spec as the report writes it: without mesh axes of size 1 unless `mesh_sizes` is None."""
    if spec is None:
        return "-"
    if mesh_sizes:
        return diff.compact(specs.spec_to_json(spec, len(spec), mesh_sizes))
    return diff.compact(spec)


def _counts_line(report: CaseReport) -> str:
    c = report.counts
    return f"{c['changed']} tensors changed, {c['added']} added, {c['removed']} removed"


def _memory_cell(old: int | None, new: int | None) -> str:
    """`3.1 GiB -> 24.2 GiB (+21.1 GiB, +673%)`, or one size when it did not move."""
    if old == new:
        return sizes.format_bytes(old)
    change = f"{sizes.format_delta(old, new)}, {sizes.format_percent(old, new)}"
    return f"{sizes.format_bytes(old)} -> {sizes.format_bytes(new)} ({change})"


def _cache_changes(report: CaseReport) -> list[str]:
    """A serving case's KV cache bytes (serving_steps.json's cache_bytes) that changed, in bytes."""
    return [f"{key.removeprefix(CACHE_BYTES).replace('_', ' ')} {_memory_cell(old, new)}"
            for key, (old, new) in sorted(report.header.items()) if key.startswith(CACHE_BYTES)]


def _part(part: str, fmt: str) -> str:
    """A part's name in a table: a name of the user's own state (any text) as code in markdown."""
    return part if fmt != "markdown" or re.fullmatch(r"[\w.-]+", part) else tables.code(part)


def _summary_parts(reports: list[CaseReport]) -> list[str]:
    """The parts the summary table has a column for: params, opt_state and activations, and any other
    part that moved in a differing case."""
    found = {part for r in reports for part in r.memory}
    moved = {part for r in reports for part, (o, n) in r.memory.items() if o != n}
    return memory.ordered(p for p in found if p in memory.ORDER or p in moved)


@dataclasses.dataclass
class Line:
    """One line of a case's tensor table: a tensor, or repeated layers changed alike (`members`)."""

    row: Row
    name: str
    members: int


def _lines(report: CaseReport, full: bool) -> list[Line]:
    """The tensor table's lines: repeated layers that changed alike grouped into one
    (`layers_0..31/...`), unless `full` (every tensor by its own name)."""
    if full:
        return [Line(row, row.tensor, 1) for row in report.rows]
    by_name = {row.tensor: row for row in report.rows}
    def key(name: str) -> str:
        row = by_name[name]
        return diff.compact([row.slots, row.old_spec, row.new_spec, row.old_bytes, row.new_bytes,
                             sorted(row.other.items()), row.status])
    return [Line(by_name[members[0]], shown, len(members))
            for shown, members in diff.group_layers([row.tensor for row in report.rows], key)]


def _row_cells(line: Line, fmt: str, mesh_sizes: dict[str, int] | None) -> list[str]:
    row = line.row
    wrap = tables.code if fmt == "markdown" else str
    notes = [f"{line.members} tensors"] * (line.members > 1) + [f"and {', '.join(row.slots)}"] * bool(row.slots)
    name = wrap(line.name) + (f" ({', '.join(notes)})" if notes else "")
    other = "; ".join(f"{key} {diff.compact(old)} -> {diff.compact(new)}" for key, (old, new) in sorted(row.other.items()))
    if row.status != "changed":
        other = row.status + (f"; {other}" if other else "")
    old_spec, new_spec = _spec(row.old_spec, mesh_sizes), _spec(row.new_spec, mesh_sizes)
    if old_spec == new_spec and row.old_spec != row.new_spec:  # the change is in a size-1 axis: show it
        old_spec, new_spec = _spec(row.old_spec, None), _spec(row.new_spec, None)
    return [name, wrap(old_spec), wrap(new_spec), sizes.format_bytes(row.old_bytes), sizes.format_bytes(row.new_bytes),
            other]


TENSOR_HEADERS = ["tensor", "old spec", "new spec", "old bytes/device", "new bytes/device", "also changed"]
MEMORY_HEADERS = ["memory per device", "before", "after", "change"]


def _tensor_table(report: CaseReport, fmt: str, max_rows: int | None,
                  full: bool) -> tuple[list[str], list[list[str]], int]:
    """Headers, cells and how many tensors were left out (beyond `max_rows` lines)."""
    lines = _lines(report, full)
    shown = lines if max_rows is None else lines[:max_rows]
    cells = [_row_cells(line, fmt, None if full else report.mesh_sizes) for line in shown]
    headers = TENSOR_HEADERS
    if not any(c[-1] for c in cells):
        headers, cells = headers[:-1], [c[:-1] for c in cells]
    return headers, cells, sum(line.members for line in lines[len(shown):])


def _notes(report: CaseReport) -> list[str]:
    """Header fields that changed and golden files on one side only, one line each."""
    header = sorted((key, change) for key, change in report.header.items() if not key.startswith(CACHE_BYTES))
    return ([f"header {key}: {diff.compact(old)} -> {diff.compact(new)}" for key, (old, new) in header]
            + [f"{name} only in {side.upper()}" for name, side in sorted(report.files_only.items())])


def _case_block(report: CaseReport, fmt: str, max_rows: int | None = MAX_ROWS, full: bool = False) -> Iterator[str]:
    heading = f"#### {report.label}" if fmt == "markdown" else f"== {report.label}"
    yield heading
    bullet = "- " if fmt == "markdown" else ""  # markdown joins plain lines into one paragraph
    if report.status in ("added", "removed"):
        where = report.new if report.status == "added" else report.old
        yield f"{bullet}case {report.status} ({display(where)})"
        return
    yield bullet + _counts_line(report)
    if report.memory:  # memory per device first, every part, before and after
        yield ""
        rows = [[_part(row[0], fmt), *row[1:]] for row in memory.rows(report.memory)]
        yield tables.render(MEMORY_HEADERS, rows, fmt, right=(1, 2, 3))
    cache = _cache_changes(report)
    if cache:
        yield ""
        yield f"{bullet}KV cache: " + ", ".join(cache)
    chart = pictures.memory_chart(report.memory) if fmt == "markdown" else None
    if chart:
        yield ""
        yield chart
    extra = _notes(report)
    if extra:
        yield ""
        yield from (bullet + line for line in extra)
    if report.rows:
        headers, cells, left = _tensor_table(report, fmt, max_rows, full)
        yield ""
        yield tables.render(headers, cells, fmt, right=(3, 4))
        if left:
            yield f"... and {left} more tensors (--full lists every one, --format json too)"


def _summary(reports: list[CaseReport], fmt: str) -> Iterator[str]:
    differ = [r for r in reports if r.status != "identical"]
    title = (f"sharding-dump diff: {len(differ)} of {len(reports)} "
             f"{'case differs' if len(reports) == 1 else 'cases differ'}")
    yield f"### {title}" if fmt == "markdown" else title
    if differ:  # memory per device of every differing case first, every part before and after
        parts = _summary_parts(differ)
        cells = []
        for r in differ:
            c = r.counts
            cells.append([tables.code(r.label) if fmt == "markdown" else r.label, r.status,
                          *(_memory_cell(*r.memory.get(p, (None, None))) for p in parts),
                          str(c["changed"]), str(c["added"]), str(c["removed"])])
        yield ""
        headers = ["case", "status", *(f"{_part(p, fmt)}/device" for p in parts), "changed", "added", "removed"]
        yield tables.render(headers, cells, fmt, right=tuple(range(2, len(parts) + 5)))


def render_text(reports: list[CaseReport], fmt: str = "text", max_chars: int | None = None, full: bool = False) -> str:
    """The report for a terminal (`text`) or a pull-request comment (`markdown`). With `max_chars`,
    the summary table is always kept and the case blocks (folded under `<details>` in markdown) are
    cut to fit, ending with a line saying what was left out. `full`: every tensor by its name, specs
    with every mesh axis, no row limit."""
    summary = "\n".join(_summary(reports, fmt))
    differ = [r for r in reports if r.status != "identical"]
    limit = None if full else MAX_ROWS
    blocks = [_folded(r, fmt, limit, first=i == 0, full=full) for i, r in enumerate(differ)]
    text = "\n\n".join([summary, *blocks]) + "\n"
    if max_chars is None or len(text) <= max_chars:
        return text
    kept, partial = [summary], False
    for i, (r, block) in enumerate(zip(differ, blocks)):
        closing = _cut_line(len(differ) - len(kept) + 1, len(text), partial=True)  # longest it can be
        budget = max_chars - len("\n\n".join(kept)) - len(closing) - 5
        total = len(_lines(r, full))
        rows = total if limit is None else min(total, limit)
        while len(block) > budget and rows > 1:  # fewer table rows until the block fits
            rows = max(1, min(rows - 1, rows * budget // len(block)))
            block = _folded(r, fmt, rows, first=i == 0, full=full)
        if len(block) > budget:
            break
        kept.append(block)
        if rows < (total if limit is None else min(total, limit)):
            partial = True
            break
    shown = len(kept) - 1
    cut = len(text) - len("\n\n".join(kept))
    kept.append(_cut_line(len(differ) - shown, cut, partial))
    return "\n\n".join(kept) + "\n"


def _cut_line(cases_left: int, chars: int, partial: bool = False) -> str:
    """The closing line of a report cut to fit."""
    what = f"{cases_left} more case{'' if cases_left == 1 else 's'} not shown" if cases_left else "rows cut"
    if partial:
        what = "the last case shown is cut" + (f"; {what}" if cases_left else "")
    return (f"... {what} ({chars:,} characters left out to fit the size limit; "
            f"`sharding-dump diff OLD NEW --format json` lists everything)")


def _folded(report: CaseReport, fmt: str, max_rows: int | None, first: bool = False, full: bool = False) -> str:
    """One case's block; in markdown, folded under `<details>` (the first one open) with its counts
    as the summary line."""
    lines = list(_case_block(report, fmt, max_rows, full))
    if fmt != "markdown":
        return "\n".join(lines)
    label = lines[0].removeprefix("#### ")
    head = _counts_line(report) if report.status == "changed" else f"case {report.status}"
    lines = [line for line in lines if line != f"- {head}"]  # said in the summary line already
    opening = "<details open>" if first else "<details>"
    return "\n".join([f"{opening}<summary><code>{label}</code>: {head}</summary>", "", *lines[1:], "", "</details>"])


def render_json(reports: list[CaseReport]) -> str:
    """Every case (identical ones too) and every row, as canonical JSON."""
    def side(path: Path | None) -> str | None:
        return None if path is None else display(path)

    doc = {
        "differs": any(r.status != "identical" for r in reports),
        "cases": [{
            "case": r.label, "old": side(r.old), "new": side(r.new), "status": r.status, "counts": r.counts,
            "header": {k: list(v) for k, v in r.header.items()},
            "per_device_bytes": {g: {"old": o, "new": n} for g, (o, n) in r.memory.items()},
            "files_only": r.files_only,
            "tensors": [{"tensor": row.tensor, "slots": row.slots, "status": row.status,
                         "old_spec": row.old_spec, "new_spec": row.new_spec,
                         "old_per_device_bytes": row.old_bytes, "new_per_device_bytes": row.new_bytes,
                         "other": {k: list(v) for k, v in row.other.items()}} for row in r.rows],
        } for r in reports],
    }
    return codec.canonical_bytes(doc).decode("utf-8")


HTML_STYLE = """body{font-family:sans-serif;margin:1.5em auto;max-width:1360px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0;width:100%;table-layout:auto}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.n{text-align:right;white-space:nowrap}
td.up{background:#fde2e1}td.down{background:#dff3e2}td.chg{background:#fff3c4}
code{font-size:90%;white-space:pre-wrap;overflow-wrap:anywhere}summary{cursor:pointer;margin:.8em 0}
svg{max-width:100%;height:auto}"""


def _td(text: str, cls: str = "", code: bool = False) -> str:
    body = f"<code>{html.escape(text)}</code>" if code else html.escape(text)
    return f'<td class="{cls}">{body}</td>' if cls else f"<td>{body}</td>"


def _moved(old: int | None, new: int | None) -> str:
    """The class of a memory cell: `up` grew, `down` shrank, `` did not move."""
    if old is None or new is None or old == new:
        return ""
    return "up" if new > old else "down"


def _html_table(headers: list[str], rows: list[str]) -> str:
    return ("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>"
            + "".join(f"<tr>{row}</tr>" for row in rows) + "</table>")


def render_html(reports: list[CaseReport], full: bool = False) -> str:
    """A standalone HTML page (no script, no external file): the summary table, then per differing
    case its memory per device and chart (inline SVG) and every changed tensor, in a fold of its own,
    as tables whose changed cells are coloured (memory grown red, shrunk green, a new spec yellow),
    laid out to the window's width. Never cut."""
    differ = [r for r in reports if r.status != "identical"]
    title = next(_summary(reports, "text"))
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{html.escape(title)}</title>", f"<style>{HTML_STYLE}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    if differ:
        columns = _summary_parts(differ)
        rows = []
        for r in differ:
            mem = [r.memory.get(p, (None, None)) for p in columns]
            rows.append(_td(r.label, code=True) + _td(r.status)
                        + "".join(_td(_memory_cell(o, n), f"n {_moved(o, n)}".strip()) for o, n in mem)
                        + "".join(_td(str(r.counts[k]), "n") for k in ("changed", "added", "removed")))
        headers = ["case", "status", *(f"{p}/device" for p in columns), "changed", "added", "removed"]
        parts.append(_html_table(headers, rows))
    for i, r in enumerate(differ):
        head = _counts_line(r) if r.status == "changed" else "case " + r.status
        parts.append(f"<details{' open' * (i == 0)}><summary><code>{html.escape(r.label)}</code>: "
                     f"{html.escape(head)}</summary>")
        if r.status in ("added", "removed"):
            where = display(r.new if r.status == "added" else r.old)
            parts.append(f"<p>case {r.status} ({html.escape(where)})</p></details>")
            continue
        if r.memory:
            parts.append(_html_table(MEMORY_HEADERS, [
                _td(part) + _td(sizes.format_bytes(o), "n") + _td(sizes.format_bytes(n), f"n {_moved(o, n)}".strip())
                + _td(sizes.format_change(o, n), f"n {_moved(o, n)}".strip()) for part, (o, n) in r.memory.items()]))
        svg = pictures.memory_svg(r.memory)
        if svg:
            parts.append(f"<p>{svg}</p>")
        parts += [f"<p>{html.escape(line)}</p>" for line in _notes(r)]
        if r.rows:
            headers, cells, _ = _tensor_table(r, "text", None, full)
            rows = []
            for cell in cells:
                changed_spec, changed_bytes = cell[1] != cell[2], cell[3] != cell[4]
                row = _td(cell[0], code=True) + _td(cell[1], code=True) + _td(cell[2], "chg" * changed_spec, code=True)
                row += _td(cell[3], "n") + _td(cell[4], "n chg" if changed_bytes else "n")
                row += "".join(_td(c, "chg") for c in cell[5:])
                rows.append(row)
            parts.append(_html_table(headers, rows))
        parts.append("</details>")
    return "\n".join(parts + ["</body></html>"]) + "\n"


def render(reports: list[CaseReport], fmt: str, max_chars: int | None = None, full: bool = False) -> str:
    """The report in one of options.REPORT_FORMATS or html (`max_chars`: see :func:`render_text`; JSON
    and HTML are never cut; `full`: every tensor by its own name, specs with every mesh axis)."""
    if fmt == "html":
        return render_html(reports, full)
    return render_json(reports) if fmt == "json" else render_text(reports, fmt, max_chars, full)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", metavar="OLD", help="case folder or golden tree before the change")
    parser.add_argument("new", metavar="NEW", help="case folder or golden tree after the change")
    options.add_format_option(parser, html=True)
    parser.add_argument("--max-chars", type=int, metavar="N",
                        help=f"cut the text or markdown report to N characters, keeping the summary table "
                             f"(markdown default: {GITHUB_COMMENT_CHARS:,}, what a GitHub comment takes)")
    parser.add_argument("--full", action="store_true",
                        help=f"every changed tensor on a line of its own (by default repeated layers that changed "
                             f"alike are one line, layers_0..31, and a case shows {MAX_ROWS} lines), specs with "
                             f"the mesh axes of size 1 too")
    parser.add_argument("--fail-on-growth", action="append", default=[], metavar="PART:LIMIT",
                        help="exit 1 when memory per device of PART (params, opt_state, activations, another part of "
                             "the state, or * for each) grows by more than LIMIT (10%% or a size such as 256MiB) in "
                             "any case, else 0, however the layouts differ; repeatable")


def run(args: argparse.Namespace) -> int:
    """Exit 1 when anything differs, 0 when nothing does; with --fail-on-growth, 1 when memory grew
    beyond a threshold (each such growth also on stderr), else 0."""
    if args.max_chars is not None and (args.format in ("json", "html") or args.max_chars < 1000):
        raise BadInput(f"--max-chars {args.max_chars}: takes a number >= 1000, with --format text or markdown")
    thresholds = [memory.parse_threshold(text) for text in args.fail_on_growth]
    limit = args.max_chars
    if limit is None and args.format == "markdown":
        limit = GITHUB_COMMENT_CHARS
    reports = compare(args.old, args.new)
    parts = {part for r in reports for part in r.memory}
    for text, (part, _, _) in zip(args.fail_on_growth, thresholds):
        if part != "*" and part not in parts:
            raise BadInput(f"--fail-on-growth {text!r}: no part {part!r} in these goldens "
                           f"(parts: {', '.join(memory.ordered(parts)) or 'none'}, or * for each)")
    sys.stdout.write(render(reports, args.format, limit, args.full))
    if not thresholds:
        return 1 if any(r.status != "identical" for r in reports) else 0
    grown = [f"{r.label}: {what}" for r in reports for t in thresholds for what in memory.exceeded(r.memory, t)]
    for line in grown:
        sys.stderr.write(f"sharding-dump diff: memory per device grew beyond --fail-on-growth: {line}\n")
    return 1 if grown else 0
