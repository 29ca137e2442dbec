"""The case matrix file: every entry parsed in order, a bad entry or a repeated case named by its index."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharding_dump.errors import BadInput
from sharding_dump.zoo.matrix import load_matrix

CASE = "{model: qwen3-0.6b, topology: tpu7x-16, rule: default}"


def write(tmp_path: Path, *entries: str) -> Path:
    path = tmp_path / "cases.yml"
    path.write_text("cases:\n" + "".join(f"  - {entry}\n" for entry in entries))
    return path


def test_a_repeated_case_is_refused_naming_both_entries(tmp_path: Path) -> None:
    path = write(tmp_path, CASE, "{model: qwen3-0.6b, topology: tpu7x-8, rule: default}", CASE)
    with pytest.raises(BadInput, match=r"^case matrix .*cases\.yml: field cases/2: same case as cases/0$"):
        load_matrix(path)


def test_a_bad_entry_is_named_by_its_index(tmp_path: Path) -> None:
    path = write(tmp_path, CASE, "{model: qwen3-0.6b, topology: tpu9-16, rule: default}")
    with pytest.raises(BadInput, match=r"^case matrix .*cases\.yml: field cases/1: .*tpu9-16"):
        load_matrix(path)


def test_cases_come_in_file_order(tmp_path: Path) -> None:
    path = write(tmp_path, "{model: qwen3-0.6b, topology: tpu7x-8, rule: default}", CASE)
    assert [case.topology for case in load_matrix(path)] == ["tpu7x-8", "tpu7x-16"]
