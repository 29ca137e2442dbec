"""Where the package's data files live, and how they are read.

Every YAML file goes through :func:`load_yaml` (a safe loader, errors as one-line BadInput naming the
file); every JSON Schema through :func:`schema_validator` (jsonschema-rs, the schemas' own draft 2020-12,
`$ref` between them resolved by their `$id`), its errors worded as jsonschema words them.
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

import yaml

from sharding_dump.errors import BadInput, os_error, shown

if TYPE_CHECKING:  # jsonschema-rs is imported when a validator is first asked for
    import jsonschema_rs

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

Entry = TypeVar("Entry")


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
    """How deeply lists and dicts nest in `value`, level by level, without recursion."""
    depth, level = 0, [value] if isinstance(value, (list, dict)) else []
    while level and depth <= MAX_DEPTH:
        depth += 1
        children = [child for item in level for child in (item.values() if isinstance(item, dict) else item)]
        level = [child for child in children if isinstance(child, (list, dict))]
    return depth


@functools.cache
def _schemas() -> dict[str, dict[str, Any]]:
    """Every schema of data/schemas by its $id."""
    schemas = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(SCHEMAS_DIR.glob("*.schema.json"))]
    return {schema["$id"]: schema for schema in schemas}


def _schema_id(name: str) -> str:
    return f"sharding-dump/{name}.schema.json"


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
def schema_validator(name: str) -> jsonschema_rs.Validator:
    """The validator for `data/schemas/<name>.schema.json` (jsonschema-rs, the schema's own draft
    2020-12, `$ref` between schemas resolved offline by their `$id`; a KeyError for no such schema).
    The test suite checks every schema against its metaschema: they are the package's own files."""
    import jsonschema_rs

    schemas = _schemas()
    schema = schemas[_schema_id(name)]
    registry = jsonschema_rs.Registry(list(schemas.items()))
    return jsonschema_rs.validator_for(schema, registry=registry)


def validate(instance: Any, schema_name: str, where: str) -> None:
    """Raises BadInput naming `where` and the most relevant failing field when `instance` breaks the schema."""
    if is_valid(instance, schema_name):
        return
    error = best_error(schema_validator(schema_name).iter_errors(instance), _schema_id(schema_name))
    if error is not None:
        raise BadInput(f"{where}: {error}")


_WEAK = ("AnyOf", "OneOfNotValid", "OneOfMultipleValid")  # superseded by another error at the same field


class SchemaError:
    """One failing field of a schema check: where (`field`) and why (`message`), read from a
    jsonschema-rs error and the schema keyword that failed."""

    def __init__(self, error: jsonschema_rs.ValidationError, root_id: str) -> None:
        self.error = error
        self.path = tuple(error.instance_path)
        self.kind = type(error.kind).__name__
        self.detail = error.kind.as_dict()
        self.schema = _subschema(root_id, tuple(error.evaluation_path)[:-1])

    def relevance(self) -> tuple[Any, ...]:
        """jsonschema's `best_match` order (the greatest wins): shallower fields, then later siblings,
        then anything but an anyOf/oneOf, then an error whose instance has the type its schema asks for."""
        path = [(isinstance(p, str), p) for p in self.path]
        return (-len(self.path), path, self.kind not in _WEAK, not self._matches_type())

    def _matches_type(self) -> bool:
        expected = self.schema.get("type") if isinstance(self.schema, dict) else None
        if expected is None:
            return False
        return any(_is_type(self.error.instance, t) for t in ([expected] if isinstance(expected, str) else expected))

    def context(self, root_id: str) -> list[SchemaError]:
        branches = self.detail.get("context") or []
        return [SchemaError(error, root_id) for branch in branches for error in branch]

    @property
    def field(self) -> str:
        """The '/'-joined path of the failing field."""
        return "/".join(str(p) for p in self.path) or "(top level)"

    @property
    def message(self) -> str:
        """A short message that never echoes a large instance back (it may be any file's content)."""
        message = _message(self)
        return message if len(message) <= 160 else message[:157] + "..."

    def __str__(self) -> str:
        return f"field {self.field}: {self.message}"


def best_error(errors: Any, root_id: str) -> SchemaError | None:
    """The error a reader should see first, chosen as jsonschema's `best_match` chooses: the most
    relevant one, and inside an anyOf/oneOf the most relevant branch error when one stands out."""
    found = [SchemaError(error, root_id) for error in errors]
    if not found:
        return None
    best = max(found, key=SchemaError.relevance)
    while context := best.context(root_id):
        ranked = sorted(context, key=SchemaError.relevance)[:2]
        if len(ranked) == 2 and ranked[0].relevance() == ranked[1].relevance():
            return best
        best = ranked[0]
    return best


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"string": str, "object": dict, "array": list, "boolean": bool, "null": type(None)}
    return isinstance(value, kinds.get(name, object))


