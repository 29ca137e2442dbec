"""Accelerator topologies: how many devices one slice has, how many slices, HBM per device.

The table is `data/topologies.tsv` (TPU names from MaxText's published table, 8-GPU hosts); `cpu-N`
is any N CPU devices. Multi-slice (DCN) topologies are the same slice repeated `num_slices` times.

>>> t = load_topology("v5p-16", num_slices=2)
>>> (t.devices_per_slice, t.num_slices, t.num_devices)
(8, 2, 16)
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import re

from sharding_dump.errors import BadInput
from sharding_dump.resources import DATA_DIR

GIB = 1024**3
_CPU_NAME = re.compile(r"cpu-([1-9][0-9]*)")


@dataclasses.dataclass(frozen=True)
class Topology:
    """One (accelerator name, number of slices) pair."""

    name: str
    platform: str  # tpu | gpu | cpu
    chip: str
    devices_per_slice: int
    devices_per_host: int
    hbm_bytes_per_device: int | None  # None: no limit known (cpu-N)
    num_slices: int = 1
    torus: tuple[int, ...] | None = None  # physical chip grid of one TPU slice (x, y, z); None off TPU
    device_kind: str | None = None  # the chip's device kind, as JAX's device-mesh builder names it

    @property
    def devices_per_chip(self) -> int:
        """JAX devices per chip (tpu7x: 2 TensorCores; 1 elsewhere)."""
        return self.devices_per_slice // math.prod(self.torus) if self.torus else 1

    @property
    def num_devices(self) -> int:
        return self.devices_per_slice * self.num_slices


@functools.cache
def _table() -> dict[str, Topology]:
    path = DATA_DIR / "topologies.tsv"
    with path.open(encoding="utf-8") as handle:
        rows = csv.DictReader((line for line in handle if not line.startswith("#")), delimiter="\t")
        return {
            row["name"]: Topology(
                name=row["name"],
                platform=row["platform"],
                chip=row["chip"],
                devices_per_slice=int(row["devices_per_slice"]),
                devices_per_host=int(row["devices_per_host"]),
                hbm_bytes_per_device=int(float(row["hbm_gib_per_device"]) * GIB),
                torus=tuple(int(d) for d in row["torus"].split("x")) if row["torus"] else None,
                device_kind=row["device_kind"] or None,
            )
            for row in rows
        }


def topology_names() -> list[str]:
    """Every accelerator name in the table (cpu-N is open-ended and listed as such)."""
    return sorted(_table(), key=_natural_key)


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def load_topology(name: str, num_slices: int = 1) -> Topology:
    """The topology called `name`, repeated over `num_slices` slices; unknown names are BadInput."""
    if not isinstance(num_slices, int) or isinstance(num_slices, bool) or num_slices < 1:
        raise BadInput(f"--num-slices {num_slices!r}: must be a whole number >= 1")
    match = _CPU_NAME.fullmatch(name)
    if match:
        n = int(match.group(1))
        return Topology(name, "cpu", "cpu", n, n, None, num_slices)
    table = _table()
    if name not in table:
        close = [t for t in topology_names() if t.split("-")[0] == name.split("-")[0]][:8]
        hint = f"e.g. {', '.join(close)}" if close else "see `sharding-dump list topologies`"
        raise BadInput(f"unknown topology {name!r}: valid names are in the topology table ({hint}) or cpu-N")
    return dataclasses.replace(table[name], num_slices=num_slices)
