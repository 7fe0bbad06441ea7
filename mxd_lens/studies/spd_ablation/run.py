"""SPD component ablation on a real model (the offline default, SmolLM2-135M-Instruct): decompose one
late weight matrix, find the component most specific to a concept, ablate it, and compare the damage
on held-out concept text (target) with the damage elsewhere (collateral) and with norm-matched random
components. ``run_real_model_study(model, SPDAblationOptions(...), out)``; mxd-lens spd-ablation is its
command line.

Steps (each cached under OUT, so a killed run resumes):

1. Rows of ``context_size`` tokens (BOS + the rest) from the train side of the corpus and of the
   labelled sets (language, code language, BBC topic), mixed; the residual stream at the input of
   block ``block`` is cached once, and SPD (``SPDTrainer`` on ``ResidualModel``) trains from it.
2. Concept scoring (``concept_scores``) on TRAIN-side labelled texts only: French vs the other
   languages of language_id, Python vs the other code languages, sport vs the other BBC topics. The
   concept kept is the one whose best component has the highest score (mean CI on the concept minus
   mean CI on its controls); no evaluation text takes part in the choice.
3. Ablation (``ablation_effect``) on EVAL-side texts: the concept's texts (target), the other labels of
   the same file and held-out corpus text (collateral), the top-1 and top-3 components, and
   norm-matched random components as the baseline. All concepts are evaluated; the chosen one is the
   result, the others are context.
4. The chosen concept's top-1 component's effect split by its own CI (on / off).

Each step writes its result as it goes (OUT/spd/: checkpoints, metrics.json; OUT/decomposition.json with
the options and the command, OUT/scores.json, OUT/ablation.json, OUT/by_ci.json); the study's result
(:func:`ablation_result`) adds the tables ``ablation_effects.csv`` (one row per concept, top-k and text
set) and ``by_ci.csv`` and the figure ``ablation.png``. What the numbers mean is for the reader (the
write-up of the run on SmolLM2: docs/results/spd-svd-control.md), not printed here.
"""

from __future__ import annotations

import json
import logging
import lzma
import random
import time
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from mxd_lens.data import TokenRows, iter_texts, split_texts
from mxd_lens.fileio import atomic_write_text
from mxd_lens.spd.ablation import (
    ResidualModel,
    ablation_effect,
    component_importance,
    component_norms,
    concept_scores,
)
from mxd_lens.spd.train import SPDConfig, SPDTrainer
from mxd_lens.studies import StudyResult
from mxd_lens.studies.spd_ablation import CONCEPTS, SPDAblationOptions

log = logging.getLogger(__name__)

CORPUS = [
    "jane_austen_novels",
    "bible_web",
    "matthew_henry_concise_commentary",
    "spurgeon_treasury_of_david",
    "debian_package_descriptions",
    "fortunes_en",
    "gcide_webster1913_dictionary",
]
LABELLED_EVAL_FRACTION = 0.25  # labelled texts: hash < 0.25 is eval, the rest train (split_texts)


# -- text --------------------------------------------------------------------------------------------------
def labelled(data: str | Path, name: str) -> list[tuple[str, str]]:
    with lzma.open(Path(data) / "probing" / f"{name}.jsonl.xz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(row["text"], row["label"]) for row in rows if row.get("text")]


def labelled_side(rows: list[tuple[str, str]], side: str) -> list[tuple[str, str]]:
    texts = [text for text, _ in rows]
    keep = set(split_texts(texts, side, eval_fraction=LABELLED_EVAL_FRACTION))
    return [(text, label) for text, label in rows if text in keep]


def packed(rows: TokenRows, texts: list[str], n: int, seed: int) -> torch.Tensor:
    """n rows packed from ``texts`` in a seeded random order (documents joined by <|endoftext|>)."""
    texts = list(texts)
    random.Random(seed).shuffle(texts)
    out = list(islice(rows.rows(texts), n))
    if len(out) < n:
        raise ValueError(f"only {len(out)} rows of text, {n} wanted")
    return torch.stack(out)


def corpus_rows(rows: TokenRows, data: str | Path, side: str, per_file: int) -> torch.Tensor:
    parts = []
    for name in CORPUS:
        texts = split_texts(iter_texts(Path(data) / "corpus" / f"{name}.txt.xz"), side)
        parts.append(torch.stack(list(islice(rows.rows(texts), per_file))))
    return torch.cat(parts)


# -- cached residuals --------------------------------------------------------------------------------------
def residuals(start: ResidualModel, tokens: torch.Tensor, path: Path, batch: int = 8) -> torch.Tensor:
    """The residual stream at ``start``'s block for ``tokens``, cached at ``path`` (reused only for the
    same tokens); the cache also keeps the wall seconds it took (``cache_seconds``)."""
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        if torch.equal(cached["tokens"], tokens):
            return cached["resid"]
    t0 = time.time()
    resid = torch.cat([start.residual(tokens[i : i + batch]) for i in range(0, len(tokens), batch)])
    seconds = time.time() - t0
    log.info("cached residuals of %s tokens in %.0fs -> %s", tuple(tokens.shape), seconds, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"tokens": tokens, "resid": resid, "seconds": torch.tensor(seconds)}, path)
    return resid


