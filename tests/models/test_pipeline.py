"""Pipeline parallelism: stacked weights on `stage`, the traced schedule, numerics, bad settings."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from helpers import LINEN, REPO, assert_bad_input, committed_golden, matrix_setups, run_cli, sweep_beyond_first
from sharding_dump.core import capture as activations
from sharding_dump.core.state import parameter_count
from sharding_dump.errors import BadInput
from sharding_dump.models.pipeline import PipelineConfig, stage_as_data
from sharding_dump.zoo import cards, state
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.dump import setup_case, trace_case
from sharding_dump.zoo.matrix import load_matrix
from sharding_dump.zoo.pipeline_plan import check_batch

MATRIX = load_matrix()
SETUPS = matrix_setups()
PIPELINE_CASES = [c for c in MATRIX if SETUPS[c.label].pipeline is not None]
STAGES = "/decoder/pipeline_module/layers/"  # MaxText's path of the stacked stages


def test_matrix_has_the_pipeline_cases():
    assert len(PIPELINE_CASES) >= 2
    assert any(SETUPS[c.label].pipeline.uses_circular_storage for c in PIPELINE_CASES)
    assert any(SETUPS[c.label].pipeline.num_layers < SETUPS[c.label].config.num_decoder_layers
               for c in PIPELINE_CASES)


def test_matrix_covers_every_stage_layout():
    layouts = {(p.layers_per_stage > 1, p.scan_layers_per_stage)
               for p in (SETUPS[c.label].pipeline for c in PIPELINE_CASES)}
    assert layouts == {(False, False), (True, False), (True, True)}


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=lambda c: c.label)
def test_stacked_layer_weights_are_laid_out_as_maxtext(case):
    """[R,] N leading dims named ([circular_repeats,] layers), stage on `stage`; a stage of one layer
    has no layer axis of its own, K unscanned layers are `layers_<k>`, K scanned ones share one
    weight with `layers_per_stage` (size K) at position 1 of the layer's own axes."""
    named, logical = (committed_golden(case, n)["tensors"] for n in ("named_shardings.json", "logical_shardings.json"))
    # Every stacked weight and its moments; the NNX build's RNG state, and a routed bias 0.2.5 keeps as model
    # state (state.ROUTED_BIAS, no moments), are stacked as MaxText stacks them with no logical axes to check.
    stacked = [path for path in named if STAGES in path and "/rngs/" not in path
               and not (path.startswith("model/") and path.endswith(state.ROUTED_BIAS)
                        and f"optimizer/opt_state/0/mu/{path.split('/', 1)[1]}" not in named)]
    assert len(stacked) >= 3 * 9  # params, mu and nu of every stacked weight
    pp = SETUPS[case.label].pipeline
    lead = ["circular_repeats", "layers"] if pp.num_repeats > 1 else ["layers"]
    unscanned = pp.layers_per_stage > 1 and not pp.scan_layers_per_stage
    scanned = pp.layers_per_stage > 1 and pp.scan_layers_per_stage
    for path in stacked:
        axes, shape = logical[path]["logical_axes"], named[path]["shape"]
        assert axes[:len(lead)] == lead, (path, axes)
        assert shape[:len(lead)] == ([pp.num_repeats] if pp.num_repeats > 1 else []) + [pp.num_stages], path
        assert named[path]["partition_spec"][len(lead) - 1] == "stage", path
        if scanned:
            assert axes[len(lead) + 1] == "layers_per_stage" and shape[len(lead) + 1] == pp.layers_per_stage, path
        else:
            assert "layers_per_stage" not in axes, (path, axes)
        stage_part = path.split(STAGES, 1)[1]
        assert stage_part.startswith("layers_") == unscanned, path
        assert stage_part.startswith("scanned_layers/") == scanned, path
    if unscanned:
        assert {p.split(STAGES, 1)[1].split("/")[0] for p in stacked} == {
            f"layers_{k}" for k in range(pp.layers_per_stage)}


