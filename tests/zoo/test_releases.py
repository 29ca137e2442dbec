"""The MaxText releases (`maxtext_version`, data/maxtext_releases.yml): each release's rule files are
MaxText's of that release, its new model configs are refused naming what is missing, and its layers'
logical axes are the ones MaxText gives them.

MaxText's own configuration files of each release are test data (tests/data/maxtext/configs for e591f30,
configs-0.2.5 for PyPI's 0.2.5).
"""

from __future__ import annotations

import pytest
import yaml

from helpers import REPO, assert_bad_input
from sharding_dump.core.specs import entry_axes
from sharding_dump.errors import BadInput
from sharding_dump.zoo import cards, releases, rules
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.dump import dump_case

CONFIGS = {"0.2.4": REPO / "tests/data/maxtext/configs", "0.2.5": REPO / "tests/data/maxtext/configs-0.2.5"}


def test_every_release_has_its_maxtext_configs_here():
    assert set(CONFIGS) == set(releases.releases())


def maxtext_rule_files(version: str) -> dict[str, dict]:
    """MaxText's rule files of a release by the zoo's name: its custom_mesh_and_rule files, base.yml as
    `default`, and inference/inference.yml (on base.yml's mesh) as `inference`."""
    folder = CONFIGS[version]
    found = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((folder / "custom_mesh_and_rule").glob("*.yml"))}
    found["default"] = yaml.safe_load((folder / "base.yml").read_text())
    inference = yaml.safe_load((folder / "inference/inference.yml").read_text())  # over base.yml, on its mesh
    found["inference"] = {**inference, "mesh_axes": found["default"]["mesh_axes"]}
    return found


@pytest.mark.parametrize("version", sorted(CONFIGS))
def test_each_release_has_maxtexts_rule_files_of_that_release(version):
    """Same names; same mesh axes, batch axes and logical_axis_rules in order, a mesh axis the rule's mesh
    lacks dropped as MaxText drops it."""
    rel = releases.release(version)
    theirs = maxtext_rule_files(version)
    assert set(rules.rule_names(rel.rules_dir)) == set(theirs)
    for name, data in theirs.items():
        ours = rules.load_rule(name, rel.rules_dir)
        assert list(ours.mesh_axes) == data["mesh_axes"], name
        assert [list(ours.data_sharding)] == [[a for a in data["data_sharding"][0] if a in ours.mesh_axes]], name
        expected = [(n, tuple(a for a in entry_axes(tuple(axes) if isinstance(axes, list) else axes)
                              if a in ours.mesh_axes)) for n, axes in data["logical_axis_rules"]]
        assert [(n, entry_axes(a)) for n, a in ours.logical_axis_rules] == expected, name
        dropped = {}  # axis -> the logical names whose rules named it: what missing_axes must say
        for n, axes in data["logical_axis_rules"]:
            for a in entry_axes(tuple(axes) if isinstance(axes, list) else axes):
                if a not in ours.mesh_axes and n not in dropped.setdefault(a, []):
                    dropped[a].append(n)
        assert {m.axis: list(m.rules) for m in ours.missing_axes} == dropped, name
        assert [m.axis for m in ours.missing_axes if m.data_sharding] == \
            [a for a in data.get("data_sharding", [[]])[0] if a not in ours.mesh_axes], name


def test_each_releases_model_configs_without_a_card_are_the_ones_it_names():
    for version, folder in CONFIGS.items():
        added = {p.stem for p in (folder / "models").glob("*.yml")} - set(cards.card_files())
        assert added == set(releases.release(version).models_missing), version


def test_keys_of_a_release_leave_out_later_additions_and_its_removals():
    everything = {"pure_nnx", "use_m3_model", "steps"}
    assert releases.keys_of("0.2.4", everything) == {"pure_nnx", "steps"}
    assert releases.keys_of("0.2.5", everything) == {"use_m3_model", "steps"}


