"""A case: (model, topology, num_slices, rule, overrides), its folder name and its golden path.

`golden_dir` is the only function that turns a case into a path; the CLI, the pytest plugin and the
tools all call it. Every name in a case is checked against the known models, topologies and rules
(or, for a rule path, reduced to a safe stem) before it is used, so nothing given on the command line
can point outside the golden tree.

>>> case = Case.make("llama2-7b", "tpu7x-8", "default",
...                  overrides={"ici_tensor_parallelism": "2", "ici_fsdp_parallelism": "-1"})
>>> case.name
'rule_default_ici_fsdp_parallelism=-1_ici_tensor_parallelism=2'
>>> golden_dir(case, "golden").as_posix()
'golden/llama2-7b/tpu7x-8/slice_1/rule_default_ici_fsdp_parallelism=-1_ici_tensor_parallelism=2'
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Mapping

from sharding_dump import models, rules, settings, topology
from sharding_dump.errors import BadInput
from sharding_dump.resources import DATA_DIR, load_yaml, validate

CASES_FILE = DATA_DIR / "cases.yml"
MAX_NAME_CHARS = 200  # of a case folder name


@dataclasses.dataclass(frozen=True)
class Case:
    """One dump: validated names and canonical overrides. Build it with :meth:`Case.make`."""

    model: str
    topology: str
    rule: str  # a rule name, or a path to a user's rule file
    num_slices: int = 1
    overrides: tuple[tuple[str, settings.Value], ...] = ()

    @classmethod
    def make(cls, model: str, topology_name: str, rule: str, num_slices: int = 1,
             overrides: Mapping[str, Any] | None = None) -> "Case":
        """Validates every field (BadInput on the first bad one) and canonicalises the overrides."""
        models.check_model_name(model)
        topology.load_topology(topology_name, num_slices)
        rules.rule_path(rule)
        return cls(model, topology_name, rule, num_slices, settings.parse_overrides(overrides or {}))

    @property
    def rule_name(self) -> str:
        return rules.rule_name(self.rule)

    @property
    def name(self) -> str:
        """`rule_<rule>` plus `_<key>=<value>` per override, in canonical order. A name longer than
        MAX_NAME_CHARS (file systems allow 255 bytes, and a temp name beside it adds some) keeps a
        readable prefix and ends in `~` plus 16 hex digits of the full name's SHA-256."""
        parts = [f"rule_{self.rule_name}"]
        parts += [f"{key}={settings.format_value(value)}" for key, value in self.overrides]
        full = "_".join(parts)
        if len(full.encode("utf-8")) <= MAX_NAME_CHARS:
            return full
        digest = hashlib.sha256(full.encode("utf-8")).hexdigest()[:16]
        return f"{full[:MAX_NAME_CHARS - len(digest) - 1]}~{digest}"

    @property
    def label(self) -> str:
        """A short id for test names and progress lines."""
        return f"{self.model}/{self.topology}/slice_{self.num_slices}/{self.name}"

    def header(self) -> dict[str, Any]:
        """The case as recorded in every golden file."""
        return {
            "model": self.model,
            "topology": self.topology,
            "num_slices": self.num_slices,
            "rule": self.rule_name,
            "overrides": {key: value for key, value in self.overrides},
        }

    def command(self, output_dir: str | None = None) -> str:
        """The shell command that writes this case's golden."""
        words = ["sharding-dump", "--model", self.model, "--topology", self.topology, "--rule", self.rule]
        if self.num_slices != 1:
            words += ["--num-slices", str(self.num_slices)]
        words += [f"{k}={settings.format_value(v)}" for k, v in self.overrides]
        if output_dir is not None:
            words += ["--output-dir", output_dir]
        return " ".join(words)


def golden_dir(case: Case, root: str | Path) -> Path:
    """The folder of a case's golden files under `root`: the one place this path is built."""
    return Path(root) / case.model / case.topology / f"slice_{case.num_slices}" / case.name


def load_matrix(path: Path = CASES_FILE) -> list[Case]:
    """Every case of the case matrix (`data/cases.yml`), validated, in file order; no duplicates."""
    data = load_yaml(path, "case matrix")
    validate(data, "cases", f"case matrix {path}")
    cases: list[Case] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(data["cases"]):
        try:
            case = Case.make(entry["model"], entry["topology"], entry["rule"],
                             entry.get("num_slices", 1), entry.get("overrides"))
        except BadInput as err:
            raise BadInput(f"case matrix {path}: field cases/{index}: {err}") from None
        if case.label in seen:
            raise BadInput(f"case matrix {path}: field cases/{index}: same case as cases/{seen[case.label]}")
        seen[case.label] = index
        cases.append(case)
    return cases
