"""Writing and printing a study's result: the one place that turns a :class:`StudyResult` into files
(each written atomically: a reader sees the old file or the new one) and into the text a verb prints.

Columns are described once (:data:`COLUMNS`: name, label, format), so a new metric is a new key in
``evaluate``'s rows and one :class:`Column` here. Tables name an architecture by its key in an ``arch``
column (``mxd:gate=topk``, :func:`mxd_lens.layers.registry.layer_arch`); it is labelled from the registry
(:func:`mxd_lens.layers.arch_label`: ``MxD (gate=topk)``) only when a table is rendered.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mxd_lens.studies import StudyResult


@dataclass(frozen=True)
class Column:
    """How a table column is shown: its header and its format (``"{:+.4f}"``, ``"{:.0%}"``, ``"{:,}"``)."""

    name: str
    label: str | None = None
    format: str = "{}"
    se: str | None = None
    """a standard-error column shown beside the value, as ``value ± se``"""
    arch: bool = False
    """the values are architecture keys (``mxd:gate=topk``), shown by their labels (``MxD (gate=topk)``)"""

    def render(self, value: Any) -> str:
        if value is None or (isinstance(value, float) and value != value):
            return ""
        if self.arch:
            from mxd_lens.layers import arch_label

            return arch_label(str(value))
        try:
            return self.format.format(value)
        except (ValueError, TypeError):
            return str(value)


# Every metric a study table shows, described once.
COLUMNS: dict[str, Column] = {
    c.name: c
    for c in (
        Column("arch", "architecture", arch=True),
        Column("label", "method"),
        Column("name", "layer"),
        Column("block", "block", "{:d}"),
        Column("k", "K", "{}"),
        Column("seed", "seed", "{}"),
        Column("params", "params", "{:,}"),
        Column("ce_clean", "clean CE", "{:.3f}"),
        Column("delta_ce", "ΔCE", "{:+.4f}"),
        Column("delta_ce_se", "± ΔCE", "{:.4f}"),
        Column("kl", "KL", "{:.4f}"),
        Column("kl_se", "± KL", "{:.4f}"),
        Column("zero_ablation_cost", "zero-ablation ΔCE", "{:+.4f}"),
        Column("fvu", "FVU", "{:.3f}"),
        Column("l0", "L0", "{:.1f}"),
        Column("l0_positive", "L0 (> 0)", "{:.1f}"),
        Column("always_on", "always on", "{:.0f}"),
        Column("effective_units", "effective", "{:.1f}"),
        Column("top1_fvu", "top-1 FVU", "{:.2f}"),
        Column("dead_fraction", "silent", "{:.0%}"),
        Column("train_dead_fraction", "dead (training)", "{:.0%}"),
        Column("jacobian_cos", "Jacobian cos", "{:.2f}"),
        Column("ce_recovered_zero", "CE recovered", "{:.3f}"),
        Column("tokens", "tokens", "{:,}"),
        Column("ood_delta_ce", "ΔCE (other text)", "{:+.4f}"),
        Column("ood_kl", "KL (other text)", "{:.4f}"),
        Column("ood_fvu", "FVU (other text)", "{:.3f}"),
    )
}


def columns(*names: str, se: Sequence[str] = (), **labels: str) -> tuple[Column, ...]:
    """The specs of ``names`` from :data:`COLUMNS` (a name not there is shown as it is), with headers
    replaced where ``labels`` gives one; the columns named in ``se`` are shown with their standard error
    (column ``NAME_se``) as ``value ± se``."""
    out = []
    for name in names:
        spec = COLUMNS.get(name, Column(name))
        label = labels.get(name, spec.label)
        if name in se:
            out.append(dataclasses.replace(spec, label=f"{label} ± se", se=f"{name}_se"))
        else:
            out.append(dataclasses.replace(spec, label=label))
    return tuple(out)


def render_table(table: Any, specs: Sequence[Column] | None = None) -> str:
    """``table`` as markdown: the columns of ``specs`` that it has, each formatted by its spec and headed
    by its label (every column as it is when ``specs`` is None)."""
    import pandas as pd

    if table is None or len(table) == 0:
        return ""
    if specs is None:
        return table.to_markdown(index=False, floatfmt=".4f")
    shown = {}
    for spec in specs:
        if spec.name not in table:
            continue
        values = [spec.render(v) for v in table[spec.name]]
        if spec.se and spec.se in table:
            fmt = COLUMNS.get(spec.se, Column(spec.se, format="{:.4f}"))
            # no "±" where the error is not known (NaN: one batch) or the value is not shown
            values = [
                f"{v} ± {se}" if v and (se := fmt.render(s)) else v
                for v, s in zip(values, table[spec.se], strict=True)
            ]
        shown[spec.label or spec.name] = values
    frame = pd.DataFrame(shown)
    align = ["left"] + ["right"] * (len(frame.columns) - 1)
    return frame.to_markdown(index=False, colalign=align, disable_numparse=True)


def render(result: StudyResult) -> str:
    """What a verb prints for ``result``: its table (by its column specs) and its text."""
    parts = [render_table(result.table, result.columns)] if result.columns is not None else []
    if result.text:
        parts.append(result.text)
    return "\n\n".join(p for p in parts if p)


def write_result(result: StudyResult, out: str | Path) -> list[Path]:
    """Write ``result`` into ``out`` (created): NAME.csv, NAME.json, the extra tables, the figures (PNG,
    120 dpi) and the pages, each atomically. Returns the paths written."""
    from mxd_lens.fileio import atomic_to_csv, atomic_write, atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if result.table is not None:
        atomic_to_csv(result.table, out / f"{result.name}.csv", index=False)
        written.append(out / f"{result.name}.csv")
    for file in [*result.tables, *result.figures, *result.pages]:
        (out / file).parent.mkdir(parents=True, exist_ok=True)
    for file, table in result.tables.items():
        named = table.index.name is not None or any(n is not None for n in table.index.names)
        atomic_to_csv(table, out / file, index=named)
        written.append(out / file)
    if result.record:
        atomic_write_text(out / f"{result.name}.json", json.dumps(result.record, indent=1, default=_jsonable))
        written.append(out / f"{result.name}.json")
    for file, figure in result.figures.items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format=Path(file).suffix.lstrip(".") or "png", dpi=120)
        data = buffer.getvalue()
        atomic_write(out / file, lambda tmp, data=data: Path(tmp).write_bytes(data))
        _close(figure)
        written.append(out / file)
    for file, page in result.pages.items():
        atomic_write_text(out / file, page)
        written.append(out / file)
    return written


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _close(figure: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)
