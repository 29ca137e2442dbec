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
import sys
from pathlib import Path
from typing import Any, Iterator

from sharding_dump.commands import options, pictures, tables
from sharding_dump.core import specs
from sharding_dump.core.format import ACTIVATIONS_FILE, GOLDEN_FILE_NAMES, NAMED_FILE
from sharding_dump.errors import BadInput
from sharding_dump.golden import codec, diff
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


def tensor_bytes(entry: dict[str, Any] | None) -> int | None:
    """Bytes one device holds of a tensor; for an activation (no byte count recorded), from its
    per-device shape and dtype."""
    if entry is None:
        return None
    if "per_device_bytes" in entry:
        return entry["per_device_bytes"]
    return math.prod(entry["per_device_shape"]) * specs.itemsize(entry["dtype"])


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
    old_named, new_named = old_docs.get(NAMED_FILE), new_docs.get(NAMED_FILE)
    rows = []
    for tensor, (fields, slots) in diff.fold_slots(changes).items():
        old_entry, new_entry = (_entry(docs, tensor) for docs in (old_docs, new_docs))
        other = {key: values for key, values in fields.items()
                 if key.split(": ", 1)[1] not in LAYOUT_FIELDS + ("(entry)",)}
        rows.append(Row(tensor, slots, (old_entry or {}).get("partition_spec"), (new_entry or {}).get("partition_spec"),
                        tensor_bytes(old_entry), tensor_bytes(new_entry), other, status[tensor]))
    rows.sort(key=lambda r: (not r.tensor.startswith("params/"), r.tensor))
    counts = {kind: sum(1 for s in status.values() if s == kind) for kind in ("changed", "added", "removed")}
    old_mem = (old_named or {}).get("per_device_bytes", {})
    new_mem = (new_named or {}).get("per_device_bytes", {})
    memory = {group: (old_mem.get(group), new_mem.get(group)) for group in sorted({*old_mem, *new_mem})}
    return CaseReport(label, old, new, counts, header, memory, rows, files_only)


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

def _spec(spec: Any) -> str:
    return "-" if spec is None else diff.compact(spec)


def _counts_line(report: CaseReport) -> str:
    c = report.counts
    return f"{c['changed']} tensors changed, {c['added']} added, {c['removed']} removed"


def _memory_changes(report: CaseReport) -> list[str]:
    """Each part of the state whose bytes per device changed (params and opt_state, or a server's
    weights and cache), then the total."""
    first = ("params", "opt_state")
    groups = sorted(report.memory, key=lambda g: (g == "total", first.index(g) if g in first else len(first), g))
    return [f"{group} {tables.format_bytes(old)} -> {tables.format_bytes(new)} ({tables.format_delta(old, new)})"
            for group in groups for old, new in [report.memory[group]] if old != new]


def _cache_changes(report: CaseReport) -> list[str]:
    """A serving case's KV cache bytes (serving_steps.json's cache_bytes) that changed, in bytes."""
    return [f"{key.removeprefix(CACHE_BYTES).replace('_', ' ')} {tables.format_bytes(old)} -> "
            f"{tables.format_bytes(new)} ({tables.format_delta(old, new)})"
            for key, (old, new) in sorted(report.header.items()) if key.startswith(CACHE_BYTES)]


def _row_cells(row: Row, fmt: str) -> list[str]:
    wrap = tables.code if fmt == "markdown" else str
    name = wrap(row.tensor) + (f" (and {', '.join(row.slots)})" if row.slots else "")
    other = "; ".join(f"{key} {diff.compact(old)} -> {diff.compact(new)}" for key, (old, new) in sorted(row.other.items()))
    if row.status != "changed":
        other = row.status + (f"; {other}" if other else "")
    return [name, wrap(_spec(row.old_spec)), wrap(_spec(row.new_spec)),
            tables.format_bytes(row.old_bytes), tables.format_bytes(row.new_bytes), other]


def _case_block(report: CaseReport, fmt: str, max_rows: int = MAX_ROWS) -> Iterator[str]:
    heading = f"#### {report.label}" if fmt == "markdown" else f"== {report.label}"
    yield heading
    bullet = "- " if fmt == "markdown" else ""  # markdown joins plain lines into one paragraph
    if report.status in ("added", "removed"):
        where = report.new if report.status == "added" else report.old
        yield f"{bullet}case {report.status} ({display(where)})"
        return
    yield bullet + _counts_line(report)
    memory = _memory_changes(report)
    if memory:
        yield f"{bullet}memory per device: " + ", ".join(memory)
    cache = _cache_changes(report)
    if cache:
        yield f"{bullet}KV cache: " + ", ".join(cache)
    for key, (old, new) in sorted(report.header.items()):
        if not key.startswith(CACHE_BYTES):
            yield f"{bullet or '  '}header {key}: {diff.compact(old)} -> {diff.compact(new)}"
    for name, side in sorted(report.files_only.items()):
        yield f"{bullet or '  '}{name} only in {side.upper()}"
    chart = pictures.memory_chart(report.memory) if fmt == "markdown" else None
    if chart:
        yield ""
        yield chart
    if report.rows:
        shown = report.rows[:max_rows]
        headers = ["tensor", "old spec", "new spec", "old bytes/device", "new bytes/device", "also changed"]
        cells = [_row_cells(row, fmt) for row in shown]
        if not any(c[-1] for c in cells):
            headers, cells = headers[:-1], [c[:-1] for c in cells]
        yield ""
        yield tables.render(headers, cells, fmt, right=(3, 4))
        if len(report.rows) > len(shown):
            yield f"... and {len(report.rows) - len(shown)} more tensors (--format json lists every one)"