BAD = [
    ("--model weaver-mini", "model 'weaver-mini': MaxText 0.2.5's model config 'weaver-mini' is not built by the zoo: "
                            "a qwen3 decoder behind Weaver's vision encoder"),
    ("--model qwen3-0.6b --rule fsdp-as-dp-for-attn maxtext_version=0.2.4",
     "unknown rule 'fsdp-as-dp-for-attn' (a rule of MaxText 0.2.5: give maxtext_version=0.2.5)"),
    ("--model qwen3-0.6b maxtext_version=0.2.3", "maxtext_version='0.2.3': must be one of 0.2.4, 0.2.5"),
    ("--model qwen3-0.6b maxtext_version=0.2.5 pure_nnx=false", "pure_nnx=false: not a key of MaxText 0.2.5"),
    ("--model qwen3-0.6b maxtext_version=0.2.4 use_m3_model=false", "use_m3_model=false: not a key of MaxText 0.2.4"),
    ("--model qwen3-0.6b base_emb_dim=1024", "base_emb_dim=1024: a hyperparameter of the model: a --model case "
                                             "builds its card's"),
    ("--model qwen3-0.6b compile_topology=v5p-8", "compile_topology=v5p-8: the topology and slices of a --model "
                                                  "case are --topology and --num-slices"),
    ("--model qwen3.5-35b-a3b maxtext_version=0.2.5 ici_fsdp_parallelism=-1 ici_tensor_parallelism=4",
     "MaxText 0.2.5 never splits a key/value head: qwen3.5-35b-a3b has 2 key/value heads, which the rules split "
     "over tensor (4 shards); size those axes to divide 2"),
    ("--model qwen3-0.6b maxtext_version=0.2.5 use_lineage=true", "use_lineage=true: not supported: another "
                                                                  "implementation of the model"),
    ("--model qwen3.5-35b-a3b maxtext_version=0.2.4 ici_fsdp_parallelism=-1 ici_tensor_parallelism=2",
     "decoder block 'qwen3_5' with tensor parallelism 2 with MaxText 0.2.4's NNX build (enable_nnx/pure_nnx_decoder/"
     "pure_nnx true): its NNX build gives the decoder_norm of qwen3.5 and qwen3-next no logical axes"),
    ("--model gemma4-26b maxtext_version=0.2.4 ici_pipeline_parallelism=2 num_pipeline_microbatches=8",
     "decoder block 'gemma4' with pipeline parallelism (2 stages) with MaxText 0.2.4's NNX build (enable_nnx/"
     "pure_nnx_decoder/pure_nnx true): its NNX decoder runs a pipelined Gemma 4 through _apply_gemma4_scanned_blocks"),
    ("--model gemma4-26b ici_fsdp_parallelism=-1 ici_pipeline_parallelism=2 num_pipeline_microbatches=8",
     "decoder block 'gemma4' with pipeline parallelism (2 stages) with MaxText 0.2.5's NNX build (its only build): it "
     "places the optimizer moments of a pipelined Gemma 4's local_layers"),
    ("--model qwen3-next-80b-a3b ici_fsdp_parallelism=-1 ici_pipeline_parallelism=2",
     "pipeline parallelism (2 stages): MaxText 0.2.5 fails to build decoder block 'qwen3_next' pipelined: its "
     "Qwen3NextScannableBlock runs the full-attention layer in a scan of its own"),
]


def test_the_default_release_is_not_named_in_the_folder():
    """`maxtext_version=0.2.5` (the default) is the case without it; 0.2.4 is named."""
    assert Case.make("qwen3-0.6b", "tpu7x-16", "default", overrides={"maxtext_version": "0.2.5"}) == \
        Case.make("qwen3-0.6b", "tpu7x-16", "default")
    assert Case.make("qwen3-0.6b", "tpu7x-16", "default", overrides={"maxtext_version": "0.2.4"}).name == \
        "rule_default_maxtext_version=0.2.4"


