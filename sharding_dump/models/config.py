"""Model cards: hyperparameters as data (`data/models/<name>.yml`), loaded into a frozen ModelConfig.

A card is checked against `data/schemas/model-card.schema.json`; its keys are ModelConfig's fields.
Settings that belong to the run rather than the model (weight dtype) are filled in by
:func:`load_config`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharding_dump.errors import BadInput
from sharding_dump.resources import MODELS_DIR, load_yaml, validate

if TYPE_CHECKING:
    from sharding_dump.models.pipeline import PipelineConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything a decoder needs to build its parameters and trace a step."""

    name: str
    decoder_block: str
    emb_dim: int
    num_query_heads: int
    num_kv_heads: int
    num_decoder_layers: int
    vocab_size: int
    mlp_dim: int
    head_dim: int | None = None  # None: emb_dim // num_query_heads
    mlp_activations: tuple[str, ...] = ("silu", "linear")
    logits_via_embedding: bool = False
    use_qk_norm: bool = False
    normalization_layer_epsilon: float = 1e-6
    rope_max_timescale: int = 10_000
    # Rotary variant: "default" (plain RoPE) or "yarn" (YaRN frequency interpolation for long context).
    rope_type: str = "default"
    max_position_embeddings: int = 0
    original_max_position_embeddings: int = 0
    rope_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    rope_interleave: bool = False  # rotate (even, odd) pairs instead of (first half, second half)
    rope_truncate: bool = True  # round YaRN's correction range to whole dimensions
    rope_attention_scaling: bool = False  # scale cos/sin by YaRN's attention factor
    # Multi-head latent attention (DeepSeek): low-rank query (q_lora_rank 0: full query) and key/value.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts: the first `first_num_dense_layers` layers are dense, the rest route each token
    # to `num_experts_per_tok` of `num_experts` experts (width moe_mlp_dim) plus `shared_experts` always-on ones.
    first_num_dense_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_mlp_dim: int = 0
    shared_experts: int = 0
    routed_score_func: str = "none"  # softmax | sigmoid | none (raw logits, softmax over the chosen k)
    routed_scaling_factor: float = 1.0
    routed_bias: bool = False  # learned per-expert bias on the router
    mlp_bias: bool = False  # biases on the routed experts' projections
    mlp_activations_limit: float = 0.0  # > 0: clamp the gated unit's inputs (gpt-oss)
    # Attention extras (gpt-oss).
    attention_bias: bool = False
    attention_sink: bool = False  # a learned per-head logit that absorbs attention mass
    sliding_window_size: int = 0
    inhomogeneous_layer_cycle_interval: int = 1  # layers per scanned block (local, global, ...)
    # A card's own logical axis rules, merged over the rule file's (see rules.with_overrides).
    logical_axis_rules: tuple[tuple[str, Any], ...] = ()
    # Run settings, not from the card.
    weight_dtype: str = "float32"
    dtype: str = "bfloat16"
    pipeline: PipelineConfig | None = None  # pipeline parallelism over `stage` (models/pipeline.py)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.emb_dim // self.num_query_heads

    @property
    def num_moe_layers(self) -> int:
        """Layers after the leading dense ones (every layer of a dense model)."""
        return self.num_decoder_layers - self.first_num_dense_layers

    @property
    def pipelined_stack_layers(self) -> int:
        """Length of the layer stack a pipeline cuts into stages (the MoE stack of a model with leading
        dense layers; scanned blocks, not layers, for models that cycle layer kinds)."""
        return self.num_moe_layers // self.inhomogeneous_layer_cycle_interval


def model_names() -> list[str]:
    """Every model card shipped with the package."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yml"))


def check_model_name(name: str) -> None:
    """BadInput unless `name` is a known model card."""
    if name not in model_names():
        raise BadInput(f"unknown model {name!r}: valid models are {', '.join(model_names())}")


def card_path(name: str) -> Path:
    """The file of model card `name` (checked to be a known card)."""
    check_model_name(name)
    return MODELS_DIR / f"{name}.yml"


@functools.cache
def _card(name: str) -> dict[str, Any]:
    path = card_path(name)
    data = load_yaml(path, "model card")
    validate(data, "model-card", f"model card {path}")
    if data["name"] != name:
        raise BadInput(f"model card {path}: field name: {data['name']!r} must match the file name {name!r}")
    check_card_consistency(data, f"model card {path}")
    return data


def check_card_consistency(card: dict[str, Any], where: str) -> None:
    """Cross-field rules the schema cannot state: layer splits and expert counts must add up."""
    layers = card["num_decoder_layers"]
    if card["num_query_heads"] % card["num_kv_heads"]:
        raise BadInput(f"{where}: field num_kv_heads: {card['num_kv_heads']} does not divide num_query_heads "
                       f"({card['num_query_heads']}); each key/value head serves a whole group of query heads")
    dense = card.get("first_num_dense_layers", 0)
    experts = card.get("num_experts", 0)
    if experts and dense >= layers:
        raise BadInput(f"{where}: field first_num_dense_layers: {dense} leaves no MoE layer "
                       f"(num_decoder_layers is {layers})")
    if card.get("num_experts_per_tok", 0) > experts:
        raise BadInput(f"{where}: field num_experts_per_tok: {card['num_experts_per_tok']} is more than "
                       f"num_experts ({experts})")
    activations = card.get("mlp_activations", ["silu", "linear"])
    if experts and len(activations) != 2:
        raise BadInput(f"{where}: field mlp_activations: experts have two input projections (wi_0, wi_1), "
                       f"so an MoE model names exactly two activations, not {len(activations)}")
    if card.get("mlp_activations_limit", 0) and activations != ["sigmoid", "linear"]:
        raise BadInput(f"{where}: field mlp_activations_limit: the clamped gated unit is gpt-oss's "
                       f"[sigmoid, linear], not {activations}")
    cycle = card.get("inhomogeneous_layer_cycle_interval", 1)
    if layers % cycle:
        raise BadInput(f"{where}: field inhomogeneous_layer_cycle_interval: {cycle} does not divide "
                       f"num_decoder_layers ({layers})")


def load_config(name: str, **run_settings: Any) -> ModelConfig:
    """The ModelConfig of card `name`, with run settings (e.g. weight_dtype) applied."""
    data = dict(_card(name))
    if "mlp_activations" in data:
        data["mlp_activations"] = tuple(data["mlp_activations"])
    if "logical_axis_rules" in data:
        data["logical_axis_rules"] = tuple(
            (n, tuple(a) if isinstance(a, list) else a) for n, a in data["logical_axis_rules"])
    data.pop("description", None)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**data, **{k: v for k, v in run_settings.items() if k in fields})
