"""`sharding-dump check` of a serving case (an sd.ServingProgram): its state at the slots x length it
is served with, and the steps that hand the KV cache on.

- memory: weights, KV cache and decode state per device against the topology's HBM, with the largest
  slot count (at the case's length) and length (at the case's slots) that fit;
- cache-replicated: KV cache bytes held whole over a mesh axis larger than 1 (every device along it
  holds the same entries), above the replicated tolerance of the cache's bytes;
- handoff: a step that hands a state leaf to the next in another layout than the next takes it in
  (prefill's cache against generate's), with the bytes per request it moves;
- divisibility and unknown-name, as for any case: kv heads or pages that the axes splitting them do
  not divide, rules for logical axes no weight, cache leaf or activation of any step carries.
"""

from __future__ import annotations

import math

from sharding_dump.commands import tables
from sharding_dump.commands.check import Finding, check_divisibility, check_names, check_placement
from sharding_dump.core import specs
from sharding_dump.core.layout import TensorLayout
from sharding_dump.golden import diff
from sharding_dump.zoo import serving
from sharding_dump.zoo.dump import CaseSetup

TOP_LEAVES = 5  # leaves listed under a finding


def check_memory(setup: CaseSetup) -> list[Finding]:
    """The state per device at the case's slots x length above one device's HBM."""
    fit = serving.memory_fit(setup)
    if fit is None or fit.used <= fit.hbm:
        return []
    devices = setup.plan.num_devices
    weights = fit.used - fit.cache
    largest = (f"the largest slot count that fits at {fit.length} tokens is {fit.largest_slots} "
               f"(per_device_batch_size={fit.largest_slots / devices:g} on {devices} devices)" if fit.largest_slots
               else f"no slot count fits at {fit.length} tokens: the state without its cache takes "
                    f"{tables.format_bytes(weights)}")
    longest = (f"at {fit.slots} slots the longest cache that fits is {fit.largest_length} tokens"
               if fit.largest_length else f"at {fit.slots} slots no cache length fits")
    return [Finding(
        "memory", f"weights + KV cache per device at {fit.slots} slots x {fit.length} tokens",
        f"{tables.format_bytes(weights)} + cache {tables.format_bytes(fit.cache)} = {tables.format_bytes(fit.used)} "
        f"per device, above the {tables.format_bytes(fit.hbm)} HBM of one {setup.topology.chip} device "
        f"({fit.used / fit.hbm:.0%}); {largest}",
        (longest,))]


def check_cache_replicated(setup: CaseSetup, traced: serving.Traced, tolerance: float) -> list[Finding]:
    """Cache leaves split over none of some mesh axis larger than 1, above `tolerance` of the cache."""
    sizes = setup.plan.sizes
    cache = [t for t in traced.layouts if traced.is_cache(t.path)]
    whole: dict[str, list[TensorLayout]] = {}
    for t in cache:
        used = {a for d in range(len(t.shape)) for a in t.axes(d)}
        for axis, size in sizes.items():
            if size > 1 and axis not in used:
                whole.setdefault(axis, []).append(t)
    total = sum(_bytes(t) for t in cache)
    findings = []
    for axis, leaves in sorted(whole.items()):
        replicated = sum(_bytes(t) for t in leaves)
        if not total or replicated / total <= tolerance:
            continue
        ordered = sorted(leaves, key=lambda t: (-t.per_device_bytes, t.path))
        findings.append(Finding(
            "cache-replicated", f"KV cache whole over {axis}={sizes[axis]}",
            f"{replicated / total:.1%} of the cache's bytes are split over no dimension along {axis}: each of its "
            f"{sizes[axis]} devices holds the same entries "
            f"({tables.format_bytes(sum(t.per_device_bytes for t in leaves))} per device)",
            tuple(f"{t.path}  spec {diff.compact(_spec(t))}  {tables.format_bytes(t.per_device_bytes)} per device"
                  for t in ordered[:TOP_LEAVES])
            + ((f"... and {len(ordered) - TOP_LEAVES} more cache leaves",) if len(ordered) > TOP_LEAVES else ())))
    return findings


def check_handoffs(traced: serving.Traced, sizes: dict[str, int]) -> list[Finding]:
    """Steps that hand leaves on in another layout than the next step takes them in."""
    findings = []
    for pair, moved in serving.handoffs(traced, sizes).items():
        if not moved:
            continue
        source, target = pair.split(".")
        ordered = sorted(moved, key=lambda m: (-m.bytes_per_request, m.path))
        findings.append(Finding(
            "handoff", f"{source} -> {target}",
            f"{source} hands {len(moved)} lea{'f' if len(moved) == 1 else 'ves'} to {target} in another layout than "
            f"{target} takes {'it' if len(moved) == 1 else 'them'} in: "
            f"{tables.format_bytes(sum(m.bytes_per_request for m in moved))} per request, "
            f"{tables.format_bytes(sum(m.back.moved_bytes for m in moved))} received by the device that moves most",
            tuple(f"{m.path}  {diff.compact(m.back.came_back)} -> {diff.compact(m.back.went_in)}  "
                  f"{tables.format_bytes(m.bytes_per_request)} per request" for m in ordered[:TOP_LEAVES])
            + ((f"... and {len(ordered) - TOP_LEAVES} more leaves",) if len(ordered) > TOP_LEAVES else ())))
    return findings


def lint_serving(setup: CaseSetup, layouts: list[TensorLayout], known: frozenset[str],
                 tolerance: float) -> list[Finding]:
    """Every finding of a serving case, lint by lint."""
    traced = serving.traced_of(setup)
    activation_axes = frozenset(n for step in traced.steps for c in step.activations
                                for n in c.logical_axes if n is not None)
    return (check_divisibility(setup, layouts) + check_names(setup, known, layouts, activation_axes)
            + check_placement(setup, layouts) + check_memory(setup)
            + check_cache_replicated(setup, traced, tolerance) + check_handoffs(traced, setup.plan.sizes))


def _bytes(layout: TensorLayout) -> int:
    return math.prod(layout.shape) * specs.itemsize(layout.dtype)


def _spec(layout: TensorLayout) -> specs.SpecJson:
    return specs.spec_to_json(layout.partition_spec, len(layout.shape))
