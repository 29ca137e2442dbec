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

from sharding_dump.zoo import releases, rules, settings, topology
from sharding_dump.zoo.model_ref import ModelRef, parse_model_ref

MAX_NAME_CHARS = 230  # of a case folder name: its temp twin (".<name>.new-<pid>-<8 hex>") stays within 255 bytes


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
             overrides: Mapping[str, Any] | None = None, project: bool = True) -> "Case":
        """Validates every field (BadInput on the first bad one) and canonicalises the overrides. A
        model or rule name is resolved as the CLI resolves it (`project`, the default): through the
        `models`, `rule-dirs` and `card-dirs` of the [tool.sharding-dump] table around the working
        directory (:meth:`sharding_dump.zoo.project.Project.resolve`), so a test's
        `Case.make("tiny", "cpu-8", "tp")` is the case `sharding-dump --model tiny ... --rule tp` dumps."""
        if project:
            from sharding_dump.zoo.project import load_project

            table = load_project()
            model, rule = table.resolve("model", model), table.resolve("rule", rule)
        parse_model_ref(model)
        topology.load_topology(topology_name, num_slices)
        parsed = settings.parse_overrides(overrides or {})
        releases.nnx_build(dict(parsed))  # MaxText's build keys: refused where that MaxText refuses them
        # The default release needs no mention: its cases keep the folder names they had before releases.
        parsed = tuple((k, v) for k, v in parsed if (k, v) != (releases.SETTING, settings.value_of({}, releases.SETTING)))
        rules.rule_path(rule, releases.release_of(dict(parsed)).rules_dir)
        return cls(model, topology_name, rule, num_slices, parsed)

    @property
    def model_ref(self) -> ModelRef:
        """What the model name refers to: a card or a factory in the user's code."""
        return parse_model_ref(self.model)

    @property
    def release(self) -> releases.Release:
        """The MaxText release the case builds (its `maxtext_version`)."""
        return releases.release_of(dict(self.overrides))

    def rule_set(self) -> rules.RuleSet:
        """The case's rule file, a name looked up among its MaxText release's rule files."""
        return rules.load_rule(self.rule, self.release.rules_dir)

    @property
    def rule_name(self) -> str:
        return rules.rule_name(self.rule)

    @property
    def name(self) -> str:
        """`rule_<rule>` plus `_<key>=<value>` per override, in canonical order. A name longer than
        MAX_NAME_CHARS (file systems allow 255 bytes, and a temp name beside it adds some) keeps a
        readable prefix and ends in `~` plus 16 hex digits of the full name's SHA-256."""
        parts = [f"rule_{self.rule_name}"]
        # A reference (optimizer=pkg.mod:fn) is written pkg.mod-fn, as a factory model's folder is.
        parts += [f"{key}={settings.format_value(value).replace(':', '-')}" for key, value in self.overrides]
        full = "_".join(parts)
        if len(full.encode("utf-8")) <= MAX_NAME_CHARS:
            return full
        digest = hashlib.sha256(full.encode("utf-8")).hexdigest()[:16]
        return f"{full[:MAX_NAME_CHARS - len(digest) - 1]}~{digest}"

    @property
    def label(self) -> str:
        """A short id for test names and progress lines."""
        return f"{self.model_ref.label}/{self.topology}/slice_{self.num_slices}/{self.name}"

    def header(self) -> dict[str, Any]:
        """The case as recorded in every golden file."""
        return {
            "model": self.model_ref.label,
            "topology": self.topology,
            "num_slices": self.num_slices,
            "rule": self.rule_name,
            "overrides": {key: value for key, value in self.overrides},
        }

    def command(self, golden_root: str | None = None) -> str:
        """The shell command that writes this case's golden (under `golden_root` when given); file
        paths relative to the working directory when inside it."""
        words = ["sharding-dump", "--model", _shown(self.model), "--topology", self.topology,
                 "--rule", _shown(self.rule)]
        if self.num_slices != 1:
            words += ["--num-slices", str(self.num_slices)]
        words += [f"{k}={settings.format_value(v)}" for k, v in self.overrides]
        if golden_root is not None:
            words += ["--golden-dir", _shown(str(golden_root))]
        return " ".join(words)


def _shown(ref: str) -> str:
    """An absolute path as a user would type it (relative to the working directory when inside it)."""
    path = Path(ref)
    if not path.is_absolute():
        return ref
    try:
        return path.relative_to(Path.cwd()).as_posix() or "."
    except ValueError:
        return ref


def golden_dir(case: Case, root: str | Path) -> Path:
    """The folder of a case's golden files under `root`: the one place this path is built."""
    return Path(root) / case.model_ref.folder_name / case.topology / f"slice_{case.num_slices}" / case.name
