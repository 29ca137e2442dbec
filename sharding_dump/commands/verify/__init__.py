"""`sharding-dump verify`: compile a case's real training step and report what an abstract dump cannot see.

The dump proves the state's layout; it cannot tell whether XLA partitions the step well. `verify`
compiles one training step of the case (forward, backward, AdamW update) with
`jax.jit(step, in_shardings=state+batch, out_shardings=state+loss, donate the state)` in a child
process (:mod:`sharding_dump.commands.verify.child`), so that the number of fake CPU devices can be set before
jax starts, and reports per case:

- involuntary full rematerializations: XLA's partitioner could not reshard a value and replicated it
  (a failure). XLA writes these warnings from C++ to file descriptor 2, so the child's fd 2 goes to a
  file that is parsed here;
- values XLA keeps whole on every device after sharding propagation, above a size threshold (a
  failure), read from the module as it stands after propagation, before partitioning;
- per-device memory from XLA's own analysis (arguments, outputs, aliases, temporaries) and whether it
  fits the topology's HBM: on CPU an estimate (XLA:CPU schedules and fuses unlike a TPU), so
  informative; with `--tpu` XLA's own verdict for the real chip, a failure when it does not fit;
- collectives per step (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute),
  count and per-device bytes, loop bodies multiplied by their trip counts;
- that the compiled state shardings equal the golden's, leaf for leaf (a failure otherwise).

With `--record`, the compiled figures are written beside the case's golden as
`compiled_<backend>_jax-<version>.json`; a later run on the same backend and jax version compares
with them (a failure when they differ, like a golden). Other backends' files are left alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from sharding_dump.errors import BadInput
from sharding_dump.resources import DATA_DIR, load_yaml

SETTINGS_FILE = DATA_DIR / "verify.yml"
TPU_TOPOLOGIES_FILE = DATA_DIR / "tpu_topologies.tsv"
FORMATS = ("text", "markdown", "json")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
FIGURES_PREFIX = "compiled_"


# --- the training step, from the harness (the one place verify reaches into its internals) ----------

@dataclasses.dataclass
class StepParts:
    """What the child compiles: the step, its abstract inputs and their layouts on the case's mesh."""

    step: Any  # (state, batch) -> (new state, loss)
    state: Any  # abstract state, unboxed
    batch: dict[str, Any]  # abstract batch
    state_specs: dict[str, Any]  # leaf path -> PartitionSpec
    batch_spec: Any  # PartitionSpec of every batch field, as the data pipeline delivers it
    axis_names: tuple[str, ...]
    ici: tuple[int, ...]  # per axis, within a slice
    dcn: tuple[int, ...]  # per axis, across slices
    logical_axis_rules: Any  # made current while the step is traced
    stacks: frozenset[tuple[int, ...]]  # sorted dims of every state leaf stacked over layers (stack_dims)
    allow_split: bool  # allow_split_physical_axes: how the TPU device mesh is built


def _build_step(case: Any) -> StepParts:
    """The case's training step from the harness: setup, abstract state, step function, layouts."""
    from sharding_dump.zoo import dump
    from sharding_dump.core.layout import unbox
    from sharding_dump.core.step import abstract_batch

    setup, layouts = dump.case_layouts(case)
    abstract = unbox(dump.abstract_state_of(setup))
    stacks = stack_dims(layouts, stack_axes())
    return StepParts(dump.case_step(setup), abstract, abstract_batch(setup.batch.shape),
                     {t.path: t.partition_spec for t in layouts}, setup.batch.pipeline_spec,
                     setup.plan.axis_names, setup.plan.ici, setup.plan.dcn, setup.rule_set.logical_axis_rules,
                     stacks, bool(setup.values["allow_split_physical_axes"]))


def leaf_path(key_path: Sequence[Any]) -> str:
    """A state leaf's path as the goldens write it."""
    from sharding_dump.zoo import state

    return state.path_text(key_path)


# --- settings -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Options:
    """What one verify run checks and where it reads and writes."""

    replicated_threshold: int  # bytes: a value held whole by every device above this is a failure
    golden_dir: Path
    record: bool = False
    tpu: bool = False


