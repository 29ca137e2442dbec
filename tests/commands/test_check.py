"""`sharding-dump check`: every lint on real dense-model layouts, and the rule line it names."""

import json

import pytest

from helpers import LINEN, LINEN_ARGS, REPO, committed_golden, sweep_beyond_first
from sharding_dump.commands import check
from sharding_dump.commands.cli import main
from sharding_dump.core.specs import entry_axes
from sharding_dump.zoo import releases, rules
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.dump import case_layouts, setup_case
from sharding_dump.zoo.matrix import load_matrix, load_project_cases
from sharding_dump.zoo.project import load_project

DEFAULT = REPO / "sharding_dump/rules/default.yml"


def line_of(path, text):
    """1-based line of the first line of `path` that starts with `text`."""
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(text))


def by_lint(findings):
    out = {}
    for f in findings:
        out.setdefault(f.lint, []).append(f)
    return out


def test_clean_case_exits_0(capsys):
    assert main(["check", "--model", "llama2-7b", "--topology", "v5p-16", "--rule", "pure-fsdp"]) == 0
    assert capsys.readouterr().out.startswith("llama2-7b/v5p-16/slice_1/rule_pure-fsdp: clean (")


# Matrix cases whose findings are true and intended: ZeRO-1 on v5p-8 uses data=2 x stage=2, so no
# device is left for fsdp and the embeddings (3.9% of parameter bytes) are whole on every device.
EXPECTED_FINDINGS = {
    "llama2-7b/v5p-8/slice_1/rule_default_ici_data_parallelism=2_ici_pipeline_parallelism=2_"
    "num_pipeline_microbatches=8_shard_optimizer_over_data=true": ["replicated"],
    "llama2-7b/v5p-8/slice_1/rule_default_ici_data_parallelism=2_ici_pipeline_parallelism=2_"
    "num_pipeline_microbatches=8_shard_optimizer_over_data=true_shard_mode=explicit": ["replicated"],
    # DeepSeek-V3.2 (672B) on 16 chips does not fit, and its indexer's k_norm carries no logical axes in
    # MaxText either (whole on every device in MaxText's own dump); the case is the one checked against it.
    "deepseek3.2-671b/tpu7x-16/slice_1/rule_default": ["unplaced", "memory"],
    # Gated DeltaNet's conv1d kernel, A_log and dt_bias carry no logical axes in MaxText's own dump either.
    "qwen3-next-80b-a3b/tpu7x-16/slice_1/rule_default_ici_tensor_parallelism=2_ici_expert_parallelism=4": ["unplaced"],
    "qwen3.5-35b-a3b/tpu7x-8/slice_1/rule_default": ["unplaced"],
    # optax's muon keeps its Newton-Schulz coefficients (3 floats) as state: whole on every device, in
    # MaxText's own dump too; the lint of state leaves placed by nothing names it.
    "qwen3-0.6b/tpu7x-16/slice_1/rule_default_opt_type=muon": ["unplaced"],
    # MaxText's inference.yml names tensor_transpose, which its mesh lacks, in the rules of the weights and
    # the cache: MaxText refuses it as it is (the rule file drops it and says where it was named).
    "llama2-7b/tpu7x-8/slice_1/rule_inference_ici_fsdp_parallelism=1_ici_tensor_parallelism=8_"
    "per_device_batch_size=1_max_target_length=2048_serving=true_max_prefill_predict_length=1024_quantize_kvcache=true":
        ["missing-axis"],
}


@pytest.mark.sweep
def test_every_case_of_the_matrix_is_clean_but_the_known_ones_with_progress(capsys):
    assert main(["check", "--all"]) == 1
    lines = capsys.readouterr().out.splitlines()
    cases = load_project_cases(load_project(REPO))  # what --all checks: every case file of the project
    progress = [line for line in lines if line.startswith("[")]
    assert [line.split(" ", 1)[0] for line in progress] == [f"[{i}/{len(cases)}]" for i in range(1, len(cases) + 1)]
    for case, line in zip(cases, progress):
        expected = EXPECTED_FINDINGS.get(case.label)
        count = len(expected or [])
        said = f"{count} finding{'s' * (count > 1)}" if count else "clean"
        assert line.split(" ", 1)[1].startswith(f"{case.label}: {said} ("), line
    found = [line.strip().split("]")[0] + "]" for line in lines if line.startswith("  [")]
    assert found == [f"[{lint}]" for case in cases for lint in EXPECTED_FINDINGS.get(case.label, [])]
    assert lines[-1] == f"{len(cases)} cases checked, {len(found)} findings"


