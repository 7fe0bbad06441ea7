"""The demo: on the default model and text, one block's MLP replaced by a parameter-matched MxD (the
recommended gate: plain TopK, standardised) and a TopK transcoder at the same K, trained from one cached stream, compared spliced on
held-out text and on text neither trained on, ranked by KL with ΔCE beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mxd_lens.studies import StudyResult
from mxd_lens.studies.demo import DemoOptions


def run(model: Any, options: DemoOptions, out: Path | None) -> StudyResult:
    """The frontier study at one point, in ``out`` (default results/demo, or results/demo-quick with
    ``--quick``, so a smoke run never meets a real one)."""
    from mxd_lens.analysis.tasks import bundled_data
    from mxd_lens.config import RECOMMENDED_MXD, TrainConfig
    from mxd_lens.data import default_text
    from mxd_lens.studies.frontier import FrontierConfig, budget_words
    from mxd_lens.studies.frontier.run import run_frontier

    quick = options.quick
    out = Path(out) if out is not None else Path("results/demo-quick" if quick else "results/demo")
    ood = options.ood_text or str(bundled_data() / "topic_fortunes_en.jsonl.xz")
    config = FrontierConfig(
        text=options.text or str(default_text()),
        ood_text=None if ood.lower() == "none" else ood,
        blocks=[options.block],
        ks=[options.k],
        width_multiplier=options.width_multiplier,
        # the recommended MxD (config.RECOMMENDED_MXD): L0 = K and no always-on expert, where the paper's
        # gate falls to about a dozen mostly always-on experts (docs/results.md, "Headline")
        archs=[RECOMMENDED_MXD, "transcoder"],
        train_tokens=options.train_tokens or (8_192 if quick else 262_144),
        eval_tokens=options.eval_tokens or (1_024 if quick else 12_800),
        context_size=options.context_size,
        rows_per_shard=33 if quick else 256,
        cache_dtype="float16",  # half the disk of float32; activations need no more precision
        train=TrainConfig(
            epochs=options.epochs, batch_tokens=options.batch_tokens or (256 if quick else 512)
        ),
    )
    rows = run_frontier(model, config, out)
    held = round(rows[0]["train_tokens"] / rows[0]["epochs"])  # the tokens the cache holds
    parts = [
        f"{model.cfg.model_name}, block {options.block}: parameter-matched (m = {rows[0]['width_multiplier']}), "
        f"K = {options.k}, {budget_words(rows[0]['train_tokens'], held, options.epochs, config.train_tokens)}, "
        f"{rows[0]['tokens']:,} held-out tokens",
        demo_table(rows),
        demo_verdict(rows),
    ]
    if quick:
        parts.append("(--quick is a smoke test of the pipeline on few tokens: its numbers are not a result.)")
    freed = _drop_checkpoints(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    parts.append(
        f"plot: {out}/frontier.png   table: {out}/frontier.csv   weights: {Path(rows[0]['weights']).parent}/\n"
        f"{out} holds {size / 2**20:,.0f} MiB (the activation cache, the weights, the tables); the training "
        f"checkpoints ({freed / 2**20:,.0f} MiB) were removed once every layer was trained and evaluated"
    )
    return StudyResult(name="demo", text="\n\n".join(parts), value=rows)


def _drop_checkpoints(out: Path) -> int:
    """Remove the resumable training state of a finished demo (``runs/*/checkpoints``: a rerun reads
    each group's eval.json and final weights, never its checkpoints); the bytes freed."""
    import shutil

    freed = 0
    for folder in out.glob("runs/*/checkpoints"):
        if (folder.parent / "eval.json").is_file() and (folder.parent / "final").is_dir():
            freed += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            shutil.rmtree(folder)
    return freed


def _arch(row: dict[str, Any]) -> str:
    """A frontier row's architecture key with options (``arch``; rows that predate it: ``method``)."""
    return row["arch"] if "arch" in row else row["method"]


def demo_table(rows: list[dict[str, Any]]) -> str:
    """The demo's table as people read it (the columns' formats: mxd_lens.studies.report.COLUMNS)."""
    import pandas as pd

    from mxd_lens.studies.report import columns, render_table

    table = pd.DataFrame(rows).assign(arch=[_arch(r) for r in rows])  # keys, shown by their labels
    shown = columns("arch", "params", "ce_clean", "delta_ce", "kl", "fvu", "l0", "always_on", "dead_fraction", "ood_delta_ce",
                    "ood_kl", dead_fraction="dead")  # fmt: skip
    return render_table(table, shown)


def demo_verdict(rows: list[dict[str, Any]]) -> str:
    """What the numbers say, ranked by KL (how far the spliced model's predictions move from the
    model's own), with ΔCE beside it and a negative ΔCE worded as what it is."""
    from mxd_lens.layers import arch_label

    rows = [{**r, "label": arch_label(_arch(r))} for r in sorted(rows, key=lambda r: r["kl"])]
    zero = rows[0]["ce_zero_ablation"] - rows[0]["ce_clean"]
    kl = "; ".join(f"{r['label']} {r['kl']:.4f}" for r in rows)
    ce = "; ".join(f"{r['label']} {r['delta_ce']:+.4f}" for r in rows)
    text = (
        f"{rows[0]['label']} stays closest to the model: KL(clean ‖ spliced) {kl} nats/token. ΔCE, the "
        f"spliced model's next-token loss minus the clean model's (0: as good as the model's own MLP; "
        f"deleting the MLP gives {zero:+.4f}): {ce}."
    )
    if "ood_kl" in rows[0]:
        ood = sorted(rows, key=lambda r: r["ood_kl"])
        text += (
            f" On text none of them trained on ({ood[0]['ood_tokens']:,} tokens): KL "
            + "; ".join(f"{r['label']} {r['ood_kl']:.4f}" for r in ood)
            + ", ΔCE "
            + "; ".join(f"{r['label']} {r['ood_delta_ce']:+.4f}" for r in ood)
            + (
                f" (deleting the MLP gives {ood[0]['ood_ce_zero_ablation'] - ood[0]['ood_ce_clean']:+.4f} there)"
                if "ood_ce_zero_ablation" in ood[0]
                else ""
            )
            + "."
        )
    negative = [r["label"] for r in rows if r["delta_ce"] < 0]
    if negative:
        text += (
            f" A negative ΔCE ({', '.join(negative)}) is not a better model: the spliced model predicts this "
            "held-out text better than the model itself because the layer was fitted to text like it; KL "
            "counts that as a change."
        )
    return text
