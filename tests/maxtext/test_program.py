"""The installed MaxText's own code as the program (`pytest -m maxtext`, with MaxText installed:
requirements-maxtext.txt; skipped cleanly without it).

- an edit of one line of MaxText's own layer code fails the golden test of a case run through it,
  naming the tensor, and passes again after --sharding-update;
- a case MaxText refuses is MaxText's reason in one line, exit 2, nothing written;
- the zoo's goldens against MaxText's own code, leaf by leaf (tests/data/maxtext/program/): every
  difference is named, and each is either listed with why in known_differences.yml or fails.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import REPO, compare_maxtext_tool
from sharding_dump.errors import BadInput
from sharding_dump.golden import codec
from sharding_dump.maxtext.case import MaxTextCase, load_cases

pytestmark = pytest.mark.maxtext

DATA = REPO / "tests" / "data" / "maxtext" / "program"
NAMED, LOGICAL = "named_shardings.json", "logical_shardings.json"


@pytest.fixture(scope="module")
def runner():
    """MaxText, imported once for the module (every in-process case shares it)."""
    from sharding_dump.maxtext.program import maxtext

    try:
        return maxtext()
    except BadInput as err:
        pytest.skip(str(err))


# --- a one-line edit of MaxText's own layer code ---------------------------------------------------

EDIT_FILE = "layers/linears.py"
EDIT_ANCHOR = "self.wo = DenseGeneral("
EDIT = ('kernel_axes=("mlp", "embed"),', 'kernel_axes=("mlp", None),')  # MlpBlock's wo: embed no longer split
EDITED_TENSOR = "model/decoder/layers/mlp/wo/kernel"


def edit_one_line(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    at = text.index(EDIT_ANCHOR)
    line = text.index(EDIT[0], at)
    assert text.count("\n", at, line) <= 6, "the edit is no longer in MlpBlock's wo"
    path.write_text(text[:line] + EDIT[1] + text[line + len(EDIT[0]):], encoding="utf-8")


def test_an_edit_of_maxtexts_layer_code_fails_the_golden_naming_the_tensor(runner, tmp_path):
    import maxtext

    site = tmp_path / "site"
    shutil.copytree(Path(maxtext.__file__).parent, site / "maxtext", ignore=shutil.ignore_patterns("__pycache__"))
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.sharding-dump]\ngolden-dir = "golden"\nmaxtext-cases = ["maxtext.yml"]\n')
    (project / "maxtext.yml").write_text("cases:\n  - {args: [model_name=llama2-7b, compile_topology=v5p-8]}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}

    def pytest_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                              cwd=project, env=env, capture_output=True, text=True)

    where = subprocess.run([sys.executable, "-c", "import maxtext; print(maxtext.__file__)"], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where  # the copy runs, not the installed MaxText
    first = pytest_run("--sharding-update")
    assert first.returncode == 0, first.stdout[-3000:]
    assert pytest_run().returncode == 0
    edit_one_line(site / "maxtext" / EDIT_FILE)
    failed = pytest_run()
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert EDITED_TENSOR in failed.stdout, failed.stdout[-3000:]
    assert "llama2-7b/v5p-8/slice_1/rule_default" in failed.stdout
    shown = failed.stdout.replace(f"{project}/", "")
    guide = (REPO / "docs" / "guide" / "guard-your-maxtext.md").read_text()
    block = guide.split("says how to accept the change:\n\n```\n", 1)[1].split("```", 1)[0]
    missing = [line for line in block.splitlines() if line.strip() != "..." and line not in shown]
    assert not missing, missing  # the guide shows this failure as it is
    assert pytest_run("--sharding-update").returncode == 0
    again = pytest_run()
    assert again.returncode == 0, again.stdout[-3000:]


# --- a case MaxText refuses -------------------------------------------------------------------------

@pytest.mark.parametrize("words, reason", [
    (["ici_fsdp_parallelism=3"], "its topology mesh: AssertionError: Number of devices per slice 4 does not "
                                 "match the product of the ICI parallelism 3"),
    (["model_name=no-such-model"], "its config: "),
])
def test_a_case_maxtext_refuses_is_its_reason_in_one_line(runner, tmp_path, capsys, words, reason):
    from sharding_dump.maxtext.command import main

    status = main(["model_name=llama2-7b", "compile_topology=v5p-8", *words, "--golden-dir", str(tmp_path / "g")])
    err = capsys.readouterr().err.splitlines()
    assert status == 2
    assert err[-1].startswith("sharding-dump: error: MaxText refuses llama2-7b/v5p-8/slice_1/") or \
        err[-1].startswith("sharding-dump: error: MaxText refuses no-such-model/"), err[-1]
    assert reason in err[-1], err[-1]
    assert not (tmp_path / "g").exists()
    if words == ["ici_fsdp_parallelism=3"]:  # the guide shows this line as it is
        assert err[-1] in (REPO / "docs" / "guide" / "guard-your-maxtext.md").read_text()


# --- the zoo against MaxText's own code -----------------------------------------------------------

@functools.cache
def sample() -> list[tuple[MaxTextCase, str | dict]]:
    entries = yaml.safe_load((DATA / "cases.yml").read_text())["cases"]
    return list(zip(load_cases(DATA / "cases.yml"), [e["zoo"] for e in entries]))


def zoo_documents(zoo: str | dict) -> tuple[str, dict[str, dict]]:
    """(its name, its golden documents): a committed golden folder, or a case the zoo renders here."""
    if isinstance(zoo, str):
        return zoo, {name: codec.read_document(REPO / "golden" / zoo / name) for name in (NAMED, LOGICAL)}
    from sharding_dump.zoo import goldens
    from sharding_dump.zoo.case import Case

    case = Case.make(zoo["model"], zoo["topology"], zoo["rule"], overrides=zoo.get("overrides"))
    rendered = goldens.render(case)
    return case.label, {name: json.loads(rendered[name]) for name in (NAMED, LOGICAL)}


@functools.cache
def known() -> dict:
    return yaml.safe_load((DATA / "known_differences.yml").read_text())


def leaves(doc: dict, key: str, where: Path) -> dict:
    """compare_maxtext's leaves of a golden document."""
    return compare_maxtext_tool()["our_leaves"](doc, key, where, exact=key == "logical_axes")


