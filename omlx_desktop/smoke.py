"""``omlx-desktop --smoke-test``: drives the window (load the model, answer a 4-token prompt)
and ends the application with 0, or 1 on the first error or after a timeout. Errors shown in
the window are printed to stderr."""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication

from .window_surface import WindowSurface

SMOKE_PROMPT = "Say hello."
SMOKE_MAX_TOKENS = 4
SMOKE_TIMEOUT_MS = 300_000


class SmokeTestDriver(QObject):
    def __init__(self, window: WindowSurface):
        super().__init__(window)
        self.w = window
        self.exit_code: int | None = None
        window.modelLoaded.connect(self._loaded)
        window.answerFinished.connect(self._answered)
        window.errorShown.connect(lambda message: print(f"error: {message}", file=sys.stderr))
        window.models.failed.connect(self.fail)
        QTimer.singleShot(SMOKE_TIMEOUT_MS, lambda: self.fail("timed out"))

    def _loaded(self, _info: dict) -> None:
        if not self.w.send_message(SMOKE_PROMPT, max_tokens=SMOKE_MAX_TOKENS):
            self.fail("the prompt could not be sent")

    def _answered(self, answer: dict) -> None:
        if answer["state"] == "failed":
            self.fail(answer["error"])
            return
        stats = answer["stats"]
        print(f"smoke test: {self.w.model_info['name']} answered {answer['text']!r} "
              f"({stats.get('generated_tokens')} tokens, {stats.get('decode_tok_s', 0):.1f} tok/s)")
        self.exit(0)

    def fail(self, message: str) -> None:
        if self.exit_code is None:
            print(f"smoke test failed: {message}", file=sys.stderr)
            self.exit(1)

    def exit(self, code: int) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        QTimer.singleShot(0, self.w.close)
        QTimer.singleShot(0, lambda: QApplication.exit(code))