@pytest.mark.parametrize("args,message", BAD, ids=[a for a, _ in BAD])
def test_what_a_release_lacks_is_one_line(tmp_path, capsys, args, message):
    assert_bad_input(tmp_path, capsys, f"--topology tpu7x-16 {args}", message)


def logical(model: str, rule: str = "default", **overrides) -> dict[str, list]:
    """The logical axes of every parameter (NNX build: `model/`, RNG state aside)."""
    case = Case.make(model, "tpu7x-16", rule, overrides=overrides)
    return {path.split("/", 1)[1]: leaf["logical_axes"]
            for path, leaf in dump_case(case)["logical_shardings.json"]["tensors"].items()
            if path.startswith(("params/", "model/")) and "/rngs/" not in path}


def test_release_025_names_every_attention_kernel_embed_attn():
    """0.2.5 gives the embed dimension of q/k/v/out kernels `embed_attn` (MaxText's attentions.py); 0.2.4 `embed`.
    Nothing else changes."""
    old, new = logical("qwen3-0.6b", maxtext_version="0.2.4"), logical("qwen3-0.6b")
    assert old.keys() == new.keys()
    changed = {path for path in old if old[path] != new[path]}
    assert changed == {f"decoder/layers/self_attention/{k}/kernel" for k in ("query", "key", "value", "out")}
    for path in changed:
        assert [a if a != "embed" else "embed_attn" for a in old[path]] == new[path]


def test_release_025_names_the_router_of_routed_and_shared_experts_embed_router():
    old, new = logical("deepseek2-16b", maxtext_version="0.2.4"), logical("deepseek2-16b")
    gate = "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel"
    assert old[gate] == ["embed_moe", "moe_layers", None] and new[gate] == ["embed_router", "moe_layers", None]


def test_a_release_rule_folder_must_exist(monkeypatch, tmp_path):
    text = releases.RELEASES_FILE.read_text().replace("rules: maxtext-0.2.5", "rules: maxtext-9.9.9")
    path = tmp_path / "maxtext_releases.yml"
    path.write_text(text)
    monkeypatch.setattr(releases, "RELEASES_FILE", path)
    releases.releases.cache_clear()
    try:
        with pytest.raises(BadInput, match=r"field releases/0.2.5/rules: no folder .*maxtext-9.9.9"):
            releases.releases()
    finally:
        releases.releases.cache_clear()


@pytest.mark.parametrize("version", sorted(CONFIGS))
def test_every_key_of_a_releases_base_yml_is_known_to_key_value(version):
    """Each key of the release's base.yml, given as KEY=VALUE at base.yml's value, is honoured (a setting),
    dropped as layout-neutral, or refused naming the key and why: never an unknown setting."""
    from sharding_dump.zoo import maxtext_config, settings

    base = yaml.safe_load((CONFIGS[version] / "base.yml").read_text())
    for key, value in base.items():
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        try:
            kept, _ = maxtext_config.layout_neutral({key: text, releases.SETTING: version})
            settings.parse_overrides(kept)
        except BadInput as err:
            assert str(err).startswith(f"{key}=") and "unknown setting" not in str(err), (key, str(err))


WEAVER = ["weaver-mini", "weaver-max"]


@pytest.mark.parametrize("model", WEAVER)
def test_weaver_is_refused_naming_what_is_missing_from_the_model_option_and_its_own_config(tmp_path, capsys, model,
                                                                                           monkeypatch):
    """weaver-mini/max (0.2.5's new model configs): one line naming what the zoo lacks, exit 2, nothing written,
    from `--model` and from `--maxtext-config` with MaxText 0.2.5's own base.yml and the config it names."""
    monkeypatch.delenv("MAXTEXT_CONFIGS_DIR", raising=False)
    missing = releases.release("0.2.5").models_missing[model]
    assert_bad_input(tmp_path, capsys, f"--model {model} --topology tpu7x-16 --rule default maxtext_version=0.2.5",
                     f"model '{model}': MaxText 0.2.5's model config '{model}' is not built by the zoo: {missing}")
    assert (CONFIGS["0.2.5"] / "models" / f"{model}.yml").is_file()
    assert_bad_input(tmp_path, capsys, f"--maxtext-config {CONFIGS['0.2.5'] / 'base.yml'} model_name={model} "
                                       "compile_topology=tpu7x-16",
                     f"the command line: model_name: MaxText 0.2.5's model config '{model}' is not built by the zoo: "
                     f"{missing}")


