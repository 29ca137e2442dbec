"""The `sharding-dump` command.

    sharding-dump --model M --topology T --rule R [--num-slices N] [KEY=VALUE ...] [--output-dir DIR]
    sharding-dump --all [--output-dir DIR]
    sharding-dump list models|topologies|rules|settings

Exit status: 0 on success, 2 on bad input (one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from sharding_dump.errors import BadInput

DEFAULT_OUTPUT_DIR = "golden"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one BadInput line like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise BadInput(f"{message} (see {self.prog} --help)")


def _dump_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sharding-dump",
        description="Dump the sharding of a model's full training state for one case (or every case of "
                    "the matrix) as golden JSON. Other commands: `sharding-dump list models|topologies|rules|settings`.")
    parser.add_argument("--model", help="model card name (sharding-dump list models)")
    parser.add_argument("--topology", help="accelerator name, e.g. v5p-16, tpu7x-2048, a3, cpu-8")
    parser.add_argument("--rule", help="rule file name (sharding-dump list rules) or path to a .yml rule file")
    parser.add_argument("--num-slices", type=int, default=1, help="number of slices (DCN), default 1")
    parser.add_argument("--all", action="store_true", help="dump every case of the case matrix")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help=f"root of the golden tree (default: {DEFAULT_OUTPUT_DIR}/)")
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="setting overrides, e.g. ici_fsdp_parallelism=-1 (sharding-dump list settings)")
    return parser


def _cmd_dump(argv: Sequence[str]) -> int:
    from sharding_dump import case as case_mod
    from sharding_dump import settings
    from sharding_dump.dump import setup_case
    from sharding_dump.golden import check_or_update

    args = _dump_parser().parse_args(argv)
    if args.all:
        if args.model or args.topology or args.rule or args.settings or args.num_slices != 1:
            raise BadInput("--all dumps the whole case matrix: it takes no --model/--topology/--rule/--num-slices/KEY=VALUE")
        cases = case_mod.load_matrix()
    else:
        missing = [flag for flag, value in (("--model", args.model), ("--topology", args.topology),
                                            ("--rule", args.rule)) if not value]
        if missing:
            raise BadInput(f"missing {', '.join(missing)} (or use --all)")
        overrides = settings.parse_assignments(args.settings)
        cases = [case_mod.Case.make(args.model, args.topology, args.rule, args.num_slices, overrides)]
    for case in cases:  # every bad input surfaces before anything is written
        setup_case(case)
    total = time.perf_counter()
    for index, case in enumerate(cases, 1):
        start = time.perf_counter()
        outcome = check_or_update(case, args.output_dir, update=True)
        what = f"wrote {', '.join(outcome.files)}" if outcome.files else "unchanged"
        prefix = f"[{index}/{len(cases)}] " if len(cases) > 1 else ""
        print(f"{prefix}{outcome.folder}/: {what} ({time.perf_counter() - start:.2f}s)")
    if len(cases) > 1:
        print(f"{len(cases)} cases in {time.perf_counter() - total:.1f}s")
    return 0


def _cmd_list(argv: Sequence[str]) -> int:
    parser = _Parser(prog="sharding-dump list", description="List what exists.")
    parser.add_argument("what", choices=["models", "topologies", "rules", "settings"])
    args = parser.parse_args(argv)
    if args.what == "models":
        from sharding_dump import models, state
        for name in models.model_names():
            cfg = models.load_config(name)
            count = state.parameter_count(state.abstract_state(cfg))
            print(f"{name:<18} {cfg.decoder_block:<10} {count:>17,} parameters ({count / 1e9:.2f}B)")
    elif args.what == "topologies":
        from sharding_dump.topology import load_topology, topology_names
        for name in topology_names():
            t = load_topology(name)
            print(f"{name:<14} {t.platform:<4} {t.chip:<6} {t.devices_per_slice:>6} devices/slice "
                  f"{t.hbm_bytes_per_device / 2**30:>5.0f} GiB HBM/device")
        print("cpu-N          cpu  any N devices, no HBM limit")
    elif args.what == "rules":
        from sharding_dump.rules import load_rule, rule_names
        for name in rule_names():
            print(f"{name:<20} mesh_axes: {', '.join(load_rule(name).mesh_axes)}")
    else:
        from sharding_dump.settings import setting_specs, format_value
        for key, spec in setting_specs().items():
            print(f"{key:<42} default {format_value(spec.default):<8} {spec.help}")
    return 0


COMMANDS = {"list": _cmd_list}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]](argv[1:])
        return _cmd_dump(argv)
    except BadInput as err:
        print(f"sharding-dump: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