def test_kv_heads_not_divisible_by_tensor(capsys):
    args = ["check", "--model", "qwen3-0.6b", "--topology", "tpu7x-16", "--rule", "default", "ici_tensor_parallelism=16",
            "maxtext_version=0.2.4"]  # 0.2.5 refuses a split key/value head outright
    assert main(args) == 1
    out = capsys.readouterr().out
    rule = f"sharding_dump/rules/default.yml:{line_of(DEFAULT, '  - [kv_heads,')}  [kv_heads, [tensor, tensor_sequence, autoregressive]]"
    for name in ("key", "value"):
        block = (f"  [divisibility] model/decoder/layers/self_attention/{name}/kernel (and optimizer/opt_state/0/mu, optimizer/opt_state/0/nu)\n"
                 f"      dim 2 (kv_heads) of size 8 is split over tensor=16: 8 is not a multiple of 16\n"
                 f"      rule: {rule}\n")
        assert block in out
    assert "2 findings" in out.splitlines()[0]  # query (16 heads) and out divide; nothing else fires


def test_dimension_larger_than_its_split_but_not_a_multiple():
    """151936 rows over tensor=256: every device holds 594 rows but the last shard is padded."""
    case = Case.make("qwen3-0.6b", "tpu7x-256", "default", overrides={"ici_tensor_parallelism": "256", "maxtext_version": "0.2.4"})
    found = {f.subject: f for f in check.lint_case(case) if f.lint == "divisibility"}
    emb = found["model/token_embedder/embedding (and optimizer/opt_state/0/mu, optimizer/opt_state/0/nu)"]
    assert emb.message == "dim 0 (vocab) of size 151936 is split over tensor=256: 151936 is not a multiple of 256"
    assert emb.details == (f"rule: sharding_dump/rules/default.yml:{line_of(DEFAULT, '  - [vocab,')}  "
                           "[vocab, [tensor, tensor_sequence, autoregressive]]",)
    assert not any("mlp/" in name for name in found)  # 3072 = 12 x 256


def test_product_of_several_axes_and_the_fallback_rule_that_applied():
    """The q_lora shape of problem on a dense model: embed (1024) over fsdp x expert = 2048."""
    case = Case.make("qwen3-0.6b", "tpu7x-2048", "default", overrides={"ici_expert_parallelism": "2", "maxtext_version": "0.2.4"})
    found = {f.subject.split(" ")[0]: f for f in check.lint_case(case) if f.lint == "divisibility"}
    first = line_of(DEFAULT, "  - [embed, [fsdp, fsdp_transpose")
    fallback = line_of(DEFAULT, "  - [embed, [fsdp, context")
    key = found["model/decoder/layers/self_attention/key/kernel"]
    assert key.message == "dim 0 (embed) of size 1024 is split over fsdp=1024 x expert=2 = 2048: 1024 is not a multiple of 2048"
    assert key.details == (f"rule: sharding_dump/rules/default.yml:{first}  "
                           "[embed, [fsdp, fsdp_transpose, context, context_usp_ulysses, expert]]",)
    # in the MLP `mlp` takes fsdp_transpose first, so embed falls back to its second rule
    wi0 = found["model/decoder/layers/mlp/wi_0/kernel"]
    assert wi0.details == (f"rule: sharding_dump/rules/default.yml:{fallback}  "
                           "[embed, [fsdp, context, context_usp_ulysses, expert]]",)


def leaf_specs(case):
    """(rule set, settings, [(path, logical axes, partition spec)]) of a case: a matrix case's from its
    committed goldens (which the golden tests prove equal a fresh dump), any other case dumped."""
    setup = setup_case(case)
    if case in MATRIX:
        logical, named = (committed_golden(case, f"{kind}_shardings.json")["tensors"] for kind in ("logical", "named"))
        leaves = [(path, tuple(logical[path]["logical_axes"]), tuple(named[path]["partition_spec"])) for path in named]
    else:
        leaves = [(t.path, t.logical_axes, tuple(t.partition_spec)) for t in case_layouts(case)[1]]
    return setup.rule_set, setup.values, leaves, setup.plan.sizes


MATRIX = load_matrix()


