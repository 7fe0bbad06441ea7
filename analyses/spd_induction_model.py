"""Train the toy induction-head model that SPD decomposes (see /work/shared/SPD.md, "The toy
induction-head task"), resuming from OUT's latest checkpoint if there is one.

    python analyses/spd_induction_model.py --threads 1 --out results/spd-induction/model

Writes OUT/model.pt (load_induction_model), OUT/history.json, OUT/checkpoints/ and OUT/curves.png, and
prints the held-out accuracy and the attention of the expected circuit (layer-1 head at the final S
onto M, layer-0 head at M onto the planted S).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mxd_lens.spd.induction import (
    EVAL_SEED_OFFSET,
    InductionTask,
    Plateau,
    accuracy,
    attention_to_memorised_token,
    train_induction_model,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("results/spd-induction/model"), help="output folder")
    parser.add_argument("--steps", type=int, default=20_000, help="most training steps (default 20,000)")
    parser.add_argument("--batch-size", type=int, default=1024, help="sequences per step (default 1024)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=0.995,
        help="stop when held-out accuracy reaches this (default 0.995; may be raised when resuming)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument(
        "--no-plateau",
        action="store_true",
        help="keep the lr fixed (default: x3 once after a 1500-step plateau)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, history = train_induction_model(
        args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        target_accuracy=args.target_accuracy,
        plateau=None if args.no_plateau else Plateau(),
    )
    # A fresh batch, neither the training stream nor the held-out batch used for early stopping.
    batch = InductionTask().sample_batch(
        4096, torch.Generator().manual_seed(args.seed + 2 * EVAL_SEED_OFFSET)
    )
    stats = {
        "steps": history["records"][-1]["step"] if history["records"] else 0,
        "accuracy": accuracy(model, batch.tokens, batch.labels),
        **attention_to_memorised_token(model, batch.tokens, batch.s1),
        "events": history["events"],
    }
    (args.out / "final_stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats, indent=1))
    plot_curves(history, args.out / "curves.png")
    print(f"wrote {args.out}/model.pt, history.json, final_stats.json, curves.png")
    return 0


def plot_curves(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = history["records"]
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], label="train")
    ax_loss.plot(steps, [r["eval_loss"] for r in records], label="held-out")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (final position)", yscale="log")
    ax_acc.plot(steps, [r["acc"] for r in records], label="train")
    ax_acc.plot(steps, [r["eval_acc"] for r in records], label="held-out")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02))
    for event in history["events"]:
        for ax in (ax_loss, ax_acc):
            ax.axvline(event["step"], color="gray", ls="--", lw=0.8)
        label = f"lr -> {event['lr_to']:.0e}" if event["kind"] == "plateau_lr_raised" else event["kind"]
        ax_acc.annotate(label, (event["step"], 0.5), rotation=90, fontsize=8, ha="right")
    ax_loss.legend()
    ax_acc.legend()
    fig.suptitle("toy induction-head model: 2-layer attention-only, d_model 16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
