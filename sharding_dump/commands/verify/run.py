"""Verifying one case: its request to the compiling child process, and the answer read back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sharding_dump.commands.options import xla_flags
from sharding_dump.commands.verify.figures import compare_figures
from sharding_dump.commands.verify.hlo import Replicated, Traffic
from sharding_dump.commands.verify.result import CaseResult
from sharding_dump.commands.verify.settings import Options, tpu_topologies
from sharding_dump.commands.verify.xla_log import rematerializations
from sharding_dump.core.boundary import LIMIT_HINT, current_limit, seconds_text
from sharding_dump.core.format import NAMED_FILE
from sharding_dump.errors import BadInput, TracebackText
from sharding_dump.resources import PACKAGE_DIR


def golden_specs(case: Any, root: Path) -> dict[str, Any] | None:
    """Leaf path -> partition spec (JSON form) of the case's named golden; None when there is none."""
    from sharding_dump.golden import codec
    from sharding_dump.zoo.case import golden_dir

    path = golden_dir(case, root) / NAMED_FILE
    if not path.is_file():
        return None
    return {p: entry["partition_spec"] for p, entry in codec.read_document(path)["tensors"].items()}


def _child_env(devices: int, tpu: bool, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    if tpu:  # libtpu logs to files of its own: its warnings (the partitioner's among them) go to fd 2
        env.update(TPU_STDERR_LOG_LEVEL="1", TPU_MIN_LOG_LEVEL="1", TPU_LOG_DIR=str(work))
    env["JAX_PLATFORMS"] = "cpu"
    # with --tpu the devices come from libtpu's topology description, no backend needed
    env["XLA_FLAGS"] = xla_flags(env.get("XLA_FLAGS", ""), None if tpu else devices)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent)] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


COMPILING = "compiling"  # the file the child touches when it starts to compile: the compile's clock starts
POLL_SECONDS = 0.1


_LIVE: set[subprocess.Popen] = set()  # the compiling children running now, from any thread (`verify -j N`)
_LIVE_LOCK = threading.Lock()


def kill_children() -> None:
    """Ends every compiling child still running: a Ctrl-C reaches the main thread only, while `-j N`
    waits for its children in other threads."""
    with _LIVE_LOCK:
        for proc in _LIVE:
            if proc.poll() is None:
                proc.kill()


def _run_child(case: Any, work: Path, log: Any, env: dict[str, str], limit: float) -> int:
    """Runs the compiling child; its exit status. The compile it starts may take `limit` seconds (the
    child bounds the user's code itself); a Ctrl-C here (or any other way out) ends the child too."""
    proc = subprocess.Popen([sys.executable, "-m", "sharding_dump.commands.verify.child", str(work)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env)
    with _LIVE_LOCK:
        _LIVE.add(proc)
    try:
        while True:
            try:
                return proc.wait(timeout=POLL_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            try:
                started = (work / COMPILING).stat().st_mtime
            except FileNotFoundError:
                continue
            if time.time() - started > limit:
                raise BadInput(f"verify {case.label}: compiling the training step did not finish within the time limit "
                               f"of {seconds_text(limit)} ({LIMIT_HINT})")
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(proc)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _child_failure(returncode: int, answer: dict[str, Any], log_text: str) -> str:
    """Why the compiling child failed, by its own account when it gave one (an error it caught, such
    as MemoryError), else by the signal that killed it, else by the last line it wrote."""
    if answer.get("error"):
        return f"the compiling process failed with {answer['error']}"
    tail = [line.strip() for line in log_text.splitlines() if line.strip()][-1:]
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if name == "SIGKILL":  # no last words: the kernel's OOM killer gives none
            return f"the compiling process was killed by {name} (the kernel's out-of-memory killer sends it when " \
                   "memory runs out)"
        return f"the compiling process was killed by {name}" + (f": {tail[0][:500]}" if tail else "")
    return f"the compiling process exited with status {returncode}: {(tail or ['(no output)'])[0][:500]}"


def case_request(case: Any) -> dict[str, Any]:
    """The case as the child rebuilds it."""
    return {"model": case.model, "topology": case.topology, "rule": case.rule, "num_slices": case.num_slices,
            "overrides": {k: v for k, v in case.overrides}}


def check_tpu_available() -> None:
    """--tpu needs libtpu (the `sharding-dump[tpu]` extra): BadInput naming the fix when it is absent."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise BadInput("--tpu: libtpu is not installed; install the extra with `pip install 'sharding-dump[tpu]'` "
                       "(it compiles for the real TPU topology, no TPU needed)")


def check_tpu_case(case: Any) -> None:
    """--tpu needs a TPU topology of the table."""
    if case.topology not in tpu_topologies():
        raise BadInput(f"--tpu: {case.label}: topology {case.topology!r} is not a TPU slice "
                       f"(e.g. v5p-16, v6e-16, tpu7x-8); run without --tpu to compile on CPU")


def verify_case(case: Any, options: Options) -> CaseResult:
    """Compiles the case's training step in a child process and checks it."""
    from sharding_dump.zoo.topology import load_topology

    topology = load_topology(case.topology, case.num_slices)
    golden = golden_specs(case, options.golden_dir)
    limit = current_limit()
    request = {"case": case_request(case), "golden": golden, "threshold": options.replicated_threshold,
               "tpu": options.tpu, "tpu_topology": tpu_topologies().get(case.topology) if options.tpu else None,
               "time_limit": limit}
    result = CaseResult(case.label, "tpu" if options.tpu else "cpu", topology.num_devices,
                        topology.hbm_bytes_per_device, threshold=options.replicated_threshold)
    if golden is None:
        result.golden_missing = case.command(str(options.golden_dir))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sharding-dump-verify-") as tmp:
        work = Path(tmp)
        (work / "request.json").write_text(json.dumps(request), encoding="utf-8")
        with open(work / "xla.log", "wb") as log:  # the child's fd 2: XLA's C++ warnings land here
            returncode = _run_child(case, work, log, _child_env(topology.num_devices, options.tpu, work), limit)
        log_text = (work / "xla.log").read_text(encoding="utf-8", errors="replace")
        answer_path = work / "result.json"
        answer = json.loads(answer_path.read_text(encoding="utf-8")) if answer_path.is_file() else {}
        if answer.get("bad_input"):  # the case's own bad input (a program that fails): the child's line
            raise BadInput(answer["bad_input"]) from TracebackText(answer["traceback"]) if answer.get("traceback") else None
        if returncode != 0 or not answer or answer.get("error"):
            result.compile_error = _child_failure(returncode, answer, log_text)
            result.wall_seconds = time.perf_counter() - start
            return result
    result.wall_seconds = time.perf_counter() - start
    result.jax_version = answer["jax_version"]
    result.cpu_seconds, result.peak_rss_bytes = answer["cpu_seconds"], answer["peak_rss_bytes"]
    result.compile_error = answer.get("compile_error") or ""
    result.memory = answer.get("memory") or {}
    result.collectives = {k: Traffic(**v) for k, v in (answer.get("collectives") or {}).items()}
    result.replicated = [Replicated(**r) for r in answer.get("replicated") or []]
    result.mismatches = [tuple(m) for m in answer.get("mismatches") or []]
    result.remats = rematerializations(log_text)
    if not result.compile_error:
        compare_figures(case, options, result)
    return result


