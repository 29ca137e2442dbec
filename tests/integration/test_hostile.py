"""Hostile input: every probe below is bad input of one of the classes of issue 13 (filesystem errors,
unbounded numbers, long names, resource-exhausting files, silently accepted nonsense, a damaged
golden tree). Each must end with exit status 2, exactly one line on stderr naming what is wrong, no
traceback, and nothing written anywhere under the test's folder.

The CLI runs in-process (`cli.main(argv)`); package data files (settings.yml, topologies.tsv, model
cards) are swapped for a broken copy by pointing the module at it, with the module's cache cleared.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from sharding_dump.commands import cli
from sharding_dump.resources import MODELS_DIR
from sharding_dump.zoo import cards as card_config
from sharding_dump.zoo import settings, topology
from sharding_dump.zoo.case import MAX_NAME_CHARS

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "qwen3-0.6b", "--topology", "cpu-1", "--rule", "default", "max_target_length=16",
        "per_device_batch_size=1"]
GOLDEN_CASE = REPO / "golden/qwen3-0.6b/tpu7x-16/slice_1/rule_default"
BIG = "9" * 5000
MAX_LINE = 600  # characters of the one error line, whatever was echoed


def dump(*words: str, case: tuple[str, str, str] = ("qwen3-0.6b", "cpu-1", "default")) -> list[str]:
    """A dump command of one case plus `words`, into OUT (replaced by the probe's output folder)."""
    model, topo, rule = case
    return ["--model", model, "--topology", topo, "--rule", rule, *words]


def rule_file(text: str | bytes, name: str = "rule.yml") -> Callable[[Path], list[str]]:
    """Setup: a rule file with `text`, used by a dump of the tiny case."""
    def setup(tmp: Path) -> list[str]:
        path = tmp / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return dump("--rule", str(path))[:4] + ["--rule", str(path)]
    return setup


GOOD_RULE = "mesh_axes: [data, fsdp]\nlogical_axis_rules:\n  - [embed, fsdp]\n  - [activation_batch, [data, fsdp]]\n"


def rule_with(extra: str) -> Callable[[Path], list[str]]:
    return rule_file(GOOD_RULE + extra)


def golden_pair(mutate: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    """Setup: `diff` of a real golden case folder and a copy damaged by `mutate`."""
    def setup(tmp: Path) -> list[str]:
        old, new = tmp / "old", tmp / "new"
        shutil.copytree(GOLDEN_CASE, old)
        shutil.copytree(GOLDEN_CASE, new)
        mutate(new)
        return ["diff", str(old), str(new)]
    return setup


def edit_named(change: Callable[[dict], None], name: str = "named_shardings.json") -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        doc = json.loads((folder / name).read_text())
        change(doc)
        (folder / name).write_text(json.dumps(doc))
    return mutate


def first_tensor(doc: dict) -> dict:
    return next(iter(doc["tensors"].values()))


def write_golden(folder_text: bytes | str, name: str = "named_shardings.json") -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        (folder / name).write_bytes(folder_text if isinstance(folder_text, bytes) else folder_text.encode())
    return mutate


def replace_golden(make: Callable[[Path], None], name: str = "named_shardings.json") -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        (folder / name).unlink()
        make(folder / name)
    return mutate


def in_tree(make: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    """Setup: an output folder prepared by `make(out)` (symlinks, files where folders go, ...)."""
    def setup(tmp: Path) -> list[str]:
        out = tmp / "tree"
        out.mkdir()
        make(out)
        return TINY + ["--output-dir", str(out)]
    return setup


def case_path(out: Path) -> Path:
    return out / "qwen3-0.6b/cpu-1/slice_1/rule_default_per_device_batch_size=1_max_target_length=16"


def symlinked_model(out: Path) -> None:
    (out.parent / "elsewhere").mkdir()
    (out / "qwen3-0.6b").symlink_to(out.parent / "elsewhere")


def symlinked_case(out: Path) -> None:
    case_path(out).parent.mkdir(parents=True)
    (out.parent / "elsewhere").mkdir()
    case_path(out).symlink_to(out.parent / "elsewhere")


def file_as_slice(out: Path) -> None:
    (out / "qwen3-0.6b/cpu-1").mkdir(parents=True)
    (out / "qwen3-0.6b/cpu-1/slice_1").write_text("x")


def dir_as_golden(out: Path) -> None:
    (case_path(out) / "named_shardings.json").mkdir(parents=True)


def fifo_as_golden(out: Path) -> None:
    case_path(out).mkdir(parents=True)
    os.mkfifo(case_path(out) / "named_shardings.json")


def devzero_as_golden(out: Path) -> None:
    case_path(out).mkdir(parents=True)
    (case_path(out) / "logical_shardings.json").symlink_to("/dev/zero")


def output_dir(path: str) -> Callable[[Path], list[str]]:
    return lambda tmp: TINY + ["--output-dir", path.replace("TMP", str(tmp))]


def output_file(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return TINY + ["--output-dir", str(tmp / "afile")]


def below_file(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return TINY + ["--output-dir", str(tmp / "afile/golden")]


def data_file(module, attr: str, cache: Callable[[], None], name: str, edit: Callable[[str], str],
              argv: list[str] | None = None):
    """Setup: a broken copy of one of the package's data files, the module pointed at it."""
    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
        source = getattr(module, attr)
        copy = tmp / name
        copy.write_text(edit(source.read_text()))
        monkeypatch.setattr(module, attr, copy)
        cache()
        return argv or TINY + ["--output-dir", str(tmp / "out")]
    setup.data = True
    return setup


def clear_data_caches() -> None:
    settings._registry.cache_clear()
    topology._table.cache_clear()
    card_config._read_card.cache_clear()


def settings_edit(edit: Callable[[str], str]):
    return data_file(settings, "SETTINGS_FILE", clear_data_caches, "settings.yml", edit)


def topologies_edit(edit: Callable[[str], str]):
    return data_file(topology, "TOPOLOGIES_FILE", clear_data_caches, "topologies.tsv", edit,
                     ["list", "topologies"])


def card_edit(edit: Callable[[str], str]):
    """A models folder whose qwen3-0.6b card is edited."""
    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
        models = tmp / "models"
        shutil.copytree(MODELS_DIR, models)
        card = models / "qwen3-0.6b.yml"
        card.write_text(edit(card.read_text()))
        monkeypatch.setattr(card_config, "MODELS_DIR", models)
        clear_data_caches()
        return TINY + ["--output-dir", str(tmp / "out")]
    setup.data = True
    return setup


def sub(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)
    return edit


TSV_ROW = "v5p-8\ttpu\tv5p\t4\t4\t95"

# (id, argv or setup, a word the one error line must hold)
PROBES: list[tuple[str, object, str]] = [
    # --- 2. unbounded numbers ------------------------------------------------------------------------
    ("cpu-2**31", dump(case=("qwen3-0.6b", "cpu-2147483648", "default")), "[1, 1048576]"),
    ("cpu-1048577", dump(case=("qwen3-0.6b", "cpu-1048577", "default")), "[1, 1048576]"),
    ("cpu-5000-digits", dump(case=("qwen3-0.6b", "cpu-" + BIG, "default")), "cpu-N"),
    ("cpu-0", dump(case=("qwen3-0.6b", "cpu-0", "default")), "unknown topology"),
    ("cpu-negative", dump(case=("qwen3-0.6b", "cpu--4", "default")), "unknown topology"),
    ("num-slices-1e9", dump("--num-slices", "1000000000"), "[1, 1048576]"),
    ("num-slices-0", dump("--num-slices", "0"), "[1, 1048576]"),
    ("num-slices-negative", dump("--num-slices", "-3"), "[1, 1048576]"),
    ("num-slices-5000-digits", dump("--num-slices", BIG), "digits"),
    ("num-slices-text", dump("--num-slices", "two"), "not a whole number"),
    ("num-slices-float", dump("--num-slices", "1.5"), "not a whole number"),
    ("devices-x-slices", dump("--num-slices", "2048", case=("qwen3-0.6b", "cpu-1024", "default")), "limit of 1048576"),
    ("ici-parallelism-0", dump("ici_fsdp_parallelism=0"), "ici_fsdp_parallelism"),
    ("ici-parallelism-minus-2", dump("ici_fsdp_parallelism=-2"), "-1 (fill)"),
    ("ici-parallelism-2**31", dump("ici_fsdp_parallelism=2147483648"), "1048576"),
    ("ici-parallelism-5000-digits", dump(f"ici_fsdp_parallelism={BIG}"), "1048576"),
    ("ici-parallelism-float", dump("ici_fsdp_parallelism=1.5"), "whole number"),
    ("ici-parallelism-bool", dump("ici_fsdp_parallelism=true"), "whole number"),
    ("dcn-parallelism-1e9", dump("dcn_data_parallelism=1000000000"), "1048576"),
    ("pdbs-1e308", dump("per_device_batch_size=1e308"), "[0, 1048576]"),
    ("pdbs-1e400", dump("per_device_batch_size=1e400"), "[0, 1048576]"),
    ("pdbs-inf", dump("per_device_batch_size=inf"), "[0, 1048576]"),
    ("pdbs-nan", dump("per_device_batch_size=nan"), "[0, 1048576]"),
    ("pdbs-negative", dump("per_device_batch_size=-1"), "[0, 1048576]"),
    ("pdbs-5000-digits", dump(f"per_device_batch_size={BIG}"), "[0, 1048576]"),
    ("pdbs-text", dump("per_device_batch_size=lots"), "must be a number"),
    ("seq-1e30", dump("max_target_length=" + "1" + "0" * 30), "2147483647"),
    ("seq-2**31", dump("max_target_length=2147483648"), "2147483647"),
    ("seq-0", dump("max_target_length=0"), "[1, 2147483647]"),
    ("seq-float", dump("max_target_length=2048.5"), "whole number"),
    ("seq-5000-digits", dump(f"max_target_length={BIG}"), "2147483647"),
    ("microbatches-1e12", dump("num_pipeline_microbatches=1000000000000"), "1048576"),
    ("microbatches-minus-2", dump("num_pipeline_microbatches=-2"), "[-1, 1048576]"),
    ("repeats-below-fill", dump("num_pipeline_repeats=-2"), "[-1, 1048576]"),
    ("repeats-1e7", dump("num_pipeline_repeats=10000000"), "[-1, 1048576]"),
    ("pipeline-layers-minus-5", dump("pipeline_parallel_layers=-5"), "[-1, 1048576]"),
    ("bool-setting-text", dump("use_ring_of_experts=maybe"), "true or false"),
    ("choice-setting", dump("weight_dtype=float99"), "float32, bfloat16"),
    ("check-numbers", ["check", *dump("per_device_batch_size=1e308")], "[0, 1048576]"),
    ("show-numbers", ["show", *dump("--num-slices", "1000000000")], "[1, 1048576]"),
    ("check-tolerance", ["check", *dump("--replicated-tolerance", "1e999")], "replicated-tolerance"),
    # --- 3. long names, echoed values --------------------------------------------------------------
    ("model-100k-chars", dump(case=("m" * 100_000, "cpu-1", "default")), "unknown model"),
    ("topology-100k-chars", dump(case=("qwen3-0.6b", "t" * 100_000, "default")), "unknown topology"),
    ("rule-100k-chars", dump(case=("qwen3-0.6b", "cpu-1", "r" * 100_000)), "unknown rule"),
    ("setting-key-100k-chars", dump("k" * 100_000 + "=1"), "unknown setting"),
    ("setting-value-100k-chars", dump("weight_dtype=" + "v" * 100_000), "weight_dtype"),
    ("model-with-newline", dump(case=("qwen3\n0.6b", "cpu-1", "default")), "unknown model"),
    ("setting-with-escape", dump("weight_dtype=\x1b[31mred"), "weight_dtype"),
    ("rule-path-long-stem", lambda tmp: dump(case=("qwen3-0.6b", "cpu-1", str(tmp / ("r" * 300 + ".yml")))),
     "File name too long"),
    ("output-dir-too-long", output_dir("TMP/" + "d" * 300 + "/golden"), "File name too long"),
    ("output-dir-path-too-long", output_dir("TMP/" + "/".join(["d" * 200] * 30)), "File name too long"),
    ("setting-twice", dump("max_target_length=16", "max_target_length=32"), "given twice"),
    ("setting-no-value", dump("max_target_length="), "KEY=VALUE"),
    # --- 4. files that exhaust resources, 5. nonsense in them ---------------------------------------
    ("rule-fifo", lambda tmp: (os.mkfifo(tmp / "fifo.yml"), dump(case=("qwen3-0.6b", "cpu-1", str(tmp / "fifo.yml"))))[1],
     "FIFO"),
    ("rule-devzero", lambda tmp: ((tmp / "zero.yml").symlink_to("/dev/zero"),
                                  dump(case=("qwen3-0.6b", "cpu-1", str(tmp / "zero.yml"))))[1], "device"),
    ("rule-folder", lambda tmp: ((tmp / "dir.yml").mkdir(), dump(case=("qwen3-0.6b", "cpu-1", str(tmp / "dir.yml"))))[1],
     "Is a directory"),
    ("rule-missing", lambda tmp: dump(case=("qwen3-0.6b", "cpu-1", str(tmp / "nope.yml"))), "No such file"),
    ("rule-dangling-link", lambda tmp: ((tmp / "l.yml").symlink_to(tmp / "gone"),
                                        dump(case=("qwen3-0.6b", "cpu-1", str(tmp / "l.yml"))))[1], "No such file"),
    ("rule-2mib", rule_file("mesh_axes: [fsdp]\n" + "# pad\n" * 400_000), "more than the limit of"),
    ("rule-sparse-1gib", lambda tmp: (os.truncate(_touch(tmp / "big.yml"), 1 << 30),
                                      dump(case=("qwen3-0.6b", "cpu-1", str(tmp / "big.yml"))))[1], "limit of"),
    ("rule-alias-bomb", rule_file("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
                                  "c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c]\n"),
     "aliases are not allowed"),
    ("rule-merge-key", rule_file("base: &b {x: 1}\nmesh_axes: [fsdp]\nother: {<<: *b}\n"), "aliases"),
    ("rule-deep-flow", rule_file("mesh_axes: " + "[" * 100_000 + "]" * 100_000 + "\n"), "nested deeper"),
    ("rule-deep-block", rule_file("".join("  " * i + f"k{i}:\n" for i in range(300)) + "  " * 300 + "v\n"),
     "nested deeper"),
    ("rule-duplicate-key", rule_with("mesh_axes: [fsdp]\n"), "duplicate key 'mesh_axes'"),
    ("rule-duplicate-nested-key", rule_with("mesh_rules:\n  - {match: v5, match: v4, settings: {}}\n"), "duplicate key"),
    ("rule-not-utf8", rule_file(b"mesh_axes: [fsdp]\n# \xff\xfe\n"), "not UTF-8"),
    ("rule-empty", rule_file(""), "must be an object"),
    ("rule-top-level-list", rule_file("- mesh_axes\n"), "must be an object"),
    ("rule-5000-digit-int", rule_with(f"mesh_rules:\n  - {{match: v5, settings: {{ici_fsdp_parallelism: {BIG}}}}}\n"),
     "digits"),
    ("rule-python-tag", rule_file("mesh_axes: !!python/object/apply:os.system [true]\n"), "constructor"),
    ("rule-two-documents", rule_file(GOOD_RULE + "---\n" + GOOD_RULE), "not valid YAML"),
    ("rule-int-key", rule_with("1: 2\n"), "keys must be strings"),
    ("rule-not-yaml", rule_file("mesh_axes: [fsdp\n"), "not valid YAML"),
    ("rule-nul-bytes", rule_file(b"mesh_axes: [fsdp]\x00\n"), "not valid YAML"),
    ("rule-suffix", lambda tmp: dump(case=("qwen3-0.6b", "cpu-1", str(tmp / "rule.txt"))), "must end in .yml"),
    ("rule-data-sharding-repeated", rule_with("data_sharding: [[fsdp, fsdp]]\n"), "data_sharding"),
    ("rule-input-axes-repeated", rule_with("input_data_sharding_logical_axes: [embed, embed]\n"),
     "input_data_sharding_logical_axes"),
    ("rule-mesh-axes-repeated", rule_file("mesh_axes: [fsdp, fsdp]\nlogical_axis_rules: [[embed, fsdp]]\n"), "mesh_axes"),
    ("rule-rule-axes-repeated", rule_file("mesh_axes: [data, fsdp]\nlogical_axis_rules: [[embed, [fsdp, fsdp]]]\n"),
     "logical_axis_rules/0/1"),
    ("rule-undeclared-mesh-axis", rule_file("mesh_axes: [fsdp]\nlogical_axis_rules: [[embed, bogus]]\n"), "bogus"),
    ("rule-axis-not-in-mesh", rule_file("mesh_axes: [fsdp]\nlogical_axis_rules: [[embed, data]]\n"), "not in mesh_axes"),
    ("rule-context-not-in-mesh", rule_with("context_sharding: tensor\n"), "context_sharding"),
    ("rule-bad-regex", rule_with("mesh_rules:\n  - {match: '(', settings: {}}\n"), "regular expression"),
    ("rule-mesh-rule-huge-number", rule_with("mesh_rules:\n  - {match: cpu, settings: {ici_fsdp_parallelism: 4294967296}}\n"),
     "1048576"),
    ("rule-mesh-rule-unknown-key", rule_with("mesh_rules:\n  - {match: cpu, settings: {bogus: 1}}\n"), "unknown setting"),
    ("rule-mesh-rule-float-inf", rule_with("mesh_rules:\n  - {match: cpu, settings: {per_device_batch_size: .inf}}\n"),
     "per_device_batch_size"),
    ("rule-too-many-rules", rule_file("mesh_axes: [fsdp]\nlogical_axis_rules:\n" + "  - [embed, fsdp]\n" * 2000),
     "logical_axis_rules"),
    ("rule-name-too-long", rule_file("mesh_axes: [fsdp]\nlogical_axis_rules: [[" + "e" * 500 + ", fsdp]]\n"),
     "logical_axis_rules/0/0"),
    ("rule-unknown-field", rule_with("meshaxes: [fsdp]\n"), "meshaxes"),
    # --- data files of the package -------------------------------------------------------------------
    ("settings-defaults-wrong-type", settings_edit(sub("ici_defaults: {fsdp: -1}", "ici_defaults: fsdp")), "ici_defaults"),
    ("settings-unknown-type", settings_edit(sub("type: bool", "type: boolean")), "type"),
    ("settings-default-out-of-bounds", settings_edit(sub("    maximum: 2147483647\n    default: 2048",
                                                         "    maximum: 2147483647\n    default: 0")), "max_target_length"),
    ("settings-no-limits", settings_edit(lambda t: t.replace("limits:", "limitz:")), "limit"),
    ("settings-duplicate-key", settings_edit(sub("shard_mode:", "weight_dtype: {type: bool, default: true, help: x}\n  shard_mode:")),
     "duplicate key 'weight_dtype'"),
    ("settings-choice-default", settings_edit(sub("default: float32", "default: float64")), "weight_dtype"),
    ("settings-max-devices-text", settings_edit(sub("max_devices: 1048576", "max_devices: many")), "max_devices"),
    ("topologies-text-count", topologies_edit(sub(TSV_ROW, "v5p-8\ttpu\tv5p\tfour\t4\t95")), "devices_per_slice"),
    ("topologies-missing-column", topologies_edit(sub(TSV_ROW, "v5p-8\ttpu\tv5p\t4\t4")), "columns"),
    ("topologies-bad-platform", topologies_edit(sub(TSV_ROW, "v5p-8\tasic\tv5p\t4\t4\t95")), "platform"),
    ("topologies-duplicate", topologies_edit(lambda t: t + TSV_ROW + "\t2x2x1\tTPU v5p\n"), "listed twice"),
    ("topologies-bad-torus", topologies_edit(sub(TSV_ROW + "\t2x2x1", TSV_ROW + "\t3x3x1")), "torus"),
    ("topologies-huge", topologies_edit(sub(TSV_ROW, "v5p-8\ttpu\tv5p\t99999999999\t4\t95")), "[1, 1048576]"),
    ("topologies-hbm-nan", topologies_edit(sub(TSV_ROW, "v5p-8\ttpu\tv5p\t4\t4\tnan")), "hbm_gib_per_device"),
    ("topologies-header", topologies_edit(sub("devices_per_host", "hosts")), "header"),
    ("card-kv-heads", card_edit(sub("num_kv_heads: 8", "num_kv_heads: 5")), "num_kv_heads"),
    ("card-vocab-2**40", card_edit(lambda t: t.replace("vocab_size: 151936", "vocab_size: 1099511627776")), "vocab_size"),
    ("card-duplicate-key", card_edit(lambda t: t + "emb_dim: 8\n"), "duplicate key 'emb_dim'"),
    ("card-inf-epsilon", card_edit(lambda t: t + "normalization_layer_epsilon: .inf\n"), "normalization_layer_epsilon"),
    # --- 1. filesystem errors ------------------------------------------------------------------------
    ("output-dir-empty", output_dir(""), "give the path of a folder"),
    ("output-dir-a-file", output_file, "Not a directory"),
    ("output-dir-below-a-file", below_file, "Not a directory"),
    ("output-dir-proc", output_dir("/proc/sharding-dump-golden"), "/proc"),
    ("output-dir-proc-self", output_dir("/proc/self/golden"), "/proc/self"),
    ("output-dir-sys", output_dir("/sys/golden"), "/sys"),
    ("output-dir-dev-null", output_dir("/dev/null/golden"), "Not a directory"),
    ("tree-symlinked-model", in_tree(symlinked_model), "symbolic link"),
    ("tree-symlinked-case", in_tree(symlinked_case), "symbolic link"),
    ("tree-file-as-folder", in_tree(file_as_slice), "Not a directory"),
    ("tree-golden-is-folder", in_tree(dir_as_golden), "Is a directory"),
    ("tree-golden-is-fifo", in_tree(fifo_as_golden), "FIFO"),
    ("tree-golden-is-devzero", in_tree(devzero_as_golden), "device"),
    # --- 6. golden tree integrity (diff reads goldens) -----------------------------------------------
    ("golden-wrong-kind", golden_pair(lambda f: shutil.copy(f / "logical_shardings.json", f / "named_shardings.json")),
     "which holds kind 'named'"),
    ("golden-unknown-dtype", golden_pair(edit_named(lambda d: first_tensor(d).update(dtype="float99"))), "float99"),
    ("golden-act-unknown-dtype", golden_pair(edit_named(lambda d: first_tensor(d).update(dtype="x"), "activation_shardings.json")),
     "dtype"),
    ("golden-not-utf8", golden_pair(lambda f: (f / "named_shardings.json").write_bytes(b"\xff" + (f / "named_shardings.json").read_bytes())),
     "not UTF-8"),
    ("golden-folder", golden_pair(replace_golden(lambda p: p.mkdir())), "Is a directory"),
    ("golden-fifo", golden_pair(replace_golden(os.mkfifo)), "FIFO"),
    ("golden-devzero", golden_pair(replace_golden(lambda p: p.symlink_to("/dev/zero"))), "device"),
    ("golden-deep", golden_pair(write_golden("[" * 100_000 + "]" * 100_000)), "nested deeper"),
    ("golden-deep-50", golden_pair(write_golden("[" * 50 + "]" * 50)), "nested deeper"),
    ("golden-5000-digits", golden_pair(write_golden(f'{{"kind": "named", "n": {BIG}}}')), "digits"),
    ("golden-nan", golden_pair(write_golden('{"kind": NaN}')), "NaN"),
    ("golden-duplicate-key", golden_pair(write_golden('{"kind": "named", "kind": "named"}')), "duplicate key"),
    ("golden-empty", golden_pair(write_golden("")), "not valid JSON"),
    ("golden-sparse-huge", golden_pair(lambda f: os.truncate(f / "named_shardings.json", 1 << 34)), "limit of"),
    ("golden-top-level-list", golden_pair(write_golden("[]")), "named_shardings.json"),
    ("golden-unknown-kind", golden_pair(edit_named(lambda d: d.update(kind="bogus"))), "kind"),
    ("diff-old-is-file", lambda tmp: ["diff", str(_touch(tmp / "f")), str(GOLDEN_CASE)], "not a folder"),
]


def _touch(path: Path) -> Path:
    path.write_text("")
    return path


def tree(root: Path) -> dict[str, tuple[int, bytes | str]]:
    """Every entry under `root` with its mode and content (files), target (links) or nothing."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                content: bytes | str = os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                content = path.read_bytes() if info.st_size < 1 << 20 else str(info.st_size)
            else:
                content = ""
            out[path.relative_to(root).as_posix()] = (info.st_mode, content)
    return out


def test_there_are_at_least_100_probes():
    assert len(PROBES) >= 100
    assert len({name for name, _, _ in PROBES}) == len(PROBES)


@pytest.mark.parametrize("name,probe,word", PROBES, ids=[p[0] for p in PROBES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(name, probe, word, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    try:
        if callable(probe):
            argv = probe(work, monkeypatch) if getattr(probe, "data", False) else probe(work)
        else:
            argv = list(probe) + ([] if probe[0] in ("check", "show", "diff") else ["--output-dir", str(work / "out")])
        before = tree(tmp_path)
        status = cli.main(argv)
        captured = capsys.readouterr()
    finally:
        clear_data_caches()
    assert status == 2, f"exit status {status}, stderr {captured.err[:500]!r}"
    assert captured.out == "", captured.out[:500]
    assert captured.err.count("\n") == 1 and captured.err.endswith("\n"), captured.err[:2000]
    assert captured.err.startswith("sharding-dump: error: "), captured.err[:500]
    assert "Traceback" not in captured.err and len(captured.err) <= MAX_LINE, captured.err[:2000]
    assert word in captured.err, captured.err
    assert tree(tmp_path) == before


def test_disk_errors_while_writing_are_one_line_and_leave_nothing(tmp_path, capsys):
    """A real OS error in the middle of writing a case (the file size limit: EFBIG, as ENOSPC would be)
    names the file and the error, and leaves no folder or temp behind."""
    out = tmp_path / "out"
    assert cli.main(TINY + ["--output-dir", str(tmp_path / "warm")]) == 0  # trace before the limit is set
    capsys.readouterr()
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        status = cli.main(TINY + ["--output-dir", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "File too large (EFBIG)" in err, err
    assert "_shardings.json" in err and not out.exists()


def test_long_overrides_make_a_short_stable_folder_name():
    from sharding_dump.zoo.case import MAX_NAME_CHARS, Case

    long_rule = Case.make("qwen3-0.6b", "cpu-8", "default", overrides={"per_device_batch_size": "0.125", "max_target_length": "16",
                                     "num_pipeline_microbatches": "-1", "num_pipeline_repeats": "1",
                                     "pipeline_parallel_layers": "-1", "shard_optimizer_over_data": "false",
                                     "use_ring_of_experts": "false", "weight_dtype": "bfloat16", "shard_mode": "auto",
                                     **{f"ici_{a}_parallelism": "1" for a in ("data", "tensor", "expert", "context")}})
    name = long_rule.name
    assert len(name) == MAX_NAME_CHARS and name.startswith("rule_default_ici_data_parallelism=1")
    assert name == Case.make("qwen3-0.6b", "cpu-8", "default", overrides=dict(reversed(dict(
        long_rule.overrides).items()))).name  # stable: canonical order, same hash
    assert name[-17] == "~" and all(c in "0123456789abcdef" for c in name[-16:])


def test_user_rule_file_with_a_long_name_gets_a_hashed_folder(tmp_path, capsys):
    rule = tmp_path / ("r" * 240 + ".yml")
    rule.write_text((REPO / "sharding_dump/rules/default.yml").read_text())
    assert cli.main(TINY[:4] + ["--rule", str(rule), *TINY[6:], "--output-dir", str(tmp_path / "out")]) == 0
    (folder,) = (tmp_path / "out/qwen3-0.6b/cpu-1/slice_1").iterdir()
    assert len(folder.name) == MAX_NAME_CHARS and "~" in folder.name
    assert sorted(p.name for p in folder.iterdir()) == ["activation_shardings.json", "logical_shardings.json",
                                                        "named_shardings.json"]


def test_goldens_get_the_umask_mode(tmp_path, capsys):
    old = os.umask(0o027)
    try:
        assert cli.main(TINY + ["--output-dir", str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    folder = tmp_path / "out/qwen3-0.6b/cpu-1/slice_1/rule_default_per_device_batch_size=1_max_target_length=16"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o640}
    (folder / "named_shardings.json").chmod(0o600)  # as written by an older version: rewritten
    old = os.umask(0o027)
    try:
        assert cli.main(TINY + ["--output-dir", str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    assert "wrote named_shardings.json" in capsys.readouterr().out
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o640}


def test_stray_files_in_a_case_folder_are_removed_by_the_cli(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(TINY + ["--output-dir", str(out)]) == 0
    folder = case_path(out)
    (folder / "notes.txt").write_text("x")
    (folder / ".named_shardings.json.tmp-1-0000abcd").write_text("x")
    capsys.readouterr()
    assert cli.main(TINY + ["--output-dir", str(out)]) == 0
    assert "removed .named_shardings.json.tmp-1-0000abcd, notes.txt" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == ["activation_shardings.json", "logical_shardings.json",
                                                        "named_shardings.json"]


# The cheapest dump for a fresh process: the NNX example (its layers scanned), a tiny batch.
SMALL_FACTORY = ["--model", "examples.nnx_lm:small_lm", "--topology", "cpu-1", "--rule",
                 str(REPO / "examples/rules.yml"), "max_target_length=16", "per_device_batch_size=1"]


def test_environment_cannot_break_the_command(tmp_path, capsys, monkeypatch):
    """JAX_PLATFORMS naming an absent accelerator, strict dtype promotion, x64 and an unknown XLA flag
    (read by jax when a process imports it, so the command runs in a new one): the command needs no
    device and writes the same bytes as without them."""
    monkeypatch.chdir(REPO)  # where `examples` is importable, as for a user's own package
    assert cli.main(SMALL_FACTORY + ["--output-dir", str(tmp_path / "plain")]) == 0
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "JAX_NUMPY_DTYPE_PROMOTION": "strict", "JAX_ENABLE_X64": "1",
           "XLA_FLAGS": "--no_such_xla_flag", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "sharding_dump.commands.cli", *SMALL_FACTORY, "--output-dir",
                             str(tmp_path / "env")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert tree(tmp_path / "env") == tree(tmp_path / "plain")


# A program that builds its concrete mesh from jax.devices() in its factory, as Levanter's trainer does.
OWN_MESH = """
import os
import jax, jax.numpy as jnp, numpy as np
import sharding_dump as sd


def program():
    assert "--xla_dump_hlo_as_text" in os.environ["XLA_FLAGS"].split(), os.environ["XLA_FLAGS"]  # the user's own
    devices = jax.devices()
    if len(devices) % 2:
        raise ValueError(f"ICI product 2 does not divide devices_per_slice {len(devices)}")
    mesh = jax.sharding.Mesh(np.array(devices).reshape(-1, 2), ("fsdp", "tensor"))
    assert dict(mesh.shape) == {"fsdp": 2, "tensor": 2}, mesh
    return sd.TrainProgram(lambda key: {"params": {"w": jnp.zeros((8, 4))}}, lambda state, batch: (state, {}))
"""


def test_a_program_that_builds_its_mesh_from_the_devices_gets_the_cases_count(tmp_path):
    """The case's device count as CPU devices, after the user's own XLA_FLAGS (which stay): a fresh
    process, as the command is (mutation: no give_cpu_devices in options.cases_of, and the factory
    fails with `ICI product 2 does not divide devices_per_slice 1`; XLA_FLAGS dropped as before, and
    it fails its assertion of the user's flag)."""
    (tmp_path / "own_mesh.py").write_text(OWN_MESH)
    (tmp_path / "mesh.yml").write_text("mesh_axes: [fsdp, tensor]\n")
    env = {**os.environ, "XLA_FLAGS": "--xla_dump_hlo_as_text --xla_force_host_platform_device_count=1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    result = subprocess.run([sys.executable, "-m", "sharding_dump.commands.cli", "--model", "own_mesh:program",
                             "--topology", "cpu-4", "--rule", "mesh.yml", "ici_fsdp_parallelism=2",
                             "ici_tensor_parallelism=2", "--golden-dir", "out"], cwd=tmp_path, capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert next((tmp_path / "out").rglob("named_shardings.json")).is_file()


# A program whose mesh spans every device of its process, as Kauldron's DEVICES_MESH does.
ALL_DEVICES = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import sharding_dump as sd


def program():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("fsdp",))
    make = lambda key: {"params": {"w": jnp.zeros((16, 4))}}
    init = lambda key: jax.jit(make, out_shardings={"params": {"w": NamedSharding(mesh, P("fsdp"))}})(key)
    return sd.TrainProgram(init, lambda state, batch: (state, {}))
"""


def test_all_gives_each_program_case_its_own_device_count(tmp_path):
    """`--all` over program cases of two device counts: each is dumped in a process of its own case's
    count, so a program whose mesh spans jax.devices() is on its case's mesh in both (mutation: every
    case in one process, as before, and the cpu-4 case is refused: `its own mesh fsdp=2 ..., not on the
    case's mesh fsdp=4`). Cases of several counts take a pool of one worker per count whatever -j (one
    case a count here), so -j 1 and -j 2 run alike: the second run takes the default."""
    (tmp_path / "all_devices.py").write_text(ALL_DEVICES)
    (tmp_path / "mesh.yml").write_text("mesh_axes: [fsdp]\n")
    (tmp_path / "cases.yml").write_text("cases:\n" + "".join(
        f"  - {{model: prog, topology: cpu-{n}, rule: mesh, overrides: {{ici_fsdp_parallelism: {n}}}}}\n"
        for n in (2, 4)))
    (tmp_path / "pyproject.toml").write_text('[tool.sharding-dump]\ngolden-dir = "out"\ncases = ["cases.yml"]\n'
                                             'rule-dirs = ["."]\nmodels = {prog = "all_devices:program"}\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    result = subprocess.run([sys.executable, "-m", "sharding_dump.commands.cli", "--all", "-j", "1"], cwd=tmp_path,
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    sizes = sorted(json.loads(path.read_text())["mesh"]["axis_sizes"]
                   for path in (tmp_path / "out").rglob("named_shardings.json"))
    assert sizes == [[2], [4]]
    # a failing case among the worker pools is its one line, no worker's traceback
    (tmp_path / "all_devices.py").write_text(ALL_DEVICES.replace("(16, 4)", "(15, 4)"))
    result = subprocess.run([sys.executable, "-m", "sharding_dump.commands.cli", "--all"], cwd=tmp_path,
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]


def all_devices_project(path, count: int, source: str = ALL_DEVICES) -> None:
    """A project of one case: ALL_DEVICES on cpu-`count`, its mesh the program's own over jax.devices()."""
    (path / "all_devices.py").write_text(source)
    (path / "mesh.yml").write_text("mesh_axes: [fsdp]\n")
    (path / "cases.yml").write_text(f"cases:\n  - {{model: prog, topology: cpu-{count}, rule: mesh, "
                                    f"overrides: {{ici_fsdp_parallelism: {count}}}}}\n")
    (path / "pyproject.toml").write_text('[tool.sharding-dump]\ngolden-dir = "out"\ncases = ["cases.yml"]\n'
                                         'rule-dirs = ["."]\nmodels = {prog = "all_devices:program"}\n')


def test_a_program_case_the_process_cannot_give_its_count_is_dumped_in_a_worker(tmp_path, monkeypatch):
    """The command called from Python code in a process whose jax backend runs already, with fewer
    devices than the case: the case is dumped in a worker process started with the case's count, so a
    program whose mesh spans jax.devices() is on the case's mesh (mutation: dump.dumped_in_order asks
    no options.serves, and the case is refused: `its own mesh fsdp=1 ..., not on the case's mesh fsdp=2`)."""
    import jax

    count = 2 * jax.device_count()  # the backend runs: this process cannot give the case its count
    all_devices_project(tmp_path, count)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["--all"]) == 0
    (path,) = (tmp_path / "out").rglob("named_shardings.json")
    assert json.loads(path.read_text())["mesh"]["axis_sizes"] == [count]
    assert jax.device_count() == count // 2


USER_PROCESS = """
import json, os


def pytest_sessionfinish(session):
    import jax
    with open("process.json", "w") as out:
        json.dump({"XLA_FLAGS": os.environ.get("XLA_FLAGS"), "devices": jax.device_count()}, out)
"""


# As Levanter's trainer fails building its mesh over too few devices, before anything is traced.
TOO_FEW = ALL_DEVICES.replace("def program():\n", "def too_few():\n    if len(jax.devices()) % 4:\n        raise "
                              "ValueError(f'ICI product 4 does not divide devices_per_slice {len(jax.devices())}')\n"
                              "    return program()\n\n\ndef program():\n")


def test_the_plugin_gives_program_cases_their_count_in_a_worker_in_any_order(tmp_path):
    """Plain pytest, no XLA_FLAGS: the plugin checks two program cases of 4 devices in a worker process
    started with 4 CPU devices when they fail here for want of them: the first's mesh spans this
    process's one device, and the second fails after asking for the devices, which the first had
    started. The user's process keeps its environment and its one device (mutations: options.where_served
    always answers here, and the update fails: `this process has 1 device and the program's mesh spans
    all of them`; it asks the worker on a DeviceCountError only, or only when the failing case started
    the backend itself, and the second fails: `ICI product 4 does not divide devices_per_slice 1`)."""
    all_devices_project(tmp_path, 4, TOO_FEW)
    (tmp_path / "cases.yml").write_text("cases:\n" + "".join(
        f"  - {{model: {name}, topology: cpu-4, rule: mesh, overrides: {{ici_fsdp_parallelism: 4}}}}\n"
        for name in ("prog", "few")))
    (tmp_path / "pyproject.toml").write_text('[tool.sharding-dump]\ngolden-dir = "out"\ncases = ["cases.yml"]\n'
                                             'rule-dirs = ["."]\nmodels = {prog = "all_devices:program", '
                                             'few = "all_devices:too_few"}\n')
    (tmp_path / "conftest.py").write_text(USER_PROCESS)
    env = {name: value for name, value in os.environ.items() if name not in ("XLA_FLAGS", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]), JAX_PLATFORMS="cpu")
    for args in (["--sharding-update"], []):
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                 *args], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        assert json.loads((tmp_path / "process.json").read_text()) == {"XLA_FLAGS": None, "devices": 1}
    sizes = [json.loads(path.read_text())["mesh"]["axis_sizes"]
             for path in (tmp_path / "out").rglob("named_shardings.json")]
    assert sizes == [[4], [4]]


@pytest.mark.parametrize("stdout,buffered", [("/dev/full", True), ("/dev/full", False), ("closed", True)],
                         ids=["full-at-the-last-flush", "full-at-a-write", "closed"])
def test_standard_output_that_cannot_be_written_is_one_line(stdout, buffered):
    """A full device (met at the final flush of buffered output, or at a write when PYTHONUNBUFFERED is
    set) or a closed descriptor as standard output: one line on stderr, exit 2. The child lists the
    settings: a command that imports no jax, a few KiB of text."""
    target = subprocess.DEVNULL if stdout == "closed" else open(stdout, "w")  # noqa: SIM115
    command = [sys.executable, "-c", "import os, sys\nfrom sharding_dump.commands import cli\n"
               + ("os.close(1)\nsys.stdout = None\n" if stdout == "closed" else "")
               + "sys.exit(cli.main(['list', 'settings']))"]
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    result = subprocess.run(command, stdout=target, stderr=subprocess.PIPE, text=True, timeout=300,
                            env={**env, "PYTHONPATH": str(REPO), **({} if buffered else {"PYTHONUNBUFFERED": "1"})})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("sharding-dump: error: standard output: "), result.stderr
