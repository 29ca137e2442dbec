"""`sharding-dump diff`: two case folders or two golden trees, text / markdown / JSON, exit status."""

import json
import re
import shutil

import pytest

from helpers import REPO, run_cli
from sharding_dump.commands.cli import main
from sharding_dump.golden import diff
from sharding_dump.zoo import releases
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.goldens import check_or_update

PURE_FSDP = releases.release_of({}).rules_dir / "pure-fsdp.yml"  # the default release's


def no_embed_rule(tmp_path, name="no-embed.yml"):
    """pure-fsdp with `embed` (and 0.2.5's `embed_attn`, the attention kernels' embed) left unsharded: the
    classic regression."""
    text = PURE_FSDP.read_text()
    assert "  - [embed, [fsdp]]\n" in text and "  - [embed_attn, [fsdp]]\n" in text
    path = tmp_path / name
    path.write_text(text.replace("  - [embed, [fsdp]]\n", "  - [embed, []]\n").replace("  - [embed_attn, [fsdp]]\n",
                                                                                      "  - [embed_attn, []]\n"))
    return str(path)


def dumped(case, root):
    check_or_update(case, root, update=True)
    return golden_dir(case, root)


def copy_cases(root, labels):
    """A golden tree under `root` holding the committed case folders `labels` (paths under golden/):
    the tests below diff as many cases as their property needs, not the whole tree."""
    for label in labels:
        shutil.copytree(REPO / "golden" / label, root / label)
    return root


PURE_FSDP_CASE = "llama2-7b/v5p-16/slice_1/rule_pure-fsdp"


@pytest.fixture(scope="module")
def no_embed(tmp_path_factory):
    """The shipped pure-fsdp case of llama2-7b dumped under no_embed_rule: the rule file keeps the name
    pure-fsdp.yml, so the dump lands in the shipped case's folder (PURE_FSDP_CASE) with another layout."""
    root = tmp_path_factory.mktemp("no-embed")
    return dumped(Case.make("llama2-7b", "v5p-16", no_embed_rule(root, "pure-fsdp.yml")), root / "golden")


