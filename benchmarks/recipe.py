"""Training recipe (issue 10): the previous trainer defaults against the new recipe, at equal steps and
tokens, with a minimal independent re-implementation of the paper as the reference, on one cached
activation set. Not run in CI (it needs the real model and a cache of it).

Make the cache once (SmolLM2-135M layer 15, Austen + the World English Bible, train split, BOS then
128 tokens a row, so 32,768 tokens a shard; 20 shards = 655k tokens, 3 GB in fp32; ~15 min here):

    mkdir -p data/train_text && ln -s $DATA/corpus/{jane_austen_novels,bible_web}.txt.xz data/train_text/
    mxd-lens cache --model smollm2-135m --text data/train_text --blocks 15 --context-size 129 \\
        --rows-per-shard 256 --shards 20 --out data/cache-l15

Then

    python benchmarks/recipe.py compare --cache data/cache-l15 \\
        --eval-text $DATA/corpus/matthew_henry_concise_commentary.txt.xz --out results/recipe
    python benchmarks/recipe.py sweep --cache data/cache-l15 --out results/recipe-sweep

``compare`` trains MxD, skip transcoder and TopK transcoder (K = 32, m = 8, parameter-matched) under:

    minimal        a plain-PyTorch loop of the paper's equations (dense TopK, autograd, Adam, warmup, unit
                   C / W_dec rows with the parallel gradient removed, loss sum||y_hat - y||^2 / sum||y||^2),
                   written here without any of the trainer's code
    previous       the project trainer as it was: no normalisation, no AuxK, constant rate, shard shuffle
    recipe         the new defaults (normalisation folded into the weights, AuxK, global shuffle, decay)

on (1) the first 4 shards (131,072 tokens, one epoch) at 256 steps of 512 tokens, lr 1e-3, warmup 100
(the issue's setting: every variant sees the same batches' tokens and steps), and (2) the whole cache
for ``--epochs`` epochs with the new recipe's batch and rate, where ``previous`` gets the same steps and
tokens. Every layer is spliced into the model on ``--eval-tokens`` held-out tokens of ``--eval-text``
(never the training text) by ``mxd_lens.evaluation.evaluate``. Printed and written to OUT/results.csv:
train FVU (last logged batch), held-out FVU, held-out dead fraction (units that never fired on the
held-out tokens), L0, ΔCE, KL, CE recovered (zero-ablation), wall time of the training run. A run that
finished is not retrained (its layers are reloaded from OUT/NAME/final).

``sweep`` chooses defaults on the training side only: it trains the new recipe at several (batch, lr)
at equal tokens on the first shards and reports FVU on the cache's last ``--val-shards`` shards (a
held-out part of the train split; no model needed).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import mxd_lens
from mxd_lens.activations import CachedActivations
from mxd_lens.layers.learners import LearnerSpec, build_layer
from mxd_lens.layers.nonlinearity import get_activation
from mxd_lens.training import TrainConfig, Trainer

ARCHS = ("mxd", "skip_transcoder", "transcoder")
PREVIOUS = dict(normalize="none", aux_coefficient=0.0, lr_schedule="constant")


# -- the independent reference ------------------------------------------------------------------------
def minimal_train(arch, info, x, y, *, k, m, steps, batch, lr, warmup, seed):
    """The paper's equations in plain PyTorch, on tensors x [T, I], y [T, O]; returns a state dict in
    our layers' parameter names (so the same evaluation splices it)."""
    torch.manual_seed(seed)
    I, O, Hs = info.d_in, info.d_out, info.d_hidden
    width = m * I
    n = mxd_lens.match_experts(width, I, O, Hs, glu=info.gated) if arch == "mxd" else width

    def lin(i, o):  # nn.Linear's default init of a weight used as x @ W
        return torch.empty(i, o).uniform_(-(i**-0.5), i**-0.5).requires_grad_()

    p = {
        "W_enc": lin(I, n),
        "b_enc": torch.zeros(n, requires_grad=True),
        "b_dec": torch.zeros(O, requires_grad=True),
    }
    dec = torch.zeros(n, O) if arch == "skip_transcoder" else torch.empty(n, O).uniform_(-1, 1)
    if arch != "skip_transcoder":
        dec /= dec.norm(dim=-1, keepdim=True)
    p["W_dec"] = dec.requires_grad_()
    if arch == "mxd":
        p["W_in"], p["b_in"] = lin(I, Hs), torch.zeros(Hs, requires_grad=True)
        if info.gated:
            p["W_in_gate"], p["b_in_gate"] = lin(I, Hs), torch.zeros(Hs, requires_grad=True)
        p["W_out"] = torch.zeros(Hs, O, requires_grad=True)
    if arch == "skip_transcoder":
        p["W_skip"] = torch.zeros(I, O, requires_grad=True)
    phi = get_activation(info.activation)
    opt = torch.optim.Adam(p.values(), lr=lr)
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    fvu = float("nan")
    for step in range(steps):
        idx = order[(step * batch) % x.shape[0] :][:batch]
        xb, yb = x[idx], y[idx]
        pre = torch.relu(xb @ p["W_enc"] + p["b_enc"])
        top = pre.topk(k, dim=-1)
        a = torch.zeros_like(pre).scatter(-1, top.indices, top.values)
        if arch == "mxd":
            up = xb @ p["W_in"] + p["b_in"]
            z = phi(xb @ p["W_in_gate"] + p["b_in_gate"]) * up if info.gated else phi(up)
            out = (z @ p["W_out"]) * (a @ p["W_dec"]) + p["b_dec"]
        else:
            out = a @ p["W_dec"] + p["b_dec"] + (xb @ p["W_skip"] if arch == "skip_transcoder" else 0)
        loss = (out - yb).pow(2).sum() / yb.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        with torch.no_grad():
            if arch != "skip_transcoder":
                W = p["W_dec"]
                W.grad -= (W.grad * W).sum(-1, keepdim=True) * W
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / warmup)
            opt.step()
            if arch != "skip_transcoder":
                p["W_dec"] /= p["W_dec"].norm(dim=-1, keepdim=True).clamp_min(1e-12)
            fvu = float((out - yb).pow(2).sum() / (yb - yb.mean(0)).pow(2).sum())
    return {key: value.detach() for key, value in p.items()}, fvu


