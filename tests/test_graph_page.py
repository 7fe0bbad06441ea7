"""A graph's HTML page in a real headless browser: it loads without console errors, draws every kept node
and edge, and shows a node's top-activating contexts when the node is hovered or clicked."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import D_VOCAB, make_model, randomise

from mxd_lens.graph import build_graph, prune
from mxd_lens.graph_files import edge_records, graph_html, node_records
from mxd_lens.layers import MxD


def _browser() -> str | None:
    for name in (os.environ.get("MXD_LENS_BROWSER"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def test_the_page_draws_the_graph_and_shows_a_nodes_contexts(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="no Playwright: pip install playwright")
    browser_path = _browser()
    if browser_path is None:
        pytest.skip("no headless browser: install Chromium (Debian: apt-get install chromium)")
    model = make_model("gated")
    layers = []
    for block in range(model.cfg.n_layers):
        layer = randomise(MxD.for_model(model, block, d_sae=24, k=4), block, scale=0.3)
        layer.cfg.metadata.seqpos_slice = [1, None]
        layers.append(layer)
    tokens = torch.randint(0, D_VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    graph = build_graph(model, layers, tokens)
    kept = prune(graph, 0.8, 0.98)
    nodes = node_records(graph, kept)
    feature = next(n for n in nodes if n["kind"] == "feature")
    contexts = {(feature["block"], feature["unit"]): [("the cat <sat", " on", " a mat")]}
    page = tmp_path / "graph.html"
    page.write_text(graph_html(graph, kept, contexts, title="a <test> graph"))

    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=browser_path,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],  # fmt: skip
        )
        try:
            tab = browser.new_page()
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(page.as_uri())
            assert tab.title() == "a <test> graph"
            assert tab.locator("circle.node").count() == len(nodes)
            drawn = {(s, t) for s, t, _ in edge_records(graph, kept)}
            assert tab.locator("line").count() == len(drawn)
            tab.locator(f'circle[data-node="{feature["index"]}"]').hover()
            assert tab.locator("#node-title").inner_text() == feature["label"]
            context = tab.locator(".ctx").first
            assert context.inner_text() == "the cat <sat on a mat"  # escaped as text, not markup
            assert context.locator("b").text_content() == " on"  # the activating token, marked
            token = next(n for n in nodes if n["kind"] == "token")
            tab.locator(f'circle[data-node="{token["index"]}"]').click()
            assert tab.locator("#node-title").inner_text() == token["label"]
        finally:
            browser.close()
    assert errors == []