def test_layers_outside_the_pipeline_are_not_on_stage():
    """MaxText names the layers a pipeline leaves out, and their layer axis, `layers_outside_pipeline` (no
    rule: unsharded); DeepSeek's leftover MoE layers keep the layer axis `moe_layers`, in a module its NNX
    build names `moe_layers_outside_pipeline` (its Linen build: `moe_layers`), its dense layers `dense_layers`."""
    for case in PIPELINE_CASES:
        setup = SETUPS[case.label]
        if setup.pipeline.num_layers == cards.pipelined_stack_length(setup.config):
            continue
        named, logical = (committed_golden(case, n)["tensors"] for n in ("named_shardings.json", "logical_shardings.json"))
        axis = "moe_layers" if setup.config.first_num_dense_layers else "layers_outside_pipeline"
        nnx = any(p.startswith("model/") for p in named)  # MaxText's NNX build (the Linen one: params/...)
        module = "moe_layers_outside_pipeline" if axis == "moe_layers" and nnx else axis
        outside = [p for p in named if p.startswith((f"params/decoder/{module}/", f"model/decoder/{module}/"))
                   and "/rngs/" not in p]  # the NNX build's RNG state has no logical axes
        assert outside
        for path in outside:
            axes = logical[path]["logical_axes"]
            assert axis in axes and "stage" not in json.dumps(named[path]["partition_spec"]), (path, axes)


@pytest.mark.parametrize("case", sweep_beyond_first(PIPELINE_CASES, lambda c: SETUPS[c.label].config.num_experts > 1),
                         ids=lambda c: c.label)
