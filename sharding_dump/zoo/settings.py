"""The KEY=VALUE settings a case may override, read from `data/settings.yml`.

A setting has a type; values arrive as strings (command line) or YAML scalars (cases.yml) and are
parsed to one canonical Python value, so `ici_fsdp_parallelism=-1` and `-1` in YAML are the same case.

>>> s = parse_overrides({"ici_expert_parallelism": "2", "ici_fsdp_parallelism": -1})
>>> s  # canonical order: the order of data/settings.yml
(('ici_fsdp_parallelism', -1), ('ici_expert_parallelism', 2))
>>> format_value(True)
'true'

Any mesh axis a rule file declares is sized by `ici_<axis>_parallelism` / `dcn_<axis>_parallelism`
(default 1); MaxText's axes keep their own setting names (`stage` is `ici_pipeline_parallelism`):

>>> parallelism_key("ici", "stage"), parallelism_key("dcn", "replica")
('ici_pipeline_parallelism', 'dcn_replica_parallelism')
>>> parse_overrides({"ici_model_parallelism": 4, "ici_fsdp_parallelism": -1})
(('ici_fsdp_parallelism', -1), ('ici_model_parallelism', 4))
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Mapping

from sharding_dump.errors import BadInput, shown
from sharding_dump.resources import DATA_DIR, MAX_DIGITS, load_yaml, validate

# `[NAME=]package.module:function`: a factory in the user's code (a setting of type reference, or a model)
REFERENCE = re.compile(r"(?:(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)=)?(?P<module>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"
                       r":(?P<attr>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
MAX_REF = 200

SETTINGS_FILE = DATA_DIR / "settings.yml"

Value = int | float | bool | str
# The parallelism setting of a mesh axis of any name a rule file may declare.
PARALLELISM_KEY = re.compile(r"(ici|dcn)_([A-Za-z_][A-Za-z0-9_]*)_parallelism")


@dataclasses.dataclass(frozen=True)
class SettingSpec:
    """One overridable setting: its type, allowed values and default."""

    key: str
    type: str  # int | float | bool | choice | reference | parallelism
    default: Value
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on numbers users give (data/settings.yml `limits`)."""

    max_devices: int
    max_parallelism: int
    int_range: tuple[int, int]
    float_range: tuple[float, float]


@dataclasses.dataclass(frozen=True)
class ParallelismAxis:
    axis: str  # mesh axis name
    setting: str  # name inside ici_<setting>_parallelism


@functools.cache
def _registry() -> tuple[tuple[ParallelismAxis, ...], dict[str, SettingSpec], Limits]:
    """settings.yml, schema-checked, with every default checked against its own setting's bounds."""
    where = f"settings file {SETTINGS_FILE}"
    data = load_yaml(SETTINGS_FILE, "settings file")
    validate(data, "settings", where)
    raw_limits = data["limits"]
    limits = Limits(raw_limits["max_devices"], raw_limits["max_parallelism"],
                    tuple(raw_limits["int_range"]), tuple(raw_limits["float_range"]))
    axes = tuple(ParallelismAxis(a["axis"], a["setting"]) for a in data["parallelism_axes"])
    specs: dict[str, SettingSpec] = {}
    for kind in ("dcn", "ici"):
        defaults = data[f"{kind}_defaults"]
        for ax in axes:
            key = f"{kind}_{ax.setting}_parallelism"
            specs[key] = SettingSpec(
                key, "parallelism", defaults.get(ax.setting, 1),
                f"{kind.upper()} size of the '{ax.axis}' mesh axis (-1: fill with what is left)",
                minimum=-1, maximum=limits.max_parallelism)
    for key, raw in data["settings"].items():
        low, high = {"int": limits.int_range, "float": limits.float_range}.get(raw["type"], (None, None))
        choices = raw.get("choices", ())
        if isinstance(choices, str):  # a data file whose `releases` name the choices (written there once)
            choices = load_yaml(DATA_DIR / choices, "data file")["releases"]
        specs[key] = SettingSpec(
            key, raw["type"], raw["default"], raw["help"],
            tuple(choices), raw.get("minimum", low), raw.get("maximum", high))
    for key, spec in specs.items():
        try:
            _parse(spec, spec.default)
        except BadInput as err:
            raise BadInput(f"{where}: field {key}/default: {err}") from None
    return axes, specs, limits


def limits() -> Limits:
    """The bounds on device counts and parallelism sizes."""
    return _registry()[2]


def parallelism_axes() -> tuple[ParallelismAxis, ...]:
    """MaxText's mesh axes, in its mesh order, with the names their parallelism settings use."""
    return _registry()[0]


def setting_specs() -> dict[str, SettingSpec]:
    """Every known setting, in canonical order."""
    return _registry()[1]


def parallelism_key(kind: str, axis: str) -> str:
    """`ici_pipeline_parallelism` for ('ici', 'stage') (MaxText's alias), `ici_<axis>_parallelism` for
    any other axis."""
    for ax in parallelism_axes():
        if ax.axis == axis:
            return f"{kind}_{ax.setting}_parallelism"
    return f"{kind}_{axis}_parallelism"


def parallelism_axis(key: str) -> str | None:
    """The mesh axis a parallelism setting sizes (`stage` for ici_pipeline_parallelism), None when
    `key` is not one."""
    match = PARALLELISM_KEY.fullmatch(key)
    if match is None:
        return None
    for ax in parallelism_axes():
        if ax.setting == match.group(2):
            return ax.axis
    return match.group(2)


