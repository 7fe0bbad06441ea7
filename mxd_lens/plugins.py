"""Installed plug-ins: the objects other packages declare under an entry-point group of mxd-lens
(``mxd_lens.architectures``, ``mxd_lens.studies``). Torch-free, so the CLI can read them at once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class PluginWarning(UserWarning):
    """An installed plug-in that was skipped (it failed to load, or is not what its group takes); the
    message names it and why, ``details`` holds the traceback of the error, when there was one. The
    other plug-ins and every verb still work; ``mxd-lens`` prints it as one line (``--debug``: with the
    traceback)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def skip_plugin(group: str, name: str, value: str, why: str, err: BaseException | None = None) -> None:
    """Warn (:class:`PluginWarning`) that the ``group`` plug-in ``name`` (``value``) is skipped."""
    import traceback
    import warnings

    details = "".join(traceback.format_exception(err)) if err is not None else ""
    warnings.warn(
        PluginWarning(f"skipped the {group} plug-in {name!r} ({value}): {why}", details), stacklevel=3
    )


def entry_point_objects(group: str) -> Iterator[tuple[str, str, Any]]:
    """``(name, value, object)`` for every entry point of ``group``, each loaded in turn; a plug-in that
    fails to load is skipped with a :class:`PluginWarning` naming it (its entry point and the error), so
    one broken package breaks neither the others nor any verb, and is never skipped silently."""
    from importlib.metadata import entry_points

    for point in entry_points(group=group):
        try:
            target = point.load()
        except Exception as err:
            skip_plugin(
                group, point.name, point.value, f"it failed to load: {type(err).__name__}: {err}", err
            )
            continue
        yield point.name, point.value, target
