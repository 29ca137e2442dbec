"""A MaxText run configuration as a case (`--maxtext-config`): composed as MaxText composes it, every
key honoured, ignored as layout-neutral or refused in one line, and the key list complete.

MaxText's own configuration files are test data (tests/data/maxtext/configs, MaxText e591f30), found
through MAXTEXT_CONFIGS_DIR as a MaxText installation would be.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

from helpers import LINEN, NNX, REPO, sweep_beyond_first, tree_bytes
from sharding_dump.commands import cli, options
from sharding_dump.errors import BadInput
from sharding_dump.models.config import BUILD_FIELDS, NUMERICS, RELEASE_FIELDS, ModelConfig
from sharding_dump.zoo import cards, maxtext_config, releases, settings
from sharding_dump.zoo import cards as card_registry
from sharding_dump.zoo.cards import load_card
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.matrix import load_matrix

CONFIGS = REPO / "tests" / "data" / "maxtext" / "configs"
# MaxText's configuration files of each release data/maxtext_releases.yml names.
RELEASE_CONFIGS = {"0.2.4": CONFIGS, "0.2.5": REPO / "tests" / "data" / "maxtext" / "configs-0.2.5"}
RUN = REPO / "tests" / "data" / "maxtext" / "runs" / "llama2-7b-v5p-16.yml"
BASE = CONFIGS / "base.yml"
# Keys of MaxText's configuration that are not in base.yml: base_config (read by pyconfig itself),
# and two that MaxText's model configs set (gemma3/llama4/qwen3.5 vision_encoder_block,
# deepseek4 log_moe_bias_norms).
BEYOND_BASE = {"base_config", "vision_encoder_block", "log_moe_bias_norms"}
# ModelConfig fields that are no MaxText key: the card's own name and description, and the run
# settings and pipeline plan the harness fills in.
ZOO_ONLY_FIELDS = {"name", "description", "weight_dtype", "dtype", "pipeline"}


@pytest.fixture(autouse=True)
def maxtext_installed(monkeypatch):
    """MaxText's configs folder, as an installation gives it; no M_<KEY> overrides from the caller."""
    monkeypatch.setenv("MAXTEXT_CONFIGS_DIR", str(CONFIGS))
    for name in [n for n in __import__("os").environ if n.startswith(maxtext_config.ENV_PREFIX)]:
        monkeypatch.delenv(name)


def base_keys(version: str = "0.2.4") -> dict:
    return yaml.safe_load((RELEASE_CONFIGS[version] / "base.yml").read_text())


def read(*command_line: str, config: Path = RUN, **kwargs) -> Case:
    return maxtext_config.read_case(config, list(command_line), **kwargs).case


