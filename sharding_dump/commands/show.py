"""`sharding-dump show`: one case as a table for the terminal, without writing anything.

Every leaf of the training state (parameters first) with its shape, logical axes, partition spec and
what one device holds of it (for a user's model, also where its spec came from: `type`, `box`,
`params_axes`, `regex` or `none`), then the per-device totals against the device's HBM. Specs leave out
mesh axes of size 1 (they split nothing) unless asked for the spec exactly as the golden holds it.
`--tensor PATH` draws one leaf's (or one activation's) split over the mesh instead
(:func:`pictures.split_grid`).

>>> specs.spec_to_json(["fsdp", ["tensor", "expert"], None], 3, {"fsdp": 8, "tensor": 1, "expert": 1})
['fsdp', None, None]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sharding_dump.commands import options, pictures, tables
from sharding_dump.core import specs
from sharding_dump.core.layout import per_device_totals
from sharding_dump.errors import BadInput, shown
from sharding_dump.golden import diff
from sharding_dump.golden.sizes import format_bytes
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.dump import case_layouts, trace_activations

GROUP_ORDER = {"params": 0, "opt_state": 1}


def render_case_table(case: Case, full_specs: bool = False) -> str:
    """The table and totals of `case`."""
    setup, layouts = case_layouts(case)
    sizes = setup.plan.sizes
    sources = setup.config is None  # a user's model: say where each spec came from (type, box, params_axes...)
    rows: list[list[Any]] = []
    for t in sorted(layouts, key=lambda t: (GROUP_ORDER.get(t.group, 2), t.path)):
        spec = specs.spec_to_json(t.partition_spec, len(t.shape))
        rows.append([t.path, diff.compact(list(t.shape)), diff.compact(list(t.logical_axes)),
                     diff.compact(spec if full_specs else specs.spec_to_json(spec, len(spec), sizes)),
                     diff.compact(list(t.per_device_shape)), format_bytes(t.per_device_bytes)]
                    + [t.source] * sources)
    mesh = " x ".join(f"{name}={size}" for name, size in sizes.items() if size > 1) or "a single device"
    note = "" if full_specs else "; specs leave out mesh axes of size 1 (--full-specs shows them)"
    lines = [f"{case.label}: mesh {mesh} ({setup.plan.num_devices} devices){note}", "",
             tables.render(["tensor", "shape", "logical axes", "spec", "per-device shape", "bytes/device"]
                           + ["placed by"] * sources, rows, "text", right=(5,)), ""]
    totals = per_device_totals(layouts)
    groups = sorted((g for g in totals if g != "total"), key=lambda g: (GROUP_ORDER.get(g, 2), g))
    parts = ", ".join(f"{group} {format_bytes(totals[group])}" for group in groups)
    hbm = setup.topology.hbm_bytes_per_device
    limit = (f" of {format_bytes(hbm)} HBM ({totals['total'] / hbm:.1%})" if hbm
             else " (no HBM limit known for this topology)")
    lines.append(f"per device: {parts}; total {format_bytes(totals['total'])}{limit}")
    return "\n".join(lines) + "\n"


def render_tensor_grid(case: Case, path: str) -> str:
    """One leaf of `case`'s training state, or one activation of its traced step (`forward/...`,
    `backward/...`, as the activation golden keys it), drawn over the mesh; BadInput naming the nearest
    paths when there is no such tensor."""
    setup, layouts = case_layouts(case)
    by_path = {t.path: t for t in layouts}
    if path not in by_path and path.startswith(("forward/", "backward/")):
        for c in trace_activations(setup):
            if c.key == path:
                return pictures.split_grid(c.key, c.shape, c.dtype, c.logical_axes,
                                           specs.spec_to_json(c.partition_spec, len(c.shape)), setup.plan.sizes) + "\n"
    if path not in by_path:
        ordered = sorted(by_path, key=lambda p: (GROUP_ORDER.get(p.split("/", 1)[0], 2), p))
        near = [p for p in ordered if path.rsplit("/", 1)[-1] in p][:5] or ordered[:5]
        raise BadInput(f"--tensor {shown(path)}: no such leaf in {case.label} (leaves like {', '.join(near)}; "
                       f"`sharding-dump show` without --tensor lists them all)")
    t = by_path[path]
    return pictures.split_grid(t.path, t.shape, t.dtype, t.logical_axes,
                               specs.spec_to_json(t.partition_spec, len(t.shape)), setup.plan.sizes) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_case_options(parser)
    parser.add_argument("--full-specs", action="store_true",
                        help="print partition specs exactly as the golden holds them (with mesh axes of size 1)")
    parser.add_argument("--tensor", metavar="PATH",
                        help="draw one tensor's split over the mesh: a leaf of the state as the table shows it "
                             "(e.g. model/decoder/layers/mlp/wi_0/kernel) or an activation as its golden keys it "
                             "(forward/..., backward/...): which mesh axes split which dimension, the block each "
                             "device holds")
    options.add_settings_argument(parser)


def run(args: argparse.Namespace) -> int:
    (case,) = options.cases_of(args, "shows", options.project_of(args))
    if args.tensor is not None:
        sys.stdout.write(render_tensor_grid(case, args.tensor))
    else:
        sys.stdout.write(render_case_table(case, full_specs=args.full_specs))
    return 0
