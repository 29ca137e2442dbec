"""Model cards: exact published sizes, blocks that honour every field a card sets, cards given by
path, cards and families registered by installed packages, and golden cases that catch a rule edit."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from helpers import REPO, assert_bad_input, committed_golden, sweep_beyond_first
from sharding_dump import models
from sharding_dump.commands import cli
from sharding_dump.core.layout import leaves
from sharding_dump.core.state import parameter_count
from sharding_dump.errors import BadInput
from sharding_dump.zoo import cards, rules, state
from sharding_dump.zoo.cards import honoured_fields, load_card, resolve_model
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.goldens import check_or_update
from sharding_dump.zoo.matrix import load_matrix

# Parameter counts of the published checkpoints, from each model's Hugging Face config
# (meta-llama/Llama-3.1-*, mistralai/Mixtral-*-v0.1, Qwen/Qwen3-*, google/gemma-*). A card follows
# MaxText's model config where the two disagree: the Gemma cards have MaxText's 256128-row vocabulary
# (its models/gemma-*.yml), the checkpoints 256000 rows; their counts are in MAXTEXT below.
PUBLISHED = {
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_630_071_296,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "gemma-2b": 2_506_172_416,
    "gemma-7b": 8_537_680_896,
}
PUBLISHED_VOCAB = {"gemma-2b": 256_000, "gemma-7b": 256_000}
# Counts of MaxText's own model where its config differs from the checkpoint: the published count plus
# (256128 - 256000) rows of the tied embedding table, the only difference (MaxText e591f30,
# configs/models/gemma-2b.yml and gemma-7b.yml: vocab_size 256128, logits_via_embedding true).
MAXTEXT = {
    "gemma-2b": 2_506_172_416 + 128 * 2048,
    "gemma-7b": 8_537_680_896 + 128 * 3072,
}


def count(cfg: models.ModelConfig) -> int:
    return parameter_count(state.abstract_params(cfg))


@pytest.mark.parametrize("model", sweep_beyond_first(sorted(PUBLISHED), lambda name: load_card(name)["decoder_block"]))
def test_parameter_count_is_the_published_count(model):
    cfg = cards.load_config(model)
    if model in PUBLISHED_VOCAB:  # the card has MaxText's vocabulary: the checkpoint's is checked here
        cfg = dataclasses.replace(cfg, vocab_size=PUBLISHED_VOCAB[model])
    assert count(cfg) == PUBLISHED[model]


@pytest.mark.parametrize("model", sorted(MAXTEXT))
def test_parameter_count_is_maxtexts_where_it_differs_from_the_checkpoint(model):
    assert cards.load_config(model).vocab_size == 256_128
    assert count(cards.load_config(model)) == MAXTEXT[model]


def test_every_shipped_card_loads_and_its_block_builds_it():
    for name in cards.model_names():
        cfg = cards.load_config(name)
        assert type(cards.build_model(cfg)).__name__ == cards.block_class(cfg.decoder_block).__name__


def test_module_names_follow_maxtext():
    """Mixtral's experts are MoeBlock_0, Qwen3-MoE's moe_block, both routers on `embed`; Gemma's norms
    are pre_self_attention_norm / pre_ffw_norm. Nothing is named after another family."""
    def params(model):
        found = leaves(state.abstract_state(cards.load_config(model)))
        return {path: logical for path, _, logical in found if path.startswith("params/")}

    mixtral = params("mixtral-8x7b")
    assert mixtral["params/decoder/layers/MoeBlock_0/gate/kernel"] == ("embed", "layers", None)
    assert mixtral["params/decoder/layers/MoeBlock_0/wi_0"] == ("exp", "layers", "embed_moe", "mlp_moe")
    qwen = params("qwen3-30b-a3b")
    assert qwen["params/decoder/layers/moe_block/gate/kernel"] == ("embed", "layers", None)
    assert qwen["params/decoder/layers/self_attention/query_norm/scale"] == ("norm", "layers")
    gemma = params("gemma-7b")
    assert {"params/decoder/layers/pre_self_attention_norm/scale", "params/decoder/layers/pre_ffw_norm/scale"} <= set(gemma)
    assert not any("logits_dense" in p for p in gemma)  # tied output projection
    for tree in (mixtral, qwen, gemma):
        assert not any("GptOss" in p or "DeepSeek" in p for p in tree)


# --- honest blocks -------------------------------------------------------------------------------

def card_file(tmp_path: Path, base: str, name: str, **change) -> Path:
    """A copy of shipped card `base`, renamed and changed, as a file of its own."""
    card = {**load_card(base), "name": name, **change}
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(card, sort_keys=False))
    return path


@pytest.mark.parametrize("base,field,value", [
    ("llama3.1-8b", "num_experts", 8),  # would silently build a dense model
    ("llama3.1-8b", "use_qk_norm", True),  # MaxText's llama2 layer has no q/k norms
    ("gpt-oss-20b", "use_qk_norm", True),  # Qwen3-30B-A3B as gpt_oss came out 12,288 parameters short
    ("mixtral-8x7b", "shared_experts", 1),
    ("qwen3-30b-a3b", "first_num_dense_layers", 2),
    ("gemma-7b", "sliding_window_size", 4096),
    ("deepseek2-16b", "logits_via_embedding", True),
    ("llama3.1-8b", "rope_type", "yarn"),
])
def test_field_the_block_ignores_exits_2_naming_it(tmp_path, capsys, base, field, value):
    extra = {"original_max_position_embeddings": 4096, "rope_factor": 8} if field == "rope_type" else {}
    path = card_file(tmp_path, base, "my-card", **{field: value}, **extra)
    block = load_card(base)["decoder_block"]
    assert_bad_input(tmp_path, capsys, f"--model {path}",
                     f"model card {path}: field {field}: {json.dumps(value)} is ignored by decoder block '{block}'")


@pytest.mark.parametrize("base,change,message", [
    ("llama3.1-8b", {"decoder_block": "llama9"}, "field decoder_block: 'llama9' is not a decoder block: valid blocks are"),
    ("mixtral-8x7b", {"moe_mlp_dim": 1024}, "field moe_mlp_dim: 1024 must equal mlp_dim (14336)"),
    ("deepseek2-16b", {"num_kv_heads": 8}, "field num_kv_heads: 8 must equal num_query_heads (16)"),
    ("gemma-7b", {"emb_dim": "wide"}, "field emb_dim: must be an integer, not str"),
    ("gpt3-6b", {"settings": {"max_target_len": 1024}}, "field settings: unknown setting 'max_target_len'"),
])
def test_inconsistent_card_exits_2(tmp_path, capsys, base, change, message):
    path = card_file(tmp_path, base, "my-card", **change)
    assert_bad_input(tmp_path, capsys, f"--model {path}", f"model card {path}: {message}")


def test_required_field_of_the_block(tmp_path):
    card = load_card("mixtral-8x7b")
    path = tmp_path / "no-experts.yml"
    path.write_text(yaml.safe_dump({k: v for k, v in card.items() if k != "num_experts"} | {"name": "no-experts"}))
    with pytest.raises(BadInput, match="field num_experts: decoder block 'mixtral' requires it"):
        load_card(str(path))


@pytest.mark.parametrize("base,field", [("llama3.1-8b", "num_experts"), ("gpt-oss-20b", "use_qk_norm")])
def test_rejected_fields_really_are_ignored(base, field):
    """Why those cards are refused: the block builds the same parameters with or without the field."""
    cfg = cards.load_config(base)
    value = 8 if field == "num_experts" else True
    assert count(dataclasses.replace(cfg, **{field: value})) == count(cfg)


COMMON = honoured_fields("llama2") - {"head_dim", "mlp_activations", "logits_via_embedding", "rope_max_timescale"}
BLOCK_CARDS = {"gemma": "gemma-2b", "mixtral": "mixtral-8x7b", "qwen3_moe": "qwen3-30b-a3b"}
TINY = dict(emb_dim=32, num_query_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48, moe_mlp_dim=48,
            num_decoder_layers=2, vocab_size=64, num_experts=4, num_experts_per_tok=2, dtype="float32")
OTHER_VALUE = {"head_dim": 16, "mlp_activations": ("relu", "linear"), "rope_max_timescale": 1234,
               "num_experts": 8, "num_experts_per_tok": 1, "moe_mlp_dim": 40}


@functools.cache
def model_signature(cfg: models.ModelConfig) -> str:
    """A digest of the traced init-and-forward of the card's module (program text and constants)."""
    net = cards.build_model(cfg)
    tokens, positions = jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None]
    closed = jax.make_jaxpr(lambda: net.init_with_output(jax.random.key(0), tokens, positions))()
    digest = hashlib.sha256(str(closed.jaxpr).encode())
    for const in closed.consts:
        digest.update(np.asarray(const).tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("block,field", [
    (block, field) for block in sorted(BLOCK_CARDS)
    for field in sorted(honoured_fields(block) - honoured_fields("llama2") | honoured_fields("llama2") - COMMON)])
def test_fields_a_new_block_honours_change_its_model(block, field):
    """A block's card_fields do not overclaim: each field a new block lists changes what it builds."""
    cfg = dataclasses.replace(cards.load_config(BLOCK_CARDS[block]), **TINY)
    value = OTHER_VALUE.get(field, not getattr(cfg, field))
    change = {field: value, **({"mlp_dim": value} if field == "moe_mlp_dim" else {})}
    assert model_signature(dataclasses.replace(cfg, **change)) != model_signature(cfg)


# --- cards by path -------------------------------------------------------------------------------

LLAMA3_8B = textwrap.dedent("""\
    # Llama 3 8B, written by a user outside the package.
    name: my-llama3-8b
    decoder_block: llama2
    emb_dim: 4096
    num_query_heads: 32
    num_kv_heads: 8
    head_dim: 128
    mlp_dim: 14336
    num_decoder_layers: 32
    vocab_size: 128256
    logits_via_embedding: false
    rope_max_timescale: 500000
    """)


def test_card_by_path_dumps_under_its_name(tmp_path):
    path = tmp_path / "cards" / "llama3.yaml"
    path.parent.mkdir()
    path.write_text(LLAMA3_8B)
    out = tmp_path / "out"
    assert cli.main(["--model", str(path), "--topology", "v5p-32", "--rule", "default", "--output-dir", str(out)]) == 0
    folder = out / "my-llama3-8b" / "v5p-32" / "slice_1" / "rule_default"
    named = json.loads((folder / "named_shardings.json").read_text())
    assert named["case"]["model"] == "my-llama3-8b"
    params = {k: v for k, v in named["tensors"].items() if k.startswith("model/") and "/rngs/" not in k}
    assert sum(int(np.prod(t["shape"])) for t in params.values()) == 8_030_261_248
    # The same model as the shipped Llama 3.1 8B card: the same layouts, tensor by tensor.
    shipped = committed_golden(Case.make("llama3.1-8b", "v5p-32", "default"), "named_shardings.json")
    assert named["tensors"] == shipped["tensors"]


def test_card_path_and_name_resolution(tmp_path):
    shipped = REPO / "sharding_dump/data/models/llama3.1-8b.yml"
    assert resolve_model(str(shipped)) == ("llama3.1-8b", shipped)
    assert resolve_model("llama3.1-8b")[0] == "llama3.1-8b"
    copy = tmp_path / "copy.yml"
    copy.write_text(shipped.read_text())
    with pytest.raises(BadInput, match=r"field name: 'llama3.1-8b' is the name of the model card .*own name"):
        resolve_model(str(copy))
    with pytest.raises(BadInput, match=r"unknown model 'llama3.1-9b': valid models are the \d+ cards .*closest: llama3.1-8b.* or a path to a card file"):
        resolve_model("llama3.1-9b")


def test_missing_card_file_exits_2(tmp_path, capsys):
    assert_bad_input(tmp_path, capsys, f"--model {tmp_path / 'nope.yml'}", f"model card {tmp_path / 'nope.yml'}: no such file")


# --- entry points --------------------------------------------------------------------------------

PLUGIN = textwrap.dedent('''\
    """A package outside sharding-dump registering one family and a directory of cards."""
    from pathlib import Path

    from sharding_dump.models.dense import DenseDecoderLM


    class TinyFamilyLM(DenseDecoderLM):
        card_fields = ("head_dim", "use_qk_norm", "logits_via_embedding")
        required_fields = ("head_dim",)


    def card_dir():
        return Path(__file__).parent / "cards"
    ''')
PLUGIN_CARD = textwrap.dedent("""\
    name: tiny-plugin-lm
    decoder_block: tiny_family
    emb_dim: 64
    num_query_heads: 4
    num_kv_heads: 2
    head_dim: 16
    mlp_dim: 128
    num_decoder_layers: 2
    vocab_size: 256
    use_qk_norm: true
    """)
# embedding + logits (2 x 256 x 64) + final norm, and per layer: q, k, v, out, q/k norms, 3 MLP kernels, 2 norms
PLUGIN_PARAMS = 2 * 256 * 64 + 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16 + 3 * 64 * 128 + 2 * 64)


