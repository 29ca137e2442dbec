"""One test per case of the matrix: the dump must equal its committed golden, byte for byte; and
nothing in the golden tree that no case produces."""

import pytest

from sharding_dump.case import load_matrix


@pytest.mark.parametrize("case", load_matrix(), ids=lambda c: c.label)
def test_golden(case, sharding_golden):
    sharding_golden.check(case)


def test_no_stale_goldens(sharding_golden):
    sharding_golden.check_stale(load_matrix())
