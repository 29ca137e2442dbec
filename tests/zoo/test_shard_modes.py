"""Explicit sharding mode and ZeRO-1: explicit equals auto, moments on `data`, the header's mode."""

import pytest
from jax.sharding import PartitionSpec as P

from helpers import assert_bad_input, committed_golden, matrix_setups, sweep_beyond_first
from sharding_dump.core.documents import golden_documents
from sharding_dump.errors import BadInput
from sharding_dump.golden.codec import check_document
from sharding_dump.zoo import serving, state
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.dump import case_layouts, header
from sharding_dump.zoo.matrix import load_matrix

MATRIX = load_matrix()
SETUPS = matrix_setups()
ZERO1_CASES = [c for c in MATRIX if SETUPS[c.label].values["shard_optimizer_over_data"]]
# Explicit mode for the decoder blocks the case's MaxText release accepts in it (data/maxtext_releases.yml);
# not for a served card, which explicit mode refuses (MaxEngine runs its decoder on Auto axes).
AUTO_CASES = [c for c in MATRIX if not SETUPS[c.label].explicit and not serving.serves(c)
              and SETUPS[c.label].config.decoder_block in c.release.explicit_blocks]
EXPLICIT_CASES = [c for c in MATRIX if SETUPS[c.label].explicit]


def representatives(cases: list[Case]) -> list[Case]:
    """The first case of each kind (decoder block, pipelined, multi-slice, ZeRO-1, optimizer), plus the first case
    of each rule file not yet taken: every code path of explicit mode, each rule once, without
    tracing the 30-odd cases that repeat one."""
    kinds, rules, out = set(), set(), []
    for case in cases:
        setup = SETUPS[case.label]
        kind = (setup.config.decoder_block, setup.pipeline is not None, case.num_slices > 1,
                bool(setup.values["shard_optimizer_over_data"]), setup.values["opt_type"])
        if kind not in kinds or case.rule not in rules:
            kinds.add(kind)
            rules.add(case.rule)
            out.append(case)
    return out


def with_overrides(case: Case, **overrides) -> Case:
    return Case.make(case.model, case.topology, case.rule, case.num_slices, {**dict(case.overrides), **overrides})


def spec_axes(entry) -> list:
    return [] if entry is None else [entry] if isinstance(entry, str) else entry


def test_matrix_has_explicit_and_zero1_cases():
    assert len(EXPLICIT_CASES) == 2 and len(ZERO1_CASES) == 3


def code_path(case: Case) -> tuple:
    """The code path of explicit mode a case takes: pipelined, multi-slice, ZeRO-1, optimizer, MoE."""
    setup = SETUPS[case.label]
    return (setup.pipeline is not None, case.num_slices > 1, bool(setup.values["shard_optimizer_over_data"]),
            setup.values["opt_type"], setup.config.num_experts > 1)


@pytest.mark.parametrize("case", sweep_beyond_first(representatives(AUTO_CASES), code_path), ids=lambda c: c.label)
def test_explicit_mode_gives_the_auto_layout(case):
    """A case of every kind and rule of the matrix, traced on an Explicit-axis mesh, has the same
    tensors as in auto mode.
    The auto layout is the case's golden (the golden tests check it equals the auto dump), so only the
    explicit state is traced here: a card's step runs on the Auto mesh in both modes (the same step
    inputs, so the dump traces it once for both), and its activations are the golden's."""
    explicit_case = with_overrides(case, shard_mode="explicit")
    setup, layouts = case_layouts(explicit_case)
    assert setup.step_inputs() == SETUPS[case.label].step_inputs()
    explicit = golden_documents(layouts, setup.plan.abstract_mesh(), header=header(setup))
    for name, document in explicit.items():
        auto = committed_golden(case, name)
        assert document["mesh"]["shard_mode"] == "explicit" and auto["mesh"]["shard_mode"] == "auto"
        assert document["tensors"] == auto["tensors"], name


@pytest.mark.parametrize("case", EXPLICIT_CASES, ids=lambda c: c.label)
def test_explicit_golden_equals_its_auto_twin(case):
    twin = Case.make(case.model, case.topology, case.rule, case.num_slices,
                     {k: v for k, v in case.overrides if k != "shard_mode"})
    assert twin in MATRIX
    for name in ("named_shardings.json", "logical_shardings.json"):
        explicit, auto = (committed_golden(c, name) for c in (case, twin))
        assert explicit["mesh"]["shard_mode"] == "explicit" and auto["mesh"]["shard_mode"] == "auto"
        assert explicit["tensors"] == auto["tensors"], name


@pytest.mark.parametrize("case", ZERO1_CASES, ids=lambda c: c.label)
def test_zero1_moments_on_data_params_not(case):
    tensors = committed_golden(case, "named_shardings.json")["tensors"]
    moments = [p for p in tensors if state.is_optimizer_leaf(p) and tensors[p]["shape"]]
    params = [p for p in tensors if p.startswith(("params/", "model/")) and "/rngs/" not in p]  # RNG state aside
    assert len(moments) == 2 * len(params) > 0
    for path in moments:
        assert any("data" in spec_axes(e) for e in tensors[path]["partition_spec"]), path
    for path in params:
        assert not any("data" in spec_axes(e) for e in tensors[path]["partition_spec"]), path


