"""Pipeline parallelism: stacked weights on `stage`, the traced schedule, numerics, bad settings."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, assert_bad_input, run_cli
from sharding_dump import activations, serialize, state, train_step
from sharding_dump.case import Case, golden_dir, load_matrix
from sharding_dump.dump import dump_case, setup_case
from sharding_dump.errors import BadInput
from sharding_dump.models.pipeline import PipelineConfig, stage_as_data

MATRIX = load_matrix()
SETUPS = {case.label: setup_case(case) for case in MATRIX}
PIPELINE_CASES = [c for c in MATRIX if SETUPS[c.label].config.pipeline is not None]


def test_matrix_has_the_pipeline_cases():
    assert len(PIPELINE_CASES) >= 2
    assert any(SETUPS[c.label].config.pipeline.uses_circular_storage for c in PIPELINE_CASES)
    assert any(SETUPS[c.label].config.pipeline.num_layers < SETUPS[c.label].config.num_decoder_layers
               for c in PIPELINE_CASES)


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=lambda c: c.label)
def test_stacked_layer_weights_are_on_stage(case):
    docs = dump_case(case)
    named, logical = docs["named_shardings.json"]["tensors"], docs["logical_shardings.json"]["tensors"]
    stacked = [path for path in named if "/stages/" in path]
    assert len(stacked) >= 3 * 9  # params, mu and nu of every stacked weight
    pp = SETUPS[case.label].config.pipeline
    for path in stacked:
        axes = logical[path]["logical_axes"]
        assert "layers" in axes and "layers_per_stage" in axes, (path, axes)
        stage_dim = axes.index("layers")
        assert named[path]["partition_spec"][stage_dim] == "stage", path
        assert named[path]["shape"][stage_dim] == pp.num_stages
        assert named[path]["shape"][axes.index("layers_per_stage")] == pp.layers_per_stage


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=lambda c: c.label)
def test_traced_step_shifts_with_ppermute_and_constrains_stage_buffers(case):
    """The traced training step moves microbatches with a ppermute ring on `stage` inside a shard_map,
    and the activation dump holds the stage buffers with `activation_stage` on `stage`."""
    setup = SETUPS[case.label]
    pp, cfg, batch = setup.config.pipeline, setup.config, setup.batch
    closed, _ = train_step.trace_step(cfg, state.abstract_state(cfg), setup.plan, setup.rule_set, batch,
                                      state.optimizer())
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
    dumped = serialize.read_document(golden_dir(case, REPO / "golden") / "activation_shardings.json")["tensors"]
    for name, shape in buffers.items():
        entries = [e for e in dumped.values() if e["name"] == name and e["pass"] == "forward"]
        assert entries, f"{name} is not in the activation dump"
        for entry in entries:
            assert tuple(entry["shape"]) == shape, (name, entry["shape"])
            assert entry["logical_axes"][0] == "activation_stage" and entry["partition_spec"][0] == "stage", entry


def test_pipeline_keeps_every_parameter():
    counts = {}
    for case in (MATRIX[0], PIPELINE_CASES[0]):
        counts[case.label] = state.parameter_count(state.abstract_state(SETUPS[case.label].config))
    assert len(set(counts.values())) == 1, counts


def test_schedule_arithmetic():
    pp = PipelineConfig(num_stages=4, num_microbatches=8, num_repeats=2, num_layers=56)
    assert (pp.layers_per_stage, pp.microbatches_per_stage, pp.num_iterations) == (7, 2, 19)
    assert pp.uses_circular_storage and not dataclasses.replace(pp, num_microbatches=4).uses_circular_storage
    with pytest.raises(BadInput, match="num_pipeline_microbatches=8: does not divide the global batch of 12"):
        pp.check_batch(12)


def test_default_microbatches_are_one_per_stage():
    setup = setup_case(Case.make("llama2-7b", "v5p-8", "default", overrides={"ici_pipeline_parallelism": 4}))
    assert setup.config.pipeline == PipelineConfig(4, 4, 1, 32)


def test_layers_outside_the_pipeline_use_stage_as_data():
    rules = (("activation_batch", ("data", "fsdp")), ("activation_stage", "stage"), ("layers", "stage"),
             ("embed_and_batch", ("fsdp", "stage", "data")))
    assert stage_as_data(rules) == (("activation_batch", ("stage", "data", "fsdp")), ("activation_stage", ()),
                                    ("layers", ()), ("embed_and_batch", ("fsdp", "stage", "data")))


BAD = [
    ("ici_pipeline_parallelism=2 num_pipeline_microbatches=3",
     "num_pipeline_microbatches=3: must be a multiple of the 2 pipeline stages"),
    ("ici_pipeline_parallelism=2 num_pipeline_repeats=3",
     "the model's layers (32) must be divisible by stages x repeats = 2 x 3"),
    ("ici_pipeline_parallelism=2 num_pipeline_repeats=2 pipeline_parallel_layers=10",
     "pipeline_parallel_layers (10) must be divisible by stages x repeats = 2 x 2"),
    ("ici_pipeline_parallelism=2 pipeline_parallel_layers=40", "pipeline_parallel_layers=40: must be -1"),
    ("--rule pure-fsdp ici_pipeline_parallelism=2", "ici_pipeline_parallelism=2: rule 'pure-fsdp' has no 'stage' mesh axis"),
    ("--rule pure-fsdp num_pipeline_microbatches=4",
     "num_pipeline_microbatches=4: needs a pipeline (ici_pipeline_parallelism x dcn_pipeline_parallelism > 1), "
     "but rule 'pure-fsdp' has no 'stage' mesh axis"),
    ("num_pipeline_repeats=2", "num_pipeline_repeats=2: needs a pipeline"),
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


def test_pipelined_logits_equal_the_plain_stack():
    """Run on 4 CPU devices: the schedule (state_io, circular storage, ppermute shifts) must not change
    the numbers the model computes."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(REPO / "tests" / "pipeline_equivalence.py")], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["ppermute"], row
        assert row["max_abs_diff"] <= 1e-5 * row["scale"] and row["scale"] > 0.1, row
