"""Training throughput (issue 3): tokens per second of whole training runs, measured side by side.

    python benchmarks/train_throughput.py                 # random 6-layer d_model=256 model, ~2.5 min on 2 cores
    python benchmarks/train_throughput.py --model gpt2    # a real TransformerLens model (needs its weights)
    python benchmarks/train_throughput.py --tokens 256 --batch-tokens 64 --context-size 16 \\
        --rows-per-shard 16 --n-layers 2 --d-model 32 --d-mlp 64 --n-heads 2 --d-vocab 100 \\
        --layer 1 --k 4 --m 4                             # smoke run (seconds)

Every variant trains on the same number of tokens (--tokens, a multiple of --batch-tokens) of the same
seeded token rows, on one model, with every progress bar off; the wall time of each is timed with
time.perf_counter after one untimed warm-up (two steps of every code path on other rows).

Variants (L = --layer, K = --k, m = --m; the transcoder has H = m * d_model latents and each MxD the
experts that match its parameters, as the trainer builds them):

    stream only         ModelActivations -> shuffled_batches, no learner: the model forward + shuffling
    4 learners          ONE Trainer with MxD K/2, MxD K, transcoder K/2, transcoder K, one live stream
    <learner> alone     four Trainers, one learner each, each with its own live stream (and model forwards)
    SAELens store       sae_lens ActivationsStore.from_config_multi_hook on the two hooks
                        blocks.L.mlp.hook_in / blocks.L.hook_mlp_out of the same HookedSAETransformer,
                        feeding our Transcoder (K, m; same init) in a plain loop: forward_sparse, the
                        trainer's loss, backward, torch.optim.Adam(fused=True) as the trainer builds it
    write cache         write_cache of the shards the cached run needs (reported, not in any ratio)
    cache read only     CachedActivations -> shuffled_batches, no learner
    cached transcoder   the transcoder-K Trainer reading the cache

Each live run also reports the token rows it read: a Trainer whose last step ends a shard reads (and
runs the model on) one shard more than it trains on, and that cost is in its time, as it is for a user.

Ratios:

    (a) 4 learners / sum of the four "alone" runs                 (wall time; goal <= 0.4)
    (b) transcoder K alone (ours) / SAELens store                 (tokens per second; goal >= 1.0)
    (c) cached transcoder / transcoder K alone                    (tokens per second)

Fairness: SAELens's buffer is set to the size of our shard (n_batches_in_buffer = rows_per_shard: its
buffer holds n_batches_in_buffer * (context - 1) tokens), its forward batch to ours
(store_batch_size_prompts = rows_per_forward) and both drop position 0 of every row (seqpos_slice=(1, None)).
Its dataset is a datasets.Dataset of the same token rows (column input_ids, so is_dataset_tokenized).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

import mxd_lens
from mxd_lens import hook_names, hooks
from mxd_lens.activations import CachedActivations, ModelActivations, shuffled_batches, write_cache
from mxd_lens.layers.learners import LearnerSpec, build_layer
from mxd_lens.training import TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_speed import _machine_busy_s, _own_cpu_s  # noqa: E402  (shared CPU accounting)

DEFAULT_TOKENS = 6 * 7 * 4096  # six shards of 256 rows x 127 tokens, 7 batches of 4,096 each


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default=None,
        help="TransformerLens model name to load (needs its weights); default: a random model (below)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help=f"training tokens per variant, a multiple of --batch-tokens (default {DEFAULT_TOKENS:,})",
    )
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per step (default 4096)")
    p.add_argument("--context-size", type=int, default=128, help="tokens per row (default 128)")
    p.add_argument("--rows-per-shard", type=int, default=256, help="rows per shard (default 256, as the CLI)")
    p.add_argument("--rows-per-forward", type=int, default=16, help="rows per model forward (default 16)")
    p.add_argument("--k", type=int, default=32, help="K of the single-learner runs; the 4 use K/2 and K")
    p.add_argument(
        "--m", type=int, default=8, help="width multiplier: transcoder H = m * d_model (default 8)"
    )
    p.add_argument("--layer", type=int, default=3, help="block whose MLP is replaced (default 3)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("the random model (when --model is not given)")
    g.add_argument("--n-layers", type=int, default=6)
    g.add_argument("--d-model", type=int, default=256)
    g.add_argument("--d-mlp", type=int, default=1024)
    g.add_argument("--n-heads", type=int, default=4, help="d_head = d_model / n_heads")
    g.add_argument("--d-vocab", type=int, default=5000)
    args = p.parse_args(argv)
    for name in ("tokens", "batch_tokens", "rows_per_shard", "rows_per_forward", "k", "m", "n_layers"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.k < 2:
        p.error("--k must be >= 2 (the four-learner run uses K/2 and K)")
    if args.tokens % args.batch_tokens:
        p.error(f"--tokens {args.tokens} must be a multiple of --batch-tokens {args.batch_tokens}")
    if args.rows_per_shard * (args.context_size - 1) < args.batch_tokens:
        p.error("--rows-per-shard * (--context-size - 1) must hold at least one batch of --batch-tokens")
    if args.model is None and args.d_model % args.n_heads:
        p.error("--d-model must be a multiple of --n-heads")
    return args


def build_model(args: argparse.Namespace) -> tuple[Any, str]:
    """One HookedSAETransformer for every variant (it has blocks.L.mlp.hook_in for SAELens)."""
    warnings.filterwarnings("ignore", message="HookedTransformer is deprecated", category=DeprecationWarning)
    from sae_lens import HookedSAETransformer
    from transformer_lens import HookedTransformerConfig

    if args.model is not None:
        try:
            model = HookedSAETransformer.from_pretrained(args.model, device="cpu")
        except Exception as err:  # unknown name, or weights not cached while offline
            raise SystemExit(f"could not load model {args.model!r}: {type(err).__name__}: {err}") from err
        desc = f"{args.model} (pretrained, loaded with HookedSAETransformer.from_pretrained)"
    else:
        cfg = HookedTransformerConfig(
            n_layers=args.n_layers,
            d_model=args.d_model,
            d_mlp=args.d_mlp,
            n_heads=args.n_heads,
            d_head=args.d_model // args.n_heads,
            n_ctx=max(128, args.context_size),
            d_vocab=args.d_vocab,
            act_fn="gelu_new",
            normalization_type="LN",
            model_name=f"random-{args.n_layers}L-d{args.d_model}",
            seed=args.seed,
            device="cpu",
        )
        model = HookedSAETransformer(cfg)
        desc = (
            f"random GPT-2-shaped HookedSAETransformer: {cfg.n_layers} layers, d_model {cfg.d_model}, "
            f"d_mlp {cfg.d_mlp}, {cfg.n_heads} heads x {cfg.d_head}, n_ctx {cfg.n_ctx}, d_vocab {cfg.d_vocab}, "
            f"gelu_new, LayerNorm; {sum(p.numel() for p in model.parameters()):,} parameters"
        )
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, desc


def token_rows(model: Any, context_size: int, n_rows: int, seed: int) -> torch.Tensor:
    """[n_rows, context_size] seeded random tokens; position 0 is the BOS token when there is one."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, model.cfg.d_vocab, (n_rows, context_size), generator=g)
    bos = getattr(getattr(model, "tokenizer", None), "bos_token_id", None)
    if bos is not None:
        rows[:, 0] = bos
    return rows


