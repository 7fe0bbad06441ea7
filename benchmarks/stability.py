"""Training stability (issue 11): one learner trained with and without gradient clipping on the same
cache, seed and schedule, every step logged, summarised per window of steps. Not run in CI (it needs
a real activation cache).

The case it was written for: MxD at K = 8 on SmolLM2-135M layer 15 in the frontier-v2 study
(docs/results/frontier-v2; CHANGELOG.md) diverged at step ~2,100 of 6,287 (FVU 0.15 -> 0.41 -> 1.75, L0 4 -> 1) and never
recovered. The frontier's cache and schedule (33 shards = 1,072,896 tokens, 3 epochs of 512-token
steps) reproduce it exactly:

    python benchmarks/stability.py --cache data/cache-frontier --block 15 --arch mxd --k 8 \\
        --total-steps 6287 --stop 4200 --clips none 1.0 --out results/stability

The first learner of a frontier group gets the trainer's seed ``seed * 7919 + 0``, as here, so the
unclipped run is the frontier's MxD K = 8 step for step. Printed per window: mean training FVU and L0,
the median and largest pre-clip gradient norm, and the steps clipped. Written to OUT/stability.json
(every step) and OUT/stability.csv (the windows).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from mxd_lens.activations import CachedActivations
from mxd_lens.config import TrainConfig
from mxd_lens.layers.learners import LearnerSpec
from mxd_lens.training import Trainer


class _Stopping(Trainer):
    """The trainer, stopped after ``stop`` steps (the schedule stays that of ``total_steps``)."""

    stop: int | None = None

    def should_stop(self) -> bool:
        return self.stop is not None and self.step >= self.stop


def parse_clip(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def run(args: argparse.Namespace, clip: float | None) -> list[dict[str, float]]:
    source = CachedActivations(args.cache, blocks=[args.block], max_shards=args.max_shards)
    config = TrainConfig(
        total_tokens=args.total_steps * args.batch_tokens,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        grad_clip=clip,
        seed=args.seed,
        log_every=1,
        checkpoint_every=0,
    )
    trainer = _Stopping(
        [LearnerSpec(args.arch, args.block, args.k, args.m)], source, config, None, progress=False
    )
    trainer.stop = args.stop
    trainer.fit()
    (learner,) = trainer.learners.values()
    return learner.history


def windows(history: list[dict[str, float]], size: int) -> list[dict[str, float]]:
    rows = []
    for start in range(0, len(history), size):
        part = history[start : start + size]
        norms = [h["grad_norm"] for h in part]
        rows.append(
            {
                "step": part[-1]["step"],
                "fvu": statistics.fmean(h["fvu"] for h in part),
                "l0": statistics.fmean(h["l0"] for h in part),
                "grad_norm_median": statistics.median(norms),
                "grad_norm_max": max(norms),
                "clipped": part[-1]["clipped_steps"] - (history[start - 1]["clipped_steps"] if start else 0),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    """Run, print and write; returns each run's per-step history."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True)
    p.add_argument("--block", type=int, default=15)
    p.add_argument("--arch", default="mxd")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--m", type=int, default=8, help="width multiplier")
    p.add_argument("--max-shards", type=int, default=33, help="cache shards read (the frontier's 33)")
    p.add_argument("--batch-tokens", type=int, default=TrainConfig.batch_tokens)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-steps", type=int, default=6287, help="the schedule's length")
    p.add_argument("--stop", type=int, default=None, help="stop after this many steps")
    p.add_argument("--clips", type=parse_clip, nargs="+", default=[None, 1.0], help="'none' or a norm")
    p.add_argument("--window", type=int, default=125)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/stability")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    histories, tables = {}, {}
    for clip in args.clips:
        name = f"clip={clip}"
        histories[name] = run(args, clip)
        tables[name] = windows(histories[name], args.window)
        (out / "stability.json").write_text(json.dumps({"args": vars(args), "runs": histories}))
    import pandas as pd

    frame = pd.concat(
        {name: pd.DataFrame(rows).set_index("step") for name, rows in tables.items()}, axis=1
    ).round(4)
    frame.to_csv(out / "stability.csv")
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(frame.to_string())
    for name, history in histories.items():
        last = history[-1]
        finite = all(math.isfinite(h["fvu"]) for h in history)
        print(
            f"{name}: {last['step']} steps, last FVU {last['fvu']:.4f}, clipped {last['clipped_steps']}, finite {finite}"
        )
    return histories


if __name__ == "__main__":
    main()
