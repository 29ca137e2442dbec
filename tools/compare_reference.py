#!/usr/bin/env python3
"""Checks our activation goldens against a reference trainer's activation dumps (MaxText's format).

    python tools/compare_reference.py REFERENCE_input_shardings.json OUR_activation_shardings.json
    python tools/compare_reference.py --reference-root tests/data/maxtext/goldens [--golden-root golden]

The second form pairs every `input_shardings.json` under the reference root with our
`activation_shardings.json` in the folder of the same relative path (both trees name folders
`<model>/<topology>/slice_<n>/rule_<rule>[_<overrides>]`). Every reference entry with known logical
axes must appear in ours with the same shape, dtype, logical axes and, size-1 mesh axes dropped,
partition spec (see sharding_dump/zoo/reference.py). With `--by-name`, each entry is matched only by ours
of the names sharding_dump/data/maxtext_call_sites.yml gives its MaxText call site (an entry with unknown
logical axes whose call site the table names, e.g. `attention_op/decoder_segment_ids`, on its shape, dtype
and spec). Exit status 0: all match; 1: mismatches; 2: bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sharding_dump.core.format import ACTIVATIONS_FILE  # noqa: E402
from sharding_dump.errors import BadInput  # noqa: E402
from sharding_dump.golden import codec
from sharding_dump.zoo import reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", metavar="FILE", help="a reference input_shardings.json and our activation_shardings.json")
    parser.add_argument("--reference-root", type=Path, help="folder tree of reference input_shardings.json files")
    parser.add_argument("--golden-root", type=Path, default=REPO / "golden", help="our golden tree (default: golden/)")
    parser.add_argument("--by-name", action="store_true",
                        help="match each entry by its MaxText call site's names (data/maxtext_call_sites.yml)")
    args = parser.parse_args(argv)
    try:
        sites = reference.call_sites() if args.by_name else None
        if args.reference_root is not None:
            if args.files:
                raise BadInput("give either two files or --reference-root, not both")
            results = reference.compare_trees(args.reference_root, args.golden_root, ACTIVATIONS_FILE, sites)
        elif len(args.files) == 2:
            ref_path, ours_path = map(Path, args.files)
            results = {ref_path.parent.name: reference.compare(reference.load_reference(ref_path),
                                                               codec.read_document(ours_path), sites)}
        else:
            raise BadInput("give a reference input_shardings.json and our activation_shardings.json, or --reference-root")
    except BadInput as err:
        print(f"compare_reference: error: {err}", file=sys.stderr)
        return 2
    for title, result in results.items():
        print(result.report(title))
    bad = sum(not r.ok for r in results.values())
    print(f"{len(results) - bad}/{len(results)} cases match")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
