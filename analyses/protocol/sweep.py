"""The protocol's choice of learning rate per architecture and of MxD's gate, made on the training split.

Block 15 of SmolLM2-135M-Instruct, K = 32, m = 8 (MxD parameter-matched), 512 steps of 512 tokens from
the first 12 shards (393k tokens, under one pass, so each batch is new when it is scored) of the
protocol's cache (cache.sh). Learners: MxD with the paper's gate (relu_topk), the plain TopK gate
(topk), the TopK transcoder and the skip transcoder, each at lr 5e-4, 1e-3, 2e-3; and at lr 1e-3 the
usage controller on each gate (balance_rate 1e-3) and a narrower dense path (d_hidden 384, N raised to
keep parameters matched). All from one stream, each with its own Adam (same schedule, warmup, decay).

The rule: per architecture the lr with the lowest training-window FVU (the mean over the last 10% of
logged steps); the new MxD variant (the paper's gate, "mxd", stays in the study as the baseline): among
the MxD variants other than "mxd" whose training-window L0 is >= 0.9 K, the lowest FVU. (512 steps are
too few to show the paper's gate collapsing, which the study's 2,048 steps measure; so the paper's gate
is not a candidate, as issue 27 asks: "the best of the new gates".) Writes OUT/sweep.csv and OUT/sweep.md (OUT: the first argument, default results/protocol-sweep).
Resumable (checkpoints under OUT). THREADS (default 2).

    OMP_NUM_THREADS=2 .venv/bin/python analyses/protocol/sweep.py results/protocol-sweep

The same sweep at another block and grid (issue 43, part 1: the per-depth rates at blocks 5 and 25, on
the cache of those blocks; sweep_depth.sh runs both): --block, --lrs, --archs (each at every lr), --extra
(each at --extra-lrs).

    .venv/bin/python analyses/protocol/sweep.py results/protocol-sweep-l5 --cache results/cache-mix7-l5-25 \
        --block 5 --lrs 1e-3 2e-3 4e-3 8e-3 --archs mxd mxd:gate=topk mxd:gate=topk,gate_standardize=0.1 \
        transcoder skip_transcoder --extra mxd:gate=topk,gate_standardize=0.03 \
        mxd:gate=topk,gate_standardize=0.3 --extra-lrs 2e-3 4e-3

The rates a sweep chose, in the form `mxd-lens frontier --arch-lr` takes (gemma.sh reads them so):

    .venv/bin/python analyses/protocol/sweep.py --rates-of results/gemma-sweep-l9/sweep.csv --archs mxd transcoder
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from mxd_lens.activations import CachedActivations
from mxd_lens.config import TrainConfig
from mxd_lens.fileio import atomic_write_text
from mxd_lens.layers import arch_label
from mxd_lens.layers.learners import LearnerSpec
from mxd_lens.training import Trainer

BLOCK, K, STEPS, SHARDS = 15, 32, 512, 12
LRS = (5e-4, 1e-3, 2e-3)
SWEPT = ("mxd", "mxd:gate=topk", "transcoder", "skip_transcoder")
EXTRA = ("mxd:balance_rate=0.001", "mxd:balance_rate=0.001,gate=topk", "mxd:d_hidden=384")


def best_rates(path: str | Path, archs: list[str]) -> str:
    """The `arch=lr ...` string --arch-lr takes: each of archs at the rate its sweep marked best_lr."""
    table = pd.read_csv(path)
    best = table[table["best_lr"].astype(str) == "True"].set_index("arch")["lr"]
    if missing := [arch for arch in archs if arch not in best.index]:
        sys.exit(f"{path} has no best rate for {missing}: rerun the sweep or set the rates by hand")
    return " ".join(f"{arch}={best[arch]:g}" for arch in archs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="results/protocol-sweep")
    parser.add_argument("--cache", default="results/cache-mix7")
    parser.add_argument("--block", type=int, default=BLOCK)
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    parser.add_argument("--archs", nargs="+", default=list(SWEPT))
    parser.add_argument("--extra", nargs="*", default=list(EXTRA))
    parser.add_argument("--extra-lrs", type=float, nargs="+", default=[1e-3])
    parser.add_argument("--rates-of", metavar="SWEEP_CSV",
                        help="train nothing: print 'arch=lr' for each of --archs at its best rate in this "
                             "sweep.csv (for --arch-lr)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rates_of:
        print(best_rates(args.rates_of, args.archs))
        return 0
    out_dir, cache = Path(args.out), args.cache
    specs = [LearnerSpec(arch, args.block, K, lr=lr) for arch in args.archs for lr in args.lrs]
    specs += [LearnerSpec(arch, args.block, K, lr=lr) for arch in args.extra for lr in args.extra_lrs]
    source = CachedActivations(cache, blocks=[args.block], max_shards=SHARDS)
    manifest = json.loads((Path(cache) / "manifest.json").read_text())
    config = TrainConfig(
        total_tokens=STEPS * 512, batch_tokens=512, lr=1e-3, log_every=8, checkpoint_every=64
    )
    trainer = Trainer(specs, source, config, out_dir, progress=False, data_info=manifest.get("text"))
    trainer.fit(resume=True)
    rows = []
    for spec in specs:
        history = trainer.learners[spec.name].history
        tail = pd.DataFrame(history[-max(1, len(history) // 10) :])
        rows.append({
            "arch": spec.method, "lr": spec.lr,
            "params": sum(p.numel() for p in trainer.learners[spec.name].layer.parameters()),
            "d_sae": trainer.learners[spec.name].layer.cfg.d_sae,
            "train_fvu": tail["fvu"].mean(), "train_l0": tail["l0"].mean(),
            "train_dead": tail["dead_fraction"].mean(), "steps": trainer.step,
        })  # fmt: skip
    table = pd.DataFrame(rows)
    best = table.loc[table.groupby("arch")["train_fvu"].idxmin()]
    new = best["arch"].str.startswith("mxd:")  # every MxD variant but the paper's gate
    mxd = best[new & (best["train_l0"] >= 0.9 * K)]
    gate = mxd.loc[mxd["train_fvu"].idxmin(), "arch"] if len(mxd) else None
    table["best_lr"] = table.index.isin(best.index)
    table.to_csv(out_dir / "sweep.csv", index=False)
    shown = table.assign(arch=table["arch"].map(arch_label))  # the key in the CSV, its label here
    text = shown.round(4).to_markdown(index=False)
    text = f"Block {args.block}, K = {K}, {STEPS} steps of 512 tokens, cache {cache}\n\n" + text
    text += f"\n\nChosen MxD variant (L0 >= {0.9 * K:.1f}, lowest FVU at its best lr): {gate}\n"
    atomic_write_text(out_dir / "sweep.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
