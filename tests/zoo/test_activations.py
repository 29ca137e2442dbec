"""Activation shardings: the recording helper, the traced step, the golden report, the batch settings."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from helpers import NNX, REPO
from sharding_dump.core import capture as activations
from sharding_dump.core.capture import constrain
from sharding_dump.core.layout import resolve
from sharding_dump.core.state import SEGMENT_FIELD
from sharding_dump.core.step import BATCH_FIELDS
from sharding_dump.errors import BadInput
from sharding_dump.zoo import releases
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.dump import (
    abstract_state_of,
    render_case,
    setup_case,
    trace_case,
)
from sharding_dump.zoo.goldens import check_or_update


def trace(case: Case):
    setup = setup_case(case)
    return (setup, abstract_state_of(setup), *trace_case(setup))


@pytest.fixture(scope="module")
def qwen_trace():
    return trace(Case.make("qwen3-0.6b", "tpu7x-16", "default", overrides={"ici_tensor_parallelism": 4, **NNX}))


def test_every_constraint_of_the_step_is_named(qwen_trace):
    """Every constraint of the step is read from its jaxpr; the zoo's models place each one through
    `constrain`, so none is keyed by a bare call site, and the step works on the parameter values, so
    flax adds no parameter-read constraints."""
    setup, st, closed, rec = qwen_trace
    found = activations.read_constraints(closed, rec)
    assert len(found) > 30
    assert [c.key for c in found if "-L" in c.name] == []
    assert {c.name for c in found} == {s.name for s in rec.sites}


def test_constraints_forward_backward_and_rule_resolution(qwen_trace):
    setup, _, closed, rec = qwen_trace
    found = {c.key: c for c in activations.read_constraints(closed, rec)}
    batch, length = setup.batch.shape
    heads, head_dim = setup.config.num_query_heads, setup.config.resolved_head_dim
    assert found["forward/decoder/layers/self_attention/query"].shape == (batch, length, heads, head_dim)
    assert found["forward/decoder/logits"].shape == (batch, length, setup.config.vocab_size)
    forward = {k.split("/", 1)[1]: c for k, c in found.items() if c.pass_ == "forward"}
    backward = {k.split("/", 1)[1]: c for k, c in found.items() if c.pass_ == "backward"}
    # Every float activation (inside the scanned, rematerialised layer too) is constrained on the way
    # back as well; the integer batch is not.
    assert set(backward) == {k for k, c in forward.items() if c.dtype == "bfloat16"}
    # The batch, and in MaxText's NNX build its segment ids, which every attention constrains as the
    # queries' and as the keys'.
    assert {k for k, c in forward.items() if c.dtype == "int32"} == \
        {*BATCH_FIELDS, SEGMENT_FIELD, "decoder/layers/self_attention/decoder_segment_ids",
         "decoder/layers/self_attention/decoder_segment_ids_kv"}
    for key, c in found.items():
        assert c.partition_spec == resolve(c.logical_axes, setup.rule_set), key
        assert c.dtype in ("bfloat16", "int32"), key
    assert forward["decoder/layers/mlp/mlp_hidden"].partition_spec[2] == ("tensor", "tensor_sequence")


def test_recording_is_scoped_to_one_trace():
    x = jnp.ones((4, 8))
    with nn.logical_axis_rules((("b", None),)):
        constrain(x, ("b", None), "outside")  # no recording: just the constraint
        with activations.recording() as first:
            constrain(x, ("b", None), "inside")
        with activations.recording() as second:
            pass
    assert [s.name for s in first.sites] == ["inside"] and second.sites == []
    assert first.token != second.token
    with pytest.raises(ValueError, match="2 logical axes for a rank-1 array"):
        constrain(jnp.ones(3), ("b", None), "bad")
    with nn.logical_axis_rules((("b", None),)), activations.recording() as fewer:
        constrain(x, ("b",), "fewer")  # the last dimension left free, recorded as named (MaxText's Qwen3-Next)
    assert [s.logical_axes for s in fewer.sites] == [("b",)]
    with pytest.raises(ValueError, match="activation name 'a/b'"):
        constrain(x, ("b", None), "a/b")


@jax.jit
def _cached_helper(y):
    return constrain(y, ("b", None), "cached")


def test_a_cached_trace_from_another_recording_is_refused():
    """jit caches traces across cases (with the old rules' shardings): that must fail, not mislead."""
    mesh = AbstractMesh((2,), ("fsdp",), axis_types=(AxisType.Auto,))
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules((("b", "fsdp"),)):
        with activations.recording() as rec:
            closed = jax.make_jaxpr(_cached_helper)(x)
        assert [c.key for c in activations.read_constraints(closed, rec)] == ["forward/cached"]
        with activations.recording() as rec:
            closed = jax.make_jaxpr(_cached_helper)(x)
        with pytest.raises(RuntimeError, match="marker of another trace"):
            activations.read_constraints(closed, rec)


RULES = (("act_batch", "data"), ("act_embed", "fsdp"))
MESH = AbstractMesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
BE = ("act_batch", "act_embed")


@jax.custom_vjp
def _doubled(x):
    return constrain(x * 2.0, BE, "custom_fwd")


_doubled.defvjp(lambda x: (_doubled(x), None), lambda _, g: (constrain(g * 2.0, BE, "custom_bwd"),))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, ("act_embed",)), (x.shape[-1],))
        x = constrain(x * w, BE, "scanned")
        x = jax.jit(lambda y: constrain(jnp.sin(y), BE, "jitted"))(x)
        x = jax.lax.cond(x.sum() > 0, lambda y: constrain(y * 2, BE, "branch"), lambda y: y, x)
        return x, None


