"""The zoo built as MaxText's NNX build (`maxtext_version`, `pure_nnx`) against MaxText's own dumps of it.

`tests/data/maxtext/releases/<version>/` (source and licence in tests/data/maxtext/README.md) holds dumps of
MaxText 0.2.5 (its only build) and of e591f30's NNX build (`0.2.4`, base.yml's default). They compare with
our goldens of the same cases by path, with no table (`tools/compare_maxtext.py`): every parameter,
optimizer and RNG-state leaf's shape and placement. A missing reference fails, it is not skipped.
Their activation records (a pipeline's too) are found among ours by name.
"""

from __future__ import annotations

import pytest

from helpers import REPO, compare_maxtext_tool, sweep_beyond_first
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.goldens import check_or_update
from sharding_dump.zoo.matrix import load_matrix

RELEASES = REPO / "tests" / "data" / "maxtext" / "releases"
ZERO1_PIPELINE = {"ici_data_parallelism": 2, "ici_pipeline_parallelism": 2, "num_pipeline_microbatches": 8,
                  "shard_optimizer_over_data": True}
DEEPSEEK2_PIPELINE = {"ici_pipeline_parallelism": 4, "num_pipeline_microbatches": 4, "pipeline_parallel_layers": 24}
DEEPSEEK3_PIPELINE = {"dcn_pipeline_parallelism": 4, "ici_expert_parallelism": 8, "num_pipeline_microbatches": 8,
                      "num_pipeline_repeats": 2, "num_layers_per_pipeline_stage": 7, "scan_layers_per_stage": True,
                      "pipeline_parallel_layers": 56}
PIPELINE = {"ici_pipeline_parallelism": 2, "num_pipeline_microbatches": 8}
QWEN3_PIPELINE = {"ici_pipeline_parallelism": 2, "num_pipeline_microbatches": 8, "num_pipeline_repeats": 2,
                  "num_layers_per_pipeline_stage": 6, "pipeline_parallel_layers": 24}
