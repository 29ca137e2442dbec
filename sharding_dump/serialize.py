"""Golden files: building the JSON documents, their canonical bytes, schema checks, atomic writes.

Canonical text is `json.dumps(sort_keys=True, indent=2)` plus a trailing newline, so the same case
gives the same bytes on any machine, hash seed or worker count. Every document is schema-checked when
it is built and when it is read back.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from sharding_dump.core.specs import SpecJson, spec_to_json  # noqa: F401  (re-exported)
from sharding_dump.errors import BadInput
from sharding_dump.resources import error_field, error_message, schema_validator

FORMAT_VERSION = 1  # of every document kind not listed in FORMAT_VERSIONS
# named v2 added per-device bytes (per tensor and per-device totals in the header); the schema still
# reads v1 so that `sharding-dump diff` can compare goldens written before the change.
FORMAT_VERSIONS = {"named": 2}


def document(kind: str, header: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """A golden document of `kind` (named, logical, ...): header fields plus a `tensors` map."""
    version = FORMAT_VERSIONS.get(kind, FORMAT_VERSION)
    return {"format_version": version, "kind": kind, **header, "tensors": dict(tensors)}


def check_document(doc: Mapping[str, Any], where: str) -> None:
    """Schema-checks a document; a failure names `where` and the failing field."""
    kind = doc.get("kind") if isinstance(doc, Mapping) else None
    try:
        validator = schema_validator(str(kind))
    except KeyError:  # unknown kind: no such schema in the registry
        raise BadInput(f"{where}: field kind: {kind!r} is not a golden document kind") from None
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        raise BadInput(f"{where}: field {error_field(errors[0])}: {error_message(errors[0])}")


def canonical_bytes(doc: Mapping[str, Any]) -> bytes:
    """The one text form of a document."""
    return (json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def render(docs: Mapping[str, Mapping[str, Any]]) -> dict[str, bytes]:
    """{file name: document} -> {file name: canonical bytes}, every document schema-checked first."""
    for name, doc in docs.items():
        check_document(doc, name)
    return {name: canonical_bytes(doc) for name, doc in sorted(docs.items())}


def read_document(path: Path) -> dict[str, Any]:
    """Reads and schema-checks a golden file."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise BadInput(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None
    check_document(doc, str(path))
    return doc


def write_atomic(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temp file in the same folder and a rename: readers see
    either the old file or the new one, never half of either."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_files(folder: Path, files: Mapping[str, bytes]) -> None:
    """Writes every rendered file of one case into `folder`, each atomically."""
    for name, data in sorted(files.items()):
        write_atomic(folder / name, data)


def shapes_json(shape: Sequence[int]) -> list[int]:
    return [int(d) for d in shape]
