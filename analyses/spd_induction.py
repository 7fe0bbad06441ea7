"""SPD of the toy induction model's 8 attention projections (Q, K, V, O x 2 layers), four variants:
CI function {token, sequence} x {stochastic + subset reconstruction, stochastic only}.

    python analyses/spd_induction.py time  --variant sequence-subset --steps 40
    python analyses/spd_induction.py train --variant token-subset --steps 8000   # resumes from checkpoints
    python analyses/spd_induction.py report --variant token-subset
    python analyses/spd_induction.py summary                                       # all variants found
    python analyses/spd_induction.py train --variant sequence-subset --minimality 0.1   # supplementary:
        # writes OUT/sequence-subset-min0.1/ (any --minimality other than 1e-2 gets such a suffix)

Variants (``--variant``): token-subset, token-stoch, sequence-subset, sequence-stoch. Settings (fixed
per variant, recorded in OUT/VARIANT/run_config.json, refused on resume if changed): C = 32, batch 16,
AdamW lr 1e-3 constant, faithfulness 1e5 with the delta component, stochastic recon 1, subset recon 1
(or 0), minimality 1e-2 with p linear 2 -> 0.3, continuous masks, KL at the last position only (the
model is trained only there). Training batches: fresh InductionTask sequences, step s drawn from a
generator seeded with 10_000 + s; the evaluation batch (512 sequences) from seed 7_777_777.

Writes OUT/VARIANT/{checkpoints/, metrics.json, run_config.json, train_log.jsonl, report.json,
ci_by_position.png} and OUT/summary.json, OUT/comparison.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from mxd_lens.spd import SPDConfig, SPDTrainer, decomposable_weights
from mxd_lens.spd.induction import InductionTask, load_induction_model
from mxd_lens.spd.report import comparison_table, module_table, plot_ci_by_position, study_report

VARIANTS = {
    "token-subset": dict(ci="token", subset_recon=1.0),
    "token-stoch": dict(ci="token", subset_recon=0.0),
    "sequence-subset": dict(ci="sequence", subset_recon=1.0),
    "sequence-stoch": dict(ci="sequence", subset_recon=0.0),
}
TITLES = {
    "token-subset": "token CI (vector MLP), stochastic + subset reconstruction",
    "token-stoch": "token CI (vector MLP), stochastic reconstruction only",
    "sequence-subset": "sequence CI (causal attention), stochastic + subset reconstruction",
    "sequence-stoch": "sequence CI (causal attention), stochastic reconstruction only",
}
DATA_SEED = 10_000
EVAL_SEED = 7_777_777
EVAL_SIZE = 512


def choose_model(root: Path) -> Path:
    """model-long/model.pt when that run has finished past step 800 (the first model's end; its
    final_stats.json is written after model.pt), else model/model.pt."""
    long = root / "model-long"
    try:
        steps = json.loads((long / "final_stats.json").read_text())["steps"]
    except (OSError, ValueError, KeyError):
        steps = 0
    if (long / "model.pt").is_file() and steps > 800:
        return long / "model.pt"
    return root / "model" / "model.pt"


DEFAULT_MINIMALITY = 1e-2


def run_name(variant: str, minimality: float) -> str:
    return variant if minimality == DEFAULT_MINIMALITY else f"{variant}-min{minimality:g}"


def make_config(
    variant: str, steps: int, batch_size: int, minimality: float = DEFAULT_MINIMALITY
) -> SPDConfig:
    return SPDConfig(
        C=32,
        steps=steps,
        batch_size=batch_size,
        lr=1e-3,
        lr_schedule="constant",
        mask_type="continuous",
        delta=True,
        faithfulness=1e5,
        stochastic_recon=1.0,
        layerwise_recon=0.0,
        ci_masked_recon=0.0,
        minimality=minimality,
        p_start=2.0,
        p_end=0.3,
        positions="last",
        ci_hidden=16,
        seed=0,
        log_every=10,
        checkpoint_every=250,
        keep_checkpoints=2,
        **VARIANTS[variant],
    )


def batches_for(task: InductionTask, batch_size: int):
    def batches(step: int) -> torch.Tensor:
        return task.sample_batch(batch_size, torch.Generator().manual_seed(DATA_SEED + step)).tokens

    return batches


def build_trainer(out: Path, model_path: Path, config: SPDConfig, progress: bool = False):
    model = load_induction_model(model_path)
    modules = [name for name in decomposable_weights(model) if ".attn." in name]
    trainer = SPDTrainer(
        model, modules, batches_for(InductionTask(), config.batch_size), config, out, progress
    )
    return model, trainer


def cmd_train(args: argparse.Namespace) -> int:
    out = args.out / run_name(args.variant, args.minimality)
    run_config = out / "run_config.json"
    if run_config.is_file():
        saved = json.loads(run_config.read_text())
        model_path = Path(saved["model"])
        if args.model and Path(args.model) != model_path:
            raise SystemExit(f"{out} was trained on {model_path}; refusing {args.model}")
    else:
        model_path = Path(args.model) if args.model else choose_model(args.out)
    config = make_config(args.variant, args.steps, args.batch_size, args.minimality)
    out.mkdir(parents=True, exist_ok=True)
    run_config.write_text(
        json.dumps({"variant": args.variant, "model": str(model_path), "config": asdict(config)}, indent=1)
    )
    _, trainer = build_trainer(out, model_path, config)
    trainer.load_checkpoint()
    start_step, started, cpu_started = trainer.step, time.perf_counter(), time.process_time()
    base = trainer.batches
    log = (out / "train_log.jsonl").open("a")

    def logged(step: int) -> torch.Tensor:
        if step > start_step and step % args.print_every == 0 and trainer.history:
            rate = (time.perf_counter() - started) / (step - start_step)
            last = trainer.history[-1]
            keys = ("loss", "faithfulness", "stochastic_recon", "subset_recon", "minimality", "ci_l0", "p")
            print(
                f"step {step} {rate:.3f} s/step eta {(config.steps - step) * rate / 60:.1f} min "
                + " ".join(f"{k} {last[k]:.3g}" for k in keys if k in last),
                flush=True,
            )
        return base(step)

    trainer.batches = logged
    print(f"{out.name}: model {model_path}, from step {start_step} to {config.steps}", flush=True)
    trainer.fit()
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    record = {
        "from_step": start_step,
        "to_step": trainer.step,
        "wall_s": wall,
        "cpu_s": cpu,
        "ended": time.ctime(),
    }
    log.write(json.dumps(record) + "\n")
    log.close()
    print(json.dumps(record), flush=True)
    return 0


def cmd_time(args: argparse.Namespace) -> int:
    """s/step over ``--steps`` steps after 5 warm-up steps, in a scratch folder (nothing kept)."""
    import tempfile

    config = make_config(args.variant, args.steps + 5, args.batch_size, args.minimality)
    config.checkpoint_every = 0
    with tempfile.TemporaryDirectory() as tmp:
        _, trainer = build_trainer(
            Path(tmp), Path(args.model) if args.model else choose_model(args.out), config
        )
        batches = trainer.batches
        for step in range(5):
            trainer.train_step(batches(step))
        started = time.perf_counter()
        for step in range(5, config.steps):
            trainer.train_step(batches(step))
        rate = (time.perf_counter() - started) / args.steps
    print(json.dumps({"variant": args.variant, "batch_size": args.batch_size, "s_per_step": rate}))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    name = run_name(args.variant, args.minimality)
    out = args.out / name
    saved = json.loads((out / "run_config.json").read_text())
    config = SPDConfig(**saved["config"])
    model, trainer = build_trainer(out, Path(saved["model"]), config)
    trainer.load_checkpoint()
    if trainer.step == 0:
        raise SystemExit(f"{out} has no checkpoint yet")
    batch = InductionTask().sample_batch(EVAL_SIZE, torch.Generator().manual_seed(EVAL_SEED))
    started = time.perf_counter()
    report = study_report(trainer.decomposition, batch, threshold=0.1, positions=config.positions, seed=1)
    log = out / "train_log.jsonl"
    runs = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    report["training"] = {
        "variant": name,
        "model": saved["model"],
        "steps": trainer.step,
        "batch_size": config.batch_size,
        "wall_s": sum(r["wall_s"] for r in runs),
        "cpu_s": sum(r["cpu_s"] for r in runs) if all("cpu_s" in r for r in runs) else None,
        "runs": runs,
        "final_metrics": trainer.history[-1] if trainer.history else {},
        "config": saved["config"],
    }
    report["report_s"] = time.perf_counter() - started
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_ci_by_position(
        report,
        out / "ci_by_position.png",
        title=f"{name}: {TITLES[args.variant]}, minimality {config.minimality:g} (step {trainer.step})",
    )
    print(json.dumps({k: v for k, v in report.items() if k not in ("modules", "training")}, indent=1))
    print(f"wrote {out}/report.json, {out}/ci_by_position.png")
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    reports = {}
    extra = sorted(p.parent.name for p in args.out.glob("*-min*/report.json"))
    for variant in [*VARIANTS, *extra]:
        path = args.out / variant / "report.json"
        if path.is_file():
            reports[variant] = json.loads(path.read_text())
    if not reports:
        raise SystemExit(f"no report.json under {args.out}/<variant>/; run `report` first")
    summary = {}
    for variant, rep in reports.items():
        summary[variant] = {
            "training": {k: rep["training"][k] for k in ("model", "steps", "batch_size", "wall_s", "cpu_s")},
            "faithfulness": rep["losses"]["faithfulness"],
            "kl_stochastic": rep["losses"]["kl_stochastic"],
            "kl_ci_masked": rep["losses"]["kl_ci_masked"],
            "accuracy_clean": rep["accuracy_clean"],
            "accuracy_ci_masked": rep["accuracy_ci_masked"],
            "accuracy_ci_masked_no_delta": rep["accuracy_ci_masked_no_delta"],
            "accuracy_ci_binary": rep["accuracy_ci_binary"],
            "per_module_accuracy_ci_masked": {
                rep["modules"][n]["short"]: v["accuracy"] for n, v in rep["per_module_ci_masked"].items()
            },
            "modules": {
                m["short"]: {
                    "n_alive": m["n_alive"],
                    "l0": dict(zip(rep["position_classes"], m["l0"], strict=True)),
                }
                for m in rep["modules"].values()
            },
            "expected": {rep["modules"][n]["short"]: e for n, e in rep["expected"].items()},
        }
    table = comparison_table(reports)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "comparison.md").write_text(table + "\n")
    sections = [f"### {variant}\n\n{module_table(rep)}\n" for variant, rep in reports.items()]
    (args.out / "modules.md").write_text("\n".join(sections))
    print(table)
    print(f"wrote {args.out}/summary.json, {args.out}/comparison.md, {args.out}/modules.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=("time", "train", "report", "summary"))
    parser.add_argument("--variant", choices=tuple(VARIANTS), default="sequence-subset")
    parser.add_argument("--out", type=Path, default=Path("results/spd-induction"), help="results root")
    parser.add_argument(
        "--model", default=None, help="model.pt (default: model-long if trained further, else model)"
    )
    parser.add_argument("--steps", type=int, default=6000, help="total SPD steps (sets the p schedule)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--minimality", type=float, default=DEFAULT_MINIMALITY, help="minimality coefficient (default 1e-2)"
    )
    parser.add_argument("--print-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return {"time": cmd_time, "train": cmd_train, "report": cmd_report, "summary": cmd_summary}[args.command](
        args
    )


if __name__ == "__main__":
    sys.exit(main())
