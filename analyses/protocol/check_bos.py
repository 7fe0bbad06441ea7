"""Is Gemma block 3's huge KL the BOS position? Each layer of a run group (any model: the one its training
record names) replaces the MLP through a plain forward hook on model.blocks[B].mlp at every position (as
`evaluate` spliced before 2026-12-07) and at every position but 0 (the MLP's own output kept at BOS, the one
position the layers never trained on), on BBC News; CE and KL summed by hand (none of mxd_lens's splicing or
scoring). Last, `evaluate`'s own KL and ΔCE on the same batches: since splices keep the MLP at BOS
(`mxd_lens.hooks.first_position`) they must equal the keep_bos rows.

    HF_HUB_OFFLINE=1 .venv/bin/python analyses/protocol/check_bos.py results/gemma-G3/runs/L3.seed0/final 2048
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from sae_lens import SAE

import mxd_lens  # noqa: F401
from mxd_lens.evaluation import evaluate, held_out_batches
from mxd_lens.models import load_model
from mxd_lens.studies.eval.run import recorded_model

folder = Path(sys.argv[1])
ntok = int(sys.argv[2])
layers = {
    p.name: SAE.load_from_disk(p).eval() for p in sorted(folder.iterdir()) if (p / "cfg.json").is_file()
}
block = next(iter(layers.values())).cfg.metadata.hook_layer
first = next(iter(layers.values()))
model = load_model(recorded_model(first.cfg.metadata.training["model"], folder / next(iter(layers))))
batches = held_out_batches(
    model, os.environ.get("DATA", "../shared/data") + "/probing/topic_bbc_news.jsonl.xz", "all", ntok, 128, 8
)
mlp = model.blocks[block].mlp
sums = {(n, m): [0.0, 0.0] for n in layers for m in ("all", "keep_bos")}
norms = []
clean_sum = count = 0
with torch.inference_mode():
    for tokens in batches:
        target = tokens[:, 1:].reshape(-1)
        outs = {}
        h = mlp.register_forward_hook(lambda mod, inp, out, outs=outs: outs.update(x=inp[0], y=out))
        clean = model(tokens)[:, :-1].float().log_softmax(-1).reshape(-1, model.cfg.d_vocab)
        h.remove()
        norms.append(
            (outs["y"][:, 0].norm(dim=-1).mean().item(), outs["y"][:, 1:].norm(dim=-1).mean().item())
        )
        clean_sum += float(F.nll_loss(clean, target, reduction="sum"))
        count += target.numel()
        for n, layer in layers.items():
            for mode in ("all", "keep_bos"):

                def hook(mod, inp, out, layer=layer, mode=mode):
                    new = layer(inp[0]).to(out.dtype)
                    if mode == "keep_bos":
                        new[:, 0] = out[:, 0]
                    return new

                h = mlp.register_forward_hook(hook)
                try:
                    logp = model(tokens)[:, :-1].float().log_softmax(-1).reshape(-1, model.cfg.d_vocab)
                finally:
                    h.remove()
                sums[(n, mode)][0] += float(F.nll_loss(logp, target, reduction="sum"))
                sums[(n, mode)][1] += float((clean.exp() * (clean - logp)).sum())
print(
    f"block {block}, BBC, {count} predicted tokens; MLP output norm at BOS {sum(a for a, _ in norms) / len(norms):.1f}, "
    f"elsewhere {sum(b for _, b in norms) / len(norms):.1f}"
)
for (n, mode), (ce, kl) in sums.items():
    print(f"  {n:45s} {mode:9s} ΔCE {(ce - clean_sum) / count:+.4f}  KL {kl / count:.4f}", flush=True)
for row in evaluate(model, layers, batches, baselines=False, progress=False, jacobian_tokens=0):
    print(
        f"  {row['name']:45s} evaluate  ΔCE {row['delta_ce']:+.4f}  KL {row['kl']:.4f}  (spliced from "
        f"position {row['spliced_from']})",
        flush=True,
    )