# -- runs --------------------------------------------------------------------------------------------
def run_trainer(name, cache, out, *, archs, k, m, layer, overrides, seed, shuffle="global", max_shards=None):
    """Train (or reload) one Trainer run; returns ({arch: layer at raw scale}, {arch: train fvu}, seconds)."""
    folder = out / name
    done = folder / "done.json"
    specs = [LearnerSpec(arch, layer, k, m) for arch in archs]
    config = TrainConfig(
        seed=seed, checkpoint_every=100, log_every=max(1, overrides.get("log_every", 25)), **overrides
    )
    if done.is_file():
        record = json.loads(done.read_text())
        layers = {s.arch: mxd_lens.load_layer(folder / "final" / s.name) for s in specs}
        # the run as trained (its saved layers record the whole TrainConfig) must be the run asked for
        trained = layers[specs[0].arch].cfg.metadata.training["config"]
        differ = {
            k: (trained.get(k), v)
            for k, v in json.loads(json.dumps(asdict(config))).items()
            if trained.get(k) != v
        }
        if differ:
            raise SystemExit(
                f"{folder} was trained with other settings than {name!r} asks for now (trained, asked): "
                f"{differ}; move it away to retrain (a default changed?)"
            )
        return layers, record["train_fvu"], record["seconds"]
    source = CachedActivations(cache, blocks=[layer], shuffle=shuffle, max_shards=max_shards)
    trainer = Trainer(specs, source, config, folder, progress=False, data_info=source.text_info)
    start = time.perf_counter()
    metrics = trainer.fit(resume=True)
    seconds = time.perf_counter() - start
    layers = {s.arch: layer_ for s, layer_ in zip(specs, trainer.trained_layers().values(), strict=True)}
    train_fvu = {s.arch: metrics[s.name]["fvu"] for s in specs}
    done.write_text(json.dumps({"train_fvu": train_fvu, "seconds": seconds, "config": overrides}))
    return layers, train_fvu, seconds


