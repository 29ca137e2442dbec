"""The import rule (tools/layering.py holds it): every edge between the package's layers points one
way, no modules import each other round a cycle, and no module imports a private name of another.
Read from the source (ast), so an import inside a function counts too.
"""

from __future__ import annotations

import functools
import runpy
import subprocess
import sys

import pytest

from helpers import REPO


@functools.cache
def layering() -> dict:
    """tools/layering.py loaded in this process (its rule, `findings()` and `violations()`)."""
    return runpy.run_path(str(REPO / "tools" / "layering.py"), run_name="layering")


THIRD_PARTY_JAX = ("jax", "jaxlib", "flax", "optax")


def test_every_import_follows_the_layers_and_closes_no_cycle():
    assert layering()["findings"]() == []


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
    found = layering()["findings"](files, tmp_path)
    assert any("core imports sharding_dump.zoo.case" in f for f in found), found
    assert any("must not import jax" in f for f in found), found
    assert any("imports private _fsync_dir" in f for f in found), found
    assert any("models imports sharding_dump.zoo.rules" in f for f in found), found


def test_a_cycle_is_found(tmp_path):
    """Two modules importing each other (one inside a function) are one finding naming both edges;
    an import under `if TYPE_CHECKING:` closes none."""
    files = {}
    for name, text in {"sharding_dump.zoo.a": "import sharding_dump.zoo.c\ndef f():\n    import sharding_dump.zoo.b\n",
                       "sharding_dump.zoo.b": "import sharding_dump.zoo.a\n",
                       "sharding_dump.zoo.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    import sharding_dump.zoo.a\n"}.items():
        files[name] = tmp_path / (name.replace(".", "_") + ".py")
        files[name].write_text(text)
    found = layering()["findings"](files, tmp_path)
    assert found == ["import cycle between zoo/a, zoo/b: zoo/a:3 -> zoo/b; zoo/b:1 -> zoo/a"], found


@pytest.mark.parametrize("module", ["sharding_dump", "sharding_dump.golden.engine", "sharding_dump.golden.stale",
                                    "sharding_dump.commands.diff", "sharding_dump.pytest_plugin",
                                    "sharding_dump.zoo.case", "sharding_dump.zoo.matrix",
                                    "sharding_dump.maxtext.case"])
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

    modules, imports_of = layering()["modules"], layering()["imports_of"]
    missing = []
    for module, path in modules().items():
        for line, target, names in imports_of(module, path):
            if not target.startswith("sharding_dump"):
                continue
            imported = importlib.import_module(target)
            missing += [f"{path.relative_to(REPO)}:{line}: {target}.{name}" for name in names
                        if not hasattr(imported, name) and f"{target}.{name}" not in modules()]
    assert missing == []


def test_a_zoo_dump_loads_only_what_it_uses(tmp_path):
    """A cold dump of a zoo case that names no MaxText config, asks for no compile and no reference
    model imports neither OmegaConf, transformers nor the verify machinery (each costs a cold start
    tenths of a second), nor any model family but the one its card builds (llama2's: models.dense)."""
    from sharding_dump.models import shipped_families

    others = sorted({family.__module__ for _, family in shipped_families()} - {"sharding_dump.models.dense"})
    heavy = ("omegaconf", "transformers", "sharding_dump.commands.verify", *others)
    code = ("import sys; from sharding_dump.commands.cli import main; "
            f"status = main(['--model', 'llama2-7b', '--topology', 'v5p-16', '--rule', 'pure-fsdp', '--output-dir', "
            f"{str(tmp_path)!r}]); assert status == 0, status; "
            f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
