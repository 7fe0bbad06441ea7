"""Against sparsify (issue 11): EleutherAI's trainer (``eai-sparsify``) and ours, on the same model,
layer, text, token rows, K, width, tokens, batch and learning rate, on this machine, side by side in
one run. Prints tokens/s and held-out FVU.

sparsify is not a dependency of mxd-lens. Install it into the benchmark's environment only, keeping
the CPU torch (its requirements name torch without a version, so pip keeps the installed one):

    pip install eai-sparsify==1.3.3 -c <(echo torch==2.13.0)
    python benchmarks/vs_sparsify.py                    # SmolLM2-135M layer 15, K 32, m 8, 262,144 tokens
    python benchmarks/vs_sparsify.py --tokens 8192 --eval-tokens 2048        # smoke run

Runs, each from the live model (every run pays for its own model forwards, as a user's would):

    sparsify transcoder   sparsify.Trainer, ``--transcode`` on ``layers.L.mlp`` of the transformers model
    ours: transcoder      mxd_lens Trainer on ModelActivations of the TransformerLens model
    ours: MxD             the same, the parameter-matched MxD

Matched: the token rows (the train side of the text's split, BOS + context-1 tokens each; BOS
positions are excluded from training by both), K, width m x d_model, tokens, batch (rows per step),
Adam at the same lr, warmup steps, AuxK coefficient and dead window. Where sparsify differs (its own
choices, kept): no activation normalisation, encoder bias set from the first batch's mean, a linear decay
of the rate to 0 over the run (ours: constant, then to 0.1x over the last 20%), the full model run per
batch (ours stops after block L), its fused TopK encoder. Held-out FVU is computed for all three on
the same MLP inputs and outputs, captured from the transformers model on the eval side of the split.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from mxd_lens import data
from mxd_lens.activations import ModelActivations
from mxd_lens.config import DEFAULT_MODEL
from mxd_lens.layers.learners import LearnerSpec
from mxd_lens.models import hf_folder, load_model
from mxd_lens.training import TrainConfig, Trainer


def token_rows(model, text, split, n_rows, context):
    rows = data.TokenRows.for_model(model, context)
    texts = data.split_texts(data.iter_texts(text), split, 0.02, 0)
    got = list(itertools.islice(rows.rows(texts), n_rows))
    if len(got) < n_rows:
        raise SystemExit(f"{text}'s {split} side holds {len(got)} rows of {context}, fewer than {n_rows}")
    return torch.stack(got)


@torch.inference_mode()
def hf_mlp_io(hf_model, layer, rows, skip):
    """(MLP input, MLP output) of the transformers model at ``layer`` on ``rows``, BOS dropped."""
    got = {}
    mlp = hf_model.model.layers[layer].mlp
    handle = mlp.register_forward_hook(lambda m, args, out: got.update(x=args[0], y=out))
    xs, ys = [], []
    try:
        for i in range(0, len(rows), 8):
            hf_model(rows[i : i + 8])
            xs.append(got["x"][:, skip:].reshape(-1, got["x"].shape[-1]))
            ys.append(got["y"][:, skip:].reshape(-1, got["y"].shape[-1]))
    finally:
        handle.remove()
    return torch.cat(xs).float(), torch.cat(ys).float()


def fvu(predict, x, y) -> float:
    with torch.no_grad():
        sse = sum(
            float((predict(x[i : i + 4096]) - y[i : i + 4096]).pow(2).sum()) for i in range(0, len(x), 4096)
        )
    return sse / float((y - y.mean(0)).pow(2).sum())


def run_sparsify(hf_model, rows, args, warmup, dead_window, bos, folder):
    from datasets import Dataset
    from sparsify import SaeConfig
    from sparsify import TrainConfig as SparsifyConfig
    from sparsify import Trainer as SparsifyTrainer

    dataset = Dataset.from_dict({"input_ids": rows.tolist()}).with_format("torch")
    cfg = SparsifyConfig(
        SaeConfig(expansion_factor=args.m, k=args.k, transcode=True),
        batch_size=args.rows_per_step,
        optimizer="adam",
        lr=args.lr,
        lr_warmup_steps=warmup,
        auxk_alpha=TrainConfig.aux_coefficient,
        dead_feature_threshold=dead_window,
        exclude_tokens=[bos] if bos is not None else [],
        hookpoints=[f"layers.{args.layer}.mlp"],
        log_to_wandb=False,
        save_every=10**9,
        save_dir=str(folder),
        run_name="sparsify",
    )
    trainer = SparsifyTrainer(cfg, dataset, hf_model)
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    sae = trainer.saes[f"layers.{args.layer}.mlp"].eval()
    return (lambda x: sae(x).sae_out), seconds, sum(p.numel() for p in sae.parameters())


def run_ours(arch, model, rows, args, warmup, dead_window, folder):
    stream = ModelActivations(
        model, [args.layer], lambda: iter(rows), args.context, rows_per_shard=args.rows_per_step
    )
    stream.text_info = {"text": args.text, "split": "train", "eval_fraction": 0.02, "split_seed": 0}
    tokens_per_step = args.rows_per_step * (args.context - stream.info.drop_first_position)
    config = TrainConfig(
        total_tokens=len(rows) // args.rows_per_step * tokens_per_step,
        batch_tokens=tokens_per_step,
        lr=args.lr,
        warmup_steps=warmup,
        dead_window_tokens=dead_window,
        checkpoint_every=10**9,
        log_every=max(1, len(rows) // args.rows_per_step // 10),
    )
    spec = LearnerSpec(arch, args.layer, args.k, args.m)
    trainer = Trainer([spec], stream, config, folder, progress=False, data_info=stream.text_info)
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    (layer,) = trainer.trained_layers().values()
    return layer.eval(), seconds, sum(p.numel() for p in layer.parameters())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--text", default=str(data.default_text()))
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=262_144, help="training tokens (rounded to whole rows)")
    parser.add_argument("--context", type=int, default=128, help="tokens per row, BOS included")
    parser.add_argument("--rows-per-step", type=int, default=4)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--eval-tokens", type=int, default=16_384)
    parser.add_argument("--only", nargs="+", choices=["sparsify", "transcoder", "mxd"])
    parser.add_argument("--out", default="results/vs-sparsify")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_folder(args.model), dtype=torch.float32).eval()
    skip = int(model.cfg.default_prepend_bos)
    per_row = args.context - skip
    rows = token_rows(model, args.text, "train", math.ceil(args.tokens / per_row), args.context)
    rows = rows[: len(rows) // args.rows_per_step * args.rows_per_step]
    steps = len(rows) // args.rows_per_step
    warmup, dead_window = (
        max(1, steps // 20),
        TrainConfig(total_tokens=len(rows) * per_row).dead_window_for(len(rows) * per_row),
    )
    held = token_rows(model, args.text, "eval", math.ceil(args.eval_tokens / per_row), args.context)
    x_eval, y_eval = hf_mlp_io(hf_model, args.layer, held, skip)
    bos = model.tokenizer.bos_token_id if skip else None

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "sparsify": lambda: run_sparsify(
                hf_model, rows, args, warmup, dead_window, bos, Path(tmp) / "sparsify"
            ),
            "transcoder": lambda: run_ours(
                "transcoder", model, rows, args, warmup, dead_window, Path(tmp) / "tc"
            ),
            "mxd": lambda: run_ours("mxd", model, rows, args, warmup, dead_window, Path(tmp) / "mxd"),
        }
        labels = {"sparsify": "sparsify transcoder", "transcoder": "ours: transcoder", "mxd": "ours: MxD"}
        for name, run in runs.items():
            if args.only and name not in args.only:
                continue
            print(f"== {labels[name]}", flush=True)
            predict, seconds, params = run()
            results.append(
                {
                    "run": labels[name],
                    "params": params,
                    "train_tokens": len(rows) * per_row,
                    "steps": steps,
                    "seconds": seconds,
                    "tokens_per_s": len(rows) * per_row / seconds,
                    "heldout_fvu": fvu(predict, x_eval, y_eval),
                }
            )
    import pandas as pd

    table = pd.DataFrame(results)
    if "sparsify transcoder" in set(table["run"]):
        ref = table.set_index("run").loc["sparsify transcoder"]
        table["time / sparsify"] = table["seconds"] / ref["seconds"]
    (out / "results.json").write_text(
        json.dumps(
            {"command": " ".join(shlex.quote(a) for a in sys.argv), "args": vars(args), "rows": results},
            indent=1,
        )
    )
    print(
        f"\n{model.cfg.model_name} layer {args.layer}, K {args.k}, m {args.m}, {len(rows) * per_row:,} tokens "
        f"({steps} steps of {args.rows_per_step} rows), lr {args.lr:g}, held-out {len(x_eval):,} tokens, "
        f"torch threads {torch.get_num_threads()}\n"
    )
    print(table.to_markdown(index=False, floatfmt=".4g"))


if __name__ == "__main__":
    main()
