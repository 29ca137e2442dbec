"""Where the package's data files live, and how they are read.

Every YAML file goes through :func:`load_yaml` (a safe loader, errors as one-line BadInput naming the
file); every JSON Schema through :func:`schema_validator` (jsonschema, the schemas' own draft 2020-12,
`$ref` between them resolved by their `$id`).
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from sharding_dump.errors import BadInput, os_error, shown

if TYPE_CHECKING:  # jsonschema is imported when a validator is first asked for
    import jsonschema
    import referencing

PACKAGE_DIR = Path(__file__).resolve().parent
DATA_DIR = PACKAGE_DIR / "data"
RULES_DIR = PACKAGE_DIR / "rules"
MODELS_DIR = DATA_DIR / "models"
SCHEMAS_DIR = DATA_DIR / "schemas"

# Limits on what a file may ask of us (a rule file is a few KB; the largest golden is well under 1 MB).
YAML_MAX_BYTES = 256 << 10  # 40 times the largest shipped YAML file; parsing it takes under a second
JSON_MAX_BYTES = 64 << 20
MAX_DEPTH = 32  # nesting of YAML collections and JSON arrays/objects
MAX_DIGITS = 30  # digits of one number in a YAML or JSON file: more is no size or count we can use


def read_regular_file(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The bytes of `path`, refusing (as BadInput naming the path) anything that is not a regular
    file (a FIFO would hang, /dev/zero would never end, a folder is a mistake) or is larger than
    `max_bytes`; an OSError names the path and the system's reason."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise os_error(what, path, err) from None
    except ValueError:  # a NUL byte in the path
        raise BadInput(f"{what} {shown(os.fsdecode(path))}: not a valid path") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = (f"{os.strerror(errno.EISDIR)} (EISDIR)" if stat.S_ISDIR(info.st_mode) else
                    "a FIFO" if stat.S_ISFIFO(info.st_mode) else
                    "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "not a regular file")
            raise BadInput(f"{what} {os.fsdecode(path)}: {kind}; give a regular file")
        if info.st_size > max_bytes:
            raise BadInput(f"{what} {os.fsdecode(path)}: {info.st_size} bytes, more than the limit of {max_bytes}")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise BadInput(f"{what} {os.fsdecode(path)}: more than the limit of {max_bytes} bytes")
        return b"".join(chunks)
    except OSError as err:
        raise os_error(what, path, err) from None
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, what: str, max_bytes: int) -> str:
    """:func:`read_regular_file` decoded as UTF-8; other bytes are BadInput naming their offset."""
    data = read_regular_file(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadInput(f"{what} {os.fsdecode(path)}: not UTF-8 text (byte {err.start}: {err.reason})") from None


_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where installed: 20x faster


def _check_events(text: str) -> None:
    """Refuses aliases (a 1 KB alias bomb expands to gigabytes) and nesting deeper than MAX_DEPTH,
    from the event stream, before anything is composed (composing recurses once per level)."""
    depth = 0
    for event in yaml.parse(text, Loader=_BaseLoader):
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, f"alias *{shown(event.anchor, 40)[1:-1]}: "
                                              "aliases are not allowed", event.start_mark)
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  event.start_mark)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


class _StrictLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    """The safe loader with limits, after :func:`_check_events`: no duplicate keys (YAML would keep
    the last silently), string keys only, numbers of at most MAX_DIGITS digits."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(None, None, f"key {shown(key, 40)}: keys must be strings",
                                                        key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shown(key, 40)} (first on line {seen[key]})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if sum(c.isdigit() for c in str(node.value)) > MAX_DIGITS:
            raise yaml.constructor.ConstructorError(None, None, f"a number of more than {MAX_DIGITS} digits",
                                                    node.start_mark)
        return super().construct_yaml_int(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:map", _StrictLoader.construct_yaml_map)


def load_yaml(path: Path, what: str = "file") -> Any:
    """Reads a YAML file with the strict safe loader; a missing, oversized, non-regular or malformed
    file is BadInput naming the file (and the line)."""
    return parse_yaml(read_text(path, what, YAML_MAX_BYTES), f"{what} {path}:")


def parse_yaml(text: str, where: str) -> Any:
    """YAML text (a file's, or one value a user typed) through the strict safe loader; malformed text
    is BadInput starting with `where` (and naming the line). The caller owns what it gets (a copy)."""
    return copy.deepcopy(_parsed_yaml(text, where))


@functools.lru_cache(maxsize=256)
def _parsed_yaml(text: str, where: str) -> Any:
    # By content: a test session or `--all` reads the same rule file and MaxText config for every case,
    # and parsing is 5 to 10 times slower than copying what it gave.
    try:
        _check_events(text)
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "not valid YAML"
        if "nesting depth" in problem:  # libyaml's own limit (PyYAML 6.0.4), met before ours in a flow
            problem = f"nested deeper than {MAX_DEPTH} levels"
        raise BadInput(f"{where}{line} not valid YAML ({problem})") from None


def _json_int(text: str) -> int:
    if len(text) > MAX_DIGITS:
        raise ValueError(f"a number of more than {MAX_DIGITS} digits")
    return int(text)


def _json_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {shown(key, 40)}")
        out[key] = value
    return out


def load_json(path: str | os.PathLike, what: str = "file", max_bytes: int = JSON_MAX_BYTES) -> Any:
    """Reads a JSON file: regular, at most `max_bytes`, UTF-8, nested at most MAX_DEPTH deep, no
    duplicate keys, NaN or overlong numbers; anything else is BadInput naming the file."""
    return parse_json(read_text(path, what, max_bytes), f"{what} {os.fsdecode(path)}")


def parse_json(text: str, where: str) -> Any:
    """JSON text as :func:`load_json` accepts it; BadInput naming `where` (e.g. `golden file <path>`)."""
    too_deep = BadInput(f"{where}: nested deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(text, parse_int=_json_int, parse_constant=_json_constant, object_pairs_hook=_json_object)
    except json.JSONDecodeError as err:
        raise BadInput(f"{where}: not valid JSON (line {err.lineno}: {err.msg})") from None
    except ValueError as err:  # raised by the hooks above
        raise BadInput(f"{where}: not valid here ({err})") from None
    except RecursionError:  # the decoder recurses once per level
        raise too_deep from None
    if _depth(data) > MAX_DEPTH:
        raise too_deep
    return data


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in `value`, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


@functools.cache
def _schemas() -> dict[str, dict[str, Any]]:
    """Every schema of data/schemas by its $id."""
    schemas = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(SCHEMAS_DIR.glob("*.schema.json"))]
    return {schema["$id"]: schema for schema in schemas}


@functools.cache
def _schema_registry() -> referencing.Registry:
    """Every schema by its $id, so schemas can $ref each other offline (the test suite checks each
    against its metaschema: they are the package's own files, not input)."""
    import referencing

    return referencing.Registry().with_resources(
        (schema_id, referencing.Resource.from_contents(schema)) for schema_id, schema in _schemas().items())


def is_valid(instance: Any, schema_name: str) -> bool:
    """Whether `instance` passes `data/schemas/<schema_name>.schema.json`.

    >>> is_valid({"format_version": 1, "kind": "logical", "mesh": {"axis_names": ["fsdp"], "axis_sizes": [4],
    ...           "shard_mode": "auto"}, "tensors": {"params/w": {"shape": [8], "logical_axes": ["embed"]}}}, "logical")
    True
    >>> is_valid({"format_version": 1, "kind": "logical", "tensors": {}}, "logical")
    False
    """
    return schema_validator(schema_name).is_valid(instance)


@functools.cache
def schema_validator(name: str) -> jsonschema.protocols.Validator:
    """The validator for `data/schemas/<name>.schema.json` (every schema is metaschema-checked)."""
    import jsonschema

    registry = _schema_registry()
    schema = registry.contents(f"sharding-dump/{name}.schema.json")
    return jsonschema.validators.validator_for(schema)(schema, registry=registry)


def validate(instance: Any, schema_name: str, where: str) -> None:
    """Raises BadInput naming `where` and the first failing field when `instance` breaks the schema."""
    if is_valid(instance, schema_name):
        return
    import jsonschema

    validator = schema_validator(schema_name)
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is None:
        return
    raise BadInput(f"{where}: field {error_field(error)}: {error_message(error)}")


def error_field(error: jsonschema.ValidationError) -> str:
    """The '/'-joined path of the failing field."""
    return "/".join(str(p) for p in error.absolute_path) or "(top level)"


def error_message(error: jsonschema.ValidationError) -> str:
    """A short message that never echoes a large instance back (it may be any file's content)."""
    if error.validator == "type":
        expected = error.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        return f"must be {'an' if str(expected)[0] in 'aeiou' else 'a'} {expected}, not {type(error.instance).__name__}"
    if error.validator in ("oneOf", "enum") and isinstance(error.schema, dict) and "description" in error.schema:
        return f"{json.dumps(error.instance)[:60]} is not {error.schema['description'].rstrip('.')}"
    message = error.message
    return message if len(message) <= 160 else message[:157] + "..."


def yaml_item_lines(path: Path, key: str) -> list[int]:
    """The 1-based line of each item of the top-level list `key` of a YAML file (empty when absent),
    so a finding can point at the exact rule a user would edit. Call after :func:`load_yaml` has
    accepted the file."""
    return list(item_lines(read_text(path, "file", YAML_MAX_BYTES), key))


@functools.lru_cache(maxsize=256)
def item_lines(text: str, key: str) -> tuple[int, ...]:
    """:func:`yaml_item_lines` of a YAML file's text, already read."""
    node = yaml.compose(text, Loader=_BaseLoader)
    if not isinstance(node, yaml.MappingNode):
        return ()
    for key_node, value_node in node.value:
        if key_node.value == key and isinstance(value_node, yaml.SequenceNode):
            return tuple(item.start_mark.line + 1 for item in value_node.value)
    return ()