@functools.cache
def _settings() -> dict[str, Any]:
    data = load_yaml(SETTINGS_FILE, "verify settings")
    for field in ("replicated_threshold", "stack_axes"):
        if not isinstance(data, dict) or field not in data:
            raise BadInput(f"verify settings {SETTINGS_FILE}: field {field}: missing")
    return data


def default_threshold() -> int:
    """`replicated_threshold` of data/verify.yml, in bytes."""
    return parse_size(str(_settings()["replicated_threshold"]), f"verify settings {SETTINGS_FILE}: field replicated_threshold")


def stack_axes() -> tuple[str, ...]:
    """`stack_axes` of data/verify.yml: the logical axes a scan stacks layers on."""
    axes = _settings()["stack_axes"]
    if not isinstance(axes, list) or not all(isinstance(a, str) and a for a in axes):
        raise BadInput(f"verify settings {SETTINGS_FILE}: field stack_axes: give a list of logical axis names")
    return tuple(axes)


_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_size(text: str, what: str = "--replicated-threshold") -> int:
    """`256MiB`, `1.5 GiB`, `1000000` -> bytes; BadInput on anything else."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2) not in _UNITS:
        raise BadInput(f"{what} {text!r}: give a size such as 256MiB, 1.5GiB or a number of bytes "
                       f"(units: {', '.join(u for u in _UNITS if u)})")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@functools.cache
def tpu_topologies() -> dict[str, str]:
    """Slice name -> XLA topology name (e.g. v6e-16 -> v6e:4x4)."""
    rows = [line.split("\t") for line in TPU_TOPOLOGIES_FILE.read_text(encoding="utf-8").splitlines()
            if line and not line.startswith("#")]
    return {name: topo for name, topo in rows[1:]}


# --- HLO text: collectives, replicated values ------------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([^ ]+) = (.*)$")
_CALLEE = re.compile(r"\b(?:calls|body|condition|to_apply)=%([^\s,)}]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (`f32[8,128]{1,0}`, or a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """`TYPE opcode(...)...` -> (TYPE, remainder); a tuple type is matched to its closing parenthesis."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 2:]
    return rest, ""


