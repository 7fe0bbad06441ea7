"""The replacement model's tables and figures for docs/results.md, from what eval.sh wrote per method:
    .venv/bin/python analyses/replacement/report.py [--results docs/results/replacement]
reads RESULTS/METHOD/{replacement,compounding,blocks}.csv, graphs/graphs.csv and time.txt for each METHOD run
so far (mxd, skip, topk), and writes RESULTS/compounding.png (KL against the first n blocks spliced, one line per
method and text), RESULTS/blocks.png (each block alone) and RESULTS/tables.md (the markdown tables, printed too).
A method not yet run is named as such, never filled in.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

METHODS = {"mxd": "MxD (recommended gate)", "skip": "skip transcoder", "topk": "TopK transcoder"}
COLORS = {"mxd": "tab:blue", "skip": "tab:orange", "topk": "tab:green"}
TEXTS = {"held-out": "held out (the mix's eval side)", "ood": "BBC News (never trained on)"}


def read(results: Path) -> dict[str, dict[str, pd.DataFrame]]:
    found = {}
    for method in METHODS:
        folder = results / method
        if not (folder / "replacement.csv").is_file():
            continue
        found[method] = {
            name: pd.read_csv(folder / f"{name}.csv")
            for name in ("replacement", "compounding", "blocks")
            if (folder / f"{name}.csv").is_file()
        }
        if (folder / "graphs" / "graphs.csv").is_file():
            found[method]["graphs"] = pd.read_csv(folder / "graphs" / "graphs.csv")
        if (folder / "time.txt").is_file():
            found[method]["time"] = (folder / "time.txt").read_text()
    return found


def se(value: float, err: float | None) -> str:
    return f"{value:.3f} ± {err:.3f}" if err is not None and err == err else f"{value:.3f}"


def whole_table(found: dict) -> str:
    lines = ["| method | text | tokens | KL, all 30 blocks | ΔCE, all 30 blocks | exact: KL | exact: max abs Δ log p |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for method, parts in found.items():
        for _, r in parts["replacement"].iterrows():
            lines.append(f"| {METHODS[method]} | {TEXTS.get(r['text'], r['text'])} | {int(r['tokens']):,} | "
                         f"{se(r['kl'], r.get('kl_se'))} | {se(r['delta_ce'], r.get('delta_ce_se'))} | "
                         f"{r['exact_kl']:.1e} | {r['exact_max_abs_logprob_diff']:.1e} |")  # fmt: skip
    return "\n".join(lines)


def bends(curve: pd.DataFrame) -> dict[str, object]:
    """Where the curve bends: the n > 1 whose block adds the most KL, and the n at which KL passes half its end."""
    kl = curve.sort_values("n")["kl"].to_numpy()
    steps = [kl[0]] + [kl[i] - kl[i - 1] for i in range(1, len(kl))]
    biggest = (
        max(range(1, len(steps)), key=lambda i: steps[i]) if len(steps) > 1 else 0
    )  # n = 1: block 0 alone
    half = next(i for i in range(len(kl)) if kl[i] >= kl[-1] / 2)
    return {"biggest_step_n": biggest + 1, "biggest_step": steps[biggest], "half_n": half + 1, "end": kl[-1]}


def curve_table(found: dict) -> str:
    lines = ["| method | text | KL at n = 1 | n = 5 | n = 10 | n = 20 | n = 30 | half the end KL at n = | largest step after n = 1: n (ΔKL) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for method, parts in found.items():
        for text, curve in parts["compounding"].groupby("text"):
            kl = curve.set_index("n")["kl"]
            b = bends(curve)
            at = " | ".join(f"{kl[n]:.3f}" if n in kl else "—" for n in (1, 5, 10, 20, 30))
            lines.append(f"| {METHODS[method]} | {TEXTS.get(text, text)} | {at} | {b['half_n']} | "
                         f"{b['biggest_step_n']} ({b['biggest_step']:+.3f}) |")  # fmt: skip
    return "\n".join(lines)


def blocks_table(found: dict) -> str:
    lines = ["| method | text | KL alone: median (worst, block) | FVU: median (worst) | always-on units: median (most) | silent units: median (most) | effective units: median |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for method, parts in found.items():
        for text, t in parts["blocks"].groupby("text"):
            worst = t.loc[t["kl"].idxmax()]
            lines.append(f"| {METHODS[method]} | {TEXTS.get(text, text)} | {t['kl'].median():.3f} ({worst['kl']:.3f}, "
                         f"{int(worst['block'])}) | {t['fvu'].median():.3f} ({t['fvu'].max():.3f}) | "
                         f"{t['always_on'].median():.0f} ({t['always_on'].max():.0f}) | "
                         f"{t['dead_fraction'].median():.3f} ({t['dead_fraction'].max():.3f}) | "
                         f"{t['effective_units'].median():.1f} |")  # fmt: skip
    return "\n".join(lines)


def graphs_table(found: dict) -> str:
    lines = ["| method | graphs | replacement score: median (min–max) | completeness score: median (min–max) | nodes for 80% | features | kept nodes | seconds a graph | largest completeness error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for method, parts in found.items():
        g = parts.get("graphs")
        if g is None:
            lines.append(f"| {METHODS[method]} | not yet run | | | | | | | |")
            continue
        lines.append(f"| {METHODS[method]} | {len(g)} | {g['replacement'].median():.3f} ({g['replacement'].min():.3f}–"
                     f"{g['replacement'].max():.3f}) | {g['completeness'].median():.3f} ({g['completeness'].min():.3f}–"
                     f"{g['completeness'].max():.3f}) | {g['nodes_80'].median():.0f} | {g['features'].median():,.0f} | "
                     f"{g['kept_nodes'].median():.0f} | {g['seconds'].median():.0f} | "
                     f"{g['max_completeness_error'].max():.1e} |")  # fmt: skip
    return "\n".join(lines)


def compounding_plot(found: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method, parts in found.items():
        for text, curve in parts["compounding"].groupby("text"):
            curve = curve.sort_values("n")
            style = "-" if text == "held-out" else "--"
            label = f"{METHODS[method]}, {text}"
            axes[0].plot(
                curve["n"], curve["kl"], style, marker="o", markersize=3, color=COLORS[method], label=label
            )
            axes[1].plot(curve["n"], curve["delta_ce"], style, marker="o", markersize=3, color=COLORS[method])
    axes[0].set_yscale("log")
    axes[0].set_ylabel("KL(clean ‖ spliced), nats/token")
    axes[1].set_ylabel("ΔCE, nats/token")
    for ax in axes:
        ax.set_xlabel("blocks spliced at once (the first n)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "SmolLM2-135M: the replacement model built up block by block (524,288 training tokens a layer)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def blocks_plot(found: dict, path: Path) -> None:
    columns = [("kl", "KL, this block alone", True), ("fvu", "FVU", False), ("always_on", "always-on units", False),
               ("effective_units", "effective units", False)]  # fmt: skip
    fig, axes = plt.subplots(1, len(columns), figsize=(16, 3.8))
    for method, parts in found.items():
        t = parts["blocks"][parts["blocks"]["text"] == "held-out"].sort_values("block")
        for ax, (column, _, _) in zip(axes, columns, strict=True):
            ax.plot(
                t["block"], t[column], marker="o", markersize=3, color=COLORS[method], label=METHODS[method]
            )
    for ax, (_, name, log) in zip(axes, columns, strict=True):
        ax.set_xlabel("block")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("each block's layer spliced alone, held-out text")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("docs/results/replacement"))
    args = parser.parse_args()
    found = read(args.results)
    if not found:
        raise SystemExit(f"nothing in {args.results}: run 'bash analyses/replacement/eval.sh METHOD' first")
    missing = [METHODS[m] for m in METHODS if m not in found]
    compounding_plot(found, args.results / "compounding.png")
    blocks_plot(found, args.results / "blocks.png")
    parts = [
        "### All 30 blocks spliced at once\n\n" + whole_table(found),
        "### The compounding curve (the first n blocks spliced)\n\n" + curve_table(found),
        "### Each block alone\n\n" + blocks_table(found),
        "### Attribution graphs (11 prompts, pruned at node 0.8 / edge 0.98)\n\n" + graphs_table(found),
    ]
    for method, p in found.items():
        if "time" in p:
            parts.append(f"### Time and memory, {METHODS[method]}\n\n```\n{p['time'].strip()}\n```")
    if missing:
        parts.append("Not yet run: " + ", ".join(missing) + ".")
    text = "\n\n".join(parts) + "\n"
    (args.results / "tables.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
