"""mkdocs hook (mkdocs.yml `hooks:`): the site draws its mermaid charts with a copy of mermaid served
from the site itself, so it renders offline. Material for MkDocs fetches mermaid from a CDN only when
no global `mermaid` is defined; `extra_javascript` loads the copy this hook puts into the built site.

The copy is mermaid's own bundle as npm installs it, the one tests/commands/test_rendered.py draws the
review charts with: `SHARDING_DUMP_MERMAID`, else `~/.cache/sharding-dump/mermaid/...` (where .ci/run
installs it: `npm install --prefix ~/.cache/sharding-dump/mermaid mermaid@11.17.2`). Without it the
build stops with one line saying so.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

MERMAID = Path(os.environ.get("SHARDING_DUMP_MERMAID") or
               Path.home() / ".cache/sharding-dump/mermaid/node_modules/mermaid/dist/mermaid.min.js")
SITE_PATH = "javascripts/mermaid.min.js"  # as mkdocs.yml's extra_javascript names it


def on_config(config: Any) -> Any:
    """Stops the build before it starts when there is no mermaid bundle to serve."""
    from mkdocs.exceptions import PluginError

    if SITE_PATH not in [str(script) for script in config["extra_javascript"]]:
        raise PluginError(f"mkdocs.yml: extra_javascript must list {SITE_PATH} (the mermaid this hook copies)")
    if not MERMAID.is_file():
        raise PluginError(f"no mermaid bundle at {MERMAID}: npm install --prefix ~/.cache/sharding-dump/mermaid "
                          f"mermaid@11.17.2, or set SHARDING_DUMP_MERMAID to a mermaid.min.js")
    return config


def on_post_build(config: Any) -> None:
    target = Path(config["site_dir"]) / SITE_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(MERMAID, target)
