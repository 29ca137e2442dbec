"""docs/program-placement.md and docs/hf-models.md: their rule files and code are the examples', and
every command they show dumps what they say (each weight's source, the same layouts for a model and
its module)."""

from __future__ import annotations

import re
import shlex

import pytest

from helpers import REPO
from sharding_dump.zoo.settings import parse_assignments
from sharding_dump.zoo import dump
from sharding_dump.zoo.case import Case

PLACEMENT = (REPO / "docs/program-placement.md").read_text()
HF = (REPO / "docs/hf-models.md").read_text()


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def command_case(line: str) -> Case:
    """The case a `sharding-dump --model M --topology T --rule R KEY=VALUE...` line dumps."""
    words = shlex.split(line)[1:]
    flags = {words[i]: words[i + 1] for i in range(0, 6, 2)}
    return Case.make(flags["--model"], flags["--topology"], str(REPO / flags["--rule"]),
                     overrides=parse_assignments(words[6:]))


def sources(line: str) -> dict[str, str]:
    return {t.path: t.source for t in dump.case_layouts(command_case(line))[1] if t.group == "params"}


def test_placement_page_rule_files_are_the_examples():
    rules = [line for line in (REPO / "examples/pure_jax_rules.yml").read_text().splitlines()
             if not line.startswith("#")]
    (yaml,) = blocks(PLACEMENT, "yaml")
    assert yaml.splitlines() == rules
    assert "partition_rules" not in (REPO / "examples/t5x_rules.yml").read_text()


def test_placement_page_commands_place_as_it_says(monkeypatch):
    monkeypatch.chdir(REPO)
    pure, model, train = [line for block in blocks(PLACEMENT, "bash") for line in block.splitlines()]
    assert set(sources(pure).values()) == {"type"}
    assert set(sources(model).values()) == set(sources(train).values()) == {"params_axes"}


def test_hf_page_code_and_rules_are_the_examples(monkeypatch):
    (code,) = blocks(HF, "python")
    example = (REPO / "examples/hf_llama.py").read_text()
    body = code.split("def small_llama():\n", 1)[1]
    assert all(line.strip() in example for line in body.splitlines() if line.strip())
    (yaml,) = blocks(HF, "yaml")
    assert yaml.splitlines() == [line for line in (REPO / "examples/hf_llama_rules.yml").read_text().splitlines()
                                 if not line.startswith("#")]


def test_hf_page_commands_give_the_same_layouts(monkeypatch):
    pytest.importorskip("transformers", minversion="4.57")
    monkeypatch.chdir(REPO)
    held, module = [line for block in blocks(HF, "bash") for line in block.splitlines()]
    layouts = [{t.path: t for t in dump.case_layouts(command_case(line))[1]} for line in (held, module)]
    assert {p: (t.partition_spec, t.source) for p, t in layouts[0].items()} == \
        {p: (t.partition_spec, t.source) for p, t in layouts[1].items()}
    assert {t.source for t in layouts[0].values() if t.group == "params"} == {"regex"}
