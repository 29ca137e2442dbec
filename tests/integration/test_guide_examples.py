"""The users' guide runs as written: "Your own model" (its model, rule file, dump command and test,
the partition rules, the Adafactor table) and "Your own training program" (its programs and commands)."""

from __future__ import annotations

import json
import re
import shlex

from helpers import REPO
from sharding_dump.commands import cli

PAGE = REPO.joinpath("docs/guide/your-own-model.md").read_text()
SECTION = PAGE.split("\n## ", 1)[0]
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", SECTION, re.S)


def block(lang: str, index: int = 0) -> str:
    return [code for kind, code in BLOCKS if kind == lang][index]


def test_guide_model_dumps_and_its_test_passes(tmp_path, monkeypatch, pytester=None):
    (tmp_path / "mylm.py").write_text(block("python"))
    (tmp_path / "rules.yml").write_text(block("yaml"))
    monkeypatch.chdir(tmp_path)
    words = shlex.split(block("bash").strip())
    assert words[0] == "sharding-dump"
    assert cli.main(words[1:]) == 0
    folder = tmp_path / "golden/mylm-make_lm/cpu-16/slice_1/rule_rules_ici_fsdp_parallelism=4_ici_tensor_parallelism=4"
    acts = json.loads((folder / "activation_shardings.json").read_text())["tensors"]
    assert acts["forward/block_0/batch.length.mlp"]["partition_spec"] == [["data", "fsdp"], None, "tensor"]
    named = json.loads((folder / "named_shardings.json").read_text())["tensors"]
    assert named["params/block_0/up/kernel"]["partition_spec"] == ["fsdp", "tensor"]
    assert sum(1 for p in named if p.startswith("params/")) == 9


def test_guide_pytest_test_passes_on_the_dumped_golden(tmp_path, monkeypatch, pytester):
    """The page's test, run by pytest in the user's folder, passes on the golden its command wrote
    and fails once the rule file changes a line."""
    for path in (pytester.path / "mylm.py", pytester.path / "rules.yml"):
        path.write_text(block("python") if path.suffix == ".py" else block("yaml"))
    pytester.makepyfile(test_sharding=block("python", 1))
    monkeypatch.chdir(pytester.path)
    assert cli.main(shlex.split(block("bash").strip())[1:]) == 0
    pytester.syspathinsert()
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    rules = pytester.path / "rules.yml"
    rules.write_text(rules.read_text().replace("[mlp, tensor]", "[mlp, null]"))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*params/block_0..3/up/kernel  (4 tensors, and opt_state/0/mu, opt_state/0/nu)"])
    full = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-vv")  # every tensor by its own name
    full.stdout.fnmatch_lines(["  params/block_2/up/kernel  (and opt_state/0/mu, opt_state/0/nu)"])


def subsection(title: str) -> str:
    return PAGE.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


def test_guide_partition_rules_are_the_example_rule_file():
    (excerpt,) = re.findall(r"```yaml\n(.*?)```", subsection("Weights placed by path"), re.S)
    example = REPO.joinpath("examples/regex_llama.yml").read_text().splitlines()
    assert all(line in example for line in excerpt.splitlines())


def test_guide_adafactor_table_is_what_show_prints(monkeypatch, capsys):
    text = subsection("Your own optimizer")
    (command,) = re.findall(r"```bash\n(.*?)```", text, re.S)
    (shown,) = re.findall(r"```\n(.*?)```", text, re.S)
    monkeypatch.chdir(REPO)
    assert cli.main(shlex.split(command.strip())[1:]) == 0
    printed = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    for line in shown.splitlines():
        if line.strip() and line != "...":
            assert printed[line.split()[0]] == line.split(), line


PROGRAMS = REPO.joinpath("docs/guide/your-own-program.md").read_text()


def test_guide_programs_dump(tmp_path, monkeypatch):
    """Both programs of "Your own training program" dump with the commands shown, with the layouts
    the text states."""
    code = re.findall(r"```python\n(.*?)```", PROGRAMS, re.S)[0]
    (tmp_path / "myprogram.py").write_text(code)
    (tmp_path / "rules.yml").write_text(block("yaml"))
    monkeypatch.chdir(tmp_path)
    commands = re.findall(r"```bash\n(.*?)```", PROGRAMS, re.S)[0].strip().splitlines()
    docs = {}
    for line in commands:
        words = shlex.split(line)
        assert words[0] == "sharding-dump" and cli.main(words[1:]) == 0
        model = words[words.index("--model") + 1]
        folder = next((tmp_path / "golden" / model.replace(":", "-")).rglob("named_shardings.json")).parent
        docs[model] = {p.name: json.loads(p.read_text())["tensors"] for p in folder.glob("*.json")}
    for model, doc in docs.items():
        assert doc["named_shardings.json"]["params/up/kernel"]["partition_spec"] == ["fsdp", "tensor"], model
        acts = doc["activation_shardings.json"]
        assert acts["forward/batch.length.mlp"]["partition_spec"] == [["data", "fsdp"], None, "tensor"], model
        assert acts["forward/inputs_segmentation"]["logical_axes"] == ["batch", "length"], model
    assert "opt_state/1/0/mu/up/kernel" in docs["myprogram:train_program"]["named_shardings.json"]
