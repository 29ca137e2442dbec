"""verify's settings: `data/verify.yml` (replicated threshold, stack axes), sizes, the TPU topology table."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from sharding_dump.golden.sizes import parse_bytes
from sharding_dump.errors import BadInput
from sharding_dump.resources import DATA_DIR, load_yaml

SETTINGS_FILE = DATA_DIR / "verify.yml"
TPU_TOPOLOGIES_FILE = DATA_DIR / "tpu_topologies.tsv"


@dataclasses.dataclass(frozen=True)
class Options:
    """What one verify run checks and where it reads and writes."""

    replicated_threshold: int  # bytes: a value held whole by every device above this is a failure
    golden_dir: Path
    record: bool = False
    tpu: bool = False


@functools.cache
def _settings() -> dict[str, Any]:
    data = load_yaml(SETTINGS_FILE, "verify settings")
    for field in ("replicated_threshold", "stack_axes"):
        if not isinstance(data, dict) or field not in data:
            raise BadInput(f"verify settings {SETTINGS_FILE}: field {field}: missing")
    return data


def default_threshold() -> int:
    """`replicated_threshold` of data/verify.yml, in bytes."""
    return parse_size(str(_settings()["replicated_threshold"]), f"verify settings {SETTINGS_FILE}: field replicated_threshold")


def stack_axes() -> tuple[str, ...]:
    """`stack_axes` of data/verify.yml: the logical axes a scan stacks layers on."""
    axes = _settings()["stack_axes"]
    if not isinstance(axes, list) or not all(isinstance(a, str) and a for a in axes):
        raise BadInput(f"verify settings {SETTINGS_FILE}: field stack_axes: give a list of logical axis names")
    return tuple(axes)


def parse_size(text: str, what: str = "--replicated-threshold") -> int:
    """`256MiB`, `1.5 GiB`, `1000000` -> bytes (:func:`sharding_dump.golden.sizes.parse_bytes`)."""
    return parse_bytes(text, what)


@functools.cache
def tpu_topologies() -> dict[str, str]:
    """Slice name -> XLA topology name (e.g. v6e-16 -> v6e:4x4)."""
    rows = [line.split("\t") for line in TPU_TOPOLOGIES_FILE.read_text(encoding="utf-8").splitlines()
            if line and not line.startswith("#")]
    return {name: topo for name, topo in rows[1:]}