def _summary(reports: list[CaseReport], fmt: str) -> Iterator[str]:
    differ = [r for r in reports if r.status != "identical"]
    title = (f"sharding-dump diff: {len(differ)} of {len(reports)} "
             f"{'case differs' if len(reports) == 1 else 'cases differ'}")
    yield f"### {title}" if fmt == "markdown" else title
    if len(reports) > 1 and differ:
        cells = []
        for r in differ:
            c = r.counts
            mem = {g: r.memory.get(g, (None, None)) for g in ("params", "opt_state")}
            cells.append([tables.code(r.label) if fmt == "markdown" else r.label, r.status,
                          str(c["changed"]), str(c["added"]), str(c["removed"]),
                          *(f"{tables.format_bytes(o)} -> {tables.format_bytes(n)}" for o, n in mem.values())])
        yield ""
        yield tables.render(["case", "status", "changed", "added", "removed", "params/device", "opt_state/device"],
                            cells, fmt, right=(2, 3, 4, 5, 6))


def render_text(reports: list[CaseReport], fmt: str = "text", max_chars: int | None = None) -> str:
    """The report for a terminal (`text`) or a pull-request comment (`markdown`). With `max_chars`,
    the summary table is always kept and the case blocks (folded under `<details>` in markdown) are
    cut to fit, ending with a line saying what was left out."""
    summary = "\n".join(_summary(reports, fmt))
    differ = [r for r in reports if r.status != "identical"]
    blocks = [_folded(r, fmt, MAX_ROWS, first=i == 0) for i, r in enumerate(differ)]
    text = "\n\n".join([summary, *blocks]) + "\n"
    if max_chars is None or len(text) <= max_chars:
        return text
    kept, partial = [summary], False
    for i, (r, block) in enumerate(zip(differ, blocks)):
        closing = _cut_line(len(differ) - len(kept) + 1, len(text), partial=True)  # longest it can be
        budget = max_chars - len("\n\n".join(kept)) - len(closing) - 5
        rows = min(len(r.rows), MAX_ROWS)
        while len(block) > budget and rows > 1:  # fewer table rows until the block fits
            rows = max(1, min(rows - 1, rows * budget // len(block)))
            block = _folded(r, fmt, rows, first=i == 0)
        if len(block) > budget:
            break
        kept.append(block)
        if rows < min(len(r.rows), MAX_ROWS):
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


def _folded(report: CaseReport, fmt: str, max_rows: int, first: bool = False) -> str:
    """One case's block; in markdown, folded under `<details>` (the first one open) with its counts
    as the summary line."""
    lines = list(_case_block(report, fmt, max_rows))
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


def render_html(reports: list[CaseReport]) -> str:
    """A standalone HTML page (no script, no external file): the summary table, then per differing
    case its memory chart (inline SVG) and every row, in a fold of its own. Never cut."""
    esc = html.escape
    differ = [r for r in reports if r.status != "identical"]
    title = next(_summary(reports, "text"))
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{esc(title)}</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}td.n{text-align:right}"
             "code{font-size:90%}</style></head><body>", f"<h1>{esc(title)}</h1>"]
    if differ:
        parts.append("<table><tr><th>case</th><th>status</th><th>changed</th><th>added</th><th>removed</th>"
                     "<th>params/device</th><th>opt_state/device</th></tr>")
        for r in differ:
            mem = [r.memory.get(g, (None, None)) for g in ("params", "opt_state")]
            cells = [f"<td><code>{esc(r.label)}</code></td><td>{r.status}</td>",
                     *(f'<td class="n">{r.counts[k]}</td>' for k in ("changed", "added", "removed")),
                     *(f'<td class="n">{tables.format_bytes(o)} &rarr; {tables.format_bytes(n)}</td>' for o, n in mem)]
            parts.append("<tr>" + "".join(cells) + "</tr>")
        parts.append("</table>")
    for i, r in enumerate(differ):
        lines = list(_case_block(r, "text", max_rows=len(r.rows)))
        parts.append(f"<details{' open' * (i == 0)}><summary><code>{esc(r.label)}</code>: "
                     f"{esc(_counts_line(r) if r.status == 'changed' else 'case ' + r.status)}</summary>")
        svg = pictures.memory_svg(r.memory)
        if svg:
            parts.append(f"<p>{svg}</p>")
        parts.append(f"<pre>{esc(chr(10).join(lines[1:]))}</pre></details>")
    return "\n".join(parts + ["</body></html>"]) + "\n"


def render(reports: list[CaseReport], fmt: str, max_chars: int | None = None) -> str:
    """The report in one of options.REPORT_FORMATS or html (`max_chars`: see :func:`render_text`; JSON
    and HTML are never cut)."""
    if fmt == "html":
        return render_html(reports)
    return render_json(reports) if fmt == "json" else render_text(reports, fmt, max_chars)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", metavar="OLD", help="case folder or golden tree before the change")
    parser.add_argument("new", metavar="NEW", help="case folder or golden tree after the change")
    options.add_format_option(parser, html=True)
    parser.add_argument("--max-chars", type=int, metavar="N",
                        help=f"cut the text or markdown report to N characters, keeping the summary table "
                             f"(markdown default: {GITHUB_COMMENT_CHARS:,}, what a GitHub comment takes)")


def run(args: argparse.Namespace) -> int:
    """Exit 1 when anything differs, 0 when nothing does."""
    if args.max_chars is not None and (args.format in ("json", "html") or args.max_chars < 1000):
        raise BadInput(f"--max-chars {args.max_chars}: takes a number >= 1000, with --format text or markdown")
    limit = args.max_chars
    if limit is None and args.format == "markdown":
        limit = GITHUB_COMMENT_CHARS
    reports = compare(args.old, args.new)
    sys.stdout.write(render(reports, args.format, limit))
    return 1 if any(r.status != "identical" for r in reports) else 0