class Rows:
    """The rows as ModelActivations takes them (a fresh iterator per call), counting the rows read."""

    def __init__(self, table: torch.Tensor):
        self.table, self.read = table, 0

    def __call__(self) -> Iterator[torch.Tensor]:
        for row in self.table:
            self.read += 1
            yield row


def stream(model: Any, args: argparse.Namespace, rows: Rows, rows_per_shard: int | None = None):
    return ModelActivations(
        model,
        [args.layer],
        rows,
        context_size=args.context_size,
        rows_per_shard=rows_per_shard or args.rows_per_shard,
        rows_per_forward=args.rows_per_forward,
    )


def train_config(args: argparse.Namespace, tokens: int) -> TrainConfig:
    # The stream and the step are what this measures: the recipe's extras (activation scaling, the
    # AuxK term) are off, so every variant does the work of the plain reconstruction step.
    return TrainConfig(
        total_tokens=tokens,
        batch_tokens=args.batch_tokens,
        seed=args.seed,
        checkpoint_every=0,
        normalize="none",
        aux_coefficient=0.0,
    )


def run_trainer(
    specs: list[LearnerSpec], source: Any, args: argparse.Namespace, tokens: int, out: Path
) -> float:
    """Wall seconds of Trainer.fit (construction, i.e. layer init, not included)."""
    trainer = Trainer(specs, source, train_config(args, tokens), out, progress=False)
    gc.collect()
    t0 = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - t0
    if trainer.tokens_seen != tokens:
        raise RuntimeError(f"Trainer.fit trained {trainer.tokens_seen:,} tokens, not the {tokens:,} asked")
    return seconds


