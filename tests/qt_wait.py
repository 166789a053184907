"""Waiting in Qt tests without starving the engine's worker thread.

Not QTest.qWait / qtbot.waitUntil: qWait keeps the GIL while it waits, so the worker thread's
Python code barely runs and answers take several times longer. These process events, then sleep.
"""

from __future__ import annotations

import time

from PySide6.QtWidgets import QApplication


def pump(seconds: float) -> None:
    """Runs the event loop for a while."""
    end = time.monotonic() + seconds
    while True:
        QApplication.processEvents()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.005))


def wait_until(condition, timeout: float = 120.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        pump(0.01)
