"""The import rule: every edge between the package's layers points one way, and no module imports a
private name of another. Read from the source (ast), so an import inside a function counts too.

    base           core        golden                  models         zoo                   maxtext          commands, plugin
    (errors,       core        golden, core.format,    models, core   core, golden, models  zoo and below    anything below
    resources)                 core.specs, core.gc_policy (no jax)

The base (the one-line error and the data-file reader, both without jax) is the floor every layer
stands on.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

PACKAGE = REPO / "sharding_dump"

BASE = {"sharding_dump.errors", "sharding_dump.resources"}
JAX_FREE_CORE = {"sharding_dump.core.boundary", "sharding_dump.core.format", "sharding_dump.core.gc_policy",
                 "sharding_dump.core.specs"}
# layer -> the layers (or single modules) it may import
ALLOWED = {
    "base": {"base"},
    "core": {"core", "base"},
    "golden": {"golden", "base", *JAX_FREE_CORE},
    "models": {"models", "core"},  # Flax only: cards and data files are the zoo's
    "zoo": {"zoo", "core", "golden", "models", "base"},
    "maxtext": {"maxtext", "zoo", "core", "golden", "base"},  # the installed MaxText's code as the program
    "commands": {"commands", "zoo", "core", "golden", "models", "base"},
    "plugin": {"commands", "zoo", "golden", "maxtext", "base"},
    "api": set(),  # sharding_dump/__init__.py exports lazily, by name, and imports nothing of its own
}
THIRD_PARTY_JAX = ("jax", "jaxlib", "flax", "optax")


def layer_of(module: str) -> str:
    """`sharding_dump.zoo.case` -> 'zoo'."""
    if module in BASE:
        return "base"
    if module == "sharding_dump":
        return "api"
    if module == "sharding_dump.pytest_plugin":
        return "plugin"
    return module.split(".")[1]


@functools.cache
def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(module: str, path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, names taken from it) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = tuple(alias.name for alias in node.names)
            known = modules()
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            rest = tuple(n for n in names if f"{base}.{n}" not in known)
            out += [(node.lineno, base, rest)] * bool(rest or not submodules)
            out += [(node.lineno, sub, ()) for sub in submodules]
    return out


def target_allowed(source_layer: str, target: str) -> bool:
    allowed = ALLOWED[source_layer]
    return layer_of(target) in allowed or target in allowed


def violations(package_modules: dict[str, Path], root: Path = REPO) -> list[str]:
    found = []
    for module, path in package_modules.items():
        layer = layer_of(module)
        for line, target, names in imports_of(module, path):
            where = f"{path.relative_to(root)}:{line}"
            if target.startswith("sharding_dump") and target != module:
                if target == "sharding_dump" or not target_allowed(layer, target):
                    found.append(f"{where}: {layer} imports {target} ({layer_of(target)})")
                private = [n for n in names if n.startswith("_") and n != "__version__"]
                if private:
                    found.append(f"{where}: imports private {', '.join(private)} from {target}")
            if target.split(".")[0] in THIRD_PARTY_JAX and (layer in ("base", "golden") or module in JAX_FREE_CORE):
                found.append(f"{where}: {module} must not import {target}")
    return found


def test_every_import_follows_the_layers():
    assert violations(modules()) == []


def test_the_rule_bites(tmp_path):
    """A forbidden edge, a private import and jax in the golden layer are each reported."""
    bad = {"sharding_dump.core.bad": "from sharding_dump.zoo import case\n",
           "sharding_dump.golden.bad": "import jax\nfrom sharding_dump.golden.store import _fsync_dir\n",
           "sharding_dump.models.bad": "from sharding_dump.zoo.rules import RuleSet\n"}
    files = {}
    for name, text in bad.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(text)
        files[name] = path
    found = violations(files, tmp_path)
    assert any("core imports sharding_dump.zoo.case" in f for f in found), found
    assert any("must not import jax" in f for f in found), found
    assert any("imports private _fsync_dir" in f for f in found), found
    assert any("models imports sharding_dump.zoo.rules" in f for f in found), found


@pytest.mark.parametrize("module", ["sharding_dump", "sharding_dump.golden.engine", "sharding_dump.golden.stale",
                                    "sharding_dump.commands.diff", "sharding_dump.pytest_plugin",
                                    "sharding_dump.zoo.case", "sharding_dump.maxtext.case"])
def test_jax_free_modules_load_no_jax(module):
    """What runs without a model (the API's import, golden I/O, `diff`, the plugin's import, the case
    names and golden folders its stale check reads) loads no jax."""
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in {THIRD_PARTY_JAX!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", (module, out.stdout, out.stderr)


def test_every_import_of_the_package_resolves():
    """An import inside a function runs only when that path runs: every name taken from a module of
    the package must exist there (a move that forgets one fails here, not in a user's command)."""
    import importlib

    missing = []
    for module, path in modules().items():
        for line, target, names in imports_of(module, path):
            if not target.startswith("sharding_dump"):
                continue
            imported = importlib.import_module(target)
            missing += [f"{path.relative_to(REPO)}:{line}: {target}.{name}" for name in names
                        if not hasattr(imported, name) and f"{target}.{name}" not in modules()]
    assert missing == []
