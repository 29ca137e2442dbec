"""A case run through the installed MaxText: MaxText's own command line (`KEY=VALUE` words after an
optional config file), named and foldered as MaxText's own sharding dump names it.

No jax and no MaxText here: the pytest plugin and the stale check read case files with this alone.

>>> case = MaxTextCase.parse(["model_name=deepseek2-16b", "compile_topology=tpu7x-8",
...                           "custom_mesh_and_rule=ep-as-cp", "ici_fsdp_parallelism=-1", "ici_expert_parallelism=2"])
>>> case.label
'deepseek2-16b/tpu7x-8/slice_1/rule_ep-as-cp_ici_expert_parallelism=2_ici_fsdp_parallelism=-1'
>>> case.command()
'python -m sharding_dump.maxtext model_name=deepseek2-16b compile_topology=tpu7x-8 custom_mesh_and_rule=ep-as-cp ici_fsdp_parallelism=-1 ici_expert_parallelism=2'
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Sequence

from sharding_dump.errors import BadInput, shown
from sharding_dump.resources import load_yaml, parse_entries

# The keys that place a case's folder (model, topology, slices, rule), not part of its overrides: the
# same keys MaxText's own tests/utils/sharding_dump.py leaves out of its folder name.
PLACE_KEYS = ("model_name", "compile_topology", "compile_topology_num_slices", "custom_mesh_and_rule")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


@dataclasses.dataclass(frozen=True)
class MaxTextCase:
    """MaxText's command line for one dump: `config` (a MaxText yml; None: the installed MaxText's
    base.yml) and its `KEY=VALUE` words, in the order given (MaxText applies them in that order)."""

    words: tuple[tuple[str, str], ...]
    config: str | None = None

    @classmethod
    def parse(cls, words: Sequence[str], config: str | None = None) -> "MaxTextCase":
        """Checks the words' form (BadInput naming the bad one); what they mean is MaxText's to say."""
        pairs = []
        for word in words:
            key, sep, value = str(word).partition("=")
            if not sep or not _KEY.fullmatch(key):
                raise BadInput(f"MaxText argument {shown(word)}: expected KEY=VALUE (a MaxText config key)")
            pairs.append((key, value))
        case = cls(tuple(pairs), config)
        for key in ("model_name", "compile_topology"):
            if not case.get(key):
                raise BadInput(f"MaxText case {' '.join(words) or '(empty)'}: no {key}=... (the model and "
                               "the topology MaxText dumps, e.g. model_name=llama2-7b compile_topology=v5p-16)")
        for key in ("model_name", "compile_topology", "custom_mesh_and_rule"):
            value = case.get(key)
            if value and not _NAME.fullmatch(value):
                raise BadInput(f"MaxText argument {key}={shown(value)}: expected a name (letters, digits, . _ + -)")
        if not case.get("compile_topology_num_slices", "1").isdigit():
            raise BadInput(f"MaxText argument compile_topology_num_slices={shown(case.get('compile_topology_num_slices'))}: "
                           "expected a positive integer")
        return case

    def get(self, key: str, default: str = "") -> str:
        """The last value given for `key` (MaxText's own rule: a later word wins)."""
        found = [value for k, value in self.words if k == key]
        return found[-1] if found else default

    @property
    def model(self) -> str:
        return self.get("model_name")

    @property
    def topology(self) -> str:
        return self.get("compile_topology")

    @property
    def num_slices(self) -> int:
        return int(self.get("compile_topology_num_slices", "1"))

    @property
    def rule(self) -> str:
        return self.get("custom_mesh_and_rule") or "default"

    @property
    def overrides(self) -> tuple[tuple[str, str], ...]:
        """The words that are not the case's place, in canonical (key) order, the last value per key."""
        return tuple(sorted({k: self.get(k) for k, _ in self.words if k not in PLACE_KEYS}.items()))

    @property
    def name(self) -> str:
        """`rule_<rule>` plus `_<key>=<value>` per override, as the zoo's case folders are named."""
        return "_".join([f"rule_{self.rule}"] + [f"{k}={v}" for k, v in self.overrides])

    @property
    def label(self) -> str:
        return f"{self.model}/{self.topology}/slice_{self.num_slices}/{self.name}"

    def folder(self, root: str | Path) -> Path:
        """The case's golden folder under `root` (the zoo's layout: model/topology/slice_N/name)."""
        return Path(root) / self.model / self.topology / f"slice_{self.num_slices}" / self.name

    def argv(self, base_config: str) -> list[str]:
        """MaxText's own argv: program name, config file, KEY=VALUE words (with the number of slices,
        1 unless given: MaxText's own default is none)."""
        words = [f"{k}={v}" for k, v in self.words]
        if not self.get("compile_topology_num_slices"):
            words.append(f"compile_topology_num_slices={self.num_slices}")
        return ["sharding-dump", self.config or base_config, *words]

    def header(self) -> dict[str, Any]:
        """The case as recorded in every golden file (the zoo's `case` header)."""
        return {"model": self.model, "topology": self.topology, "num_slices": self.num_slices,
                "rule": self.rule, "overrides": {k: _typed(v) for k, v in self.overrides}}

    def command(self, golden_root: str | None = None) -> str:
        """The command that writes this case's golden."""
        words = ["python -m sharding_dump.maxtext"] + ([f"--config {self.config}"] if self.config else [])
        words += [f"{k}={v}" for k, v in self.words]
        return " ".join(words + ([f"--golden-dir {golden_root}"] if golden_root else []))


def _typed(value: str) -> Any:
    """A word's value as the zoo's headers write it: an integer or a boolean as such, else the text."""
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    return {"true": True, "false": False}.get(value.lower(), value)


def load_cases(path: str | Path) -> list[MaxTextCase]:
    """A MaxText case file: `cases:` a list of entries, each `args:` (MaxText's KEY=VALUE words) and
    optionally `config:` (a MaxText yml, relative to the case file) and `zoo:` (the zoo's golden of the
    same case, which only tests/maxtext/test_program.py reads). No two entries the same case."""
    path = Path(path)
    data = load_yaml(path, "MaxText case file")
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise BadInput(f"MaxText case file {path}: expected a mapping with cases: [{{args: [KEY=VALUE, ...]}}, ...]")
    where = f"MaxText case file {path}"

    def parse(entry: Any) -> MaxTextCase:
        if not isinstance(entry, dict) or not isinstance(entry.get("args"), list) or set(entry) - {"args", "config", "zoo"}:
            raise BadInput("expected {args: [KEY=VALUE, ...], config: FILE (optional)}")
        config = entry.get("config")
        if config is not None:
            config = str(config if Path(config).is_absolute() else (path.parent / config).resolve())
        return MaxTextCase.parse([str(w) for w in entry["args"]], config)

    return parse_entries(data["cases"], where, parse, lambda case: case.label)
