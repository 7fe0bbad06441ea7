"""A picture of one attribution graph's page, as a reader sees it in a browser, with its most influential unit
hovered (its top-activating contexts in the side panel):
    .venv/bin/python analyses/replacement/picture.py docs/results/replacement/mxd/graphs/graph-03.html
writes graph-03.png beside the page. Needs Playwright (the dev extras) and a Chromium (`apt-get install
chromium`; MXD_LENS_BROWSER names another executable).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def main() -> None:
    from playwright.sync_api import sync_playwright

    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    page_path = Path(sys.argv[1]).resolve()
    text = page_path.read_text()
    data = json.loads(text.split('<script type="application/json" id="data">')[1].split("</script>")[0])
    features = [n for n in data["nodes"] if n["kind"] == "feature"]
    if not features:
        raise SystemExit(f"{page_path}: no feature node kept")
    top = max(features, key=lambda n: n["influence"])
    browser_path = next(
        (shutil.which(n) for n in (os.environ.get("MXD_LENS_BROWSER"), "chromium", "chromium-browser") if n and shutil.which(n)),
        None,
    )  # fmt: skip
    if browser_path is None:
        raise SystemExit("no Chromium: apt-get install chromium (or set MXD_LENS_BROWSER)")
    out = page_path.with_suffix(".png")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1600, "height": 1200})
        tab.goto(page_path.as_uri())
        tab.locator(f'circle[data-node="{top["index"]}"]').hover()
        tab.screenshot(path=str(out), full_page=True)
        browser.close()
    print(f"wrote {out} (hovered: {top['label']})")


if __name__ == "__main__":
    main()