def test_maxtext_025s_own_base_yml_and_model_config_dump_the_model_case(tmp_path, capsys, monkeypatch):
    """`--maxtext-config <0.2.5's base.yml> model_name=qwen3-0.6b`, as a MaxText user runs MaxText: the model
    config is found beside base.yml (models/), as MaxText's pyconfig finds it, and the golden is that of
    `--model qwen3-0.6b --rule default maxtext_version=0.2.5`, byte for byte."""
    from sharding_dump.commands import cli
    from sharding_dump.zoo.case import golden_dir

    monkeypatch.delenv("MAXTEXT_CONFIGS_DIR", raising=False)
    ours, theirs = tmp_path / "config", tmp_path / "model"
    assert cli.main(["--maxtext-config", str(CONFIGS["0.2.5"] / "base.yml"), "model_name=qwen3-0.6b",
                     "compile_topology=tpu7x-16", "--golden-dir", str(ours)]) == 0, capsys.readouterr().err
    assert cli.main(["--model", "qwen3-0.6b", "--topology", "tpu7x-16", "--rule", "default", "maxtext_version=0.2.5",
                     "--golden-dir", str(theirs)]) == 0, capsys.readouterr().err
    folder = golden_dir(Case.make("qwen3-0.6b", "tpu7x-16", "default", overrides={"maxtext_version": "0.2.5"}), ours)
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["activation_shardings.json", "logical_shardings.json", "named_shardings.json"]
    for name in files:
        assert (folder / name).read_bytes() == (golden_dir(Case.make("qwen3-0.6b", "tpu7x-16", "default", overrides={
            "maxtext_version": "0.2.5"}), theirs) / name).read_bytes()


V024 = {"maxtext_version": "0.2.4"}
NNX_BUILD = [  # (settings, MaxText's build) as e591f30's train_compile.py / models.py read its three keys
    ({**V024, "pure_nnx": True, "enable_nnx": True, "pure_nnx_decoder": True}, True),  # base.yml: all three true
    (V024, True),  # the zoo's defaults: base.yml's
    ({**V024, "pure_nnx": False, "enable_nnx": False, "pure_nnx_decoder": False}, False),  # MaxText's own sharding tests
    ({**V024, "pure_nnx": False, "enable_nnx": False}, False),  # the Linen Transformer never reads pure_nnx_decoder
    ({**V024, "enable_nnx": False}, True),  # the NNX state never reads enable_nnx
    ({}, True),  # the default release, 0.2.5, has only its NNX build
]


@pytest.mark.parametrize("values,nnx", NNX_BUILD, ids=[str(v) for v, _ in NNX_BUILD])
def test_nnx_build_is_the_build_maxtext_chooses_for_its_keys(values, nnx):
    assert releases.nnx_build(values) is nnx


