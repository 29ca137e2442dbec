"""The pictures: a tensor's split over the mesh (`show --tensor`) and the memory chart of `diff`."""

import json

from helpers import REPO
from sharding_dump.commands.cli import main
from sharding_dump.commands.pictures import memory_chart, memory_svg, split_grid

CASE = ["--model", "llama2-7b", "--topology", "tpu7x-2048", "--rule", "default", "ici_fsdp_parallelism=-1",
        "ici_tensor_parallelism=8"]
FOLDER = REPO / "golden/llama2-7b/tpu7x-2048/slice_1/rule_default_ici_fsdp_parallelism=-1_ici_tensor_parallelism=8"
WI_0 = "model/decoder/layers/mlp/wi_0/kernel"


def test_show_tensor_draws_the_golden_layout(capsys):
    """`show --tensor` draws, from the case's abstract layout, what the committed golden records: the
    same grid as one drawn from the golden's own spec and mesh."""
    assert main(["show", *CASE, "--tensor", WI_0]) == 0
    out = capsys.readouterr().out
    golden = json.loads((FOLDER / "named_shardings.json").read_text())
    entry = golden["tensors"][WI_0]
    sizes = dict(zip(golden["mesh"]["axis_names"], golden["mesh"]["axis_sizes"]))
    logical = json.loads((FOLDER / "logical_shardings.json").read_text())["tensors"][WI_0]["logical_axes"]
    assert out == split_grid(WI_0, entry["shape"], entry["dtype"], logical, entry["partition_spec"], sizes) + "\n"
    assert "  dim 0 (embed): 4096 split 256 ways over fsdp, 16 per device" in out
    assert "| 4080:4096       | fsdp 255 | fsdp 255    |" in out and "| dim 0 \\ dim 2   | 0:1376   | 1376:2752   |" in out


def test_show_tensor_unknown_path_is_one_line(capsys):
    assert main(["show", *CASE, "--tensor", "params/nope"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "--tensor 'params/nope': no such leaf in llama2-7b/tpu7x-2048/slice_1/" in captured.err
    assert "(leaves like model/decoder/" in captured.err  # the parameters first


def test_replicated_tensor_has_no_grid():
    out = split_grid("s", [4096], "float32", ["embed"], [None], {"fsdp": 8, "tensor": 1})
    assert out.splitlines()[-1] == "each device holds float32[4096] (16.0 KiB); each block is on 8 devices (replicated over fsdp=8)"


def test_long_splits_are_elided_and_extra_split_dimensions_named():
    sizes = {"data": 2, "expert": 16, "fsdp": 4, "tensor": 2}
    out = split_grid("w", [128, 64, 30], "bfloat16", ["exp", None, "mlp"], [["data", "expert"], "fsdp", "tensor"], sizes)
    lines = out.splitlines()
    assert "  dim 0 (exp): 128 split 32 ways over data, expert, 4 per device" in lines
    assert "  dim 2 (mlp): 30 split 2 ways over tensor, 15 per device" in lines
    assert "each cell is further split over dim 2 (2 ways over tensor)" in lines
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| dim")]
    labels = [r.split("|")[1].strip() for r in rows if r.split("|")[1].strip()]
    assert labels == ["0:4", "4:8", "8:12", "12:16", "16:20", "20:24", "...", "124:128"]
    second = out.split("| 4:8 ")[1].split("+")[0]  # block 1: the first axis of the entry is the major one
    assert "data 0" in second and "expert 1 " in second and "data 1" not in second
    assert "| 124:128" in out and "data 1" in out.split("| 124:128")[1] and "expert 15" in out.split("| 124:128")[1]


def test_single_split_dimension_and_ragged_blocks():
    out = split_grid("b", [10], "int32", ["vocab"], ["tensor"], {"tensor": 4})
    assert "  dim 0 (vocab): 10 split 4 ways over tensor, 3 per device" in out
    assert [r.split("|")[1].strip() for r in out.splitlines() if r.startswith("| ")][1:] == ["0:3", "3:6", "6:9", "9:10"]


def test_memory_chart_only_when_memory_moved():
    assert memory_chart({"params": (10, 10), "total": (10, 10)}) is None
    assert memory_chart({"params": (None, 10)}) is None
    chart = memory_chart({"params": (3 * 2**20, 2**20), "step": (4, 4), "total": (3 * 2**20 + 4, 2**20 + 4)})
    assert '    y-axis "MiB per device, from 0" 0 --> 3.00' in chart and "step" not in chart  # 4 bytes: not drawn
    assert "    bar [3.00, 0]\n    bar [0, 1.00]" in chart  # before grey, after blue
    assert '    x-axis ["params before 3.0 MiB", "params after 1.0 MiB"]' in chart


def test_show_tensor_draws_an_activation_as_its_golden_records_it(capsys):
    """An activation of the traced step (`forward/...`) is drawn from the case's trace as its committed
    golden records it."""
    act = "forward/decoder/layers/mlp/mlp_hidden"
    assert main(["show", *CASE, "--tensor", act]) == 0
    golden = json.loads((FOLDER / "activation_shardings.json").read_text())
    entry = golden["tensors"][act]
    sizes = dict(zip(golden["mesh"]["axis_names"], golden["mesh"]["axis_sizes"]))
    assert capsys.readouterr().out == split_grid(act, entry["shape"], entry["dtype"], entry["logical_axes"],
                                                 entry["partition_spec"], sizes) + "\n"


def test_part_names_of_any_text_stay_inside_the_chart_labels():
    """A part of the user's state named with a quote, a line break or markup ends no mermaid label and
    reaches the SVG as text."""
    memory = {'a"b\nc': (2**20, 2**21), "<script>x<": (2**20, 2**20)}
    chart = memory_chart(memory)
    assert "\"a'b c before 1.0 MiB\", \"a'b c after 2.0 MiB\"" in chart and chart.count("\n") == 8
    svg = memory_svg(memory)
    assert "<script>" not in svg and "&lt;script&gt;x&lt; before" in svg
