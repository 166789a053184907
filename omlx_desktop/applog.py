"""The app's log file: ``omlx-desktop.log`` beside the database. Every ``omlx.*`` logger (the
window, the worker, the engine) writes to it at INFO, so an unexpected error's traceback is on
disk when the banner says where to find it.

One handler per window (:func:`open_log` / :func:`close_log`); a file over ``MAX_BYTES`` rolls
over to ``.1`` .. ``.3``.
"""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

LOG_NAME = "omlx-desktop.log"
MAX_BYTES = 1_000_000
BACKUPS = 3
LOGGER = "omlx"

_FORMAT = "%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"


def open_log(folder: Path) -> tuple[Path, logging.Handler | None]:
    """Starts writing the ``omlx`` loggers to ``folder``/omlx-desktop.log; returns its path and
    the handler (None if the file cannot be opened: the app runs without a log file)."""
    path = Path(folder) / LOG_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS,
                                                       encoding="utf-8")
    except OSError:
        logging.getLogger(LOGGER).warning("cannot write the log file %s", path, exc_info=True)
        return path, None
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger = logging.getLogger(LOGGER)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return path, handler


def close_log(handler: logging.Handler | None) -> None:
    if handler is not None:
        logging.getLogger(LOGGER).removeHandler(handler)
        handler.close()
