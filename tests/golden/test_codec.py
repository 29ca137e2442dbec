"""Golden documents through the codec: every committed golden passes its schema, and broken copies
of one fail it, naming the field."""

from __future__ import annotations

import copy
import json
import re

import pytest

from helpers import REPO
from sharding_dump.errors import BadInput
from sharding_dump.golden import codec
from sharding_dump.resources import is_valid, validate

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


def _trimmed_goldens() -> list[dict]:
    """One golden of each kind per model family, cut to its first four tensors (jsonschema, the
    reference below, takes a third of a second for a whole 400-tensor golden)."""
    docs = []
    for path in GOLDEN[::7]:
        doc = json.loads(path.read_text())
        doc["tensors"] = dict(sorted(doc["tensors"].items())[:4])
        docs.append(doc)
    return docs


_VALUES = [None, True, -1, 0, 1.5, "x", "", [], {}, [1], {"q": 1}, "fsdp", ["a", "a"], "float33", "params//w"]


def _mutated(doc: dict, rng) -> dict:
    """`doc` with one or two random changes: a key dropped or added, an item dropped or added, a value replaced."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.choice([1, 1, 2])):
        def nodes(x, path=()):
            yield path, x
            for key, value in (x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()):
                yield from nodes(value, (*path, key))
        path, node = rng.choice(list(nodes(doc)))
        if not path:
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        op = rng.random()
        if op < 0.25 and isinstance(node, dict) and node:
            del node[rng.choice(sorted(node))]
        elif op < 0.4 and isinstance(node, dict):
            node["zz_extra"] = 1
        elif op < 0.5 and isinstance(node, list) and node:
            node.pop(rng.randrange(len(node)))
        elif op < 0.55 and isinstance(node, list):
            node.append(copy.deepcopy(rng.choice(_VALUES)))
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(_VALUES))
    return doc


def test_schema_checks_agree_with_jsonschema_on_mutated_goldens():
    """jsonschema-rs (the checks the package runs) gives jsonschema's verdict, and names the field
    jsonschema's best match names, on 300 randomly mutated goldens of every kind."""
    import random

    jsonschema = pytest.importorskip("jsonschema")
    import referencing

    from sharding_dump.resources import SCHEMAS_DIR

    schemas = [json.loads(p.read_text()) for p in sorted(SCHEMAS_DIR.glob("*.schema.json"))]
    registry = referencing.Registry().with_resources(
        (s["$id"], referencing.Resource.from_contents(s)) for s in schemas)
    reference = {s["$id"].split("/")[1].split(".")[0]: jsonschema.Draft202012Validator(s, registry=registry)
                 for s in schemas}
    rng = random.Random(37)
    goldens = _trimmed_goldens()
    assert {d["kind"] for d in goldens} == {"named", "logical", "activations"}
    failed = 0
    for _ in range(300):
        golden = rng.choice(goldens)
        doc, kind = _mutated(golden, rng), golden["kind"]  # the file name says which schema
        expected = reference[kind].is_valid(doc)
        assert is_valid(doc, kind) == expected, doc
        if not expected:
            failed += 1
            best = jsonschema.exceptions.best_match(reference[kind].iter_errors(doc))
            field = "/".join(map(str, best.absolute_path)) or "(top level)"
            with pytest.raises(BadInput, match=f"^where: field {re.escape(field)}: "):
                validate(doc, kind, "where")
    assert failed > 200  # the mutations mostly break the document
