"""The recorded KV cache is still what the installed MaxText's own MaxEngine builds (`pytest -m maxtext`, with
MaxText installed; skipped without it): tools/maxtext_kvcache_reference.py run again, in a process of its
own with 8 CPU devices, writes what tests/data/maxtext/serving/llama2-7b.json holds, which
tests/zoo/test_serving_zoo.py compares with the zoo's serving case."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.maxtext


def test_the_recorded_cache_is_the_installed_maxtexts(tmp_path):
    if importlib.util.find_spec("maxtext") is None:
        pytest.skip("MaxText is not installed (requirements-maxtext.txt)")
    out = tmp_path / "llama2-7b.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, str(REPO / "tools/maxtext_kvcache_reference.py"), str(out)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    recorded = json.loads((REPO / "tests/data/maxtext/serving/llama2-7b.json").read_text())
    made = json.loads(out.read_text())
    assert made["maxtext"] == recorded["maxtext"], "another MaxText: record its cache again (tests/data/maxtext/README.md)"
    assert made["cases"] == recorded["cases"]
    assert made["tensor_transpose_in_inference_yml"] == recorded["tensor_transpose_in_inference_yml"]
