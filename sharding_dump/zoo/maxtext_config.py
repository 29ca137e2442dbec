"""A MaxText run configuration as a case: `sharding-dump --maxtext-config my_run.yml --topology v5p-16`.

The configuration is composed as MaxText's pyconfig composes it (MaxText e591f30), with OmegaConf as
MaxText does (its YAML reading, `OmegaConf.merge`, `OmegaConf.from_cli`); every file and value is
first read through the package's YAML limits (size, nesting, no aliases, no duplicate keys):

1. the file given, and the `base_config` it names, recursively (a relative name is looked up next to
   the file, then in MaxText's configs folder), each merged over its base;
2. KEY=VALUE from the command line (each VALUE read as YAML, `a.b=1` sets a nested key);
3. the model config `models/<model_name>.yml` (without `-Instruct`), looked up next to the given file,
   then one folder up, then in MaxText's configs folder. It overrides the files, and the command
   line overrides it; a key set in both with different values is refused unless
   `override_model_config=true` (then the command line wins);
4. `logical_axis_rules` are merged rather than replaced: the model config's and the command line's
   rules replace the base rules of the same logical name (all of them with
   `override_logical_axis_rules=true`);
5. environment variables `M_<KEY>` override the result, as in MaxText.

MaxText's configs folder is `$MAXTEXT_CONFIGS_DIR` (MaxText's own variable), else the `configs`
folder of an installed `maxtext` package; without either, only files next to the given one are found.

Every key of the result is then looked up in `data/maxtext_keys.yml`: honoured (the case's settings,
topology, rule and model card), refused unless at the value the zoo builds (one line naming the key
and why), or ignored as layout-neutral. A key the list does not know is refused, never ignored. The
case is the one `--model <model_name> --rule <custom_mesh_and_rule or default>` names, with every
honoured setting that differs from its default, so its golden is that case's golden.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from sharding_dump.core.specs import entry_axes
from sharding_dump.errors import BadInput, one_line, shown
from sharding_dump.resources import DATA_DIR, YAML_MAX_BYTES, load_yaml, parse_yaml, read_text, validate
from sharding_dump.zoo import releases

if TYPE_CHECKING:  # imported when a case is made: composing a configuration needs neither jax nor flax
    from omegaconf import DictConfig

    from sharding_dump.models.config import ModelConfig
    from sharding_dump.zoo.case import Case
    from sharding_dump.zoo.rules import RuleSet

KEYS_FILE = DATA_DIR / "maxtext_keys.yml"
BASE_CONFIG = "base_config"
COMMAND_LINE = "the command line"
ENV_PREFIX = "M_"  # MaxText's environment override of a key: M_<KEY upper-cased>
DEFAULT_RULE = "default"  # MaxText's base rules (an empty custom_mesh_and_rule)
INSTRUCT = "-Instruct"  # MaxText builds `<model>-Instruct` from `<model>`'s config
MAX_CHAIN = 32  # base_config files one configuration may chain through
_TRUE, _FALSE = ("y", "yes", "t", "true", "1"), ("n", "no", "f", "false", "0")  # MaxText's str2bool


# --- the key table ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Refusal:
    """A layout-relevant key the zoo does not build: refused unless at `supported` (or `same_as`'s value)."""

    supported: Any
    why: str
    same_as: str | None = None
    moe: bool = False  # only checked when the card's model routes tokens to experts


@dataclasses.dataclass(frozen=True)
class ModelKey:
    """A key of the model's architecture, honoured through the card (see data/maxtext_keys.yml)."""

    field: str
    neutral: Any = None
    has_neutral: bool = False
    count: bool = False
    blocks: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class KeyTable:
    """data/maxtext_keys.yml: the class of every known key."""

    commit: str
    kind: dict[str, str]  # key -> compose | settings | topology | rule | model | refuse | ignore
    model: dict[str, ModelKey]
    refuse: dict[str, Refusal]
    ignore_why: dict[str, str]
    compiled: dict[str, tuple[Any, bool]]  # key -> (the zoo's traced value, only for models with experts)


@functools.cache
def key_table() -> KeyTable:
    """The key table, schema-checked; a key listed twice is an error in the package's data."""
    where = f"MaxText keys file {KEYS_FILE}"
    data = load_yaml(KEYS_FILE, "MaxText keys file")
    validate(data, "maxtext-keys", where)
    kind: dict[str, str] = {}

    def add(key: str, what: str) -> None:
        if key in kind:
            raise BadInput(f"{where}: key {key} is listed twice ({kind[key]} and {what})")
        kind[key] = what

    for what in ("compose", "settings", "topology", "rule"):
        for key in data[what]:
            add(key, what)
    model = {}
    for key, spec in data["model"].items():
        add(key, "model")
        model[key] = ModelKey(spec.get("field", key), spec.get("neutral"), "neutral" in spec,
                              spec.get("count", False), tuple(sorted(spec.get("blocks", {}).items())))
    refuse = {}
    for group in data["refuse"]:
        for key, spec in group["keys"].items():
            add(key, "refuse")
            spec = spec if isinstance(spec, dict) else {"supported": spec}
            refuse[key] = Refusal(spec["supported"], group["why"], spec.get("same_as"), spec.get("moe", False))
    ignore_why = {}
    for group in data["ignore"]:
        for key in group["keys"]:
            add(key, "ignore")
            ignore_why[key] = group["why"]
    for key in data["compiled"]:
        if kind.get(key) != "ignore":
            raise BadInput(f"{where}: field compiled/{key}: only a layout-neutral (ignore) key may be listed")
    compiled = {key: (spec["value"], spec.get("moe", False)) if isinstance(spec, dict) else (spec, False)
                for key, spec in data["compiled"].items()}
    return KeyTable(data["maxtext_commit"], kind, model, refuse, ignore_why, compiled)


# --- composing the configuration as MaxText does ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Composed:
    """A composed MaxText configuration: every key's value and where it was set last."""

    values: dict[str, Any]
    origins: dict[str, str]
    model_config: Path | None  # the models/<model_name>.yml read, None when none was found
    explicit: frozenset[str] = frozenset()  # keys given as overrides or by the environment (MaxText's explicit keys)

    def where(self, key: str) -> str:
        """`my_run.yml: key` or `the command line: key`, for a message about `key`."""
        return f"{self.origins.get(key, 'MaxText configuration')}: {key}"


def maxtext_configs_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """MaxText's configs folder: $MAXTEXT_CONFIGS_DIR, else that of an installed `maxtext` package
    (found without importing it), else None."""
    environ = os.environ if environ is None else environ
    if environ.get("MAXTEXT_CONFIGS_DIR"):
        return Path(environ["MAXTEXT_CONFIGS_DIR"])
    try:
        spec = importlib.util.find_spec("maxtext")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / "configs" / "base.yml").is_file():
            return Path(location) / "configs"
    return None


