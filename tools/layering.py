#!/usr/bin/env python3
"""The import rule of the package, and a check of it: every edge between layers points one way, no
two modules import each other (directly or round a longer cycle), and no module imports a private
name of another. Read from the source (ast), so an import inside a function counts too.

    python tools/layering.py     # one line per finding; exit 1 when there is any

    base           core        golden                  models         zoo                   maxtext          commands, plugin
    (errors,       core        golden, core.format,    models, core   core, golden, models  zoo and below    anything below
    resources)                 core.specs, core.gc_policy (no jax)

The base (the one-line error and the data-file reader, both without jax) is the floor every layer
stands on. tests/integration/test_layers.py runs this check; tools/docs.py renders the rule as
docs/maintainers/layout.md.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
    """Every module of the package, by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(module: str, path: Path, running: bool = False) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, names taken from it) for every import in the file, relative ones
    resolved; `running`: without those under `if TYPE_CHECKING:` (they never run, so close no cycle)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skipped = {id(n) for node in ast.walk(tree) if running and isinstance(node, ast.If)
               and _is_type_checking(node.test) for child in node.body for n in ast.walk(child)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def target_allowed(source_layer: str, target: str) -> bool:
    """Whether a module of `source_layer` may import `target`."""
    allowed = ALLOWED[source_layer]
    return layer_of(target) in allowed or target in allowed


def violations(package_modules: dict[str, Path], root: Path = REPO) -> list[str]:
    """Imports against ALLOWED, private names taken from another module, jax where it must not be."""
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


def cycles(package_modules: dict[str, Path]) -> list[str]:
    """One line per group of modules that import each other round a cycle (a strongly connected
    component of the import graph), naming each module and the edges that close it."""
    graph: dict[str, dict[str, int]] = {module: {} for module in package_modules}
    for module, path in package_modules.items():
        for line, target, _ in imports_of(module, path, running=True):
            # `from sharding_dump.zoo import case` names the submodule; a package's own __init__ is no edge
            if target in graph and target != module and not module.startswith(f"{target}."):
                graph[module].setdefault(target, line)
    found = []
    for component in _components(graph):
        if len(component) < 2:
            continue
        members = set(component)
        edges = sorted(f"{_short(a)}:{graph[a][b]} -> {_short(b)}" for a in component for b in graph[a] if b in members)
        found.append(f"import cycle between {', '.join(_short(m) for m in sorted(component))}: {'; '.join(edges)}")
    return sorted(found)


def _short(module: str) -> str:
    return module.removeprefix("sharding_dump.").replace(".", "/")


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def findings(package_modules: dict[str, Path] | None = None, root: Path = REPO) -> list[str]:
    """Every layer violation and import cycle of the package (or of `package_modules`)."""
    package_modules = modules() if package_modules is None else package_modules
    return violations(package_modules, root) + cycles(package_modules)


def main() -> int:
    found = findings()
    for line in found:
        print(line)
    print(f"{len(found)} findings", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
