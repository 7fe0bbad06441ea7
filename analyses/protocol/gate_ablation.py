"""How much of an MxD's fit do its codes carry? On the last shard of the block's activation cache (held out
from nothing: a diagnostic, not a held-out score), each MxD layer's output beside the same layer with its
mixture aC replaced by that mixture's mean over the tokens (every expert's gate held at its average): if
the constant gate fits about as well, the fit comes from the dense path zD, not from which experts fire.

    HF_HUB_OFFLINE=1 .venv/bin/python analyses/protocol/gate_ablation.py CACHE FINAL_FOLDER [FINAL_FOLDER ...]
"""

import sys
from pathlib import Path

import torch
from sae_lens import SAE

import mxd_lens  # noqa: F401 (registers the layers with SAELens)
from mxd_lens.activations import CachedActivations

cache = CachedActivations(sys.argv[1])
folders = [p for arg in sys.argv[2:] for p in sorted(Path(arg).iterdir()) if (p / "cfg.json").is_file()]
print(f"{'layer':<60} {'FVU':>8} {'FVU, gate at its mean':>22} {'FVU, dense path alone (aC = 1)':>31}")
for folder in folders:
    layer = SAE.load_from_disk(folder).eval()
    if not hasattr(layer, "hidden"):
        continue
    block = layer.cfg.metadata.hook_layer
    x, y = cache.read(cache.n_shards - 1)[block]
    x, y = x.float()[:16384], y.float()[:16384]
    with torch.no_grad():
        codes = layer.encode(x)
        mixture = codes @ layer.W_dec
        zD = layer.hidden(x) @ layer.W_out
        full = zD * mixture + layer.b_dec
        assert torch.allclose(full, layer(x), atol=1e-4), "the formula is not the layer's forward"
        const = zD * mixture.mean(0) + layer.b_dec
        dense = zD + layer.b_dec
        var = (y - y.mean(0)).pow(2).sum()
        fvu = [float((y - pred).pow(2).sum() / var) for pred in (full, const, dense)]
        print(f"{folder.name:<60} {fvu[0]:8.4f} {fvu[1]:22.4f} {fvu[2]:31.4f}")
