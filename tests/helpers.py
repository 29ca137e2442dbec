"""Shared helpers for the tests: run the CLI in-process or as a subprocess."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable

import pytest

from sharding_dump.commands import cli
from sharding_dump.errors import BadInput
from sharding_dump.golden import codec
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.goldens import check_or_update
from sharding_dump.zoo.matrix import load_matrix
from sharding_dump.zoo.releases import linen_build, linen_settings
from sharding_dump.zoo.mesh import MeshPlan, plan_mesh
from sharding_dump.zoo.rules import load_rule
from sharding_dump.zoo.settings import parse_overrides, resolve
from sharding_dump.zoo.topology import load_topology

REPO = Path(__file__).resolve().parents[1]
# The settings that choose MaxText e591f30's NNX build, as a case gives them: the release; its build keys
# (enable_nnx, pure_nnx_decoder, pure_nnx) default to its base.yml's values, true.
NNX = {"maxtext_version": "0.2.4"}
# The settings that choose e591f30's Linen build, as MaxText's own sharding tests give them: the build every
# MaxText dump under tests/data/maxtext/ (goldens/, blocks/, pipelines/) was made of.
# (tests/zoo/test_releases.py pins them: maxtext_version=0.2.4 enable_nnx=false pure_nnx_decoder=false pure_nnx=false)
LINEN = linen_settings()
LINEN_ARGS = linen_build().split()  # as KEY=VALUE on the command line

# A repository adopting sharding-dump (tests/integration/test_adopt.py, test_wheel.py): [tool.sharding-dump]
# of its pyproject.toml, two rule files with mesh axes of its own naming, and its case file.
ADOPT_TABLE = """\
golden-dir = "sharding/goldens"
cases = ["sharding/cases.yml"]
rule-dirs = ["sharding/rules"]"""

# Our own mesh names: replicas of the model (data parallel) x model shards (tensor parallel).
ADOPT_TP_RULE = """\
mesh_axes: [replica, model]
data_sharding: [[replica]]
mesh_rules:
  - {match: ".*", settings: {ici_replica_parallelism: -1}}
logical_axis_rules:
  - [activation_batch, replica]
  - [activation_embed_and_logits_batch, replica]
  - [mlp, model]
  - [heads, model]
  - [kv_heads, model]
  - [vocab, model]
"""
ADOPT_DP_RULE = """\
mesh_axes: [replica]
logical_axis_rules:
  - [activation_batch, replica]
  - [activation_embed_and_logits_batch, replica]
  - [embed, replica]
"""
# `tp` is found in the project's rule folder; `rules/dp.yml` is relative to this case file.
ADOPT_CASES = """\
cases:
  - {model: qwen3-0.6b, topology: cpu-8, rule: tp, overrides: {ici_model_parallelism: 2}}
  - {model: qwen3-0.6b, topology: cpu-8, rule: rules/dp.yml, overrides: {ici_replica_parallelism: -1}}
"""
ADOPT_FILES = {"sharding/rules/tp.yml": ADOPT_TP_RULE, "sharding/rules/dp.yml": ADOPT_DP_RULE,
               "sharding/cases.yml": ADOPT_CASES}


def sweep_beyond_first(items: Iterable[Any], kind: Callable[[Any], Hashable] = lambda _: None) -> list[Any]:
    """Parameters for a check repeated over many items: the first item of each kind runs by default,
    the others carry the `sweep` mark (CI runs them as a step of their own: `pytest -m sweep`)."""
    seen, out = set(), []
    for item in items:
        key = kind(item)
        out.append(item if key not in seen else pytest.param(item, marks=pytest.mark.sweep))
        seen.add(key)
    return out


@functools.cache
def matrix_setups() -> dict:
    """Every case of the matrix set up (values, mesh plan, rule set, model config, pipeline), by label:
    made once per test process for all the modules that read it."""
    from sharding_dump.zoo.dump import setup_case
    return {case.label: setup_case(case) for case in load_matrix()}


@functools.cache
def matrix_folders() -> dict:
    """The committed golden folder of every case of the matrix, to its case (read once per test process)."""
    return {golden_dir(case, REPO / "golden"): case for case in load_matrix()}


@functools.cache
def linen_matrix() -> dict[str, Case]:
    """Every case of the matrix as e591f30's Linen build (LINEN added to its overrides), by its golden folder
    relative to a golden root: the build MaxText's Linen dumps under tests/data/maxtext/ were made of. A
    case that builds nothing else (0.2.5's serving) is left out."""
    out = {}
    for case in load_matrix():
        try:
            linen = Case.make(case.model, case.topology, case.rule, case.num_slices, {**dict(case.overrides), **LINEN})
        except BadInput:
            continue
        out[golden_dir(linen, Path("/")).relative_to("/").as_posix()] = linen
    return out


@functools.cache
def _linen_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="sharding-dump-linen-"))
    atexit.register(shutil.rmtree, root, True)
    return root


