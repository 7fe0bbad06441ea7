"""Top-activating contexts of chosen experts / latents, as a CSV table and a self-contained HTML page.

    python analyses/inspect_features.py --layer results/frontier-smollm2-l15-long/runs/final/L15.mxd.k32.m8 \
        --features 12 345 --text ../shared/data/corpus --tokens 200000 --out results/inspect

``--from-steering results/steering/steering.csv`` takes the features the steering study chose for this
layer instead of ``--features``. The texts are packed into rows of ``--context-size`` tokens starting
with the model's BOS and read once, up to ``--tokens`` tokens in all (an equal share from each).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from mxd_lens.analysis.inspect import to_html, top_activations
from mxd_lens.data import TokenRows, default_text, iter_texts
from mxd_lens.layers.io import load_layer
from mxd_lens.models import DEFAULT_MODEL, load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name or path (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--layer", required=True, help="a saved layer folder")
    parser.add_argument("--features", type=int, nargs="*", default=[], help="feature indices")
    parser.add_argument(
        "--from-steering", default=None, help="steering.csv: take the features chosen for this layer"
    )
    parser.add_argument(
        "--text",
        nargs="+",
        default=None,
        help="texts to read, an equal share of tokens from each (default: the bundled English text)",
    )
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens to read (default 100,000)")
    parser.add_argument("--context-size", type=int, default=128, help="tokens per row (default 128)")
    parser.add_argument("--n", type=int, default=20, help="contexts per feature (default 20)")
    parser.add_argument("--out", default="results/inspect", help="output folder (default results/inspect)")
    args = parser.parse_args(argv)

    layer = load_layer(args.layer)
    name = Path(args.layer).name
    features = list(args.features)
    if args.from_steering:
        import pandas as pd

        chosen = pd.read_csv(args.from_steering)
        features += sorted(set(chosen[chosen["name"] == name]["feature"].astype(int)) - set(features))
    if not features:
        raise SystemExit("no features: pass --features or --from-steering")
    model = load_model(args.model)
    rows = TokenRows.for_model(model, args.context_size)
    sources = args.text or [default_text()]
    n_batches = max(1, args.tokens // (8 * args.context_size * len(sources)))
    batches = itertools.chain.from_iterable(
        itertools.islice(rows.batches(iter_texts(source), 8), n_batches) for source in sources
    )
    table = top_activations(model, layer, batches, features, n=args.n)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / f"{name}.csv", index=False)
    to_html(table, f"{name}: top contexts over {table.attrs['tokens']:,} tokens", out / f"{name}.html")
    print(table.groupby("feature").head(3).to_markdown(index=False))
    print(f"\nwrote {out}/{name}.csv and {name}.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
