"""The zoo serves too: a model card with serving=true runs MaxEngine's prefill, insert and generate over
MaxText's KV cache under MaxText's inference configuration (rule `inference`), and gives the cache
MaxText's own code gives for the same configuration (tests/data/maxtext/serving/llama2-7b.json,
recorded from MaxText 0.2.5's MaxEngine by tools/maxtext_kvcache_reference.py)."""

from __future__ import annotations

import json

import pytest

from helpers import REPO
from sharding_dump.commands import check
from sharding_dump.commands.cli import main
from sharding_dump.core import specs
from sharding_dump.zoo import dump, serving
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.matrix import load_matrix

RECORDED = json.loads((REPO / "tests/data/maxtext/serving/llama2-7b.json").read_text())
CACHE_PREFIX = "decoder/layers/self_attention/KVCache_0/"


def recorded_case(recorded: dict) -> Case:
    """The zoo's case of a recorded MaxText configuration: llama2-7b on 8 chips, rule inference, as MaxText
    0.2.5 builds it (the int8 one is the matrix's serving case)."""
    settings = dict(s.split("=", 1) for s in recorded["settings"])
    keys = ("per_device_batch_size", "max_prefill_predict_length", "max_target_length", "ici_fsdp_parallelism",
            "ici_tensor_parallelism", "quantize_kvcache")
    return Case.make("llama2-7b", "tpu7x-8", "inference", overrides={
        "maxtext_version": RECORDED["maxtext"], "serving": "true", **{k: settings[k] for k in keys if k in settings}})


def theirs(recorded: dict, mode: str) -> dict[str, dict]:
    mesh = recorded["mesh"]
    return {name.rsplit("/", 1)[1]: {"shape": e["shape"], "dtype": e["dtype"],
                                     "partition_spec": specs.spec_to_json(e["partition_spec"], len(e["shape"]), mesh)}
            for name, e in recorded["cache"][mode].items()}


def spec_json(spec, ndim: int, sizes: dict[str, int]):
    return specs.spec_to_json(spec, ndim, sizes)  # axes of size 1 left out: they split nothing


@pytest.mark.parametrize("recorded", RECORDED["cases"], ids=["bfloat16-fsdp8", "int8-tensor8"])
def test_the_zoo_serving_case_gives_maxtexts_cache(recorded):
    """The decode state's cache (MaxEngine's generate model, every slot) and the prefix a prefill hands
    on (its prefill model's cache variables insert reads) equal MaxText's in shape, dtype and
    partition spec, and the case's rules are the ones MaxEngine resolved them with."""
    setup = dump.setup_case(recorded_case(recorded))
    traced = serving.traced_of(setup)
    sizes = setup.plan.sizes
    assert dict(recorded["mesh"]) == {a: sizes.get(a, 1) for a in recorded["mesh"]}
    state = {t.path[len("cache/" + CACHE_PREFIX):]: {"shape": list(t.shape), "dtype": t.dtype,
                                                     "partition_spec": spec_json(t.partition_spec, len(t.shape), sizes)}
             for t in traced.layouts if t.path.startswith("cache/")}
    assert state == theirs(recorded, "autoregressive")
    logical = {t.path.rsplit("/", 1)[1]: list(t.logical_axes) for t in traced.layouts if t.path.startswith("cache/")}
    assert logical == {n.rsplit("/", 1)[1]: e["logical_axes"] for n, e in recorded["cache"]["autoregressive"].items()}
    prefill = next(step for step in traced.steps if step.name == "prefill")
    prefix = {path[len("cache/" + CACHE_PREFIX):]: {"shape": list(leaf.shape), "dtype": leaf.dtype.name,
                                                     "partition_spec": spec_json(spec, leaf.ndim, sizes)}
              for path, (leaf, spec) in prefill.outputs.items() if path.startswith("cache/")}
    expected = theirs(recorded, "prefill")
    assert prefix == {name: expected[name] for name in prefix}
    assert sorted(prefix) == sorted(n for n in expected if n.startswith(("cached_prefill_", "cache_prefill_")))

    def axes(entry):
        return tuple(a for a in specs.entry_axes(entry if isinstance(entry, (str, type(None))) else tuple(entry))
                     if a != "tensor_transpose")

    # The recording kept one rule naming tensor_transpose, [activation_embed, [tensor_transpose]]: MaxText ran
    # with it, as it drops an axis its mesh lacks from an activation's constraint (the fact the
    # missing-axis lint reads); the rule file drops it.
    ours = [(name, axes(a)) for name, a in setup.rule_set.logical_axis_rules]
    assert ours == [(name, axes(a)) for name, a in recorded["logical_axis_rules"]]


