"""The MaxText releases the zoo builds (`maxtext_version`), read from `data/maxtext_releases.yml`.

What changes from one release to the next (its rule files, the logical axes its layers give, which
routed biases are model state, the blocks explicit mode accepts, ZeRO-1 with FSDP, its configuration
keys, the model configs the zoo has no card for) is data, written once there; this module reads it.

>>> release("0.2.5").model["attention_embed_axis"], release("0.2.4").rules_dir.name
('embed_attn', 'rules')
>>> release_of({"maxtext_version": "0.2.5"}).version
'0.2.5'
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Mapping, Sequence

from sharding_dump.errors import BadInput, shown
from sharding_dump.resources import DATA_DIR, RULES_DIR, load_yaml, validate

RELEASES_FILE = DATA_DIR / "maxtext_releases.yml"
SETTING = "maxtext_version"


@dataclasses.dataclass(frozen=True)
class Release:
    """One MaxText release as data/maxtext_releases.yml describes it."""

    version: str
    source: str
    rules_dir: Path
    model: Mapping[str, str]
    model_state_bias: tuple[str, ...]
    explicit_blocks: tuple[str, ...]
    explicit_refused: tuple[Mapping[str, Any], ...]  # what it refuses in explicit mode for some of those blocks
    zero1_with_fsdp: bool
    kv_heads_atomic: bool
    keys_added: tuple[str, ...]
    keys_removed: tuple[str, ...]
    models_missing: Mapping[str, str]
    pipeline_fails: Mapping[str, str]  # decoder block -> why the release's MaxText fails to build it pipelined
    builds: tuple[str, ...]
    nnx_keys: tuple[str, ...]  # MaxText keys choosing between its two builds, where it has two
    choose: Mapping[str, Mapping[str, bool]]  # build -> the values of the keys that choose it
    nnx_differs: tuple[Mapping[str, Any], ...]  # the cases that build places otherwise than the Linen build
    rng_streams: tuple[str, ...]  # the streams of the nnx.Rngs its NNX build trains with
    rng_key_impl: str  # the PRNG implementation of those keys (jax.random.key's `impl`)
    rngs: Mapping[str, tuple[str, ...]]  # decoder block -> the modules whose NNX class keeps that nnx.Rngs
    # its NNX build's (stack, module, layer axis) of the layers a pipeline leaves out of a stack
    outside_pipeline: tuple[tuple[str, str, str], ...]

    def rng_modules(self, lineage: Sequence[str]) -> tuple[str, ...]:
        """The module patterns that keep RNG state in the release's NNX build, those of the first decoder
        block of `lineage` the release names (a block, then the blocks its class derives from:
        cards.block_lineage). A family of a user's own, derived from a shipped block's class, builds that
        block's modules, so it keeps its RNG state where that block does."""
        for block in lineage:
            if block in self.rngs:
                return self.rngs[block]
        raise BadInput(f"decoder block {lineage[0]!r}: which of its modules keep RNG state in MaxText "
                       f"{self.version}'s NNX build is not known: neither it nor a block its class derives from is "
                       f"in {RELEASES_FILE.name} builds/nnx_state/rngs ({', '.join(sorted(self.rngs))}); derive its "
                       f"class from one of theirs, or dump the Linen build: {linen_build()}")

    def bias_is_state(self, model_name: str) -> bool:
        """True when the release keeps the routed `gate/bias` of `model_name` as model state, not a
        parameter (MaxText keys this on the model name's prefix)."""
        return model_name.startswith(self.model_state_bias) if self.model_state_bias else False


@functools.cache
def releases() -> dict[str, Release]:
    """Every release, oldest first (the file's order), schema-checked."""
    data = load_yaml(RELEASES_FILE, "MaxText releases file")
    validate(data, "maxtext-releases", f"MaxText releases file {RELEASES_FILE}")
    out = {}
    for version, raw in data["releases"].items():
        folder = RULES_DIR if raw["rules"] == "." else RULES_DIR / raw["rules"]
        if not folder.is_dir():
            raise BadInput(f"MaxText releases file {RELEASES_FILE}: field releases/{version}/rules: no folder {folder}")
        out[version] = Release(version, raw["source"], folder, dict(raw["model"]), tuple(raw["model_state_bias"]),
                               tuple(raw["explicit_blocks"]), tuple(raw["explicit_refused"]), raw["zero1_with_fsdp"],
                               raw["kv_heads_atomic"],
                               tuple(raw["keys_added"]),
                               tuple(raw["keys_removed"]), dict(raw["models_missing"]), dict(raw["pipeline_fails"]),
                               tuple(raw["builds"]["maxtext"]),
                               tuple(raw["builds"]["nnx_keys"]), dict(raw["builds"]["choose"]),
                               tuple(raw["builds"]["nnx_differs"]), tuple(raw["builds"]["nnx_state"]["streams"]),
                               raw["builds"]["nnx_state"]["key_impl"],
                               {block: tuple(paths) for block, paths in raw["builds"]["nnx_state"]["rngs"].items()},
                               tuple((stack, left["name"], left["axis"])
                                     for stack, left in raw["builds"]["nnx_state"]["outside_pipeline"].items()))
    return out


