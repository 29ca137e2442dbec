"""Hugging Face's Flax Llama (transformers' `FlaxLlamaForCausalLM`) at toy sizes, as a user holds it.

The factory returns the `FlaxPreTrainedModel` itself (built from a small `LlamaConfig`, no weights
downloaded); the harness takes its `.module` and calls it as HF's Flax training scripts do
(`input_ids`, `attention_mask`, `position_ids`, dropout on). Its weights carry no logical axes: the
rule file places them by path regexes (`examples/hf_llama_rules.yml`). Needs `transformers<5`
(the last releases with Flax models): `pip install "transformers>=4.57,<5"`.
"""

from __future__ import annotations

from typing import Any


def small_llama() -> Any:
    """The FlaxPreTrainedModel (`_do_init=False`: the harness initialises it abstractly)."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attention_dropout=0.1)
    return FlaxLlamaForCausalLM(config, _do_init=False)


def small_llama_module() -> Any:
    """Its linen module, as a user holding `model.module` would give it."""
    return small_llama().module
