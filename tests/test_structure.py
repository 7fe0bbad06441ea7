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


# -- `train` in the studies' shape (issue 45) --------------------------------------------------------
def _function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _called_names(node: ast.AST) -> set[str]:
    return {
        n.func.id if isinstance(n.func, ast.Name) else n.func.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))
    }


def test_the_train_verb_hands_one_run_config_to_one_function():
    """`mxd-lens train` parses one nested TrainRun and calls training.train with it: the CLI holds no
    stream/cache/model agreement and builds no learner itself."""
    import dataclasses

    from mxd_lens.config import LearnersConfig, StreamConfig, TrainConfig, TrainRun

    verb = _function(ROOT / "cli.py", "_train")
    called = _called_names(verb)
    assert "train" in called
    assert not called & {"load_host", "CachedActivations", "ModelActivations", "LearnerSpec", "Trainer",
                         "model_identity", "default_width_multiplier"}, called  # fmt: skip
    types = {f.name: getattr(f.type, "__name__", f.type) for f in dataclasses.fields(TrainRun)}
    assert {types["stream"], types["train"], types["learners"]} == {
        "StreamConfig",
        "TrainConfig",
        "LearnersConfig",
    }
    assert StreamConfig and TrainConfig and LearnersConfig


def test_the_cache_model_agreement_lives_next_to_the_cache():
    """One function decides whether a cache, a model and a stream agree for a run: activations.open_stream
    (the CLI and the trainer only call it)."""
    assert {"model_identity", "is_named", "CachedActivations"} <= _called_names(
        _function(ROOT / "activations.py", "open_stream")
    )
    for path in (ROOT / "cli.py", ROOT / "training.py"):
        assert "model_identity" not in path.read_text(), path


def test_the_frontier_nests_the_training_recipe_instead_of_copying_it():
    import dataclasses

    from mxd_lens.config import TrainConfig
    from mxd_lens.studies.frontier import FrontierConfig

    own = {f.name for f in dataclasses.fields(FrontierConfig)}
    assert "train" in own
    assert not own & ({f.name for f in dataclasses.fields(TrainConfig)} - {"train"}), own & {
        f.name for f in dataclasses.fields(TrainConfig)
    }


def test_the_trainer_asks_one_object_about_its_checkpoints():
    """The identity and resume state are one object (TrainerState), not eight methods of the Trainer."""
    from mxd_lens.loop import ResumeState
    from mxd_lens.training import Trainer, TrainerState

    asked = {name for name in vars(ResumeState) if not name.startswith("_")}
    assert len(asked) == 7
    assert not asked & set(vars(Trainer)), asked & set(vars(Trainer))
    assert asked <= set(vars(TrainerState))


def test_one_name_per_module():
    """No module of the core and of layers/ shares another's name (there were two `activations`)."""
    paths = [*ROOT.glob("*.py"), *(ROOT / "layers").glob("*.py")]
    names = [p.stem for p in paths if p.stem != "__init__"]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_train_is_a_straight_pipeline_over_one_learner_builder():
    """`training.train` opens the stream, asks layers/learners.py for the specs and runs Trainer(...).fit();
    the Trainer takes its token budget from TrainConfig.budget and its layers from learners.build_learners
    (issue 45 part 2), so neither the budget nor the admission of learners is interleaved in training.py."""
    train = _called_names(_function(ROOT / "training.py", "train"))
    assert {"check_archs", "open_stream", "learner_specs", "Trainer", "fit"} <= train, train
    trainer = next(
        n
        for n in ast.parse((ROOT / "training.py").read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "Trainer"
    )
    init = _called_names(
        next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    )
    assert {"budget", "build_learners"} <= init, init
    assert not init & {
        "tokens_for",
        "dead_window_for",
        "default_width_multiplier",
        "_admit",
        "build_layer",
        "size_for",
    }, init
    defined = {n.name for n in ast.parse((ROOT / "training.py").read_text()).body if hasattr(n, "name")}
    assert not defined & {"LearnerSpec", "build_layer", "_admit", "_check_given", "check_archs",
                          "learner_specs", "build_learners"}, defined  # fmt: skip
    learners = ast.parse((ROOT / "layers" / "learners.py").read_text())
    assert not {m for n in ast.walk(learners) for m in _imported(n)} & {"mxd_lens.training"}
    assert "training" not in import_graph().get("layers/", set())


def _spelled_hook_names(path: Path) -> list[str]:
    """Strings in ``path``'s code (docstrings left out) that are a whole TransformerLens hook name of a
    numbered block: ``"blocks.3.hook_mlp_out"``, or an f-string ``f"blocks.{L}.mlp.hook_post"``."""
    import re

    name = re.compile(r"blocks\.(\d+|\{\})\.[\w.]*hook_\w+")
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        else:
            continue
        if name.fullmatch(text):
            found.append(f"{path}:{node.lineno}: {text}")
    return found


def test_hook_names_are_spelled_in_one_module(tmp_path):
    """Every hook name of a block comes from mxd_lens/hook_names.py (issue 45: a name spelled by hand in
    a second module is the one that drifts when a family names its hooks differently)."""
    spelled = [hit for path in sorted(ROOT.rglob("*.py")) if path.name != "hook_names.py"
               for hit in _spelled_hook_names(path)]  # fmt: skip
    assert not spelled, "spell these through mxd_lens.hook_names:\n" + "\n".join(spelled)
    assert _spelled_hook_names(ROOT / "hook_names.py") == []  # it builds them with block_hook()
    probe = (
        tmp_path / "probe.py"
    )  # the check sees both forms it refuses, and passes a message and a docstring
    probe.write_text('"""blocks.3.hook_mlp_out"""\nA = "blocks.3.hook_mlp_out"\nB = f"blocks.{L}.mlp.hook_post"\n'
                     'C = f"reads blocks.{L}.mlp.hook_in"\n')  # fmt: skip
    assert [hit.split(": ")[1] for hit in _spelled_hook_names(probe)] == [
        "blocks.3.hook_mlp_out",
        "blocks.{}.mlp.hook_post",
    ]


def test_the_host_is_loaded_once_and_the_stream_sizes_the_learners():
    """open_stream loads the host in one place, for a cache and a live stream alike (after the cache is
    opened, before the live stream is built on it); the default width multiplier is the stream's
    (StreamInfo.default_width_multiplier), so layers/learners.py sizes a spec without asking matching."""
    stream = _function(ROOT / "activations.py", "open_stream")
    loads = [
        n for n in ast.walk(stream) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "load_host"
    ]
    assert len(loads) == 1, ast.unparse(stream)
    learners = ast.parse((ROOT / "layers" / "learners.py").read_text())
    assert "mxd_lens.matching" not in {m for n in ast.walk(learners) for m in _imported(n)}
    from mxd_lens.activations import StreamInfo

    assert isinstance(StreamInfo.default_width_multiplier, property)