def drain(source: Any, args: argparse.Namespace, tokens: int) -> float:
    """Wall seconds to draw tokens // batch_tokens batches from ``source`` without training."""
    steps = tokens // args.batch_tokens
    gc.collect()
    t0 = time.perf_counter()
    for i, _ in enumerate(shuffled_batches(source, args.batch_tokens, args.seed), start=1):
        if i == steps:
            break
    else:
        raise ValueError(f"the stream ran out before {steps} batches")
    return time.perf_counter() - t0


def saelens_store(model: Any, args: argparse.Namespace, rows: torch.Tensor, rows_per_shard: int):
    import datasets
    from sae_lens.training.activations_store import ActivationsStore

    hook_in, hook_out = hook_names.mlp_in_hook(args.layer), hook_names.mlp_out_hook(args.layer)
    dataset = datasets.Dataset.from_dict({"input_ids": rows.numpy()})
    with warnings.catch_warnings():
        # "fewer samples than total_training_tokens": it compares rows with tokens.
        warnings.simplefilter("ignore")
        store = ActivationsStore.from_config_multi_hook(
            model,
            dataset=dataset,
            hook_names=[hook_in, hook_out],
            hook_d_ins={hook_in: model.cfg.d_model, hook_out: model.cfg.d_model},
            streaming=False,
            context_size=args.context_size,
            n_batches_in_buffer=rows_per_shard,  # buffer = n_batches_in_buffer * (context - 1) tokens
            total_training_tokens=args.tokens,
            store_batch_size_prompts=args.rows_per_forward,
            train_batch_size_tokens=args.batch_tokens,
            prepend_bos=True,
            seqpos_slice=(1, None),
            device="cpu",
            dtype="float32",
        )
    return store, hook_in, hook_out


def run_saelens(
    model: Any, args: argparse.Namespace, rows: torch.Tensor, tokens: int, info: Any, rows_per_shard: int
) -> tuple[float, int]:
    """Wall seconds of SAELens's multi-hook store feeding our Transcoder in a plain Adam loop, and the
    rows the store read. Our trainer's loss (NMSE, scale from the first batch); no decoder-norm upkeep,
    no metrics: the loop is the least a trainer can do."""
    spec = LearnerSpec("transcoder", args.layer, k=args.k, width_multiplier=args.m)
    layer = build_layer(spec, info, seed=args.seed * 7919)  # the same init as the Trainer's first learner
    optimizer = torch.optim.Adam(layer.parameters(), lr=train_config(args, tokens).lr, fused=True)
    store, hook_in, hook_out = saelens_store(model, args, rows, rows_per_shard)
    steps = tokens // args.batch_tokens
    gc.collect()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. torch.tensor(row) on a tensor row, in its row iterator
        # Running out of rows (a "new epoch") would reuse tokens: an error here.
        warnings.filterwarnings("error", message="All samples in the training dataset have been exhausted")
        loader = store.get_multi_hook_data_loader()
        scale = None
        for _ in range(steps):
            batch = next(loader)
            x, y = batch[hook_in], batch[hook_out]
            if scale is None:
                scale = max(float((y - y.mean(0)).pow(2).sum(-1).mean()), 1e-12)
            out, _, _ = layer.forward_sparse(x)
            loss = (out - y).pow(2).sum(-1).mean() / scale
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return time.perf_counter() - t0, store.n_dataset_processed


