"""`sharding-dump check` of serving cases: memory at slots x length with the largest slot count that
fits, a replicated KV cache, a prefill handing its cache to generate in another layout."""

from __future__ import annotations

import dataclasses

import pytest
from jax.sharding import PartitionSpec as P

from helpers import REPO, cache_resharded
from sharding_dump.commands import check
from sharding_dump.zoo import dump, serving
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.matrix import load_matrix

LLAMA_70B = {"ici_x_parallelism": 1, "ici_y_parallelism": 8, "shard_mode": "explicit", "max_target_length": 8192,
             "max_prefill_predict_length": 1024, "quantize_kvcache": True}


def seventy_b(slots_per_device: int) -> Case:
    """jax-llm-examples' Llama 3.1 70B, int8 weights and cache, 8 slots per device x 8192 tokens on v5e-8."""
    return Case.make("examples.llama3_serving:llama3_70b", "v5e-8", str(REPO / "examples/llama3_serving_rules.yml"),
                     overrides={**LLAMA_70B, "per_device_batch_size": slots_per_device})


def test_a_70b_cache_that_does_not_fit_names_the_largest_slot_count_that_fits(fresh):
    """64 slots: 10.2 GiB of weights + 10.2 GiB of cache on a 16 GiB v5e; 36 slots fit (each slot holds
    8192 tokens x 8 kv heads x 128 x 80 layers x k and v in int8, 1 kv head per device: 162.5 MiB)."""
    (finding,) = check.check_serving_memory(dump.setup_case(seventy_b(8)))
    assert finding.lint == "memory" and "127%" in finding.message
    assert "the largest slot count that fits at 8192 tokens is 36 (per_device_batch_size=4.5" in finding.message
    assert finding.details == ("at 64 slots the longest cache that fits is 4694 tokens",)
    assert check.check_serving_memory(dump.setup_case(seventy_b(4))) == []  # 32 slots fit


def example_case() -> Case:
    (case,) = load_matrix(REPO / "examples/serving_cases.yml")
    return case


def test_the_serving_example_is_clean(fresh):
    assert check.lint_case(example_case()) == []


def test_a_cache_whole_over_a_mesh_axis_is_a_finding(fresh):
    from examples import llama3_serving as ls

    fresh.setattr(ls, "RULES", dataclasses.replace(ls.RULES, kv_heads=None))
    (finding,) = [f for f in check.lint_case(example_case()) if f.lint == "cache-replicated"]
    assert finding.subject == "KV cache whole over y=4"
    assert finding.details[0].startswith("cache/k/0/quant  spec [\"x\",null,null,null]")


def test_a_prefill_handing_the_cache_on_replicated_is_a_finding(fresh):
    from examples import llama3_serving as ls

    fresh.setattr(ls, "prefill", cache_resharded(ls.prefill, P()))
    (finding,) = [f for f in check.lint_case(example_case()) if f.lint == "handoff"]
    assert finding.subject == "prefill -> generate"
    assert "hands 9 leaves to generate in another layout" in finding.message and "per request" in finding.message
    assert any(line.startswith("cache/k/0/quant  [null,null,null,null] -> [\"x\",\"y\",null,null]")
               for line in finding.details)