def test_traced_step_shifts_with_ppermute_and_constrains_stage_buffers(case):
    """The traced training step moves microbatches with a ppermute ring on `stage` inside a shard_map,
    and the activation dump holds the stage buffers with `activation_stage` on `stage`."""
    setup = SETUPS[case.label]
    pp, cfg, batch = setup.pipeline, setup.config, setup.batch
    closed, _ = trace_case(setup)
    eqns = [eqn for eqn, _ in activations.equations(closed)]
    shifts = [e for e in eqns if e.primitive.name == "ppermute"]
    assert shifts and all(e.params["axis_name"] == ("stage",) for e in shifts)
    assert any(e.primitive.name == "shard_map" for e in eqns)
    ring = tuple((s, (s + 1) % pp.num_stages) for s in range(pp.num_stages))
    assert any(tuple(e.params["perm"]) == ring for e in shifts)
    micro = (batch.global_batch_size // pp.num_microbatches, batch.max_target_length, cfg.emb_dim)
    buffers = {
        "pipeline_state_io": (pp.num_stages, pp.microbatches_per_stage) + micro,
        "pipeline_shift": (pp.num_stages,) + micro,
    }
    if pp.uses_circular_storage:
        buffers["pipeline_circular_storage"] = (pp.num_stages, pp.num_microbatches) + micro
    dumped = committed_golden(case, "activation_shardings.json")["tensors"]
    for name, shape in buffers.items():
        entries = [e for e in dumped.values() if e["name"] == name and e["pass"] == "forward"]
        assert entries, f"{name} is not in the activation dump"
        for entry in entries:
            assert tuple(entry["shape"]) == shape, (name, entry["shape"])
            assert entry["logical_axes"][0] == "activation_stage" and entry["partition_spec"][0] == "stage", entry


def test_pipeline_keeps_every_parameter():
    counts = {}
    for case in (MATRIX[0], PIPELINE_CASES[0]):
        counts[case.label] = parameter_count(state.abstract_state(SETUPS[case.label].config, pipeline=SETUPS[case.label].pipeline))
    assert len(set(counts.values())) == 1, counts


def test_schedule_arithmetic():
    pp = PipelineConfig(num_stages=4, num_microbatches=8, num_repeats=2, num_layers=56, layers_per_stage=7)
    assert (pp.microbatches_per_stage, pp.num_iterations) == (2, 19)
    assert pp.uses_circular_storage and not dataclasses.replace(pp, num_microbatches=4).uses_circular_storage
    with pytest.raises(BadInput, match="num_pipeline_microbatches=8: does not divide the global batch of 12"):
        check_batch(pp, 12)


def test_maxtext_defaults_one_layer_per_stage_and_derived_repeats():
    """num_layers_per_pipeline_stage=1, num_pipeline_repeats=-1 (layers / stages), one microbatch per stage."""
    setup = setup_case(Case.make("llama2-7b", "v5p-8", "default", overrides={"ici_pipeline_parallelism": 4}))
    assert setup.pipeline == PipelineConfig(4, 4, 8, 32, 1, False)
    setup = setup_case(Case.make("llama2-7b", "v5p-8", "default", overrides={
        "ici_pipeline_parallelism": 4, "num_layers_per_pipeline_stage": 4}))
    assert setup.pipeline == PipelineConfig(4, 4, 2, 32, 4, False)
    deepseek = setup_case(Case.make("deepseek2-16b", "v6e-16", "pipeline-large-moe",
                                    overrides={"ici_pipeline_parallelism": 4, "pipeline_parallel_layers": 24}))
    assert deepseek.pipeline == PipelineConfig(4, 4, 6, 24, 1, False)


def test_pipelined_run_puts_stage_first_in_the_logits_batch():
    case = next(c for c in PIPELINE_CASES if c.rule == "default")
    rules = dict(SETUPS[case.label].rule_set.logical_axis_rules)
    assert rules["activation_embed_and_logits_batch"] == ("stage", "data", "fsdp", "fsdp_transpose", "expert")
    acts = committed_golden(case, "activation_shardings.json")["tensors"]
    assert acts["forward/decoder/logits"]["partition_spec"][0][0] == "stage"
    assert acts["forward/inputs"]["partition_spec"][0][0] == "stage"


def test_deepseek_dense_layers_split_over_stage_as_data():
    """Under a pipeline MaxText runs DeepSeek's dense layers (and the MoE layers left out) with
    logical_axis_rules_pp_act_as_dp: their activation batch goes over stage, just before data."""
    case = next(c for c in PIPELINE_CASES if c.model == "deepseek2-16b" and "pipeline_parallel_layers" in dict(c.overrides))
    acts = committed_golden(case, "activation_shardings.json")["tensors"]
    for key in ("forward/decoder/dense_layers/inputs", "forward/decoder/moe_layers_outside_pipeline/inputs"):
        assert acts[key]["partition_spec"][0][:2] == ["stage", "data"], (key, acts[key]["partition_spec"])
    piped = acts["forward/decoder/pipeline_module/layers/inputs"]["partition_spec"]
    assert "stage" not in json.dumps(piped[1:]), piped


def test_layers_outside_the_pipeline_use_stage_as_data():
    rules = (("activation_batch", ("data", "fsdp")), ("activation_stage", "stage"), ("layers", "stage"),
             ("embed_and_batch", ("fsdp", "stage", "data")))
    assert stage_as_data(rules) == (("activation_batch", ("stage", "data", "fsdp")), ("activation_stage", ()),
                                    ("layers", ()), ("embed_and_batch", ("fsdp", "stage", "data")))


BAD = [
    ("ici_pipeline_parallelism=2 num_pipeline_microbatches=3",
     "num_pipeline_microbatches=3: must be a multiple of the 2 pipeline stages"),
    ("ici_pipeline_parallelism=2 num_pipeline_repeats=3",
     "num_pipeline_repeats=3: stages x repeats x num_layers_per_pipeline_stage = 2 x 3 x 1 = 6 must equal "
     "pipeline_parallel_layers (32;"),
    ("ici_pipeline_parallelism=2 num_pipeline_repeats=2 pipeline_parallel_layers=10",
     "2 x 2 x 1 = 4 must equal pipeline_parallel_layers (10;"),
    ("ici_pipeline_parallelism=2 num_layers_per_pipeline_stage=3",
     "num_layers_per_pipeline_stage=3 x 2 stages = 6 must divide pipeline_parallel_layers (32;"),
    ("ici_pipeline_parallelism=2 pipeline_parallel_layers=40", "pipeline_parallel_layers=40: must be -1"),
    ("--rule pure-fsdp ici_pipeline_parallelism=2", "ici_pipeline_parallelism=2: rule 'pure-fsdp' has no 'stage' mesh axis"),
    ("--rule pure-fsdp num_pipeline_microbatches=4",
     "num_pipeline_microbatches=4: needs a pipeline (ici_pipeline_parallelism x dcn_pipeline_parallelism > 1), "
     "but rule 'pure-fsdp' has no 'stage' mesh axis"),
    ("num_pipeline_repeats=2", "num_pipeline_repeats=2: needs a pipeline"),
    ("scan_layers_per_stage=true", "scan_layers_per_stage=true: needs a pipeline"),
    ("num_layers_per_pipeline_stage=2", "num_layers_per_pipeline_stage=2: needs a pipeline"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[a for a, _ in BAD])
def test_bad_pipeline_settings_are_one_line(tmp_path, capsys, args, message):
    assert_bad_input(tmp_path, capsys, args, message)


def test_rule_without_stage_mapping_is_bad_input(tmp_path):
    rule = tmp_path / "no-stage-layers.yml"
    rule.write_text("mesh_axes: [stage, fsdp]\nlogical_axis_rules:\n  - [embed, fsdp]\n  - [activation_stage, stage]\n")
    result = run_cli("--model", "llama2-7b", "--topology", "v5p-8", "--rule", str(rule), "ici_pipeline_parallelism=2",
                     "--output-dir", str(tmp_path / "o"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == ("sharding-dump: error: rule 'no-stage-layers': a pipeline needs logical axis 'layers' "
                             "on mesh axis 'stage' (got None)\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.compile
def test_pipelined_logits_equal_the_plain_stack():
    """Run on 4 CPU devices: the schedule (state_io, circular storage, ppermute shifts) must not change
    the numbers the model computes."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "tests" / "models" / "pipeline_equivalence.py")], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["ppermute"], row
        assert row["max_abs_diff"] <= 1e-5 * row["scale"] and row["scale"] > 0.1, row


# MaxText (e591f30) counts a pipeline's layers in units of the pipelined stack, which is a scanned
# block for these blocks; its own dumps of the pipelined cases hold these parameter counts (a pipelined
# gemma4 is built as MaxText's Linen build: its NNX builds place it otherwise, data/maxtext_releases.yml).
SCAN_BLOCK_PIPELINES = [
    ("gemma4-31b", "tpu7x-8", {"ici_pipeline_parallelism": 2, **LINEN}, PipelineConfig(2, 2, 30, 60, 1, False), 360),
    ("olmo3-32b", "tpu7x-8", {"ici_pipeline_parallelism": 4}, PipelineConfig(4, 4, 16, 64, 1, False), 256),
    ("olmo3-32b", "tpu7x-8", {"ici_pipeline_parallelism": 4, "num_pipeline_repeats": 2,
                              "num_layers_per_pipeline_stage": 8}, PipelineConfig(4, 4, 2, 64, 8, False), 256),
    ("gemma3-4b", "tpu7x-8", {"ici_pipeline_parallelism": 2}, PipelineConfig(2, 2, 17, 34, 1, False), 34),
]


@pytest.mark.parametrize("model,topology,overrides,expected,layers", SCAN_BLOCK_PIPELINES,
                         ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for m, _, o, _, _ in SCAN_BLOCK_PIPELINES])
def test_pipelines_count_units_of_the_stack_as_maxtext(model, topology, overrides, expected, layers):
    """gemma4's unit is a scanned block of 6 layers, olmo3's of 4: MaxText's default pipeline takes
    `num_decoder_layers` of them (so 360 and 256 layers); Gemma 3 pipelines single layers."""
    setup = setup_case(Case.make(model, topology, "default", overrides=overrides))
    assert setup.pipeline == expected
    assert cards.built_layers(setup.config, pipelined=True) == layers
    assert cards.built_layers(setup.config, pipelined=False) == setup.config.num_decoder_layers
