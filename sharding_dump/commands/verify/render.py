"""verify's report: one block per case (text or markdown) and the summary, or JSON."""

from __future__ import annotations

import json

from sharding_dump.golden.sizes import format_bytes
from sharding_dump.commands.verify.hlo import COLLECTIVES
from sharding_dump.commands.verify.result import CaseResult

MAX_LISTED = 10  # remats / replicated values / mismatches listed per case in text and markdown


def _memory_line(r: CaseResult) -> str:
    m = r.memory
    parts = [f"arguments {format_bytes(m['argument'])}", f"outputs {format_bytes(m['output'])}",
             f"aliased {format_bytes(m['alias'])}", f"temporaries {format_bytes(m['temp'])}",
             f"peak {format_bytes(r.peak_bytes)}"]
    if r.hbm_bytes is None:
        verdict = "no HBM limit for this topology"
    else:
        verdict = f"{'fits' if r.fits else 'does NOT fit'} {format_bytes(r.hbm_bytes)} HBM"
    where = "XLA:CPU estimate, not the chip's figure" if r.backend == "cpu" else "XLA:TPU, the real chip"
    return f"memory per device ({where}): {', '.join(parts)}; {verdict}"


def _collective_cells(r: CaseResult) -> list[list[str]]:
    return [[kind, str(r.collectives[kind].count), format_bytes(r.collectives[kind].bytes)]
            for kind in COLLECTIVES if kind in r.collectives]


def render_case(r: CaseResult, fmt: str = "text") -> str:
    """One case's block (text or markdown)."""
    from sharding_dump.commands import tables

    md = fmt == "markdown"
    wrap = tables.code if md else str
    bullet = "- " if md else "  "
    status = "FAILED" if r.failures else "ok"
    lines = [f"#### {r.label}: {status}" if md else f"{r.label}: {status} ({r.backend}, {r.devices} devices, "
             f"{r.cpu_seconds:.1f} s CPU, {format_bytes(r.peak_rss_bytes)} peak RSS)"]
    lines += [f"{bullet}FAIL {f}" for f in r.failures]
    if r.compile_error and not r.memory:
        return "\n".join(lines)
    for remat in r.remats[:MAX_LISTED]:
        kind = "remat, in a partitioner trial, not a failure" if remat.trial else "remat"
        lines.append(f"{bullet}[{kind}] {wrap(remat.op_name or remat.instruction)} {remat.shape}: "
                     f"{wrap(remat.from_sharding)} -> {wrap(remat.to_sharding)}")
    for value in r.replicated[:MAX_LISTED]:
        kind = "replicated" if value.where == "propagation" else "gathered"
        lines.append(f"{bullet}[{kind}] {wrap(value.op_name)} {value.shape} {format_bytes(value.bytes)}"
                     + (f" ({value.count} instructions)" if value.count > 1 else ""))
    for path, golden, compiled in r.mismatches[:MAX_LISTED]:
        lines.append(f"{bullet}[sharding] {wrap(path)}: golden {json.dumps(golden)}, compiled {json.dumps(compiled)}")
    for key, old, new in r.figures_changed[:MAX_LISTED]:
        lines.append(f"{bullet}[figures] {key}: recorded {old}, now {new}")
    listed = max(len(r.remats), len(r.replicated), len(r.mismatches), len(r.figures_changed))
    if listed > MAX_LISTED:
        lines.append(f"{bullet}... more than {MAX_LISTED} of a kind: --format json lists every one")
    if r.memory:
        lines.append(bullet + _memory_line(r))
    if r.figures_written:
        lines.append(f"{bullet}recorded figures in {r.figures_file}")
    cells = _collective_cells(r)
    if cells:
        lines.append("")
        table = tables.render(["collective per step", "count", "bytes/device"], cells, fmt, right=(1, 2))
        lines += table.splitlines() if md else ["    " + line for line in table.splitlines()]
    return "\n".join(lines)


def render(results: list[CaseResult], fmt: str) -> str:
    """The whole report: JSON (every case, every item), or a summary plus one block per case."""
    if fmt == "json":
        from sharding_dump.golden import codec

        doc = {"failed": any(r.failures for r in results), "cases": [r.to_json() for r in results]}
        return codec.canonical_bytes(doc).decode("utf-8")
    failed = [r for r in results if r.failures]
    title = f"sharding-dump verify: {len(failed)} of {len(results)} case{'s' * (len(results) != 1)} failed"
    blocks = [f"### {title}" if fmt == "markdown" else title] + [render_case(r, fmt) for r in results]
    return "\n\n".join(blocks) + "\n"
