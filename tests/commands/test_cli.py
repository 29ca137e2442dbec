"""The command line as a user meets it: real dumps, bad input, determinism, the golden tree."""

import json
import shutil

import pytest

from helpers import REPO, assert_bad_input, run_cli, tree_bytes
from sharding_dump.commands.cli import main
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.goldens import check_or_update
from sharding_dump.zoo.matrix import load_matrix


def test_dump_one_case(tmp_path, capsys):
    """In this process: a fresh process is what the hash-seed test below runs."""
    assert main(["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "pure-fsdp",
                 "--output-dir", str(tmp_path)]) == 0
    folder = tmp_path / "llama2-7b/v5p-16/slice_1/rule_pure-fsdp"
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith(f"{folder}/: wrote activation_shardings.json, "), captured
    named = json.loads((folder / "named_shardings.json").read_text())
    assert named["mesh"] == {"axis_names": ["fsdp"], "axis_sizes": [8], "shard_mode": "auto"}
    assert named["tensors"]["model/decoder/layers/mlp/wi_0/kernel"]["partition_spec"] == ["fsdp", None, None]
    assert (folder / "named_shardings.json").read_bytes() == (REPO / "golden" / folder.relative_to(tmp_path)
                                                              / "named_shardings.json").read_bytes()


def test_settings_are_taken_anywhere_on_the_command_line(tmp_path, capsys):
    """KEY=VALUE between and after options (`--golden-dir DIR shard_mode=...` was refused as unrecognized
    arguments): the case is the one with the settings at the end, its golden byte for byte (mutation:
    `parse_args` instead of `parse_intermixed_args` in cli.run, exit 2)."""
    assert main(["--model", "llama2-7b", "ici_data_parallelism=2", "--topology", "v5p-8", "--golden-dir", str(tmp_path),
                 "shard_optimizer_over_data=true", "--rule", "default", "opt_type=adam_pax", "maxtext_version=0.2.4"]) == 0, capsys.readouterr()
    folder = "llama2-7b/v5p-8/slice_1/rule_default_ici_data_parallelism=2_maxtext_version=0.2.4_shard_optimizer_over_data=true_opt_type=adam_pax"
    assert tree_bytes(tmp_path / folder) == tree_bytes(REPO / "golden" / folder)