@pytest.mark.parametrize("values,message", [
    ({**V024, "pure_nnx": False}, "pure_nnx=false enable_nnx=true pure_nnx_decoder=true: MaxText 0.2.4 bridges one "
                                  "build's modules into the other's state"),
    ({**V024, "enable_nnx": False, "pure_nnx_decoder": False}, "enable_nnx=false pure_nnx_decoder=false pure_nnx=true: "
                                                               "MaxText 0.2.4 bridges"),
    ({"enable_nnx": False}, "enable_nnx=false: not a key of MaxText 0.2.5"),
])
def test_nnx_build_refuses_a_mix_and_keys_a_release_lacks(values, message):
    with pytest.raises(BadInput, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        releases.nnx_build(values)


def test_a_modules_rng_state_is_flax_nnx_rngs_state():
    """The RNG leaves the NNX build's state holds per module are nnx.Rngs's state of MaxText's streams
    (count and typed key per stream), stacked over the scans of the module."""
    import jax
    from flax import nnx

    from sharding_dump.zoo import state

    def shapes(tree):
        return jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)

    rel = releases.release("0.2.5")
    streams, impl = rel.rng_streams, rel.rng_key_impl
    theirs = jax.eval_shape(lambda k: nnx.to_pure_dict(nnx.state(nnx.Rngs(**{s: k for s in streams}))),
                            jax.random.key(0, impl=impl))
    assert shapes(state.rng_state((), streams, impl)) == shapes(theirs)
    stacked = jax.eval_shape(jax.vmap(lambda k: nnx.to_pure_dict(nnx.state(nnx.Rngs(**{s: k for s in streams})))),
                             jax.ShapeDtypeStruct((28,), jax.random.key(0, impl=impl).dtype))
    assert shapes(state.rng_state((28,), streams, impl)) == shapes(stacked)
    # MaxText's keys are unsafe_rbg's (train_compile.py sets jax_default_prng_impl): 4 words, 16 bytes each.
    assert str(theirs["params"]["key"].dtype) == "key<urbg>"


def test_a_block_the_release_does_not_name_keeps_the_rng_state_of_the_block_its_class_derives_from():
    """A user's family is no block of the release's data: its RNG modules are those of the first block of its
    lineage (cards.block_lineage) that the release names; with none, one line naming how to go on."""
    rel = releases.release("0.2.5")
    assert rel.rng_modules(("tiny_family", "llama2")) == rel.rngs["llama2"]
    assert rel.rng_modules(("qwen3", "llama2")) == rel.rngs["qwen3"]  # a block the release names is its own
    with pytest.raises(BadInput, match=r"^decoder block 'tiny_family': which of its modules keep RNG state in MaxText "
                                       r"0\.2\.5's NNX build is not known: .* derive its class from one of theirs, or "
                                       r"dump the Linen build: maxtext_version=0\.2\.4 enable_nnx=false "
                                       r"pure_nnx_decoder=false pure_nnx=false$"):
        rel.rng_modules(("tiny_family",))


def test_a_shared_rng_state_is_written_at_the_first_place_the_tree_has():
    """`a|b` in builds/nnx_state/rngs: NNX writes a shared nnx.Rngs once, at the first module holding it. Gemma 3's
    unpipelined decoder gives it to layers_remainder/layers_0; pipelined (no such module), the decoder keeps it."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from sharding_dump.zoo import state

    def leaf(*shape_names):
        return nn.Partitioned(jax.ShapeDtypeStruct(tuple(s for s, _ in shape_names), jnp.float32),
                              names=tuple(n for _, n in shape_names))

    norm = {"scale": leaf((8, "norm"))}
    unpipelined = {"decoder": {"decoder_norm": norm,
                               "layers_remainder": {"layers_0": {"mlp": {"kernel": leaf((8, "embed"), (4, "mlp"))}}}}}
    pipelined = {"decoder": {"decoder_norm": norm, "pipeline_module": {"layers": {
        "kernel": leaf((17, "circular_repeats"), (2, "layers"), (8, "embed"))}}}}
    patterns = ["decoder/layers_remainder/layers_0|decoder", "decoder/pipeline_module/layers"]
    assert state.rng_modules(unpipelined, patterns) == {("decoder", "layers_remainder", "layers_0"): ()}
    assert state.rng_modules(pipelined, patterns) == {("decoder",): (),
                                                      ("decoder", "pipeline_module", "layers"): (17, 2)}