def run_minimal(name, cache, out, *, archs, k, m, layer, steps, batch, lr, warmup, seed, max_shards):
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    source = CachedActivations(cache, blocks=[layer], max_shards=max_shards)
    shards = [source.read(s)[layer] for s in range(source.n_shards)]
    x, y = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
    layers, fvus, seconds = {}, {}, {}
    for arch in archs:
        spec = LearnerSpec(arch, layer, k, m)
        path = folder / spec.name
        template = build_layer(spec, source.info, seed=seed)
        if (path / "done.json").is_file():
            record = json.loads((path / "done.json").read_text())
            layers[arch] = mxd_lens.load_layer(path)
            fvus[arch], seconds[arch] = record["train_fvu"], record["seconds"]
            continue
        start = time.perf_counter()
        state, fvus[arch] = minimal_train(
            arch, source.info, x, y, k=k, m=m, steps=steps, batch=batch, lr=lr, warmup=warmup, seed=seed
        )
        seconds[arch] = time.perf_counter() - start
        with torch.no_grad():
            for key, param in template.state_dict().items():
                param.copy_(state[key])
        template.cfg.metadata.training = {
            "data": source.text_info,
            "reference": "benchmarks/recipe.py minimal_train",
        }
        template.save_model(path)
        (path / "done.json").write_text(json.dumps({"train_fvu": fvus[arch], "seconds": seconds[arch]}))
        layers[arch] = template
    return layers, fvus, sum(seconds.values())


def eval_batches(model, text, tokens, context):
    import itertools

    from mxd_lens import data

    rows = data.TokenRows.for_model(model, context)
    held = list(itertools.islice(rows.rows(data.iter_texts(text)), math.ceil(tokens / (context - 1))))
    return [torch.stack(held[i : i + 8]) for i in range(0, len(held), 8)]


def heldout_inputs(model, text, tokens, context, layer):
    """MLP inputs of ``layer`` on the first ``tokens`` tokens of ``text`` (BOS position dropped)."""
    from mxd_lens import data
    from mxd_lens.activations import ModelActivations

    rows = data.TokenRows.for_model(model, context)
    stream = ModelActivations(
        model,
        [layer],
        lambda: rows.rows(data.iter_texts(text)),
        context,
        rows_per_shard=128,
        drop_first_position=rows.prepend_bos,
    )
    xs, n = [], 0
    for shard in stream.shards():
        xs.append(shard[layer][0])
        n += len(xs[-1])
        if n >= tokens:
            break
    return torch.cat(xs)[:tokens]


def dead_on(layers, x) -> dict[str, float]:
    """Fraction of each layer's units that never fire on the inputs x (mxd_lens.firing's definition)."""
    from mxd_lens.firing import FiringTracker

    out = {}
    with torch.no_grad():
        for arch, layer in layers.items():
            tracker = FiringTracker(layer.cfg.d_sae)
            for i in range(0, len(x), 8192):
                tracker.update(*layer.encode_sparse(x[i : i + 8192]))
            out[arch] = tracker.dead_fraction()
    return out


