"""MoE golden cases: every MoE rule file is covered and bites, layouts divide evenly, and
`use_ring_of_experts` is recorded without changing any layout."""

import math

import pytest

from helpers import REPO, committed_golden, sweep_beyond_first
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.dump import dump_case
from sharding_dump.zoo.goldens import check_or_update
from sharding_dump.zoo.matrix import load_matrix

MOE_MODELS = ("deepseek2-16b", "deepseek3-671b", "gpt-oss-20b")


# One line of each MoE rule file, and what it becomes: the routed experts must change layout.
RULE_MUTATIONS = [
    ("shard-exp-on-fsdp", "  - [exp, [expert, fsdp]]\n", "  - [exp, [expert]]\n"),
    ("ep-as-cp", "  - [exp, expert]\n", "  - [exp, []]\n"),
    ("cp-as-ep", "  - [exp, [context, expert]]\n", "  - [exp, [expert]]\n"),
    ("ep-as-dp", "  - [exp, expert]\n", "  - [exp, []]\n"),
    ("pipeline-large-moe", "  - [exp, expert]\n", "  - [exp, []]\n"),
]


@pytest.mark.parametrize("mutation", sweep_beyond_first(RULE_MUTATIONS), ids=lambda m: m[0])
def test_mutated_moe_rule_fails_its_golden_naming_the_expert_weights(mutated_rule, mutation):
    """A copy of the rule file with the `exp` line changed maps to the same golden folder and fails
    (one rule file by default: the golden tests check each against a fresh dump; the sweep mutates each)."""
    rule, line, mutated = mutation
    case = next(c for c in load_matrix() if c.rule == rule and c.model == "deepseek2-16b")
    copy = mutated_rule(rule, line, mutated)
    mutated_case = Case.make(case.model, case.topology, str(copy), case.num_slices, dict(case.overrides))
    assert golden_dir(mutated_case, "g") == golden_dir(case, "g")
    outcome = check_or_update(mutated_case, REPO / "golden", update=False)
    assert outcome.status == "differs"
    for weight in ("wi_0", "wi_1", "wo"):
        assert (f"model/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/{weight}  "
                f"(and optimizer/opt_state/0/mu, optimizer/opt_state/0/nu)") in outcome.report


def test_every_moe_rule_file_has_a_golden_case():
    covered = {c.rule for c in load_matrix() if c.model in MOE_MODELS}
    assert {rule for rule, _, _ in RULE_MUTATIONS} <= covered


@pytest.mark.parametrize("case", [c for c in load_matrix() if c.model in MOE_MODELS], ids=lambda c: c.label)
def test_moe_cases_shard_every_dimension_evenly(case):
    """Indivisible splits compile to padding or fail on hardware; the committed MoE cases have none."""
    doc = committed_golden(case, "named_shardings.json")
    sizes = dict(zip(doc["mesh"]["axis_names"], doc["mesh"]["axis_sizes"]))
    for path, tensor in doc["tensors"].items():
        for dim, entry in zip(tensor["shape"], tensor["partition_spec"]):
            axes = [] if entry is None else [entry] if isinstance(entry, str) else entry
            assert dim % math.prod(sizes[a] for a in axes) == 0, (path, dim, entry)


def test_ring_of_experts_is_recorded_but_changes_no_layout():
    case = next(c for c in load_matrix() if dict(c.overrides).get("use_ring_of_experts"))
    plain = Case.make(case.model, case.topology, case.rule, case.num_slices,
                      {k: v for k, v in case.overrides if k != "use_ring_of_experts"})
    with_ring, without = dump_case(case), dump_case(plain)
    assert with_ring["named_shardings.json"]["case"]["overrides"]["use_ring_of_experts"] is True
    assert with_ring["named_shardings.json"]["tensors"] == without["named_shardings.json"]["tensors"]