def run_file(tmp_path: Path, text: str, name: str = "run.yml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --- the key list ----------------------------------------------------------------------------------

@pytest.mark.parametrize("version", sorted(RELEASE_CONFIGS))
def test_every_key_of_maxtexts_base_yml_is_classified_and_nothing_else(version):
    """Each release's base.yml: its keys are the key list's less those another release adds or removes."""
    assert set(RELEASE_CONFIGS) == set(releases.releases())
    table = maxtext_config.key_table()
    assert set(base_keys(version)) == releases.keys_of(version, set(table.kind)) - BEYOND_BASE
    assert BEYOND_BASE <= set(table.kind)


def test_every_setting_of_the_package_is_honoured_under_maxtexts_name():
    table = maxtext_config.key_table()
    honoured = {k for k, kind in table.kind.items() if kind == "settings"}
    # a reference setting names a function of the user's own (optimizer=): MaxText has no such key
    # maxtext_version chooses the release itself (data/maxtext_releases.yml): MaxText has no such key
    # serving serves a card by MaxEngine's steps (MaxText's inference entry point, not a key of its config);
    # page_size is the paged cache's page of a ServingProgram of the user's own (MaxText's has no such key)
    known = {key for key, spec in settings.setting_specs().items()
             if spec.type != "reference" and key not in (releases.SETTING, "serving", "page_size")}
    assert known <= honoured, f"settings with no MaxText key: {sorted(known - honoured)}"
    assert all(settings.spec_for(key) is not None for key in honoured)


def test_every_model_card_field_is_a_classified_maxtext_key():
    """A card field the other blocks add must be classified: as a model key (compared with the card)
    when it moves a layout, as ignore when it is numerics."""
    table = maxtext_config.key_table()
    by_field = {spec.field: key for key, spec in table.model.items()}
    rules = {"logical_axis_rules"}
    # set by the run (settings) or by the MaxText release, not by the card
    run_settings = {name for name, _, _ in NUMERICS + RELEASE_FIELDS + BUILD_FIELDS}
    for field in {f.name for f in dataclasses.fields(ModelConfig)} - ZOO_ONLY_FIELDS - rules - run_settings:
        key = by_field.get(field, field)
        assert key in table.kind, f"card field {field} is no key of data/maxtext_keys.yml"
        assert table.kind[key] in ("model", "ignore"), (field, table.kind[key])


def test_a_model_key_without_a_neutral_value_is_a_field_every_block_builds():
    common = card_registry._common_fields()
    table = maxtext_config.key_table()
    assert {spec.field for spec in table.model.values() if not spec.has_neutral} <= common


@pytest.mark.parametrize("version", sorted(RELEASE_CONFIGS))
def test_maxtexts_defaults_are_never_refused(version):
    """Each release's base.yml's own value of every refused or model key is one the zoo builds."""
    base = base_keys(version)
    table = maxtext_config.key_table()
    for key, refusal in table.refuse.items():
        if key in base:
            assert maxtext_config.same(base[key], refusal.supported), key
    for key, spec in table.model.items():
        if spec.has_neutral and key in base:
            assert maxtext_config.same(base[key], spec.neutral), key


# --- a real run configuration ----------------------------------------------------------------------

def test_run_config_with_kernel_keys_dumps_the_committed_golden(tmp_path, capsys):
    """The run's kernel tiling, data, logging and checkpointing keys, plus one more on the command
    line, give the golden of `--model llama2-7b --topology v5p-16 --rule default` of e591f30 (the release
    whose base.yml the run composes, and its NNX build, base.yml's default), byte for byte."""
    out, model = tmp_path / "g", tmp_path / "m"
    status = cli.main(["--maxtext-config", str(RUN), "sa_block_q=256", "sa_block_kv_dkv=2048", "--golden-dir", str(out)])
    assert status == 0, capsys.readouterr().err
    nnx = NNX  # e591f30, whose base.yml chooses its NNX build
    case = Case.make("llama2-7b", "v5p-16", "default", overrides=nnx)
    assert cli.main(["--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default",
                     *(f"{k}={v}" for k, v in nnx.items()), "--golden-dir", str(model)]) == 0, capsys.readouterr().err
    assert tree_bytes(golden_dir(case, out)) == tree_bytes(golden_dir(case, model))
    assert [p.relative_to(out).as_posix() for p in out.glob("*/*/*/*")] == \
        [golden_dir(case, out).relative_to(out).as_posix()]


def test_opt_type_is_honoured(tmp_path, capsys):
    """MaxText's opt_type is the zoo's setting of that name: the case gets it as an override."""
    out = tmp_path / "g"
    assert cli.main(["--maxtext-config", str(RUN), "opt_type=sgd", "--golden-dir", str(out)]) == 0, capsys.readouterr().err
    (named,) = out.rglob("named_shardings.json")
    assert named.parent.name == "rule_default_maxtext_version=0.2.4_opt_type=sgd"  # e591f30's base.yml
    assert [p for p in json.loads(named.read_text())["tensors"] if "opt_state/" in p] == ["optimizer/opt_state/1/count"]


@pytest.mark.parametrize("command_line,key,why", [
    (["quantization=int8"], "quantization", "adds scale tensors"),
    (["dtype=float32"], "dtype", "the zoo computes in bfloat16"),
    (["scan_layers=false"], "scan_layers", "changes every layer parameter's shape"),
    (["skip_step_on_spikes=true"], "skip_step_on_spikes", "changes the optimizer state or step"),
    (["gradient_accumulation_steps=4"], "gradient_accumulation_steps", "changes every activation's batch"),
    (["mu_dtype=bfloat16"], "mu_dtype", "AdamW's first moment"),
    (["num_vocab_tiling=4"], "num_vocab_tiling", "vocabulary tiles"),
    (["context_parallel_strategy=ring"], "context_parallel_strategy", "all_gather"),
    (["fused_qkv=true"], "fused_qkv", "decoder block 'llama2' of model card llama2-7b does not build it"),
    (["use_post_attn_norm=true"], "use_post_attn_norm", "does not build it"),
    (["attention_type=mla"], "attention_type", "does not build it: it builds 'global'"),
    (["no_such_key=1"], "no_such_key", "not a MaxText key that sharding-dump knows"),
])
def test_layout_relevant_unsupported_key_is_one_line_naming_it(tmp_path, capsys, command_line, key, why):
    out = tmp_path / "g"
    status = cli.main(["--maxtext-config", str(RUN), *command_line, "--golden-dir", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"sharding-dump: error: the command line: {key}: ") and why in err, err
    assert not out.exists()


def test_docs_show_the_refusal_as_printed(tmp_path, capsys):
    shown = next(line for line in (REPO / "docs/maxtext/run-configuration.md").read_text().splitlines()
                 if line.startswith("sharding-dump: error: the command line: quantization"))
    assert cli.main(["--maxtext-config", str(RUN), "quantization=int8", "--golden-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == shown + "\n"
    assert len(base_keys()) == 696  # the counts docs/maxtext/run-configuration.md gives
    assert len(set(base_keys("0.2.5")) - set(base_keys())) == 93


def test_refused_key_in_the_run_file_names_the_file(tmp_path, capsys):
    run = run_file(tmp_path, f"""\
        base_config: {RUN}
        quantization: fp8
        sa_block_q: 256
        """)
    status = cli.main(["--maxtext-config", str(run), "--golden-dir", str(tmp_path / "g")])
    err = capsys.readouterr().err
    assert status == 2 and f"{run}: quantization: 'fp8' is not supported" in err, err


def test_every_refusal_is_named_after_the_first():
    with pytest.raises(BadInput, match=r"dtype: 'float16' is not supported: .* \(and 2 more: quantization, scan_layers\)"):
        read("dtype=float16", "quantization=int8", "scan_layers=false")


def test_key_of_a_newer_base_yml_is_reported_not_ignored(tmp_path):
    newer = tmp_path / "maxtext" / "base.yml"
    newer.parent.mkdir()
    newer.write_text(BASE.read_text() + "use_new_sharding_trick: false\n")
    run = run_file(tmp_path / "maxtext", "base_config: base.yml\nmodel_name: llama2-7b\n")
    with pytest.raises(BadInput, match=f"{newer}: use_new_sharding_trick: not a MaxText key that sharding-dump "
                                       f"knows .* refused, not ignored"):
        read(config=run, topology="v5p-16")


def test_moe_only_refusal_applies_to_models_with_experts():
    assert read("model_name=mixtral-8x7b", "override_model_config=true", "shard_exp_on_fsdp=false").model == "mixtral-8x7b"
    with pytest.raises(BadInput, match="shard_exp_on_fsdp: true is not supported: changes the logical axes of the MoE"):
        read("model_name=mixtral-8x7b", "shard_exp_on_fsdp=true")
    assert read("shard_exp_on_fsdp=true").model == "llama2-7b"  # a dense model has no expert weights


def test_verify_warns_what_it_compiles_otherwise_and_a_dump_does_not(capsys):
    args = argparse.Namespace(maxtext_config=str(RUN), settings=["remat_policy=minimal"], topology=None,
                              num_slices=None, model=None, rule=None)
    project = options.project_of(args)
    assert options.cases_of(args, "dumps", project)[0].model == "llama2-7b"
    assert capsys.readouterr().err == ""
    options.cases_of(args, "verifies", project)
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(w.startswith("sharding-dump: warning: ") for w in warnings), warnings


def test_verify_is_told_what_it_compiles_otherwise():
    notes = maxtext_config.read_case(RUN, ["remat_policy=minimal"]).compiled_notes
    assert any(n.startswith(f"{RUN.relative_to(Path.cwd()) if RUN.is_relative_to(Path.cwd()) else RUN}: attention: "
                            f"'flash': verify compiles the zoo's step with attention='dot_product'") for n in notes), notes
    assert any("remat_policy: 'minimal'" in n and "remat_policy='full'" in n for n in notes), notes
    assert not any("megablox" in n for n in notes)  # a dense model has no token dispatch
    moe = maxtext_config.read_case(BASE, ["model_name=mixtral-8x7b"], topology="v5p-16").compiled_notes
    assert any("megablox: true: verify compiles the zoo's step with megablox=false" in n for n in moe), moe
    assert not any("sparse_matmul" in n for n in moe), moe  # the dispatch is built as the setting says


# --- every card is its MaxText model config --------------------------------------------------------

@pytest.mark.parametrize("card", sweep_beyond_first(cards.model_names(), lambda name: cards.load_config(name).decoder_block))
def test_every_card_composes_from_maxtexts_model_config(card):
    """base.yml + models/<card>.yml, as MaxText composes them, is the card (every layout-relevant key
    equal) under MaxText's base rules merged with the model config's; the run settings the model config
    sets beside the model (MaxText's GPT-3 configs: adam_pax, two of them on 1024 tokens) are the card's
    `settings`; base.yml's build keys choose MaxText's NNX build."""
    case = read(f"model_name={card}", config=BASE, topology="v5p-16")
    nnx = NNX  # e591f30, whose base.yml chooses its NNX build
    assert case == Case.make(card, "v5p-16", "default", overrides={**cards.card_settings(card), **nnx})


@pytest.mark.parametrize("card", sweep_beyond_first(cards.model_names(), lambda name: cards.load_config(name).decoder_block))
def test_every_card_composes_from_maxtext_025s_model_config(card, monkeypatch):
    """MaxText 0.2.5's base.yml + models/<card>.yml is the card built as 0.2.5 (`maxtext_version=0.2.5`),
    DeepSeek3/Kimi's routed bias included (0.2.5 keeps it as model state, and so does the zoo's NNX build)."""
    configs = RELEASE_CONFIGS["0.2.5"]
    monkeypatch.setenv("MAXTEXT_CONFIGS_DIR", str(configs))
    case = read(f"model_name={card}", config=configs / "base.yml", topology="v5p-16")
    assert case == Case.make(card, "v5p-16", "default", overrides={**cards.card_settings(card), "maxtext_version": "0.2.5"})


def test_a_configuration_of_two_releases_is_refused():
    with pytest.raises(BadInput, match=r"mixes keys of different releases [(]0.2.5: use_m3_model[)]; compose it"):
        read("model_name=qwen3-0.6b", "use_m3_model=false", config=BASE, topology="v5p-16")


def test_e591f30s_nnx_build_is_taken_and_its_linen_build_by_the_three_keys():
    """base.yml of e591f30 asks for the NNX build (ZeRO-1 included, placed as that build places it); the three
    keys false give the Linen build, as MaxText's own sharding tests run it. qwen3.5 with tensor parallelism,
    whose decoder_norm that NNX build leaves without axes, and a pipelined Gemma 4, which it fails to build, are
    refused there."""
    from sharding_dump.zoo import releases

    zero1 = ["model_name=llama2-7b", "ici_data_parallelism=2", "ici_fsdp_parallelism=-1", "shard_optimizer_over_data=true"]
    nnx = read(*zero1, config=BASE, topology="v5p-16")
    assert releases.nnx_build(dict(nnx.overrides)) and dict(nnx.overrides)["shard_optimizer_over_data"] is True
    linen = read(*zero1, "pure_nnx=false", "enable_nnx=false", "pure_nnx_decoder=false", config=BASE, topology="v5p-16")
    assert not releases.nnx_build(dict(linen.overrides)) and dict(linen.overrides)["shard_optimizer_over_data"] is True
    tensor = ["model_name=qwen3.5-35b-a3b", "ici_fsdp_parallelism=-1", "ici_tensor_parallelism=2"]
    with pytest.raises(BadInput, match=r"decoder block 'qwen3_5' with tensor parallelism 2 with MaxText 0.2.4's NNX"):
        read(*tensor, config=BASE, topology="v5p-16")
    assert read(*tensor, "pure_nnx=false", "enable_nnx=false", "pure_nnx_decoder=false", config=BASE, topology="v5p-16")
    pipelined = ["model_name=gemma4-26b", "ici_pipeline_parallelism=2", "num_pipeline_microbatches=8"]
    with pytest.raises(BadInput, match=r"decoder block 'gemma4' with pipeline parallelism \(2 stages\) with MaxText "
                                       r"0.2.4's NNX"):  # its NNX decoder fails to build it
        read(*pipelined, config=BASE, topology="tpu7x-16")
    assert read(*pipelined, "pure_nnx=false", "enable_nnx=false", "pure_nnx_decoder=false", config=BASE,
                topology="tpu7x-16")


def test_a_cards_settings_are_its_cases_defaults():
    """`--model gpt3-6b` trains as MaxText's `model_name=gpt3-6b` does (adam_pax on 1024 tokens): the same
    tensors as the matrix case that names those settings; a KEY=VALUE still wins."""
    from sharding_dump.zoo.dump import case_layouts, setup_case

    plain = setup_case(Case.make("gpt3-6b", "tpu7x-8", "default"))
    assert (plain.values["opt_type"], plain.values["max_target_length"]) == ("adam_pax", 1024)
    named = Case.make("gpt3-6b", "tpu7x-8", "default", overrides={"opt_type": "adam_pax", "max_target_length": 1024})
    assert named in load_matrix()
    layouts = [[(t.path, t.shape, t.partition_spec) for t in case_layouts(c)[1]] for c in (plain.case, named)]
    assert layouts[0] == layouts[1] and any(path.startswith("optimizer/opt_state") for path, _, _ in layouts[0])
    other = setup_case(Case.make("gpt3-6b", "tpu7x-8", "default", overrides={"opt_type": "adamw"}))
    assert (other.values["opt_type"], other.values["max_target_length"]) == ("adamw", 1024)


def test_a_card_that_drifts_from_maxtext_is_refused(tmp_path):
    """The check bites: gemma-7b with the checkpoint's 256000-row vocabulary is not MaxText's gemma-7b."""
    card = {**load_card("gemma-7b"), "name": "gemma-7b-published", "vocab_size": 256_000}
    path = tmp_path / "gemma-7b-published.yml"
    path.write_text(yaml.safe_dump(card))
    resolve = lambda field, ref: str(path) if field == "model" else ref  # noqa: E731
    with pytest.raises(BadInput, match=r"model config .*gemma-7b.yml: vocab_size: 256128: model card "
                                       r"gemma-7b-published has vocab_size 256000"):
        read("model_name=gemma-7b", config=BASE, topology="v5p-16", resolve=resolve)


@pytest.mark.parametrize("case", [c for c in load_matrix() if c.model == "deepseek2-16b"], ids=lambda c: c.label)
def test_maxtexts_reference_cases_are_the_matrix_cases(case):
    """MaxText's own dump of deepseek2-16b names its cases by custom_mesh_and_rule and the command line
    (its Linen build's three keys false, which it leaves out of the name); composed from MaxText's configs,
    each is the matrix case of the same golden folder."""
    command_line = [f"model_name={case.model}", "pure_nnx=false", "enable_nnx=false", "pure_nnx_decoder=false"] + \
        [f"{k}={settings.format_value(v)}" for k, v in case.overrides]
    if case.rule != "default":
        command_line.append(f"custom_mesh_and_rule={case.rule}")
    assert read(*command_line, config=BASE, topology=case.topology, num_slices=case.num_slices) == \
        Case.make(case.model, case.topology, case.rule, case.num_slices, {**dict(case.overrides), **LINEN})


def test_custom_rule_that_drifts_from_maxtexts_file_is_refused(tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    shutil.copytree(CONFIGS, configs)
    text = (CONFIGS / "custom_mesh_and_rule" / "pure-fsdp.yml").read_text()
    (configs / "custom_mesh_and_rule" / "pure-fsdp.yml").write_text(text.replace("- [embed, [fsdp]]", "- [embed, []]"))
    monkeypatch.setenv("MAXTEXT_CONFIGS_DIR", str(configs))
    with pytest.raises(BadInput, match=r"custom_mesh_and_rule/pure-fsdp.yml: logical_axis_rules: differs from rule "
                                       r"'pure-fsdp' \(entry 8: \[embed, \[\]\] here, \[embed, \[fsdp\]\] in the rule\)"):
        read("custom_mesh_and_rule=pure-fsdp", "model_name=llama2-7b", config=configs / "base.yml", topology="v5p-16")


# --- composed as MaxText composes it ---------------------------------------------------------------

def test_model_config_wins_over_the_run_file_as_in_maxtext(tmp_path):
    run = run_file(tmp_path, f"base_config: {RUN}\nbase_num_decoder_layers: 4\n")
    assert read(config=run).model == "llama2-7b"  # MaxText merges base, model config, then the command line


def test_command_line_over_the_model_config_needs_override_model_config():
    with pytest.raises(BadInput, match="base_num_decoder_layers: set by the model config .*llama2-7b.yml and by "
                                       "the command line with different values; MaxText refuses this unless "
                                       "override_model_config=true"):
        read("base_num_decoder_layers=4")
    with pytest.raises(BadInput, match="the command line: base_num_decoder_layers: 4: model card llama2-7b has "
                                       "num_decoder_layers 32"):
        read("base_num_decoder_layers=4", "override_model_config=true")


def test_rules_merge_by_logical_name_and_a_change_is_refused():
    with pytest.raises(BadInput, match=r"the command line: logical_axis_rules: differs from rule 'default' with model "
                                       r"card qwen3-0.6b's rules \(entry \d+: .* --model qwen3-0.6b --rule FILE$"):
        read("model_name=qwen3-0.6b", "logical_axis_rules=[[embed, []]]")
    with pytest.raises(BadInput, match=r"entry 0: \[embed, \[\]\] here"):
        read("model_name=qwen3-0.6b", "override_logical_axis_rules=true", "logical_axis_rules=[[embed, []]]")




def test_composed_values_are_omegaconfs_merge_of_every_layer(tmp_path):
    """compose() merges into the base_config chain only the keys the model config and the command line
    set; the values are still OmegaConf's merge of every layer, as MaxText's pyconfig takes it, a
    mapping set in part keeping the rest of the chain's (mutation: merge the overlays over none of the
    chain's keys, and `vllm_additional_config` loses `kept`)."""
    from omegaconf import OmegaConf

    run = run_file(tmp_path, f"""\
        base_config: {RUN}
        vllm_additional_config: {{kept: 1, replaced: 2}}
        """)
    command_line = ["vllm_additional_config.replaced=3", "vllm_additional_config.added=4", "ici_tensor_parallelism=2"]
    composed = maxtext_config.compose(run, command_line)
    layers = [BASE, RUN, run, CONFIGS / "models" / "llama2-7b.yml"]
    merged = OmegaConf.merge(*(OmegaConf.create(path.read_text()) for path in layers), OmegaConf.from_cli(command_line))
    expected = OmegaConf.to_container(merged, resolve=True)
    assert composed.values["vllm_additional_config"] == {"kept": 1, "replaced": 3, "added": 4}
    assert list(composed.values) == list(expected)  # the keys in MaxText's order
    assert composed.values == {**expected, "logical_axis_rules": composed.values["logical_axis_rules"]}
    # an interpolation may name any key of the chain: resolved over the whole merge
    run = run_file(tmp_path, f"base_config: {RUN}\nvllm_additional_config: {{kept: '${{model_name}}-run'}}\n")
    assert maxtext_config.compose(run, command_line).values["vllm_additional_config"] == \
        {"kept": "llama2-7b-run", "replaced": 3, "added": 4}


def test_settings_name_the_case_as_maxtexts_dumps_do():
    """Honoured settings that differ from the default name the case, and so does any given on the
    command line (MaxText's explicit keys), even at its default; base.yml's build keys choose its NNX build."""
    release = "_maxtext_version=0.2.4"  # e591f30's base.yml, whose build keys default to its NNX build
    assert read("ici_tensor_parallelism=2").name == "rule_default_ici_tensor_parallelism=2" + release
    assert read("ici_fsdp_parallelism=-1").name == "rule_default_ici_fsdp_parallelism=-1" + release
    assert read().name == "rule_default" + release  # the run file sets ici_fsdp_parallelism: -1, the default
    linen = ("pure_nnx=false", "enable_nnx=false", "pure_nnx_decoder=false")  # MaxText's sharding tests' own
    assert read("ici_tensor_parallelism=2", *linen).name == \
        "rule_default_ici_tensor_parallelism=2" + release + "_enable_nnx=false_pure_nnx_decoder=false_pure_nnx=false"


def test_environment_overrides_as_in_maxtext():
    environ = {"M_PER_DEVICE_BATCH_SIZE": "4", "MAXTEXT_CONFIGS_DIR": str(CONFIGS)}
    assert dict(read(environ=environ).overrides) == {"per_device_batch_size": 4, **NNX}
    with pytest.raises(BadInput, match="per_device_batch_size: set by the command line and by the environment "
                                       "variable M_PER_DEVICE_BATCH_SIZE"):
        read("per_device_batch_size=2", environ=environ)
    with pytest.raises(BadInput, match="M_SCAN_LAYERS='maybe': not a bool"):
        read(environ={"M_SCAN_LAYERS": "maybe", "MAXTEXT_CONFIGS_DIR": str(CONFIGS)})


def test_base_config_next_to_the_file_comes_before_maxtexts(tmp_path):
    (tmp_path / "base.yml").write_text(BASE.read_text().replace("dtype: bfloat16", "dtype: float16"))
    run = run_file(tmp_path, "base_config: base.yml\nmodel_name: llama2-7b\n")
    with pytest.raises(BadInput, match=f"{tmp_path / 'base.yml'}: dtype: 'float16' is not supported"):
        read(config=run, topology="v5p-16")


@pytest.mark.parametrize("text,message", [
    ("base_config: nowhere.yml\n", "field base_config: 'nowhere.yml' is not next to it nor in MaxText's configs folder"),
    ("base_config: run.yml\n", "base_config chain loops back to it"),
    ("- a\n- b\n", "holds a list, not a mapping of MaxText keys"),
    ("base_config: base.yml\nmodel_name: llama2-7b\n", r"missing --topology \(or compile_topology in the MaxText config\)"),
    ("base_config: base.yml\n", "model_name: 'default': MaxText's base model has no card"),
    ("base_config: base.yml\nmodel_name: gemma9-4b\n", "model_name: unknown model 'gemma9-4b'"),
    ("base_config: base.yml\nmodel_name: llama2-7b\ncompile_topology: 16\n", "compile_topology: 16 is not a topology name"),
    ("base_config: base.yml\nmodel_name: llama2-7b\ncompile_topology: v9x-16\n", "unknown topology 'v9x-16'"),
])
def test_bad_configuration_is_one_line(tmp_path, text, message):
    with pytest.raises(BadInput, match=message):
        read(config=run_file(tmp_path, text))


def test_instruct_model_and_topology_from_the_config():
    assert read("model_name=llama3.1-8b-Instruct", config=BASE, topology="v5p-16").model == "llama3.1-8b"
    assert read().topology == "v5p-16"
    with pytest.raises(BadInput, match="--topology v5p-32: .*compile_topology is 'v5p-16'; give one or the same"):
        read(topology="v5p-32")


def test_cli_refuses_model_and_rule_beside_a_maxtext_config(tmp_path, capsys):
    status = cli.main(["--maxtext-config", str(RUN), "--rule", "pure-fsdp", "--golden-dir", str(tmp_path / "g")])
    assert status == 2 and "--maxtext-config names the model (model_name) and the rule" in capsys.readouterr().err


def test_case_file_entry_with_a_maxtext_config(tmp_path):
    cases = tmp_path / "cases.yml"
    cases.write_text(f"cases:\n  - {{maxtext_config: {RUN}, overrides: {{ici_tensor_parallelism: 2, sa_block_q: 256}}}}\n")
    assert load_matrix(cases) == [Case.make("llama2-7b", "v5p-16", "default",
                                            overrides={"ici_tensor_parallelism": 2, **NNX})]
    cases.write_text(f"cases:\n  - {{maxtext_config: {RUN}, overrides: {{quantization: int8}}}}\n")
    with pytest.raises(BadInput, match=r"case matrix .*cases.yml: field cases/0: overrides: quantization: 'int8' is not"):
        load_matrix(cases)
    cases.write_text(f"cases:\n  - {{maxtext_config: {RUN}, model: llama2-7b}}\n")
    with pytest.raises(BadInput, match=r"field cases/0: maxtext_config names the model \(model_name\) and the rule"):
        load_matrix(cases)


def test_base_config_chain_is_bounded(tmp_path):
    for index in range(maxtext_config.MAX_CHAIN + 1):
        (tmp_path / f"c{index}.yml").write_text(f"base_config: c{index + 1}.yml\n")
    (tmp_path / f"c{maxtext_config.MAX_CHAIN + 1}.yml").write_text("model_name: llama2-7b\n")
    with pytest.raises(BadInput, match=f"more than {maxtext_config.MAX_CHAIN} files chained by base_config"):
        maxtext_config.compose(tmp_path / "c0.yml")
