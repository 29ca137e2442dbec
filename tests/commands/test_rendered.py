"""The review pictures as a browser draws them: the mermaid chart of `diff --format markdown`
rendered by mermaid itself, and the HTML report at 1400 pixels wide, in headless Chromium.

Skipped when no Chromium is on PATH, or (the chart) when mermaid's bundle is not found: set
SHARDING_DUMP_MERMAID to its `mermaid.min.js`, or install it where .ci/run does
(`npm install --prefix ~/.cache/sharding-dump/mermaid mermaid@11`). Nothing is fetched at run time.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import REPO
from sharding_dump.commands import diff, pictures
from sharding_dump.zoo.case import Case, golden_dir
from sharding_dump.zoo.goldens import check_or_update
from tools.mkdocs_mermaid import MERMAID  # the bundle the docs site serves

CASE = "llama2-7b/v5p-16/slice_1/rule_default"
BATCH_LINE = "  - [activation_batch, [data, fsdp, fsdp_transpose, expert]]\n"
WIDTH = 1400


def chromium() -> str:
    found = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if found is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium)")
    return found


def dump_dom(page: Path, tmp_path: Path, *flags: str) -> str:
    """The page's DOM once its scripts ran, as headless Chromium leaves it."""
    run = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                          f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000", *flags,
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The llama2-7b v5p-16 default case before and after a copy of default.yml with activation_batch
    `[]`: the committed golden, and the dump under the edited rule (which keeps the name default.yml,
    so the case folders pair)."""
    root = tmp_path_factory.mktemp("act")
    text = (REPO / "sharding_dump/rules/default.yml").read_text()
    assert BATCH_LINE in text
    rule = root / "default.yml"
    rule.write_text(text.replace(BATCH_LINE, "  - [activation_batch, []]\n")
                    .replace("  - [norm, [tensor]]\n", "  - [norm, fsdp]\n"))
    case = Case.make("llama2-7b", "v5p-16", str(rule))
    check_or_update(case, root / "golden", update=True)
    return diff.compare(REPO / "golden" / CASE, golden_dir(case, root / "golden"))


def test_mermaid_draws_every_bar_from_zero_in_two_colours(reports, tmp_path):
    if not MERMAID.is_file():
        pytest.skip(f"no mermaid bundle at {MERMAID} (set SHARDING_DUMP_MERMAID)")
    (report,) = reports
    chart = pictures.memory_chart(report.memory)
    body = chart.removeprefix("```mermaid\n").removesuffix("\n```")
    page = tmp_path / "chart.html"
    page.write_text(f'<!DOCTYPE html><html><head><meta charset="utf-8"><script src="{MERMAID.as_uri()}"></script>'
                    f'</head><body><pre class="mermaid">{body}</pre><script>mermaid.initialize({{startOnLoad: false}});'
                    'mermaid.run().then(() => document.body.dataset.done = "1", '
                    'e => document.body.dataset.error = String(e));</script></body></html>')
    dom = dump_dom(page, tmp_path)
    assert 'data-done="1"' in dom, dom[-2000:]
    svg = dom[dom.index("<svg"):dom.index("</svg>")]
    labels = re.findall(r'<g class="left-axis">.*?</g></g>', svg)[0]
    names = re.findall(r">([a-z_]+ (?:before|after) [0-9.]+ [A-Za-z]+)</text>", labels)
    assert names == [f"{part} {side} {size}" for part, pair in report.memory.items() if part != "step"
                     for side, size in zip(("before", "after"), (diff.sizes.format_bytes(v) for v in pair))]
    bars = {}
    for series, colour in ((0, pictures.BEFORE), (1, pictures.AFTER)):
        group = re.search(rf'<g class="bar-plot-{series}">(.*?)</g>', svg).group(1)
        rects = re.findall(r'<rect x="(-?[0-9.]+)" y="[0-9.]+" width="(-?[0-9.]+)" height="[0-9.]+" '
                           r'fill="([^"]+)"', group)
        assert {fill for _, _, fill in rects} == {colour}
        bars[series] = [(float(x), float(w)) for x, w, _ in rects]
    values = [v for pair in report.memory.values() for v in pair][:len(names)]
    drawn = [bars[i % 2][i][1] for i in range(len(names))]  # each bar from its own series
    hidden = [bars[1 - i % 2][i][1] for i in range(len(names))]  # the other series' 0 there
    assert len({x for series in bars.values() for x, _ in series}) == 1  # every bar starts at the axis
    assert hidden == [0.0] * len(names)
    # zero-based: every bar's length is its value times one scale (a cut axis would shift them all)
    scale = drawn[values.index(max(values))] / max(values)
    assert all(abs(length - value * scale) < 0.5 for length, value in zip(drawn, values)), (drawn, values)
    activations = list(report.memory).index("activations") * 2
    assert drawn[activations + 1] > 3 * drawn[activations]  # the blow-up is there to see


def test_html_report_fits_1400_pixels_and_colours_the_changes(reports, tmp_path):
    page = diff.render_html(reports)
    probe = ("<script>addEventListener('load', () => { const cells = [...document.querySelectorAll('td.up, td.chg')];"
             "document.body.dataset.probe = JSON.stringify({scroll: document.documentElement.scrollWidth, "
             "inner: innerWidth, cells: cells.map(c => [c.getBoundingClientRect().top, c.getBoundingClientRect().right,"
             " getComputedStyle(c).backgroundColor])}); });</script>")
    (tmp_path / "report.html").write_text(page)
    (tmp_path / "probe.html").write_text(page.replace("</body>", probe + "</body>"))  # the report has no script
    dom = dump_dom(tmp_path / "probe.html", tmp_path, f"--window-size={WIDTH},1000")
    probe = json.loads(re.search(r'data-probe="([^"]+)"', dom).group(1).replace("&quot;", '"'))
    assert probe["inner"] == WIDTH and probe["scroll"] <= WIDTH  # no horizontal overflow
    cells = probe["cells"]
    assert cells and all(right <= WIDTH for _, right, _ in cells)
    assert {"rgb(253, 226, 225)", "rgb(255, 243, 196)"} <= {colour for _, _, colour in cells}  # memory up, new spec
    assert min(top for top, _, _ in cells) < 1000  # on the first screen
    shot = tmp_path / "report.png"
    profile = f"--user-data-dir={tmp_path / 'profile'}"
    subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", profile,
                    f"--window-size={WIDTH},1000", f"--screenshot={shot}", (tmp_path / "report.html").as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000  # the picture a reviewer looks at, kept in the test's folder
