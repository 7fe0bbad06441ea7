"""The ``mxd-lens`` command."""

from __future__ import annotations

import argparse
import sys
import tempfile


def _check(args: argparse.Namespace) -> int:
    """Build, splice, save and reload every layer type on a small random model; print a table."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="HookedTransformer is deprecated", category=DeprecationWarning)
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    import mxd_lens

    torch.manual_seed(args.seed)
    rows = []
    for kind, extra in (
        ("gpt2-like", dict(act_fn="gelu_new")),
        ("gated", dict(act_fn="silu", gated_mlp=True, normalization_type="RMS")),
    ):
        cfg = HookedTransformerConfig(
            n_layers=2,
            d_model=64,
            n_ctx=32,
            d_head=16,
            n_heads=4,
            d_mlp=256,
            d_vocab=200,
            model_name=f"random-{kind}",
            **extra,
        )
        model = HookedTransformer(cfg)
        tokens = torch.randint(0, cfg.d_vocab, (4, 32))
        with torch.no_grad():
            clean = model(tokens, return_type="loss").item()
            width = args.m * cfg.d_model
            n = mxd_lens.match_experts(width, cfg.d_model, cfg.d_model, cfg.d_mlp, glu=cfg.gated_mlp)
            layers = {
                "MxD.from_mlp": mxd_lens.MxD.from_mlp(model, 1),
                f"MxD (N={n}, untrained)": mxd_lens.MxD.for_model(model, 1, d_sae=n, k=args.k),
                f"Transcoder (H={width}, untrained)": mxd_lens.Transcoder.for_model(
                    model, 1, d_sae=width, k=args.k
                ),
            }
            for name, layer in layers.items():
                with tempfile.TemporaryDirectory() as folder:
                    layer.save_model(folder)
                    loaded = mxd_lens.load_layer(folder)
                with mxd_lens.splice(model, loaded):
                    spliced = model(tokens, return_type="loss").item()
                params = sum(p.numel() for p in layer.parameters())
                rows.append((kind, name, params, clean, spliced - clean))
    print(f"{'model':<10} {'layer':<34} {'params':>9} {'clean CE':>9} {'ΔCE':>9}")
    for kind, name, params, clean, delta in rows:
        print(f"{kind:<10} {name:<34} {params:>9,} {clean:>9.4f} {delta:>+9.4f}")
    print("MxD.from_mlp must show ΔCE = 0: an MxD with one always-on expert is the MLP itself.")
    return 0 if all(abs(delta) < 1e-4 for _, name, _, _, delta in rows if name == "MxD.from_mlp") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mxd-lens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="run every layer type end to end (build, save, load, splice) on small random models",
        description=_check.__doc__,
    )
    check.add_argument("--k", type=int, default=8, help="active experts / latents per token (default 8)")
    check.add_argument(
        "--m", type=int, default=8, help="transcoder width multiplier; MxD is parameter-matched (default 8)"
    )
    check.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    check.set_defaults(func=_check)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