def compare(args) -> None:
    from mxd_lens.evaluation import check_disjoint, evaluate
    from mxd_lens.models import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(archs=ARCHS, k=args.k, m=args.m, layer=args.layer, seed=args.seed)
    short = dict(total_tokens=256 * 512, batch_tokens=512, lr=1e-3, warmup_steps=100)
    full_cache = CachedActivations(args.cache, blocks=[args.layer])
    long_tokens = int(args.epochs * full_cache.epoch_tokens) // args.batch_tokens * args.batch_tokens
    long = dict(total_tokens=long_tokens, batch_tokens=args.batch_tokens, lr=args.lr)
    runs: dict[str, tuple[str, Any]] = {
        "131k: minimal reference": ("minimal", None),
        "131k: previous trainer": (
            "trainer",
            dict(name="short-previous", overrides={**short, **PREVIOUS}, shuffle="shard", max_shards=4),
        ),
        "131k: new recipe": ("trainer", dict(name="short-recipe", overrides=short, max_shards=4)),
        f"{args.epochs:g} epochs: previous trainer": (
            "trainer",
            dict(name="long-previous", overrides={**long, **PREVIOUS}, shuffle="shard"),
        ),
        f"{args.epochs:g} epochs: new recipe": ("trainer", dict(name="long-recipe", overrides=long)),
    }
    for variant in args.variant or []:  # the recipe with some TrainConfig fields changed
        short_run, fields = variant.startswith("131k:"), variant.removeprefix("131k:")
        slug = fields.replace(",", "_").replace("=", "-")
        if short_run:
            runs[f"131k: recipe {fields}"] = (
                "trainer",
                dict(name="short-" + slug, overrides={**short, **_fields(fields)}, max_shards=4),
            )
        else:
            runs[f"{args.epochs:g} epochs: recipe {fields}"] = (
                "trainer",
                dict(name="long-" + slug, overrides={**long, **_fields(fields)}),
            )
    if args.only:
        runs = {key: value for key, value in runs.items() if any(o in key for o in args.only)}
    model = load_model(args.model)
    batches = eval_batches(model, args.eval_text, args.eval_tokens, full_cache.info.context_size)
    long_x = None
    rows = []
    for label, (kind, kw) in runs.items():
        print(f"== {label}", flush=True)
        name = "short-minimal" if kind == "minimal" else kw["name"]
        evaluated = out / name / "eval.json"
        key = {"eval_text": args.eval_text, "eval_tokens": args.eval_tokens, "model": args.model}
        if evaluated.is_file() and json.loads(evaluated.read_text())["key"] == key:
            these = json.loads(evaluated.read_text())["rows"]  # trained and evaluated before
            if args.dead_tokens and any(f"heldout_dead_{args.dead_tokens}" not in r for r in these):
                if long_x is None:
                    long_x = heldout_inputs(
                        model, args.eval_text, args.dead_tokens, full_cache.info.context_size, args.layer
                    )
                folder = out / name if kind == "minimal" else out / name / "final"
                layers = {
                    r["arch"]: mxd_lens.load_layer(
                        folder / LearnerSpec(r["arch"], args.layer, args.k, args.m).name
                    )
                    for r in these
                }
                for r, dead in zip(these, dead_on(layers, long_x).values(), strict=True):
                    r[f"heldout_dead_{args.dead_tokens}"] = dead
                evaluated.write_text(json.dumps({"key": key, "rows": these}, indent=1))
            rows.extend(these)
            _write(rows, out, args)
            continue
        if kind == "minimal":
            layers, fvus, seconds = run_minimal(
                "short-minimal",
                args.cache,
                out,
                **common,
                steps=256,
                batch=512,
                lr=1e-3,
                warmup=100,
                max_shards=4,
            )
        else:
            layers, fvus, seconds = run_trainer(kw.pop("name"), args.cache, out, **common, **kw)
        for layer in layers.values():
            check_disjoint(layer.cfg.metadata.training.get("data"), {"text": args.eval_text, "split": "all"})
        named = {arch: layer.eval() for arch, layer in layers.items()}
        if args.dead_tokens and long_x is None:
            long_x = heldout_inputs(
                model, args.eval_text, args.dead_tokens, full_cache.info.context_size, args.layer
            )
        dead_long = dead_on(named, long_x) if args.dead_tokens else {}
        these = []
        for row in evaluate(model, named, batches, progress=False):
            these.append(
                {
                    "run": label,
                    "arch": row["name"],
                    "train_fvu": fvus[row["name"]],
                    "heldout_fvu": row["fvu"],
                    "heldout_dead": row["dead_fraction"],
                    **({f"heldout_dead_{args.dead_tokens}": dead_long[row["name"]]} if dead_long else {}),
                    "l0": row["l0"],
                    "delta_ce": row["delta_ce"],
                    "kl": row["kl"],
                    "ce_recovered": row["ce_recovered_zero"],
                    "ce_clean": row["ce_clean"],
                    "ce_zero_ablation": row["ce_zero_ablation"],
                    "train_seconds": seconds,
                    "eval_tokens": row["tokens"],
                }
            )
        evaluated.write_text(json.dumps({"key": key, "rows": these}, indent=1))
        rows.extend(these)
        _write(rows, out, args)


def _write(rows, out, args) -> None:
    import pandas as pd

    table = pd.DataFrame(rows)
    table.to_csv(out / "results.csv", index=False)
    (out / "results.json").write_text(
        json.dumps(
            {"command": " ".join(shlex.quote(a) for a in sys.argv), "args": vars(args), "rows": rows},
            indent=1,
        )
    )
    print(
        table.drop(columns=["ce_clean", "ce_zero_ablation", "eval_tokens"]).to_markdown(
            index=False, floatfmt=".4f"
        ),
        flush=True,
    )