class _Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = _doubled(x * self.param("scale", nn.initializers.ones, (x.shape[-1],)))
        x = jax.shard_map(lambda y: constrain(jnp.tanh(y), (None, "act_embed"), "in_shard_map"), mesh=MESH,
                          in_specs=P("data"), out_specs=P("data"), axis_names={"data"})(x)
        stack = nn.scan(nn.remat(_Block), variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast,), length=3, metadata_params={nn.PARTITION_NAME: "layers"})
        return stack(name="layers")(x, None)[0].sum()


def test_nested_jaxprs_custom_vjp_shard_map_scan_remat_jit_cond():
    model = _Nested()
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    with jax.sharding.use_abstract_mesh(MESH), nn.logical_axis_rules(RULES), activations.recording() as rec:
        closed = jax.make_jaxpr(jax.grad(lambda p, x: model.apply({"params": p}, x)))(params, x)
    found = {c.key: c.partition_spec for c in activations.read_constraints(closed, rec)}
    assert found == {
        "forward/custom_fwd": P("data", "fsdp"), "backward/custom_bwd": P("data", "fsdp"),
        "forward/in_shard_map": P(None, "fsdp"), "backward/in_shard_map": P(None, "fsdp"),
        **{f"{p}/layers/{n}": P("data", "fsdp") for p in ("forward", "backward") for n in ("scanned", "jitted", "branch")},
    }


def test_same_case_twice_and_either_order_same_bytes():
    a = Case.make("llama2-7b", "v5p-16", "pure-fsdp")
    b = Case.make("qwen3-0.6b", "tpu7x-16", "default")
    a1, b1 = render_case(a), render_case(b)
    b2, a2 = render_case(b), render_case(a)
    assert a1 == a2 and b1 == b2
    golden = REPO / "golden/llama2-7b/v5p-16/slice_1/rule_pure-fsdp/activation_shardings.json"
    assert a1["activation_shardings.json"] == golden.read_bytes()


def test_changed_activation_batch_rule_names_the_activations(tmp_path):
    """A user's copy of default.yml with activation_batch unsharded fails with the activations named,
    after the memory per device, activations included, before and after; specs without the mesh
    axes of size 1 (v5p-16 splits over fsdp only)."""
    rule = tmp_path / "default.yml"
    text = (releases.release_of({}).rules_dir / "default.yml").read_text()  # the default release's
    line = "  - [activation_batch, [data, fsdp, fsdp_transpose, expert]]\n"
    assert line in text
    # A copy is a custom rule file: the card's own rule (norm on fsdp) is not merged in, so write it in.
    rule.write_text(text.replace(line, "  - [activation_batch, []]\n").replace("  - [norm, [tensor]]\n", "  - [norm, fsdp]\n"))
    outcome = check_or_update(Case.make("llama2-7b", "v5p-16", str(rule)), REPO / "golden", update=False)
    assert outcome.status == "differs"
    report = outcome.report
    assert "named_shardings.json" not in report and "logical_shardings.json" not in report
    lines = report.splitlines()
    assert lines[1].split() == ["memory", "per", "device", "golden", "now", "change"]
    assert lines[2].split()[:5] == ["model", "3.1", "GiB", "3.1", "GiB"] and lines[2].endswith("  0")
    assert lines[4].split() == ["activations", "9.2", "GiB", "37.2", "GiB", "+28.1", "GiB", "(+305%)"]
    assert "activation_shardings.json: 18 activations changed, 0 added, 0 removed" in report
    assert "  forward/decoder/layers/layer_input  (and backward)\n" in report
    assert 'partition_spec    golden ["fsdp",null,null]  now [null,null,null]' in report
    assert ('partition_spec    golden [["data","fsdp","fsdp_transpose","expert"],'
            '["tensor_sequence","context","context_usp_ulysses"],"tensor"]  '
            'now [null,["tensor_sequence","context","context_usp_ulysses"],"tensor"]') in outcome.full_report
    assert "per_device_shape  golden [12,2048,4096]  now [96,2048,4096]" in report
    assert "forward/decoder/layers/self_attention/query" not in report  # activation_kv_batch: unchanged


