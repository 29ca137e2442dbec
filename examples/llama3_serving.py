"""jax-llm-examples' Llama 3, served: its own weights, int8 KV cache, ShardingRules, prefill and decode step.

The model is jax-ml/jax-llm-examples' `llama3_jax` as it is (the installed package, else the copy in
`examples/llama3_jax/`): `Weights.init` and `KVCache.init` place every array by the program's own
`ShardingRules` through `jax.jit(out_shardings=)`, `prefill` writes a batch of prompts into the
cache, `decode_step` extends every slot by one token. This module only says which of its functions
is init and which are the steps, and builds its `Config` from the case's serving settings: the
cache holds `slots` requests of `max_length` tokens, in int8 or bfloat16.

    sharding-dump --model examples.llama3_serving:small_llama3 --topology cpu-8 \\
        --rule examples/llama3_serving_rules.yml ici_x_parallelism=2 ici_y_parallelism=4 shard_mode=explicit \\
        per_device_batch_size=1 max_target_length=64 max_prefill_predict_length=16 quantize_kvcache=true

The mesh axes are the program's own (`x` for the batch, `y` and `z` for tensors), declared by
`examples/llama3_serving_rules.yml`; the program reaches the case's mesh as it reaches its own,
through `jax.sharding.get_abstract_mesh()`. A server that sets its mesh as a context around its
steps (`with jax.set_mesh(mesh):`, which a traced step cannot do) gives it as
`program(base, mesh=mesh)`, `ServingProgram(mesh=...)`: the harness holds it against the case's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

import sharding_dump as sd

try:  # the package as jax-llm-examples installs it
    from llama3_jax import configs
    from llama3_jax import model as l3
except ImportError:  # the vendored copy
    from examples.llama3_jax import configs
    from examples.llama3_jax import model as l3

RULES = l3.ShardingRules()  # the program's own logical-to-mesh rules (read when a factory is called)

SMALL = dataclasses.replace(configs.LLAMA3_8B, embed=64, ffw_size=128, q_heads=4, kv_heads=4, num_layers=2,
                            head_dim=16, vocab_size=256)


def config(base: l3.Config, settings: sd.ServingSettings) -> l3.Config:
    """The model's Config on the case's mesh, for the case's cache length and dtype."""
    quant = {"auto": base.quant_cache, "int8": True, "bfloat16": False}.get(settings.cache_dtype)
    if quant is None:
        raise ValueError(f"cache_dtype={settings.cache_dtype}: llama3_jax keeps its cache in int8 or in the "
                         "model's dtype (bfloat16)")
    if settings.page_size:
        raise ValueError("page_size: llama3_jax's prefill does not fill a paged cache (PagedKVCache)")
    return dataclasses.replace(base, mesh=jax.sharding.get_abstract_mesh(), rules=RULES,
                               max_seq_len=settings.max_length, quant_cache=quant)


def prefill(state: dict, inputs: dict, settings: sd.ServingSettings, base: l3.Config) -> tuple[dict, dict]:
    """A batch of prompts written into every slot of the cache (llama3_jax's `prefill`)."""
    next_tokens, _, cache = l3.prefill(inputs["tokens"], state["weights"], state["cache"], config(base, settings))
    return {**state, "cache": cache}, {"next_tokens": next_tokens}


def generate(state: dict, inputs: dict, settings: sd.ServingSettings, base: l3.Config) -> tuple[dict, dict]:
    """One token for every slot (llama3_jax's `decode_step`, which donates the cache)."""
    next_tokens, cache = l3.decode_step(inputs["tokens"], state["weights"], state["cache"], config(base, settings))
    return {**state, "cache": cache}, {"next_tokens": next_tokens}


def program(base: l3.Config, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None) -> sd.ServingProgram:
    """Weights and a cache of `slots` requests, a prefill of `slots` prompts, a decode step; on `mesh`
    when the server sets it as a context."""

    def init(key: jax.Array, settings: sd.ServingSettings) -> dict[str, Any]:
        cfg = config(base, settings)
        return {"weights": l3.Weights.init(key, cfg),
                "cache": l3.KVCache.init(jax.random.fold_in(key, 1), cfg, settings.slots)}

    def step(fn: Any) -> Any:
        return lambda state, inputs, settings: fn(state, inputs, settings, base)

    return sd.ServingProgram(init, {
        "prefill": sd.ServingStep(step(prefill), {"tokens": sd.Input(("slots", "prefill_length"))}),
        "generate": sd.ServingStep(step(generate), {"tokens": sd.Input(("slots", 1))}),
    }, mesh=mesh)


def small_llama3() -> sd.ServingProgram:
    """Two layers at toy sizes, int8 weights and cache."""
    return program(SMALL)


def llama3_70b() -> sd.ServingProgram:
    """Llama 3.1 70B as jax-llm-examples configures it (int8 weights and cache)."""
    return program(configs.LLAMA3_70B)
