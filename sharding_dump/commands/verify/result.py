"""What verify found for one case, as a value: its failures, its figures and its JSON form."""

from __future__ import annotations

import dataclasses
from typing import Any

from sharding_dump.golden.sizes import format_bytes
from sharding_dump.commands.verify.hlo import Replicated, Traffic
from sharding_dump.commands.verify.xla_log import Remat


@dataclasses.dataclass
class CaseResult:
    """Everything verify found for one case."""

    label: str
    backend: str  # cpu | tpu
    devices: int
    hbm_bytes: int | None  # per device, from the topology table
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # argument/output/alias/temp bytes
    collectives: dict[str, Traffic] = dataclasses.field(default_factory=dict)
    remats: list[Remat] = dataclasses.field(default_factory=list)
    replicated: list[Replicated] = dataclasses.field(default_factory=list)
    mismatches: list[tuple[str, Any, Any]] = dataclasses.field(default_factory=list)  # path, golden, compiled
    golden_missing: str = ""  # the command that creates the golden, when there is none
    compile_error: str = ""
    figures_changed: list[tuple[str, Any, Any]] = dataclasses.field(default_factory=list)
    figures_file: str = ""
    figures_written: bool = False
    jax_version: str = ""
    cpu_seconds: float = 0.0  # the child's user + system CPU time
    peak_rss_bytes: int = 0  # the child's peak resident set
    wall_seconds: float = 0.0
    threshold: int = 0

    @property
    def program_remats(self) -> list[Remat]:
        """The rematerializations of the compiled program (not of the partitioner's trials)."""
        return [r for r in self.remats if not r.trial]

    @property
    def peak_bytes(self) -> int | None:
        """Arguments + outputs not aliased to them + temporaries: what one device needs at the peak."""
        if not self.memory:
            return None
        m = self.memory
        return m["argument"] + m["output"] - m["alias"] + m["temp"]

    @property
    def fits(self) -> bool | None:
        peak = self.peak_bytes
        return None if peak is None or self.hbm_bytes is None else peak <= self.hbm_bytes

    @property
    def failures(self) -> list[str]:
        """One line per failed check."""
        out = []
        if self.compile_error:
            out.append(f"compile failed: {self.compile_error}")
        if self.program_remats:
            n = len(self.program_remats)
            out.append(f"{n} involuntary full rematerialization{'s' * (n != 1)}")
        if self.replicated:
            out.append(f"{len(self.replicated)} value{'s' * (len(self.replicated) != 1)} of "
                       f"{format_bytes(self.threshold)} or more per device replicated after propagation "
                       f"or rebuilt by one all-gather")
        if self.golden_missing:
            out.append(f"no golden to compare the compiled shardings with (create it with: {self.golden_missing})")
        if self.mismatches:
            out.append(f"{len(self.mismatches)} state leaves compiled with a sharding other than the golden's")
        if self.backend == "tpu" and self.fits is False:
            out.append("does not fit the chip's HBM")
        if self.figures_changed:
            out.append(f"compiled figures differ from {self.figures_file} (rerun with --record if intended)")
        return out

    def figures(self) -> dict[str, Any]:
        """The backend-specific figures --record writes beside the golden."""
        return {
            "kind": "compiled",
            "format_version": 1,
            "backend": self.backend,
            "jax_version": self.jax_version,
            "devices": self.devices,
            "memory_per_device": dict(sorted(self.memory.items())),
            "collectives_per_step": {k: {"count": t.count, "bytes": t.bytes} for k, t in sorted(self.collectives.items())},
            "involuntary_rematerializations": len(self.program_remats),
            "replicated_values": len(self.replicated),
        }

    def to_json(self) -> dict[str, Any]:
        """The case as `--format json` shows it: findings and figures, no timings (same bytes every run)."""
        return {
            "case": self.label, "backend": self.backend, "devices": self.devices,
            "ok": not self.failures, "failures": self.failures,
            "memory_per_device": {**self.memory, "peak": self.peak_bytes, "hbm": self.hbm_bytes, "fits": self.fits,
                                  "estimate": self.backend == "cpu"},
            "collectives_per_step": {k: dataclasses.asdict(t) for k, t in self.collectives.items()},
            "involuntary_rematerializations": [dataclasses.asdict(r) for r in self.remats],
            "replicated_values": [dataclasses.asdict(r) for r in self.replicated],
            "replicated_threshold": self.threshold,
            "sharding_mismatches": [{"tensor": p, "golden": g, "compiled": c} for p, g, c in self.mismatches],
            "figures_file": self.figures_file or None,
            "figures_changed": [{"figure": k, "recorded": o, "now": n} for k, o, n in self.figures_changed],
            "jax_version": self.jax_version,
        }