@pytest.mark.parametrize("case", sweep_beyond_first(MATRIX, lambda c: c.rule) + [
    Case.make("qwen3-0.6b", "tpu7x-2048", "default", overrides={"ici_expert_parallelism": "2"}),
    Case.make("llama2-7b", "v5p-16", "default", overrides={"ici_tensor_parallelism": "2"}),
], ids=lambda c: c.label)
def test_the_deciding_rule_gives_the_resolved_spec(case):
    """Attribution replays flax's resolver: the rule it names must be the one that produced the spec."""
    rule_set, values, leaves, sizes = leaf_specs(case)
    table = rule_set.logical_axis_rules
    # MaxText's NNX build writes no mesh axis of size 1 in its state's specs (releases.nnx_build); its Linen build,
    # and a served KV cache, every one.
    nnx = releases.nnx_build(values) and not values["serving"]
    shown = (lambda axes: tuple(a for a in axes if sizes.get(a, 1) > 1)) if nnx else tuple
    for path, logical_axes, partition_spec in leaves:
        for dim, name in enumerate(logical_axes):
            index = rules.deciding_rule(logical_axes, table, dim)
            resolved = partition_spec[dim] if dim < len(partition_spec) else None
            if values["shard_optimizer_over_data"] and ("/mu/" in path or "/nu/" in path):
                # ZeRO-1 adds `data` to the moments on top of what the rules decide.
                kept = tuple(a for a in entry_axes(resolved) if a != "data")
                resolved = kept[0] if len(kept) == 1 else (kept or None)
            if index is None:
                assert resolved is None, (path, dim)
            else:
                assert shown(entry_axes(table[index][1])) == entry_axes(resolved), (path, dim, table[index])
                assert table[index][0] == name


def no_embed_rule(tmp_path):
    path = tmp_path / "no-embed.yml"
    path.write_text((REPO / "sharding_dump/rules/pure-fsdp.yml").read_text().replace("  - [embed, [fsdp]]\n", "  - [embed, []]\n"))
    return path


def test_replicated_parameters_above_tolerance(tmp_path, capsys):
    rule = no_embed_rule(tmp_path)
    args = ["check", "--model", "llama2-7b", "--topology", "v5p-16", "--rule", str(rule)]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "  [replicated] parameters held whole by every device\n" in out
    assert "96.1% of the parameter bytes (24.1 GiB of 25.1 GiB) are split over none of fsdp=8, above the 2.0% tolerance" in out
    assert (f"      model/decoder/layers/mlp/wi_0/kernel  5.4 GiB\n"
            f"        dim 0 (embed): {rule}:{line_of(rule, '  - [embed,')}  [embed, []]\n") in out
    assert main(args + ["--replicated-tolerance", "97%"]) == 0
    assert main(args + ["--replicated-tolerance", "0.95"]) == 1


def test_an_axis_of_size_1_shards_nothing(tmp_path):
    rule = tmp_path / "tp1.yml"
    rule.write_text("mesh_axes: [fsdp, tensor]\nlogical_axis_rules:\n  - [embed, tensor]\n"
                    "  - [embed_vocab, fsdp]\n  - [vocab, fsdp]\n")
    (finding,) = check.lint_case(Case.make("llama2-7b", "v5p-16", str(rule)))  # tensor = 1, fsdp = 8
    assert finding.lint == "replicated" and "split over none of fsdp=8" in finding.message
    assert f"  dim 0 (embed): {rule}:3  [embed, tensor]" in finding.details


def test_model_card_rules_point_at_the_card():
    setup, layouts = case_layouts(Case.make("llama2-7b", "v5p-16", "default"))
    norm = next(t for t in layouts if t.path == "model/decoder/decoder_norm/scale")
    card = REPO / "sharding_dump/data/models/llama2-7b.yml"
    assert check.dimension_rules(setup.rule_set, norm) == [
        f"  dim 0 (norm): sharding_dump/data/models/llama2-7b.yml:{line_of(card, 'logical_axis_rules:')}  [norm, fsdp]"]


def test_memory_above_hbm():
    findings = by_lint(check.lint_case(Case.make("llama2-7b", "v5e-4", "default")))
    assert list(findings) == ["memory"]
    (memory,) = findings["memory"]
    assert memory.message.startswith("params 6.3 GiB + optimizer state 12.6 GiB = 18.8 GiB per device, above the "
                                     "16.0 GiB HBM of one v5e device (118%)")
    assert memory.details[0] == "model/decoder/layers/mlp/wi_0/kernel (with its optimizer slots)  4.0 GiB"  # 1.3 x 3
    assert not check.lint_case(Case.make("llama2-7b", "v5e-8", "default"))  # 9.4 GiB fits in 16


