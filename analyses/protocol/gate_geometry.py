"""Why the always-on experts win TopK: per expert, the gate pre-activation xG + b split into the part
from the mean input (x̄G), the bias b, and the spread over tokens (sd of (x - x̄)G), medians over the
always-on experts (active on > 50% of tokens) and the other used ones. 8,192 tokens of cache shard 16.

    HF_HUB_OFFLINE=1 .venv/bin/python analyses/protocol/gate_geometry.py results/protocol-A/runs/L15.seed0/final
"""

import sys

import torch
from safetensors import safe_open

from mxd_lens.layers import MxD
from mxd_lens.layers.io import load_layers

final = sys.argv[1] if len(sys.argv) > 1 else "results/protocol-A/runs/L15.seed0/final"
shard = sys.argv[2] if len(sys.argv) > 2 else "results/cache-mix7/block_000016.safetensors"
for name, layer in load_layers(final).items():
    if not isinstance(layer, MxD):
        continue
    with safe_open(shard, "pt") as f:
        x = f.get_tensor(f"x.{layer.cfg.metadata.hook_layer}").float()[:8192]
    with torch.no_grad():
        _, values, idx = layer.forward_sparse(x)
        usage = torch.bincount(idx[values != 0], minlength=layer.cfg.d_sae).float() / x.shape[0]
        lin = x @ layer.W_enc
        mean_part = x.mean(0) @ layer.W_enc
        spread = (lin - lin.mean(0)).std(0)
        cos = torch.nn.functional.cosine_similarity(layer.W_enc.T, x.mean(0)[None], dim=-1)
    for label, m in (("always on", usage > 0.5), ("other used", (usage <= 0.5) & (usage > 0))):
        print(
            f"{name:36s} {label:10s} n={int(m.sum()):4d}  x̄G {mean_part[m].median():+.2f}  b {layer.b_enc[m].median():+.2f}  "
            f"sd((x-x̄)G) {spread[m].median():.2f}  cos(G_n, x̄) {cos[m].median():+.2f}"
        )
