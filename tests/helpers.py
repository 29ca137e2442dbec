"""Shared helpers for the tests: run the CLI in-process or as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs `python -m sharding_dump.cli ARGS` in a fresh process (its own hash seed, imports, exit)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "sharding_dump.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO, timeout=300)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by relative path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
