"""Evaluation cost (issue 11): ``mxd_lens.evaluation.evaluate`` against the floor and against the
previous implementation, on SmolLM2-135M with 9 learners, side by side in one run.

    python benchmarks/eval_speed.py                                   # 9 learners at block 15
    python benchmarks/eval_speed.py --blocks 5 15 25                  # 3 learners at each of 3 blocks
    python benchmarks/eval_speed.py --batches 2 --rows 2 --repeats 1  # a short run
    python benchmarks/eval_speed.py --large-vocab                     # a 262,144-token vocabulary
    python benchmarks/eval_speed.py --smoke                           # a few seconds, either case

The floor is what a spliced evaluation cannot avoid, per batch: one clean forward of the whole model,
per learner the learner on its block's clean MLP input plus one forward from that block on, and per
block the two baselines (zero- and mean-ablated MLP output), each one forward from that block on; every
forward ends in CE, computed a few rows at a time (`_ce`: no whole-batch log-probabilities). ``ours`` is ``evaluate`` as it is now (it adds KL, FVU / L0 / dead
counts, and the mean over the held-out tokens that mean-ablation needs); ``ours, no baselines`` is
``evaluate(baselines=False)``, against the floor without the baseline forwards; ``previous`` is
``evaluate`` as of commit PREVIOUS (every variant from the first block, a separate pass for the means,
each layer computed twice), loaded with ``git show``.
Every variant is run round-robin, the order rotated each round; the table shows the median over
``--repeats`` rounds (after one warm-up round), and the evaluations' numbers are checked to agree.
Learners are randomly initialised (the cost of a layer does not depend on its training).

``--large-vocab`` (issue 30) is the case where the vocabulary, not the model, sets the cost: a tiny random
TransformerLens model (d_model 64, 2 layers, d_vocab 262,144 as Gemma 3's, n_ctx 128) with one learner
at block 1, so every forward is dominated by its [tokens, 262,144] logits and everything computed over
them (log-softmax, CE, KL). There ``dense`` is ``evaluate`` as of commit DENSE (log-probabilities of the
whole batch, clean and spliced, kept at once), in place of ``previous``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from mxd_lens import hook_names, hooks
from mxd_lens.activations import ModelActivations
from mxd_lens.config import DEFAULT_MODEL
from mxd_lens.evaluation import evaluate
from mxd_lens.layers.learners import LearnerSpec, build_layer
from mxd_lens.models import load_model

PREVIOUS = "f347acf"  # main before the evaluation rewrite
DENSE = "deba1f2"  # main before the vocabulary-sized work was chunked (issue 30)
LARGE_VOCAB = 262_144  # Gemma 3's


def previous_evaluate(commit: str = PREVIOUS):
    """``evaluate`` as it was at ``commit``, from git."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{commit}:mxd_lens/evaluation.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # it calls hooks.block_of by its old name, removed in 0.2.0
    source = source.replace("hooks.layer_index(", "hooks.block_of(")
    module = types.ModuleType("previous_evaluation")
    exec(compile(source, f"{commit}:mxd_lens/evaluation.py", "exec"), module.__dict__)
    return module.evaluate


