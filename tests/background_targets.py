"""Targets for the kernel compiler process's tests (`engine.kernels.background`): stand-ins for
a kernel group's compile that take a while and say which process ran them, at what priority."""

from __future__ import annotations

import os
import time

MARKER_ENV = "OMLX_TEST_BACKGROUND_MARKER"  # the file each target appends its line to
SECONDS = 1.5


def _mark(name: str) -> None:
    time.sleep(SECONDS)
    pid = os.getpid()
    priority = os.getpriority(os.PRIO_PROCESS, pid) if hasattr(os, "getpriority") else 0
    with open(os.environ[MARKER_ENV], "a", encoding="utf-8") as f:
        f.write(f"{pid} {name} {priority}\n")


def first() -> None:
    _mark("first")


def second() -> None:
    _mark("second")
