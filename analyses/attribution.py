r"""Which experts (MxD) or latents (transcoders) carry a prediction: attribution of a logit (difference)
on one prompt to the units of saved layers spliced into the model, in the model linearised at the
prompt (``mxd_lens.attribution``). Prints the top units, the other sources, and the completeness check.

    python analyses/attribution.py --layers results/frontier-v2/runs/L15.seed0/final/L15.mxd.k32.m8 \
        --prompt "The capital of France is" --target " Paris" --minus " London" --out results/attribution
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from mxd_lens.cli import parse_config
from mxd_lens.config import DEFAULT_MODEL


@dataclass
class AttributionScript:
    """What to attribute, and where to write."""

    layers: list[str] = field(default_factory=list)
    """saved layer folders to splice (one per block), or folders holding them"""
    prompt: str = "The capital of France is"
    """the prompt (BOS prepended as the model does)"""
    target: str = " Paris"
    """the token whose logit at the last position is attributed (one token)"""
    minus: str | None = None
    """attribute the logit difference target - minus"""
    error_term: bool = True
    """splice with the error term (the model is then exactly the clean one)"""
    top: int = 10
    """units to list"""
    context_tokens: int = 16_384
    """tokens of the bundled English text searched for the top units' contexts in the report (0: none)"""
    model: str = DEFAULT_MODEL
    """model name or path"""
    out: str | None = None
    """write units.csv, parts.csv, graph.png and report.html here"""


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_config(__doc__, argv, args=AttributionScript)
    from pathlib import Path

    import mxd_lens
    import mxd_lens.hooks
    from mxd_lens.attribution import attribute, logit_target, single_token
    from mxd_lens.layers.io import load_layers
    from mxd_lens.models import load_model

    if not args.layers:
        raise SystemExit("attribution: give --layers (saved layer folders to splice)")
    model = load_model(args.model)

    try:
        ids = [single_token(model, text) for text in (args.target, args.minus) if text]
    except ValueError as err:
        raise SystemExit(f"attribution: {err}") from None
    target = logit_target(*ids)
    layers = list(load_layers(args.layers).values())
    with mxd_lens.splice(model, *layers, error_term=args.error_term):
        result = attribute(model, args.prompt, target)
    print(result.top(args.top).round(4).to_markdown(index=False))
    kinds = result.parts["kind"].where(~result.parts["kind"].str.startswith("bias "), "biases (all)")
    summary = result.parts.groupby(kinds)["attribution"].sum()
    summary["units (all)"] = result.units["attribution"].sum()
    print("\n" + summary.round(4).to_frame().to_markdown())
    print(
        f"\ntarget {result.target:+.5f}; parts sum {result.total:+.5f}; completeness {result.completeness:.2e} (relative)"
    )
    if args.out:
        from mxd_lens.attribution import edges, write_report

        blocks = sorted(mxd_lens.hooks.block_of(layer) for layer in layers)
        with mxd_lens.splice(model, *layers, error_term=args.error_term):
            graph = {
                (a, b): edges(model, args.prompt, a, b) for a, b in zip(blocks, blocks[1:], strict=False)
            }
        contexts = {}
        if args.context_tokens:
            from mxd_lens.analysis.inspect import text_batches, top_activations

            by_block = {mxd_lens.hooks.block_of(layer): layer for layer in layers}
            top_units = result.top(args.top)
            for block, group in top_units.groupby("block"):
                units = sorted({int(u) for u in group.unit})
                rows = text_batches(model, None, args.context_tokens, 64)
                found = top_activations(model, by_block[int(block)], rows, units, n=3, progress=False)
                for unit, hits in found.groupby("feature"):
                    contexts[(int(block), int(unit))] = " | ".join(
                        f"{left}[{token}]{right}"
                        for left, token, right in zip(hits.left, hits.token, hits.right, strict=True)
                    )
        paths = write_report(result, Path(args.out), graph, contexts=contexts, top=args.top)
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
