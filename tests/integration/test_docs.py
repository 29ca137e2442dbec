"""The docs site cannot go stale: every generated page and output block equals what `tools/docs.py`
writes from the data and the code now, the Layout page is the import rule, and the README (the front
page) starts with the two set-up commands and links each job into the site."""

from __future__ import annotations

import functools
import re
import shlex
import tomllib

import pytest

from helpers import REPO
from sharding_dump.zoo.cards import model_names
from sharding_dump.zoo.rules import rule_names
from sharding_dump.zoo.topology import topology_names

README = REPO / "README.md"
SET_UP = [
    'python3 -m venv .venv && .venv/bin/pip install -e ".[dev]" -c constraints.txt && .venv/bin/sharding-dump '
    "--model llama2-7b --topology v5p-16 --rule pure-fsdp --golden-dir /tmp/sharding-dump-demo",
    'python3 -m venv .venv && .venv/bin/pip install -e ".[dev]" -c constraints.txt && .venv/bin/python -m pytest -n 2',
]
JOBS = ["Dump a case", "Golden tests in CI", "Your own model", "Your own training program", "The pull-request diff"]


@functools.cache
def generator() -> dict:
    """tools/docs.py loaded in this process."""
    import runpy

    return runpy.run_path(str(REPO / "tools" / "docs.py"), run_name="docs_generator")


def stale(pages: dict) -> list[str]:
    return [path.relative_to(REPO).as_posix() for path, text in pages.items()
            if not path.exists() or path.read_text() != text]


def test_reference_pages_are_the_data():
    """Cards, MaxText configs, settings, rule files, topologies, the Layout page and the front page."""
    assert stale(generator()["reference_pages"]()) == [], "run python tools/docs.py and commit what it writes"


def test_output_blocks_are_what_the_code_prints():
    """The review page's report, diff comment, chart, check and show output, and the counts."""
    assert stale(generator()["output_pages"]()) == [], "run python tools/docs.py and commit what it writes"


def test_reference_pages_list_every_card_rule_and_topology():
    text = {name: (REPO / "docs/reference" / name).read_text() for name in ("models.md", "rules.md", "topologies.md")}
    assert all(f"| `{card}` |" in text["models.md"] for card in model_names())
    assert text["models.md"].count("\n| `") == len(model_names()) == len(list((REPO / "sharding_dump/data/models").glob("*.yml")))
    assert all(f"\n## {rule}\n" in text["rules.md"] for rule in rule_names())
    assert all(f"| `{name}` |" in text["topologies.md"] for name in topology_names())


def test_maxtext_reference_case_reads_values_with_underscores():
    """A reference folder's overrides are told apart by our golden's keys, not by `_ici_`: gpt3-6b's
    `opt_type=adam_pax` is one override, `max_target_length=1024` another."""
    case = generator()["_reference_case"]
    blocks = REPO / "tests/data/maxtext/blocks"
    assert case(blocks / "gpt3-6b/tpu7x-8/slice_1/rule_default_opt_type=adam_pax_max_target_length=1024") == (
        "tpu7x-8 default opt_type=adam_pax max_target_length=1024")
    assert case(blocks / "llama4-17b-16e/tpu7x-16/slice_1/rule_default_ici_expert_parallelism=4") == (
        "tpu7x-16 default ici_expert_parallelism=4")


def test_layout_page_follows_the_import_rule(monkeypatch):
    """An edge added to the rule of tools/layering.py changes the generated Layout page."""
    layers = generator()["_layering"]()
    page = generator()["layout_page"]()
    assert "## core: `sharding_dump/core/`\n\nMay import: `base`, `core`.\n" in page
    monkeypatch.setitem(layers.ALLOWED, "core", {"core", "base", "zoo"})
    assert generator()["layout_page"]() != page


def test_fill_replaces_a_stale_block_and_count():
    fill = generator()["fill"]
    page = "x <!-- count: n -->27<!-- /count --> y\n<!-- output: out -->\n```\nold\n```\n<!-- /output -->\n"
    assert fill(page, {"out": "new"}, {"n": "50"}, "page") == (
        "x <!-- count: n -->50<!-- /count --> y\n<!-- output: out -->\n```\nnew\n```\n<!-- /output -->\n")
    nested = fill(page, {"out": "```mermaid\nx\n```"}, {"n": "50"}, "page")
    assert "<!-- output: out -->\n````\n```mermaid\nx\n```\n````\n" in nested  # a fence inside gets a longer one


def test_readme_starts_with_the_set_up_commands_true_in_a_clone():
    text = README.read_text()
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert first[1::2] == SET_UP
    # each command under a comment line saying what it does: on the site, where a long line is cut at
    # the block's edge, the two start alike
    assert [line.startswith("# ") for line in first] == [True, False, True, False] and first[0] != first[2]
    assert text.index("```") < text.index("\n## ")  # before any section
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert (REPO / "constraints.txt").is_file() and any(d.startswith("pytest-xdist") for d in extras["dev"])
    assert "llama2-7b" in model_names() and "pure-fsdp" in rule_names() and "v5p-16" in topology_names()


