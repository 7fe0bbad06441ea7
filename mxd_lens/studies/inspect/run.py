"""The inspection study: top-activating contexts of chosen features of one saved layer, as
``NAME.csv`` (the rows) and ``NAME.html`` (one self-contained page, tokens highlighted by activation),
NAME being the layer's folder name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mxd_lens.studies import StudyResult
from mxd_lens.studies.inspect import InspectOptions


def run(model: Any, options: InspectOptions, out: Path | None, progress: bool = True) -> StudyResult:
    import pandas as pd

    from mxd_lens.analysis.inspect import contexts_title, to_html, top_contexts
    from mxd_lens.layers.io import load_any_layer

    layer, name = load_any_layer(options.layer), Path(options.layer).name
    features = list(options.features)
    if options.from_steering:
        chosen = pd.read_csv(options.from_steering)
        features += sorted(set(chosen[chosen["name"] == name]["feature"].astype(int)) - set(features))
    if not features:
        raise ValueError(
            "no features: give --features, or --from-steering with a steering.csv that used this layer"
        )
    table = top_contexts(model, layer, features, options.text, options.tokens, options.context_size, options.n,
                         progress)  # fmt: skip
    return StudyResult(
        name=name,
        table=table,
        pages={f"{name}.html": to_html(table, contexts_title(name, table))},
        text=table.groupby("feature").head(3).to_markdown(index=False),
        value=table,
    )