def cache_seconds(path: Path) -> float:
    """The wall seconds the residual cache at ``path`` took to compute (NaN if it did not record them)."""
    return float(torch.load(path, weights_only=True).get("seconds", float("nan")))


def pairs(resid: torch.Tensor, tokens: torch.Tensor, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(resid[i : i + batch], tokens[i : i + batch]) for i in range(0, len(tokens), batch)]


def run_real_model_study(
    model: Any, study: SPDAblationOptions, out: str | Path, command: str | None = None
) -> dict[str, Any]:
    """The whole study's steps (see the module docstring); each step's result is kept under ``out`` and
    reused unless ``study.redo``. Returns {"decomposition", "scores", "ablation", "by_ci"} as written
    (only "decomposition" with ``study.train_only``); :func:`ablation_result` makes them the study's
    tables and figure."""
    out = Path(out)
    cache = Path(study.cache) if study.cache else out / "cache"
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    start = ResidualModel(model, study.block)
    name = f"blocks.{study.block}.{study.weight}"
    start.check_modules([name])
    rows = TokenRows.for_model(model, study.context_size)
    sets = {key: labelled(study.data, CONCEPTS[key][0]) for key in CONCEPTS}

    # 1. decomposition --------------------------------------------------------------------------------
    n_corpus = study.train_rows // 2 // len(CORPUS)
    mixture = [corpus_rows(rows, study.data, "train", n_corpus)]
    rest = study.train_rows - len(mixture[0])
    for i, key in enumerate(CONCEPTS):
        texts = [text for text, _ in labelled_side(sets[key], "train")]
        mixture.append(
            packed(rows, texts, rest // len(CONCEPTS) + (i < rest % len(CONCEPTS)), study.seed + i)
        )
    train_tokens = torch.cat(mixture)
    train_tokens = train_tokens[
        torch.randperm(len(train_tokens), generator=torch.Generator().manual_seed(study.seed))
    ]
    train_resid = residuals(start, train_tokens, cache / "train.pt")

    def batches(step: int) -> torch.Tensor:
        per_epoch = len(train_resid) // study.batch_size
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(
            len(train_resid), generator=torch.Generator().manual_seed(study.seed + 1000 + epoch)
        )
        return train_resid[order[i * study.batch_size : (i + 1) * study.batch_size]]

    config = SPDConfig(
        C=study.C,
        steps=study.steps,
        batch_size=study.batch_size,
        lr=study.lr,
        lr_schedule="cosine",
        warmup_steps=min(20, study.steps // 10),
        ci=study.ci,
        ci_hidden=study.ci_hidden,
        faithfulness=study.faithfulness,
        stochastic_recon=1.0,
        subset_recon=0.0,  # one module: subset reconstruction is the stochastic one
        minimality=study.minimality,
        p_start=2.0,
        p_end=study.p_end,
        seed=study.seed,
        log_every=10,
        checkpoint_every=25,
    )
    trainer = SPDTrainer(start, [name], batches, config, out / "spd")
    if study.init == "svd" and trainer.latest_checkpoint() is None:
        trainer.decomposition.init_from_svd()
    # training time, summed over resumed runs (a killed run's last partial stretch is not counted)
    timer = out / "spd" / "train_time.json"
    spent = json.loads(timer.read_text()) if timer.is_file() else {"wall_s": 0.0, "cpu_s": 0.0}
    t0, c0, step0 = time.time(), time.process_time(), trainer.step
    metrics = trainer.fit()
    if trainer.step > step0:
        spent = {
            "wall_s": spent["wall_s"] + time.time() - t0,
            "cpu_s": spent["cpu_s"] + time.process_time() - c0,
        }
        atomic_write_text(timer, json.dumps(spent))
    log.info("SPD: %d steps, last metrics %s", trainer.step, {k: round(v, 5) for k, v in metrics.items()})
    decomp = trainer.decomposition

    held_corpus = corpus_rows(rows, study.data, "eval", max(1, study.eval_rows // len(CORPUS)))
    held_resid = residuals(start, held_corpus, cache / "eval_corpus.pt")
    report = {"steps": trainer.step, "train_wall_s": spent["wall_s"], "train_cpu_s": spent["cpu_s"]}
    report["last_metrics"] = metrics
    evals = [trainer.evaluate(held_resid[i : i + 8]) for i in range(0, min(len(held_resid), 16), 8)]
    report["heldout_corpus"] = {
        key: (sum(e[key] for e in evals) / len(evals) if not isinstance(evals[0][key], dict)
              else {n: sum(e[key][n] for e in evals) / len(evals) for n in evals[0][key]})
        for key in evals[0]
    }  # fmt: skip
    report["config"] = {**asdict(study), "layer": study.block}
    alignment = svd_alignment(decomp, name)
    report["svd_alignment"] = {
        "note": "|cos| between component c and the c-th singular direction of W (the SVD init)",
        "median_v": float(alignment[0].median()),
        "median_u": float(alignment[1].median()),
    }
    report["cache_train_s"] = cache_seconds(cache / "train.pt")
    report["command"] = command
    atomic_write_text(out / "decomposition.json", json.dumps(report, indent=1))
    log.info("held-out corpus: %s", json.dumps(report["heldout_corpus"]))
    if study.train_only:
        return {"decomposition": report}

    if (out / "ablation.json").is_file() and (out / "scores.json").is_file() and not study.redo:
        log.info("reusing %s/scores.json and ablation.json (redo recomputes them)", out)
        score_report = json.loads((out / "scores.json").read_text())
        final = json.loads((out / "ablation.json").read_text())
    else:
        score_report, final = score_and_ablate(
            study, out, model, start, decomp, name, rows, sets, cache, command
        )

    # 4. the chosen concept's top-1 component, split by its own CI ---------------------------------------
    by_ci_path = out / "by_ci.json"
    if by_ci_path.is_file() and not study.redo:
        by_ci = json.loads(by_ci_path.read_text())
    else:
        t0 = time.time()
        by_ci = effect_by_ci(study, model, start, decomp, name, rows, sets, cache, final)
        by_ci["wall_s"] = time.time() - t0
        atomic_write_text(by_ci_path, json.dumps(by_ci, indent=1))
    return {"decomposition": report, "scores": score_report, "ablation": final, "by_ci": by_ci}


def score_and_ablate(study, out, model, start, decomp, name, rows, sets, cache, command) -> tuple[dict, dict]:
    clock = {}
    held_corpus = corpus_rows(rows, study.data, "eval", max(1, study.eval_rows // len(CORPUS)))
    held_resid = residuals(start, held_corpus, cache / "eval_corpus.pt")

    # 2. concept scoring on train-side texts ----------------------------------------------------------
    t0 = time.time()
    scores, selection, score_data = {}, {}, {}
    for key in study.concepts:
        file, label = CONCEPTS[key]
        train = labelled_side(sets[key], "train")
        concept = packed(rows, [t for t, lab in train if lab == label], study.score_rows, study.seed + 10)
        control = packed(rows, [t for t, lab in train if lab != label], study.score_rows, study.seed + 11)
        concept_pairs = pairs(residuals(start, concept, cache / f"score_{key}_concept.pt"), concept, 8)
        control_pairs = pairs(residuals(start, control, cache / f"score_{key}_control.pt"), control, 8)
        by_ci = concept_scores(decomp, start, concept_pairs, control_pairs, method="ci")[name]
        by_act = concept_scores(decomp, start, concept_pairs, control_pairs, method="activation")[name]
        scores[key] = {"ci": by_ci.to_dict(10), "activation": by_act.to_dict(10)}
        selection[key] = float(by_ci.score[by_ci.top(1)[0]])
        score_data[key] = (by_ci, concept_pairs, control_pairs)
        log.info(f"{key}: top CI components {by_ci.to_dict(5)['top']}; top by activation {by_act.top(5)}")
    chosen = max(selection, key=selection.get)
    # the token types on which the chosen component's CI is highest (train-side concept and control
    # texts, types seen at least 3 times), by mean CI
    by_ci, concept_pairs, control_pairs = score_data[chosen]
    top = by_ci.top(1)[0]
    g_all, tok_all = [], []
    for resid, tokens in concept_pairs + control_pairs:
        g_all.append(component_importance(decomp, start, resid)[name][:, 1:, top].flatten())
        tok_all.append(tokens[:, 1:].flatten())
    g_all, tok_all = torch.cat(g_all), torch.cat(tok_all)
    types, inverse, counts = torch.unique(tok_all, return_inverse=True, return_counts=True)
    mean_g = torch.zeros(len(types), dtype=torch.float64).index_add_(0, inverse, g_all.double()) / counts
    mean_g[counts < 3] = -1
    order = torch.argsort(mean_g, descending=True)[:15]
    top_tokens = [
        (model.tokenizer.decode([int(types[i])]), round(float(mean_g[i]), 3), int(counts[i])) for i in order
    ]
    clock["scoring_s"] = time.time() - t0
    score_report = {
        "rule": "the concept whose top component has the highest CI score, on train-side texts only",
        "selection_scores": selection,
        "chosen": chosen,
        "chosen_top_component": top,
        "chosen_top_tokens": top_tokens,
        "scores": scores,
    }
    atomic_write_text(out / "scores.json", json.dumps(score_report, indent=1))
    log.info(
        f"chosen concept: {chosen} (selection scores {selection}); component {top}; top tokens {top_tokens[:10]}"
    )

    # 3. ablation on eval-side texts ------------------------------------------------------------------
    t0 = time.time()
    results = {}
    corpus_pairs = pairs(held_resid, held_corpus, 8)
    for key in sorted(study.concepts, key=lambda k: k != chosen):
        file, label = CONCEPTS[key]
        held = labelled_side(sets[key], "eval")
        target = packed(rows, [t for t, lab in held if lab == label], study.eval_rows, study.seed + 20)
        other = packed(rows, [t for t, lab in held if lab != label], study.eval_rows, study.seed + 21)
        target_pairs = pairs(residuals(start, target, cache / f"eval_{key}_target.pt"), target, 8)
        other_pairs = pairs(residuals(start, other, cache / f"eval_{key}_other.pt"), other, 8)
        ranking = score_data[key][0].ranking()
        norms = component_norms(decomp, name)
        norm_rank = torch.argsort(norms, descending=True).argsort()
        cos_v, cos_u = svd_alignment(decomp, name)
        about = {
            c: {"norm": float(norms[c]), "norm_rank": int(norm_rank[c]), "svd_cos_v": float(cos_v[c]),
                "svd_cos_u": float(cos_u[c])}
            for c in ranking[:3]
        }  # fmt: skip
        controls = {"other_labels": other_pairs, "corpus": corpus_pairs}
        results[key] = {"components": about}
        for k, n_random in ((1, study.n_random), (3, 2)):
            effect = ablation_effect(start, decomp, {name: ranking[:k]}, target_pairs, controls,
                                     n_random=n_random, seed=study.seed + k)  # fmt: skip
            results[key][f"top{k}"] = effect
            e = effect["effects"]
            r = effect.get("random_mean", {})
            log.info(
                f"{key} top-{k} {ranking[:k]}: dCE target {e['target']['delta_ce']:+.4f} "
                f"other {e['other_labels']['delta_ce']:+.4f} corpus {e['corpus']['delta_ce']:+.4f}; random "
                f"target {r.get('target', {}).get('delta_ce', float('nan')):+.4f} "
                f"corpus {r.get('corpus', {}).get('delta_ce', float('nan')):+.4f}"
            )
    clock["ablation_s"] = time.time() - t0
    final = {"chosen": chosen, "module": name, "results": results, "wall_s": clock, "command": command}
    atomic_write_text(out / "ablation.json", json.dumps(final, indent=1))
    return score_report, json.loads(json.dumps(final))  # as read back from JSON (string keys)


@torch.no_grad()
def effect_by_ci(study, model, start, decomp, name, rows, sets, cache, final) -> dict:
    """ΔCE and KL of ablating the chosen concept's top-1 component (and the same norm-matched random
    components as in ablation.json) on held-out target and other-label texts, split by the top-1
    component's own CI at the predicting position: g > 0.5 ("on") vs g <= 0.5 ("off")."""
    import torch.nn.functional as F

    from mxd_lens.spd.ablation import ablate

    key = final["chosen"]
    file, label = CONCEPTS[key]
    res = final["results"][key]["top1"]
    configs = {"top1": res["components"]}
    configs.update({f"random{i}": r["components"] for i, r in enumerate(res["random"])})
    top = res["components"][name][0]
    held = labelled_side(sets[key], "eval")
    out = {"concept": key, "component": top, "threshold": 0.5, "sets": {}}
    for set_name, wanted, seed in (("target", True, 20), ("other_labels", False, 21)):
        texts = [t for t, lab in held if (lab == label) == wanted]
        tokens = packed(rows, texts, study.eval_rows, study.seed + seed)  # the rows of ablation.json
        resid = residuals(start, tokens, cache / f"eval_{key}_{'target' if wanted else 'other'}.pt")
        sums = {
            c: {"on": torch.zeros(3, dtype=torch.float64), "off": torch.zeros(3, dtype=torch.float64)}
            for c in configs
        }
        for x, tok in pairs(resid, tokens, 8):
            logits, inputs = decomp.run_clean(start, x)
            g = decomp.ci_from_inputs(inputs)[name][0][..., top]
            clean = F.log_softmax(logits.float(), -1)[:, 1:-1]  # skip the BOS position and the last
            labels = tok[:, 2:, None]
            on = g[:, 1:-1] > 0.5
            for c, comps in configs.items():
                with ablate(decomp, comps):
                    lp = F.log_softmax(start(x).float(), -1)[:, 1:-1]
                dce = (clean - lp).gather(-1, labels)[..., 0]
                kl = (clean.exp() * (clean - lp)).sum(-1)
                for part, mask in (("on", on), ("off", ~on)):
                    sums[c][part] += torch.stack([dce[mask].sum(), kl[mask].sum(), mask.sum()]).double()
        out["sets"][set_name] = {
            c: {
                part: {"delta_ce": float(v[0] / v[2]) if v[2] else None, "kl": float(v[1] / v[2]) if v[2] else None,
                       "n": int(v[2])}
                for part, v in parts.items()
            }
            for c, parts in sums.items()
        }  # fmt: skip
        log.info(f"by CI, {set_name}: {json.dumps(out['sets'][set_name]['top1'])}")
    return out


def svd_alignment(decomp, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per component c: |cos(v_c, a_c)| and |cos(u_c, b_c)| with Wᵀ = A S Bᵀ (how far training moved the
    components from their SVD init)."""
    part = decomp._components(name)
    A, _, Bh = torch.linalg.svd(part.target.float(), full_matrices=False)
    k = min(decomp.C, A.shape[1])
    V, U = part.V.detach()[:, :k], part.U.detach()[:k]
    cos_v = (torch.nn.functional.normalize(V, dim=0) * A[:, :k]).sum(0).abs()
    cos_u = (torch.nn.functional.normalize(U, dim=1) * Bh[:k]).sum(1).abs()
    return cos_v, cos_u


def plot_ablation(final: dict, path: str | Path | None = None) -> Any:
    """ΔCE on target / other labels / corpus for the top-1 and top-3 components and the norm-matched
    random ones, one panel per concept. Returns the Figure (saved to ``path`` when given)."""
    from matplotlib.figure import Figure

    keys = list(final["results"])
    fig = Figure(figsize=(3.6 * len(keys), 3.2))
    axes = fig.subplots(1, len(keys), sharey=False, squeeze=False)
    sets = ("target", "other_labels", "corpus")
    for ax, key in zip(axes[0], keys, strict=True):
        res = final["results"][key]
        width = 0.2
        bars = [
            ("top-1", [res["top1"]["effects"][s]["delta_ce"] for s in sets],
             [res["top1"]["effects"][s]["delta_ce_se"] for s in sets]),
            ("top-3", [res["top3"]["effects"][s]["delta_ce"] for s in sets],
             [res["top3"]["effects"][s]["delta_ce_se"] for s in sets]),
            ("norm-matched random (top-1 stand-ins: mean, min..max)",
             [res["top1"]["random_mean"][s]["delta_ce"] for s in sets], "range"),
        ]  # fmt: skip
        for i, (label, values, errors) in enumerate(bars):
            xs = [j + (i - 1) * width for j in range(len(sets))]
            if errors == "range":
                spread = [[r["effects"][s]["delta_ce"] for r in res["top1"]["random"]] for s in sets]
                errors = [[v - min(x) for v, x in zip(values, spread, strict=True)],
                          [max(x) - v for v, x in zip(values, spread, strict=True)]]  # fmt: skip
            ax.bar(xs, values, width, yerr=errors, label=label, capsize=2)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xticks(range(len(sets)), ["target", "other labels", "corpus"], fontsize=8)
        ax.set_title(f"{key}{' (chosen)' if key == final['chosen'] else ''}", fontsize=9)
        ax.set_ylabel("ΔCE (nats/token)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(f"Ablating SPD components of {final['module']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    if path is not None:
        fig.savefig(path, dpi=90)
    return fig


def ablation_rows(final: dict) -> pd.DataFrame:
    """One row per (concept, top-k, text set) of ``ablation.json``: the ablated components, clean CE, ΔCE
    and its s.e., Δp (correct token), KL, and the norm-matched random components' ΔCE and KL (mean, min
    and max over the draws)."""
    name, rows = final["module"], []
    for key, res in final["results"].items():
        for k in (1, 3):
            effect = res[f"top{k}"]
            for s in ("target", "other_labels", "corpus"):
                e, r = effect["effects"][s], effect["random_mean"][s]
                spread = [x["effects"][s]["delta_ce"] for x in effect["random"]]
                kls = [x["effects"][s]["kl"] for x in effect["random"]]
                rows.append({
                    "concept": key, "chosen": key == final["chosen"], "k": k,
                    "components": " ".join(map(str, effect["components"][name])), "set": s,
                    "ce_clean": e["ce_clean"], "delta_ce": e["delta_ce"], "delta_ce_se": e["delta_ce_se"],
                    "delta_p_correct": e["delta_p_correct"], "kl": e["kl"],
                    "random_delta_ce": r["delta_ce"], "random_delta_ce_min": min(spread),
                    "random_delta_ce_max": max(spread), "random_kl": r["kl"], "random_kl_min": min(kls),
                    "random_kl_max": max(kls),
                })  # fmt: skip
    return pd.DataFrame(rows)


def ablation_table(final: dict) -> pd.DataFrame:
    """:func:`ablation_rows` formatted for reading: ΔCE ± s.e., and the random components' [min, max] over
    the draws for top-1."""
    return pd.DataFrame(
        {
            "concept": r.concept + (" (chosen)" if r.chosen else ""),
            "ablated": f"top{r.k} [{r.components.replace(' ', ', ')}]",
            "set": r.set,
            "CE clean": f"{r.ce_clean:.3f}",
            "ΔCE": f"{r.delta_ce:+.4f} ± {r.delta_ce_se:.4f}",
            "Δp": f"{r.delta_p_correct:+.5f}",
            "KL": f"{r.kl:.4f}",
            "random ΔCE": f"{r.random_delta_ce:+.4f}"
            + (f" [{r.random_delta_ce_min:+.4f}, {r.random_delta_ce_max:+.4f}]" if r.k == 1 else ""),
            "random KL": f"{r.random_kl:.4f}"
            + (f" [{r.random_kl_min:.4f}, {r.random_kl_max:.4f}]" if r.k == 1 else ""),
        }
        for r in ablation_rows(final).itertuples()
    )


def by_ci_rows(by_ci: dict) -> pd.DataFrame:
    """One row per (text set, CI on/off) of ``by_ci.json``: the positions counted, the top-1 component's
    ΔCE and KL there, and the norm-matched random components' (mean, min and max ΔCE; mean KL); NaN
    where no position is counted."""
    rows = []
    for set_name, configs in by_ci["sets"].items():
        for part in ("on", "off"):
            t = configs["top1"][part]
            rand = [v[part] for c, v in configs.items() if c != "top1"]
            dce = [r["delta_ce"] for r in rand] if t["n"] else [float("nan")]
            kls = [r["kl"] for r in rand] if t["n"] else [float("nan")]
            rows.append({
                "set": set_name, "ci": part, "n": t["n"],
                "delta_ce": t["delta_ce"] if t["n"] else float("nan"), "kl": t["kl"] if t["n"] else float("nan"),
                "random_delta_ce": sum(dce) / len(dce), "random_delta_ce_min": min(dce),
                "random_delta_ce_max": max(dce), "random_kl": sum(kls) / len(kls),
            })  # fmt: skip
    return pd.DataFrame(rows)


def by_ci_table(by_ci: dict) -> pd.DataFrame:
    """:func:`by_ci_rows` formatted for reading ("–" where no position is counted)."""

    def row(r: Any) -> dict[str, str]:
        shown = {"set": r.set, "positions": f"CI {r.ci}", "n": str(r.n)}
        names = ("top-1 ΔCE", "top-1 KL", "random ΔCE (mean [min, max])", "random KL (mean)")
        if not r.n:
            return {**shown, **dict.fromkeys(names, "–")}
        values = (f"{r.delta_ce:+.4f}", f"{r.kl:.4f}",
                  f"{r.random_delta_ce:+.4f} [{r.random_delta_ce_min:+.4f}, {r.random_delta_ce_max:+.4f}]",
                  f"{r.random_kl:.4f}")  # fmt: skip
        return {**shown, **dict(zip(names, values, strict=True))}

    return pd.DataFrame(row(r) for r in by_ci_rows(by_ci).itertuples())


def ablation_result(found: dict[str, Any]) -> StudyResult:
    """The study's result from :func:`run_real_model_study`'s: ``ablation_effects.csv``
    (:func:`ablation_rows`), ``by_ci.csv`` (:func:`by_ci_rows`) and ``ablation.png``, printed as the two
    tables; with ``train_only``, the decomposition's held-out metrics alone."""
    if "ablation" not in found:
        held = found["decomposition"]["heldout_corpus"]
        return StudyResult(name="decomposition", text=json.dumps(held, indent=1), value=found)
    final, by_ci = found["ablation"], found["by_ci"]
    text = "\n\n".join([
        f"Ablating components of {final['module']} on held-out texts (ΔCE, Δp, KL per token; random: "
        "norm-matched components, mean [min, max] over the draws):",
        ablation_table(final).to_markdown(index=False, disable_numparse=True),
        f"The top-1 component of {by_ci['concept']} ({by_ci['component']}), split by its own CI at the "
        f"predicting position (on: CI > {by_ci['threshold']}):",
        by_ci_table(by_ci).to_markdown(index=False, disable_numparse=True),
    ])  # fmt: skip
    return StudyResult(
        name="ablation_effects",
        table=ablation_rows(final),
        tables={"by_ci.csv": by_ci_rows(by_ci)},
        figures={"ablation.png": plot_ablation(final)},
        text=text,
        value=found,
    )


def run(model: Any, options: SPDAblationOptions, out: Path) -> StudyResult:
    """The verb ``mxd-lens spd-ablation``."""
    import shlex
    import sys

    command = shlex.join(["mxd-lens", *sys.argv[1:]])
    return ablation_result(run_real_model_study(model, options, out, command=command))
