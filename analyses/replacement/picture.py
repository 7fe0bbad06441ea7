"""A picture of one attribution graph's page, as a reader sees it in a browser, with its most influential unit
hovered (its top-activating contexts in the side panel):
    .venv/bin/python analyses/replacement/picture.py PAGE [--top N] [--out PNG]
e.g. results/replacement/mxd/graphs/graph-03.html --top 40 --out docs/results/replacement/mxd/graph-03.png.
--top N draws the N most influential feature and error nodes of the kept graph (with every token and logit,
and the kept edges among them) and says so in the page's title line; a pruned graph of 30 blocks keeps
thousands of nodes, more than a picture can show. Needs Playwright (the dev extras) and a Chromium
(`apt-get install chromium`; MXD_LENS_BROWSER names another executable).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import tempfile
from pathlib import Path


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description="a picture of a graph page")
    parser.add_argument("page", type=Path)
    parser.add_argument(
        "--top", type=int, default=None, help="draw only the N most influential feature/error nodes"
    )
    parser.add_argument("--out", type=Path, default=None, help="the PNG (default: beside the page)")
    args = parser.parse_args()
    page_path = args.page.resolve()
    text = page_path.read_text()
    marker = '<script type="application/json" id="data">'
    head, rest = text.split(marker)
    payload, tail = rest.split("</script>", 1)
    data = json.loads(payload)
    if args.top is not None:
        inner = [n for n in data["nodes"] if n["kind"] in ("feature", "error")]
        # cumulative influence: small for the most influential nodes
        chosen = {n["index"] for n in sorted(inner, key=lambda n: n["influence"])[: args.top]}
        chosen |= {n["index"] for n in data["nodes"] if n["kind"] in ("token", "logit")}
        kept_nodes, kept_edges = (
            data.get("nodes_kept", len(inner)),
            data.get("edges_kept", len(data["edges"])),
        )
        data["nodes"] = [n for n in data["nodes"] if n["index"] in chosen]
        data["edges"] = [e for e in data["edges"] if e[0] in chosen and e[1] in chosen]
        note = (f"drawn: the {args.top} most influential of the {kept_nodes:,} feature and error nodes kept, and the "
                f"{len(data['edges']):,} edges among them drawn (of {kept_edges:,} kept)")  # fmt: skip
        head = head.replace('<p class="meta">', f'<p class="meta">{html.escape(note)}<br>', 1)
        text = head + marker + json.dumps(data).replace("</", "<\\/") + "</script>" + tail
    features = [n for n in data["nodes"] if n["kind"] == "feature"]
    if not features:
        raise SystemExit(f"{page_path}: no feature node kept")
    top = min(features, key=lambda n: n["influence"])  # the earliest in the cumulative influence
    browser_path = next(
        (shutil.which(n) for n in (os.environ.get("MXD_LENS_BROWSER"), "chromium", "chromium-browser") if n and shutil.which(n)),
        None,
    )  # fmt: skip
    if browser_path is None:
        raise SystemExit("no Chromium: apt-get install chromium (or set MXD_LENS_BROWSER)")
    out = (args.out or page_path.with_suffix(".png")).resolve()
    drawn = Path(tempfile.mkdtemp()) / page_path.name
    drawn.write_text(text)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1600, "height": 1200})
        tab.goto(drawn.as_uri())
        tab.locator(f'circle[data-node="{top["index"]}"]').hover()
        tab.screenshot(path=str(out), full_page=True)
        browser.close()
    print(f"wrote {out} (hovered: {top['label']})")


if __name__ == "__main__":
    main()