def test_a_pipeline_of_scan_blocks_reports_the_layers_and_parameters_it_adds():
    """gemma4-31b with 2 stages (MaxText's Linen build: its NNX builds place a pipelined gemma4 otherwise):
    MaxText pipelines 60 blocks of 6 layers; its own dump of the case holds 177,137,614,440 parameters (the
    model: 30,697,345,340). A pipeline of single layers adds none."""
    findings = by_lint(check.lint_case(Case.make("gemma4-31b", "tpu7x-8", "default",
                                                 overrides={"ici_pipeline_parallelism": 2, **LINEN})))
    (layers,) = findings["pipeline-layers"]
    assert layers.message == ("the pipelined run builds 360 decoder layers where model gemma4-31b has 60, and "
                              "177,137,614,440 (177.14B) parameters where the model has 30,697,345,340 (30.70B)")
    assert "blocks of 6 layers: 60 blocks in all" in layers.details[0]
    plain = check.lint_case(Case.make("llama2-7b", "v5p-8", "default", overrides={"ici_pipeline_parallelism": 2,
                                                                                 "num_pipeline_microbatches": 8}))
    assert "pipeline-layers" not in by_lint(plain)


@pytest.mark.parametrize("cards", ["three", pytest.param("every", marks=pytest.mark.sweep)])
def test_a_logical_name_nothing_uses(tmp_path, monkeypatch, cards):
    """A name no card carries is only known after tracing every kind of card (29, ~10 s): by default
    three cards stand for them, the sweep traces all."""
    if cards == "three":
        from sharding_dump.zoo import cards
        three = tuple(cards.load_config(name) for name in ("llama2-7b", "qwen3-0.6b", "deepseek2-16b"))
        monkeypatch.setattr(check, "_card_kinds", lambda: three)
    rule = tmp_path / "tp.yml"
    rule.write_text("mesh_axes: [data, tensor]\nlogical_axis_rules:\n  - [embbed, tensor]\n"
                    "  - [mlp, tensor]\n  - [vocab, tensor]\n  - [heads, [tensor]]\n  - [cache_batch, []]\n")
    case = Case.make("llama2-7b", "v5p-16", str(rule),
                     overrides={"ici_tensor_parallelism": "-1", "ici_fsdp_parallelism": "1"})
    findings = by_lint(check.lint_case(case))
    assert "mesh-axis" not in findings  # a custom rule file replaces the rules: the card's norm rule is not used
    (name,) = findings["unknown-name"]  # cache_batch is a trainer axis: not reported
    assert name.subject == "logical axis 'embbed'" and name.details == (f"rule: {rule}:3  [embbed, tensor]",)
    assert findings["replicated"]  # every embed-like weight is replicated because of the typo


