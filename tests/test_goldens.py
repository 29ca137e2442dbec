"""One test per case of the matrix: the dump must equal its committed golden, byte for byte."""

import pytest

from sharding_dump.case import load_matrix


@pytest.mark.parametrize("case", load_matrix(), ids=lambda c: c.label)
def test_golden(case, sharding_golden):
    sharding_golden.check(case)
