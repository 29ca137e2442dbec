"""tools/compare_maxtext.py against MaxText's published deepseek2-16b dumps, and proof that it bites.

The reference dumps are test data of this repository (`tests/data/maxtext/`, with their source commit
and licence). Without them these tests fail saying so: a comparison that silently did not run is no
comparison.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import LINEN, REPO, compare_maxtext_tool, linen_golden
from sharding_dump.zoo.case import Case, golden_dir

REFERENCE = REPO / "tests" / "data" / "maxtext" / "goldens"
TOOL = REPO / "tools" / "compare_maxtext.py"

# MaxText's eight published cases (its Linen build, as its own sharding tests dump e591f30), as folders of its
# golden tree: our cases of them with LINEN added.
REFERENCE_CASES = [golden_dir(Case.make("deepseek2-16b", topology, rule, overrides={**overrides, **LINEN}), Path("/"))
                   .relative_to("/").as_posix() for topology, rule, overrides in [
    ("tpu7x-16", "default", {}),
    ("tpu7x-16", "pure-fsdp", {}),
    ("tpu7x-16", "ep-as-dp", {"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 2, "use_ring_of_experts": True}),
    ("tpu7x-8", "shard-exp-on-fsdp", {"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 2}),
    ("tpu7x-8", "cp-as-ep", {"ici_fsdp_parallelism": -1, "ici_context_parallelism": 2, "ici_expert_parallelism": 2}),
    ("tpu7x-8", "ep-as-cp", {"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 2}),
    ("v6e-16", "default", {"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 4}),
    ("v6e-16", "pipeline-large-moe", {"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 4, "use_ring_of_experts": True}),
]]
MOE_WEIGHT = "params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_0"


def reference_root():
    if not (REFERENCE / "deepseek2-16b").is_dir():
        pytest.fail(f"MaxText reference goldens not found at {REFERENCE} (tests/data/maxtext/goldens of "
                    f"this repository)", pytrace=False)
    return REFERENCE


def our_folder(reference_case: str):
    """Our golden of a reference case: the matrix case as e591f30's Linen build (helpers.linen_golden)."""
    return linen_golden(reference_case)


def tool_main():
    """tools/compare_maxtext.py's `main(argv)`: its command line, run in this process."""
    return compare_maxtext_tool()["main"]


def run_tool(capsys, *args):
    """The tool's command line on `args`: its exit status and what it printed."""
    capsys.readouterr()
    status = tool_main()([str(arg) for arg in args])
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=status, stdout=captured.out, stderr=captured.err)


def test_command_line_runs_as_the_readme_says(tmp_path):
    """`python tools/compare_maxtext.py REFERENCE OURS` as a script, from any folder (the other tests
    call its main() in this process)."""
    case = REFERENCE_CASES[0]
    result = subprocess.run([sys.executable, str(TOOL), str(reference_root() / case), str(our_folder(case))],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.endswith("multiset remainder 0 + 0\nMATCH\n"), result.stdout


def test_reference_case_list_is_complete():
    published = sorted(p.parent.relative_to(reference_root()).as_posix()
                       for p in reference_root().rglob("named_shardings.json"))
    assert published == sorted(REFERENCE_CASES)


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: c.split("/", 1)[1])
def test_matches_maxtext(case, capsys):
    result = run_tool(capsys, reference_root() / case, our_folder(case))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(shape, spec) multiset remainder 0 + 0" in result.stdout
    assert "named_shardings.json: 84 reference leaves, 84 ours; 84 match by path" in result.stdout


def copy_of_ours(tmp_path, case):
    folder = tmp_path / "ours"
    shutil.copytree(our_folder(case), folder)
    return folder, json.loads((folder / "named_shardings.json").read_text())


def test_changed_spec_is_printed_with_both_sides(tmp_path, capsys):
    case = REFERENCE_CASES[0]
    folder, doc = copy_of_ours(tmp_path, case)
    doc["tensors"][MOE_WEIGHT]["partition_spec"] = [None, None, None, None]
    (folder / "named_shardings.json").write_text(json.dumps(doc))
    result = run_tool(capsys, reference_root() / case, folder)
    assert result.returncode == 1
    assert f"  {MOE_WEIGHT}\n      reference shape [64,26,2048,1408] spec " \
           '["expert",null,["fsdp","context","context_usp_ulysses"],' in result.stdout
    assert "      ours      shape [64,26,2048,1408] spec [null,null,null,null]" in result.stdout
    assert "1 differ" in result.stdout and "multiset remainder 1 + 1" in result.stdout


def test_renamed_leaf_is_caught_by_path_not_by_multiset(tmp_path, capsys):
    case = REFERENCE_CASES[0]
    folder, doc = copy_of_ours(tmp_path, case)
    doc["tensors"]["params/decoder/moe_layers/renamed"] = doc["tensors"].pop(MOE_WEIGHT)
    (folder / "named_shardings.json").write_text(json.dumps(doc))
    result = run_tool(capsys, reference_root() / case, folder)
    assert result.returncode == 1
    assert f"only in reference: {MOE_WEIGHT}" in result.stdout
    assert "only in ours: params/decoder/moe_layers/renamed" in result.stdout
    assert "multiset remainder 0 + 0" in result.stdout


def test_mesh_difference_is_reported(tmp_path, capsys):
    case = REFERENCE_CASES[0]
    folder, doc = copy_of_ours(tmp_path, case)
    doc["mesh"]["axis_sizes"][doc["mesh"]["axis_names"].index("fsdp")] = 8
    (folder / "named_shardings.json").write_text(json.dumps(doc))
    result = run_tool(capsys, reference_root() / case, folder)
    assert result.returncode == 1 and "mesh differs" in result.stdout


def reference_keyed(tmp, *keys):
    """A reference folder of one scalar leaf under each key, and an empty one of ours."""
    (tmp / "ref").mkdir()
    leaves = {key: {"partition_spec": [], "shape": []} for key in keys}
    (tmp / "ref" / "named_shardings.json").write_text(json.dumps(leaves))
    (tmp / "ours").mkdir()
    (tmp / "ours" / "named_shardings.json").write_text("{}")
    return tmp / "ref", tmp / "ours"


@pytest.mark.parametrize("make,message", [
    (lambda tmp: (tmp / "nope", tmp), "no such case folder"),
    (lambda tmp: (tmp, tmp), "named_shardings.json: no such file"),
    (lambda tmp: reference_keyed(tmp, ".params/decoder"),
     "named_shardings.json: leaf '.params/decoder': element at character 8 is not a jax key"),
    (lambda tmp: reference_keyed(tmp, ".params/['params']/['w']", ".params/['w']"),
     "named_shardings.json: leaf \".params/['w']\" reads as 'params/w', the path of an earlier leaf"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, make, message):
    result = run_tool(capsys, *make(tmp_path))
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_activations_appear_in_our_activation_golden(case):
    """Every reference input_shardings.json entry with known logical axes appears in our activation
    dump with the same shape, dtype, logical axes and (size-1 mesh axes dropped) partition spec."""
    from sharding_dump.golden import codec
    from sharding_dump.zoo import reference

    expected = reference.load_reference(reference_root() / case / "input_shardings.json")
    ours = codec.read_document(our_folder(case) / "activation_shardings.json")
    result = reference.compare(expected, ours)
    assert result.mismatches == [] and result.ok
    assert result.checked == 21, result  # MaxText's 29 entries less its 8 with unknown axes
