"""Installed plug-ins: the objects other packages declare under an entry-point group of mxd-lens
(``mxd_lens.architectures``, ``mxd_lens.studies``). Torch-free, so the CLI can read them at once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def entry_point_objects(group: str) -> Iterator[tuple[str, str, Any]]:
    """``(name, value, object)`` for every entry point of ``group``, each loaded in turn; a plug-in that
    fails to load is a RuntimeError naming it (its entry point and the error), not a silent skip."""
    from importlib.metadata import entry_points

    for point in entry_points(group=group):
        try:
            target = point.load()
        except Exception as err:
            raise RuntimeError(
                f"the {group} plug-in {point.name!r} ({point.value}) failed to load: {err}"
            ) from err
        yield point.name, point.value, target