def test_maxtext_keys_that_move_no_layout_are_taken_on_the_command_line(tmp_path, capsys):
    """A MaxText user's overrides (MaxText's DeepSeek-V3.2 needs attention=dot_product): the case is the
    one without them, byte for byte; a key MaxText does not have is still refused."""
    case = ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "pure-fsdp", "--output-dir", str(tmp_path)]
    assert main(case + ["attention=dot_product", "sa_block_q=256", "use_tokamax_splash=true"]) == 0
    folder = tmp_path / "llama2-7b/v5p-16/slice_1/rule_pure-fsdp"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["rule_pure-fsdp"]
    assert (folder / "named_shardings.json").read_bytes() == (REPO / "golden" / folder.relative_to(tmp_path)
                                                              / "named_shardings.json").read_bytes()
    capsys.readouterr()
    assert main(case + ["sa_blok_q=256"]) == 2
    assert "unknown setting 'sa_blok_q'" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--model", "nope", "--topology", "v5p-16", "--rule", "default"],
    ["--model", "llama2-7b", "--topology", "v5p-99", "--rule", "default"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "nope"],
    ["--model", "../llama2-7b", "--topology", "v5p-16", "--rule", "default"],
    ["--model", "llama2-7b", "--topology", "../../v5p-16", "--rule", "default"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "../../../etc/passwd"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "/no/such/rule.yml"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "ici_tensor_parallelism=16"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "no_such_key=1"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "weight_dtype=int3"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "ici_fsdp_parallelism"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "pure-fsdp", "ici_expert_parallelism=2"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "--num-slices", "0"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "per_device_batch_size=0.3"],
    ["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "max_target_length=0"],
    ["--all", "--model", "llama2-7b"],
    ["--model", "llama2-7b"],
    ["list", "galaxies"],
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args):
    """In this process (the CLI's main returns the status; an escaping exception fails the test)."""
    out = tmp_path / "out"
    status = main([*args, "--output-dir", str(out)])
    captured = capsys.readouterr()
    assert status == 2, (captured.out, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sharding-dump: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert not out.exists()


def test_bad_rule_file_names_file_and_field(tmp_path, capsys):
    rule = tmp_path / "broken.yml"
    rule.write_text("mesh_axes: [fsdp]\nlogical_axis_rules:\n  - [embed, tensor]\n")
    assert_bad_input(tmp_path, capsys, f"--model llama2-7b --topology v5p-16 --rule {rule}",
                     f"rule file {rule}: field logical_axis_rules/0 (embed): mesh axis 'tensor' is not in mesh_axes")


# Four cases of different kinds (multi-slice over DCN, context parallelism with a fractional batch,
# a two-stage pipeline, a circular one with unscanned layers per stage): the plugin's tests already
# compare every case with its golden in the pytest process (under pytest's own random hash seed);
# this runs `--all` in a fresh process under a fixed non-default hash seed, on few cases, so the
# matrix runs once.
DETERMINISM_CASES = """\
cases:
  - {model: qwen3-0.6b, topology: a3, num_slices: 2, rule: default}
  - {model: qwen3-0.6b, topology: tpu7x-8, rule: ep-as-cp,
     overrides: {ici_fsdp_parallelism: -1, ici_expert_parallelism: 2, per_device_batch_size: 0.5, max_target_length: 4096}}
  - {model: llama2-7b, topology: v5p-8, rule: default,
     overrides: {ici_pipeline_parallelism: 2, num_pipeline_microbatches: 8}}
  - {model: qwen3-0.6b, topology: tpu7x-8, rule: default,
     overrides: {ici_pipeline_parallelism: 2, num_pipeline_microbatches: 8, num_pipeline_repeats: 2,
                 num_layers_per_pipeline_stage: 6, pipeline_parallel_layers: 24}}
"""


def test_all_in_worker_processes_reproduces_the_goldens_for_another_hash_seed_in_the_cases_order(tmp_path):
    """`--all -j 2` under another hash seed: four cases of two models in two spawned workers (one per
    model, the llama2 case between qwen3's) write the bytes the committed goldens hold, and the
    progress lines keep the case file's order."""
    case_file = tmp_path / "cases.yml"
    case_file.write_text(DETERMINISM_CASES)
    cases = load_matrix(case_file)
    assert {c.label for c in cases} <= {c.label for c in load_matrix()}, "every case here is in the matrix"
    out = tmp_path / "out"
    result = run_cli("--all", "--cases", str(case_file), "--golden-dir", str(out), "-j", "2",
                     env={"PYTHONHASHSEED": "12345"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "sharding-dump goldens: 0 updated, 4 created, 0 unchanged, 0 deleted"
    assert [line.split("] ", 1)[1].split("/: ", 1)[0].split("/out/", 1)[1] for line in lines[:4]] == [
        case.label for case in cases], lines
    golden = tree_bytes(REPO / "golden")
    made = tree_bytes(out)
    assert len(made) == 12 and made == {path: golden[path] for path in made}


def test_list_models_prints_parameter_counts(monkeypatch, capsys):
    """Two cards stand for all (every card's count is held to its checkpoint in tests/zoo/test_cards.py)."""
    from sharding_dump.zoo import cards
    monkeypatch.setattr(cards, "model_names", lambda: ["llama2-7b", "qwen3-0.6b"])
    assert main(["list", "models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["llama2-7b", "llama2", "6,738,415,616", "parameters", "(6.74B)"]
    assert lines[1].split() == ["qwen3-0.6b", "qwen3", "596,049,920", "parameters", "(0.60B)"]
    assert lines[2].startswith("decoder blocks: ") and "deepseek" in lines[2]


def test_list_rules_names_a_later_releases_own_rules(capsys):
    """A rule file only MaxText 0.2.5 has is listed with the setting that takes it."""
    assert main(["list", "rules"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "cp-as-ep"
    assert "fsdp-as-dp-for-attn  mesh_axes: data, fsdp, fsdp_transpose, expert (maxtext_version=0.2.5)" in lines


def test_sixteen_thousand_devices(tmp_path):
    assert main(["--model", "llama2-7b", "--topology", "tpu7x-16384", "--rule", "default",
                 "ici_fsdp_parallelism=-1", "--output-dir", str(tmp_path)]) == 0
    named = json.loads(next(tmp_path.rglob("named_shardings.json")).read_text())
    assert dict(zip(named["mesh"]["axis_names"], named["mesh"]["axis_sizes"]))["fsdp"] == 16384


def test_mutated_rule_is_caught_with_tensor_names(mutated_rule):
    """A user's copy of pure-fsdp.yml with `embed` unsharded maps to the same golden folder and fails."""
    rule = mutated_rule("pure-fsdp", "  - [embed, [fsdp]]\n", "  - [embed, []]\n")
    outcome = check_or_update(Case.make("llama2-7b", "v5p-16", str(rule)), REPO / "golden", update=False)
    assert outcome.status == "differs"
    assert "model/decoder/layers/mlp/wi_0/kernel  (and optimizer/opt_state/0/mu, optimizer/opt_state/0/nu)" in outcome.report
    assert 'partition_spec    golden ["fsdp",null,null]  now [null,null,null]' in outcome.report


def test_missing_golden_fails_with_the_command(tmp_path):
    case = load_matrix()[0]
    outcome = check_or_update(case, tmp_path, update=False)
    assert outcome.status == "missing" and case.command() in outcome.report


def test_update_writes_exactly_cli_bytes(tmp_path):
    case = load_matrix()[0]
    assert check_or_update(case, tmp_path, update=True).status == "written"
    assert check_or_update(case, tmp_path, update=True).status == "match"
    folder = next(tmp_path.rglob("named_shardings.json")).parent
    for f in folder.iterdir():
        assert f.read_bytes() == (REPO / "golden" / f.relative_to(tmp_path)).read_bytes()
    shutil.rmtree(tmp_path / case.model)


def test_help_lists_every_command_on_one_line(capsys):
    """`sharding-dump --help` names each command, dump included, on a line of its own, and each
    command word runs its command."""
    from sharding_dump.commands.cli import COMMANDS

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    listed = lines[lines.index("commands (sharding-dump COMMAND --help for each):") + 1:]
    assert [line.split()[0] for line in listed] == ["dump", "list", "diff", "check", "show", "verify"] == list(COMMANDS)
    assert all(len(line.split()) > 3 for line in listed)
    assert main(["dump", "--model", "qwen3-0.6b", "--topology", "cpu-8", "--rule", "nope"]) == 2
    assert "unknown rule 'nope'" in capsys.readouterr().err