def linen_golden(folder: str) -> Path:
    """Our golden folder of the Linen build of a matrix case (`folder`: a key of :func:`linen_matrix`, the
    name a MaxText Linen dump is kept under), written once per test process."""
    assert folder in linen_matrix(), f"reference case {folder} is not a case of sharding_dump/data/cases.yml " \
                                     f"as e591f30's Linen build"
    case = linen_matrix()[folder]
    ours = golden_dir(case, _linen_root())
    if not (ours / "named_shardings.json").is_file():
        check_or_update(case, _linen_root(), update=True)
    return ours


@functools.cache
def compare_maxtext_tool() -> dict:
    """tools/compare_maxtext.py loaded in this process (its `main(argv)` and `compare(...)`)."""
    import runpy

    return runpy.run_path(str(REPO / "tools" / "compare_maxtext.py"), run_name="compare_maxtext")


def mesh_plan(rule: str, topology: str, num_slices: int = 1, **overrides: object) -> MeshPlan:
    """The mesh a case gets from its rule file, topology and KEY=VALUE overrides, as the dump plans it
    (the overrides count as set explicitly), without loading a model."""
    parsed = parse_overrides(overrides)
    return plan_mesh(load_rule(rule), load_topology(topology, num_slices), resolve(parsed),
                     frozenset(key for key, _ in parsed))


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs `python -m sharding_dump.commands.cli ARGS` in a fresh process (its own hash seed, imports, exit)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "sharding_dump.commands.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO, timeout=300)


def committed_golden(case: Case, name: str) -> dict:
    """One of the repository's committed golden documents of `case`, schema-checked: what the golden
    tests compare with a fresh dump, so other tests may inspect it rather than dump the case again."""
    return codec.read_document(golden_dir(case, REPO / "golden") / name)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by relative path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def cli_args(text: str) -> list[str]:
    """The words of a dump command, with a default model, topology and rule (none with --maxtext-config,
    which names them)."""
    words = text.split()
    if "--maxtext-config" in words:
        return words
    for flag, default in (("--model", "llama2-7b"), ("--topology", "v5p-8"), ("--rule", "default")):
        if flag not in words:
            words = [flag, default] + words
    return words


def assert_bad_input(tmp_path, capsys, args: str, message: str) -> None:
    """The CLI (in-process) exits 2 with one line holding `message` and writes nothing."""
    out = tmp_path / "out"
    status = cli.main(cli_args(args) + ["--output-dir", str(out)])
    captured = capsys.readouterr()
    assert status == 2, f"exit status {status}, stderr {captured.err!r}"
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("sharding-dump: error: ") and message in captured.err, captured.err
    assert not out.exists()

# Example programs that decide their own layouts (tests/core/test_handback.py, docs/program-placement.md).
FSDP = ("examples.fsdp_trainer:small_lm", "cpu-8", "examples/fsdp_rules.yml",
        {"ici_fsdp_parallelism": 8, "per_device_batch_size": 2, "max_target_length": 32})
JITTED = ("examples.pure_jax_llama:small_llama_jitted", "cpu-4", "examples/pure_jax_rules.yml",
          {"ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2, "shard_mode": "explicit", "per_device_batch_size": 2,
           "max_target_length": 32})


def program_case(spec: tuple) -> Case:
    """The case of `(model, topology, rule file in the checkout, overrides)`: an example program's."""
    model, topology, rule, overrides = spec
    return Case.make(model, topology, str(REPO / rule), overrides=overrides)


def forget_programs() -> None:
    """Forget every program built in this process: the next dump builds the edited one."""
    from sharding_dump.zoo import dump, model_ref, serving

    for cached in (model_ref.factory_program, dump.program_model, dump._factory_state, dump._recorded,
                   serving.init_layouts, serving.trace_case):
        cached.cache_clear()


def golden_after(tmp_path: Path, spec: tuple, render: Callable[[Case], dict[str, bytes]],
                 edit: Callable[[], Any]) -> str:
    """The goldens `render` gives the case of `spec` written, the program edited by `edit()`, then
    checked: the report of what differs (the test fails when nothing does)."""
    from sharding_dump.golden.engine import check_or_update_folder

    case = program_case(spec)
    folder = tmp_path / "golden"
    assert check_or_update_folder(folder, render(case), update=True).status == "written"
    assert check_or_update_folder(folder, render(case), update=False).status == "match"
    edit()
    forget_programs()
    outcome = check_or_update_folder(folder, render(case), update=False)
    assert outcome.status == "differs"
    return outcome.report


def cache_resharded(step: Callable[..., Any], spec: Any) -> Callable[..., Any]:
    """A step of examples/llama3_serving.py that hands its cache back resharded to `spec` (leaves of
    lower rank than the spec as they were): the program's own `reshard`, as a server's bug writes it."""
    import jax

    def resharded(state: Any, inputs: Any, settings: Any, base: Any) -> Any:
        state, out = step(state, inputs, settings, base)
        cache = jax.tree.map(lambda x: jax.sharding.reshard(x, spec) if x.ndim >= len(spec) else x, state["cache"])
        return {**state, "cache": cache}, out

    return resharded