def _display(path: Path) -> str:
    from sharding_dump.golden.engine import display

    return display(path)


@functools.lru_cache(maxsize=64)
def _omegaconf(text: str, where: str) -> DictConfig:
    """YAML text as OmegaConf reads it (MaxText's reader: 1e-5 is a float, where YAML 1.1 reads a
    string), after the package's strict reader has held it to its limits; BadInput naming `where`.
    Cached by text: base.yml is read for every composition, and nothing here changes a read config in
    place (`OmegaConf.merge` copies what it merges into)."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    data = parse_yaml(text, f"{where}:")  # size, nesting, aliases, duplicate keys: refused here first
    if data is None:
        return OmegaConf.create({})
    if not isinstance(data, dict):
        raise BadInput(f"{where}: holds a {type(data).__name__}, not a mapping of MaxText keys")
    try:
        config = OmegaConf.create(text)
    except (OmegaConfBaseException, ValueError) as err:
        raise BadInput(f"{where}: {one_line(str(err))}") from None
    assert isinstance(config, DictConfig)
    return config


def _read(path: Path, what: str) -> DictConfig:
    return _omegaconf(read_text(path, what, YAML_MAX_BYTES), f"{what} {path}")


def _merge(*configs: DictConfig | Mapping[str, Any]) -> DictConfig:
    """OmegaConf.merge, as MaxText merges: mappings key by key, anything else replaced; BadInput on
    what OmegaConf refuses."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.merge(*configs)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise BadInput(f"MaxText configuration: {one_line(str(err))}") from None


