"""Keep freed memory in the process (glibc malloc), for steps that free and reallocate big tensors.

PyTorch's CPU tensors come from ``malloc``. glibc serves a block above ``M_MMAP_THRESHOLD`` (128 KiB at
first, raised as blocks are freed, at most 32 MiB) with a fresh ``mmap`` and unmaps it on free, and gives
the top of the heap back to the kernel beyond ``M_TRIM_THRESHOLD``. A training step that allocates
tensors of tens or hundreds of MB (the SPD step: [8, 1024, C·H] CI hidden layers) then pays, every
step, page faults and zero-filling on pages the kernel hands out again. With both thresholds at 1 GiB
the freed blocks stay in the heap and the next step reuses them (``benchmarks/spd_step.py --mallopt``
and ``benchmarks/layer_speed.py --mallopt`` measure it).

Process-global and never undone, so only the command line (``mxd_lens.cli.main``) calls it: a plain
``import mxd_lens`` leaves the allocator of the program that imports it alone. The cost: the process's
resident memory stays at its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30
ENV = "MXD_LENS_KEEP_FREED_MEMORY"
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def setting_on(name: str, default: bool) -> bool:
    """An on/off environment variable: 1/true/on/yes is on, 0/false/off/no off (any case, spaces
    ignored), unset or empty ``default``; anything else raises ValueError naming the variable."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(
        f"{name}={os.environ[name]!r}: give one of {', '.join(_ON)} (on) or {', '.join(_OFF)} (off), or unset it"
    )


def keep_freed_memory(threshold: int = KEEP_BYTES) -> bool:
    """Set glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to ``threshold`` bytes (default 1 GiB), so
    freed blocks below it stay in the process for reuse. True when set; False (and a debug log line)
    where the C library is not glibc or refuses. ``MXD_LENS_KEEP_FREED_MEMORY=0`` (or false, off, no) in
    the environment turns it off (a machine short of memory: the process then keeps its peak); another
    value than those or 1, true, on, yes (any case) raises ValueError (:func:`setting_on`)."""
    if not setting_on(ENV, default=True):
        log.debug("keep_freed_memory: off (%s=%s)", ENV, os.environ[ENV])
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        log.debug("keep_freed_memory: not glibc (%s %s), allocator left as it is", platform.system(),
                  platform.libc_ver()[0] or "unknown libc")  # fmt: skip
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as err:
        log.debug("keep_freed_memory: no mallopt (%s), allocator left as it is", err)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    value = min(threshold, 2**31 - 1)  # mallopt takes an int
    done = [mallopt(param, value) for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)]
    if not all(done):
        log.debug("keep_freed_memory: mallopt refused (mmap threshold %d, trim threshold %d)", *done)
        return False
    log.debug("keep_freed_memory: glibc mmap and trim thresholds set to %d bytes", value)
    return True