def test_readme_has_the_five_jobs_each_linking_into_the_site():
    text = README.read_text()
    sections = re.split(r"\n## ", text)[1:]
    assert [s.split("\n", 1)[0] for s in sections] == JOBS
    for section in sections:
        assert re.search(r"\]\(docs/[\w/.-]+\.md", section), section.split("\n", 1)[0]
    links = re.findall(r"\]\(([^)]+)\)", text)
    local = [link for link in links if not link.startswith("https://")]
    assert local and all(link.startswith("docs/") for link in local), local  # the site builds them too
    assert all((REPO / link.split("#")[0]).is_file() for link in local), local


@pytest.mark.parametrize("page", ["docs/guide/review.md", "docs/maintainers/index.md"])
def test_pages_with_outputs_hold_no_typed_count(page):
    """The counts that went stale in the README are generated now: no hand-written "of 27 cases"."""
    text = (REPO / page).read_text()
    assert "27" not in re.sub(r"<!-- (count|output|raw): [\w-]+ -->.*?<!-- /(count|output|raw) -->", "", text, flags=re.S)


def readme_section(title: str) -> str:
    return README.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_dump_commands_run(capsys):
    """"Dump a case": its dump is a case of the matrix (so its golden is committed and checked), and
    its `show --tensor` draws that tensor."""
    from sharding_dump.commands import cli
    from sharding_dump.zoo.case import Case
    from sharding_dump.zoo.matrix import load_matrix

    dump, show = (shlex.split(line) for line in re.search(r"```bash\n(.*?)```", readme_section("Dump a case"),
                                                             re.S).group(1).splitlines())
    options = dict(zip(dump[1::2], dump[2::2]))
    assert Case.make(options["--model"], options["--topology"], options["--rule"]).label in {
        c.label for c in load_matrix()}
    assert show[:2] == ["sharding-dump", "show"] and cli.main(show[1:]) == 0
    assert capsys.readouterr().out.startswith(f"{show[show.index('--tensor') + 1]}: float32[4096,32,11008]")


def test_readme_project_table_is_the_guides():
    """The README's `[tool.sharding-dump]` lines are the guide's, which test_adopt.py's flow reads alike."""
    (table,) = re.findall(r"```toml\n(.*?)```", readme_section("Golden tests in CI"), re.S)
    guide = re.findall(r"```toml\n(.*?)```", (REPO / "docs/guide/pytest-in-ci.md").read_text(), re.S)[0]
    guide_lines = [line.split("#")[0].rstrip() for line in guide.splitlines()]
    assert all(line in guide_lines for line in table.splitlines()), table


# Pages other changes add under docs/ before the nav lists them (mkdocs builds a page the nav leaves
# out, with a note: mkdocs.yml's validation.nav.omitted_files).
NOT_YET_IN_NAV: set[str] = set()  # pages that may land before their nav entry


def test_every_page_is_in_the_nav():
    """A page of the site that the nav forgets would build without a warning: each is listed once."""
    nav = re.findall(r"^\s*- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert sorted(nav) == sorted(pages - NOT_YET_IN_NAV) and len(nav) == len(set(nav))


@pytest.mark.parametrize("title, page", [("Your own model", "your-own-model.md"),
                                         ("Your own training program", "your-own-program.md")])
def test_readme_commands_are_the_guides(title, page):
    """The README's command of a job is one the guide page gives (test_guide_examples.py runs those)."""
    (command,) = re.findall(r"```bash\n(.*?)```", readme_section(title), re.S)
    guide = re.findall(r"```bash\n(.*?)```", (REPO / "docs/guide" / page).read_text(), re.S)[0]
    assert command.strip() in guide.splitlines()


def test_ci_guide_snippets_are_the_adoption_tests():
    """The rule file and case file of "Golden tests in CI" say what test_adopt.py's project runs (the
    guide may show fewer rules, none it does not run)."""
    import runpy

    import yaml

    adopt = runpy.run_path(str(REPO / "tests/integration/test_adopt.py"))
    snippets = [yaml.safe_load(block) for block in
                re.findall(r"```yaml\n(.*?)```", (REPO / "docs/guide/pytest-in-ci.md").read_text(), re.S)]
    rule, cases = snippets[0], snippets[1]
    tested = yaml.safe_load(adopt["TP_RULE"])
    assert {k: v for k, v in rule.items() if k != "logical_axis_rules"} == {
        k: v for k, v in tested.items() if k != "logical_axis_rules"}
    assert all(pair in tested["logical_axis_rules"] for pair in rule["logical_axis_rules"])
    assert all(case in yaml.safe_load(adopt["CASES"])["cases"] for case in cases["cases"])
