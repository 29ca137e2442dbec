"""Rule files: a mesh (`mesh_axes`) plus the logical-to-physical axis rules for it.

A rule is named (`sharding_dump/rules/<name>.yml`) or given as a path to a user's own file. Every
file is checked against `data/schemas/rule.schema.json`, and every mesh axis a rule names must be in
its `mesh_axes`. Logical specs are resolved with flax's own resolver, so precedence and fallbacks
behave exactly as in training:

>>> rules = load_rule("pure-fsdp")
>>> from sharding_dump.core.layout import resolve
>>> resolve(("embed", "mlp"), rules)
P('fsdp', None)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path
from typing import Any, Container, Iterable, Mapping, Sequence

from sharding_dump.core import specs
from sharding_dump.core.boundary import bounded_regexes, bounded_search
from sharding_dump.core.format import ACTIVATIONS_FILE, LOGICAL_FILE, NAMED_FILE
from sharding_dump.core.specs import PathRule, entry_axes, match_path_rule, rule_axes
from sharding_dump.errors import BadInput, shown
from sharding_dump.golden.diff import slot_parameter
from sharding_dump.golden.engine import display
from sharding_dump.resources import (RULES_DIR, YAML_MAX_BYTES, item_lines, parse_yaml, read_text, validate,
                                     yaml_item_lines)
from sharding_dump.zoo import releases
from sharding_dump.zoo import settings as settings_mod

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
BASE_RULE = "default"  # the rule file holding MaxText's base logical_axis_rules
# Packaged rule files made from MaxText configuration files (base.yml, inference/inference.yml over it),
# into whose rules MaxText merges a model config's own, unlike a custom_mesh_and_rule file.
CONFIG_RULES = (BASE_RULE, "inference")


@dataclasses.dataclass(frozen=True)
class MissingAxis:
    """A mesh axis the rules' source (MaxText's configuration file) names but the mesh lacks, dropped from
    the rules: MaxText drops it where it constrains an activation (remove_size_one_mesh_axis) and fails
    where it places a weight, a cache or the batch by it ('Resource axis: ... is not found in mesh')."""

    axis: str
    rules: tuple[str, ...]  # the logical names whose rules named it
    data_sharding: bool = False  # data_sharding named it


@dataclasses.dataclass(frozen=True)
class RuleSet:
    """A loaded, validated rule file."""

    name: str
    path: Path
    mesh_axes: tuple[str, ...]
    data_sharding: tuple[str, ...]
    context_sharding: str | None
    input_data_sharding_logical_axes: tuple[str, ...]  # () when the file has none: the batch follows data_sharding
    logical_axis_rules: Rules
    # (topology regex, settings as (key, value) pairs): every field is immutable, so a RuleSet hashes.
    mesh_rules: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    # Where each logical_axis_rules entry was written: (file, 1-based line), same order.
    origins: tuple[tuple[Path, int], ...] = ()
    # Parameters without logical axes, placed by path regex (first match wins); each knows its line.
    partition_rules: tuple[PathRule, ...] = ()
    # Mesh axes the file's source names that its mesh lacks, dropped here: (axis, the logical names whose
    # rules named it, whether its data_sharding did).
    missing_axes: tuple[MissingAxis, ...] = ()

    def mesh_settings_for(self, topology_name: str) -> dict[str, Any]:
        """Settings of the first `mesh_rules` entry whose regex matches the topology name."""
        for pattern, values in self.mesh_rules:
            if bounded_search(pattern, topology_name, f"rule file {self.path}: mesh_rules"):
                return dict(values)
        return {}


def rule_names(folder: Path = RULES_DIR) -> list[str]:
    """The rule files shipped with the package (`folder`: a MaxText release's, data/maxtext_releases.yml)."""
    return sorted(p.stem for p in folder.glob("*.yml"))


def is_rule_path(ref: str) -> bool:
    """A `--rule` value is a path when it has a separator or a YAML suffix; otherwise a name."""
    return "/" in ref or "\\" in ref or ref.endswith((".yml", ".yaml"))


def rule_name(ref: str) -> str:
    """The name a rule reference goes by in case names: the name itself, or a path's stem."""
    name = Path(ref).stem if is_rule_path(ref) else ref
    if not SAFE_NAME.fullmatch(name):
        raise BadInput(f"rule {ref!r}: a rule name is letters, digits, '.', '_' or '-'")
    return name


def rule_path(ref: str, folder: Path = RULES_DIR) -> Path:
    """The file behind a rule reference (a name: in `folder`, a MaxText release's rule files); unknown
    names are BadInput."""
    if is_rule_path(ref):
        if not ref.endswith((".yml", ".yaml")):
            raise BadInput(f"rule file {ref}: a rule file path must end in .yml or .yaml")
        rule_name(ref)
        return Path(ref)
    if ref not in rule_names(folder):
        names = ", ".join(rule_names(folder))
        other = [r.version for r in releases.releases().values() if ref in rule_names(r.rules_dir)]
        known = f" (a rule of MaxText {', '.join(other)}: give {releases.SETTING}={other[-1]})" if other else ""
        raise BadInput(f"unknown rule {ref!r}{known}: valid rules are {names} or a path to a .yml file")
    return folder / f"{ref}.yml"


def load_rule(ref: str, folder: Path = RULES_DIR) -> RuleSet:
    """Loads, schema-checks and cross-checks the rule file `ref` (a name or a path). The file is read
    every time; what its text gives is checked once per process (a test session or `--all` loads the
    same few files for every case, and the schema check is most of the cost)."""
    path = rule_path(ref, folder)
    return _rule_set(rule_name(ref), path, read_text(path, "rule file", YAML_MAX_BYTES))


@functools.lru_cache(maxsize=64)
def _rule_set(label: str, path: Path, text: str) -> RuleSet:
    where = f"rule file {path}"
    data = parse_yaml(text, f"{where}:")
    validate(data, "rule", where)
    mesh_axes = tuple(data["mesh_axes"])
    sized_by: dict[str, str] = {}
    for axis in mesh_axes:  # any name; two names sized by one setting (stage and pipeline) would clash
        key = settings_mod.parallelism_key("ici", axis)
        if key in sized_by:
            raise BadInput(f"{where}: field mesh_axes: {sized_by[key]!r} and {axis!r} are both sized by {key}: "
                           f"rename one")
        sized_by[key] = axis
    rules: Rules = tuple((name, rule_axes(axes)) for name, axes in data.get("logical_axis_rules", ()))
    path_rules = _partition_rules(path, text, data.get("partition_rules", []), mesh_axes,
                                  {name for name, _ in data.get("logical_axis_rules", ())})
    for index, (name, axes) in enumerate(rules):
        for axis in entry_axes(axes):
            if axis not in mesh_axes:
                raise BadInput(f"{where}: field logical_axis_rules/{index} ({name}): mesh axis {axis!r} "
                               f"is not in mesh_axes [{', '.join(mesh_axes)}]")
    data_sharding = tuple(data.get("data_sharding", [list(mesh_axes)])[0])
    for axis in data_sharding:
        if axis not in mesh_axes:
            raise BadInput(f"{where}: field data_sharding: {axis!r} is not in mesh_axes [{', '.join(mesh_axes)}]")
    context = data.get("context_sharding")
    if context is not None and context not in mesh_axes:
        raise BadInput(f"{where}: field context_sharding: {context!r} is not in mesh_axes [{', '.join(mesh_axes)}]")
    missing = []
    for index, entry in enumerate(data.get("missing_axes", [])):
        if entry["axis"] in mesh_axes:
            raise BadInput(f"{where}: field missing_axes/{index}: {entry['axis']!r} is in mesh_axes; list only axes "
                           "the mesh lacks")
        missing.append(MissingAxis(entry["axis"], tuple(entry.get("rules", ())), entry.get("data_sharding", False)))
    mesh_rules = []
    for index, entry in enumerate(data.get("mesh_rules", [])):
        try:
            re.compile(entry["match"])
        except re.error as err:
            raise BadInput(f"{where}: field mesh_rules/{index}/match: not a regular expression ({err})") from None
        try:
            parsed = tuple(settings_mod.parse_overrides(entry["settings"]))
        except BadInput as err:
            raise BadInput(f"{where}: field mesh_rules/{index}/settings: {err}") from None
        mesh_rules.append((entry["match"], parsed))
    return RuleSet(
        name=label,
        path=path,
        mesh_axes=mesh_axes,
        data_sharding=data_sharding,
        context_sharding=context,
        input_data_sharding_logical_axes=tuple(data.get("input_data_sharding_logical_axes", ())),
        logical_axis_rules=rules,
        mesh_rules=tuple(mesh_rules),
        origins=tuple((path, line) for line in item_lines(text, "logical_axis_rules")),
        partition_rules=path_rules,
        missing_axes=tuple(missing),
    )


def _partition_rules(path: Path, text: str, entries: list[Any], mesh_axes: tuple[str, ...],
                     logical_names: set[str]) -> tuple[PathRule, ...]:
    """The `partition_rules` of a rule file, each regex compiled, each mesh axis declared and used
    once per spec (a mesh axis splits one dimension at most), each logical name one the file's
    `logical_axis_rules` resolve (another would leave its dimension whole without a word)."""
    where = f"rule file {path}"
    lines = item_lines(text, "partition_rules")
    out = []
    for index, (pattern, spec) in enumerate(entries):
        try:
            re.compile(pattern)
        except re.error as err:
            raise BadInput(f"{where}: field partition_rules/{index}: {shown(pattern)} is not a regular expression "
                           f"({err})") from None
        origin = f"{display(path)}:{lines[index]}" if index < len(lines) else f"{display(path)} partition_rules/{index}"
        field = f"{where}: field partition_rules/{index} ({shown(pattern)})"
        if isinstance(spec, dict):
            for name in spec["logical"]:
                if name is not None and name not in logical_names:
                    known = ", ".join(sorted(logical_names)) or "none: the file has no logical_axis_rules"
                    raise BadInput(f"{field}: logical axis {name!r} has no rule in logical_axis_rules, so its "
                                   f"dimension would stay whole; give a name the rules map (known: {known}) or null")
            out.append(PathRule(pattern, logical=tuple(spec["logical"]), where=origin))
            continue
        used: set[str] = set()
        for axis in (a for entry in spec for a in entry_axes(entry)):
            if axis not in mesh_axes:
                raise BadInput(f"{field}: mesh axis {axis!r} is not in mesh_axes [{', '.join(mesh_axes)}]")
            if axis in used:
                raise BadInput(f"{field}: mesh axis {axis!r} appears twice in the spec; a mesh axis splits one "
                               "dimension at most (e.g. [fsdp, tensor] or [[fsdp, tensor], null])")
            used.add(axis)
        out.append(PathRule(pattern, spec=tuple(rule_axes(entry) for entry in spec), where=origin))
    return tuple(out)


def is_base_rule(rule_set: RuleSet) -> bool:
    """True for a packaged `default` or `inference` rule file (of any MaxText release): MaxText's
    configuration files, the only rules a model card's rules are merged into (a custom_mesh_and_rule
    file replaces the rules wholesale)."""
    return rule_set.path.resolve() in {(folder / f"{name}.yml").resolve() for folder in releases.rule_dirs()
                                       for name in CONFIG_RULES}


def with_overrides(rule_set: RuleSet, overrides: Sequence[Sequence[Any]], source: Path | None = None) -> RuleSet:
    """Applies a model card's own rules the way MaxText merges them: every rule of the base rule file
    with the same logical name is dropped and the card's rules are appended. Any other rule file is
    returned unchanged: as in MaxText, a custom mesh-and-rule file replaces the merged rules wholesale.
    A card rule that names an axis this mesh lacks is left out (the card cannot know every mesh).
    `source` is the card's file, so the merged rules keep pointing at the line that wrote them."""
    if not is_base_rule(rule_set):
        return rule_set
    lines = yaml_item_lines(source, "logical_axis_rules") if source is not None else []
    extra, extra_origins = [], []
    for index, (name, axes) in enumerate(overrides):
        if all(a in rule_set.mesh_axes for a in entry_axes(rule_axes(axes))):
            extra.append((name, rule_axes(axes)))
            if index < len(lines):
                extra_origins.append((source, lines[index]))
    if not extra:
        return rule_set
    names = {name for name, _ in extra}
    kept = [i for i, r in enumerate(rule_set.logical_axis_rules) if r[0] not in names]
    origins = ()
    if len(rule_set.origins) == len(rule_set.logical_axis_rules) and len(extra_origins) == len(extra):
        origins = tuple(rule_set.origins[i] for i in kept) + tuple(extra_origins)
    return dataclasses.replace(rule_set, logical_axis_rules=tuple(rule_set.logical_axis_rules[i] for i in kept)
                               + tuple(extra), origins=origins)


def deciding_rule(logical_axes: Sequence[str | None], rules: Rules, dim: int) -> int | None:
    """Index of the rule that decided dimension `dim` of a logical spec, or None when no rule did.

    flax assigns dimensions while it walks the rules in order, so replaying its own resolver on growing
    prefixes of the rules finds the first prefix that assigns `dim`; its last rule is the one.

    >>> r = (("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", None))
    >>> deciding_rule(("embed", "mlp"), r, 1)   # the first mlp rule is skipped: fsdp is taken
    2
    >>> deciding_rule(("embed", "vocab"), r, 1) is None
    True
    """
    from flax.linen import spmd  # its resolver, replayed step by step (imported here: a case needs no flax)

    names = tuple(logical_axes)
    if names[dim] is None:
        return None
    for index, (name, _) in enumerate(rules):
        if name == names[dim] and spmd._logical_to_mesh_axes(names, rules[: index + 1])[dim] is not spmd._unassigned_axis:
            return index
    return None


# A state leaf as the lints below read it, from a golden document or a layout: path, shape, logical axes.
Leaf = tuple[str, Sequence[int], Sequence[Any]]
def parameter(path: str) -> str | None:
    """A parameter leaf's path inside the parameters (a Linen state's `params/`, an NNX state's `model/`), None for
    any other leaf (an NNX module's RNG state among them: MaxText replicates it, no rule places it)."""
    part, _, rest = path.partition("/")
    return rest if part in specs.PARAMETER_PARTS and rest and specs.NNX_RNGS not in rest.split("/") else None


def unplaced_parameters(rule_set: RuleSet, leaves: Iterable[Leaf], placed: Container[str] = ()) -> list[str]:
    """Parameters of more than one element that carry no logical axis name, that no partition rule
    matches and that the program did not place itself (`placed`: their paths): each is whole on every
    device, and nothing in the model or the rule file says so."""
    return [path for path, shape, logical in leaves
            if parameter(path) is not None and math.prod(shape) > 1 and all(name is None for name in logical)
            and path not in placed and match_path_rule(rule_set.partition_rules, parameter(path)) is None]


def unplaced_state(leaves: Iterable[Leaf], none: Container[str], unplaced: Container[str] = ()) -> list[str]:
    """State leaves outside the parameters, of more than one element, that nothing places (`none`: the
    paths whose layout's source is `none`: no box, partition rule or sharding of the program's own, nor
    a weight they follow), each whole on every device; an optimizer slot of an `unplaced` parameter is
    left to that parameter's line."""
    return [path for path, shape, _ in leaves
            if parameter(path) is None and math.prod(shape) > 1 and path in none
            and slot_parameter(path, unplaced) is None]


def unmatched_partition_rules(rule_set: RuleSet, leaves: Iterable[Leaf]) -> list[PathRule]:
    """Partition rules whose regex is found in no parameter path of the model (a typo, or a rule file
    written for another model)."""
    paths = [parameter(path) for path, _, _ in leaves if parameter(path) is not None]
    with bounded_regexes() as search:
        return [rule for rule in rule_set.partition_rules
                if not any(search(rule.pattern, p, f"partition rule {rule.where}") for p in paths)]


def shadowed_partition_rules(rule_set: RuleSet, leaves: Iterable[Leaf]) -> list[tuple[PathRule, PathRule, str]]:
    """(rule, the earlier rule that wins, a path) for every partition rule whose regex matches some
    parameter path, none of which it places: an earlier rule matches each first (first match wins)."""
    paths = [parameter(path) for path, _, _ in leaves if parameter(path) is not None]
    rules_ = rule_set.partition_rules
    winner = {path: match_path_rule(rules_, path) for path in paths}
    out = []
    for index, rule in enumerate(rules_):
        with bounded_regexes() as search:
            matched = [p for p in paths if search(rule.pattern, p, f"partition rule {rule.where}")]
        if matched and all(winner[p] is not None and winner[p] < index for p in matched):
            out.append((rule, rules_[winner[matched[0]]], matched[0]))
    return out


def rank_mismatches(leaves: Iterable[Leaf]) -> list[tuple[str, int, int]]:
    """(path, number of logical axes, rank) of every parameter whose logical axes (when it has any)
    are more or fewer than its dimensions (flax resolves them anyway: the extra names are dropped, the missing
    dimensions left whole)."""
    return [(path, len(logical), len(shape)) for path, shape, logical in leaves
            if parameter(path) is not None and logical and len(logical) != len(shape)]


def _examples(paths: Sequence[str], limit: int = 3) -> str:
    shown_paths = ", ".join(paths[:limit])
    return shown_paths + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def use_warnings(rule_set: RuleSet, docs: Mapping[str, Mapping[str, Any]], known: Iterable[str] = (),
                 batch_fields: Iterable[str] | None = None, placed: Container[str] = (),
                 none: Container[str] = ()) -> list[str]:
    """Why a dump that worked may still not be what was meant, from its golden documents: rules that
    shard nothing on a mesh of more than one device, and logical names in the rule file that no
    tensor or activation of the dump carries (nor `known`: names a trainer defines for other models).
    A rule file written for other logical names dumps everything replicated without an error.
    `placed`: the paths of leaves the program placed itself (never "placed by nothing"); `none`: the paths
    of leaves nothing placed (a user's program: an optimizer state its init left unplaced)."""
    named = docs[NAMED_FILE]
    sizes = dict(zip(named["mesh"]["axis_names"], named["mesh"]["axis_sizes"]))
    tensors = [entry for doc in docs.values() for entry in doc["tensors"].values()]
    warnings = []
    if math.prod(sizes.values()) > 1:
        # What the rules placed: the state, and activations with logical axes (a batch left on the data
        # pipeline's layout, or a constraint given in mesh axes, is placed without them).
        ruled = [entry for entry in tensors if any(name is not None for name in entry.get("logical_axes", ()))
                 or entry.get("pass") is None]
        used = {axis for entry in ruled for dim in entry.get("partition_spec") or () for axis in entry_axes(dim)}
        if not any(sizes.get(axis, 1) > 1 for axis in used):
            mesh = " x ".join(f"{a}={n}" for a, n in sizes.items() if n > 1)
            warnings.append(f"the rules of {rule_set.path} shard nothing: every tensor and activation is whole on "
                            f"each of the {math.prod(sizes.values())} devices ({mesh}); do its logical names match "
                            f"the model's?")
    carried = {name for entry in tensors for name in entry.get("logical_axes", ()) if name is not None}
    carried |= set(known) | set(rule_set.input_data_sharding_logical_axes)
    lines = dict(zip(range(len(rule_set.origins)), (line for _, line in rule_set.origins)))
    unused = [f"{name} (line {lines[i]})" if i in lines else name
              for i, (name, _) in enumerate(rule_set.logical_axis_rules) if name not in carried]
    if unused:
        warnings.append(f"{rule_set.path} has rules for logical axes no tensor or activation of this dump "
                        f"carries: {', '.join(unused)}")
    state = [(path, entry["shape"], entry["logical_axes"]) for path, entry in docs[LOGICAL_FILE]["tensors"].items()]
    unplaced = unplaced_parameters(rule_set, state, placed)
    if unplaced and math.prod(sizes.values()) > 1:
        warnings.append(f"{len(unplaced)} parameter{'s' if len(unplaced) > 1 else ''} carry no logical axes and "
                        f"match no partition rule of {rule_set.path}, so each is whole on every device: "
                        f"{_examples(unplaced)}")
    others = unplaced_state(state, none, unplaced)
    if others and math.prod(sizes.values()) > 1:
        many = len(others) > 1
        warnings.append(f"{len(others)} state {'leaves' if many else 'leaf'} outside params {'are' if many else 'is'} "
                        "placed by nothing (no logical axes, partition rule or sharding of the program's own, nor a "
                        f"weight followed), so each is whole on every device: {_examples(others)}")
    for rule in unmatched_partition_rules(rule_set, state):
        warnings.append(f"partition rule {rule.where} ({rule.pattern!r}) matches no parameter path of this model")
    for rule, first, path in shadowed_partition_rules(rule_set, state):
        warnings.append(f"partition rule {rule.where} ({rule.pattern!r}) places nothing: every parameter path it "
                        f"matches is matched first by partition rule {first.where} ({first.pattern!r}), e.g. {path}")
    mismatched = rank_mismatches(state)
    if mismatched:
        warnings.append("logical axes that do not fit the tensor's rank: " + ", ".join(
            f"{path} ({axes} names, rank {rank})" for path, axes, rank in mismatched[:3])
            + (f" and {len(mismatched) - 3} more" if len(mismatched) > 3 else ""))
    if ACTIVATIONS_FILE in docs and not model_constraints(docs[ACTIVATIONS_FILE], batch_fields):
        if not rule_set.logical_axis_rules:  # flax resolves a logical constraint to none without rules
            warnings.append("the model placed no activation sharding constraint in its training step that resolves "
                            f"to a layout: {ACTIVATIONS_FILE} holds only the batch ({rule_set.path} has no "
                            "logical_axis_rules, so any constraint in logical axes resolves to none)")
        else:
            warnings.append("the model placed no activation sharding constraint in its training step: "
                            f"{ACTIVATIONS_FILE} holds only the batch (a helper gated on a mesh the harness does "
                            "not set, or shardings given only to jit, are not seen)")
    return warnings


def model_constraints(activations: Mapping[str, Any], batch_fields: Iterable[str] | None = None) -> list[str]:
    """Keys of the activation constraints the model placed, not the harness's own placement of the
    batch fields (default: the token batch's)."""
    from sharding_dump.core.step import BATCH_FIELDS

    fields = set(BATCH_FIELDS if batch_fields is None else batch_fields)
    return [key for key, entry in activations["tensors"].items()
            if not (entry["module"] == "" and entry["name"] in fields)]
