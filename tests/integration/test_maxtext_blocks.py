"""Every decoder block against MaxText's own model: the parameter count of each card equals what
MaxText's model gives for the same config, and one golden case per block equals MaxText's dump of
that case, leaf for leaf (shape and partition spec of every parameter and optimizer-state leaf).

The reference dumps are test data of this repository (`tests/data/maxtext/blocks/`, with their
source commit and licence in `tests/data/maxtext/README.md`); a missing one fails, it is not skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import LINEN, LINEN_ARGS, REPO, compare_maxtext_tool, linen_golden, matrix_folders, sweep_beyond_first
from sharding_dump.commands.cli import main
from sharding_dump.core.state import parameter_count
from sharding_dump.zoo import cards, state
from sharding_dump.zoo.case import Case, golden_dir

BLOCK_REFERENCE = REPO / "tests" / "data" / "maxtext" / "blocks"
DEEPSEEK_REFERENCE = REPO / "tests" / "data" / "maxtext" / "goldens"

# Parameters of MaxText's own model for each card's MaxText config (configs/models/<card>.yml at
# e591f30), from the data file the docs' MaxText config table is generated from.
MAXTEXT_MODELS = yaml.safe_load((REPO / "tests/data/maxtext/models.yml").read_text())["configs"]
MAXTEXT_PARAMETERS = {name: entry["parameters"] for name, entry in MAXTEXT_MODELS.items() if "parameters" in entry}
# Blocks whose shipped cards do not yet equal MaxText's model, and why.
NOT_YET_EQUAL: dict[str, str] = {}


def reference_cases() -> list[str]:
    """Every reference case folder: MaxText's deepseek2-16b goldens and one case per other block."""
    found = [p.parent for root in (BLOCK_REFERENCE, DEEPSEEK_REFERENCE) for p in root.rglob("named_shardings.json")]
    if not any(BLOCK_REFERENCE in p.parents for p in found):
        pytest.fail(f"MaxText reference dumps not found under {BLOCK_REFERENCE}", pytrace=False)
    return sorted(str(p.relative_to(p.parents[3])) for p in found)


def reference_folder(case: str):
    return next(root / case for root in (BLOCK_REFERENCE, DEEPSEEK_REFERENCE) if (root / case).is_dir())


def compare_maxtext():
    """tools/compare_maxtext.py's comparison, in this process (test_compare_maxtext.py runs its command line)."""
    return compare_maxtext_tool()["compare"]


@pytest.mark.parametrize("card", sweep_beyond_first(sorted(MAXTEXT_PARAMETERS),
                                                    lambda card: cards.load_config(card).decoder_block))
def test_parameter_count_is_maxtexts(card):
    assert parameter_count(state.abstract_state(cards.load_config(card))) == MAXTEXT_PARAMETERS[card]


@pytest.mark.parametrize("case", [c for c in reference_cases() if (BLOCK_REFERENCE / c).is_dir()])
def test_block_matches_maxtexts_dump(case):
    ok, report = compare_maxtext()(reference_folder(case), linen_golden(case))
    assert ok, report
    assert "0 differ, 0 only in reference, 0 only in ours; (shape, spec) multiset remainder 0 + 0" in report


def test_every_block_with_a_card_is_checked_against_maxtext():
    """A block that ships cards has a reference case of one of them (or is listed as not yet equal)."""
    checked = {cards.load_config(case.split("/")[0]).decoder_block for case in reference_cases()}
    shipped = {cards.load_config(name).decoder_block for name in cards.model_names()}
    assert shipped - checked == set(NOT_YET_EQUAL), sorted(shipped - checked)
    assert len(checked) >= 10, sorted(checked)


def test_every_shipped_card_has_its_maxtext_config():
    """The MaxText config list names every shipped card (with its block) and nothing else as a card."""
    shipped = {name: cards.load_config(name).decoder_block for name in cards.model_names()}
    assert {name: MAXTEXT_MODELS[name]["block"] for name in MAXTEXT_PARAMETERS} == shipped


def test_qwen3_next_attention_output_has_maxtexts_three_names():
    """MaxText's own activation dump of qwen3-next-80b-a3b (tpu7x-8, default rules; models/qwen3.py
    gives its attention `out_axis_names` of three names) records the full attention's output as
    `attentions/out: bfloat16[96,2048,16,256] ('activation_batch', 'activation_length', 'activation_embed')`."""
    case = next(c for c in matrix_folders() if c.parts[-4] == "qwen3-next-80b-a3b")
    tensors = json.loads((case / "activation_shardings.json").read_text())["tensors"]
    outs = [entry for key, entry in tensors.items() if key.endswith("/attention/attention/attention_out")]
    assert outs and all(entry["logical_axes"] == ["activation_batch", "activation_length", "activation_embed"]
                        for entry in outs), outs


PIPELINE_REFERENCE = REPO / "tests" / "data" / "maxtext-scan-block-pipelines"


def linen_pipeline(model: str, stages: int) -> tuple[str, str]:
    """(the folder of our case as e591f30's Linen build, the one setting it adds)."""
    case = Case.make(model, "tpu7x-8", "default", overrides={"ici_pipeline_parallelism": stages, **LINEN})
    return golden_dir(case, Path("/")).relative_to("/").as_posix(), f"ici_pipeline_parallelism={stages}"


# MaxText's own dumps (its Linen build) of pipelines whose unit is a scanned block, with the one setting each adds.
PIPELINES = dict(linen_pipeline(model, stages) for model, stages in [("gemma4-31b", 2), ("olmo3-32b", 4),
                                                                      ("qwen3.5-35b-a3b", 2)])


def test_every_pipeline_reference_is_compared():
    found = {str(p.parent.relative_to(PIPELINE_REFERENCE)) for p in PIPELINE_REFERENCE.rglob("named_shardings.json")}
    assert found == set(PIPELINES)


@pytest.mark.parametrize("case", sweep_beyond_first(sorted(PIPELINES)))
def test_pipeline_of_scan_blocks_matches_maxtexts_dump(case, tmp_path):
    """gemma4-31b: 60 blocks of 6 layers in 2 stages x 30 repeats; olmo3-32b: 64 blocks of 4 in 4 x 16;
    qwen3.5-35b-a3b: 40 blocks of 4 in 2 x 20, whose norm scales (declared with no logical axes) have
    none and are replicated. MaxText's dump of the case and ours name the same leaves, with the same
    shape, partition spec and logical axes."""
    model, topology = case.split("/")[:2]
    assert main(["--model", model, "--topology", topology, "--rule", "default", PIPELINES[case], *LINEN_ARGS,
                 "--golden-dir", str(tmp_path)]) == 0
    ok, report = compare_maxtext()(PIPELINE_REFERENCE / case, tmp_path / case)
    assert ok, report