@pytest.mark.parametrize("args,message", [
    (["check"], "missing --model, --topology, --rule (or use --all)"),
    (["check", "--all", "--model", "llama2-7b"], "--all checks the whole case matrix"),
    (["check", "--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "--replicated-tolerance", "2"],
     "--replicated-tolerance '2': must be a fraction in [0, 1]"),
    (["check", "--model", "llama2-7b", "--topology", "v5p-16", "--rule", "default", "ici_tensor_parallelism=3"],
     "does not divide"),
    (["show", "--all"], "unrecognized arguments: --all"),
    (["show", "--model", "llama2-7b", "--topology", "v5p-99", "--rule", "default"], "unknown topology 'v5p-99'"),
])
def test_bad_input(args, message, capsys):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and len(captured.err.strip().splitlines()) == 1


# Kauldron's way: a flax struct train state, the weights placed by init's own jit, the optimizer state made
# outside it: no box, no rule, no sharding of its own, and no weight it follows (mapping states only).
OWN_INIT = """
import flax, jax, jax.numpy as jnp, optax
import sharding_dump as sd
from jax.sharding import NamedSharding, PartitionSpec as P

TX = optax.adamw(1e-3)


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState


def _params(key):
    mesh = jax.sharding.get_abstract_mesh()
    return jax.jit(lambda k: {"w": jax.random.normal(k, (64, 32)), "b": jnp.zeros((32,))},
                   out_shardings={"w": NamedSharding(mesh, P("fsdp")), "b": NamedSharding(mesh, P())})(key)


def _updated(params, opt_state, batch):
    grads = jax.grad(lambda p: (jnp.take(p["w"], batch["inputs"], axis=0) ** 2).sum() + p["b"].sum())(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def program():
    def init(key):
        params = _params(key)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=TX.init(params))

    def train_step(state, batch):
        params, opt_state = _updated(state.params, state.opt_state, batch)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), {}

    return sd.TrainProgram(init, train_step, batch={"inputs": sd.Input()})


def mapping_program():
    def init(key):
        params = _params(key)
        return {"params": params, "opt_state": TX.init(params)}

    def train_step(state, batch):
        params, opt_state = _updated(state["params"], state["opt_state"], batch)
        return {"params": params, "opt_state": opt_state}, {}

    return sd.TrainProgram(init, train_step, batch={"inputs": sd.Input()})
"""


def test_state_leaves_placed_by_nothing_are_warned_about_and_listed(tmp_path, capsys, monkeypatch):
    """docs/program-placement.md: a leaf placed by `none` is whole on every device, the dump warns and
    check lists it, optimizer leaves too (mutation: `unplaced_state` returning [], and neither the
    warning nor the finding is there: the dump was silent about them). In a mapping state the slots
    follow their weights, the one the program replicated itself too (mutation: a slot whose weight's
    spec splits nothing placed by `none` in layout.tensor_layouts, as before, and check lists
    opt_state/0/mu/b)."""
    (tmp_path / "own_init.py").write_text(OWN_INIT)
    (tmp_path / "mesh.yml").write_text("mesh_axes: [fsdp]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    case = ["--topology", "cpu-4", "--rule", "mesh.yml", "ici_fsdp_parallelism=4", "per_device_batch_size=1",
            "max_target_length=16"]
    assert main(["--model", "own_init:program", *case, "--golden-dir", "out"]) == 0
    assert ": 4 state leaves outside params are placed by nothing (no logical axes, partition rule or sharding of " \
           "the program's own, nor a weight followed), so each is whole on every device: opt_state/0/mu/b, " \
           "opt_state/0/mu/w, opt_state/0/nu/b and 1 more\n" in capsys.readouterr().err
    assert main(["check", "--model", "own_init:program", *case]) == 1
    out = capsys.readouterr().out
    assert "[unplaced] state leaves placed by nothing\n      4 state leaves outside params" in out, out
    assert [line.strip() for line in out.splitlines()[-4:]] == [
        "opt_state/0/mu/w  8.0 KiB", "opt_state/0/nu/w  8.0 KiB", "opt_state/0/mu/b  128 Bytes",
        "opt_state/0/nu/b  128 Bytes"]
    assert main(["check", "--model", "own_init:mapping_program", *case]) == 0, capsys.readouterr().out


def test_show_prints_every_leaf_and_the_totals(capsys):
    assert main(["show", "--model", "llama2-7b", "--topology", "v5p-16", "--rule", "pure-fsdp"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("llama2-7b/v5p-16/slice_1/rule_pure-fsdp: mesh fsdp=8 (8 devices)")
    row = next(line.split() for line in lines if line.startswith("model/decoder/layers/mlp/wi_0/kernel "))
    assert row == ["model/decoder/layers/mlp/wi_0/kernel", "[4096,32,11008]", '["embed","layers","mlp"]',
                   '["fsdp",null,null]', "[512,32,11008]", "688.0", "MiB"]
    golden = json.loads((REPO / "golden/llama2-7b/v5p-16/slice_1/rule_pure-fsdp/named_shardings.json").read_text())
    assert [line.split()[0] for line in lines if line.startswith(("model/", "optimizer/"))] == sorted(
        golden["tensors"], key=lambda p: (not p.startswith("model/"), p))
    assert lines[-1] == "per device: model 3.1 GiB, optimizer 6.3 GiB; total 9.4 GiB of 95.0 GiB HBM (9.9%)"
    assert main(["show", "--model", "qwen3-0.6b", "--topology", "tpu7x-16", "--rule", "default", "--full-specs",
                 *LINEN_ARGS]) == 0  # the Linen build writes every axis a rule names (the NNX build no size-1 one)
    assert '[["fsdp","context","context_usp_ulysses","expert"],"stage",' in capsys.readouterr().out


def test_deepseek3_q_lora_and_kv_lora_cannot_split_over_fsdp_times_expert(capsys):
    """fsdp=128 x expert=8 = 1024 devices share the low-rank dims: q_lora 1536 and kv_lora 512 do not divide."""
    args = ["check", "--model", "deepseek3-671b", "--topology", "tpu7x-2048", "--rule", "default",
            "ici_data_parallelism=2", "ici_fsdp_parallelism=-1", "ici_expert_parallelism=8", "maxtext_version=0.2.4"]
    assert main(args) == 1
    out = capsys.readouterr().out
    q_line = line_of(DEFAULT, "  - [q_lora,")
    assert ("model/decoder/moe_layers/self_attention/wq_b/kernel (and optimizer/opt_state/0/mu, optimizer/opt_state/0/nu)\n"
            "      dim 0 (q_lora) of size 1536 is split over fsdp=128 x expert=8 = 1024: "
            "1536 is not a multiple of 1024\n"
            f"      rule: sharding_dump/rules/default.yml:{q_line}") in out
    assert "dim 0 (kv_lora) of size 512 is split over fsdp=128 x expert=8 = 1024" in out
