"""Model cards: hyperparameters as data (`data/models/<name>.yml`), and the decoder blocks that build them.

A card is checked against `data/schemas/model-card.schema.json`; its keys are ModelConfig's fields.
Its `decoder_block` names a block: a DecoderLM subclass of a module of `sharding_dump.models` that
names it, or a family an installed package registers through the `sharding_dump.families`
entry-point group. Every field the card sets away from its default must be one that block honours:
a card cannot describe one model and build another. Settings that belong to the run rather than
the model (weight dtype) are filled in by :func:`load_config`.

A model reference is a card name (shipped, or registered by an installed package through the
`sharding_dump.cards` entry-point group) or a path to a card file ending .yml/.yaml:

>>> resolve_model("llama3.1-8b")[0]
'llama3.1-8b'
>>> load_config("llama3.1-8b").num_kv_heads
8
>>> type(build_model(load_config("qwen3-0.6b"))).__name__
'Qwen3DecoderLM'
>>> pipelined_stack_length(load_config("qwen3-0.6b"))
28

Nothing here imports flax until a block's class is asked for.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharding_dump.errors import BadInput
from sharding_dump.models.config import (BUILD_FIELDS, NOT_MODEL_FIELDS, NUMERICS, RELEASE_FIELDS, ModelConfig,
                                          default_of, frozen, is_default)
from sharding_dump.resources import DATA_DIR, MODELS_DIR, load_yaml, validate
from sharding_dump.zoo.settings import parse_overrides

if TYPE_CHECKING:
    import flax.linen as nn

    from sharding_dump.models.decoder import Stack
    from sharding_dump.models.pipeline import PipelineConfig

BLOCKS_FILE = DATA_DIR / "blocks.yml"
FAMILY_GROUP = "sharding_dump.families"  # entry points: block name -> Flax module class taking a ModelConfig
CARD_GROUP = "sharding_dump.cards"  # entry points: a directory of card files, or a callable returning one
CARD_SUFFIXES = (".yml", ".yaml")


@dataclasses.dataclass(frozen=True)
class Block:
    """A decoder block: where its module lives and which card fields it honours."""

    name: str
    module: str  # "package.module:Class" (shipped) or the entry point's value (registered)
    fields: frozenset[str] | None  # honoured beyond the common ones; None: an installed family not yet read
    required: tuple[str, ...] = ()
    equal: tuple[tuple[str, str], ...] = ()
    entry_point: importlib.metadata.EntryPoint | None = None


@functools.cache
def _common_fields() -> frozenset[str]:
    """The card fields every decoder block reads (data/blocks.yml)."""
    data = load_yaml(BLOCKS_FILE, "decoder blocks")
    validate(data, "blocks", f"decoder blocks {BLOCKS_FILE}")
    return frozenset(data["common"])


@functools.cache
def _shipped_blocks() -> dict[str, Block]:
    """The blocks of this package: each DecoderLM subclass of its model modules that names its
    `decoder_block` (a new family is its module and a card)."""
    from sharding_dump.models import shipped_families

    blocks: dict[str, Block] = {}
    for name, family in shipped_families():
        where = f"{family.__module__}:{family.__qualname__}"
        if name in blocks:
            raise BadInput(f"decoder block {name!r}: named by both {blocks[name].module} and {where}")
        blocks[name] = _declared_by(Block(name, where, None), family)
    return dict(sorted(blocks.items()))


def _declared_by(block: Block, family: type) -> Block:
    """`block` with the card fields its class reads, requires and pairs; BadInput when one of them is
    no card field (a typo would otherwise refuse or wave through every card of the block)."""
    block = dataclasses.replace(block, fields=frozenset(getattr(family, "card_fields", ())),
                                required=tuple(getattr(family, "required_fields", ())),
                                equal=tuple(tuple(pair) for pair in getattr(family, "equal_fields", ())))
    known = {f.name for f in dataclasses.fields(ModelConfig)} | {"description"}
    named = block.fields | set(block.required) | {f for pair in block.equal for f in pair}
    for field in sorted(named - known):
        raise BadInput(f"decoder block {block.name} ({block.module}): {field!r} is no model-card field "
                       f"(data/schemas/model-card.schema.json declares them)")
    return block


def _entry_points(group: str) -> tuple[importlib.metadata.EntryPoint, ...]:
    """The installed entry points of `group`, by name (read once per sys.path: a folder added to it
    later, such as a plugin's, is read then)."""
    return _entry_points_on(tuple(sys.path), group)


@functools.lru_cache(maxsize=32)
def _entry_points_on(path: tuple[str, ...], group: str) -> tuple[importlib.metadata.EntryPoint, ...]:
    # Scanning every installed distribution's metadata costs ~3 ms; a case asks several times.
    return tuple(sorted(importlib.metadata.entry_points(group=group), key=lambda ep: (ep.name, ep.value)))


def decoder_blocks() -> dict[str, Block]:
    """Every decoder block: this package's and those installed packages register."""
    blocks = dict(_shipped_blocks())
    for ep in _entry_points(FAMILY_GROUP):
        if ep.name in blocks:
            raise BadInput(f"entry point {ep.name} = {ep.value} (group {FAMILY_GROUP}): decoder block "
                           f"{ep.name!r} already exists; register the family under another name")
        blocks[ep.name] = Block(ep.name, ep.value, None, entry_point=ep)
    return blocks


def block_class(name: str) -> Any:
    """The Flax module class of decoder block `name` (imported only now: this module needs no flax)."""
    block = _block(name, "decoder block")
    if block.entry_point is not None:
        try:
            return block.entry_point.load()
        except Exception as err:  # a broken plugin is the user's input, not our crash
            raise BadInput(f"entry point {block.name} = {block.module} (group {FAMILY_GROUP}): cannot be "
                           f"loaded ({type(err).__name__}: {err})") from None
    module, _, attr = block.module.partition(":")
    return getattr(importlib.import_module(module), attr)


def block_lineage(name: str) -> tuple[str, ...]:
    """Decoder block `name`, then, for an installed family, the shipped blocks its class derives from,
    nearest first: the `decoder_block` each class of its MRO names itself (a subclass of a shipped block's
    class inherits that block's name). A shipped block is itself alone: what MaxText builds for it is
    data of its own, never its base class's."""
    if _block(name, "decoder block").entry_point is None:
        return (name,)
    named = [klass.__dict__["decoder_block"] for klass in block_class(name).__mro__ if "decoder_block" in klass.__dict__]
    return tuple(dict.fromkeys([name, *named]))


@functools.cache
def _shipped_block(name: str) -> Block | None:
    """Decoder block `name` of this package as :func:`_shipped_blocks` holds it, with only its own
    family module imported (None: not found that way)."""
    from sharding_dump.models import family_of

    family = family_of(name)
    if family is None:
        return None
    return _declared_by(Block(name, f"{family.__module__}:{family.__qualname__}", None), family)


def _block(name: str, where: str) -> Block:
    if all(ep.name != name for ep in _entry_points(FAMILY_GROUP)):  # no installed family claims the name
        shipped = _shipped_block(name)
        if shipped is not None:
            return shipped
    blocks = decoder_blocks()
    if name not in blocks:
        raise BadInput(f"{where}: field decoder_block: {name!r} is not a decoder block: valid blocks are "
                       f"{', '.join(sorted(blocks))}")
    return blocks[name]


def _declared(name: str, where: str) -> Block:
    """Decoder block `name` with what its class declares (an installed family's class is loaded only
    now, when a card of it is read)."""
    block = _block(name, where)
    return block if block.fields is not None else _declared_by(block, block_class(name))


def honoured_fields(name: str) -> frozenset[str]:
    """The card fields decoder block `name` reads (the common ones included)."""
    return _common_fields() | _declared(name, "decoder block").fields


def _registered_card_dirs() -> tuple[tuple[str, Path], ...]:
    """(entry point, directory) of every card directory installed packages register."""
    return _registered_card_dirs_on(tuple(sys.path))


@functools.lru_cache(maxsize=32)
def _registered_card_dirs_on(path: tuple[str, ...]) -> tuple[tuple[str, Path], ...]:
    # Read once per sys.path, as the entry points are: a case asks for the cards many times.
    found = []
    for ep in _entry_points(CARD_GROUP):
        where = f"entry point {ep.name} = {ep.value} (group {CARD_GROUP})"
        try:
            target = ep.load()
            target = target() if callable(target) else target
        except Exception as err:
            raise BadInput(f"{where}: cannot be loaded ({type(err).__name__}: {err})") from None
        if not isinstance(target, (str, Path)) or not Path(target).is_dir():
            raise BadInput(f"{where}: gives {target!r}, not a directory of model card files")
        found.append((where, Path(target)))
    return tuple(found)


def card_files() -> dict[str, Path]:
    """Every known card by name: the shipped ones, then those registered through entry points."""
    folders = ((None, MODELS_DIR), *_registered_card_dirs())
    return dict(_cards_in(tuple((where, folder, _stamp(folder)) for where, folder in folders)))


def _stamp(folder: Path) -> int:
    """When a folder last gained or lost a file (0 when it cannot be read)."""
    try:
        return folder.stat().st_mtime_ns
    except OSError:
        return 0


@functools.lru_cache(maxsize=32)
def _cards_in(folders: tuple[tuple[str | None, Path, int], ...]) -> tuple[tuple[str, Path], ...]:
    # Listed again only when a folder's modification time moves (a card added, renamed or removed):
    # a test session resolves a card name thousands of times.
    cards = {p.stem: p for p in sorted(folders[0][1].glob("*.yml"))}
    for where, directory, _ in folders[1:]:
        for path in sorted(p for p in directory.iterdir() if p.suffix in CARD_SUFFIXES):
            if path.stem in cards and cards[path.stem].resolve() != path.resolve():
                raise BadInput(f"{where}: card {path.stem!r} ({path}) has the name of {cards[path.stem]}; "
                               f"rename it")
            cards[path.stem] = path
    return tuple(cards.items())


def model_names() -> list[str]:
    """Every model card: shipped with the package or registered by an installed package."""
    return sorted(card_files())


def is_card_path(ref: str) -> bool:
    """True when a model reference is a card file (ends .yml/.yaml) rather than a card name."""
    return str(ref).lower().endswith(CARD_SUFFIXES)


def resolve_model(ref: str) -> tuple[str, Path]:
    """(card name, card file) of a model reference: a known card name or a path to a card file.

    A card given by path is named by its `name` field (that is what the case is called), which must
    not be the name of another known card."""
    if not is_card_path(ref):
        cards = card_files()
        if ref not in cards:
            from sharding_dump.zoo.releases import missing_model

            if missing_model(ref) is not None:
                raise BadInput(f"model {ref!r}: {missing_model(ref)}")
            close = difflib.get_close_matches(ref, sorted(cards), n=3, cutoff=0.5)
            hint = f" (closest: {', '.join(close)})" if close else ""
            raise BadInput(f"unknown model {ref!r}: valid models are the {len(cards)} cards `sharding-dump list "
                           f"models` prints{hint}, or a path to a card file ending .yml/.yaml")
        return ref, cards[ref]
    path = Path(ref)
    name = load_card(ref)["name"]
    known = card_files().get(name)
    if known is not None and known.resolve() != path.resolve():
        raise BadInput(f"model card {path}: field name: {name!r} is the name of the model card {known}; "
                       f"give this card its own name")
    return name, path


def check_model_name(ref: str) -> None:
    """BadInput unless `ref` is a known model card or a valid card file."""
    resolve_model(ref)


def card_path(ref: str) -> Path:
    """The file of a model reference (checked to be a known card or a valid card file)."""
    return resolve_model(ref)[1]


def load_card(ref: str) -> dict[str, Any]:
    """The checked content of a card (by name or path): schema, block, honoured fields, consistency."""
    if is_card_path(ref):
        path, expected_name = Path(ref), None
    else:
        path, expected_name = card_path(ref), ref
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        raise BadInput(f"model card {path}: no such file") from None
    return _read_card(path, stamp, expected_name)


@functools.cache
def _read_card(path: Path, stamp: int, expected_name: str | None) -> dict[str, Any]:
    where = f"model card {path}"
    data = load_yaml(path, "model card")
    validate(data, "model-card", where)
    if expected_name is not None and data["name"] != expected_name:
        raise BadInput(f"{where}: field name: {data['name']!r} must match the file name {expected_name!r}")
    check_card_block(data, where)
    check_card_consistency(data, where)
    try:
        parse_overrides(data.get("settings", {}))
    except BadInput as err:
        raise BadInput(f"{where}: field settings: {err}") from None
    return data


def card_settings(ref: str) -> dict[str, Any]:
    """The run settings a card sets as its case's defaults (KEY=VALUE overrides win), as MaxText's
    model config of the same name sets them: gpt3-6b's `opt_type: adam_pax` and `max_target_length: 1024`.

    >>> card_settings("gpt3-6b")
    {'opt_type': 'adam_pax', 'max_target_length': 1024}
    >>> card_settings("llama2-7b")
    {}
    """
    return dict(parse_overrides(load_card(ref).get("settings", {})))


def check_card_block(card: dict[str, Any], where: str) -> None:
    """Every field the card sets must be honoured by its decoder block (or be at its default), the
    block's required fields present and its paired fields equal: else BadInput naming the field."""
    name = card["decoder_block"]
    block = _declared(name, where)
    honoured = honoured_fields(name)
    for field, value in card.items():
        if field in honoured or field in NOT_MODEL_FIELDS or is_default(value, field):
            continue
        others = sorted(b for b, known in decoder_blocks().items()  # an installed family not yet read is left out
                        if known.fields is not None and field in honoured_fields(b))
        hint = f"blocks that honour it: {', '.join(others)}" if others else "no decoder block honours it"
        raise BadInput(f"{where}: field {field}: {json.dumps(value)} is ignored by decoder block {name!r}, "
                       f"which would build the model without it; remove the field or use another block "
                       f"({hint})")
    for field in block.required:
        if field not in card:
            raise BadInput(f"{where}: field {field}: decoder block {name!r} requires it")
    for first, second in block.equal:
        a, b = card.get(first, default_of(first)), card.get(second, default_of(second))
        if a != b:
            raise BadInput(f"{where}: field {first}: {json.dumps(a)} must equal {second} ({json.dumps(b)}): "
                           f"decoder block {name!r} builds both from one value")


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


def load_config(ref: str, **run_settings: Any) -> ModelConfig:
    """The ModelConfig of a card (by name or path), with run settings (e.g. weight_dtype) applied."""
    data = {field: frozen(value) for field, value in load_card(ref).items() if field not in NOT_MODEL_FIELDS}
    numerics = {name: run_settings[name] for name, _, _ in NUMERICS + RELEASE_FIELDS + BUILD_FIELDS
                if name in run_settings}
    return ModelConfig(**data, **numerics)


def build_model(cfg: ModelConfig, pipeline: PipelineConfig | None = None) -> nn.Module:
    """The Flax module for a model config, its layer stack pipelined by `pipeline` when given (never
    initialised with real arrays here)."""
    family = block_class(cfg.decoder_block)
    return family(cfg) if pipeline is None else family(cfg, pipeline)


def pipelined_stack_length(cfg: ModelConfig) -> int | None:
    """Length of the layer stack a pipeline would cut into stages (None: the family cannot be pipelined)."""
    from sharding_dump.models.decoder import pipelined_length

    return pipelined_length(block_class(cfg.decoder_block), cfg)


def pipelined_stack(cfg: ModelConfig) -> Stack | None:
    """The stack a pipeline would cut into stages, as MaxText counts its units (None: none)."""
    from sharding_dump.models.decoder import pipelined_stack as stack

    return stack(block_class(cfg.decoder_block), cfg)


def built_layers(cfg: ModelConfig, pipelined: bool) -> int:
    """The decoder layers a card's block builds, as the card counts them, without a pipeline (the card's
    own) or with one (MaxText's count of the pipelined stack's units, which may be blocks of layers)."""
    from sharding_dump.models.decoder import built_layers as count

    return count(block_class(cfg.decoder_block), cfg, pipelined)
