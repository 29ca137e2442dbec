"""The golden file format: which file holds which kind of document, and each kind's version.

Plain Python (no jax), so that golden I/O and `sharding-dump diff` read it without loading a model.

>>> FILE_KINDS[NAMED_FILE], GOLDEN_FILE_NAMES[2]
('named', 'activation_shardings.json')
>>> document("logical", {"mesh": {}}, {"params/w": {}})["format_version"]
1
"""

from __future__ import annotations

from typing import Any, Mapping

NAMED_FILE = "named_shardings.json"
LOGICAL_FILE = "logical_shardings.json"
ACTIVATIONS_FILE = "activation_shardings.json"
SERVING_FILE = "serving_steps.json"  # a serving program's steps, hand-offs and cache bytes
# The kind of document each golden file name holds: a file of another kind under this name is refused.
FILE_KINDS = {NAMED_FILE: "named", LOGICAL_FILE: "logical", ACTIVATIONS_FILE: "activations", SERVING_FILE: "serving"}
GOLDEN_FILE_NAMES = tuple(FILE_KINDS)

FORMAT_VERSION = 1  # of every document kind not listed in FORMAT_VERSIONS
# named v2 added per-device bytes (per tensor and per-device totals in the header); the schema still
# reads v1 so that `sharding-dump diff` can compare goldens written before the change.
FORMAT_VERSIONS = {"named": 2}


def document(kind: str, header: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """A golden document of `kind` (named, logical, ...): header fields plus a `tensors` map."""
    version = FORMAT_VERSIONS.get(kind, FORMAT_VERSION)
    return {"format_version": version, "kind": kind, **header, "tensors": dict(tensors)}
