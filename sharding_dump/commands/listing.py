"""`sharding-dump list models|topologies|rules|settings`: what the package and the project offer."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["models", "topologies", "rules", "settings"])


def run(args: argparse.Namespace) -> int:
    if args.what == "models":
        from sharding_dump.core.state import parameter_count
        from sharding_dump.resources import MODELS_DIR
        from sharding_dump.zoo import cards, state
        files = cards.card_files()
        for name in cards.model_names():
            cfg = cards.load_config(name)
            count = parameter_count(state.abstract_params(cfg))
            source = "" if files[name].parent == MODELS_DIR else f"  (card {files[name]})"
            print(f"{name:<18} {cfg.decoder_block:<10} {count:>17,} parameters ({count / 1e9:.2f}B){source}")
        print(f"decoder blocks: {', '.join(sorted(cards.decoder_blocks()))}")
    elif args.what == "topologies":
        from sharding_dump.zoo.topology import load_topology, topology_names
        for name in topology_names():
            t = load_topology(name)
            print(f"{name:<14} {t.platform:<4} {t.chip:<6} {t.devices_per_slice:>6} devices/slice "
                  f"{t.hbm_bytes_per_device / 2**30:>5.0f} GiB HBM/device")
        print("cpu-N          cpu  any N devices, no HBM limit")
    elif args.what == "rules":
        from sharding_dump.zoo.releases import SETTING, releases
        from sharding_dump.zoo.rules import RULES_DIR, load_rule, rule_names
        for name in rule_names():
            print(f"{name:<20} mesh_axes: {', '.join(load_rule(name).mesh_axes)}")
        for rel in releases().values():  # a release's own files: only a name the folder above lacks is new
            for name in sorted(set(rule_names(rel.rules_dir)) - set(rule_names())):
                print(f"{name:<20} mesh_axes: {', '.join(load_rule(name, rel.rules_dir).mesh_axes)} "
                      f"({SETTING}={rel.version})")
            if rel.rules_dir != RULES_DIR:
                print(f"{'':<20} ({SETTING}={rel.version}: every name is MaxText {rel.version}'s file, in "
                      f"{rel.rules_dir.relative_to(RULES_DIR.parent).as_posix()}/)")
    else:
        from sharding_dump.zoo.settings import format_value, setting_specs
        for key, spec in setting_specs().items():
            print(f"{key:<42} default {format_value(spec.default):<8} {spec.help}")
        print(f"{'ici_<axis>_parallelism, dcn_<axis>_parallelism':<42} default {'1':<8} "
              f"size of any other mesh axis a rule file declares (-1: fill with what is left)")
    return 0