def markdown_rows(text):
    """{first cell: cells} of every body row of every markdown table in `text`."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith(("| tensor ", "| case ", "| memory per device ")):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells
    return rows


def test_two_rules_markdown_names_tensors_specs_and_bytes(capsys, no_embed):
    old = REPO / "golden" / PURE_FSDP_CASE
    assert main(["diff", str(old), str(no_embed), "--format", "markdown"]) == 1
    out = capsys.readouterr().out
    assert "21 tensors changed, 0 added, 0 removed" in out
    rows = markdown_rows(out)
    # memory per device first: in the summary, then every part before and after in the case's block
    assert out.index("model/device") < out.index("| memory per device ") < out.index("| tensor ")
    assert rows["model"] == ["model", "3.1 GiB", "24.2 GiB", "+21.1 GiB (+673%)"]
    assert rows["activations"] == ["activations", "9.2 GiB", "9.2 GiB", "0"]
    assert rows["`model/decoder/layers/mlp/wi_0/kernel` (and optimizer/opt_state/0/mu, optimizer/opt_state/0/nu)"][1:] == [
        '`["fsdp",null,null]`', "`[null,null,null]`", "688.0 MiB", "5.4 GiB"]
    tensors = [name for name in rows if name.startswith("`model/")]
    assert len(tensors) == 7 and not any("token_embedder" in name for name in rows)  # embed_vocab kept fsdp
    assert "|---" in out or "|:--" in out  # a real table, ready to paste


def test_command_line_exit_status(tmp_path):
    folder = "golden/llama2-7b/v5p-16/slice_1/rule_default"
    other = "golden/llama2-7b/v5p-16/slice_2/rule_default"
    result = run_cli("diff", folder, other, "--format", "markdown")
    assert result.returncode == 1 and result.stderr == ""
    assert "- header mesh.axis_sizes: " in result.stdout and "- header case.num_slices: 1 -> 2" in result.stdout


def test_identical_inputs_exit_0(tmp_path, capsys):
    folder = REPO / "golden/llama2-7b/v5p-16/slice_1/rule_default"
    assert main(["diff", str(folder), str(folder)]) == 0
    assert "0 of 1 case differs" in capsys.readouterr().out
    tree = REPO / "golden/llama2-7b/v5p-16"  # a golden tree of three cases
    assert main(["diff", str(tree), str(tree), "--format", "markdown"]) == 0
    assert capsys.readouterr().out == "### sharding-dump diff: 0 of 3 cases differ\n"


def test_golden_trees_paired_by_case(tmp_path, capsys, no_embed):
    same = ["llama2-7b/v5p-16/slice_1/rule_default", "qwen3-0.6b/tpu7x-16/slice_1/rule_default"]
    gone, added = "llama2-7b/v5p-16/slice_2/rule_default", "qwen3-0.6b/a3/slice_2/rule_default"
    old = copy_cases(tmp_path / "old", [PURE_FSDP_CASE, gone, *same])
    new = copy_cases(tmp_path / "new", [added, *same])
    shutil.copytree(no_embed, new / PURE_FSDP_CASE)  # same folder as the shipped pure-fsdp case, different layout
    assert main(["diff", str(old), str(new), "--format", "json"]) == 1
    first = capsys.readouterr().out
    doc = json.loads(first)
    status = {c["case"]: c["status"] for c in doc["cases"]}
    assert status == {PURE_FSDP_CASE: "changed", added: "added", gone: "removed", **dict.fromkeys(same, "identical")}
    changed = next(c for c in doc["cases"] if c["status"] == "changed")
    assert changed["counts"] == {"added": 0, "changed": 21, "removed": 0}
    wi0 = next(t for t in changed["tensors"] if t["tensor"] == "model/decoder/layers/mlp/wi_0/kernel")
    assert (wi0["old_spec"], wi0["new_spec"]) == (["fsdp", None, None], [None, None, None])
    assert (wi0["old_per_device_bytes"], wi0["new_per_device_bytes"]) == (721420288, 5771362304)
    assert wi0["slots"] == ["optimizer/opt_state/0/mu", "optimizer/opt_state/0/nu"]
    main(["diff", str(old), str(new), "--format", "json"])
    assert capsys.readouterr().out == first  # deterministic
    assert main(["diff", str(old), str(new)]) == 1
    text = capsys.readouterr().out
    assert text.startswith("sharding-dump diff: 3 of 5 cases differ")
    assert "case added" in text and "case removed" in text


def test_goldens_of_the_previous_format_compare_by_content(tmp_path, capsys):
    """A checkout of main from before per-device bytes were recorded diffs clean against today's (on
    the first case of each model: every decoder block's state)."""
    cases = [min(model.rglob("named_shardings.json")).parent.relative_to(REPO / "golden").as_posix()
             for model in sorted((REPO / "golden").iterdir())]
    old, new = copy_cases(tmp_path / "old", cases), copy_cases(tmp_path / "new", cases)
    for path in old.rglob("named_shardings.json"):
        doc = json.loads(path.read_text())
        doc["format_version"] = 1
        del doc["per_device_bytes"]
        for entry in doc["tensors"].values():
            del entry["per_device_bytes"]
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    assert main(["diff", str(old), str(new)]) == 0
    assert capsys.readouterr().out.startswith(f"sharding-dump diff: 0 of {len(cases)} cases differ")


def test_documents_with_no_tensor_in_common_are_reported_per_tensor():
    old = {"kind": "named", "tensors": {f"params/a{i}": {"shape": [i]} for i in range(5)}}
    new = {"kind": "named", "tensors": {f"params/b{i}": {"shape": [i]} for i in range(5)}}
    found = diff.diff_documents(old, new)
    assert sorted(found.removed) == sorted(old["tensors"]) and sorted(found.added) == sorted(new["tensors"])


