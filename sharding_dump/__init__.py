"""sharding-dump: golden tests for the sharding of JAX/Flax training state.

Public API::

    from sharding_dump import Case, dump_case, golden_dir, check_or_update
    case = Case.make("llama2-7b", "v5p-16", "pure-fsdp")
    docs = dump_case(case)               # {file name: JSON document}
    outcome = check_or_update(case, "golden", update=False)
"""

import os

# A layout tool: it never needs an accelerator, and probing for one costs seconds.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from sharding_dump.case import Case, golden_dir, load_matrix  # noqa: E402
from sharding_dump.dump import dump_case, render_case  # noqa: E402
from sharding_dump.errors import BadInput  # noqa: E402
from sharding_dump.golden import Outcome, check_or_update  # noqa: E402

__all__ = ["BadInput", "Case", "Outcome", "check_or_update", "dump_case", "golden_dir", "load_matrix", "render_case"]
