"""The zoo's KV cache against the one MaxText's own code builds: llama2-7b under MaxText's inference
configuration, in prefill and autoregressive mode, bfloat16 on an 8-way fsdp mesh and int8 with scales
on an 8-way tensor mesh (tests/data/maxtext/serving/llama2-7b.json, recorded by
tools/maxtext_kvcache_reference.py with MaxText 0.2.5: every cache variable's shape, dtype, logical
axes and partition spec, with the mesh and the rules MaxEngine used)."""

from __future__ import annotations

import json

import pytest
from jax.sharding import AbstractMesh

from helpers import REPO
from sharding_dump.core import specs
from sharding_dump.core.layout import tensor_layouts
from sharding_dump.models.kvcache import layer_cache, stacked
from sharding_dump.zoo.cards import load_config

RECORDED = json.loads((REPO / "tests/data/maxtext/serving/llama2-7b.json").read_text())


def setting(case: dict, key: str) -> str | None:
    return next((s.split("=", 1)[1] for s in case["settings"] if s.startswith(f"{key}=")), None)


@pytest.mark.parametrize("case", RECORDED["cases"], ids=lambda c: "_".join(c["settings"][-3:]))
@pytest.mark.parametrize("mode", ["prefill", "autoregressive"])
def test_the_cache_is_maxtexts(case, mode):
    cfg = load_config("llama2-7b")
    mesh = AbstractMesh(tuple(case["mesh"].values()), tuple(case["mesh"]))
    slots = int(float(setting(case, "per_device_batch_size")) * mesh.size)
    layer = layer_cache(cfg.num_kv_heads, cfg.resolved_head_dim, 1 if mode == "prefill" else slots,
                        int(setting(case, "max_prefill_predict_length")), int(setting(case, "max_target_length")),
                        mode, quantize=setting(case, "quantize_kvcache") == "true")
    cache = stacked(layer, cfg.num_decoder_layers)
    ours = {t.path: {"shape": list(t.shape), "dtype": t.dtype, "logical_axes": list(t.logical_axes),
                     "partition_spec": specs.spec_to_json(t.partition_spec, len(t.shape), case["mesh"])}
            for t in tensor_layouts(cache, mesh, [tuple(rule) for rule in case["logical_axis_rules"]])}
    theirs = {path.rsplit("/", 1)[1]: entry for path, entry in case["cache"][mode].items()}
    for entry in theirs.values():
        entry["partition_spec"] = specs.spec_to_json(entry["partition_spec"], len(entry["shape"]), case["mesh"])
    assert ours == theirs  # specs compared leaving out axes of size 1, which split nothing


def test_maxtexts_inference_yml_names_a_mesh_axis_its_mesh_lacks():
    """As recorded: MaxText 0.2.5's inference/inference.yml names `tensor_transpose` 26 times, an axis
    base.yml's mesh_axes no longer has, so MaxText refuses it ('Resource axis: tensor_transpose ... is
    not found in mesh'); the reference was made with the axis dropped."""
    assert RECORDED["tensor_transpose_in_inference_yml"] == 26
    assert all("tensor_transpose" not in case["mesh"] for case in RECORDED["cases"])
