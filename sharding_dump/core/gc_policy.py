"""Fewer garbage collections while models are traced.

Tracing a model's init and training step builds hundreds of thousands of small objects (equations,
avals, flax scopes) that live until the trace ends, and a process that dumps many cases keeps
their results. CPython's default policy collects the youngest objects every 700 new ones and the
whole heap each time it grows by a quarter, so it scans the same live objects again and again:
`sharding-dump --all` spent 10 s of its 35 s collecting. With a young collection every 50,000
new objects it spent about 1 s, at the same peak memory (345 MB). The matrix grew to 51 cases and
each young collection of traced equations costs more than its count says (about 85 ms each): at
50,000, `--all -j 1` spent 6.4 s of 41 s CPU collecting (gen 0: 50, gen 1: 5); at 1,000,000 it
spends 3.5 s (gen 0: 14, gen 1: 1), peak RSS 403 MB against 380 MB (gc callbacks, this 2-core machine).

:func:`fewer_collections` sets that policy for a block and gives the old one back: the CLI holds it
for its whole run; a golden dump and :func:`sharding_dump.core.model_dump.dump_model` hold it
inside a user's process (which keeps its own policy before and after).

>>> import gc
>>> before = gc.get_threshold()
>>> with fewer_collections():
...     gc.get_threshold()[0]
1000000
>>> gc.get_threshold() == before
True
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

# New container objects between two young collections while tracing (CPython's default: 700).
YOUNG_THRESHOLD = 1_000_000


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Collects the youngest generation every YOUNG_THRESHOLD new objects inside the block (a higher
    threshold already set is kept), then restores the thresholds found."""
    found = gc.get_threshold()
    gc.set_threshold(max(found[0], YOUNG_THRESHOLD), *found[1:])
    try:
        yield
    finally:
        gc.set_threshold(*found)

