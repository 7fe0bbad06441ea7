"""The ``mxd-lens`` command."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Literal

# Only light modules at import: `mxd-lens --help` must not wait for torch.
from mxd_lens.allocator import keep_freed_memory
from mxd_lens.config import (
    DEFAULT_MODEL,
    WIDTH_MULTIPLIER,
    ExportConfig,
    PublishConfig,
    StreamConfig,
    TrainRun,
)

CHECK_D_MODEL, CHECK_D_MLP = 64, 256  # the widths of `mxd-lens check`'s random models

# Each subcommand's options are the fields of a dataclass (docstrings as help, defaults stated once):
# `train` reads one nested run config (config.TrainRun); the other commands' own options are below.


@dataclass
class CheckCommand:
    """Options of `mxd-lens check`."""

    k: int = 8
    """active experts / latents per token"""
    m: int = WIDTH_MULTIPLIER
    """transcoder width multiplier; MxD is parameter-matched"""
    seed: int = 0
    """random seed"""

    def __post_init__(self) -> None:
        # refused here, before torch is imported, rather than by the first layer built from them
        from mxd_lens.matching import match_experts

        if self.m < 1:
            raise ValueError(f"--m {self.m}: the width multiplier must be at least 1")
        width = self.m * CHECK_D_MODEL
        try:
            smallest = min(
                match_experts(width, CHECK_D_MODEL, CHECK_D_MODEL, CHECK_D_MLP, glu=glu)
                for glu in (False, True)
            )
        except ValueError as err:
            raise ValueError(f"--m {self.m}: {err}") from None
        if not 0 < self.k <= min(width, smallest):
            raise ValueError(
                f"--k {self.k}: give 1 to {min(width, smallest)} (the fewest units of a layer checked: "
                f"{smallest} MxD experts at m = {self.m})"
            )


@dataclass
class MixCommand:
    """Options of `mxd-lens mix`."""

    sources: list[str] = field(metadata={"custom_args": {"nargs": "+"}, "positional": True})
    """files, folders or datasets, as iter_texts reads them"""
    out: str = "mixed.txt.xz"
    """the file to write, compressed as its name says: .txt.xz, .txt.gz or .txt (plain); not a source"""
    tokenizer: str | None = None
    """count volume in this tokenizer's tokens (a Hugging Face folder, or 'default' for the default model's)"""
    per_source: int | None = None
    """stop after this volume (characters, or tokens with --tokenizer) from each source"""


def _mix(args: argparse.Namespace) -> int:
    """Interleave the documents of several texts into one file (.txt.xz, .txt.gz or .txt by --out's name;
    --out may not be a source, and no source may be given twice): the next document always comes from the
    source that has given the least so far, so that any prefix holds about as much of each source, whatever
    the length of their documents (a Bible chapter against an Austen paragraph). By characters, or with
    --tokenizer by that tokenizer's tokens; --per-source N stops at N per source (equal shares, refused if a
    source holds less)."""
    from mxd_lens.data import mix_texts

    mix = args.mix
    measure = None
    if mix.tokenizer is not None:
        from transformers import AutoTokenizer

        from mxd_lens.models import hf_folder

        folder = hf_folder(DEFAULT_MODEL if mix.tokenizer == "default" else mix.tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)

        def measure(doc: str) -> int:
            return len(tokenizer(doc, add_special_tokens=False).input_ids)

    n, given = mix_texts(mix.sources, mix.out, measure=measure, per_source=mix.per_source)
    print(f"{mix.out}: {n:,} documents, {'tokens' if measure else 'characters'} per source {given}")
    return 0


@dataclass
class CacheCommand:
    """Options of `mxd-lens cache` (besides the stream's)."""

    out: str
    """cache folder"""
    blocks: list[int] | None = None
    """transformer blocks whose MLP to cache (required to write)"""
    shards: int | None = None
    """shards to write, each rows-per-shard rows (tokens = shards x rows-per-shard x context; required to write)"""
    verify: bool = False
    """check every shard of the cache at --out against its recorded checksum and write nothing (exit 1 if
    damaged; with --shards, also that it holds that many)"""
    cache_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """storage dtype (default: the model's --dtype, float32 unless given)"""


@dataclass
class LayersArgument:
    """The saved layers to read."""

    layers: list[str] = field(metadata={"custom_args": {"nargs": "+"}, "positional": True})
    """layer folders, or folders holding them (a trainer's final/, the frontier's runs/*/final)"""


@dataclass
class CpuOptions:
    """How much of the machine to use."""

    threads: int = 0
    """torch CPU threads (0: torch's default, every core); on a shared machine, fewer"""


def _info(args: argparse.Namespace) -> int:
    """What a saved layer is: architecture and sizes, the model and hooks, how it was trained (config,
    data and its digests, tokens, epochs, library version) and, once evaluated, its evaluation; a folder
    that would not load is flagged (exit 1). Read from the files (no torch) for mxd-lens's layers."""
    from mxd_lens.saved_layers import describe_layer, layer_folders

    try:
        folders = layer_folders(args.layers.layers)
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"mxd-lens info: {err}") from None
    damaged = 0
    for folder in folders:
        print(f"{folder}\n")
        problem = layer_folder_problem(folder)
        if problem is not None:
            damaged += 1
            print(f"PROBLEM: {problem}\n")
        try:
            print(describe_layer(folder).to_markdown(index=False))
        except ValueError:  # cfg.json unreadable: the problem above says so
            pass
        print()
    if damaged:
        print(f"{damaged} of {len(folders)} layer folder(s) cannot be loaded (PROBLEM above)")
    return 1 if damaged else 0


