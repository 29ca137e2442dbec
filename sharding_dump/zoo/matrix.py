"""The case matrix: a case file (`data/cases.yml`, or a project's) read into its cases, in file order,
each entry a model, topology and rule, or a MaxText run configuration (:mod:`sharding_dump.zoo.maxtext_config`).

>>> [case.label for case in load_matrix()][:1]
['llama2-7b/v5p-16/slice_1/rule_pure-fsdp']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from sharding_dump.errors import BadInput
from sharding_dump.resources import DATA_DIR, load_yaml, parse_entries, validate
from sharding_dump.zoo import rules
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.project import PYPROJECT, TABLE, Project

CASES_FILE = DATA_DIR / "cases.yml"


def _maxtext_entry(entry: Mapping[str, Any], path: Path, resolve: Callable[[str, str], str] | None) -> Case:
    """A case file's `maxtext_config` entry: the MaxText run configuration (relative to the case file)
    with the entry's overrides as its command line (sharding_dump/zoo/maxtext_config.py)."""
    from sharding_dump.zoo.maxtext_config import read_case

    if "model" in entry or "rule" in entry:
        raise BadInput("maxtext_config names the model (model_name) and the rule (custom_mesh_and_rule): "
                       "drop model and rule")
    config = Path(entry["maxtext_config"])
    return read_case(config if config.is_absolute() else path.parent / config, entry.get("overrides", {}),
                     entry.get("topology"), entry.get("num_slices"), resolve, source="overrides").case


def load_matrix(path: str | Path = CASES_FILE, resolve: Callable[[str, str], str] | None = None) -> list[Case]:
    """Every case of a case file (default: the package's `data/cases.yml`), validated, in file order;
    no duplicates. Relative rule and card paths in it resolve against the file's folder; `resolve`
    (field, value) -> value then maps names (a project's rule and card folders, model factories)."""
    path = Path(path)
    data = load_yaml(path, "case matrix")
    validate(data, "cases", f"case matrix {path}")

    def parse(entry: dict[str, Any]) -> Case:
        if "maxtext_config" in entry:
            return _maxtext_entry(entry, path, resolve)
        refs = {}
        for field in ("model", "rule"):
            ref = entry[field]
            if rules.is_rule_path(ref) and not Path(ref).is_absolute():
                ref = str((path.parent / ref).resolve())
            refs[field] = resolve(field, ref) if resolve is not None else ref
        return Case.make(refs["model"], entry["topology"], refs["rule"], entry.get("num_slices", 1),
                         entry.get("overrides"), project=False)

    return parse_entries(data["cases"], f"case matrix {path}", parse, lambda case: case.label)


def load_project_cases(project: "Project", paths: Iterable[Path] | None = None) -> list[Case]:
    """Every case of a project's case files (or `paths`), validated, in file order, names resolved through
    the project's `models` and `rule-dirs`; two files naming the same case is BadInput. With no case file
    configured, BadInput saying how to name one."""
    paths = list(project.cases if paths is None else paths)
    if not paths:
        where = (f"[tool.{TABLE}] of {project.source}" if project.source
                 else f"[tool.{TABLE}] of a {PYPROJECT}")
        raise BadInput(f"no case file: set cases in {where} or pass --cases FILE")
    cases: list[Case] = []
    seen: dict[str, Path] = {}
    for path in paths:
        for case in load_matrix(path, project.resolve):
            if case.label in seen:
                raise BadInput(f"case file {path}: case {case.label} is also in {seen[case.label]}")
            seen[case.label] = path
            cases.append(case)
    return cases