@pytest.mark.parametrize("args,message", [
    (["diff", "/no/such/old", "golden"], "OLD /no/such/old: not a folder"),
    (["diff", "golden/llama2-7b/v5p-16/slice_1/rule_default", "golden"], "OLD is a case folder but NEW is not"),
    (["diff", "sharding_dump/rules", "sharding_dump/rules"], "no golden files under"),
    (["diff", "golden", "golden", "--format", "svg"], "invalid choice: 'svg'"),
    (["diff", "golden"], "the following arguments are required: NEW"),
])
def test_bad_input(args, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and len(captured.err.strip().splitlines()) == 1


def test_broken_golden_file_is_bad_input(tmp_path, capsys):
    folder = tmp_path / "case"
    shutil.copytree(REPO / "golden/llama2-7b/v5p-16/slice_1/rule_default", folder)
    (folder / "named_shardings.json").write_text('{"kind": "named"')
    assert main(["diff", str(folder), str(folder)]) == 2
    assert "named_shardings.json: not valid JSON" in capsys.readouterr().err


def unshard_activation_batch(tree):
    """What `activation_batch: []` in default.yml does to the activation goldens of every default-rule
    case (the classic out-of-memory regression), written into the JSON directly: the batch dimension
    of every activation named activation_batch loses its mesh axes. Returns the case folders changed."""
    changed = set()
    for path in sorted(tree.rglob("rule_default*/activation_shardings.json")):
        doc = json.loads(path.read_text())
        for entry in doc["tensors"].values():
            if entry["logical_axes"][:1] == ["activation_batch"] and entry["partition_spec"][0] is not None:
                entry["partition_spec"][0] = None
                entry["per_device_shape"][0] = entry["shape"][0]
                changed.add(path.parent)
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return changed


# Default-rule cases: with the activation batch unsharded, the markdown of the first five (the ones
# with the most activations) is longer than one GitHub comment holds, so that the cut leaves the
# last two (short ones) out.
LONG_CASES = ["gemma3-4b/tpu7x-8/slice_1/rule_default",
              "gemma4-26b/tpu7x-16/slice_1/rule_default_ici_tensor_parallelism=2_ici_expert_parallelism=4",
              "llama4-17b-16e/tpu7x-16/slice_1/rule_default_ici_expert_parallelism=4",
              "olmo3-7b/v6e-8/slice_1/rule_default_ici_tensor_parallelism=2",
              "qwen3-0.6b/tpu7x-8/slice_1/rule_default_ici_pipeline_parallelism=2_num_pipeline_microbatches=8_"
              "num_pipeline_repeats=2_num_layers_per_pipeline_stage=6_pipeline_parallel_layers=24",
              "qwen3-235b-a22b/tpu7x-256/slice_1/rule_default_ici_expert_parallelism=8",
              "qwen3-30b-a3b/tpu7x-64/slice_1/rule_default_ici_expert_parallelism=4"]


def test_markdown_fits_a_github_comment_and_keeps_the_summary(tmp_path, capsys):
    old, new = copy_cases(tmp_path / "old", LONG_CASES), copy_cases(tmp_path / "new", LONG_CASES)
    differing = unshard_activation_batch(new)
    assert len(differing) == len(LONG_CASES)
    # --full: every activation by its own name, specs with every mesh axis (the long form to cut)
    assert main(["diff", str(old), str(new), "--format", "markdown", "--max-chars", "1000000", "--full"]) == 1
    full = capsys.readouterr().out
    assert main(["diff", str(old), str(new), "--format", "markdown", "--full"]) == 1
    cut = capsys.readouterr().out
    # GitHub's limit for a comment is the default, filled up to the last row that fits
    assert len(full) > 65_536 >= len(cut) > 60_000
    summary = full.split("\n\n<details")[0]
    assert cut.startswith(summary) and summary.count("\n| `") == len(differing)  # every differing case stays
    first = full.split("<details open><summary><code>")[1].split("</code>")[0]
    assert f"<details open><summary><code>{first}</code>" in cut and cut.count("<details") < full.count("<details")
    first_block = cut.split("</details>")[0]
    rows = [line for line in first_block.splitlines() if line.startswith("| `forward/")]
    assert rows and all('| `[["data","fsdp","fsdp_transpose","expert"],' in r and "| `[null," in r for r in rows)
    last = cut.rstrip("\n").splitlines()[-1]
    assert last.startswith("... ") and "more cases not shown" in last and "characters left out" in last
    assert cut.count("<details") == cut.count("</details>")  # no fold left open
    assert main(["diff", "golden", "golden", "--format", "json", "--max-chars", "5000"]) == 2
    assert "--max-chars 5000: takes a number >= 1000, with --format text or markdown" in capsys.readouterr().err


def test_markdown_of_a_rule_mutation_charts_memory_per_device(capsys, no_embed):
    """The comment carries a mermaid bar chart GitHub renders: each part of the state before and after,
    the figures those of the goldens' headers (3.1 -> 24.2 GiB of params, 6.3 -> 48.5 GiB of moments)."""
    assert main(["diff", str(REPO / "golden" / PURE_FSDP_CASE), str(no_embed), "--format", "markdown"]) == 1
    out = capsys.readouterr().out
    chart = out.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert chart.splitlines()[1:] == [
        "xychart-beta horizontal", '    title "Memory per device, before (grey) and after (blue)"',
        '    x-axis ["model before 3.1 GiB", "model after 24.2 GiB", "optimizer before 6.3 GiB", '
        '"optimizer after 48.5 GiB", "activations before 9.2 GiB", "activations after 9.2 GiB"]',
        '    y-axis "GiB per device, from 0" 0 --> 48.50',
        "    bar [3.14, 0, 6.28, 0, 9.19, 0]", "    bar [0, 24.25, 0, 48.50, 0, 9.19]"]
    assert main(["diff", str(REPO / "golden" / PURE_FSDP_CASE), str(no_embed)]) == 1
    assert "mermaid" not in capsys.readouterr().out  # a terminal gets the figures only


def test_many_charted_cases_fit_one_comment(tmp_path, capsys, no_embed):
    """Forty cases of the rule mutation, each with its chart: the comment is cut within GitHub's
    65,536 characters with every code fence and fold closed and the summary whole."""
    labels = [f"m{i:02d}/v5p-16/slice_1/rule_pure-fsdp" for i in range(40)]
    for label in labels:
        shutil.copytree(REPO / "golden" / PURE_FSDP_CASE, tmp_path / "old" / label)
        shutil.copytree(no_embed, tmp_path / "new" / label)
    assert main(["diff", str(tmp_path / "old"), str(tmp_path / "new"), "--format", "markdown"]) == 1
    out = capsys.readouterr().out
    assert len(out) <= 65_536 < len(out) * 2
    assert out.count("```mermaid") > 1 and out.count("```") % 2 == 0
    assert out.count("<details") == out.count("</details>")
    assert out.split("\n\n<details")[0].count("\n| `m") == 40
    assert "more cases not shown" in out.rstrip("\n").splitlines()[-1]


def test_html_report_is_a_standalone_page_with_the_chart(tmp_path, capsys, no_embed):
    """--format html: one page for a CI artifact, every row (never cut), the memory chart as inline SVG
    with the bar after the change eight times the bar before, as the bytes are."""
    from html.parser import HTMLParser

    assert main(["diff", str(REPO / "golden" / PURE_FSDP_CASE), str(no_embed), "--format", "html"]) == 1
    page = capsys.readouterr().out
    opened = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag != "meta":
                opened.append(tag)

        def handle_endtag(self, tag):
            assert opened.pop() == tag

    Tags().feed(page)
    assert opened == [] and page.startswith("<!DOCTYPE html>") and "<script" not in page
    widths = dict(re.findall(r'<text x="0" y="\d+" font-size="13">(model \w+)</text><rect x="150" y="\d+" width="(\d+)"',
                             page))
    assert (int(widths["model before"]), int(widths["model after"])) == (19, 150)
    assert page.count("model/decoder/layers/") == 7  # every changed parameter row: nothing folded away
    assert main(["diff", str(REPO / "golden" / PURE_FSDP_CASE), str(no_embed), "--format", "html"]) == 1
    assert capsys.readouterr().out == page  # deterministic
    assert main(["diff", "golden", "golden", "--format", "html", "--max-chars", "5000"]) == 2


def test_a_serving_case_shows_cache_bytes_per_device_and_per_request(tmp_path, capsys, fresh):
    """The serving example with llama3_jax's kv_heads rule removed: the cache is split over x only, so
    each device holds four times as much of it (and more of the k and v weights); a request's cache is
    as large as before."""
    import dataclasses

    from examples import llama3_serving as ls
    from sharding_dump.golden.engine import check_or_update_folder
    from sharding_dump.zoo import dump
    from sharding_dump.zoo.matrix import load_matrix

    (case,) = load_matrix(REPO / "examples/serving_cases.yml")
    fresh.setattr(ls, "RULES", dataclasses.replace(ls.RULES, kv_heads=None))
    new = tmp_path / "new"
    check_or_update_folder(new, dump.render_case(case), update=True)
    assert main(["diff", str(golden_dir(case, REPO / "golden")), str(new), "--format", "markdown"]) == 1
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| cache ") or line.startswith("| weights ")}
    assert rows == {"cache": ["18.0 KiB", "72.0 KiB", "+54.0 KiB (+300%)"],
                    "weights": ["62.1 KiB", "74.1 KiB", "+12.0 KiB (+19%)"]}  # memory per device, by part
    assert ("- KV cache: per device 18.0 KiB -> 72.0 KiB (+54.0 KiB, +300%), per device per request 2.3 KiB -> "
            "9.0 KiB (+6.8 KiB, +300%)") in out
    assert ", per request" not in out  # a request's cache is as large as before: not listed
    assert '`cache/k/0/quant`' in out and '`["x",null,null,null]`' in out
