"""The sparsity–accuracy frontier on a real model: parameter-matched MxD, TopK transcoder and skip
transcoder at several K, from one cached activation stream, spliced on held-out text.

    python analyses/frontier.py --layers 15 --ks 16 32 64 --width-multiplier 8 \
        --train-tokens 1000000 --out results/frontier

Writes OUT/frontier.json (config, command, results), OUT/frontier.csv and OUT/frontier.png; the cache
and the trained weights stay under OUT for later studies (probing, steering).
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from mxd_lens.analysis.frontier import METHODS, FrontierConfig, run_frontier
from mxd_lens.data import default_text
from mxd_lens.models import DEFAULT_MODEL, load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name or path (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--text", default=None, help="training/eval text (default: the bundled English text)")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[15], help="blocks whose MLP to replace (default 15)"
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 32, 64], help="K values (default 16 32 64)")
    parser.add_argument(
        "--width-multiplier", type=int, default=8, help="transcoder width m x d_model (default 8)"
    )
    parser.add_argument(
        "--archs", nargs="+", default=list(METHODS), choices=list(METHODS), help="methods to compare"
    )
    defaults = {name: f.default for name, f in FrontierConfig.__dataclass_fields__.items()}
    parser.add_argument(
        "--train-tokens",
        type=int,
        default=defaults["train_tokens"],
        help=f"tokens cached from the train split (default {defaults['train_tokens']:,})",
    )
    parser.add_argument(
        "--epochs",
        type=float,
        default=defaults["epochs"],
        help=f"passes over them (default {defaults['epochs']})",
    )
    parser.add_argument(
        "--eval-tokens", type=int, default=25_600, help="held-out tokens for CE (default 25,600)"
    )
    parser.add_argument("--context-size", type=int, default=128, help="tokens per row (default 128)")
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=defaults["batch_tokens"],
        help=f"tokens per training step (default {defaults['batch_tokens']})",
    )
    parser.add_argument(
        "--lr", type=float, default=defaults["lr"], help=f"Adam learning rate (default {defaults['lr']})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--out", default="results/frontier", help="output folder (default results/frontier)")
    args = parser.parse_args(argv)

    model = load_model(args.model)
    config = FrontierConfig(
        text=args.text or str(default_text()),
        layers=args.layers,
        ks=args.ks,
        width_multiplier=args.width_multiplier,
        archs=args.archs,
        train_tokens=args.train_tokens,
        epochs=args.epochs,
        eval_tokens=args.eval_tokens,
        context_size=args.context_size,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        seed=args.seed,
    )
    rows = run_frontier(model, config, args.out)
    columns = [
        "method",
        "layer",
        "k",
        "params",
        "ce_clean",
        "delta_ce",
        "kl",
        "fvu",
        "l0",
        "dead_fraction",
        "ce_recovered_zero",
    ]
    print(
        pd.DataFrame(rows)[columns]
        .sort_values(["layer", "k", "method"])
        .to_markdown(index=False, floatfmt=".4f")
    )
    print(f"\nresults in {args.out}/frontier.json|csv|png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
