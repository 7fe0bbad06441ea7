"""Check graph files (``SLUG.json`` + ``graph-metadata.json``) against circuit-tracer's own code: its pydantic
``Model``, its ``Node`` factories (the ids its ``create_graph_files`` writes), and its viewer's local server.

Run with a python that has circuit-tracer installed (not this project's venv: it pins other transformers):
    python3 -m venv /tmp/ctenv && /tmp/ctenv/bin/pip install torch==2.13.0
    /tmp/ctenv/bin/pip install --no-deps circuit-tracer==0.5.0 && /tmp/ctenv/bin/pip install pydantic
    /tmp/ctenv/bin/python analyses/replacement/check_circuit_tracer.py FOLDER [PORT]
Exits 1 on a validation error, a duplicate node_id, a link to no node, or a file the server does not return as
written; where a node differs from what circuit-tracer's ``Node`` factories make, it says so (0.5.0's error-node
``node_id``, ``0_{layer}_{pos}``, can equal a feature's; ours is ``{layer}_-1_{pos}``, as circuit-tracer's PR #102).
"""

import json
import sys
import urllib.request
from pathlib import Path

import circuit_tracer
from circuit_tracer.frontend.graph_models import Metadata, Model, Node
from circuit_tracer.frontend.local_server import serve


def expected(node: Node, n_layers: int) -> Node:
    """The node circuit-tracer's factory makes for this node's (kind, layer, unit, position); its logit nodes
    carry no influence (``logit_node`` takes none), so ours having one is reported, not counted."""
    layer, unit, pos = node.node_id.split("_")[0], int(node.node_id.split("_")[1]), node.ctx_idx
    if node.feature_type == "cross layer transcoder":
        return Node.feature_node(int(layer), pos, unit, node.influence, node.activation)
    if node.feature_type == "mlp reconstruction error":
        return Node.error_node(int(node.layer), pos, node.influence)
    if node.feature_type == "embedding":
        return Node.token_node(pos, unit, node.influence)
    token = node.clerp.split('"')[1] if '"' in node.clerp else ""
    return Node.logit_node(pos, unit, token, n_layers, node.is_target_logit, node.token_prob)


def main(folder: Path, port: int) -> int:
    bad = 0
    print("circuit-tracer", circuit_tracer.__version__)
    listed = json.loads((folder / "graph-metadata.json").read_text())["graphs"]
    for entry in listed:
        Metadata.model_validate(entry)
        text = (folder / f"{entry['slug']}.json").read_text()
        try:
            model = Model.model_validate_json(text)
        except Exception as error:  # pydantic.ValidationError: print it as is
            print(f"{entry['slug']}: INVALID\n{error}")
            bad += 1
            continue
        raw = json.loads(text)
        extra = {k for n in raw["nodes"] for k in n} - set(Node.model_fields)
        ids = [n.node_id for n in model.nodes]
        dangling = [lk for lk in model.links if lk["source"] not in ids or lk["target"] not in ids]
        n_layers = max(int(n.layer) for n in model.nodes if n.feature_type == "logit") - 1
        theirs = [expected(n, n_layers).node_id for n in model.nodes]
        hidden = [n.node_id for n in model.nodes if n.feature_type not in ("embedding", "logit")
                  and n.influence is not None and n.influence > (entry.get("node_threshold") or 1.0)]  # fmt: skip
        diffs = []
        for node in model.nodes:
            ref = expected(node, n_layers)
            for field in ("node_id", "jsNodeId", "feature", "layer", "ctx_idx", "clerp", "influence"):
                if getattr(node, field) != getattr(ref, field):
                    diffs.append((node.feature_type, field, getattr(node, field), getattr(ref, field)))
        print(f"{entry['slug']}: valid Model, {len(model.nodes)} nodes, {len(model.links)} links; extra node keys "
              f"{sorted(extra)}; duplicate node_id {len(ids) - len(set(ids))}; dangling links {len(dangling)}")  # fmt: skip
        print(f"  node_ids as circuit-tracer's factories make them collide: {len(theirs) - len(set(theirs))}; "
              f"nodes the viewer hides at its default pruning (influence > node_threshold): {hidden}")  # fmt: skip
        kinds = sorted({(t, f) for t, f, _, _ in diffs})
        for kind, field in kinds:
            ex = next(d for d in diffs if d[:2] == (kind, field))
            n = sum(d[:2] == (kind, field) for d in diffs)
            print(
                f"  differs from circuit-tracer's ({n} nodes): {kind}.{field}: ours {ex[2]!r}, its {ex[3]!r}"
            )
        bad += len(dangling) + len(ids) - len(set(ids))
    server = serve(data_dir=str(folder), port=port)
    try:
        urls = ["/", "/data/graph-metadata.json"] + [f"/graph_data/{g['slug']}.json" for g in listed]
        for url in urls:
            with urllib.request.urlopen(f"http://localhost:{port}{url}") as response:
                body = response.read()
            file = folder / ("graph-metadata.json" if "graph-metadata" in url else url.split("/")[-1])
            same = url == "/" or json.loads(body) == json.loads(file.read_text())
            print(
                f"GET {url}: {response.status}, {len(body)} bytes"
                + ("" if url == "/" else f", same as {file}: {same}")
            )
            bad += response.status != 200 or not same
    finally:
        server.stop()
    print("OK" if not bad else f"{bad} problems")
    return int(bool(bad))


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) > 2 else 8041))