def sweep(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = CachedActivations(args.cache, blocks=[args.layer])
    train_shards = args.train_shards or cache.n_shards - args.val_shards
    if train_shards + args.val_shards > cache.n_shards:
        raise SystemExit(
            f"{args.train_shards} + {args.val_shards} shards exceed the cache's {cache.n_shards}"
        )
    val = [cache.read(s)[args.layer] for s in range(cache.n_shards - args.val_shards, cache.n_shards)]
    xv, yv = torch.cat([v[0] for v in val]), torch.cat([v[1] for v in val])
    tokens = int(args.epochs * train_shards * cache.info.tokens_per_shard)
    rows = []
    for setting in args.settings:
        batch, lr, *rest = setting.split(",")
        overrides = {
            "total_tokens": tokens // int(batch) * int(batch),
            "batch_tokens": int(batch),
            "lr": float(lr),
            **_fields(",".join(rest)),
        }
        name = "sweep-" + setting.replace(",", "_").replace("=", "-")
        layers, fvus, seconds = run_trainer(
            name,
            args.cache,
            out,
            archs=args.archs,
            k=args.k,
            m=args.m,
            layer=args.layer,
            seed=args.seed,
            overrides=overrides,
            max_shards=train_shards,
        )
        for arch, layer in layers.items():
            with torch.no_grad():
                sse = sum(
                    float((layer(xv[i : i + 4096]) - yv[i : i + 4096]).pow(2).sum())
                    for i in range(0, len(xv), 4096)
                )
            fvu = sse / float((yv - yv.mean(0)).pow(2).sum())
            rows.append(
                {
                    "setting": setting,
                    "arch": arch,
                    "steps": overrides["total_tokens"] // int(batch),
                    "train_fvu": fvus[arch],
                    "val_fvu": fvu,
                    "seconds": seconds,
                }
            )
        _write_sweep(rows, out, args)


def _fields(text: str) -> dict[str, Any]:
    """'FIELD=VALUE,FIELD=VALUE' -> TrainConfig overrides, each value cast to its field's type."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in TrainConfig.__dataclass_fields__:
            raise SystemExit(f"{key!r} is not a TrainConfig field (in {text!r})")
        default = TrainConfig.__dataclass_fields__[key].default
        out[key] = type(default)(value) if default is not None else int(value)
    return out


def _write_sweep(rows, out, args) -> None:
    import pandas as pd

    table = pd.DataFrame(rows)
    table.to_csv(out / "sweep.csv", index=False)
    (out / "sweep.json").write_text(
        json.dumps({"command": " ".join(shlex.quote(a) for a in sys.argv), "rows": rows}, indent=1)
    )
    print(table.to_markdown(index=False, floatfmt=".4f"), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("compare", "sweep"):
        p = sub.add_parser(name)
        p.add_argument("--cache", required=True)
        p.add_argument("--layer", type=int, default=15)
        p.add_argument("--k", type=int, default=32)
        p.add_argument("--m", type=int, default=8)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", required=True)
    c = sub.choices["compare"]
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--eval-text", required=True, help="held-out text, not the cache's training text")
    c.add_argument("--eval-tokens", type=int, default=16_384)
    c.add_argument("--epochs", type=float, default=3.0)
    c.add_argument("--batch-tokens", type=int, default=TrainConfig.batch_tokens)
    c.add_argument("--lr", type=float, default=TrainConfig.lr)
    c.add_argument("--only", nargs="+", help="run only the runs whose label contains one of these")
    c.add_argument(
        "--variant",
        action="append",
        help="also train the long recipe with FIELD=VALUE[,FIELD=VALUE] (TrainConfig fields); "
        "prefix 131k: for the short setting; repeatable",
    )
    c.add_argument(
        "--dead-tokens",
        type=int,
        default=262_144,
        help="also count dead units on this many held-out tokens (encoding only, no splice)",
    )
    s = sub.choices["sweep"]
    s.add_argument("--archs", nargs="+", default=list(ARCHS))
    s.add_argument("--val-shards", type=int, default=2, help="the cache's last shards, held out for FVU")
    s.add_argument(
        "--train-shards", type=int, help="train on the cache's first shards (default: all but --val-shards)"
    )
    s.add_argument("--epochs", type=float, default=1.0)
    s.add_argument(
        "--settings",
        nargs="+",
        default=["512,1e-3", "512,2e-3", "1024,2e-3", "1024,4e-3", "2048,4e-3"],
        help="BATCH,LR[,FIELD=VALUE...] (TrainConfig fields), e.g. 1024,2e-3,lr_schedule=constant",
    )
    args = parser.parse_args(argv)
    compare(args) if args.command == "compare" else sweep(args)


if __name__ == "__main__":
    main()
