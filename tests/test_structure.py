"""The package's import structure (issue 29): no cycles between its modules, and no chain of imports longer
than 6 modules, counting lazy imports (inside functions) but not TYPE_CHECKING ones, a sub-package
(layers/, spd/, analysis/, studies/) as one module, and leaving out the package's own __init__."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "mxd_lens"


def _node(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / parts[1]).is_dir():
        return parts[1] + "/"
    return parts[1] if len(parts) > 1 else "mxd_lens"


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("mxd_lens.")]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mxd_lens"):
        if node.module == "mxd_lens":  # from mxd_lens import hooks, layers, ...
            return [
                f"mxd_lens.{a.name}"
                for a in node.names
                if (ROOT / f"{a.name}.py").exists() or (ROOT / a.name).is_dir()
            ]
        return [node.module]
    return []


def import_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        source = _node(module)
        tree = ast.parse(path.read_text())
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            for target in map(_node, _imported(node)):
                if "mxd_lens" not in (source, target) and target != source:
                    edges.setdefault(source, set()).add(target)
    return edges


def test_no_import_cycles_and_no_chain_longer_than_six():
    edges = import_graph()
    assert {"studies/", "cli", "layers/", "training"} <= set(edges) | {t for ts in edges.values() for t in ts}
    cycles, longest = [], []

    def walk(path: list[str]) -> None:
        nonlocal longest
        if len(path) > len(longest):
            longest = list(path)
        for target in sorted(edges.get(path[-1], ())):
            if target in path:
                cycles.append(path[path.index(target) :] + [target])
            else:
                walk([*path, target])

    for start in sorted(edges):
        walk([start])
    assert not cycles, cycles[:3]
    assert len(longest) <= 6, " -> ".join(longest)