def _tuple_items(type_text: str) -> list[str]:
    """The top-level elements of a tuple type."""
    items, depth, start = [], 0, 1
    for i, ch in enumerate(type_text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            items.append(type_text[start:i].strip())
            start = i + 1
    return [re.sub(r"/\*.*?\*/", "", item).strip() for item in items]


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str
    opcode: str
    text: str  # the rest of the line: operands and attributes


def computations(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
    """{computation name: its instructions} and the name of the entry computation."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if not line.startswith((" ", "}")) and line.endswith("{") and " -> " in line:
            head = line.split(" ", 2)
            is_entry = head[0] == "ENTRY"
            current = (head[1] if is_entry else head[0]).lstrip("%")
            comps[current] = []
            if is_entry:
                entry = current
            continue
        match = _INSTRUCTION.match(line) if current is not None else None
        if match:
            type_text, rest = _split_type(match.group(2))
            opcode = rest.split("(", 1)[0].strip()
            comps[current].append(Instruction(match.group(1), type_text, opcode, rest))
    return comps, entry


@dataclasses.dataclass
class Traffic:
    """One kind of collective over one step."""

    count: int = 0
    bytes: int = 0  # per device: each collective's result, summed


def _collective_kind(opcode: str) -> str | None:
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVES else None


def _result_bytes(inst: Instruction) -> int:
    """Bytes a collective produces: an async all-gather / collective-permute start holds (operand,
    result, ...), of which the result counts."""
    if inst.opcode in ("all-gather-start", "collective-permute-start") and inst.type.startswith("("):
        items = _tuple_items(inst.type)
        return array_bytes(items[1]) if len(items) > 1 else array_bytes(inst.type)
    return array_bytes(inst.type)


_CONDITION = re.compile(r"\bcondition=%([^\s,)}]+)")
_CONSTANT = re.compile(r"constant\((-?[0-9]+)\)")


def _trip_count(loop: Instruction, comps: dict[str, list[Instruction]]) -> int:
    """How many times a while loop runs: XLA's `known_trip_count` (XLA:CPU writes it), else the bound
    of its condition `counter < N` with the counter starting at 0, as a scan's loop is (XLA:TPU
    writes no trip count); 1 when neither is there."""
    trip = _TRIP_COUNT.search(loop.text)
    if trip:
        return int(trip.group(1))
    condition = _CONDITION.search(loop.text)
    insts = comps.get(condition.group(1), []) if condition else []
    constants = {i.name: int(m.group(1)) for i in insts if i.opcode == "constant" and (m := _CONSTANT.search(i.text))}
    for inst in insts:
        if inst.opcode == "compare" and "direction=LT" in inst.text:
            operands = re.findall(r"%([^\s,)]+)", inst.text.split(")", 1)[0])
            if len(operands) == 2 and operands[1] in constants and constants[operands[1]] > 0:
                return constants[operands[1]]
    return 1


def collectives(hlo: str) -> dict[str, Traffic]:
    """Collectives of one execution of the compiled module's entry computation, loop bodies counted
    once per iteration (:func:`_trip_count`)."""
    comps, entry = computations(hlo)

    @functools.cache
    def within(name: str) -> tuple[tuple[int, int], ...]:
        totals = [[0, 0] for _ in COLLECTIVES]
        for inst in comps.get(name, ()):
            kind = _collective_kind(inst.opcode)
            if kind is not None:
                totals[COLLECTIVES.index(kind)][0] += 1
                totals[COLLECTIVES.index(kind)][1] += _result_bytes(inst)
            callees = _CALLEE.findall(inst.text)
            for listed in _CALLEE_LIST.findall(inst.text):
                callees += [c.strip().lstrip("%") for c in listed.split(",") if c.strip()]
            times = _trip_count(inst, comps) if inst.opcode == "while" else 1
            for callee in callees:
                for i, (count, size) in enumerate(within(callee)):
                    totals[i][0] += times * count
                    totals[i][1] += times * size
        return tuple((c, b) for c, b in totals)

    return {kind: Traffic(c, b) for kind, (c, b) in zip(COLLECTIVES, within(entry))}


_SKIP_OPCODES = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all"})


def _shards(sharding: str, rank: int) -> int | None:
    """How many pieces an HLO sharding splits a value of `rank` into; None for manual / maximal /
    unknown ones (not a replication question)."""
    if sharding == "replicated":
        return 1
    match = re.match(r"devices=\[([0-9,]+)\]", sharding)
    if not match:
        return None
    dims = [int(d) for d in match.group(1).split(",")]
    return math.prod(dims[:rank])


@dataclasses.dataclass(frozen=True)
class Replicated:
    """A large value every device holds whole: so annotated after sharding propagation
    (`propagation`), or gathered whole by the partitioner (`all-gather`, e.g. a layer stack split on
    its layer axis, which the scan can only slice once it is gathered)."""

    where: str  # propagation | all-gather
    shape: str
    bytes: int  # per device
    op_name: str
    count: int  # instructions of that shape and source


def replicated_values(hlo: str, threshold: int) -> list[Replicated]:
    """Values of at least `threshold` bytes that every device holds whole, in the module after sharding
    propagation (global shapes, a `sharding=` on every instruction); grouped by shape and source op."""
    found: dict[tuple[str, str], list[int]] = {}
    for insts in computations(hlo)[0].values():
        for inst in insts:
            if inst.type.startswith("(") or inst.opcode in _SKIP_OPCODES:
                continue
            size = array_bytes(inst.type)
            if size < threshold:
                continue
            match = re.search(r"sharding=\{([^{}]*)\}", inst.text)
            array = _ARRAY.search(inst.type)
            rank = len([d for d in array.group(2).split(",") if d]) if array else 0
            if not match or _shards(match.group(1), rank) != 1:
                continue
            op = _OP_NAME.search(inst.text)
            shape = inst.type.split("{", 1)[0]
            entry = found.setdefault((shape, op.group(1) if op else inst.opcode), [size, 0])
            entry[1] += 1
    return _grouped("propagation", found)


def _grouped(where: str, found: dict[tuple[str, str], list[int]]) -> list[Replicated]:
    values = [Replicated(where, shape, size, op, count) for (shape, op), (size, count) in found.items()]
    return sorted(values, key=lambda v: (-v.bytes, v.op_name, v.shape))


def stack_dims(layouts: Sequence[Any], axes: Sequence[str]) -> frozenset[tuple[int, ...]]:
    """Sorted dimensions of every value that holds a whole layer stack on one device: for each state
    leaf with a stacked axis (one of `axes`), its per-device shape with that axis made whole and any
    other axis whole or split, less the shapes a device already holds of some leaf (ZeRO-1 gathers
    its updated parameters to exactly their own shape). Sorted, so the order the partitioner puts the
    dimensions in does not matter.

    >>> from sharding_dump.core.layout import TensorLayout
    >>> from jax.sharding import PartitionSpec as P
    >>> stack = TensorLayout("params/w", (1024, 28, 3072), "float32", ("embed", "layers", "mlp"),
    ...                      P("tensor", "fsdp"), {"fsdp": 2, "tensor": 2})
    >>> sorted(stack_dims([stack], ["layers"]))
    [(28, 512, 3072), (28, 1024, 3072)]
    """
    import itertools

    held = {tuple(sorted(t.per_device_shape)) for t in layouts}
    out = set()
    for t in layouts:
        local = t.per_device_shape
        for k, axis in enumerate(t.logical_axes or ()):
            if axis not in axes or t.shape[k] < 2:
                continue
            choices = [(t.shape[i],) if i == k else tuple({local[i], t.shape[i]}) for i in range(len(t.shape))]
            out.update(tuple(sorted(dims)) for dims in itertools.product(*choices))
    return frozenset(out - held)


def gathered_values(hlo: str, threshold: int, stacks: frozenset[tuple[int, ...]]) -> list[Replicated]:
    """All-gathers of the compiled (partitioned) module that rebuild a whole layer stack on one device:
    a result of at least `threshold` bytes whose dimensions are those of a whole stack (see
    :func:`stack_dims`). A scan slices one layer per step, so a stack split on its layer axis is gathered
    whole, with no warning. FSDP's gather of one layer's weight, of an unscanned weight (embedding,
    logits) or of an activation is how the rules work, not a finding, whatever its size."""
    found: dict[tuple[str, str], list[int]] = {}
    for insts in computations(hlo)[0].values():
        for inst in insts:
            if _collective_kind(inst.opcode) != "all-gather":
                continue
            size = _result_bytes(inst)
            if size < threshold:
                continue
            shape = inst.type if not inst.type.startswith("(") else _tuple_items(inst.type)[-1]
            array = _ARRAY.search(shape)
            dims = tuple(sorted(int(d) for d in array.group(2).split(",") if d)) if array else ()
            if dims not in stacks:
                continue
            op = _OP_NAME.search(inst.text)
            entry = found.setdefault((re.sub(r"\{[^}]*\}", "", shape), op.group(1) if op else inst.opcode), [size, 0])
            entry[1] += 1
    return _grouped("all-gather", found)


# --- XLA's log: involuntary full rematerializations --------------------------------------------------

_REMAT = re.compile(r"Involuntary full rematerialization\..*? from sharding (\{.*?\}) to (\{.*?\}) "
                    r"(?:efficiently |without doing a full rematerialization of the tensor )?"
                    r"for HLO operation (%\S+) = (\S+)")


_TRIAL_INPUT = "%fake_parameter"


@dataclasses.dataclass(frozen=True)
class Remat:
    """XLA could not reshard a value and rebuilt it whole on every device, then split it again.

    `trial`: the instruction reads a `%fake_parameter`, the stand-in input of a scratch computation
    the partitioner builds to try a partitioning strategy (e.g. a dot's) before choosing one; such a
    warning is about a candidate, not the compiled program, so it is listed but not a failure."""

    instruction: str
    shape: str
    from_sharding: str
    to_sharding: str
    op_name: str
    trial: bool = False


def rematerializations(log: str) -> list[Remat]:
    """Every involuntary full rematerialization XLA logged, once each, in log order."""
    out: list[Remat] = []
    for line in log.splitlines():
        if "Involuntary full rematerialization" not in line:
            continue
        match = _REMAT.search(line)
        op = _OP_NAME.search(line)
        if match:
            remat = Remat(match.group(3), match.group(4).split("{", 1)[0], match.group(1), match.group(2),
                          op.group(1) if op else "", _TRIAL_INPUT in line.split(" for HLO operation ", 1)[-1])
        else:  # a wording this parser does not know: keep the whole line rather than lose the warning
            remat = Remat("", "", "", "", line.split("] ", 1)[-1][:400])
        if remat not in out:
            out.append(remat)
    return out


# --- one case -------------------------------------------------------------------------------------

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


def format_bytes(count: int | None) -> str:
    from sharding_dump.commands.tables import format_bytes as fmt

    return fmt(count)


def _golden_specs(case: Any, root: Path) -> dict[str, Any] | None:
    """Leaf path -> partition spec (JSON form) of the case's named golden; None when there is none."""
    from sharding_dump.golden import codec
    from sharding_dump.zoo.case import golden_dir

    path = golden_dir(case, root) / "named_shardings.json"
    if not path.is_file():
        return None
    return {p: entry["partition_spec"] for p, entry in codec.read_document(path)["tensors"].items()}


def _child_env(devices: int, tpu: bool, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if not tpu:  # with --tpu the devices come from libtpu's topology description, no backend needed
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    else:  # libtpu logs to files of its own: its warnings (the partitioner's among them) go to fd 2
        env.update(TPU_STDERR_LOG_LEVEL="1", TPU_MIN_LOG_LEVEL="1", TPU_LOG_DIR=str(work))
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1])] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


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
    golden = _golden_specs(case, options.golden_dir)
    request = {"case": case_request(case), "golden": golden, "threshold": options.replicated_threshold,
               "tpu": options.tpu, "tpu_topology": tpu_topologies().get(case.topology) if options.tpu else None}
    result = CaseResult(case.label, "tpu" if options.tpu else "cpu", topology.num_devices,
                        topology.hbm_bytes_per_device, threshold=options.replicated_threshold)
    if golden is None:
        result.golden_missing = case.command(str(options.golden_dir))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sharding-dump-verify-") as tmp:
        work = Path(tmp)
        (work / "request.json").write_text(json.dumps(request), encoding="utf-8")
        with open(work / "xla.log", "wb") as log:  # the child's fd 2: XLA's C++ warnings land here
            proc = subprocess.run([sys.executable, "-m", "sharding_dump.commands.verify.child", str(work)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                  env=_child_env(topology.num_devices, options.tpu, work))
        log_text = (work / "xla.log").read_text(encoding="utf-8", errors="replace")
        answer_path = work / "result.json"
        if proc.returncode != 0 or not answer_path.is_file():
            tail = [line for line in log_text.splitlines() if line.strip()][-1:] or ["(no output)"]
            result.compile_error = f"the compiling process exited with status {proc.returncode}: {tail[0][:500]}"
            result.wall_seconds = time.perf_counter() - start
            return result
        answer = json.loads(answer_path.read_text(encoding="utf-8"))
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
        _compare_figures(case, options, result)
    return result


def figures_path(case: Any, root: Path, backend: str, jax_version: str) -> Path:
    """Where --record keeps a case's compiled figures: beside its golden, keyed by backend and jax."""
    from sharding_dump.zoo.case import golden_dir

    return golden_dir(case, root) / f"{FIGURES_PREFIX}{backend}_jax-{jax_version}.json"


def _flat(doc: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(doc, dict):
        for key in sorted(doc):
            yield from _flat(doc[key], f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, doc


def _compare_figures(case: Any, options: Options, result: CaseResult) -> None:
    """Compares with (or, under --record, writes) the figures recorded for this backend and jax version."""
    from sharding_dump.golden import codec
    from sharding_dump.golden.engine import display

    path = figures_path(case, options.golden_dir, result.backend, result.jax_version)
    result.figures_file = display(path)
    now = result.figures()
    if options.record:
        data = codec.canonical_bytes(now)
        if not path.is_file() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            codec.write_atomic(path, data)
            result.figures_written = True
        return
    if not path.is_file():
        result.figures_file = ""
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise BadInput(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None
    old_flat, new_flat = dict(_flat(old)), dict(_flat(now))
    result.figures_changed = [(k, old_flat.get(k), new_flat.get(k)) for k in sorted({*old_flat, *new_flat})
                              if old_flat.get(k) != new_flat.get(k)]


# --- rendering --------------------------------------------------------------------------------------

MAX_LISTED = 10  # remats / replicated values / mismatches listed per case in text and markdown


def _memory_line(r: CaseResult) -> str:
    m = r.memory
    parts = [f"arguments {format_bytes(m['argument'])}", f"outputs {format_bytes(m['output'])}",
             f"aliased {format_bytes(m['alias'])}", f"temporaries {format_bytes(m['temp'])}",
             f"peak {format_bytes(r.peak_bytes)}"]
    if r.hbm_bytes is None:
        verdict = "no HBM limit for this topology"
    else:
        verdict = f"{'fits' if r.fits else 'does NOT fit'} {format_bytes(r.hbm_bytes)} HBM"
    where = "XLA:CPU estimate, not the chip's figure" if r.backend == "cpu" else "XLA:TPU, the real chip"
    return f"memory per device ({where}): {', '.join(parts)}; {verdict}"


def _collective_cells(r: CaseResult) -> list[list[str]]:
    return [[kind, str(r.collectives[kind].count), format_bytes(r.collectives[kind].bytes)]
            for kind in COLLECTIVES if kind in r.collectives]


def render_case(r: CaseResult, fmt: str = "text") -> str:
    """One case's block (text or markdown)."""
    from sharding_dump.commands import tables

    md = fmt == "markdown"
    wrap = tables.code if md else str
    bullet = "- " if md else "  "
    status = "FAILED" if r.failures else "ok"
    lines = [f"#### {r.label}: {status}" if md else f"{r.label}: {status} ({r.backend}, {r.devices} devices, "
             f"{r.cpu_seconds:.1f} s CPU, {format_bytes(r.peak_rss_bytes)} peak RSS)"]
    lines += [f"{bullet}FAIL {f}" for f in r.failures]
    if r.compile_error and not r.memory:
        return "\n".join(lines)
    for remat in r.remats[:MAX_LISTED]:
        kind = "remat, in a partitioner trial, not a failure" if remat.trial else "remat"
        lines.append(f"{bullet}[{kind}] {wrap(remat.op_name or remat.instruction)} {remat.shape}: "
                     f"{wrap(remat.from_sharding)} -> {wrap(remat.to_sharding)}")
    for value in r.replicated[:MAX_LISTED]:
        kind = "replicated" if value.where == "propagation" else "gathered"
        lines.append(f"{bullet}[{kind}] {wrap(value.op_name)} {value.shape} {format_bytes(value.bytes)}"
                     + (f" ({value.count} instructions)" if value.count > 1 else ""))
    for path, golden, compiled in r.mismatches[:MAX_LISTED]:
        lines.append(f"{bullet}[sharding] {wrap(path)}: golden {json.dumps(golden)}, compiled {json.dumps(compiled)}")
    for key, old, new in r.figures_changed[:MAX_LISTED]:
        lines.append(f"{bullet}[figures] {key}: recorded {old}, now {new}")
    listed = max(len(r.remats), len(r.replicated), len(r.mismatches), len(r.figures_changed))
    if listed > MAX_LISTED:
        lines.append(f"{bullet}... more than {MAX_LISTED} of a kind: --format json lists every one")
    if r.memory:
        lines.append(bullet + _memory_line(r))
    if r.figures_written:
        lines.append(f"{bullet}recorded figures in {r.figures_file}")
    cells = _collective_cells(r)
    if cells:
        lines.append("")
        table = tables.render(["collective per step", "count", "bytes/device"], cells, fmt, right=(1, 2))
        lines += table.splitlines() if md else ["    " + line for line in table.splitlines()]
    return "\n".join(lines)


def render(results: list[CaseResult], fmt: str) -> str:
    """The whole report: JSON (every case, every item), or a summary plus one block per case."""
    if fmt == "json":
        from sharding_dump.golden import codec

        doc = {"failed": any(r.failures for r in results), "cases": [r.to_json() for r in results]}
        return codec.canonical_bytes(doc).decode("utf-8")
    failed = [r for r in results if r.failures]
    title = f"sharding-dump verify: {len(failed)} of {len(results)} case{'s' * (len(results) != 1)} failed"
    blocks = [f"### {title}" if fmt == "markdown" else title] + [render_case(r, fmt) for r in results]
    return "\n\n".join(blocks) + "\n"


# --- the command ---------------------------------------------------------------------------------------

def command(argv: Sequence[str]) -> int:
    """`sharding-dump verify CASE|--all [options]`: exit 0 when every case is clean, 1 on any failure."""
    from sharding_dump.commands import cli

    parser = cli._Parser(
        prog="sharding-dump verify",
        description="Compile one case's (or every case's) real training step on fake CPU devices and report "
                    "involuntary full rematerializations, large values XLA keeps replicated, per-device memory "
                    "(a CPU estimate; --tpu for the real chip), collectives per step, and whether the compiled "
                    "state shardings equal the golden's. Exit 1 on any failure, 0 when clean.")
    cli._add_case_options(parser, "verify every case of the case matrix")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="text (terminal), markdown (pull-request comment) or json; default text")
    parser.add_argument("--replicated-threshold", metavar="SIZE",
                        help=f"smallest value (e.g. 64MiB) that may not be replicated on every device "
                             f"(default: {SETTINGS_FILE.name})")
    parser.add_argument("--golden-dir", metavar="DIR",
                        help="golden tree the compiled shardings are compared with (default: golden-dir of "
                             "[tool.sharding-dump], else golden/)")
    parser.add_argument("--record", action="store_true",
                        help="write the compiled figures beside each case's golden, keyed by backend and jax version")
    parser.add_argument("--tpu", action="store_true",
                        help="compile ahead of time for the case's real TPU topology (needs libtpu: "
                             "pip install 'sharding-dump[tpu]'; no TPU needed)")
    cli._add_settings_argument(parser)
    args = parser.parse_args(argv)
    threshold = default_threshold() if args.replicated_threshold is None else parse_size(args.replicated_threshold)
    project = cli._project(args)
    cases = cli._cases(args, "verifies", project)
    if args.tpu:
        check_tpu_available()
        for case in cases:
            check_tpu_case(case)
    options = Options(threshold, project.golden_dir, record=args.record, tpu=args.tpu)
    for case in cases:  # an unreadable golden is bad input before any compile
        _golden_specs(case, options.golden_dir)
    results = []
    for index, case in enumerate(cases, 1):
        result = verify_case(case, options)
        results.append(result)
        prefix = f"[{index}/{len(cases)}] " if len(cases) > 1 else ""
        if args.format == "text":
            print(prefix + render_case(result, "text") + "\n", flush=True)
        else:  # stdout is the report to paste or parse; progress goes to stderr
            status = "FAILED" if result.failures else "ok"
            print(f"{prefix}{result.label}: {status} ({result.wall_seconds:.1f}s)", file=sys.stderr, flush=True)
    if args.format == "text":
        failed = sum(1 for r in results if r.failures)
        print(f"{len(results)} case{'s' * (len(results) != 1)} verified, {failed} failed")
    else:
        sys.stdout.write(render(results, args.format))
    return 1 if any(r.failures for r in results) else 0
