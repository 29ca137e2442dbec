"""Reading XLA's HLO text: collectives per step (loop bodies times their trip counts), values
replicated after propagation, whole layer stacks rebuilt by one all-gather."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Sequence

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


# An HLO array type: element type, dimensions, layout (`s4[8,128]{1,0:E(4)}`). XLA's element types
# carry their width in bits in their names (pred, s4, u8, f8e4m3fn, f4e2m1fn, bf16, f32, c64; token and
# opaque hold no array), so every type, the float8 and sub-byte ones too, is counted without a table
# that would lag behind XLA; tests/commands/test_verify.py holds it to every dtype jax and ml_dtypes make.
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_ELEMENT_BITS = re.compile(r"(?:[sufc]|bf)([0-9]+)(?:e[0-9]+m[0-9]+[a-z0-9]*)?")
_PACKED_BITS = re.compile(r":.*\bE\(([0-9]+)\)")  # a layout's element size in bits (sub-byte types packed)
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([^ ]+) = (.*)$")
_CALLEE = re.compile(r"\b(?:calls|body|condition|to_apply)=%([^\s,)}]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"\}')
OP_NAME = re.compile(r'op_name="([^"]*)"')


def element_bits(element_type: str, layout: str = "") -> int:
    """Bits one element of an HLO element type takes in memory: its width rounded up to whole bytes
    (pred: 8), or the element size of a layout that packs it (`{1,0:E(4)}`); 0 for what holds no
    array (token, opaque).

    >>> [element_bits(t) for t in ("pred", "s4", "f8e4m3fn", "f8e4m3b11fnuz", "bf16", "c128", "token")]
    [8, 8, 8, 8, 16, 128, 0]
    >>> element_bits("f4e2m1fn", "1,0:E(4)")
    4
    """
    if element_type == "pred":
        return 8
    width = _ELEMENT_BITS.fullmatch(element_type)
    if width is None:
        return 0
    packed = _PACKED_BITS.search(layout)
    return int(packed.group(1)) if packed else -(-int(width.group(1)) // 8) * 8


def array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (`f32[8,128]{1,0}`, or a tuple of them)."""
    total = 0
    for element_type, dims, layout in _ARRAY.findall(type_text):
        count = math.prod(int(d) for d in dims.split(",") if d)
        total += -(-count * element_bits(element_type, layout) // 8)
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
            op = OP_NAME.search(inst.text)
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
            op = OP_NAME.search(inst.text)
            entry = found.setdefault((re.sub(r"\{[^}]*\}", "", shape), op.group(1) if op else inst.opcode), [size, 0])
            entry[1] += 1
    return _grouped("all-gather", found)
