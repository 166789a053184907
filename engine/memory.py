"""Process memory: current and peak RSS (psutil), sampled cheaply."""

from __future__ import annotations

import psutil

_PROCESS = psutil.Process()


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
