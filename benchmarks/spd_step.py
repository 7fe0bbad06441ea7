"""SPD step speed (issue 28 item 1): s/step of the SPD training step without and with its exact speed-ups.

    python benchmarks/spd_step.py                  # H 16 and H 128, 5 timed steps each (a few minutes)
    python benchmarks/spd_step.py --smoke          # a few seconds: tiny batch, one timed step
    python benchmarks/spd_step.py --mallopt        # also: both steps in child processes without and with keep_freed_memory()
    python benchmarks/spd_step.py --each           # also: each speed-up alone

The setup is the toy induction study's ``ref-token-subset`` variant (reference recipe: C = 100, token CI,
stochastic + layerwise + subset + CI-masked reconstruction, 11 runs fused into one forward), batch 16 x
64 tokens, on a randomly initialised induction model of the reference shape (2 attention-only layers,
d_model 16; the 8 Q/K/V/O projections decomposed). No training is needed: speed does not depend on
the weights, and both steps see the same ones.

In ONE process two trainers start from identical parameters: "old" with every speed-up off
(``ci_chunked``, ``ci_distinct_rows``, ``routed_rows_only`` False: the implementation before them) and
"new" with them on. Each round both take a step on the same batch, in alternating order (so drift in
the machine's speed hits both), and the table shows the median s/step over the timed rounds. The loss
terms of the two are compared every step (they may drift apart by rounding only).

``--mallopt``: glibc's allocator settings are process-global, so the new step is timed in two child
processes, without and with ``mxd_lens.allocator.keep_freed_memory()``, one after the other.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # time this checkout's mxd_lens, not an installed one

FLAGS = ("ci_chunked", "ci_distinct_rows", "routed_rows_only")
TERMS = (
    "faithfulness",
    "stochastic_recon",
    "layerwise_recon",
    "subset_recon",
    "ci_masked_recon",
    "minimality",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, nargs="+", help="CI hidden widths H (default 16 128; --smoke: 16)")
    p.add_argument("--C", type=int, default=100, help="components per module (default 100)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--steps", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--smoke", action="store_true", help="a few seconds: batch 2, H 16, 1 round")
    p.add_argument(
        "--mallopt", action="store_true", help="also time the new step with and without keep_freed_memory()"
    )
    p.add_argument("--each", action="store_true", help="also time each speed-up alone (in-process table)")
    p.add_argument(
        "--rounds", type=int, default=3, help="--mallopt: pairs of child processes, alternating (default 3)"
    )
    p.add_argument("--child", choices=("plain", "mallopt"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.steps, args.warmup = 2, 1, 1
    args.hidden = args.hidden or ([16] if args.smoke else [16, 128])
    for name in ("C", "batch", "seq_len", "steps", "threads", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0 or any(h <= 0 for h in args.hidden):
        p.error("--warmup must be >= 0 and every --hidden positive")
    return args


def build(args: argparse.Namespace, hidden: int, out: Path, fast: bool):
    """A trainer of the ref-token-subset recipe at CI width ``hidden`` on a fresh induction model (seed
    0: every call builds the same model and the same decomposition), with the speed-ups on or off."""
    from mxd_lens.spd.induction import InductionTask, induction_model
    from mxd_lens.spd.sites import decomposable_weights
    from mxd_lens.spd.train import SPDTrainer
    from mxd_lens.studies.spd_induction.run import batches_for, make_config

    task = InductionTask(seq_len=args.seq_len)
    model = induction_model(0, task)
    config = make_config("ref-token-subset", 1000, args.batch, C=args.C, ci_hidden=hidden)
    for flag in FLAGS:
        setattr(config, flag, fast)
    modules = [name for name in decomposable_weights(model) if ".attn." in name]
    trainer = SPDTrainer(model, modules, batches_for(task, args.batch), config, out, progress=False)
    model.requires_grad_(False)  # as fit() does
    return trainer


def compare(args: argparse.Namespace, hidden: int) -> dict:
    """Old and new step, interleaved on the same batches: median s/step and the terms' relative diffs."""
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {"old": build(args, hidden, Path(tmp) / "old", False)}
        trainers["new"] = build(args, hidden, Path(tmp) / "new", True)
        for flag in FLAGS if args.each else ():  # one speed-up alone
            trainers[flag] = build(args, hidden, Path(tmp) / flag, False)
            setattr(trainers[flag].decomposition, flag, True)
        batches = trainers["old"].batches
        times: dict[str, list[float]] = {key: [] for key in trainers}
        faults: dict[str, list[int]] = {key: [] for key in trainers}
        first, worst = {}, {term: 0.0 for term in TERMS}
        for step in range(args.warmup + args.steps):
            tokens = batches(step)
            keys = list(trainers)
            order = keys[step % len(keys) :] + keys[: step % len(keys)]  # rotated every step
            metrics = {}
            for key in order:
                faults0, t0 = _minor_faults(), time.perf_counter()
                metrics[key] = trainers[key].train_step(tokens)
                elapsed, faulted = time.perf_counter() - t0, _minor_faults() - faults0
                trainers[key].step += 1
                if step >= args.warmup:
                    times[key].append(elapsed)
                    faults[key].append(faulted)
            for term in TERMS:
                old, new = metrics["old"][term], metrics["new"][term]
                diff = abs(new - old) / max(abs(old), 1e-30)
                worst[term] = max(worst[term], diff)
                first.setdefault(term, diff)
    median = {key: statistics.median(v) for key, v in times.items()}
    return {
        "hidden": hidden,
        "median_s": median,
        "ratio": median["old"] / median["new"],
        "faults_per_step": {key: statistics.median(v) for key, v in faults.items()},
        "rel_diff_first": first,  # the first step: both from the same parameters
        "rel_diff": worst,  # over all steps: with the parameters apart by the rounding of earlier steps
    }