def layer_folder_problem(folder: Any) -> str | None:
    """What stops ``folder`` from loading (None: nothing), on one line: a built-in layer's from its files
    alone (no torch), any other by loading it."""
    from mxd_lens.saved_layers import NotBuiltIn, check_folder

    try:
        return check_folder(folder)
    except NotBuiltIn:
        from mxd_lens.layers.io import check_layer_folder

        return check_layer_folder(folder)


def _threads(n: int) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _publish(args: argparse.Namespace) -> int:
    """Upload saved layers to the Hugging Face hub in one commit: <sae_id>/cfg.json and
    sae_weights.safetensors per layer (sae_id = its folder's name) and a model card with each layer's
    training record and evaluation. After `import mxd_lens`, SAE.from_pretrained(REPO_ID, SAE_ID)
    loads them. --dry-run DIR writes the exact files and uploads nothing."""
    from mxd_lens.hub import publish

    config = args.publish
    try:
        where = publish(args.layers.layers, config.repo_id, dry_run=config.dry_run, private=config.private,
                        revision=config.revision)  # fmt: skip
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        raise SystemExit(f"mxd-lens publish: {err}") from None
    print(f"wrote {where}" if config.dry_run else f"uploaded: {where}")
    return 0


def _export(args: argparse.Namespace) -> int:
    """Write saved TopK transcoders / skip transcoders (one per block) as a circuit-tracer
    transcoder set: config.yaml and layer_{block}.safetensors (W_enc, W_dec, b_enc, b_dec, W_skip).
    circuit-tracer loads a local set by its ABSOLUTE path (load_transcoder_from_hub("/abs/dir"), then
    TopK set on each transcoder; see docs/layers.md). An MxD has no fixed decoder vectors, so it
    cannot be exported (use expert attribution)."""
    from mxd_lens.export import export_circuit_tracer

    try:
        out = export_circuit_tracer(args.layers.layers, args.export.out)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise SystemExit(f"mxd-lens export: {err}") from None
    print(f"wrote {out}/config.yaml and {', '.join(sorted(p.name for p in out.glob('layer_*.safetensors')))}")
    print(
        f"load it in circuit-tracer by this absolute path: load_transcoder_from_hub({str(out)!r}), then set "
        "each transcoder's activation_function to TopK(config['k']) (docs/layers.md)"
    )
    return 0


PART_ENDED = 3  # exit status of `train --max-minutes` when the part ended before the run did
_LINE: list[str] | None = None  # the command line main() was given (a script may call main itself)


def _command() -> str:
    import shlex

    return shlex.join(["mxd-lens", *(sys.argv[1:] if _LINE is None else _LINE)])