def release(version: str) -> Release:
    """The release `version` (BadInput naming the known ones for any other)."""
    known = releases()
    if version not in known:
        raise BadInput(f"{SETTING}={shown(version)}: must be one of {', '.join(known)}")
    return known[version]


def release_of(values: Mapping[str, Any]) -> Release:
    """The release a case's settings choose (`maxtext_version`, its default when unset)."""
    from sharding_dump.zoo.settings import value_of

    return release(str(value_of(values, SETTING)))


def rule_dirs() -> tuple[Path, ...]:
    """The rule folder of every release, each once."""
    return tuple(dict.fromkeys(r.rules_dir for r in releases().values()))


def keys_of(version: str, all_keys: set[str]) -> set[str]:
    """The keys of the release's base.yml, out of `all_keys` (every key data/maxtext_keys.yml knows):
    a key a later release adds, or one this release or an earlier one removed, is not among them."""
    order = list(releases())
    index = order.index(version)
    keys = set(all_keys)
    for later in order[index + 1:]:
        keys -= set(releases()[later].keys_added)
    for earlier in order[: index + 1]:
        keys -= set(releases()[earlier].keys_removed)
    return keys


def missing_model(name: str) -> str | None:
    """Why the zoo does not build MaxText's model config `name` (a config some release added), or None."""
    for rel in releases().values():
        if name in rel.models_missing:
            return f"MaxText {rel.version}'s model config {name!r} is not built by the zoo: {rel.models_missing[name]}"
    return None


def linen_settings() -> dict[str, Any]:
    """The settings that give MaxText's Linen build, as MaxText's own sharding tests ask for it: the release
    that has one, its build keys false."""
    rel = next(r for r in releases().values() if "linen" in r.builds)
    return {SETTING: rel.version, **{key: False for key in rel.nnx_keys}}


def linen_build() -> str:
    """:func:`linen_settings` as KEY=VALUE words."""
    return " ".join(f"{key}={str(value).lower()}" for key, value in linen_settings().items())


def nnx_build(values: Mapping[str, Any]) -> bool:
    """Whether MaxText builds its NNX state for a case's settings (`values`, setting -> value), as MaxText
    honours `pure_nnx`, `enable_nnx` and `pure_nnx_decoder`: a release with one build has it (0.2.5: NNX;
    it has none of those keys, so any of them given is refused, as its configuration refuses an unknown
    key); e591f30 builds what data/maxtext_releases.yml `choose` says for the values (its base.yml
    defaults: NNX), and a mix that bridges one build's modules into the other's state is refused. (A key
    given at its default to 0.2.5 is refused by the command line as any key 0.2.5 lacks.)"""
    from sharding_dump.zoo.settings import format_value, value_of

    rel = release_of(values)
    if not rel.choose:  # a key at its default is no choice (resolved settings hold every key)
        given = [key for other in releases().values() for key in other.nnx_keys
                 if key in values and values[key] != value_of({}, key)]
        if given:
            raise BadInput(f"{given[0]}={format_value(values[given[0]])}: not a key of MaxText {rel.version} (it "
                           f"builds only its {'/'.join(rel.builds).upper()} state; give no {given[0]})")
        return "nnx" in rel.builds
    for build, flags in rel.choose.items():
        if all(value_of(values, key) is flag for key, flag in flags.items()):
            return build == "nnx"
    keys = sorted(rel.nnx_keys, key=lambda key: value_of(values, key) == value_of({}, key))  # the ones given first
    shown_values = " ".join(f"{key}={format_value(value_of(values, key))}" for key in keys)
    raise BadInput(f"{shown_values}: MaxText {rel.version} bridges one build's modules into the other's state "
                   f"with this mix, which sharding-dump does not build; give "
                   + " or ".join(" ".join(f"{k}={format_value(v)}" for k, v in flags.items())
                                 + f" ({build})" for build, flags in rel.choose.items()))


def check_build(rel: Release, nnx: bool, zero1: bool, block: str | None = None, tensor: int = 1,
                where: str = "", stages: int = 1) -> None:
    """BadInput when the MaxText keys ask for the release's NNX build (`nnx`) of a case that build places
    otherwise than sharding-dump builds it, or fails to build (data/maxtext_releases.yml `nnx_differs`: ZeRO-1
    on, `zero1`; tensor parallelism `tensor`, or pipeline `stages`, above 1 for a decoder `block` listed)."""
    if not nnx:
        return
    for case in rel.nnx_differs:
        if case["when"] == "shard_optimizer_over_data" and zero1:
            what = "shard_optimizer_over_data=true"
        elif case["when"] == "tensor_parallelism" and tensor > 1 and block in case.get("blocks", ()):
            what = f"decoder block {block!r} with tensor parallelism {tensor}"
        elif case["when"] == "pipeline_parallelism" and stages > 1 and block in case.get("blocks", ()):
            what = f"decoder block {block!r} with pipeline parallelism ({stages} stages)"
        else:
            continue
        build = f"({'/'.join(rel.nnx_keys)} true)" if rel.nnx_keys else "(its only build)"
        linen = "its Linen build" if "linen" in rel.builds else "the Linen build of an earlier release"
        raise BadInput(f"{where}{what} with MaxText {rel.version}'s NNX build {build}: "
                       f"{case['why']}, which sharding-dump does not build; give {linen}: {linen_build()}")