def spec_for(key: str) -> SettingSpec | None:
    """The spec of a known setting, or of the parallelism setting of a user's own mesh axis
    (default 1); None for anything else."""
    spec = setting_specs().get(key)
    if spec is None and PARALLELISM_KEY.fullmatch(key):
        kind = key.split("_", 1)[0]
        spec = SettingSpec(key, "parallelism", 1,
                           f"{kind.upper()} size of the '{parallelism_axis(key)}' mesh axis (-1: fill with what is left)",
                           minimum=-1, maximum=limits().max_parallelism)
    return spec


def _bounds(spec: SettingSpec) -> str:
    return f"[{format_value(spec.minimum)}, {format_value(spec.maximum)}]"


def _parse(spec: SettingSpec, raw: Any) -> Value:
    text = raw.strip() if isinstance(raw, str) else None
    bad = f"{spec.key}={shown(raw)}"
    if spec.type in ("int", "parallelism"):
        what = ("a parallelism is -1 (fill) or a whole number in [1, "
                f"{format_value(spec.maximum)}]") if spec.type == "parallelism" else f"must be a whole number in {_bounds(spec)}"
        if isinstance(raw, bool) or (text is not None and len(text) > MAX_DIGITS):
            raise BadInput(f"{bad}: {what}")
        try:
            value = int(text) if text is not None else raw
        except ValueError:
            raise BadInput(f"{bad}: {what}") from None
        if not isinstance(value, int) or (spec.type == "parallelism" and value != -1 and value < 1):
            raise BadInput(f"{bad}: {what}")
        if (spec.minimum is not None and value < spec.minimum) or (spec.maximum is not None and value > spec.maximum):
            raise BadInput(f"{bad}: {what}")
        return value
    if spec.type == "float":
        what = f"must be a number in {_bounds(spec)}"
        if isinstance(raw, bool) or (text is not None and len(text) > MAX_DIGITS + 10):
            raise BadInput(f"{bad}: {what}")
        try:
            value = float(text) if text is not None else float(raw)
        except (TypeError, ValueError, OverflowError):
            raise BadInput(f"{bad}: {what}") from None
        if (not math.isfinite(value) or (spec.minimum is not None and value < spec.minimum)
                or (spec.maximum is not None and value > spec.maximum)):
            raise BadInput(f"{bad}: {what}")
        return int(value) if value.is_integer() else value
    if spec.type == "bool":
        if isinstance(raw, bool):
            return raw
        if text is not None and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        raise BadInput(f"{bad}: must be true or false")
    if spec.type == "reference":
        if raw == spec.default:
            return raw
        if isinstance(raw, str) and is_reference(raw.strip()):
            return raw.strip()
        raise BadInput(f"{bad}: give package.module:function (a function of your own, importable from the "
                       "working directory)")
    if spec.type == "choice":
        if isinstance(raw, str) and raw in spec.choices:
            return raw
        raise BadInput(f"{bad}: must be one of {', '.join(spec.choices)}")
    raise BadInput(f"settings file {SETTINGS_FILE}: field {spec.key}/type: unknown type {shown(spec.type)}")


def parse_overrides(raw: Mapping[str, Any]) -> tuple[tuple[str, Value], ...]:
    """Validates and canonicalises overrides: known keys (or the parallelism of any mesh axis), typed
    values, canonical order (data/settings.yml's, then other axes' parallelism sorted by key)."""
    specs = setting_specs()
    for key in raw:
        if spec_for(key) is None:
            raise BadInput(f"unknown setting {shown(key)}: see `sharding-dump list settings` for valid keys "
                           f"(or ici_<axis>_parallelism / dcn_<axis>_parallelism for a mesh axis of the rule file)")
    order = [key for key in specs if key in raw] + sorted(key for key in raw if key not in specs)
    return tuple((key, _parse(spec_for(key), raw[key])) for key in order)


def parse_assignments(items: list[str]) -> dict[str, str]:
    """`['a=1', 'b=x']` -> `{'a': '1', 'b': 'x'}`; malformed or repeated items are BadInput."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise BadInput(f"{shown(item)}: settings are written KEY=VALUE (e.g. ici_fsdp_parallelism=-1)")
        if key in out:
            raise BadInput(f"{shown(key)} is given twice")
        out[key] = value
    return out


def format_value(value: Value) -> str:
    """The canonical text of a value, as it appears in a case's folder name."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def resolve(overrides: tuple[tuple[str, Value], ...], *layers: Mapping[str, Value]) -> dict[str, Value]:
    """Every setting's effective value: defaults, then each layer in turn, then the overrides. The
    parallelism of a user's own mesh axis is present only when set (read it with :func:`value_of`)."""
    values: dict[str, Value] = {k: s.default for k, s in setting_specs().items()}
    for layer in layers:
        values.update(layer)
    values.update(dict(overrides))
    return values


def value_of(values: Mapping[str, Value], key: str) -> Value:
    """A setting's effective value in `values` (from :func:`resolve`), its default when unset."""
    if key in values:
        return values[key]
    spec = spec_for(key)
    if spec is None:
        raise KeyError(key)
    return spec.default


def is_reference(text: str) -> bool:
    """True for a well-formed `package.module:function` reference (at most MAX_REF characters, no
    NAME= in front: that names a model's golden folder only)."""
    match = REFERENCE.fullmatch(text) if len(text) <= MAX_REF else None
    return match is not None and not match["name"]
