"""Train the toy induction-head model that SPD decomposes (see docs/spd.md, "The toy
induction study"), resuming from OUT's latest checkpoint if there is one. The options are the
fields of ``mxd_lens.spd.induction.InductionTraining``.

    python analyses/spd_induction_model.py --threads 1 --out results/spd-induction/model

Writes OUT/model.pt (load_induction_model), OUT/history.json, OUT/checkpoints/ and OUT/curves.png, and
prints the held-out accuracy and the attention of the expected circuit (layer-1 head at the final S
onto M, layer-0 head at M onto the planted S).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mxd_lens.cli import parse_config
from mxd_lens.spd.induction import (
    EVAL_SEED_OFFSET,
    InductionTask,
    InductionTraining,
    accuracy,
    attention_to_memorised_token,
    plot_training_curves,
)


@dataclass
class Script:
    """Where to write, and how."""

    out: str = "results/spd-induction/model"
    """output folder"""
    threads: int = 1
    """torch CPU threads"""


def main(argv: list[str] | None = None) -> int:
    training, script = parse_config(__doc__, argv, training=InductionTraining, script=Script)
    torch.set_num_threads(script.threads)
    out = Path(script.out)
    model, history = training.train(out)
    # A fresh batch, neither the training stream nor the held-out batch used for early stopping.
    batch = InductionTask().sample_batch(
        4096, torch.Generator().manual_seed(training.seed + 2 * EVAL_SEED_OFFSET)
    )
    stats = {
        "steps": history["records"][-1]["step"] if history["records"] else 0,
        "accuracy": accuracy(model, batch.tokens, batch.labels),
        **attention_to_memorised_token(model, batch.tokens, batch.s1),
        "events": history["events"],
    }
    (out / "final_stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats, indent=1))
    plot_training_curves(history, out / "curves.png")
    print(f"wrote {out}/model.pt, history.json, final_stats.json, curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
