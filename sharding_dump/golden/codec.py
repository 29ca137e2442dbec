"""Golden documents as canonical bytes, schema-checked both ways.

Canonical text is `json.dumps(sort_keys=True, indent=2)` plus a trailing newline, so the same case
gives the same bytes on any machine, hash seed or worker count. A document is schema-checked before it
is written (:func:`check_bytes`, called by the engine for every golden it writes or finds different)
and when it is read back, and its kind must match its file name
(:data:`sharding_dump.core.format.FILE_KINDS`). Bytes equal to a committed golden are not checked
again: they passed when they were written.

>>> doc = {"format_version": 1, "kind": "logical", "mesh": {"axis_names": ["fsdp"], "axis_sizes": [4],
...        "shard_mode": "auto"}, "tensors": {"params/w": {"shape": [8], "logical_axes": ["embed"]}}}
>>> render({"logical_shardings.json": doc})["logical_shardings.json"].splitlines()[:2]
[b'{', b'  "format_version": 1,']
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from sharding_dump.core.format import FILE_KINDS
from sharding_dump.errors import BadInput
from sharding_dump.resources import is_valid, parse_json, read_regular_file, read_text, schema_validator, validate

GOLDEN_MAX_BYTES = 64 << 20

def read_regular(path: Path) -> bytes:
    """The bytes of a golden file: a regular file of at most GOLDEN_MAX_BYTES, else BadInput."""
    return read_regular_file(path, "golden file", GOLDEN_MAX_BYTES)

def check_document(doc: Mapping[str, Any], where: str) -> None:
    """Schema-checks a document; a failure names `where` and the failing field."""
    kind = doc.get("kind") if isinstance(doc, Mapping) else None
    if kind in FILE_KINDS.values() and is_valid(doc, kind):
        return
    try:
        schema_validator(str(kind))
    except KeyError:  # unknown kind: no such schema
        raise BadInput(f"{where}: field kind: {kind!r} is not a golden document kind") from None
    validate(doc, str(kind), where)

def canonical_bytes(doc: Mapping[str, Any]) -> bytes:
    """The one text form of a document."""
    return (json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

def render(docs: Mapping[str, Mapping[str, Any]]) -> dict[str, bytes]:
    """{file name: document} -> {file name: canonical bytes}. Not schema-checked here: a 400-tensor
    document takes about 1 ms to check, and most renders are compared with a golden they equal."""
    return {name: canonical_bytes(doc) for name, doc in sorted(docs.items())}

def check_bytes(data: bytes, where: str, doc: Mapping[str, Any] | None = None) -> None:
    """Schema-checks rendered bytes (`doc`: their document, when the caller has it) once per process:
    what is about to be written, or shown as different from a golden.

    >>> check_bytes(b'{"kind": "logical"}', "logical_shardings.json")
    Traceback (most recent call last):
    ...
    sharding_dump.errors.BadInput: logical_shardings.json: field (top level): 'format_version' is a required property
    """
    digest = hashlib.sha256(data).digest()
    if digest in _VALIDATED:  # the same bytes pass or fail their schema the same way every time
        return
    check_document(json.loads(data) if doc is None else doc, where)
    if len(_VALIDATED) >= 4096:
        _VALIDATED.clear()
    _VALIDATED.add(digest)

def read_document(path: Path) -> dict[str, Any]:
    """Reads and schema-checks a golden file (regular, bounded, UTF-8 JSON); a file named after one
    kind of document (named_shardings.json, ...) must hold that kind."""
    text = read_text(path, "golden file", GOLDEN_MAX_BYTES)
    data = text.encode("utf-8")
    digest = hashlib.sha256(data).digest()
    # The same text read again (`diff golden golden` reads every file twice) passed every check of
    # parse_json and the schema already: the plain parser gives the same document 3 times faster.
    doc = json.loads(text) if digest in _READ else parse_json(text, f"golden file {path}")
    expected = FILE_KINDS.get(Path(path).name)
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if expected is not None and kind != expected:
        raise BadInput(f"golden file {path}: field kind: {json.dumps(kind)[:40]} under the name {Path(path).name}, "
                       f"which holds kind {expected!r}")
    check_bytes(data, f"golden file {path}", doc)
    if len(_READ) >= 4096:
        _READ.clear()
    _READ.add(digest)
    return doc


_VALIDATED: set[bytes] = set()  # digests of documents that passed their schema in this process
_READ: set[bytes] = set()  # digests of golden files that passed read_document in this process