def _plain(config: DictConfig) -> dict[str, Any]:
    """A configuration as plain values, interpolations resolved (MaxText's to_container(resolve=True))."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise BadInput(f"MaxText configuration: {one_line(str(err))}") from None


# Merged base_config chains by the texts of their files (base first): every composition of a run file
# merges the same base.yml under it (a third of a composition's time). Never changed in place:
# `OmegaConf.merge` copies the config it merges into.
_CHAINS: dict[tuple[str, ...], DictConfig] = {}
# The same chains as plain values: what the keys a composition does not set hold (see _overlaid).
_PLAIN_CHAINS: dict[tuple[str, ...], dict[str, Any]] = {}
_MAX_CHAINS = 64


def _bounded_put(cache: dict[tuple[str, ...], Any], key: tuple[str, ...], value: Any) -> Any:
    if len(cache) >= _MAX_CHAINS:
        cache.clear()
    cache[key] = value
    return value


def _overlaid(files: DictConfig, texts: tuple[str, ...], *overlays: DictConfig) -> dict[str, Any]:
    """`_plain(_merge(files, *overlays))`, the chain's plain values read once per chain: a merge copies
    the whole chain (base.yml's 800 keys, 40 ms a merge), yet changes only the top-level keys the
    overlays set, so only those are merged. An interpolation (`${...}`) in a file of the chain may name
    any of its keys: then the whole chain is merged. (One in an overlay names a key of its own layer:
    each layer is read alone first, by :func:`_plain`.)

    >>> from omegaconf import OmegaConf
    >>> chain = OmegaConf.create({"a": {"x": 1, "y": 2}, "b": [1], "c": 3})
    >>> _overlaid(chain, ("key of this example",), OmegaConf.create({"a": {"y": 5}, "d": 4}))
    {'a': {'x': 1, 'y': 5}, 'b': [1], 'c': 3, 'd': 4}
    """
    from omegaconf import OmegaConf

    if any("${" in text for text in texts):
        return _plain(_merge(files, *overlays))
    keys = {key for overlay in overlays for key in overlay}
    values = copy.deepcopy(_chain_values(files, texts))  # the cached chain is never handed out
    values.update(_plain(_merge(OmegaConf.masked_copy(files, list(keys)), *overlays)))
    return values


def _chain_values(files: DictConfig, texts: tuple[str, ...]) -> dict[str, Any]:
    """The chain's plain values, read once per chain (shared: never changed in place)."""
    plain = _PLAIN_CHAINS.get(texts)
    return _bounded_put(_PLAIN_CHAINS, texts, _plain(files)) if plain is None else plain


def _chain(path: Path, configs_dir: Path | None, origins: dict[str, str], seen: tuple[Path, ...]
           ) -> tuple[DictConfig, tuple[str, ...]]:
    """A config file merged over the `base_config` it names, recursively (MaxText's _load_config), and the
    texts of the chain's files, base first (the cache key of the merge and of its plain values)."""
    if path.resolve() in seen:
        raise BadInput(f"MaxText config {path}: base_config chain loops back to it "
                       f"({' -> '.join(_display(p) for p in (*seen, path.resolve()))})")
    if len(seen) >= MAX_CHAIN:
        raise BadInput(f"MaxText config {path}: more than {MAX_CHAIN} files chained by base_config")
    text = read_text(path, "MaxText config", YAML_MAX_BYTES)
    data = _omegaconf(text, f"MaxText config {path}")
    base = data.get(BASE_CONFIG)
    if base is None:
        merged, texts = data, (text,)
    else:
        if not isinstance(base, str) or not base:
            raise BadInput(f"MaxText config {path}: field {BASE_CONFIG}: {shown(base)} is not a file name")
        candidates = [Path(base)] if os.path.isabs(base) else [path.parent / base] + (
            [configs_dir / base] if configs_dir is not None else [])
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise BadInput(f"MaxText config {path}: field {BASE_CONFIG}: {shown(base)} is not next to it"
                           + ("" if os.path.isabs(base) else
                              f" nor in MaxText's configs folder ({configs_dir})" if configs_dir else
                              " and MaxText's configs folder is unknown (set MAXTEXT_CONFIGS_DIR or install maxtext)"))
        below, texts = _chain(found, configs_dir, origins, (*seen, path.resolve()))
        texts = (*texts, text)
        merged = _CHAINS.get(texts)
        if merged is None:
            merged = _bounded_put(_CHAINS, texts, _merge(below, data))
    origins.update(dict.fromkeys(data, _display(path)))
    return merged, texts


def parse_command_line(items: Sequence[str] | Mapping[str, Any], source: str = COMMAND_LINE) -> DictConfig:
    """KEY=VALUE items read by OmegaConf.from_cli, as MaxText reads its command line: VALUE is YAML
    (`[a, b]` is a list, `1e-5` a float), `a.b=1` sets key b inside a. Each VALUE is first held to the
    package's YAML limits, and a key given twice is refused (from_cli would keep the last). A mapping
    (a case file's overrides) holds values already: they are read again as OmegaConf reads YAML.

    >>> from omegaconf import OmegaConf
    >>> OmegaConf.to_container(parse_command_line(["sa_block_q=256", "mlp_activations=[gelu, linear]", "a.b=1e-5"]))
    {'sa_block_q': 256, 'mlp_activations': ['gelu', 'linear'], 'a': {'b': 1e-05}}
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(items, Mapping):
        import yaml

        return _omegaconf(yaml.safe_dump(dict(items)), source) if items else OmegaConf.create({})
    seen: set[str] = set()
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise BadInput(f"{shown(item)}: MaxText settings are written KEY=VALUE (e.g. sa_block_q=256)")
        if text:
            parse_yaml(text, f"{source}: {key}={shown(text)}:")
        if not all(key.split(".")):
            raise BadInput(f"{shown(item)}: KEY is a MaxText key, or keys joined by '.'")
        if key in seen:
            raise BadInput(f"{source}: {shown(key.rpartition('.')[2])} is given twice")
        clash = next((k for k in seen if k.startswith(key + ".") or key.startswith(k + ".")), None)
        if clash is not None:
            outer = min(key, clash, key=len)
            raise BadInput(f"{shown(item)}: {outer.rpartition('.')[2]} is given a value and keys inside it")
        seen.add(key)
    try:
        return OmegaConf.from_cli(list(items))
    except OmegaConfBaseException as err:
        raise BadInput(f"{source}: {one_line(str(err))}") from None


def _model_file(config_path: Path, model_name: str, configs_dir: Path | None) -> Path | None:
    """MaxText's lookup of models/<model_name>.yml: next to the config given, one folder up, then in
    its configs folder."""
    folders = [config_path.parent / "models", config_path.parent.parent / "models"]
    if configs_dir is not None:
        folders.append(configs_dir / "models")
    return next((f / f"{model_name}.yml" for f in folders if (f / f"{model_name}.yml").is_file()), None)


def _merge_rules(base: list, new: list) -> list:
    """MaxText's _merge_logical_axis_rules: `new` replaces every base rule of the same logical name."""
    if not new:
        return base
    names = {rule[0] for rule in new}
    return [rule for rule in base if rule[0] not in names] + list(new)


def _str2bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def model_name_of(values: Mapping[str, Any]) -> str:
    """The model a configuration builds: `model_name` without MaxText's `-Instruct` suffix."""
    name = values.get("model_name", "default")
    name = name if isinstance(name, str) else str(name)
    return name.replace(INSTRUCT, "")


def compose(config_path: str | Path, command_line: Sequence[str] | Mapping[str, Any] = (),
            environ: Mapping[str, str] | None = None, source: str = COMMAND_LINE) -> Composed:
    """The configuration MaxText's pyconfig builds from `config_path`, KEY=VALUE items (or a mapping of
    overrides, from `source`) and `M_<KEY>` environment variables (see the module docstring); BadInput
    on anything MaxText would refuse."""
    environ = os.environ if environ is None else environ
    config_path = Path(config_path)
    configs_dir = maxtext_configs_dir(environ)
    origins: dict[str, str] = {}
    files, texts = _chain(config_path, configs_dir, origins, ())  # the file over its base_config chain
    cli_config = parse_command_line(command_line, source)
    cli = _plain(cli_config)
    head = _overlaid(files, texts, cli_config)  # the files under the command line, before the model config
    name = model_name_of(head)
    model_config = None
    model: dict[str, Any] = {}
    model_path = _model_file(config_path, name, configs_dir) if name != "default" else None
    if model_path is not None:
        model_config = _read(model_path, "MaxText model config")
        model = _plain(model_config)
        if head.get("override_model_config"):
            model = {k: v for k, v in model.items() if k not in cli}
            model_config = _merge(model)
        else:
            twice = sorted(k for k in model if k in cli and cli[k] != model[k])
            if twice:
                raise BadInput(f"{', '.join(twice)}: set by the model config {_display(model_path)} and by "
                               f"{source} with different values; MaxText refuses this unless "
                               f"override_model_config=true")
        origins.update(dict.fromkeys(model, f"model config {_display(model_path)}"))
    origins.update({key: source for key in cli})
    base_rules = copy.deepcopy(_chain_values(files, texts).get("logical_axis_rules") or [])
    rules = _merge_rules(base_rules, model.get("logical_axis_rules") or [])
    if model.get("override_logical_axis_rules"):
        rules = model.get("logical_axis_rules") or []
    rules = (cli.get("logical_axis_rules") or [] if cli.get("override_logical_axis_rules") else
             _merge_rules(rules, cli.get("logical_axis_rules") or []))
    overlays = ([model_config] if model_config is not None else []) + [cli_config]
    values = _overlaid(files, texts, *overlays)
    if "logical_axis_rules" in values:
        values["logical_axis_rules"] = rules
    explicit = set(cli)
    for key in list(values):
        env_key = ENV_PREFIX + key.upper()
        if env_key not in environ:
            continue
        if key in cli:
            raise BadInput(f"{key}: set by {source} and by the environment variable {env_key}; "
                           f"MaxText refuses this")
        if key in model and not values.get("override_model_config"):
            raise BadInput(f"{key}: set by the model config {_display(model_path)} and by the environment "
                           f"variable {env_key}; MaxText refuses this unless override_model_config=true")
        original, text = values[key], environ[env_key]
        if not isinstance(original, (bool, str, int, float)):
            raise BadInput(f"environment variable {env_key}: {key} holds a {type(original).__name__}, which "
                           f"MaxText does not set from the environment")
        try:
            values[key] = _str2bool(text) if isinstance(original, bool) else type(original)(text)
        except ValueError:
            raise BadInput(f"environment variable {env_key}={shown(text)}: not a {type(original).__name__}, "
                           f"the type of {key}") from None
        origins[key] = f"environment variable {env_key}"
        explicit.add(key)
    return Composed(values, origins, model_path, frozenset(explicit))


# --- the composed configuration as a case ----------------------------------------------------------

def _norm(value: Any) -> Any:
    """A value as MaxText's pydantic layer reads it: the string 'none' (any case) is None, tuples are lists."""
    if isinstance(value, str) and value.lower() == "none":
        return None
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value


def same(a: Any, b: Any) -> bool:
    """Equal as configuration values: 1 == 1.0, but True is not 1 and lists compare item by item.

    >>> same(1, 1.0), same(True, 1), same(["a"], ("a",)), same("None", None)
    (True, False, True, True)
    """
    a, b = _norm(a), _norm(b)
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _text(value: Any) -> str:
    from sharding_dump.zoo.settings import format_value

    value = _norm(value)
    if isinstance(value, list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if value is None:
        return "null"
    return shown(value) if isinstance(value, str) else format_value(value)


def _refused(problems: list[tuple[str, str]]) -> None:
    """The first (key, message) problem as one line, the other keys named after it."""
    if problems:
        more = f" (and {len(problems) - 1} more: {', '.join(key for key, _ in problems[1:])})" \
            if len(problems) > 1 else ""
        raise BadInput(problems[0][1] + more)


def _check_known(composed: Composed, table: KeyTable, release: releases.Release) -> None:
    unknown = [key for key in composed.values if key not in table.kind]
    _refused([(key, f"{composed.where(key)}: not a MaxText key that sharding-dump knows ({_display(KEYS_FILE)} lists "
              f"MaxText {table.commit}'s and those of the releases in {_display(releases.RELEASES_FILE)}): a key it "
              f"does not know could move a layout, so it is refused, not ignored") for key in unknown])
    others = [key for key in composed.values if key not in releases.keys_of(release.version, set(table.kind))]
    _refused([(key, f"{composed.where(key)}: not a key of MaxText {release.version}, whose keys the rest of the "
              f"configuration has ({_display(releases.RELEASES_FILE)})") for key in others])


def release_of(composed: Composed, table: KeyTable) -> releases.Release:
    """The MaxText release whose base.yml the configuration composes: the one whose keys hold every known
    key of it (a key only a later release has, or one it removed, tells them apart; when the keys fit
    several, the `maxtext_version` default). A configuration mixing two releases' keys is refused."""
    from sharding_dump.zoo import settings

    known = {key for key in composed.values if key in table.kind}
    fits = [rel for rel in releases.releases().values() if known <= releases.keys_of(rel.version, set(table.kind))]
    if not fits:
        marks = {rel.version: sorted(known & set(rel.keys_added) or known & set(rel.keys_removed))[:1]
                 for rel in releases.releases().values() if known & set(rel.keys_added + rel.keys_removed)}
        raise BadInput(f"the MaxText configuration mixes keys of different releases "
                       f"({'; '.join(f'{v}: {k[0]}' for v, k in marks.items() if k)}); compose it from one "
                       f"release's base.yml ({_display(releases.RELEASES_FILE)})")
    default = str(settings.value_of({}, releases.SETTING))
    return next((rel for rel in fits if rel.version == default), fits[-1])


def _zoo_value(config: ModelConfig, field: str) -> Any:
    """What the card's model builds for a card field (head_dim: the resolved head width)."""
    if field == "head_dim":
        return config.resolved_head_dim
    return getattr(config, field)


def _check_model(composed: Composed, table: KeyTable, card: str, config: ModelConfig) -> None:
    from sharding_dump.models.config import keeps_default
    from sharding_dump.zoo.cards import honoured_fields

    honoured = honoured_fields(config.decoder_block)
    problems = []
    for key, spec in table.model.items():
        if key not in composed.values:
            continue
        value = composed.values[key]
        by_block = dict(spec.blocks)
        if config.decoder_block in by_block:
            expected, source = by_block[config.decoder_block], f"decoder block '{config.decoder_block}' builds"
        elif spec.field in honoured:
            expected, source = _zoo_value(config, spec.field), f"model card {card} has {spec.field}"
            if spec.has_neutral and same(value, spec.neutral) and keeps_default(config, spec.field):
                continue  # the card leaves the feature off, as MaxText's neutral value does (gemma4-31b: no MoE)
        elif spec.has_neutral:
            expected = spec.neutral
            source = f"decoder block '{config.decoder_block}' of model card {card} does not build it: it builds"
        else:  # only a field every block reads has no neutral value (tests/zoo/test_maxtext_config.py)
            raise BadInput(f"MaxText keys file {KEYS_FILE}: field model/{key}: decoder block "
                           f"'{config.decoder_block}' does not read {spec.field}, and the key has no neutral value")
        if spec.count:
            matches = isinstance(_norm(value), list) and len(value) == len(expected)
        else:
            matches = same(value, list(expected) if isinstance(expected, tuple) else expected)
        if not matches:
            problems.append((key, f"{composed.where(key)}: {_text(value)}: {source} {_text(expected)}"
                             + (" items" if spec.count else "") + "; the zoo builds the card's model (a card of "
                             "your own, in card-dirs of [tool.sharding-dump], describes another)"))
    _refused(problems)


def _check_refused(composed: Composed, table: KeyTable, config: ModelConfig) -> None:
    problems = []
    for key, refusal in table.refuse.items():
        if key not in composed.values or (refusal.moe and not config.num_experts):
            continue
        value = composed.values[key]
        if same(value, refusal.supported) or (
                refusal.same_as is not None and same(value, composed.values.get(refusal.same_as, value))):
            continue
        also = f" or {refusal.same_as}'s value" if refusal.same_as else ""
        problems.append((key, f"{composed.where(key)}: {_text(value)} is not supported: {refusal.why} "
                              f"(the zoo builds {key}={_text(refusal.supported)}{also})"))
    _refused(problems)


def _mesh_axes_of(axes: Any, mesh: Sequence[str]) -> tuple[str, ...]:
    """A rule's mesh axes that the mesh has (an axis it lacks can split nothing)."""
    return tuple(a for a in entry_axes(_norm(axes)) if a in mesh)


def _effective_rules(rules: Iterable[Sequence[Any]], mesh: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    return [(rule[0], _mesh_axes_of(rule[1], mesh)) for rule in rules]


def _first_difference(ours: list, theirs: list) -> str:
    def text(rule: tuple[str, tuple[str, ...]]) -> str:
        return f"[{rule[0]}, [{', '.join(rule[1])}]]"

    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"entry {index}: {text(a)} here, {text(b)} in the rule"
    return f"{len(ours)} entries here, {len(theirs)} in the rule"


def _check_rule(composed: Composed, rule_set: RuleSet, configs_dir: Path | None, card: str) -> None:
    """The composed mesh_axes, data_sharding, logical_axis_rules, input axes and context axis must be
    those of the case's rule (a custom_mesh_and_rule replaces the first three, as in MaxText)."""
    values = dict(composed.values)
    where = dict(composed.origins)
    custom = values.get("custom_mesh_and_rule") or ""
    if custom:
        mesh_file = configs_dir / "custom_mesh_and_rule" / f"{custom}.yml" if configs_dir else None
        if mesh_file is not None and mesh_file.is_file():
            data = _plain(_read(mesh_file, "MaxText custom_mesh_and_rule file"))
            for key in ("mesh_axes", "logical_axis_rules", "data_sharding"):
                if key in data:
                    values[key] = data[key]
                    where[key] = _display(mesh_file)
        else:  # MaxText's own file is not at hand: the zoo's rule of that name stands for it
            values.update(mesh_axes=list(rule_set.mesh_axes), data_sharding=[list(rule_set.data_sharding)],
                          logical_axis_rules=[[n, a] for n, a in rule_set.logical_axis_rules])
        length = next((rule[1] for rule in values["logical_axis_rules"] if rule[0] == "activation_length"), None)
        if length is not None and entry_axes(_norm(length)):
            values["context_sharding"] = entry_axes(_norm(length))[0]
    mesh = rule_set.mesh_axes
    label = f"rule '{rule_set.name}'" + (f" with model card {card}'s rules" if rule_set.name == DEFAULT_RULE else "")

    def differs(key: str, detail: str) -> None:
        raise BadInput(f"{where.get(key, 'MaxText configuration')}: {key}: differs from {label} ({detail}); the "
                       f"zoo dumps rule files: write these mesh_axes, data_sharding and logical_axis_rules to one and "
                       f"dump it with --model {card} --rule FILE")

    if "mesh_axes" in values and tuple(values["mesh_axes"]) != mesh:
        differs("mesh_axes", f"[{', '.join(map(str, values['mesh_axes']))}] here, [{', '.join(mesh)}] in the rule")
    if "data_sharding" in values:
        data = values["data_sharding"]
        data = [data] if data and isinstance(data[0], str) else data
        if [_mesh_axes_of(d, mesh) for d in data] != [_mesh_axes_of(rule_set.data_sharding, mesh)]:
            differs("data_sharding", f"{data} here, {[list(rule_set.data_sharding)]} in the rule")
    if "logical_axis_rules" in values:
        ours = _effective_rules(values["logical_axis_rules"], mesh)
        theirs = _effective_rules(rule_set.logical_axis_rules, mesh)
        if ours != theirs:
            differs("logical_axis_rules", _first_difference(ours, theirs))
    if "input_data_sharding_logical_axes" in values and \
            tuple(values["input_data_sharding_logical_axes"]) != rule_set.input_data_sharding_logical_axes:
        differs("input_data_sharding_logical_axes",
                f"{values['input_data_sharding_logical_axes']} here, "
                f"{list(rule_set.input_data_sharding_logical_axes)} in the rule")
    if "context_sharding" in values:
        context = values["context_sharding"] if values["context_sharding"] in mesh else None
        if context != rule_set.context_sharding:
            differs("context_sharding", f"{_text(context)} here, {_text(rule_set.context_sharding)} in the rule")


def _settings(composed: Composed, table: KeyTable) -> dict[str, Any]:
    """The case's overrides: the honoured settings whose value differs from the zoo's default, and those
    given on the command line or by the environment (MaxText's explicit keys, which its own sharding
    dumps name their folders by) even at the default."""
    from sharding_dump.zoo import settings

    out = {}
    # MaxText's sharding dump leaves its build keys out of the folder name (tests/utils/sharding_dump.py)
    unnamed = {key for rel in releases.releases().values() for key in rel.nnx_keys}
    for key in (k for k, kind in table.kind.items() if kind == "settings"):
        if key not in composed.values:
            continue
        try:
            ((_, value),) = settings.parse_overrides({key: composed.values[key]})
        except BadInput as err:
            raise BadInput(f"{composed.origins.get(key, 'MaxText configuration')}: {err}") from None
        if (key in composed.explicit and key not in unnamed) or not same(value, settings.value_of({}, key)):
            out[key] = value
    return out


def _topology(composed: Composed, topology: str | None, num_slices: int | None) -> tuple[str, int]:
    """--topology / --num-slices, or MaxText's compile_topology / compile_topology_num_slices (num_slices)."""
    values = composed.values
    compiled = values.get("compile_topology") or None
    if compiled is not None and not isinstance(compiled, str):
        raise BadInput(f"{composed.where('compile_topology')}: {shown(compiled)} is not a topology name (e.g. v5p-16)")
    if topology and compiled and topology != compiled:
        raise BadInput(f"--topology {topology}: {composed.where('compile_topology')} is {shown(compiled)}; "
                       f"give one or the same")
    topology = topology or compiled
    if not topology:
        raise BadInput("missing --topology (or compile_topology in the MaxText config)")
    slices = next((int(values[k]) for k in ("compile_topology_num_slices", "num_slices")
                   if isinstance(values.get(k), int) and not isinstance(values.get(k), bool) and values[k] > 0),
                  None)
    if num_slices is not None and slices is not None and num_slices != slices:
        raise BadInput(f"--num-slices {num_slices}: the MaxText config gives {slices} slices "
                       f"(compile_topology_num_slices / num_slices); give one or the same")
    return topology, num_slices if num_slices is not None else slices or 1


@dataclasses.dataclass(frozen=True)
class MaxTextCase:
    """The case a MaxText configuration is, and what `verify` compiles otherwise than it asks."""

    case: Case
    compiled_notes: tuple[str, ...]


Resolve = Callable[[str, str], str]  # (field, name) -> the model or rule reference a case takes


def to_case(composed: Composed, topology: str | None = None, num_slices: int | None = None,
            resolve: Resolve | None = None, environ: Mapping[str, str] | None = None) -> MaxTextCase:
    """The case of a composed configuration, every key checked (BadInput on the first refused one).
    `resolve(field, name)` maps model and rule names (a project's card and rule folders)."""
    from sharding_dump.zoo import cards, rules, settings
    from sharding_dump.zoo.case import Case

    resolve = resolve or (lambda field, ref: ref)
    table = key_table()
    release = release_of(composed, table)
    _check_known(composed, table, release)
    name = model_name_of(composed.values)
    if name == "default":
        raise BadInput(f"{composed.where('model_name')}: {shown(composed.values.get('model_name', 'default'))}: "
                       f"MaxText's base model has no card; set model_name to a model card "
                       f"(sharding-dump list models)")
    missing = releases.missing_model(name)
    if missing is not None:
        raise BadInput(f"{composed.where('model_name')}: {missing}")
    model_ref = resolve("model", name)
    try:
        card, _ = cards.resolve_model(model_ref)
        config = cards.load_config(model_ref, **release.model)
    except BadInput as err:
        raise BadInput(f"{composed.where('model_name')}: {err}") from None
    where = f"{composed.origins.get('model_name', COMMAND_LINE)}: "
    releases.check_build(release, releases.nnx_build({releases.SETTING: release.version,
                                                      **{k: composed.values[k] for k in release.nnx_keys
                                                         if k in composed.values}}),
                         composed.values.get("shard_optimizer_over_data") is True, config.decoder_block,
                         _parallelism(composed.values, "tensor"), where,
                         _parallelism(composed.values, "pipeline"))
    _check_refused(composed, table, config)
    _check_model(composed, table, card, config)
    rule_ref = resolve("rule", composed.values.get("custom_mesh_and_rule") or DEFAULT_RULE)
    try:
        rule_set = rules.load_rule(rule_ref, release.rules_dir)
    except BadInput as err:
        raise BadInput(f"{composed.where('custom_mesh_and_rule')}: {err}") from None
    rule_set = rules.with_overrides(rule_set, config.logical_axis_rules)
    _check_rule(composed, rule_set, maxtext_configs_dir(environ), card)
    overrides = _settings(composed, table)
    if release.version != settings.value_of({}, releases.SETTING):
        overrides[releases.SETTING] = release.version
    topology, num_slices = _topology(composed, topology, num_slices)
    notes = tuple(f"{composed.where(key)}: {_text(composed.values[key])}: verify compiles the zoo's step with "
                  f"{key}={_text(value)}, so its memory and collectives are not those of this value"
                  for key, (value, moe) in table.compiled.items()
                  if key in composed.values and not same(composed.values[key], value)
                  and (config.num_experts or not moe))
    return MaxTextCase(Case.make(model_ref, topology, rule_ref, num_slices, overrides, project=False), notes)


# MaxText keys that name what a `--model` case names otherwise (by kind of data/maxtext_keys.yml).
CASE_KEYS = {
    "compose": "composes a MaxText configuration: give the configuration with --maxtext-config",
    "topology": "the topology and slices of a --model case are --topology and --num-slices",
    "rule": "the rules of a --model case are its --rule file (or take them from a MaxText configuration with "
            "--maxtext-config)",
    "model": "a hyperparameter of the model: a --model case builds its card's (write a card, or take the model "
             "from a MaxText configuration with --maxtext-config)",
}


def _parallelism(values: Mapping[str, Any], axis: str) -> int:
    """An axis's size as the ici_/dcn_<axis>_parallelism values give it (a fill, -1, counts as 1)."""
    size = 1
    for key in (f"ici_{axis}_parallelism", f"dcn_{axis}_parallelism"):
        value = values.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            size *= value
    return size


def layout_neutral(assignments: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """KEY=VALUE of a `--model` case split into the zoo's settings and MaxText keys that move no layout
    (`ignore` in data/maxtext_keys.yml: `attention=dot_product`, `sa_block_q=256`, ...), which the case
    takes as MaxText does and drops, as they change none of its documents; any other MaxText key is refused
    saying why. Also one note for each that `verify` compiles otherwise (the `compiled` keys). The settings
    kept are the case's: Case.make checks their values, and setup_case the build they ask for (the
    release's cases its NNX build places otherwise), with the mesh as the rule file sizes it."""
    from sharding_dump.zoo import settings

    table = key_table()
    release = releases.release(assignments.get(releases.SETTING, str(settings.value_of({}, releases.SETTING))))
    keys = releases.keys_of(release.version, set(table.kind))
    problems = []
    for key, value in assignments.items():
        kind = table.kind.get(key)
        if kind is None:
            continue  # unknown: the settings say
        if key not in keys:
            problems.append((key, f"{key}={value}: not a key of MaxText {release.version} ({releases.SETTING}="
                                  f"{release.version}; {_display(releases.RELEASES_FILE)})"))
        elif kind == "settings":
            continue  # a setting of the zoo's
        elif kind in CASE_KEYS:
            problems.append((key, f"{key}={value}: {CASE_KEYS[kind]}"))
        elif kind == "refuse" and not same(parse_command_line([f"{key}={value}"])[key], table.refuse[key].supported):
            refusal = table.refuse[key]
            problems.append((key, f"{key}={value}: not supported: {refusal.why} (the zoo builds "
                                  f"{key}={_text(refusal.supported)})"))
    _refused(problems)
    kept = {k: v for k, v in assignments.items() if table.kind.get(k) not in ("ignore", "refuse")}
    notes = [f"{key}={value}: verify compiles the zoo's step with {key}={_text(table.compiled[key][0])}, so its "
             f"memory and collectives are not those of this value"
             for key, value in assignments.items() if key in table.compiled and key not in kept
             and not same(parse_command_line([f"{key}={value}"])[key], table.compiled[key][0])]
    return kept, notes


def read_case(config_path: str | Path, command_line: Sequence[str] | Mapping[str, Any] = (),
              topology: str | None = None, num_slices: int | None = None, resolve: Resolve | None = None,
              environ: Mapping[str, str] | None = None, source: str = COMMAND_LINE) -> MaxTextCase:
    """`sharding-dump --maxtext-config FILE [--topology T] [KEY=VALUE ...]`: compose, check, make the case."""
    return to_case(compose(config_path, command_line, environ, source), topology, num_slices, resolve, environ)
