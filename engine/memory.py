"""Process memory: current and peak RSS (psutil), sampled cheaply."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import psutil

_PROCESS = psutil.Process()


def _find_malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return None


_MALLOC_TRIM = _find_malloc_trim()


def release_free_heap() -> None:
    """Give freed heap memory back to the OS (glibc's malloc_trim; a no-op elsewhere).

    glibc keeps freed blocks below its (self-raising) mmap threshold in the heap, so a prefill
    chunk's temporaries of a few MiB each would stay resident after the chunk; trimming between
    chunks keeps the resident size near what is really in use. Costs about a millisecond."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _PROCESS.memory_info().rss


class PeakRSS:
    """Tracks the highest RSS seen by `sample()` since construction."""

    def __init__(self) -> None:
        self.peak = rss_bytes()

    def sample(self) -> int:
        now = rss_bytes()
        if now > self.peak:
            self.peak = now
        return now
