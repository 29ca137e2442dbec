"""Accelerator topologies: how many devices one slice has, how many slices, HBM per device.

The table is `data/topologies.tsv` (TPU names from MaxText's published table, 8-GPU hosts); `cpu-N`
is any N CPU devices. Multi-slice (DCN) topologies are the same slice repeated `num_slices` times.

>>> t = load_topology("v5p-16", num_slices=2)
>>> (t.devices_per_slice, t.num_slices, t.num_devices)
(8, 2, 16)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from sharding_dump.errors import BadInput, shown
from sharding_dump.resources import DATA_DIR, MAX_DIGITS, read_text
from sharding_dump.zoo import settings

TOPOLOGIES_FILE = DATA_DIR / "topologies.tsv"
COLUMNS = ("name", "platform", "chip", "devices_per_slice", "devices_per_host", "hbm_gib_per_device", "torus",
           "device_kind")
PLATFORMS = ("tpu", "gpu")
_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{0,63}")

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
    """topologies.tsv, every row typed and bounded (a bad row is BadInput naming its line and column)."""
    text = read_text(TOPOLOGIES_FILE, "topology table", 1 << 20)
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.startswith("#")]
    where = f"topology table {TOPOLOGIES_FILE}"
    if not lines or tuple(lines[0][1].split("\t")) != COLUMNS:
        raise BadInput(f"{where}: the header line must be the columns {', '.join(COLUMNS)} (tab-separated)")
    table: dict[str, Topology] = {}
    for number, line in lines[1:]:
        row = dict(zip(COLUMNS, line.split("\t")))
        if line.count("\t") != len(COLUMNS) - 1:
            raise BadInput(f"{where}: line {number}: {len(line.split(chr(9)))} columns, expected {len(COLUMNS)}")
        at = f"{where}: line {number}"
        if not _NAME.fullmatch(row["name"]) or _CPU_NAME.fullmatch(row["name"]):
            raise BadInput(f"{at}: column name: {shown(row['name'])} is not a topology name (lowercase letters, "
                           "digits, '.', '-'; cpu-N is built in)")
        if row["name"] in table:
            raise BadInput(f"{at}: column name: {shown(row['name'])} is listed twice")
        if row["platform"] not in PLATFORMS:
            raise BadInput(f"{at}: column platform: {shown(row['platform'])} must be one of {', '.join(PLATFORMS)}")
        if not _NAME.fullmatch(row["chip"]):
            raise BadInput(f"{at}: column chip: {shown(row['chip'])} is not a chip name")
        per_slice = _whole(row["devices_per_slice"], f"{at}: column devices_per_slice", settings.limits().max_devices)
        per_host = _whole(row["devices_per_host"], f"{at}: column devices_per_host", per_slice)
        hbm = _number(row["hbm_gib_per_device"], f"{at}: column hbm_gib_per_device", 1 << 20)
        torus = _torus(row["torus"], f"{at}: column torus", per_slice)
        table[row["name"]] = Topology(row["name"], row["platform"], row["chip"], per_slice, per_host, int(hbm * GIB),
                                      torus=torus, device_kind=row["device_kind"] or None)
    return table


def _whole(text: str, where: str, maximum: int) -> int:
    """A whole number in [1, maximum] from the table, or BadInput naming where it stands."""
    if text.isdigit() and len(text) <= MAX_DIGITS and 1 <= int(text) <= maximum:
        return int(text)
    raise BadInput(f"{where}: {shown(text)} must be a whole number in [1, {maximum}]")


def _torus(text: str, where: str, devices: int) -> tuple[int, ...] | None:
    """`4x4x2` -> (4, 4, 2): the chip grid of one slice (empty off TPU); its product divides the slice."""
    if not text:
        return None
    dims = text.split("x")
    if len(dims) > 3 or not all(d.isdigit() and 1 <= int(d) <= devices for d in dims) \
            or devices % math.prod(int(d) for d in dims):
        raise BadInput(f"{where}: {shown(text)} must be up to three whole numbers joined by 'x' whose product "
                       f"divides the {devices} devices of the slice")
    return tuple(int(d) for d in dims)


def _number(text: str, where: str, maximum: float) -> float:
    try:
        value = float(text) if len(text) <= MAX_DIGITS else float("nan")
    except ValueError:
        value = float("nan")
    if not 0 < value <= maximum:  # also false for nan
        raise BadInput(f"{where}: {shown(text)} must be a number in (0, {maximum}]")
    return value


def topology_names() -> list[str]:
    """Every accelerator name in the table (cpu-N is open-ended and listed as such)."""
    return sorted(_table(), key=_natural_key)


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def load_topology(name: str, num_slices: int = 1) -> Topology:
    """The topology called `name`, repeated over `num_slices` slices; unknown names are BadInput."""
    max_devices = settings.limits().max_devices
    if (not isinstance(num_slices, int) or isinstance(num_slices, bool) or not 1 <= num_slices <= max_devices):
        raise BadInput(f"--num-slices {shown(num_slices)}: must be a whole number in [1, {max_devices}]")
    match = _CPU_NAME.fullmatch(name) if isinstance(name, str) else None
    if match:
        digits = match.group(1)
        if len(digits) > MAX_DIGITS or int(digits) > max_devices:
            raise BadInput(f"topology {shown(name)}: cpu-N takes N in [1, {max_devices}] devices")
        n = int(digits)
        found = Topology(name, "cpu", "cpu", n, n, None, num_slices)
    else:
        table = _table()
        if name not in table:
            close = [t for t in topology_names() if t.split("-")[0] == str(name).split("-")[0]][:8]
            hint = f"e.g. {', '.join(close)}" if close else "see `sharding-dump list topologies`"
            raise BadInput(f"unknown topology {shown(name)}: valid names are in the topology table ({hint}) or cpu-N")
        found = dataclasses.replace(table[name], num_slices=num_slices)
    if found.num_devices > max_devices:
        raise BadInput(f"topology {name} x --num-slices {num_slices}: {found.num_devices} devices, more than the "
                       f"limit of {max_devices}")
    return found