@torch.inference_mode()
def _ce(logits: torch.Tensor, target: torch.Tensor, budget: int = 1 << 22) -> float:
    """Summed next-token CE, a few rows of [tokens, vocab] at a time (``budget`` logits): the cheapest
    way to compute it, so the floor does not pay for a whole batch's log-probabilities (F.cross_entropy
    over the batch makes one, which on a 262k vocabulary costs more than the forward)."""
    z, t = logits.flatten(0, 1), target.flatten()
    rows = max(1, budget // z.shape[-1])
    total = 0.0
    for i in range(0, z.shape[0], rows):
        block = z[i : i + rows].float()
        total += float((torch.logsumexp(block, -1) - block.gather(-1, t[i : i + rows, None])[:, 0]).sum())
    return total


def floor(model, named, batches, baselines: bool = True) -> float:
    """The unavoidable work, returned as total CE (so it is computed, not skipped)."""
    blocks = sorted({hooks.block_of(layer) for layer in named.values()})
    names = [hook_names.resid_pre_hook(b) for b in blocks]
    total = 0.0
    for tokens in batches:
        target = tokens[:, 1:]
        with hooks.capture_mlp_io(model, blocks) as io:
            logits, cache = model.run_with_cache(tokens, names_filter=names)
        total += _ce(logits[:, :-1], target)
        for layer in named.values():
            block = hooks.block_of(layer)
            out = layer.forward_sparse(io[block]["in"])[0]
            with model.hooks(fwd_hooks=[(hook_names.mlp_out_hook(block), lambda o, hook, out=out: out)]):
                logits = model(cache[hook_names.resid_pre_hook(block)], start_at_layer=block)
            total += _ce(logits[:, :-1], target)
        for block in blocks if baselines else []:
            for value in (0.0, 1.0):  # zero- and (a stand-in for) mean-ablation
                ablate = lambda o, hook, value=value: torch.full_like(o, value)  # noqa: E731
                with model.hooks(fwd_hooks=[(hook_names.mlp_out_hook(block), ablate)]):
                    logits = model(cache[hook_names.resid_pre_hook(block)], start_at_layer=block)
                total += _ce(logits[:, :-1], target)
    return total


def main(argv=None, model=None) -> dict:
    """Run the benchmark (``model``: an already loaded HookedTransformer instead of ``--model``);
    returns the median seconds per evaluation."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--blocks",
        type=int,
        nargs="+",
        help="learners spread over these blocks (default 15; 1 with --large-vocab)",
    )
    parser.add_argument("--learners", type=int, help="default 9; 1 with --large-vocab")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="token rows per batch")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-previous", action="store_true", help="skip the previous implementation")
    parser.add_argument(
        "--large-vocab",
        action="store_true",
        help=f"a tiny random model with a {LARGE_VOCAB:,}-token vocabulary instead of --model",
    )
    parser.add_argument("--smoke", action="store_true", help="1 batch of 2 rows of 32 tokens, 1 round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.rows, args.context, args.repeats = 1, 2, 32, 1
    large = args.large_vocab and model is None
    args.blocks = args.blocks or ([1] if large else [15])
    args.learners = args.learners or (1 if large else 9)

    torch.manual_seed(0)
    if model is None:
        model = large_vocab_model() if large else load_model(args.model)
    info = ModelActivations(model, sorted(set(args.blocks)), lambda: iter(()), args.context).info
    archs, ks = ("mxd", "transcoder", "skip_transcoder"), (16, 32, 64)
    specs = [
        LearnerSpec(archs[i % 3], args.blocks[i % len(args.blocks)], ks[(i // 3) % 3], 8)
        for i in range(args.learners)
    ]
    named = {}
    for i, spec in enumerate(specs):
        layer = build_layer(spec, info, seed=i).eval()
        torch.nn.init.normal_(layer.W_dec, std=0.02)  # the skip transcoder's decoder starts at zero
        named[f"{spec.name}#{i}"] = layer
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, model.cfg.d_vocab, (args.rows, args.context), generator=g)
        for _ in range(args.batches)
    ]

    variants = {
        "floor": lambda: floor(model, named, batches),
        "floor, no baselines": lambda: floor(model, named, batches, baselines=False),
        "ours": lambda: evaluate(model, named, batches, progress=False),
        "ours, no baselines": lambda: evaluate(model, named, batches, baselines=False, progress=False),
    }
    if not args.no_previous:
        previous = previous_evaluate(DENSE if large else PREVIOUS)
        variants["dense" if large else "previous"] = lambda: previous(model, named, batches, progress=False)
    results = {name: fn() for name, fn in variants.items()}  # warm-up round, and the numbers to compare
    for name in ("ours, no baselines", "previous", "dense"):
        for a, b in zip(results[name], results["ours"], strict=True) if name in results else []:
            for key in (
                "ce_spliced",
                "kl",
                "fvu",
                "l0",
                "dead_fraction",
                "ce_zero_ablation",
                "ce_mean_ablation",
            ):
                if key not in a:  # no baselines
                    continue
                assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(b[key])), (
                    name,
                    a["name"],
                    key,
                    a[key],
                    b[key],
                )
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.repeats):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    tokens = args.batches * args.rows * args.context
    print(
        f"{model.cfg.model_name}: {len(named)} learners at blocks {sorted(set(args.blocks))}, {tokens:,} tokens "
        f"({args.batches} batches of {args.rows}x{args.context}), median of {args.repeats}, "
        f"torch threads {torch.get_num_threads()}\n"
    )
    print("| evaluation | seconds | / its floor | / ours |")
    print("|:--|--:|--:|--:|")
    for name, t in median.items():
        its = median["floor, no baselines" if "no baselines" in name else "floor"]
        print(f"| {name} | {t:.2f} | {t / its:.2f} | {t / median['ours']:.2f} |")
    sys.stdout.flush()
    return median


def large_vocab_model():
    """A tiny random model whose cost is its vocabulary: d_model 64, 2 layers, Gemma 3's 262,144 tokens."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=64,
        d_head=16,
        n_heads=4,
        d_mlp=256,
        n_ctx=128,
        d_vocab=LARGE_VOCAB,
        act_fn="gelu_new",
        normalization_type="LN",
        model_name=f"tiny-vocab-{LARGE_VOCAB}",
        seed=0,
        device="cpu",
    )
    return HookedTransformer(cfg).eval()


if __name__ == "__main__":
    main()
