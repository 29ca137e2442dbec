"""Golden documents through the codec: every committed golden passes its schema, and broken copies
of one fail it, naming the field."""

from __future__ import annotations

import copy
import json

import pytest

from helpers import REPO
from sharding_dump.errors import BadInput
from sharding_dump.golden import codec
from sharding_dump.resources import is_valid

GOLDEN = sorted((REPO / "golden").rglob("*.json"))
NAMED = json.loads((REPO / "golden/llama2-7b/v5p-16/slice_1/rule_pure-fsdp/named_shardings.json").read_text())


def _broken() -> list[tuple[str, dict]]:
    first = sorted(NAMED["tensors"])[0]
    cases = []
    for label, change in [
        ("missing mesh", lambda d: d.pop("mesh")),
        ("extra field", lambda d: d.update(extra=1)),
        ("bad leaf path", lambda d: d["tensors"].update({"params//w": d["tensors"][first]})),
        ("shape of strings", lambda d: d["tensors"][first].update(shape=["8"])),
        ("unknown dtype", lambda d: d["tensors"][first].update(dtype="float33")),
        ("negative bytes", lambda d: d["tensors"][first].update(per_device_bytes=-1)),
        ("spec entry a number", lambda d: d["tensors"][first].update(partition_spec=[3, None, None])),
    ]:
        doc = copy.deepcopy(NAMED)
        change(doc)
        cases.append((label, doc))
    return cases


def test_every_committed_golden_passes_its_schema():
    docs = [json.loads(p.read_text()) for p in GOLDEN]
    assert docs and all(is_valid(d, d["kind"]) for d in docs)


@pytest.mark.parametrize("label,doc", _broken(), ids=[label for label, _ in _broken()])
def test_a_broken_golden_fails_its_schema_and_names_the_field(label, doc):
    assert not is_valid(doc, "named"), label
    with pytest.raises(BadInput, match="field"):
        codec.check_document(doc, "named_shardings.json")
