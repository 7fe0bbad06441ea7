"""Independent check of the frontier-v2 layer-15 ΔCE (negative for MxD and the skip transcoder):
the MLP module's output replaced by the layer's through a plain PyTorch forward hook on
model.blocks[15].mlp (none of mxd_lens's splicing or scoring), CE summed by hand over the same
held-out batches.

    HF_HUB_OFFLINE=1 python analyses/two-books/check_ce.py L15.skip_transcoder.k32.m8 L15.mxd.k32.m8

with RUN the study's runs/L15.seed0/final/ and TEXT its training text (docs/results.md). Output:
stdout, recorded in docs/results/frontier-v2/check_ce.txt. BLOCK (default 15) is the block whose MLP is replaced; block 25's
check (frontier-v6) is

    BLOCK=25 RUN=results/frontier-v6/runs/L25.seed0/final/ TEXT=results/data/austen_bible_mixed.txt.xz \
        HF_HUB_OFFLINE=1 python analyses/two-books/check_ce.py L25.mxd.k32.m8 L25.skip_transcoder.k32.m8 \
        L25.transcoder.k32.m8 > docs/results/frontier-v6/check_ce.txt
"""

import os
import sys

import torch
import torch.nn.functional as F
from sae_lens import SAE

import mxd_lens  # noqa: F401 (registers the layers with SAELens)
from mxd_lens.evaluation import held_out_batches
from mxd_lens.models import load_model

torch.set_num_threads(1)
TEXT = os.environ.get("TEXT", "data/frontier_text/austen_bible_mixed.txt.xz")
RUN = os.environ.get("RUN", "results/frontier-v2/runs/L15.seed0/final/")
BLOCK = int(os.environ.get("BLOCK", "15"))
model = load_model("smollm2-135m")
batches = held_out_batches(model, TEXT, "eval", 51200, 128, 8, 0.05, 0)
run = RUN
names = sys.argv[1:]
layers = {n: SAE.load_from_disk(run + n).eval() for n in names}
mlp = model.blocks[BLOCK].mlp
sums = {"clean": 0.0, **{n: 0.0 for n in names}}
per_batch = {n: [] for n in names}
count = 0
with torch.inference_mode():
    for tokens in batches:
        target = tokens[:, 1:]

        def ce(logits, target=target):
            return float(
                F.cross_entropy(
                    logits[:, :-1].float().reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
                )
            )

        c = ce(model(tokens))
        sums["clean"] += c
        for n, layer in layers.items():
            h = mlp.register_forward_hook(lambda mod, inp, out, layer=layer: layer(inp[0]).to(out.dtype))
            try:
                s = ce(model(tokens))
            finally:
                h.remove()
            sums[n] += s
            per_batch[n].append((s - c) / target.numel())
        count += target.numel()
print("tokens", count, "clean CE", sums["clean"] / count)
for n in names:
    d = torch.tensor(per_batch[n])
    print(
        n,
        "ΔCE",
        (sums[n] - sums["clean"]) / count,
        "batches with ΔCE<0:",
        int((d < 0).sum()),
        "of",
        len(d),
        "min/max",
        float(d.min()),
        float(d.max()),
    )
