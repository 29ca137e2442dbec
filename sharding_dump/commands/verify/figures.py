"""`--record`: a case's compiled figures kept beside its golden, and compared on later runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from sharding_dump.commands.verify.result import CaseResult
from sharding_dump.commands.verify.settings import Options
from sharding_dump.errors import BadInput
from sharding_dump.golden import store

FIGURES_PREFIX = "compiled_"


def figures_path(case: Any, root: Path, backend: str, jax_version: str) -> Path:
    """Where --record keeps a case's compiled figures: beside its golden, keyed by backend and jax."""
    from sharding_dump.zoo.case import golden_dir

    return golden_dir(case, root) / f"{FIGURES_PREFIX}{backend}_jax-{jax_version}.json"


def _flat(doc: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(doc, dict):
        for key in sorted(doc):
            yield from _flat(doc[key], f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, doc


def compare_figures(case: Any, options: Options, result: CaseResult) -> None:
    """Compares with (or, under --record, writes) the figures recorded for this backend and jax version."""
    from sharding_dump.golden import codec
    from sharding_dump.golden.engine import display

    path = figures_path(case, options.golden_dir, result.backend, result.jax_version)
    result.figures_file = display(path)
    now = result.figures()
    if options.record:
        data = codec.canonical_bytes(now)
        if not path.is_file() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            store.write_atomic(path, data)
            result.figures_written = True
        return
    if not path.is_file():
        result.figures_file = ""
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise BadInput(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None
    old_flat, new_flat = dict(_flat(old)), dict(_flat(now))
    result.figures_changed = [(k, old_flat.get(k), new_flat.get(k)) for k in sorted({*old_flat, *new_flat})
                              if old_flat.get(k) != new_flat.get(k)]
