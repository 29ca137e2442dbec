"""Reading XLA's log: involuntary full rematerializations, and which of them are partitioner trials."""

from __future__ import annotations

import dataclasses
import re

from sharding_dump.commands.verify.hlo import OP_NAME

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
        op = OP_NAME.search(line)
        if match:
            remat = Remat(match.group(3), match.group(4).split("{", 1)[0], match.group(1), match.group(2),
                          op.group(1) if op else "", _TRIAL_INPUT in line.split(" for HLO operation ", 1)[-1])
        else:  # a wording this parser does not know: keep the whole line rather than lose the warning
            remat = Remat("", "", "", "", line.split("] ", 1)[-1][:400])
        if remat not in out:
            out.append(remat)
    return out
