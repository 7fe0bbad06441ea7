"""Studies: what a researcher runs over models and saved layers (evaluation, the frontier, probing,
steering, inspection, attribution, SPD runs), one shape for all of them.

A study is a package ``mxd_lens/studies/NAME/``:

- ``__init__.py``: its options, one dataclass whose fields are the verb's options (docstrings as help).
  Nothing heavy is imported there, so ``mxd-lens NAME --help`` stays fast.
- ``run.py``: ``run(model, options, out) -> StudyResult``. Library modules keep the primitives
  (``evaluate``, ``steer``, ``top_activations``, ``attribute``, ...); ``run`` orchestrates them and returns
  what to write; :mod:`mxd_lens.studies.report` writes it (atomically) and prints it.

One line in :data:`STUDIES` makes it the verb ``mxd-lens NAME``. A third-party study registers itself
with :func:`register_study` (in a module given to ``mxd-lens --import MODULE``), or an installed package
declares it under the entry-point group ``mxd_lens.studies`` (``name = "pkg.module:STUDY"``, a
:class:`Study`). ``docs/studies.md`` has a worked example.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any

PLUGIN_GROUP = "mxd_lens.studies"


@dataclass(frozen=True)
class Study:
    """A registered study: the verb ``mxd-lens NAME``."""

    name: str
    """the verb"""
    summary: str
    """one line for ``mxd-lens --help``"""
    options: str
    """``"module:Class"``: the options dataclass (its docstring is the verb's description)"""
    run: str
    """``"module:function"``: ``run(model, options, out) -> StudyResult``"""
    model: str | None = "mxd_lens.studies.common:host_model"
    """``"module:function"``: ``(where, options) -> model`` picks the host model from ``--model`` (and, for
    some studies, the layers' training record); None: the study needs no host model (it gets None)"""
    folder: str | None = None
    """the folder under ``--out`` it writes into (default: its name; "": ``--out`` itself)"""
    where: str = "mxd_lens.studies.common:Where"
    """``"module:Class"``: the options every such verb shares (model, output folder, threads); a class
    without ``out`` means the study writes nothing of its own (eval records into the layers)"""
    check: str | None = None
    """``"module:function"``: ``check(options)``, run by the verb before the host model is loaded, so
    options that cannot work are refused (a ValueError) before any heavy work; None: no check"""

    def options_class(self) -> type:
        return resolve(self.options)

    def where_class(self) -> type:
        return resolve(self.where)

    def out_folder(self, out: str | None) -> Any:
        from pathlib import Path

        if out is None:
            return None
        sub = self.name if self.folder is None else self.folder
        if sub and not _NAME.fullmatch(sub):  # never outside --out (registration refuses such names)
            raise ValueError(f"study {self.name!r}: {sub!r} is not a plain folder name")
        return Path(out) / sub if sub else Path(out)


@dataclass
class StudyResult:
    """What a study returns and :func:`mxd_lens.studies.report.write_result` writes into its folder:
    ``NAME.csv`` (``table``), ``NAME.json`` (``record``), one CSV per extra table, one PNG per figure,
    one HTML file per page. Rows name architectures by their key (``mxd:gate=topk``); labels are applied
    when a table is rendered."""

    name: str
    """file stem of the main table and record"""
    table: Any = None
    """a pandas DataFrame, one row per measurement (or None)"""
    record: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable: the options, the command, provenance, and results that are not rows"""
    tables: dict[str, Any] = field(default_factory=dict)
    """other tables: file name (``summary.csv``) -> DataFrame (written with its index when it is named)"""
    figures: dict[str, Any] = field(default_factory=dict)
    """file name (``probing.png``) -> matplotlib Figure"""
    pages: dict[str, str] = field(default_factory=dict)
    """file name (``report.html``) -> HTML text"""
    columns: tuple[Any, ...] | None = None
    """how to print ``table``: :class:`mxd_lens.studies.report.Column` specs (None: print it as it is)"""
    text: str = ""
    """printed after the table: a summary, a verdict, a caveat"""
    value: Any = None
    """the study's own Python result, for callers that want more than the table (not written)"""


class StudyIncomplete(Exception):
    """A study measured something but could not finish (e.g. could not record it): ``result`` holds what
    it has; the verb prints it, then the error."""

    def __init__(self, message: str, result: StudyResult):
        super().__init__(message)
        self.result = result


# The built-in studies: one line each.
STUDIES: dict[str, Study] = {
    s.name: s
    for s in (
        Study("eval", "evaluate saved layers on held-out text and record the results in them",
              "mxd_lens.studies.eval:EvalOptions", "mxd_lens.studies.eval.run:run",
              where="mxd_lens.studies.common:ModelOnly"),
        Study("frontier", "train and evaluate every (block, K, seed, architecture) of a grid; tables and plots",
              "mxd_lens.studies.frontier:FrontierOptions", "mxd_lens.studies.frontier.run:run", folder=""),
        Study("frontier-report", "summary and plots of a frontier study from its OUT/frontier.json",
              "mxd_lens.studies.frontier:ReportOptions", "mxd_lens.studies.frontier.run:report", model=None,
              folder="", where="mxd_lens.studies.common:Output"),
        Study("demo", "the main job: MxD vs TopK transcoder on the default model and text, end to end",
              "mxd_lens.studies.demo:DemoOptions", "mxd_lens.studies.demo.run:run", folder="",
              where="mxd_lens.studies.common:DemoWhere"),
        Study("probe", "sparse probing of saved layers", "mxd_lens.studies.probe:ProbeOptions",
              "mxd_lens.studies.probe.run:run", folder="probing", check="mxd_lens.studies.probe.run:check"),
        Study("probe-merge", "one probing report from several probing studies of the same suite",
              "mxd_lens.studies.probe:MergeOptions", "mxd_lens.studies.probe.run:merge", model=None, folder="", where="mxd_lens.studies.common:Output"),
        Study("steer", "steering with saved layers, scored offline", "mxd_lens.studies.steer:SteerOptions",
              "mxd_lens.studies.steer.run:run", folder="steering"),
        Study("inspect", "top-activating contexts of chosen features", "mxd_lens.studies.inspect:InspectOptions",
              "mxd_lens.studies.inspect.run:run"),
        Study("attribute", "attribute one prediction to the units of spliced layers; a report with its graph",
              "mxd_lens.studies.attribution:AttributeOptions", "mxd_lens.studies.attribution.run:attribute_one",
              folder="", check="mxd_lens.studies.attribution:check_attribute"),
        Study("attribution", "attribute logit differences through spliced layers over a set of prompts",
              "mxd_lens.studies.attribution:AttributionOptions", "mxd_lens.studies.attribution.run:run", folder=""),
        Study("replacement", "a layer at every block spliced at once: KL/ΔCE, the compounding curve, each block alone",
              "mxd_lens.studies.replacement:ReplacementOptions", "mxd_lens.studies.replacement.run:run"),
        Study("graphs", "attribution graphs through saved layers over prompts: scores, pruning, HTML, circuit-tracer files",
              "mxd_lens.studies.graphs:GraphsOptions", "mxd_lens.studies.graphs.run:run"),
        Study("spd-induction", "SPD of the toy induction model: train, time or report one variant",
              "mxd_lens.studies.spd_induction:SPDInductionOptions", "mxd_lens.studies.spd_induction.run:run",
              model=None, folder="", where="mxd_lens.studies.common:Output"),
        Study("spd-induction-model", "train the toy induction-head model that spd-induction decomposes",
              "mxd_lens.studies.spd_induction:InductionModelOptions", "mxd_lens.studies.spd_induction.run:train_model",
              model=None, folder="", where="mxd_lens.studies.common:Output"),
        Study("spd-ablation", "SPD of one weight of a real model, scored and ablated on labelled text",
              "mxd_lens.studies.spd_ablation:SPDAblationOptions", "mxd_lens.studies.spd_ablation.run:run",
              folder=""),
    )
}  # fmt: skip

_PLUGINS_LOADED = False


COMMANDS = frozenset({"check", "mix", "cache", "train", "publish", "export", "info"})
"""The verbs of ``mxd-lens`` that are not studies: no study may take their names."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # a verb, and the folder it writes under --out


def check_study(study: Study) -> None:
    """Refuse (ValueError) a study whose name is not a plain word usable as a verb and as a folder name
    (letters, digits, ``-``, ``_``; so ``../escape`` cannot write outside ``--out``), that takes the name
    of a built-in command, or whose ``folder`` is not such a word (or "")."""
    if not isinstance(study.name, str) or not _NAME.fullmatch(study.name):
        raise ValueError(
            f"study name {study.name!r}: give a word usable as a verb and a folder name (letters, digits, "
            "'-', '_'), e.g. 'my-study'"
        )
    if study.name in COMMANDS:
        raise ValueError(
            f"study name {study.name!r} is a built-in command of mxd-lens; register it under another"
        )
    if study.folder not in (None, "") and not (
        isinstance(study.folder, str) and _NAME.fullmatch(study.folder)
    ):
        raise ValueError(
            f"study {study.name!r}: folder {study.folder!r} must be a plain folder name (letters, digits, '-', "
            "'_'), or '' for --out itself"
        )


def register_study(study: Study, replace: bool = False) -> Study:
    """Make ``study`` the verb ``mxd-lens <study.name>``. A name already taken is refused unless
    ``replace``; so is one that is not a plain word (:func:`check_study`)."""
    if not isinstance(study, Study):
        raise TypeError(f"register_study takes a mxd_lens.studies.Study, not {type(study).__name__}")
    check_study(study)
    if study.name in STUDIES and not replace and STUDIES[study.name] != study:
        raise ValueError(
            f"a study named {study.name!r} is already registered; register_study(..., replace=True)"
        )
    STUDIES[study.name] = study
    return study


def load_plugins() -> list[str]:
    """Register the studies installed packages declare under the entry-point group ``mxd_lens.studies``
    (once per process; each entry point names a :class:`Study`). Returns the names loaded now. A plug-in
    that fails to load, is not a :class:`Study` or cannot be registered (a taken or bad name) is skipped
    with a :class:`mxd_lens.plugins.PluginWarning` naming it, so it breaks no other verb."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return []
    _PLUGINS_LOADED = True
    from mxd_lens.plugins import entry_point_objects, skip_plugin

    loaded = []
    for name, value, study in entry_point_objects(PLUGIN_GROUP):
        if not isinstance(study, Study):
            skip_plugin(
                PLUGIN_GROUP, name, value, f"it is a {type(study).__name__}, not a mxd_lens.studies.Study"
            )
            continue
        try:
            register_study(study)
        except ValueError as err:
            skip_plugin(PLUGIN_GROUP, name, value, str(err))
            continue
        loaded.append(study.name)
    return loaded


def get_study(name: str) -> Study:
    """The registered study called ``name`` (installed plug-ins included)."""
    if name not in STUDIES:
        load_plugins()
    if name not in STUDIES:
        raise KeyError(f"no study named {name!r}; registered: {sorted(STUDIES)}")
    return STUDIES[name]


def resolve(reference: str) -> Any:
    """The object ``"package.module:attribute"`` names."""
    module, _, attribute = reference.partition(":")
    if not attribute:
        raise ValueError(f"{reference!r}: write 'package.module:attribute'")
    return getattr(importlib.import_module(module), attribute)


def run_study(name: str, model: Any, options: Any, out: Any = None, write: bool = True) -> StudyResult:
    """Run the registered study ``name`` from Python as its verb would (without loading a model:
    give it), write its result under ``out`` (when given and ``write``) and return it."""
    from pathlib import Path

    study = get_study(name)
    out = None if out is None else Path(out)
    result = resolve(study.run)(model, options, out)
    if write and out is not None:
        from mxd_lens.studies.report import write_result

        write_result(result, out)
    return result