def run(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
    torch.manual_seed(args.seed)
    model, model_desc = build_model(args)
    hooks.check_block(model, args.layer)
    if not 2 <= args.context_size <= model.cfg.n_ctx:
        raise SystemExit(f"--context-size must be in 2..{model.cfg.n_ctx} for this model")

    steps = args.tokens // args.batch_tokens
    per_row = args.context_size - 1  # position 0 is dropped by both pipelines
    shard_tokens = args.rows_per_shard * per_row
    batches_per_shard = shard_tokens // args.batch_tokens
    n_shards = math.ceil(steps / batches_per_shard)
    our_rows = n_shards * args.rows_per_shard
    # SAELens serves a batch once its buffer is full and keeps half of it: a margin of two buffers.
    saelens_rows = math.ceil(args.tokens / per_row) + 2 * args.rows_per_shard + args.rows_per_forward
    rows = token_rows(model, args.context_size, max(our_rows, saelens_rows), args.seed)

    k_lo, k = args.k // 2, args.k
    specs = [
        LearnerSpec("mxd", args.layer, k=k_lo, width_multiplier=args.m),
        LearnerSpec("mxd", args.layer, k=k, width_multiplier=args.m),
        LearnerSpec("transcoder", args.layer, k=k_lo, width_multiplier=args.m),
        LearnerSpec("transcoder", args.layer, k=k, width_multiplier=args.m),
    ]
    tc_k = specs[3]
    info = stream(model, args, Rows(rows)).info
    width = args.m * info.d_in
    n_experts = mxd_lens.match_experts(width, info.d_in, info.d_out, info.d_hidden, glu=info.gated)

    times: dict[str, float] = {}
    rows_read: dict[str, int] = {}
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="train_throughput-") as tmp:
        tmp = Path(tmp)
        # Warm-up: two steps of every code path (model forward, each learner, SAELens store, cache).
        warm_tokens = 2 * args.batch_tokens
        warm_shard = math.ceil(warm_tokens / per_row)
        n_warm = math.ceil(warm_tokens / per_row) + 3 * warm_shard + args.rows_per_forward
        warm_rows = token_rows(model, args.context_size, n_warm, args.seed + 1)
        run_trainer(specs, stream(model, args, Rows(warm_rows), warm_shard), args, warm_tokens, tmp / "warm")
        run_saelens(model, args, warm_rows, warm_tokens, info, warm_shard)
        write_cache(stream(model, args, Rows(warm_rows), warm_shard), tmp / "warm-cache", 1, progress=False)
        drain(CachedActivations(tmp / "warm-cache"), args, warm_tokens)

        busy: dict[str, float | None] = {}

        def measure(name: str, fn: Callable[[], Any]) -> Any:
            """Run one variant; record its wall seconds and the other processes' CPU share meanwhile."""
            gc.collect()
            b0, o0, w0 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
            out = fn()
            b1, o1, w1 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
            seconds, value = out if isinstance(out, tuple) else (out, None)
            times[name] = seconds
            busy[name] = (
                None
                if b0 is None or b1 is None
                else max(0.0, (b1 - b0) - (o1 - o0)) / ((w1 - w0) * (os.cpu_count() or 1))
            )
            return value

        def write() -> float:
            t0 = time.perf_counter()
            write_cache(stream(model, args, Rows(rows)), tmp / "cache", n_shards, progress=False)
            return time.perf_counter() - t0

        def live(name: str, fn: Callable[[Rows], float]) -> None:
            counter = Rows(rows)
            measure(name, lambda: fn(counter))
            rows_read[name] = counter.read

        live("stream only", lambda r: drain(stream(model, args, r), args, args.tokens))
        live(
            "4 learners, one stream",
            lambda r: run_trainer(specs, stream(model, args, r), args, args.tokens, tmp / "four"),
        )
        for spec in specs:
            live(
                f"{spec.name} alone",
                lambda r, spec=spec: run_trainer(
                    [spec], stream(model, args, r), args, args.tokens, tmp / spec.name
                ),
            )
        rows_read["SAELens store + our transcoder"] = measure(
            "SAELens store + our transcoder",
            lambda: run_saelens(model, args, rows, args.tokens, info, args.rows_per_shard),
        )
        measure("write cache", write)
        extra["cache_bytes"] = sum(f.stat().st_size for f in (tmp / "cache").iterdir())
        measure("cache read only", lambda: drain(CachedActivations(tmp / "cache"), args, args.tokens))
        measure(
            f"{tc_k.name} from cache",
            lambda: run_trainer([tc_k], CachedActivations(tmp / "cache"), args, args.tokens, tmp / "cached"),
        )

    alone = {spec.name: times[f"{spec.name} alone"] for spec in specs}
    tokens_per_s = {
        name: (n_shards * shard_tokens if name == "write cache" else args.tokens) / s
        for name, s in times.items()
    }
    ratios = {
        "one_stream_vs_separate": times["4 learners, one stream"] / sum(alone.values()),
        "ours_vs_saelens": tokens_per_s[f"{tc_k.name} alone"]
        / tokens_per_s["SAELens store + our transcoder"],
        "cache_vs_live": tokens_per_s[f"{tc_k.name} from cache"] / tokens_per_s[f"{tc_k.name} alone"],
    }
    # The model forward's cost per row read, from the stream-only run (which reads exactly n_shards
    # shards); a live run's learner part is its time minus that cost of the rows it read.
    per_row = times["stream only"] / rows_read["stream only"]
    learner_s = {n: t - per_row * rows_read[f"{n} alone"] for n, t in alone.items()}
    breakdown = {
        "stream s/step": times["stream only"] / steps,
        "stream s/shard": per_row * args.rows_per_shard,
        "learner s/step": {n: v / steps for n, v in learner_s.items()},
        "stream share": {n: 1 - learner_s[n] / t for n, t in alone.items()},
        "cached learner s/step": (times[f"{tc_k.name} from cache"] - times["cache read only"]) / steps,
        # the ratio if every run read exactly the shards it trains on (no extra shard, see rows read)
        "one-stream ratio without the extra shard": (
            times["4 learners, one stream"] - per_row * (rows_read["4 learners, one stream"] - our_rows)
        )
        / sum(t - per_row * (rows_read[f"{n} alone"] - our_rows) for n, t in alone.items()),
        "forward wasted per shard": (shard_tokens - batches_per_shard * args.batch_tokens) / shard_tokens,
    }
    result = dict(
        args=vars(args),
        argv=list(argv) if argv is not None else sys.argv[1:],
        model=model_desc,
        steps=steps,
        n_shards=n_shards,
        shard_tokens=shard_tokens,
        batches_per_shard=batches_per_shard,
        width=width,
        n_experts=n_experts,
        times=times,
        tokens_per_s=tokens_per_s,
        ratios=ratios,
        breakdown=breakdown,
        others_cpu=busy,
        rows_read=rows_read,
        rows_needed=our_rows,
        **extra,
    )
    print_report(result)
    return result