def test_over_data_takes_the_first_evenly_split_dimension():
    sizes = {"data": 2, "stage": 2, "fsdp": 4, "tensor": 1}
    assert state.over_data(P("stage", "fsdp", None), (2, 4096, 16), sizes) == P("stage", ("data", "fsdp"), None)
    assert state.over_data(P(None,), (3,), sizes) == P(None,)  # nothing splits evenly: unchanged
    assert state.over_data(P("data"), (8,), sizes) == P("data")
    assert state.over_data(P(), (6, 8), sizes) == P("data", None)


def test_over_data_skips_tensor_even_of_size_1_as_maxtext_does():
    """MaxText's ZeRO-1 never adds `data` to a dimension whose axes include `tensor` (size 1 or not)."""
    sizes = {"data": 2, "fsdp": 4, "tensor": 1, "tensor_sequence": 2}
    assert state.over_data(P("tensor", None), (8, 6), sizes) == P("tensor", "data")
    assert state.over_data(P(("fsdp", "tensor"),), (16,), sizes) == P(("fsdp", "tensor"),)
    assert state.over_data(P("tensor_sequence"), (8,), sizes) == P(("data", "tensor_sequence"),)  # only `tensor`
    with pytest.raises(BadInput, match=r"shard_optimizer_over_data=true: a dimension of size 6 \(shape \(6, 8\)\) "
                                       r"does not split evenly over fsdp \(4 shards\)"):
        state.over_data(P("fsdp", None), (6, 8), sizes)


def test_nnx_build_adds_data_after_dropping_size_one_axes_in_both_modes():
    """MaxText's NNX build drops the size-1 mesh axes before ZeRO-1 adds `data` (its Linen build keeps them, so a
    size-1 `tensor` keeps `data` off that dimension); explicit and auto mode share the one function."""
    sizes = {"data": 2, "fsdp": 4, "tensor": 1}
    assert state.state_spec(P("tensor", "fsdp"), (8, 8), sizes, nnx=True, over=True) == P("data", "fsdp")
    assert state.state_spec(P("tensor", "fsdp"), (8, 8), sizes, nnx=False, over=True) == P("tensor", ("data", "fsdp"))
    assert state.state_spec(P("tensor", "fsdp"), (8, 8), sizes, nnx=True, over=False) == P(None, "fsdp")


BAD = [
    ("--rule pure-fsdp shard_optimizer_over_data=true", "shard_optimizer_over_data=true: rule 'pure-fsdp' has no 'data'"),
    ("shard_mode=implicit", "shard_mode='implicit': must be one of auto, explicit"),
    ("--model deepseek3-671b --topology tpu7x-2048 shard_mode=explicit",
     "shard_mode=explicit: model/decoder/dense_layers/mlp/wi_0/kernel dimension 0 (size 7168) does not split "
     "evenly over fsdp (2048 shards)"),  # the NNX build's path and spec (its size-1 axes dropped)
    ("--model gemma3-4b --topology tpu7x-8 shard_mode=explicit maxtext_version=0.2.4",
     "shard_mode=explicit: MaxText 0.2.4 does not support decoder block 'gemma3' in explicit mode (blocks it "
     "supports: simple, simple_mlp, llama2, deepseek)"),
    ("--model llama2-7b --topology v5p-8 --rule default ici_data_parallelism=2 shard_optimizer_over_data=true "
     "maxtext_version=0.2.5",
     "shard_optimizer_over_data=true: MaxText 0.2.5 refuses ZeRO-1 with FSDP (the fsdp axes hold 2 devices)"),
    ("--model qwen3.5-35b-a3b --topology tpu7x-16 shard_mode=explicit sparse_matmul=false",
     "shard_mode=explicit with sparse_matmul=false: MaxText 0.2.5 refuses it for decoder block 'qwen3_5' (the dense "
     "matmul MoE path is not onboarded to explicit sharding: it needs sparse_matmul=true); give shard_mode=auto"),
    ("--model qwen3.5-35b-a3b --topology tpu7x-16 shard_mode=explicit ici_context_parallelism=2",
     "shard_mode=explicit with context parallelism 2: MaxText 0.2.5 refuses it for decoder block 'qwen3_5' "
     "(GatedDeltaNet's short convolution"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[a for a, _ in BAD])
def test_bad_shard_settings_are_one_line(tmp_path, capsys, args, message):
    assert_bad_input(tmp_path, capsys, args, message)


def test_header_schema_knows_the_modes():
    doc = committed_golden(MATRIX[0], "named_shardings.json")
    doc["mesh"]["shard_mode"] = "implicit"
    with pytest.raises(BadInput, match="field mesh/shard_mode"):
        check_document(doc, "doc")