# (version, model, topology, rule, overrides[, num_slices]): MaxText's dump of each is kept under our case's
# folder name.
CASES = [
    ("0.2.5", "qwen3-0.6b", "tpu7x-16", "fsdp-as-dp-for-attn", {}),
    ("0.2.5", "qwen3-0.6b", "tpu7x-16", "default", {}),
    ("0.2.5", "deepseek2-16b", "tpu7x-16", "default", {}),
    ("0.2.5", "deepseek2-16b", "tpu7x-16", "fsdp-as-dp-for-attn", {}),
    ("0.2.5", "deepseek2-16b", "tpu7x-8", "ep-as-cp", {"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 2}),
    ("0.2.5", "qwen3.5-35b-a3b", "tpu7x-16", "default", {"ici_fsdp_parallelism": -1, "ici_tensor_parallelism": 2}),
    ("0.2.5", "gpt-oss-20b", "tpu7x-16", "default", {}),
    ("0.2.5", "gpt3-6b", "tpu7x-16", "default", {}),
    ("0.2.5", "gemma4-26b", "tpu7x-16", "default", {}),
    ("0.2.5", "deepseek3.2-671b", "tpu7x-16", "default", {}),  # routed gate/bias as model state
    # ZeRO-1 in explicit mode: MaxText adds `data` after the size-1 axes are gone, as in auto mode
    ("0.2.5", "llama2-7b", "v5p-8", "default", {**ZERO1_PIPELINE, "shard_mode": "explicit"}),
    # DeepSeek's pipeline: the MoE layers it leaves out are `moe_layers_outside_pipeline` in the NNX build
    ("0.2.5", "deepseek2-16b", "v6e-16", "pipeline-large-moe", DEEPSEEK2_PIPELINE),
    ("0.2.5", "deepseek3-671b", "tpu7x-256", "pipeline-large-moe", DEEPSEEK3_PIPELINE, 4),
    # and in explicit mode: the routed gate/bias (model state, stacked layer first) keeps its `stage`
    ("0.2.5", "deepseek3-671b", "tpu7x-256", "pipeline-large-moe", {**DEEPSEEK3_PIPELINE, "shard_mode": "explicit"}, 4),
    # a pipeline of stages of 6 sequential layers with layers left out: their RNG state (layers_0's only)
    ("0.2.5", "qwen3-0.6b", "tpu7x-8", "default", QWEN3_PIPELINE),
    # Qwen3-Next's cycles as Qwen3NextScannableBlock holds them: local_layers (a scan in the scan) and global_layer
    ("0.2.5", "qwen3-next-80b-a3b", "tpu7x-16", "default", {"ici_expert_parallelism": 4, "ici_tensor_parallelism": 2}),
    ("0.2.5", "qwen3-next-80b-a3b", "tpu7x-8", "default", {}),
    ("0.2.5", "qwen3-next-80b-a3b", "tpu7x-8", "shard-exp-on-fsdp", {"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 2}),
    ("0.2.5", "qwen3-next-80b-a3b", "tpu7x-8", "default", {"shard_mode": "explicit"}),  # 0.2.5 accepts it explicit
    ("0.2.5", "qwen3-next-80b-a3b", "tpu7x-16", "fsdp-as-dp-for-attn", {}),  # Gated DeltaNet's kernels on embed_attn
    ("0.2.5", "qwen3-next-80b-a3b", "tpu7x-16", "default",  # ZeRO-1 (no FSDP, as 0.2.5 takes it) on the nested stacks
     {"ici_fsdp_parallelism": 1, "ici_data_parallelism": 4, "ici_expert_parallelism": 4, "shard_optimizer_over_data": True}),
    # Gemma 3's pipeline (stages of one layer): the decoder keeps the shared nnx.Rngs (layers_remainder's unpipelined)
    ("0.2.5", "gemma3-4b", "tpu7x-8", "default", PIPELINE),
    # pipelines of MoE blocks (stages of one layer or one cycle): each stage layer's MoE block keeps its RNG state
    ("0.2.5", "mixtral-8x7b", "tpu7x-16", "default", {**PIPELINE, "ici_expert_parallelism": 2}),
    ("0.2.5", "qwen3-30b-a3b", "tpu7x-16", "default", {**PIPELINE, "ici_expert_parallelism": 2}),
    ("0.2.5", "llama4-17b-16e", "tpu7x-16", "default", {**PIPELINE, "ici_expert_parallelism": 2}),
    ("0.2.5", "gpt-oss-20b", "tpu7x-16", "default", PIPELINE),
    ("0.2.5", "olmo3-7b", "v6e-8", "default", PIPELINE),
    # gpt-oss's attention output recorded under MaxText's name for it (attentions/out)
    ("0.2.5", "gpt-oss-20b", "tpu7x-16", "shard-exp-on-fsdp",
     {"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 2}),
    # two slices, data parallel over DCN: the NNX decoder's scan records a layer's input as nnx_decoders/carry
    ("0.2.5", "llama2-7b", "v5p-8", "default", {"dcn_data_parallelism": 2}, 2),
    # and Gemma 3's: its layers' inputs recorded as gemma3/inputs, gemma3/y and (the remainder's) nnx_decoders/y_in
    ("0.2.5", "gemma3-4b", "tpu7x-8", "default", {"dcn_data_parallelism": 2}, 2),
    ("0.2.4", "qwen3-0.6b", "tpu7x-16", "default", {}),
    ("0.2.4", "qwen3-0.6b", "tpu7x-16", "default", {"ici_data_parallelism": 2, "shard_optimizer_over_data": True}),
    ("0.2.4", "deepseek2-16b", "tpu7x-16", "default", {}),
    ("0.2.4", "gemma4-26b", "tpu7x-16", "default", {"ici_tensor_parallelism": 2, "ici_expert_parallelism": 4}),
    ("0.2.4", "llama2-7b", "v5p-16", "pure-fsdp", {}),
    ("0.2.4", "qwen3.5-35b-a3b", "tpu7x-8", "default", {}),
    ("0.2.4", "deepseek2-16b", "v6e-16", "pipeline-large-moe", DEEPSEEK2_PIPELINE),
    # its pipelines of Gemma 3 and Mixtral: each stage layer's RNG state, its Dropouts' too, and the decoder's own
    ("0.2.4", "gemma3-4b", "tpu7x-8", "default", PIPELINE),
    ("0.2.4", "mixtral-8x7b", "tpu7x-16", "default", {**PIPELINE, "ici_expert_parallelism": 2}),
    # e591f30's NNX build keeps the layer axis `layers` (on `stage`) on the layers a pipeline leaves out
    ("0.2.4", "qwen3-0.6b", "tpu7x-8", "default", QWEN3_PIPELINE),
    ("0.2.4", "llama2-7b", "v5p-8", "default",  # ZeRO-1 in explicit mode, as in auto mode (e591f30's NNX build too)
     {"ici_data_parallelism": 2, "shard_optimizer_over_data": True, "opt_type": "adam_pax", "shard_mode": "explicit"}),
]


def case_of(version: str, model: str, topology: str, rule: str, overrides: dict, num_slices: int = 1) -> Case:
    return Case.make(model, topology, rule, num_slices, {**overrides, "maxtext_version": version})


def test_every_reference_of_a_release_is_a_case_here():
    kept = sorted(p.parent for p in RELEASES.rglob("named_shardings.json"))
    if not kept:
        pytest.fail(f"MaxText release dumps not found under {RELEASES}", pytrace=False)
    assert kept == sorted(golden_dir(case_of(*c), RELEASES / c[0]) for c in CASES)


def by_default(entry: tuple) -> str:
    """What keeps a comparison in the default suite (helpers.sweep_beyond_first): each case of the matrix
    (its golden test traces it in the same worker, tests/conftest.py), and the first other case of
    each release; the rest run with -m sweep."""
    label = case_of(*entry).label
    return label if label in MATRIX_LABELS else entry[0]


MATRIX_LABELS = frozenset(c.label for c in load_matrix())


@pytest.mark.parametrize("entry", sweep_beyond_first(CASES, by_default), ids=lambda c: f"{c[0]}:{case_of(*c).label}")
def test_release_case_matches_maxtexts_nnx_dump_by_path(entry, tmp_path):
    case = case_of(*entry)
    check_or_update(case, tmp_path, update=True)
    ok, report = compare_maxtext_tool()["compare"](golden_dir(case, RELEASES / entry[0]), golden_dir(case, tmp_path))
    assert ok, report
    assert " 0 differ, 0 only in reference, 0 only in ours; (shape, spec) multiset remainder 0 + 0" in report


def test_the_new_rule_as_typed_writes_maxtext_025s_dump(tmp_path, capsys):
    """`sharding-dump --model qwen3-0.6b --topology tpu7x-16 --rule fsdp-as-dp-for-attn`, no release named: the
    default, MaxText 0.2.5 as it ships (its NNX build, its seventh rule file), writes MaxText 0.2.5's own dump of
    that case by path, every leaf and every activation record with known axes."""
    from sharding_dump.commands.cli import main
    from sharding_dump.golden import codec
    from sharding_dump.zoo import reference

    assert main(["--model", "qwen3-0.6b", "--topology", "tpu7x-16", "--rule", "fsdp-as-dp-for-attn",
                 "--output-dir", str(tmp_path)]) == 0, capsys.readouterr().err
    ours = tmp_path / "qwen3-0.6b/tpu7x-16/slice_1/rule_fsdp-as-dp-for-attn"
    theirs = RELEASES / "0.2.5" / ours.relative_to(tmp_path)
    ok, report = compare_maxtext_tool()["compare"](theirs, ours)
    assert ok and " 0 differ, 0 only in reference, 0 only in ours; (shape, spec) multiset remainder 0 + 0" in report, \
        report
    result = reference.compare(reference.load_reference(theirs / "input_shardings.json"),
                               codec.read_document(ours / "activation_shardings.json"), reference.call_sites())
    assert result.ok and result.checked == CHECKED["qwen3-0.6b/tpu7x-16/slice_1/rule_fsdp-as-dp-for-attn"], \
        result.report("as typed")


# Cases whose MaxText dump is kept for its activation records only (input_shardings.json): a pipeline, as
# 0.2.5 and as e591f30's NNX build (its default) record it, and e591f30's NNX build of a dense case.
ACTIVATION_ONLY = [("0.2.5", "llama2-7b", "v5p-8", "default", PIPELINE),
                   ("0.2.4", "llama2-7b", "v5p-8", "default", PIPELINE)]
# MaxText's records of each kept activation dump (by our case's label) that the comparison checks (known
# logical axes, or a call site data/maxtext_call_sites.yml names): every case adds
# attention_op/decoder_segment_ids (twice under ep-as-cp: the queries' split over expert, the keys' not); the
# pipeline records its stages' own constraints at the stage's shape (36
# records, 14 checked); Qwen3-Next's attention output names 3 logical axes for its 4 dimensions and is recorded at
# its full shape (no vmap added any).
CHECKED = {
    "qwen3-0.6b/tpu7x-16/slice_1/rule_default": 8,
    "qwen3-0.6b/tpu7x-16/slice_1/rule_default_maxtext_version=0.2.4": 8,
    "qwen3-0.6b/tpu7x-16/slice_1/rule_fsdp-as-dp-for-attn": 8,
    "deepseek2-16b/tpu7x-16/slice_1/rule_default": 22,
    "deepseek2-16b/tpu7x-8/slice_1/rule_ep-as-cp_ici_fsdp_parallelism=-1_ici_expert_parallelism=2": 23,
    "llama2-7b/v5p-8/slice_1/rule_default_ici_pipeline_parallelism=2_num_pipeline_microbatches=8": 14,
    "llama2-7b/v5p-8/slice_1/rule_default_ici_pipeline_parallelism=2_maxtext_version=0.2.4_"
    "num_pipeline_microbatches=8": 14,
    "llama2-7b/v5p-8/slice_2/rule_default_dcn_data_parallelism=2": 10,
    "gemma3-4b/tpu7x-8/slice_2/rule_default_dcn_data_parallelism=2": 13,
    "deepseek2-16b/v6e-16/slice_1/rule_pipeline-large-moe_ici_pipeline_parallelism=4_maxtext_version=0.2.4_"
    "num_pipeline_microbatches=4_pipeline_parallel_layers=24": 46,
    "gemma3-4b/tpu7x-8/slice_1/rule_default_ici_pipeline_parallelism=2_num_pipeline_microbatches=8": 14,
    "gemma3-4b/tpu7x-8/slice_1/rule_default_ici_pipeline_parallelism=2_maxtext_version=0.2.4_"
    "num_pipeline_microbatches=8": 12,
    "gpt-oss-20b/tpu7x-16/slice_1/rule_shard-exp-on-fsdp_ici_fsdp_parallelism=-1_ici_expert_parallelism=2": 9,
    "qwen3-0.6b/tpu7x-8/slice_1/rule_default_ici_pipeline_parallelism=2_num_pipeline_microbatches=8_"
    "num_pipeline_repeats=2_num_layers_per_pipeline_stage=6_pipeline_parallel_layers=24": 20,
    "qwen3-0.6b/tpu7x-8/slice_1/rule_default_ici_pipeline_parallelism=2_maxtext_version=0.2.4_"
    "num_pipeline_microbatches=8_num_pipeline_repeats=2_num_layers_per_pipeline_stage=6_"
    "pipeline_parallel_layers=24": 20,
    "qwen3-next-80b-a3b/tpu7x-16/slice_1/rule_default_ici_tensor_parallelism=2_ici_expert_parallelism=4": 10,
    "qwen3-next-80b-a3b/tpu7x-8/slice_1/rule_shard-exp-on-fsdp_ici_fsdp_parallelism=-1_ici_expert_parallelism=2": 10,
}


def activation_cases():
    """Every kept MaxText activation dump and its case."""
    kept = sorted(RELEASES.rglob("input_shardings.json"))
    assert kept, f"no MaxText activation dump under {RELEASES}"
    entries = {golden_dir(case_of(*c), RELEASES / c[0]): c for c in CASES + ACTIVATION_ONLY}
    assert all(path.parent in entries for path in kept), [str(p) for p in kept if p.parent not in entries]
    return [(path, entries[path.parent]) for path in kept]


@pytest.mark.parametrize("kept", activation_cases(), ids=lambda k: f"{k[1][0]}:{case_of(*k[1]).label}")
def test_release_activations_match_ours_by_name(kept, tmp_path):
    """MaxText 0.2.5's activation records (its NNX build's dump with debug_sharding=true), each found among
    ours by name (its call site, data/maxtext_call_sites.yml) with the same shape, dtype, logical axes and
    spec (size-1 mesh axes dropped); a record with unknown logical axes whose call site the table names
    (decoder_segment_ids) on its shape, dtype and spec."""
    from sharding_dump.golden import codec
    from sharding_dump.zoo import reference

    path, entry = kept
    case = case_of(*entry)
    check_or_update(case, tmp_path, update=True)
    result = reference.compare(reference.load_reference(path),
                               codec.read_document(golden_dir(case, tmp_path) / "activation_shardings.json"),
                               reference.call_sites())
    assert result.ok and result.checked == CHECKED[case.label], result.report(case.label)


def test_the_previous_release_differs_from_maxtext_025s_dump(tmp_path, capsys):
    """The comparison bites: deepseek2-16b as 0.2.4's NNX build builds it (attention kernels on `embed`, its router on
    `embed_moe`, both split over fsdp by fsdp-as-dp-for-attn's `embed` and `embed_moe` rules, given as a
    file since 0.2.4 has no rule of that name) is not MaxText 0.2.5's."""
    entry = next(c for c in CASES if c[1] == "deepseek2-16b" and c[3] == "fsdp-as-dp-for-attn")
    case = case_of(*entry)
    old = Case.make(entry[1], entry[2], str(case.rule_set().path), overrides={"maxtext_version": "0.2.4"})
    check_or_update(old, tmp_path, update=True)
    ok, report = compare_maxtext_tool()["compare"](golden_dir(case, RELEASES / entry[0]), golden_dir(old, tmp_path))
    assert not ok
    assert "84 match by path" not in report and "21 differ" in report  # 7 kernels, their mu and nu
    assert "model/decoder/dense_layers/self_attention/query/kernel\n      reference shape [2048,1,16,192] spec " \
           "[null,null,null,null]\n      ours      shape [2048,1,16,192] spec [\"fsdp\",null,null,null]" in report
    assert "model/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel\n      reference shape [2048,26,64] " \
           "spec [null,null,null]\n      ours      shape [2048,26,64] spec [\"fsdp\",null,null]" in report
