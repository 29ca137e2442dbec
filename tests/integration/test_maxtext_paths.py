"""Leaf paths are MaxText's: every MaxText sharding dump kept in `tests/data/maxtext/` (its deepseek2-16b
goldens, one case per decoder block, and pipelines: one layer per stage, a stage of sequential
layers, a stage's scan, DeepSeek's MoE pipeline) names exactly the leaves our golden of the same case
names, each of its keys read from jax's key syntax by `sharding_dump.core.specs.leaf_path`. No table
of names stands between the two, here or in `tools/compare_maxtext.py`.

The dumps are test data of this repository (source commit and licence in `tests/data/maxtext/README.md`);
a missing one fails, it is not skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import REPO, compare_maxtext_tool, linen_golden
from sharding_dump.core.specs import leaf_path

MAXTEXT = REPO / "tests" / "data" / "maxtext"
PIPELINES = MAXTEXT / "pipelines"
# MaxText 0.2.5's dumps are of its NNX build, which names its leaves otherwise (model/..., optimizer/...);
# tests/integration/test_maxtext_releases.py reads them with compare_maxtext.py --nnx.
NNX_BUILD_DUMPS = MAXTEXT / "releases"
NAMED, LOGICAL = "named_shardings.json", "logical_shardings.json"


def dump_folders(root: Path) -> list[Path]:
    """Every MaxText dump folder under `root` (`<model>/<topology>/slice_<n>/rule_...`)."""
    found = sorted(p.parent for p in root.rglob(NAMED) if NNX_BUILD_DUMPS not in p.parents)
    if not found:
        pytest.fail(f"MaxText sharding dumps not found under {root}", pytrace=False)
    return found


def case_of(folder: Path) -> str:
    return folder.relative_to(folder.parents[3]).as_posix()


def our_folder(folder: Path) -> Path:
    """Our golden of the case a MaxText dump is kept under: a matrix case as e591f30's Linen build, the build
    these dumps are of (helpers.linen_golden)."""
    return linen_golden(case_of(folder))


@pytest.mark.parametrize("folder", dump_folders(MAXTEXT), ids=lambda f: f.relative_to(MAXTEXT).parts[0] + ":"
                         + case_of(f))
def test_maxtext_dump_and_ours_name_the_same_leaves(folder):
    ours = our_folder(folder)
    for name in (NAMED, LOGICAL):
        theirs = json.loads((folder / name).read_text(encoding="utf-8"))
        mine = json.loads((ours / name).read_text(encoding="utf-8"))["tensors"]
        assert sorted(leaf_path(key) for key in theirs) == sorted(mine), name


@pytest.mark.parametrize("folder", dump_folders(PIPELINES), ids=case_of)
def test_pipeline_matches_maxtexts_dump(folder):
    """Shape, partition spec and logical axes of every leaf, matched by path."""
    ok, report = compare_maxtext_tool()["compare"](folder, our_folder(folder))
    assert ok, report
    assert "0 differ, 0 only in reference, 0 only in ours; (shape, spec) multiset remainder 0 + 0" in report


def test_pipeline_dumps_hold_every_stage_layout():
    """MaxText's names for each way a pipeline holds its layers are in the reference data."""
    paths = {leaf_path(key) for folder in dump_folders(PIPELINES)
             for key in json.loads((folder / NAMED).read_text(encoding="utf-8"))}
    stage = "params/decoder/pipeline_module/layers/"
    assert f"{stage}mlp/wi_0/kernel" in paths  # one layer per stage
    assert f"{stage}layers_5/mlp/wi_0/kernel" in paths  # a stage of 6 sequential layers
    assert f"{stage}scanned_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_0" in paths  # a stage's scan
    assert "params/decoder/layers_outside_pipeline/mlp/wi_0/kernel" in paths  # left out, after the pipeline
    assert "params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_0" in paths  # DeepSeek's, before it
