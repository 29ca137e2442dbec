"""`python -m sharding_dump.maxtext`: dump cases through the installed MaxText's own code.

    python -m sharding_dump.maxtext model_name=llama2-7b compile_topology=v5p-16 custom_mesh_and_rule=pure-fsdp
    python -m sharding_dump.maxtext --cases maxtext_cases.yml --golden-dir golden --check

One case from KEY=VALUE words (MaxText's own command line, after an optional `--config` file), or
every case of a case file, in one process: MaxText is imported once. Every case is dumped before
any golden is written, so a case MaxText refuses writes nothing: one line naming MaxText's reason,
exit status 2. `--check` compares instead of writing (exit 1 naming the tensors that differ).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sharding_dump.errors import BadInput, one_line
from sharding_dump.maxtext.case import MaxTextCase, load_cases


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sharding_dump.maxtext", description=__doc__.split("\n\n")[0])
    p.add_argument("words", nargs="*", metavar="KEY=VALUE", help="MaxText's own arguments for one case")
    p.add_argument("--config", help="a MaxText config file (default: the installed MaxText's base.yml)")
    p.add_argument("--cases", type=Path, help="a MaxText case file (cases: [{args: [KEY=VALUE, ...]}])")
    p.add_argument("--golden-dir", type=Path, default=Path("golden"), help="root of the golden tree (default: golden)")
    p.add_argument("--check", action="store_true", help="compare with the goldens instead of writing them")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cases and (args.words or args.config):
            raise BadInput("--cases names every case: give no KEY=VALUE words or --config with it")
        cases = load_cases(args.cases) if args.cases else [MaxTextCase.parse(args.words, args.config)]
        return run(cases, args.golden_dir, args.check)
    except BadInput as err:
        print(f"sharding-dump: error: {one_line(str(err))}", file=sys.stderr)
        return 2


def run(cases: list[MaxTextCase], root: Path, check: bool) -> int:
    """Dumps every case (timed per case on stderr), then checks or writes their goldens."""
    from sharding_dump.golden import codec
    from sharding_dump.golden.engine import check_or_update_folder, read_folder
    from sharding_dump.maxtext.program import maxtext

    start = time.perf_counter()
    runner = maxtext()
    print(f"sharding-dump: MaxText {runner.version} imported in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    dumped = []
    for case in cases:
        began = time.perf_counter()
        current = read_folder(case.folder(root))
        docs = runner.documents(case)
        rendered = codec.render(docs)
        for name, data in rendered.items():  # every document passes its schema before anything is written
            codec.check_bytes(data, f"{case.label}: {name}", docs[name])
        dumped.append((case, rendered, current))
        print(f"sharding-dump: dumped {case.label} in {time.perf_counter() - began:.1f} s", file=sys.stderr)
    status = 0
    for case, docs, current in dumped:
        outcome = check_or_update_folder(case.folder(root), docs, not check, label=case.label,
                                         command=case.command(str(root)), current=current)
        if not outcome.ok:
            print(outcome.report)
            status = 1
        else:
            print(f"{outcome.status}: {case.folder(root)}")
    return status