@functools.lru_cache(maxsize=1024)
def _subschema(root_id: str, evaluation_path: tuple[Any, ...]) -> Any:
    """The schema object an error's keyword sits in, walked from the root schema along the error's
    evaluation path (a `$ref` followed into its target, in this schema or another by its $id)."""
    schemas = _schemas()
    doc_id, node = root_id, schemas[root_id]
    for step in evaluation_path:
        if step == "$ref" and isinstance(node, dict) and isinstance(node.get("$ref"), str):
            target, _, pointer = node["$ref"].partition("#")
            if target:
                doc_id = f"{doc_id.rpartition('/')[0]}/{target}"
            node = schemas[doc_id]
            for part in filter(None, pointer.split("/")):
                node = node[part]
            continue
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _message(error: SchemaError) -> str:
    """jsonschema's wording of each kind of failure, with the instance as Python shows it."""
    instance, detail, kind, schema = error.error.instance, error.detail, error.kind, error.schema
    described = isinstance(schema, dict) and "description" in schema
    if kind == "Type":
        expected = schema.get("type", detail["types"]) if isinstance(schema, dict) else detail["types"]
        expected = " or ".join(expected) if isinstance(expected, list) else expected  # in the schema's order
        return f"must be {'an' if str(expected)[0] in 'aeiou' else 'a'} {expected}, not {type(instance).__name__}"
    if kind in ("OneOfNotValid", "OneOfMultipleValid", "Enum", "AnyOf") and described:
        return f"{json.dumps(instance)[:60]} is not {schema['description'].rstrip('.')}"
    if kind == "Required":
        return f"{detail['property']!r} is a required property"
    if kind == "AdditionalProperties":
        extras = detail["unexpected"]
        return (f"Additional properties are not allowed ({', '.join(map(repr, extras))} "
                f"{'was' if len(extras) == 1 else 'were'} unexpected)")
    short = repr(instance)[:160]
    limit = detail.get("limit")
    messages = {
        "Enum": lambda: f"{short} is not one of {detail.get('options')!r}",
        "Constant": lambda: f"{detail.get('expected_value')!r} was expected",
        "Pattern": lambda: f"{short} does not match {detail.get('pattern')!r}",
        "Minimum": lambda: f"{short} is less than the minimum of {limit!r}",
        "Maximum": lambda: f"{short} is greater than the maximum of {limit!r}",
        "ExclusiveMinimum": lambda: f"{short} is less than or equal to the minimum of {limit!r}",
        "ExclusiveMaximum": lambda: f"{short} is greater than or equal to the maximum of {limit!r}",
        "MinItems": lambda: f"{short} should be non-empty" if limit == 1 else f"{short} is too short",
        "MinLength": lambda: f"{short} should be non-empty" if limit == 1 else f"{short} is too short",
        "MinProperties": lambda: f"{short} should be non-empty" if limit == 1 else f"{short} does not have enough properties",
        "MaxItems": lambda: f"{short} is expected to be empty" if limit == 0 else f"{short} is too long",
        "MaxLength": lambda: f"{short} is expected to be empty" if limit == 0 else f"{short} is too long",
        "UniqueItems": lambda: f"{short} has non-unique elements",
        "OneOfNotValid": lambda: f"{short} is not valid under any of the given schemas",
        "AnyOf": lambda: f"{short} is not valid under any of the given schemas",
        "FalseSchema": lambda: f"False schema does not allow {short}",
    }
    return messages[kind]() if kind in messages else error.error.message


def parse_entries(entries: Iterable[Any], where: str, parse: Callable[[Any], Entry],
                  label: Callable[[Entry], str]) -> list[Entry]:
    """Each entry of a case file's `cases` list parsed, in file order: a BadInput of `parse` names the
    entry (`where: field cases/N: ...`), and so does a second entry of the same `label`, so a file with a
    duplicated case is refused naming both places.

    >>> parse_entries(["a", "b"], "case file f.yml", str.upper, str)
    ['A', 'B']
    """
    out: list[Entry] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(entries):
        try:
            parsed = parse(entry)
        except BadInput as err:
            raise BadInput(f"{where}: field cases/{index}: {err}") from None
        name = label(parsed)
        if name in seen:
            raise BadInput(f"{where}: field cases/{index}: same case as cases/{seen[name]}")
        seen[name] = index
        out.append(parsed)
    return out


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