def difference_text(name: str, path: str, mt: dict, zoo: dict) -> str:
    show = compare_maxtext_tool()["show"]
    return f"{name}:{path}: maxtext {show(mt.get(path))}; zoo {show(zoo.get(path))}"


def why_known(text: str) -> str | None:
    """The reason known_differences.yml gives for a difference (file:path: maxtext ...; zoo ...)."""
    for entry in known()["known"]:
        if re.fullmatch(entry["match"], text):
            return entry["why"]
    return None


def differences(label: str, docs: dict, zoo_docs: dict, ours: Path) -> tuple[list[str], dict[str, int], list[str]]:
    """(the differences not known, {why: how many} of the known ones, compare_maxtext's report)."""
    tool = compare_maxtext_tool()
    report, unknown, explained = [], [], {}
    for name, key in ((NAMED, "partition_spec"), (LOGICAL, "logical_axes")):
        mt = leaves(docs[name], key, Path(label) / name)
        zo = leaves(zoo_docs[name], key, ours / name)
        for path in sorted({p for p in mt.keys() & zo.keys() if mt[p] != zo[p]} | (mt.keys() ^ zo.keys())):
            text = difference_text(name, path, mt, zo)
            why = why_known(text)
            if why is None:
                unknown.append(text)
            else:
                explained[why] = explained.get(why, 0) + 1
        report += tool["compare_leaves"](f"{name} (MaxText as reference, the zoo as ours)", mt, zo)
    return unknown, explained, report


@functools.cache
def dumped(case: MaxTextCase) -> dict:
    from sharding_dump.maxtext.program import maxtext

    return maxtext().documents(case)


@pytest.mark.parametrize("case, zoo", sample(), ids=[c.label for c, _ in sample()])
def test_the_zoo_matches_maxtexts_own_code(runner, case, zoo):
    """Leaf by leaf, named and logical, modulo what known_differences.yml explains (with why): any
    other difference fails, naming the tensor; the known ones are printed per case (pytest -rP)."""
    zoo, zoo_docs = zoo_documents(zoo)
    unknown, explained, report = differences(case.label, dumped(case), zoo_docs, Path("golden") / zoo)
    for why, count in explained.items():
        print(f"{case.label}: {count} known: {why}")
    assert not unknown, (f"{case.label} against golden/{zoo}: {len(unknown)} differences not known "
                         "(tests/data/maxtext/program/known_differences.yml):\n  " + "\n  ".join(unknown)
                         + "\n" + "\n".join(report))
    # Every leaf's dtype too: its bytes per device follow it (an RNG key of MaxText's unsafe_rbg is key<urbg>).
    theirs, ours = ({p: t["dtype"] for p, t in d[NAMED]["tensors"].items()} for d in (dumped(case), zoo_docs))
    assert {p: (theirs[p], ours[p]) for p in theirs.keys() & ours.keys() if theirs[p] != ours[p]} == {}


def test_a_difference_of_the_zoo_is_named(runner):
    """The check bites: one weight of the zoo's golden split otherwise is the one difference named."""
    import copy

    case, zoo = sample()[0]
    zoo, zoo_docs = zoo_documents(zoo)
    changed = copy.deepcopy(zoo_docs)
    tensor = "model/decoder/layers/mlp/wo/kernel"
    changed[NAMED]["tensors"][tensor]["partition_spec"] = [None, None, None]
    unknown, _, _ = differences(case.label, dumped(case), changed, Path("golden") / zoo)
    assert unknown == [f"{NAMED}:{tensor}: maxtext shape [11008,32,4096] spec [null,null,\"fsdp\"]; "
                       "zoo shape [11008,32,4096] spec [null,null,null]"]