def _minor_faults() -> int:
    """Minor page faults of this process so far: each is a page the kernel handed out (and zeroed)
    for memory the allocator took from it, e.g. a freshly mmapped big tensor."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(args: argparse.Namespace) -> None:
    """One --mallopt child: ``compare`` per H (old and new, interleaved), as one JSON line."""
    if args.child == "mallopt":
        from mxd_lens.allocator import keep_freed_memory

        if not keep_freed_memory():
            print(json.dumps({"error": "keep_freed_memory() did not apply (not glibc?)"}))
            return
    torch.set_num_threads(args.threads)
    print(json.dumps([compare(args, hidden) for hidden in args.hidden]))


def mallopt_comparison(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, list[dict]]:
    """``compare`` in a child process without, then with, keep_freed_memory(): {setting: results}."""
    passed = [a for a in argv if a != "--mallopt"]
    runs: dict[str, list[list[dict]]] = {"plain": [], "mallopt": []}
    for _ in range(args.rounds):  # alternating, so that drift in the machine's speed hits both
        for setting in runs:
            run = subprocess.run(
                [sys.executable, __file__, *passed, "--child", setting],
                capture_output=True,
                text=True,
                check=True,
            )
            line = json.loads(run.stdout.strip().splitlines()[-1])
            if isinstance(line, dict):
                raise RuntimeError(line["error"])
            runs[setting].append(line)
    results: dict[str, list[dict]] = {}
    for setting, rounds in runs.items():  # per H: the round with the median new s/step
        results[setting] = [
            sorted(per_h, key=lambda res: res["median_s"]["new"])[len(per_h) // 2]
            for per_h in zip(*rounds, strict=True)
        ]
    return results


def _row(label: str, res: dict) -> str:
    diffs = ", ".join(
        f"{term} {res['rel_diff_first'][term]:.0e} / {value:.0e}" for term, value in res["rel_diff"].items()
    )
    s, faults = res["median_s"], res["faults_per_step"]
    return (
        f"| {label} | {s['old']:.3f} | {s['new']:.3f} | {res['ratio']:.2f} | "
        f"{faults['old']:,.0f} / {faults['new']:,.0f} | {diffs} |"
    )


HEADER = (
    "| {what} | old s/step | new s/step | old / new | page faults per step (old / new) | "
    "loss terms' rel. diff: first step / max over steps |\n|---|---:|---:|---:|---:|---|"
)


def run(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), python {platform.python_version()}, "
        f"{platform.machine()}, fp32 on CPU; ref-token-subset, C = {args.C}, batch {args.batch} x "
        f"{args.seq_len} tokens, 8 modules; median of {args.steps} interleaved step(s) after {args.warmup}"
    )
    print()
    print(HEADER.format(what="CI hidden H"))
    results = []
    for hidden in args.hidden:
        results.append(compare(args, hidden))
        print(_row(f"H {hidden}", results[-1]))
        sys.stdout.flush()
    if args.each:
        print()
        print("| H | " + " | ".join(f"`{flag}` alone: old / it" for flag in FLAGS) + " | all: old / new |")
        print("|---:|" + "---:|" * (len(FLAGS) + 1))
        for res in results:
            s = res["median_s"]
            alone = " | ".join(f"{s['old'] / s[flag]:.2f}" for flag in FLAGS)
            print(f"| {res['hidden']} | {alone} | {res['ratio']:.2f} |")
    out: dict = {"args": vars(args), "results": results}
    if args.mallopt:
        out["mallopt"] = mallopt_comparison(args, argv)
        print()
        print(
            f"Each in a child process of its own, default glibc allocator and keep_freed_memory() alternating, "
            f"{args.rounds} of each; per H the child with the median new s/step."
        )
        print()
        print(HEADER.format(what="H, allocator"))
        for plain, kept in zip(out["mallopt"]["plain"], out["mallopt"]["mallopt"], strict=True):
            print(_row(f"H {plain['hidden']}, default", plain))
            print(_row(f"H {kept['hidden']}, keep_freed_memory()", kept))
        print()
        print("| H | old: default / kept | new: default / kept |\n|---:|---:|---:|")
        for plain, kept in zip(out["mallopt"]["plain"], out["mallopt"]["mallopt"], strict=True):
            a, b = plain["median_s"], kept["median_s"]
            print(f"| {plain['hidden']} | {a['old'] / b['old']:.2f} | {a['new'] / b['new']:.2f} |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