def test_the_zoo_serving_case_has_a_golden_of_prefill_insert_and_generate():
    """The matrix's serving case: its golden is committed and current; each step takes the cache as the
    state holds it, insert takes the prefix in MaxEngine's layout of it, and the hand-offs are free."""
    (case,) = [c for c in load_matrix(REPO / "sharding_dump/data/cases.yml") if serving.serves(c)]
    docs = dump.dump_case(case)
    steps = docs["serving_steps.json"]
    assert list(steps["steps"]) == ["prefill", "insert", "generate"]
    assert steps["steps"]["insert"] == {"requests": 1, "takes": "prefill"}
    key = "cache/" + CACHE_PREFIX + "cached_ar_key"
    heads = ["stage", None, ["autoregressive", "tensor", "tensor_sequence"], "context_autoregressive", None]  # tensor=8
    assert docs["named_shardings.json"]["tensors"][key]["partition_spec"] == heads
    assert steps["tensors"]["generate/state/" + key] == {"in": heads, "out": heads}
    assert all(h["leaves_moved"] == 0 for h in steps["handoffs"].values())
    assert steps["per_device_bytes"]["cache"] == steps["cache_bytes"]["per_device"] > 0
    from sharding_dump.golden.engine import check_or_update_folder

    outcome = check_or_update_folder(golden_dir(case, REPO / "golden"), dump.render_case(case), update=False)
    assert outcome.status == "match", outcome.report