def _check(args: argparse.Namespace) -> int:
    """Build, splice, save and reload every layer type (MxD, TopK transcoder, skip transcoder, BatchTopK
    transcoder: every built-in architecture) on small random models; print a table."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="HookedTransformer is deprecated", category=DeprecationWarning)
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    import mxd_lens

    args = args.check
    built_in = [cls for cls in mxd_lens.ARCHITECTURES.values() if cls.__module__.startswith("mxd_lens.")]
    torch.manual_seed(args.seed)
    rows = []
    for kind, extra in (
        ("gpt2-like", dict(act_fn="gelu_new")),
        ("gated", dict(act_fn="silu", gated_mlp=True, normalization_type="RMS")),
    ):
        cfg = HookedTransformerConfig(
            n_layers=2,
            d_model=CHECK_D_MODEL,
            n_ctx=32,
            d_head=16,
            n_heads=4,
            d_mlp=CHECK_D_MLP,
            d_vocab=200,
            model_name=f"random-{kind}",
            **extra,
        )
        model = HookedTransformer(cfg)
        tokens = torch.randint(0, cfg.d_vocab, (4, 32))
        with torch.no_grad():
            clean = model(tokens, return_type="loss").item()
            width = args.m * cfg.d_model
            n = mxd_lens.match_experts(width, cfg.d_model, cfg.d_model, cfg.d_mlp, glu=cfg.gated_mlp)
            layers = {"MxD.from_mlp": mxd_lens.MxD.from_mlp(model, 1)}
            for layer_cls in built_in:  # every built-in architecture, untrained, at matched size
                d_sae, unit = (n, "N") if layer_cls is mxd_lens.MxD else (width, "H")
                layer = layer_cls.for_model(model, 1, d_sae=d_sae, k=args.k)
                layers[f"{layer_cls.label} ({unit}={d_sae}, untrained)"] = layer
            for name, layer in layers.items():
                with tempfile.TemporaryDirectory() as folder:
                    layer.save_model(folder)
                    loaded = mxd_lens.load_layer(folder)
                with mxd_lens.splice(model, loaded):
                    spliced = model(tokens, return_type="loss").item()
                params = sum(p.numel() for p in layer.parameters())
                rows.append((kind, name, params, clean, spliced - clean))
    print(f"{'model':<10} {'layer':<42} {'params':>9} {'clean CE':>9} {'ΔCE':>9}")
    for kind, name, params, clean, delta in rows:
        print(f"{kind:<10} {name:<42} {params:>9,} {clean:>9.4f} {delta:>+9.4f}")
    print("MxD.from_mlp must show ΔCE = 0: an MxD with one always-on expert is the MLP itself.")
    print(
        "The untrained layers' ΔCE is not a result: random layers on a random model scored on random tokens, "
        "so it can fall either side of 0 (a random model predicts random tokens no better than chance)."
    )
    return 0 if all(abs(delta) < 1e-4 for _, name, _, _, delta in rows if name == "MxD.from_mlp") else 1


def _cache(args: argparse.Namespace) -> int:
    """Write (or continue, or repair) the cache at --out; with --verify, only check it: every shard
    against its recorded size and checksum, printing what is wrong (exit 1) or that it is whole."""
    import warnings

    stream_config, args = args.stream, args.cache
    if not args.verify and (args.blocks is None or args.shards is None):  # before torch is imported
        raise SystemExit(
            "mxd-lens cache: --blocks (the transformer blocks to cache) and --shards (how many shards of "
            "--rows-per-shard rows to write) are required to write a cache"
        )
    from mxd_lens.activations import (
        REPAIR,
        CachedActivations,
        CacheLockedError,
        ModelActivations,
        write_cache,
    )

    if args.verify:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # shards without a checksum are reported below
                cache = CachedActivations(args.out)
        except (FileNotFoundError, ValueError) as err:  # not a cache, no shard yet, a shard missing
            print(f"mxd-lens cache --verify: {err}")
            return 1
        problems = cache.verify(progress=True)
        if args.shards is not None and cache.n_shards < args.shards:
            problems.append(f"{cache.path} holds {cache.n_shards} of the {args.shards} shards asked for")
        if problems:
            print(f"{cache.path} is damaged ({len(problems)} problem(s)):")
            for problem in problems:
                print(f"  {problem}")
            print(REPAIR)
            return 1
        print(f"{cache.path}: {cache.n_shards} shards, {cache.epoch_tokens:,} tokens, every shard intact")
        if cache.unrecorded:
            print(
                f"  {len(cache.unrecorded)} shard(s) have no recorded checksum, so only that they load was "
                f"checked; to record them, {REPAIR}"
            )
        return 0
    from mxd_lens.models import load_host

    stream = ModelActivations.from_config(load_host(stream_config), args.blocks, stream_config)
    dtype = args.cache_dtype or stream_config.dtype or "float32"
    try:
        path = write_cache(stream, args.out, n_shards=args.shards, dtype=dtype, text_info=stream.text_info)
    except CacheLockedError as err:
        raise SystemExit(f"mxd-lens cache: {err}") from None
    tokens = args.shards * stream.info.tokens_per_shard
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(
        f"activation cache at {path}: {args.shards} shards, {tokens:,} tokens x {len(stream.blocks)} block(s), "
        f"{size / 2**30:.2f} GiB on disk ({dtype})"
    )
    return 0


def _train(args: argparse.Namespace) -> int:
    from mxd_lens.loop import RunExists, RunPaused
    from mxd_lens.training import train

    try:
        metrics = train(args.run)
    except RunExists as err:
        raise SystemExit(f"mxd-lens train: {err}") from None
    except RunPaused as err:  # a part of a long run (--max-minutes): not an error, not finished either
        print(f"mxd-lens train: {err}")
        return PART_ENDED
    if metrics and len(metrics) > 4:  # many learners: per architecture, each learner's in the run's logs
        from mxd_lens.training import summary_by_arch

        print(f"{len(metrics)} layers trained; per architecture, FVU median/worst, L0 median, dead worst:")
        for line in summary_by_arch(metrics).split(" | "):
            print(f"  {line}")
        print(f"every layer's metrics: {args.run.out}/final/metrics.json; weights in {args.run.out}/final")
    elif metrics:  # rank 0 (the others return nothing)
        for name, values in metrics.items():
            print(name, " ".join(f"{key}={value:.4g}" for key, value in values.items()))
        print(f"weights in {args.run.out}/final")
    return 0


def _help_formatter() -> type:
    import re

    import simple_parsing
    from simple_parsing.help_formatter import TEMPORARY_TOKEN

    states_default = re.compile(r"\(default\b|\bdefault:|\bdefault\)")

    class HelpFormatter(simple_parsing.SimpleHelpFormatter):
        """simple_parsing's (every default shown, types as metavars), but a positional is named for what
        it holds (``LAYERS [LAYERS ...]``, not its type), and a help that states its own default
        (``(default: the suite's, 200)``) gets no second one (``(default: None)``)."""

        def _metavar_formatter(self, action: argparse.Action, default_metavar: str) -> Any:
            if action.option_strings or action.choices:
                return super()._metavar_formatter(action, default_metavar)
            name = action.dest.rpartition(".")[2].upper()  # simple_parsing's metavar is the type: 'list'
            return lambda size: (name,) * size

        def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
            if action.option_strings or action.choices:
                return super()._format_args(action, default_metavar)
            return argparse.HelpFormatter._format_args(self, action, default_metavar)

        def _get_help_string(self, action: argparse.Action) -> str | None:
            if action.help and states_default.search(action.help):
                return action.help.replace(TEMPORARY_TOKEN, "")
            return super()._get_help_string(action)

    return HelpFormatter


def _subparser_class() -> type:
    import simple_parsing

    class Subparser(simple_parsing.ArgumentParser):
        """A subcommand's parser: options from config dataclasses (``add_arguments``) as --dash-names,
        every default shown in the help, the verb's description once."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("add_option_string_dash_variants", simple_parsing.DashVariant.DASH)
            kwargs.setdefault("add_config_path_arg", False)
            kwargs.setdefault("formatter_class", _help_formatter())
            super().__init__(*args, **kwargs)

        def add_argument_group(self, title: Any = None, description: Any = None, **kwargs: Any) -> Any:
            # a study's options class gives both the verb's description and its group's: show it once
            if (
                description
                and self.description
                and inspect.cleandoc(description) == inspect.cleandoc(self.description)
            ):
                title, description = f"options of {self.prog}", None
            return super().add_argument_group(title=title, description=description, **kwargs)

    return Subparser


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``mxd-lens`` parser. With ``only`` (a subcommand's name) the other subcommands get no
    options, so ``mxd-lens SUB --help`` builds just what it shows."""
    parser = argparse.ArgumentParser(
        prog="mxd-lens", description="Sparse MLP replacements for TransformerLens models."
    )
    parser.add_argument(
        "--import",
        metavar="MODULE",
        action="append",
        help="import MODULE first (repeatable), e.g. one that registers an architecture for --arch; "
        "installed plug-ins declare an 'mxd_lens.architectures' entry point instead",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error (also: MXD_LENS_DEBUG=1); without it, one line",
    )
    # Subcommands are simple_parsing parsers, so a config dataclass becomes options (field docstrings as help).
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_subparser_class())
    commands = {  # name: (help, description, {dest: options dataclass}, function)
        "check": (
            "run every layer type end to end (build, save, load, splice) on small random models",
            _check.__doc__,
            {"check": CheckCommand},
            _check,
        ),
        "mix": (
            "interleave the documents of several texts into one, in equal shares",
            _mix.__doc__,
            {"mix": MixCommand},
            _mix,
        ),
        "cache": (
            "write an activation cache (MLP input/output pairs) for later training runs",
            "Run the model over the training split of --text and store (MLP input, MLP output) for --blocks, "
            "in --shards safetensors shards, with each shard's size and checksum. Re-running with the same "
            "arguments continues an interrupted cache and recomputes shards that are missing or damaged; "
            "--verify only checks an existing cache.",
            {"stream": StreamConfig, "cache": CacheCommand, "cpu": CpuOptions},
            _cache,
        ),
        "train": (
            "train MxD / transcoders / skip transcoders from one activation stream",
            "Train every combination of --arch x --k x --width-multiplier x --blocks from one stream (a cache, or the model "
            "live). Checkpoints go to OUT/checkpoints, final SAELens-format weights to OUT/final/NAME. Runs "
            "under torchrun too. The options are the fields of mxd_lens.config.TrainRun (recorded in OUT/run.json); give "
            "--tokens or --epochs.",
            {"run": TrainRun, "cpu": CpuOptions},
            _train,
        ),
        "publish": (
            "upload saved layers to the Hugging Face hub (SAELens layout, model card)",
            _publish.__doc__,
            {"layers": LayersArgument, "publish": PublishConfig},
            _publish,
        ),
        "export": (
            "export transcoders to circuit-tracer's transcoder-set format",
            _export.__doc__,
            {"layers": LayersArgument, "export": ExportConfig},
            _export,
        ),
        "info": (
            "show what a saved layer is and how it was made",
            _info.__doc__,
            {"layers": LayersArgument},
            _info,
        ),
    }
    for name, (summary, description, options, func) in commands.items():
        command = sub.add_parser(name, help=summary, description=inspect.cleandoc(description or ""))
        for dest, options_class in options.items() if only in (None, name) else ():
            command.add_arguments(options_class, dest=dest)
        command.set_defaults(func=func)
    # every registered study is a verb: its options dataclass and the options its kind shares
    from mxd_lens.studies import STUDIES, load_plugins

    if only not in STUDIES and only not in commands:  # `--help`, a plug-in's verb, a mistyped one
        load_plugins()
    for name, study in STUDIES.items():
        if name in commands:
            raise RuntimeError(
                f"the study {name!r} has the name of a built-in command; register it under another"
            )
        wanted = only in (None, name)
        options_class = study.options_class() if wanted else None
        description = inspect.cleandoc(options_class.__doc__ or "") if wanted else None
        command = sub.add_parser(name, help=study.summary, description=description)
        if wanted:
            command.add_arguments(options_class, dest="study")
            command.add_arguments(study.where_class(), dest="where")
        command.set_defaults(func=_study_verb(study))
    return parser


def _study_verb(study: Any) -> Any:
    """The function that runs ``study`` as its verb: threads, the host model, ``run(model, options,
    out)``, the result written (atomically) and printed."""

    def verb(args: argparse.Namespace) -> int:
        from mxd_lens.studies import StudyIncomplete, resolve
        from mxd_lens.studies.report import render, write_result

        options, where = args.study, args.where
        if where.threads < 0:
            raise SystemExit(f"mxd-lens {study.name}: --threads {where.threads} must be >= 0 (0: every core)")
        _threads(where.threads)
        if study.check:  # before the model: refuse what cannot work before any heavy work
            resolve(study.check)(options)
        model = resolve(study.model)(where, options) if study.model else None
        out = study.out_folder(getattr(where, "out", None))
        try:
            result = resolve(study.run)(model, options, out)
        except StudyIncomplete as err:
            print(render(err.result))
            raise SystemExit(f"mxd-lens {study.name}: {err}") from None
        if result.record:
            result.record.setdefault("command", _command())
        written = write_result(result, out) if out is not None else []
        shown = render(result)
        if shown:
            print(shown)
        if written:
            print(f"\nwrote {out}/ ({', '.join(sorted({p.relative_to(out).parts[0] for p in written}))})")
        return 0

    return verb


def _joined_negative_values(words: list[str]) -> list[str]:
    """``--lr -1e-3`` as ``--lr=-1e-3``: argparse takes a word like ``-1e-3`` for an option (it knows
    only plain negative numbers), so a negative value would be a usage error instead of reaching the
    field's own check."""
    out: list[str] = []
    for word in words:
        if out and out[-1].startswith("--") and "=" not in out[-1] and word.startswith("-") and _number(word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def _number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _imported_modules(words: list[str], debug: bool = False) -> list[str]:
    """Import each ``--import MODULE`` (anywhere on the line; :func:`import_plugin`: the working folder's
    MODULE.py or MODULE/ first, then installed modules) and return the line without them: a module that
    registers an architecture makes its key a valid ``--arch`` before the options are checked. A module
    that cannot be imported, or raises, ends the run with one line naming it (``debug``: the error
    itself, with its traceback)."""
    rest, modules = [], []
    it = iter(words)
    for word in it:
        if word == "--import":
            modules.append(next(it, ""))
        elif word.startswith("--import="):
            modules.append(word.removeprefix("--import="))
        else:
            rest.append(word)
    for module in modules:
        if not module:
            raise SystemExit("mxd-lens: --import needs a module name")
        try:
            import_plugin(module)
        except ModuleNotFoundError as err:
            if debug:
                raise
            if err.name == module.partition(".")[0]:  # the module named, not one it imports
                raise SystemExit(
                    f"mxd-lens: --import {module}: no {module.partition('.')[0]}.py or "
                    f"{module.partition('.')[0]}/__init__.py in {os.getcwd()}, and no installed module {err.name!r}"
                ) from None
            raise SystemExit(one_line_error(f"mxd-lens: --import {module}", err)) from None
        except Exception as err:
            if debug:
                raise
            raise SystemExit(one_line_error(f"mxd-lens: --import {module}", err)) from None
    return rest


def import_plugin(name: str) -> Any:
    """Import the module ``name`` for ``--import``: from the working folder when it holds ``NAME.py`` or
    the package ``NAME/`` (a dotted name: its first part), else as installed. Only that module is read
    from the working folder: the folder is not put on ``sys.path``, so a ``pandas.py`` or
    ``safetensors.py`` lying there never stands in for the installed package; a package plug-in imports
    its own submodules (``NAME.run``) from its folder."""
    import importlib
    import importlib.util
    from pathlib import Path

    top = name.partition(".")[0]
    if top not in sys.modules:
        here = Path.cwd()
        if (here / top / "__init__.py").is_file():
            spec = importlib.util.spec_from_file_location(
                top, here / top / "__init__.py", submodule_search_locations=[str(here / top)]
            )
        elif (here / f"{top}.py").is_file():
            spec = importlib.util.spec_from_file_location(top, here / f"{top}.py")
        else:
            spec = None
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules[top] = module  # as an import does: dataclasses and submodules look it up
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(top, None)
                raise
    return importlib.import_module(name)


def _debug_asked(words: list[str]) -> bool:
    """Whether the line (before its verb) or MXD_LENS_DEBUG asks for tracebacks: read before the parser
    exists, for errors in ``--import`` modules and plug-ins."""
    if os.environ.get("MXD_LENS_DEBUG", "") not in ("", "0"):
        return True
    it = iter(words)
    for word in it:
        if word == "--debug":
            return True
        if word == "--import":
            next(it, None)
        elif not word.startswith("-"):
            return False
    return False


def _plugin_warnings(debug: bool) -> Any:
    """A context in which a skipped plug-in (:class:`mxd_lens.plugins.PluginWarning`) is printed as one
    line on stderr (``debug``: with the traceback of its error), every time."""
    import contextlib
    import warnings

    from mxd_lens.plugins import PluginWarning

    @contextlib.contextmanager
    def context() -> Any:
        with warnings.catch_warnings():
            shown = warnings.showwarning

            def show(
                message: Any, category: Any, filename: Any, lineno: Any, file: Any = None, line: Any = None
            ) -> None:
                if not isinstance(message, PluginWarning):
                    return shown(message, category, filename, lineno, file, line)
                print(f"mxd-lens: warning: {message}", file=sys.stderr)
                if debug and message.details:
                    print(message.details, file=sys.stderr, end="")

            warnings.simplefilter("always", PluginWarning)
            warnings.showwarning = show
            yield

    return context()


def main(argv: list[str] | None = None) -> int:
    global _LINE
    # Freed big tensors stay in the process (mxd_lens/allocator.py): here only, never on import.
    try:
        keep_freed_memory()
    except ValueError as err:  # a bad MXD_LENS_KEEP_FREED_MEMORY
        raise SystemExit(f"mxd-lens: {err}") from None
    _LINE = sys.argv[1:] if argv is None else list(argv)
    argv = _joined_negative_values(_LINE)
    debug = _debug_asked(argv)
    with _plugin_warnings(debug):
        return _main(argv, debug)


def _main(argv: list[str], debug: bool) -> int:
    argv = _imported_modules(argv, debug)
    words = argv
    try:
        parser = build_parser(only=next((w for w in words if not w.startswith("-")), ""))
    except Exception as err:  # a registered study the parser cannot take: one line, as for a verb
        if debug:
            raise
        raise SystemExit(one_line_error("mxd-lens", err)) from err
    try:
        args = parser.parse_args(argv)
    except ValueError as err:  # a config dataclass refused its fields (e.g. neither --tokens nor --epochs)
        command = next((a for a in argv if not a.startswith("-")), "")
        raise SystemExit(f"mxd-lens {command}: {err}") from err
    if getattr(args, "cpu", None) is not None:
        if args.cpu.threads < 0:
            raise SystemExit(
                f"mxd-lens {args.command}: --threads {args.cpu.threads} must be >= 0 (0: every core)"
            )
        _threads(args.cpu.threads)
    if args.debug or debug:
        return args.func(args)
    try:
        return args.func(args)
    except Exception as err:  # one line that names the verb; the traceback only on request
        raise SystemExit(one_line_error(f"mxd-lens {args.command}", err)) from err


USER_ERRORS = (ValueError, OSError, RuntimeError, LookupError)  # bad input or a bad file, not a bug here


def one_line_error(where: str, err: BaseException) -> str:
    """``where: message`` for an error whose message says what is wrong (the type is added for others,
    which are more likely bugs), with how to see the traceback."""
    message = str(err) or type(err).__name__
    if not isinstance(err, USER_ERRORS):
        message = f"{type(err).__name__}: {message}"
    return f"{where}: {message}\n(for the traceback: mxd-lens --debug ..., or MXD_LENS_DEBUG=1)"


if __name__ == "__main__":
    sys.exit(main())
