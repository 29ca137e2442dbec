"""One traced step for every rule file (`sharding_dump.zoo.dump.step_reading`): a card's step whose
rules nothing but constrain() reads is traced once per model, batch and mesh, and each rule file's
constraints are resolved after the trace. What a process that shares its traces writes is what a
fresh process writes for the case alone, byte for byte: every case of the matrix, and each under a copy
of its rule file with the logical axis rules in reverse order (other specs, the same mesh)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from helpers import REPO, sweep_beyond_first
from sharding_dump.errors import BadInput
from sharding_dump.golden.codec import render
from sharding_dump.zoo import dump, serving
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.matrix import load_matrix

TRACE_CASE = dump.trace_case  # the harness's own, before a test counts its calls
# A card's cases, the first one under the default rule file (whose repeated names reversing reorders).
# Cards trained by the zoo's step (a served card traces its serving steps instead).
CARD_CASES = sorted((c for c in load_matrix() if c.model_ref.kind != "factory" and not serving.serves(c)),
                    key=lambda c: c.rule != "default")


def reversed_rules(case: Case, folder: Path) -> Case:
    """`case` under a copy of its rule file whose logical axis rules are in reverse order: the first
    match of a repeated name changes, the mesh axes do not."""
    data = yaml.safe_load(case.rule_set().path.read_text())
    data["logical_axis_rules"] = data["logical_axis_rules"][::-1]
    path = folder / f"{case.rule_name}-reversed.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return Case.make(case.model, case.topology, str(path), case.num_slices, dict(case.overrides))


def shared_path(case: Case) -> dict[str, bytes]:
    """The case's golden bytes in this process, whose caches other cases filled."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return render(dump.dump_case(case))


def fresh_process(case: Case, root: Path) -> dict[str, bytes]:
    """The golden bytes `sharding-dump` writes for the case alone, in a new process."""
    words = case.command().split()[1:]
    proc = subprocess.run([sys.executable, "-m", "sharding_dump.commands.cli", *words, "--golden-dir", str(root)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return {p.name: p.read_bytes() for p in sorted(golden_dir(case, root).glob("*.json"))}


@pytest.mark.parametrize("case", sweep_beyond_first(CARD_CASES), ids=lambda c: c.label)
def test_a_shared_trace_writes_the_bytes_of_a_fresh_process(case, tmp_path, monkeypatch):
    """The case, then the case under its rules in reverse order: the second is not traced again when
    the first trace read its rules only in constrain(), and both write what a fresh process writes."""
    original = shared_path(case)
    other = reversed_rules(case, tmp_path)
    try:
        setup = dump.setup_case(other)
    except BadInput:  # the reversed rules do not fit the case (e.g. a pipeline's stage rules): the case alone
        setup = None
    traced = []
    monkeypatch.setattr(dump, "trace_case", lambda s: traced.append(s.case) or TRACE_CASE(s))
    reordered = shared_path(other) if setup is not None else None
    if setup is not None:
        first = dump.setup_case(case)
        rule_free = dump._rule_free(dump._StepOf(first.shared_step_inputs(), first)) is not None
        assert traced == ([] if rule_free else [other])
        assert reordered == fresh_process(other, tmp_path / "fresh")
    assert original == fresh_process(case, tmp_path / "fresh")


def test_the_reversed_rules_place_activations_otherwise(tmp_path):
    """The check above compares layouts that differ: the first case's activations under its rules in
    reverse order have other specs (resolved after the shared trace), and its trace reads its rules
    only in constrain()."""
    case = CARD_CASES[0]
    setup = dump.setup_case(case)
    assert dump._rule_free(dump._StepOf(setup.shared_step_inputs(), setup)) is not None
    other = reversed_rules(case, tmp_path)
    specs = [{c.key: c.partition_spec for c in dump.trace_activations(dump.setup_case(c))} for c in (case, other)]
    assert specs[0].keys() == specs[1].keys() and specs[0] != specs[1]