GOALS = {
    "one_stream_vs_separate": ("(a) one stream, 4 learners / 4 separate runs (wall time)", "<= 0.4"),
    "ours_vs_saelens": ("(b) our trainer / SAELens ActivationsStore + Adam loop (tokens/s)", ">= 1.0"),
    "cache_vs_live": ("(c) from the disk cache / from the model (tokens/s)", "-"),
}


def _met(value: float, goal: str) -> str:
    if goal.startswith("<="):
        return "yes" if value <= float(goal[2:]) else "no"
    if goal.startswith(">="):
        return "yes" if value >= float(goal[2:]) else "no"
    return "-"


def print_report(res: dict) -> None:
    a, b = res["args"], res["breakdown"]
    L, k = a["layer"], a["k"]
    print(f"command: python benchmarks/train_throughput.py {shlex.join(res['argv'])}".rstrip())
    print(
        f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
        f"python {platform.python_version()}, {platform.machine()}, fp32 on CPU"
    )
    print(f"model: {res['model']}")
    print(
        f"stream: layer {L}, rows of {a['context_size']} seeded random tokens (position 0 dropped: "
        f"{a['context_size'] - 1} tokens/row), {a['rows_per_forward']} rows per forward, shards of "
        f"{a['rows_per_shard']} rows = {res['shard_tokens']:,} tokens = {res['batches_per_shard']} batches of "
        f"{a['batch_tokens']:,} ({100 * b['forward wasted per shard']:.1f}% of each shard's tokens are "
        f"computed and dropped); {a['tokens']:,} tokens = {res['steps']} steps = {res['n_shards']} shards "
        f"= {res['rows_needed']:,} rows per variant"
    )
    print(
        f"learners: transcoder H = m x d_model = {a['m']} x {res['width'] // a['m']} = {res['width']:,}, "
        f"MxD N = {res['n_experts']:,} experts (match_experts); K = {k} (and {k // 2} in the 4-learner run); "
        "Adam(fused=True); no checkpoints"
    )
    print(
        f"SAELens: ActivationsStore.from_config_multi_hook(hook_names=['blocks.{L}.mlp.hook_in', "
        f"'blocks.{L}.hook_mlp_out'], n_batches_in_buffer={a['rows_per_shard']}, "
        f"store_batch_size_prompts={a['rows_per_forward']}, seqpos_slice=(1, None)) on a datasets.Dataset of the "
        "same rows (column input_ids), feeding our Transcoder in a plain Adam(fused=True) loop"
    )
    print(
        f"cache: {res['n_shards']} shards, {res['cache_bytes'] / 1e6:,.0f} MB float32 (read back from the "
        "OS page cache: it was just written)"
    )
    shared = [n for n, v in res["others_cpu"].items() if v is not None and v > 0.05]
    if shared:
        print(f"WARNING: other processes used over 5% of the machine's CPU during: {', '.join(shared)}")
    print()
    print("| variant | wall s | s/step | tokens/s | rows read | other processes' CPU |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in res["times"].items():
        steps = res["n_shards"] * res["batches_per_shard"] if name == "write cache" else res["steps"]
        note = " (not in any ratio)" if name == "write cache" else ""
        other = res["others_cpu"][name]
        other_s = "?" if other is None else f"{100 * other:.0f}%"
        read = res["rows_read"].get(name)
        read_s = "-" if read is None else f"{read:,}"
        print(
            f"| {name}{note} | {s:.2f} | {s / steps:.3f} | {res['tokens_per_s'][name]:,.0f} | {read_s} | {other_s} |"
        )
    print()
    print("| ratio | measured | goal | met |")
    print("|---|---:|---:|:---:|")
    for key, value in res["ratios"].items():
        label, goal = GOALS[key]
        print(f"| {label} | {value:.3f} | {goal} | {_met(value, goal)} |")
    print()
    print(
        f"where time goes: the stream (model forward + shuffling, no learner) costs {b['stream s/shard']:.2f} s "
        f"per shard of {a['rows_per_shard']} rows, {b['stream s/step']:.3f} s per step; a live run's learner "
        "part = its time minus that cost of the rows it read, per step: "
        + ", ".join(f"{n} {s:.3f} s" for n, s in b["learner s/step"].items())
    )
    print(
        "stream share of each single-learner live run: "
        + ", ".join(f"{n} {100 * f:.0f}%" for n, f in b["stream share"].items())
        + f"; from the cache, the transcoder's step minus the cache read: {b['cached learner s/step']:.3f} s"
    )
    extra_rows = {n: r - res["rows_needed"] for n, r in res["rows_read"].items() if r > res["rows_needed"]}
    if extra_rows:
        print(
            "rows read beyond the shards trained on: "
            + ", ".join(f"{n} +{r:,}" for n, r in extra_rows.items())
            + f"; (a) without the Trainers' extra rows: {b['one-stream ratio without the extra shard']:.3f}"
        )
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
