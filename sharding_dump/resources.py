"""Where the package's data files live, and how they are read.

Every YAML file goes through :func:`load_yaml` (a safe loader, errors as one-line BadInput naming the
file); every JSON Schema through :func:`schema_validator`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import yaml

from sharding_dump.errors import BadInput

PACKAGE_DIR = Path(__file__).resolve().parent
DATA_DIR = PACKAGE_DIR / "data"
RULES_DIR = PACKAGE_DIR / "rules"
MODELS_DIR = DATA_DIR / "models"
SCHEMAS_DIR = DATA_DIR / "schemas"


def load_yaml(path: Path, what: str = "file") -> Any:
    """Reads a YAML file with the safe loader; a missing or malformed file is BadInput."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{what} {path}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise BadInput(f"{what} {path}: cannot be read ({type(err).__name__})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "not valid YAML"
        raise BadInput(f"{what} {path}:{where} not valid YAML ({problem})") from None


@functools.cache
def _schema_registry() -> referencing.Registry:
    """Every schema of data/schemas by its $id, so schemas can $ref each other offline."""
    resources = []
    for path in sorted(SCHEMAS_DIR.glob("*.schema.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        jsonschema.validators.validator_for(schema).check_schema(schema)
        resources.append((schema["$id"], referencing.Resource.from_contents(schema)))
    return referencing.Registry().with_resources(resources)


@functools.cache
def schema_validator(name: str) -> jsonschema.protocols.Validator:
    """The validator for `data/schemas/<name>.schema.json` (every schema is metaschema-checked)."""
    registry = _schema_registry()
    schema = registry.contents(f"sharding-dump/{name}.schema.json")
    return jsonschema.validators.validator_for(schema)(schema, registry=registry)


def validate(instance: Any, schema_name: str, where: str) -> None:
    """Raises BadInput naming `where` and the first failing field when `instance` breaks the schema."""
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
    if error.validator == "oneOf" and isinstance(error.schema, dict) and "description" in error.schema:
        return f"{json.dumps(error.instance)[:60]} is not {error.schema['description']}"
    message = error.message
    return message if len(message) <= 160 else message[:157] + "..."


def yaml_item_lines(path: Path, key: str) -> list[int]:
    """The 1-based line of each item of the top-level list `key` of a YAML file (empty when absent),
    so a finding can point at the exact rule a user would edit. Call after :func:`load_yaml` has
    accepted the file."""
    node = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    if not isinstance(node, yaml.MappingNode):
        return []
    for key_node, value_node in node.value:
        if key_node.value == key and isinstance(value_node, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in value_node.value]
    return []
