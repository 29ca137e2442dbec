"""ModelConfig: a model card's hyperparameters as a frozen dataclass, built from the card schema.

`data/schemas/model-card.schema.json` declares every card field once (type, bounds, default,
meaning); ModelConfig has a field for each, plus the numerics the run sets (weight dtype). Reading
and checking card files is the zoo's (:mod:`sharding_dump.zoo.cards`).

>>> default_of("mlp_activations"), is_default(["silu", "linear"], "mlp_activations")
(('silu', 'linear'), True)
>>> is_default(False, "num_experts")  # 0 is the default, and False is no count
False
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# The one declaration of every card field (data files live beside the package's modules).
CARD_SCHEMA = Path(__file__).resolve().parents[1] / "data" / "schemas" / "model-card.schema.json"
# Card fields that are not hyperparameters: documentation, and the run settings a card defaults.
NOT_MODEL_FIELDS = ("description", "settings")
_PYTHON_TYPES = {"integer": int, "number": float, "boolean": bool, "string": str, "array": tuple}
# What the model is built in and how it runs, set by the run (the `weight_dtype` and `sparse_matmul`
# settings), not by the card.
NUMERICS = (("weight_dtype", str, "float32"), ("dtype", str, "bfloat16"), ("sparse_matmul", bool, True))
# What a MaxText release changes in the layers it builds (the zoo's data/maxtext_releases.yml sets them per
# release): the logical axis of every attention kernel's embed dimension, that of the router kernel of
# MaxText's RoutedAndSharedMoE, and how the qwen3_next block holds its layers (`cycle`: one module per layer,
# layer_0 ...; `local_global`: its Gated DeltaNet layers scanned as `local_layers`, the full-attention
# layer as `global_layer`, MaxText 0.2.5's Qwen3NextScannableBlock).
RELEASE_FIELDS = (("attention_embed_axis", str, "embed"), ("router_embed_axis", str, "embed_moe"),
                  ("qwen3_next_layers", str, "cycle"))
# Which of MaxText's builds the layers mirror (the zoo sets it from the case's settings): its NNX build
# feeds the batch's segment ids to every attention, which constrains them (`decoder_segment_ids`), and
# names the layers a pipeline leaves out, and their layer axis, its own way ((stack name, module name, layer
# axis) triples, models/pipeline.py apply_layer_stack).
BUILD_FIELDS = (("segment_ids", bool, False), ("outside_pipeline", tuple, ()))


def frozen(value: Any) -> Any:
    """A card value as ModelConfig holds it: lists become tuples, so configs hash and compare.

    >>> frozen([["embed", ["fsdp", "expert"]]])
    (('embed', ('fsdp', 'expert')),)
    """
    return tuple(frozen(v) for v in value) if isinstance(value, list) else value


class _Derived:
    """What ModelConfig computes from its fields."""

    emb_dim: int
    num_query_heads: int
    head_dim: int | None

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.emb_dim // self.num_query_heads


def _config_class() -> type:
    """ModelConfig, built from the card schema (the one declaration of every card field: type, bounds,
    default, meaning), plus the numerics the run sets. Required fields come first, as a dataclass
    needs; `description` is documentation and not kept."""
    schema = json.loads(CARD_SCHEMA.read_text(encoding="utf-8"))
    required, optional = [], []
    for name, prop in schema["properties"].items():
        if name in NOT_MODEL_FIELDS:
            continue
        kind = _PYTHON_TYPES.get(prop.get("type"), int if "$ref" in prop else str)
        if name in schema["required"]:
            required.append((name, kind))
        else:
            optional.append((name, kind, dataclasses.field(default=frozen(prop.get("default")))))
    optional += [(name, kind, dataclasses.field(default=default)) for name, kind, default in NUMERICS + RELEASE_FIELDS + BUILD_FIELDS]
    doc = "A model card's hyperparameters (data/schemas/model-card.schema.json) and its numerics."
    return dataclasses.make_dataclass("ModelConfig", required + optional, bases=(_Derived,), frozen=True,
                                      namespace={"__doc__": doc, "__module__": __name__})


ModelConfig = _config_class()


def default_of(field: str) -> Any:
    """The ModelConfig default of a card field (dataclasses.MISSING for a required one)."""
    return {f.name: f.default for f in dataclasses.fields(ModelConfig)}.get(field, dataclasses.MISSING)


def is_default(value: Any, field: str) -> bool:
    """A card value equal to the field's ModelConfig default (lists as tuples; True is not 1)."""
    value, default = frozen(value), default_of(field)
    return value == default and isinstance(value, bool) == isinstance(default, bool)


def keeps_default(config: ModelConfig, field: str) -> bool:
    """True when the card behind `config` leaves `field` at its ModelConfig default (does not set it)."""
    return is_default(getattr(config, field), field)