def test_maxtexts_inference_yml_is_a_finding_where_it_reaches_a_weight_or_the_cache():
    """tensor_transpose, which MaxText's inference.yml names and base.yml's mesh lacks, is reported for
    the weights and the cache it would place; ep-as-dp.yml names axes its mesh lacks (context, tensor,
    tensor_transpose) only in activation rules, which MaxText drops from the constraint: no finding."""
    (case,) = [c for c in load_matrix(REPO / "sharding_dump/data/cases.yml") if serving.serves(c)]
    found = [f for f in check.lint_case(case) if f.lint == "missing-axis"]
    assert len(found) == 1 and found[0].subject == "mesh axis 'tensor_transpose'"
    assert "(cache_heads, embed, embed_attn, embed_vocab, heads, kv_heads, q_heads, vocab)" in found[0].message
    assert "reaches 13 state leaves:" not in found[0].message and "the batch" not in found[0].message
    ep_as_dp = Case.make("deepseek2-16b", "tpu7x-16", "ep-as-dp",
                         overrides={"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 2, "use_ring_of_experts": True})
    assert {m.axis for m in ep_as_dp.rule_set().missing_axes} == {"context", "tensor", "tensor_transpose"}
    assert [f for f in check.lint_case(ep_as_dp) if f.lint == "missing-axis"] == []


def test_training_under_maxtexts_inference_yml_also_reaches_the_batch():
    setup = dump.setup_case(Case.make("llama2-7b", "tpu7x-8", "inference"))
    (finding,) = check.check_missing_axes(setup, dump.case_layouts(setup.case)[1])
    assert "and the batch (data_sharding)" in finding.message


@pytest.mark.parametrize("setting, message", [
    ("serving=true", "serving=true: applies to the zoo's model cards; model 'examples.llama3_serving:small_llama3' "
                     "is a factory"),
    ("page_size=3", "page_size=3: give 0 (no pages) or a whole number of tokens that divides max_target_length=64"),
    ("page_size=-1", "page_size"),
])
def test_bad_serving_settings_of_a_factory_are_one_line(capsys, setting, message):
    args = ["--model", "examples.llama3_serving:small_llama3", "--topology", "cpu-8", "--rule",
            "examples/llama3_serving_rules.yml", "ici_x_parallelism=2", "ici_y_parallelism=4", "per_device_batch_size=1",
            "max_target_length=64", "max_prefill_predict_length=16", setting, "--golden-dir", "/nonexistent/never"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("overrides, message", [
    ({"page_size": 8}, "page_size=8: the zoo serves MaxText's contiguous KV cache"),
    ({"max_prefill_predict_length": 2048}, "max_prefill_predict_length=2048: MaxText's KV cache needs "
                                           "max_target_length (2048) longer"),
    ({"quantize_kvcache": True, "serving": False}, "quantize_kvcache: applies to serving programs only"),
    ({"shard_mode": "explicit"}, "shard_mode=explicit: the zoo serves a card as MaxEngine does, on a mesh of Auto axes"),
])
def test_bad_serving_settings_of_a_card_are_one_line(overrides, message):
    from sharding_dump.errors import BadInput

    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        dump.setup_case(Case.make("llama2-7b", "tpu7x-8", "inference", overrides={"serving": True, **overrides}))


def test_a_card_the_zoo_does_not_serve_is_one_line():
    from sharding_dump.errors import BadInput

    with pytest.raises(BadInput, match="serving=true: the zoo serves decoder blocks llama2, mistral, qwen2, qwen3"):
        dump.setup_case(Case.make("gemma2-2b", "tpu7x-8", "inference", overrides={"serving": True}))


def test_a_70b_zoo_server_that_does_not_fit_names_the_largest_slot_count(capsys):
    """llama2-70b in bfloat16, int8 cache, 256 slots of 8192 tokens on v6e-8 (32 GiB per chip): 16.1 GiB of
    weights + 41.3 GiB of cache; 98 slots fit at that length (the length probe reads MaxText's generate
    cache, max_target_length less the prompt, from init traced again)."""
    args = ["check", "--model", "llama2-70b", "--topology", "v6e-8", "--rule", "inference", "serving=true",
            "weight_dtype=bfloat16", "per_device_batch_size=32", "max_prefill_predict_length=1024",
            "max_target_length=8192", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=8", "quantize_kvcache=true"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "[memory] weights + KV cache per device at 256 slots x 8192 tokens" in out
    assert "the largest slot count that fits at 8192 tokens is 98 (per_device_batch_size=12.25 on 8 devices)" in out
    assert "at 256 slots the longest cache that fits is 3159 tokens" in out


PAGED = '''
import jax.numpy as jnp
import sharding_dump as sd


def init(key, settings):
    pages = (settings.max_length // settings.page_size, settings.page_size) if settings.page_size else (settings.max_length,)
    return {"weights": jnp.zeros((8, 4)), "cache": jnp.zeros((settings.slots,) + pages + (4,))}


def generate(state, inputs, settings):
    return state, {"next": inputs["tokens"] + 1}


def program():
    return sd.ServingProgram(init, {"generate": sd.ServingStep(generate, {"tokens": sd.Input(("slots", 1))})})
'''


@pytest.mark.parametrize("page_size, cache_shape", [(None, [4, 64, 4]), (16, [4, 4, 16, 4])])
def test_page_size_on_the_command_line_reaches_the_programs_init(tmp_path, monkeypatch, fresh, page_size, cache_shape):
    """page_size=16 (KEY=VALUE) is the ServingSettings.page_size the program's init builds its cache with."""
    (tmp_path / "paged_server.py").write_text(PAGED)
    (tmp_path / "rules.yml").write_text("mesh_axes: [x]\n")
    monkeypatch.chdir(tmp_path)
    given = {} if page_size is None else {"page_size": page_size}
    case = Case.make("paged_server:program", "cpu-2", str(tmp_path / "rules.yml"), overrides={
        "ici_x_parallelism": 2, "per_device_batch_size": 2, "max_target_length": 64, "max_prefill_predict_length": 16,
        **given})
    docs = dump.dump_case(case)
    assert docs["named_shardings.json"]["tensors"]["cache"]["shape"] == cache_shape
    assert docs["serving_steps.json"]["serving"]["page_size"] == (page_size or 0)
