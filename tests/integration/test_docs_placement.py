"""docs/program-placement.md and docs/hf-models.md: their rule files and code are the examples', and
every command they show dumps what they say (each weight's source; a model and its module are one
program)."""

from __future__ import annotations

import re
import shlex

import pytest

from helpers import FSDP, JITTED, REPO, program_case
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
    pure, model, train = [line for block in blocks(PLACEMENT, "bash")[:2] for line in block.splitlines()]
    assert set(sources(pure).values()) == {"type"}
    assert set(sources(model).values()) == set(sources(train).values()) == {"params_axes"}


def test_placement_page_programs_decide_as_it_says(monkeypatch):
    """The commands of 'What the program decides': the tests of tests/core/test_handback.py edit these
    programs; here each command dumps the case those tests edit (the Equinox one needs 8 devices: its
    own mesh, checked there in a process of its own)."""
    monkeypatch.chdir(REPO)
    eqx, fsdp, jitted = blocks(PLACEMENT, "bash")[2].splitlines()
    assert eqx.startswith("sharding-dump --model examples.eqx_lm:")  # the command gives it its 8 devices
    assert "ici_data_parallelism=4 ici_model_parallelism=2" in eqx
    for line, spec in ((fsdp, FSDP), (jitted, JITTED)):
        assert command_case(line) == program_case(spec)
        assert set(sources(line).values()) == {"type"}


def test_hf_page_code_and_rules_are_the_examples(monkeypatch):
    (code,) = blocks(HF, "python")
    example = (REPO / "examples/hf_llama.py").read_text()
    body = code.split("def small_llama():\n", 1)[1]
    assert all(line.strip() in example for line in body.splitlines() if line.strip())
    (yaml,) = blocks(HF, "yaml")
    assert yaml.splitlines() == [line for line in (REPO / "examples/hf_llama_rules.yml").read_text().splitlines()
                                 if not line.startswith("#")]


def test_hf_page_commands_are_one_program(monkeypatch):
    """The held model and its module are the same program (module, call): the same layouts
    (tests/core/test_placement.py dumps the held one)."""
    pytest.importorskip("transformers", minversion="4.57")
    from sharding_dump.core.program import as_program

    monkeypatch.chdir(REPO)
    held, module = [command_case(line) for block in blocks(HF, "bash") for line in block.splitlines()]
    assert (held.model, module.model) == ("examples.hf_llama:small_llama", "examples.hf_llama:small_llama_module")
    assert held.rule == module.rule and held.overrides == module.overrides and held.topology == module.topology
    from examples import hf_llama

    programs = [as_program(factory) for factory in (hf_llama.small_llama, hf_llama.small_llama_module)]
    assert programs[0].model == programs[1].model
    assert (programs[0].inputs, programs[0].kwargs) == (programs[1].inputs, programs[1].kwargs)