def test_activation_schema_rejects_bad_entries():
    from sharding_dump.golden.codec import check_document
    doc = {
        "format_version": 1, "kind": "activations",
        "case": {"model": "m", "topology": "t", "num_slices": 1, "rule": "r", "overrides": {}},
        "mesh": {"axis_names": ["fsdp"], "axis_sizes": [8], "shard_mode": "auto"},
        "batch": {"per_device_batch_size": 1, "global_batch_size": 8, "max_target_length": 4,
                  "data_pipeline_spec": ["fsdp", None]},
        "tensors": {"forward/x": {"module": "", "name": "x", "pass": "forward", "shape": [8, 4], "dtype": "int32",
                                  "logical_axes": ["b", None], "partition_spec": ["fsdp", None],
                                  "per_device_shape": [1, 4]}},
    }
    check_document(doc, "doc")
    del doc["tensors"]["forward/x"]["pass"]
    with pytest.raises(BadInput, match="field tensors/forward/x: 'pass' is a required property"):
        check_document(doc, "doc")
    doc["tensors"] = {"sideways/x": {}}
    with pytest.raises(BadInput, match="field tensors"):
        check_document(doc, "doc")


# The Linen build's activation records of two cases as every earlier round wrote them (a layer stack, a pipeline).
LINEN = REPO / "tests" / "data" / "linen-activations"
LINEN_CASES = [Case.make("qwen3-0.6b", "tpu7x-16", "default"),
               Case.make("llama2-7b", "v5p-8", "default",
                         overrides={"ici_pipeline_parallelism": 2, "num_pipeline_microbatches": 8})]


@pytest.mark.parametrize("case", LINEN_CASES, ids=lambda c: c.label)
def test_the_linen_build_keeps_its_activation_records_byte_for_byte(case, monkeypatch):
    """Where the settings choose MaxText's Linen build (releases.nnx_build false: 0.2.4 with pure_nnx,
    enable_nnx and pure_nnx_decoder false), no segment ids and a pipeline's stage records as the traced
    step holds them, vmapped over `stage`: the activation golden of earlier rounds."""
    monkeypatch.setattr(releases, "nnx_build", lambda values: False)
    assert render_case(case)["activation_shardings.json"] == \
        (golden_dir(case, LINEN) / "activation_shardings.json").read_bytes()


def test_the_nnx_build_records_a_stage_at_its_own_shape():
    """MaxText's NNX build records a pipeline stage's constraints as the stage function placed them, the
    vmap's stage dimension left out; the stage buffers keep it (their logical axes name it)."""
    case = LINEN_CASES[1]
    nnx = Case.make(case.model, case.topology, case.rule, overrides={**dict(case.overrides), **NNX})
    tensors = json.loads(render_case(nnx)["activation_shardings.json"])["tensors"]
    stage = tensors["forward/decoder/pipeline_module/layers/self_attention/query"]
    assert stage["shape"] == [6, 2048, 32, 128] and stage["partition_spec"][0] == ["data", "fsdp", "fsdp_transpose",
                                                                                      "expert"]
    segments = tensors["forward/decoder/pipeline_module/layers/self_attention/decoder_segment_ids"]
    assert segments["shape"] == [6, 2048] and segments["logical_axes"] == ["activation_batch_attn", "activation_q_length"]
    assert tensors["forward/decoder/pipeline_module/pipeline_shift"]["shape"] == [2, 6, 2048, 4096]
