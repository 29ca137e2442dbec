"""Model cards: hyperparameters as data (`data/models/<name>.yml`), loaded into a frozen ModelConfig.

A card is checked against `data/schemas/model-card.schema.json`; its keys are ModelConfig's fields.
Settings that belong to the run rather than the model (weight dtype) are filled in by
:func:`load_config`.
"""

from __future__ import annotations

import dataclasses
import functools
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
    def pipelined_stack_layers(self) -> int:
        """Length of the layer stack a pipeline cuts into stages."""
        return self.num_decoder_layers


def model_names() -> list[str]:
    """Every model card shipped with the package."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yml"))


def check_model_name(name: str) -> None:
    """BadInput unless `name` is a known model card."""
    if name not in model_names():
        raise BadInput(f"unknown model {name!r}: valid models are {', '.join(model_names())}")


@functools.cache
def _card(name: str) -> dict[str, Any]:
    check_model_name(name)
    path = MODELS_DIR / f"{name}.yml"
    data = load_yaml(path, "model card")
    validate(data, "model-card", f"model card {path}")
    if data["name"] != name:
        raise BadInput(f"model card {path}: field name: {data['name']!r} must match the file name {name!r}")
    return data


def load_config(name: str, **run_settings: Any) -> ModelConfig:
    """The ModelConfig of card `name`, with run settings (e.g. weight_dtype) applied."""
    data = dict(_card(name))
    for key in ("mlp_activations",):
        if key in data:
            data[key] = tuple(data[key])
    if "logical_axis_rules" in data:
        data["logical_axis_rules"] = tuple(
            (n, tuple(a) if isinstance(a, list) else a) for n, a in data["logical_axis_rules"])
    data.pop("description", None)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**data, **{k: v for k, v in run_settings.items() if k in fields})