def install_plugin(root: Path) -> Path:
    """A package and its dist-info (entry_points.txt) in `root`, as pip would install it."""
    package = root / "tiny_plugin"
    (package / "cards").mkdir(parents=True)
    (package / "__init__.py").write_text(PLUGIN)
    (package / "cards" / "tiny-plugin-lm.yml").write_text(PLUGIN_CARD)
    info = root / "tiny_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[sharding_dump.families]\ntiny_family = tiny_plugin:TinyFamilyLM\n\n"
        "[sharding_dump.cards]\ntiny_plugin = tiny_plugin:card_dir\n")
    return root


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The plugin package installed on sys.path, as pip would put it there, and not yet imported: the
    package reads the entry points again once sys.path has changed, so this process finds them as a
    newly started one would."""
    site = install_plugin(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "tiny_plugin", raising=False)
    return site


def test_installed_package_registers_family_and_cards(installed_plugin, tmp_path, monkeypatch, capsys):
    assert "tiny-plugin-lm" in cards.model_names() and "tiny_family" in cards.decoder_blocks()
    cfg = cards.load_config("tiny-plugin-lm")
    assert type(cards.build_model(cfg)).__name__ == "TinyFamilyLM"
    assert cards.block_lineage("tiny_family") == ("tiny_family", "llama2")  # the shipped block its class derives from
    assert cards.block_lineage("qwen3_5") == ("qwen3_5",)  # a shipped block never takes its base class's (qwen3_next)
    assert count(cfg) == PLUGIN_PARAMS
    every = cards.model_names
    monkeypatch.setattr(cards, "model_names", lambda: [n for n in every() if n in {"tiny-plugin-lm", "qwen3-0.6b"}])
    assert cli.main(["list", "models"]) == 0  # the installed card among the built-in ones (one stands for all)
    out = capsys.readouterr().out
    assert f"tiny-plugin-lm     tiny_family {PLUGIN_PARAMS:>17,} parameters" in out and "tiny_plugin/cards" in out
    # A field the family does not declare is refused like any other.
    card = tmp_path / "site" / "tiny_plugin" / "cards" / "tiny-plugin-lm.yml"
    card.write_text(PLUGIN_CARD + "num_experts: 4\n")
    with pytest.raises(BadInput, match="field num_experts: 4 is ignored by decoder block 'tiny_family'"):
        cards.load_config("tiny-plugin-lm")
    # So is a card without a field the family requires.
    card.write_text(PLUGIN_CARD.replace("head_dim: 16\n", ""))
    with pytest.raises(BadInput, match="field head_dim: decoder block 'tiny_family' requires it"):
        cards.load_config("tiny-plugin-lm")


def test_installed_card_dumps_from_the_command_line(installed_plugin, tmp_path, capsys):
    status = cli.main(["--model", "tiny-plugin-lm", "--topology", "cpu-4", "--rule", "default", "--output-dir",
                       str(tmp_path / "out")])
    assert status == 0, capsys.readouterr().err
    named = json.loads((tmp_path / "out/tiny-plugin-lm/cpu-4/slice_1/rule_default/named_shardings.json").read_text())
    assert named["case"]["model"] == "tiny-plugin-lm"
    params = [t["shape"] for path, t in named["tensors"].items() if rules.parameter(path) is not None]
    assert sum(int(np.prod(shape)) for shape in params) == PLUGIN_PARAMS
    # MaxText's NNX build (the default) keeps RNG state where the llama2 block its class derives from does.
    rngs = sorted({path.split("/rngs/")[0] for path in named["tensors"] if "/rngs/" in path})
    assert rngs == ["model/decoder", "model/decoder/layers/self_attention"]


# --- the new golden cases catch a rule edit ------------------------------------------------------

NEW_MODELS = {"llama3.1-70b", "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "gemma-7b"}
NEW_CASES = [c for c in load_matrix()
             if c.model in NEW_MODELS and (c.model != "qwen3-235b-a22b" or c.rule == "ep-as-dp")]


@pytest.mark.parametrize("case", sweep_beyond_first(NEW_CASES, lambda c: load_card(c.model)["decoder_block"]),
                         ids=lambda c: c.label)
def test_breaking_a_rule_line_fails_the_new_case(tmp_path, case):
    """The case's rule file with its first `embed` line emptied maps to the same golden folder and fails
    (by default one case per decoder block; the sweep runs them all)."""
    text = (REPO / f"sharding_dump/rules/{case.rule}.yml").read_text()
    line = next(l for l in text.splitlines(keepends=True) if l.startswith("  - [embed, "))
    rule = tmp_path / f"{case.rule}.yml"
    rule.write_text(text.replace(line, "  - [embed, []]\n", 1))
    broken = Case.make(case.model, case.topology, str(rule), case.num_slices, dict(case.overrides))
    outcome = check_or_update(broken, REPO / "golden", update=False)
    assert outcome.status == "differs"
    assert "model/decoder/layers/self_attention/query/kernel" in outcome.report


def test_a_block_found_by_its_own_module_is_the_registrys():
    """A card's block is looked up by importing only the family module whose source names it; for every
    shipped block that gives the class, module and fields the full registry (every module imported) holds."""
    full = cards._shipped_blocks()
    assert {name: cards._shipped_block(name) for name in full} == full
    assert models.family_of("no-such-block") is None
