"""The library's messages go to the ``mxd_lens`` logger (never ``print``): progress lines of a run
without a progress bar, notes such as "3 epochs over the cache", one-off downloads and conversions.

By default the logger writes INFO and above to stderr as plain lines (like ``transformers``, so a
notebook or script sees them without configuring logging) and does not propagate to the root logger.
Silence it with ``logging.getLogger("mxd_lens").setLevel(logging.WARNING)``; route it elsewhere by
replacing its handlers, or with ``propagate = True``.
"""

from __future__ import annotations

import logging
import sys


class _Stderr(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is at the time (notebooks and test runners
    replace it)."""

    def __init__(self) -> None:
        super().__init__()
        self.set_name("mxd_lens.default")

    @property
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # logging.StreamHandler assigns it in __init__
        pass


def _configure() -> logging.Logger:
    logger = logging.getLogger("mxd_lens")
    if not any(h.get_name() == "mxd_lens.default" for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


_configure()