FSDP_AXES = ("fsdp", "fsdp_transpose")  # the axes MaxText counts as FSDP when it refuses ZeRO-1 with it
CONTEXT_AXES = ("context", "context_usp_ulysses")  # the axes MaxText counts as context parallelism in explicit mode
# What each `when` of `explicit_refused` means, as a user gives it.
EXPLICIT_WHEN = {"dense_matmul": "sparse_matmul=false", "context_parallelism": "context parallelism"}


def _explicit_refusal(rel: Release, values: Mapping[str, Any], block: str,
                      sizes: Mapping[str, int]) -> tuple[str, str] | None:
    """(what, why) of a case in explicit mode with decoder `block` that the release refuses
    (data/maxtext_releases.yml `explicit_refused`), `what` said as the settings give it; None when nothing is."""
    context = 1
    for axis in CONTEXT_AXES:
        context *= sizes.get(axis, 1)
    for refusal in rel.explicit_refused:
        if block not in refusal["blocks"]:
            continue
        if refusal["when"] == "dense_matmul" and values["sparse_matmul"] is False:
            return EXPLICIT_WHEN["dense_matmul"], refusal["why"]
        if refusal["when"] == "context_parallelism" and context > 1:
            return f"{EXPLICIT_WHEN['context_parallelism']} {context}", refusal["why"]
    return None


def check_case(rel: Release, values: Mapping[str, Any], config: Any, sizes: Mapping[str, int],
               kv_head_axes: Sequence[str] = ()) -> None:
    """BadInput for what the release's MaxText refuses: shard_mode=explicit for a decoder block outside its
    explicit set or in a case its `explicit_refused` names, ZeRO-1 (shard_optimizer_over_data) with FSDP axes
    of more than one device, key/value heads split over more shards than there are (`kv_head_axes`: the mesh
    axes the key projection's kv_heads dimension is placed on), pipeline stages of a block it fails to build
    pipelined. `config`: the card's ModelConfig, None for a user's model."""
    from sharding_dump.models.pipeline import STAGE_AXIS

    decoder_block = config.decoder_block if config is not None else None
    if decoder_block in rel.pipeline_fails and sizes.get(STAGE_AXIS, 1) > 1:
        raise BadInput(f"pipeline parallelism ({sizes[STAGE_AXIS]} stages): MaxText {rel.version} fails to build "
                       f"decoder block {decoder_block!r} pipelined: {rel.pipeline_fails[decoder_block]}; size "
                       f"ici_/dcn_pipeline_parallelism 1")
    if values["shard_mode"] == "explicit" and decoder_block is not None and decoder_block not in rel.explicit_blocks:
        raise BadInput(f"shard_mode=explicit: MaxText {rel.version} does not support decoder block {decoder_block!r} "
                       f"in explicit mode (blocks it supports: {', '.join(rel.explicit_blocks)})")
    refused = _explicit_refusal(rel, values, decoder_block, sizes) if values["shard_mode"] == "explicit" and \
        decoder_block is not None else None
    if refused:
        raise BadInput(f"shard_mode=explicit with {refused[0]}: MaxText {rel.version} refuses it for decoder block "
                       f"{decoder_block!r} ({refused[1]}); give shard_mode=auto")
    if rel.kv_heads_atomic and config is not None and kv_head_axes:
        split = [axis for axis in kv_head_axes if sizes.get(axis, 1) > 1]
        shards = 1
        for axis in split:
            shards *= sizes[axis]
        for heads in {config.num_kv_heads, config.global_num_kv_heads} - {0}:
            if heads % shards:
                raise BadInput(f"MaxText {rel.version} never splits a key/value head: {config.name} has {heads} "
                               f"key/value heads, which the rules split over {' x '.join(split)} ({shards} "
                               f"shards); size those axes to divide {heads}")
    fsdp = 1
    for axis in FSDP_AXES:
        fsdp *= sizes.get(axis, 1)
    if values["shard_optimizer_over_data"] and not rel.zero1_with_fsdp and fsdp > 1:
        raise BadInput(f"shard_optimizer_over_data=true: MaxText {rel.version} refuses ZeRO-1 with FSDP (the fsdp "
                       f"axes hold {fsdp} devices); size ici_/dcn_fsdp_parallelism and "
                       f"ici_/dcn_fsdp_transpose_parallelism 1, or give {SETTING}=0.2.4")
