"""A repository's own sharding-dump setup: `[tool.sharding-dump]` in its `pyproject.toml`.

Found from the working directory upward (the nearest pyproject.toml holding the table), read by both
the command line and the pytest plugin, so `sharding-dump --all` and `pytest` agree on which cases
exist and where their goldens live. Every path in the table is relative to the pyproject.toml; every
path in a case file is relative to that case file. Flags (`--cases`, `--golden-dir`) and pytest ini
options (`sharding_dump_cases`, `sharding_dump_golden_dir`) override it. Checked against
`data/schemas/project.schema.json`.

    [tool.sharding-dump]
    golden-dir = "tests/goldens"          # default: golden
    cases = ["tests/sharding_cases.yml"]  # case files; default: none (the package's own matrix
                                          # when no table exists at all)
    rule-dirs = ["sharding/rules"]        # `rule: NAME` also finds sharding/rules/NAME.yml
    card-dirs = ["sharding/cards"]        # `model: NAME` also finds sharding/cards/NAME.yml
    models = {tiny = "mypkg.models:make_tiny"}  # `model: tiny` is the factory mypkg.models:make_tiny,
                                                # its goldens under golden/tiny/
    maxtext-cases = ["sharding/maxtext.yml"]  # cases run through the installed MaxText's own code
                                              # (sharding_dump/maxtext/case.py)
    time-limit = 600                      # seconds per call into the project's code and per verify
                                          # compile; default: data/time_limits.yml

>>> import tempfile
>>> root = Path(tempfile.mkdtemp())
>>> _ = (root / "pyproject.toml").write_text('[tool.sharding-dump]\\ngolden-dir = "g"\\n')
>>> (root / "sub").mkdir()
>>> project = load_project(root / "sub")
>>> project.golden_dir == root / "g", project.cases
(True, ())
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Sequence

from sharding_dump.errors import BadInput
from sharding_dump.resources import DATA_DIR, validate

PYPROJECT = "pyproject.toml"
TABLE = "sharding-dump"
DEFAULT_GOLDEN_DIR = "golden"
PACKAGE_CASES = DATA_DIR / "cases.yml"
CARD_SUFFIXES = (".yml", ".yaml")


@dataclasses.dataclass(frozen=True)
class Project:
    """The resolved configuration: absolute paths, in the order given."""

    root: Path  # the folder of the pyproject.toml (the working directory when there is none)
    source: Path | None  # the pyproject.toml holding [tool.sharding-dump], None when there is none
    golden_dir: Path
    cases: tuple[Path, ...]
    rule_dirs: tuple[Path, ...] = ()
    card_dirs: tuple[Path, ...] = ()
    models: tuple[tuple[str, str], ...] = ()  # model name -> "package.module:factory"
    time_limit: float | None = None  # seconds per call into the user's code; None: data/time_limits.yml
    maxtext_cases: tuple[Path, ...] = ()  # MaxText case files: cases run through the installed MaxText

    def with_overrides(self, cases: Sequence[str | Path] | None = None, golden_dir: str | Path | None = None,
                       base: Path | None = None) -> "Project":
        """The project with case files and golden folder replaced (flags or ini options; relative
        paths against `base`, the working directory by default)."""
        base = Path.cwd() if base is None else base
        changes: dict[str, object] = {}
        if cases:
            changes["cases"] = tuple((base / c).resolve() for c in cases)
        if golden_dir is not None:
            changes["golden_dir"] = (base / golden_dir).resolve()
        return dataclasses.replace(self, **changes)

    def resolve(self, field: str, ref: str) -> str:
        """A case's `model` or `rule` as Case.make takes it: a model factory's `module:function`, or
        the file a name stands for in the card / rule folders; anything else unchanged."""
        if field == "model":
            factories = dict(self.models)
            if ref in factories:
                return f"{ref}={factories[ref]}"  # named: its goldens are under the name, not the factory
            dirs = self.card_dirs
        elif field == "rule":
            dirs = self.rule_dirs
        else:
            raise ValueError(field)
        if "/" in ref or "\\" in ref or ref.endswith(CARD_SUFFIXES) or ":" in ref:
            return ref
        for folder in dirs:
            for suffix in CARD_SUFFIXES:
                if (folder / f"{ref}{suffix}").is_file():
                    return str(folder / f"{ref}{suffix}")
        return ref


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml at or above `start` that holds a [tool.sharding-dump] table."""
    for folder in (start, *start.parents):
        path = folder / PYPROJECT
        if not path.is_file():
            continue
        tool = _read_toml(path).get("tool", {})
        if not isinstance(tool, dict):
            raise BadInput(f"{path}: field tool must be a table ([tool.{TABLE}]), not {type(tool).__name__}")
        if TABLE in tool:
            return path
    return None


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as err:
        raise BadInput(f"{path}: not valid TOML ({err})") from None
    except UnicodeDecodeError as err:  # tomllib decodes the bytes it reads itself
        raise BadInput(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); TOML files are UTF-8") from None
    except OSError as err:
        raise BadInput(f"{path}: cannot be read ({type(err).__name__})") from None


def _paths(root: Path, value: str | list[str] | None) -> tuple[Path, ...]:
    if value is None:
        return ()
    return tuple((root / v).resolve() for v in ([value] if isinstance(value, str) else value))


def load_project(start: Path | None = None) -> Project:
    """The configuration of the project around `start` (the working directory by default). Without a
    [tool.sharding-dump] table: goldens in `golden/` of the working directory and the package's own
    case matrix."""
    start = (Path.cwd() if start is None else Path(start)).resolve()
    source = find_pyproject(start)
    if source is None:
        return Project(start, None, start / DEFAULT_GOLDEN_DIR, (PACKAGE_CASES,))
    table = _read_toml(source)["tool"][TABLE]
    validate(table, "project", f"{source}: [tool.{TABLE}]")
    root = source.parent
    for key in ("rule-dirs", "card-dirs"):
        for folder in _paths(root, table.get(key)):
            if not folder.is_dir():
                raise BadInput(f"{source}: [tool.{TABLE}] field {key}: {folder} is not a folder")
    return Project(
        root=root,
        source=source,
        golden_dir=(root / table.get("golden-dir", DEFAULT_GOLDEN_DIR)).resolve(),
        cases=_paths(root, table.get("cases")),
        rule_dirs=_paths(root, table.get("rule-dirs")),
        card_dirs=_paths(root, table.get("card-dirs")),
        models=tuple(sorted(table.get("models", {}).items())),
        time_limit=table.get("time-limit"),
        maxtext_cases=_paths(root, table.get("maxtext-cases")),
    )
