"""MoE dispatch as MaxText's `sparse_matmul` selects: the sorted dispatch (grouped matmuls, a ragged
all-to-all under expert parallelism) by default, the dense path with `sparse_matmul=false`."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType

from sharding_dump.core.capture import equations, read_constraints, recording
from sharding_dump.models import moe
from sharding_dump.models.moe_dispatch import all_to_all_params, fitting_spec
from sharding_dump.zoo import cards
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.dump import dump_case, setup_case

REPO = Path(__file__).resolve().parents[2]
SMALL = {"emb_dim": 64, "moe_mlp_dim": 32, "num_experts": 8, "num_experts_per_tok": 2}
RULES = (("activation_batch", ("fsdp", "expert")), ("activation_batch_moe", ("fsdp", "expert")),
         ("activation_embed", "tensor"), ("exp", "expert"), ("mlp_no_fsdp", "tensor"), ("embed_moe", "fsdp"))


def traced_block(sparse: bool, expert: int = 2, tensor: int = 1):
    """The jaxpr and recorded constraints of gpt-oss's experts (biases included) traced abstractly on a
    (fsdp 2, expert, tensor) mesh."""
    cfg = dataclasses.replace(cards.load_config("gpt-oss-20b"), sparse_matmul=sparse, **SMALL)
    block = moe.RoutedExperts(cfg)
    x = jax.ShapeDtypeStruct((8, 16, SMALL["emb_dim"]), jnp.bfloat16)
    params = jax.eval_shape(block.init, jax.random.key(0), x)
    mesh = AbstractMesh((2, expert, tensor), ("fsdp", "expert", "tensor"), axis_types=(AxisType.Auto,) * 3)
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(RULES), recording() as rec:
        jaxpr = jax.make_jaxpr(jax.grad(lambda p, v: jnp.sum(block.apply(p, v).astype(jnp.float32)),
                                        argnums=(0, 1)))(params, x)
    return jaxpr, {c.key: c.logical_axes for c in read_constraints(jaxpr, rec)}


def primitives(jaxpr) -> set[str]:
    """Primitive names in the jaxpr and every jaxpr nested in it (`ragged_dot_general` read as
    `ragged_dot`, the name it has on older jax)."""
    return {eqn.primitive.name.replace("ragged_dot_general", "ragged_dot") for eqn, _ in equations(jaxpr)}


def test_sparse_matmul_true_is_the_sorted_dispatch():
    """MaxText's default: one shard_map over the mesh, grouped matmuls forward and backward, tokens
    sent to their experts' devices and back by ragged all-to-all; no per-expert einsum over all tokens."""
    jaxpr, constraints = traced_block(sparse=True)
    found = primitives(jaxpr)
    assert {"shard_map", "ragged_dot", "ragged_all_to_all", "sort"} <= found
    assert ("forward/inputs", ("activation_batch", "activation_norm_length", None)) in constraints.items()
    assert constraints["forward/gate_logits"] == ("activation_batch", "activation_norm_length", None)


def test_without_expert_parallelism_no_tokens_move():
    found = primitives(traced_block(sparse=True, expert=1, tensor=2)[0])
    assert "ragged_dot" in found and "ragged_all_to_all" not in found
    assert "reduce_scatter" in found  # the down projection's partial sums over `tensor`


def test_sparse_matmul_false_is_the_dense_path_with_its_constraints():
    jaxpr, constraints = traced_block(sparse=False)
    found = primitives(jaxpr)
    assert "ragged_dot" not in found and "shard_map" not in found
    assert constraints["forward/gate_logits"] == ("activation_batch_moe", "activation_length_moe", None)
    assert constraints["forward/inputs"] == ("activation_batch_moe", "activation_norm_length_moe",
                                             "activation_embed_moe")


def test_the_setting_reaches_the_model_and_names_the_case():
    default = setup_case(Case.make("mixtral-8x7b", "v6e-64", "default", overrides={"ici_expert_parallelism": 8}))
    dense = setup_case(Case.make("mixtral-8x7b", "v6e-64", "default", overrides=
                                 {"ici_expert_parallelism": 8, "sparse_matmul": False}))
    assert default.config.sparse_matmul is True and dense.config.sparse_matmul is False
    assert dense.case.name.endswith("_sparse_matmul=false")


def test_all_to_all_params_send_each_experts_rows_where_they_belong():
    """sizes[i, j]: rows batch shard i sends expert shard j; shard 1's offsets there and back."""
    sizes = jnp.array([[3, 1], [2, 4]])
    there = [v.tolist() for v in all_to_all_params(sizes, 1, True)]
    assert there == [[0, 2], [2, 4], [3, 1], [1, 4]]  # input offsets, send, output offsets, receive
    back = [v.tolist() for v in all_to_all_params(sizes, 1, False)]
    assert back == [[0, 1], [1, 4], [3, 2], [2, 4]]  # each row back after the rows sent to shard 0


def test_a_batch_that_does_not_divide_stays_whole():
    spec = fitting_spec(jax.sharding.PartitionSpec(("fsdp", "expert"), None), (6, 4), {"fsdp": 4, "expert": 1})
    assert spec == jax.sharding.PartitionSpec(None, None)


@pytest.mark.compile
def test_sorted_dispatch_equals_the_dense_path_on_four_devices():
    """Outputs and gradients of the sorted dispatch over fsdp, with expert parallelism (the exchange
    there and back) and with `tensor` (reduce-scatter) equal the dense path's on one device."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "tests" / "models" / "moe_dispatch_equivalence.py")],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 6
    for row in rows:
        assert "ragged_dot" in row["primitives"] and "shard_map" in row["primitives"], row
        assert row["max_abs_diff"] <= 1e-5 * max(row["scale"], 1.0) and row["scale"] > 0.1, row


@pytest.mark.sweep
def test_dense_dump_differs_from_the_default_only_in_the_moe_constraints():
    case = {"ici_expert_parallelism": 2}
    sparse = dump_case(Case.make("gpt-oss-20b", "tpu7x-16", "default", overrides=case))
    dense = dump_case(Case.make("gpt-oss-20b", "tpu7x-16", "default", overrides={**case, "sparse_matmul": False}))
    for name in ("named_shardings.json", "logical_shardings.json"):
        assert sparse[name]["tensors"] == dense[name]["tensors"]
    changed = {k for k, v in sparse["activation_shardings.json"]["tensors"].items()
               if dense["activation_shardings.json"]["tensors"].get(k) != v}
    assert all("GptOssMlp" in k for k in changed), changed
    assert {k.rsplit("/", 1)[-1] for k in changed if k.startswith("forward/")} == {"inputs", "gate_logits"}, changed
