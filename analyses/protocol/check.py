"""Independent check of the protocol study's ΔCE, KL and L0: each layer replaces the MLP module's output
through a plain PyTorch forward hook on model.blocks[BLOCK].mlp (none of mxd_lens's splicing or scoring),
CE and KL(clean ‖ spliced) summed by hand, L0 and always-on experts counted from the codes the layer's
own ``encode`` returns (non-zero entries), on the same held-out batches as the study (in-domain: the
mix's eval documents; out-of-domain: BBC News).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 .venv/bin/python analyses/protocol/check.py \
        results/protocol-A/runs/L15.seed0/final > docs/results/protocol/A/check-L15.seed0.txt
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from sae_lens import SAE

import mxd_lens  # noqa: F401 (registers the layers with SAELens)
from mxd_lens.evaluation import held_out_batches
from mxd_lens.models import load_model

DATA = os.environ.get("DATA", "../shared/data")
folder = Path(sys.argv[1])
layers = {
    p.name: SAE.load_from_disk(p).eval() for p in sorted(folder.iterdir()) if (p / "cfg.json").is_file()
}
block = next(iter(layers.values())).cfg.metadata.hook_layer
model = load_model("smollm2-135m")
texts = {
    "in-domain": held_out_batches(model, "results/data/mix7.txt.xz", "eval", 32768, 128, 8, 0.05, 0),
    "BBC News": held_out_batches(model, f"{DATA}/probing/topic_bbc_news.jsonl.xz", "all", 32768, 128, 8),
}
mlp = model.blocks[block].mlp
for text, batches in texts.items():
    sums = {n: [0.0, 0.0, 0.0, 0] for n in layers}  # ce, kl, active codes, tokens
    usage = {n: torch.zeros(layer.cfg.d_sae) for n, layer in layers.items()}
    clean_sum, count = 0.0, 0
    with torch.inference_mode():
        for tokens in batches:
            target = tokens[:, 1:].reshape(-1)
            inputs = {}
            hook = mlp.register_forward_hook(lambda mod, inp, out, inputs=inputs: inputs.update(x=inp[0]))
            clean = model(tokens)[:, :-1].float().log_softmax(-1).reshape(-1, model.cfg.d_vocab)
            hook.remove()
            clean_sum += float(F.nll_loss(clean, target, reduction="sum"))
            count += target.numel()
            for n, layer in layers.items():
                h = mlp.register_forward_hook(lambda mod, inp, out, layer=layer: layer(inp[0]).to(out.dtype))
                try:
                    logp = model(tokens)[:, :-1].float().log_softmax(-1).reshape(-1, model.cfg.d_vocab)
                finally:
                    h.remove()
                sums[n][0] += float(F.nll_loss(logp, target, reduction="sum"))
                sums[n][1] += float((clean.exp() * (clean - logp)).sum())
                codes = layer.encode(inputs["x"][:, 1:])  # position 0 (BOS) left out, as evaluate does
                active = codes.reshape(-1, codes.shape[-1]) != 0
                sums[n][2] += float(active.sum())
                sums[n][3] += active.shape[0]
                usage[n] += active.sum(0).float()
    print(f"{text}: {count} predicted tokens, clean CE {clean_sum / count:.5f}", flush=True)
    for n, (ce, kl, l0, tok) in sums.items():
        always = int((usage[n] > tok / 2).sum())
        print(
            f"  {n}: ΔCE {(ce - clean_sum) / count:+.5f} KL {kl / count:.5f} L0 {l0 / tok:.2f} always-on {always}",
            flush=True,
        )
