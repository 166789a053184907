"""What the engine worker's request groups (worker_documents, worker_tuning) are given: the worker
as a :class:`WorkerHost` (its engine objects, the window's abort, its signals and the steps they
share), and :func:`failure_of`, the Failure a request ends with.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from PySide6.QtCore import SignalInstance

from engine.errors import OmlxError

from .protocol import Failure

log = logging.getLogger("omlx.desktop.worker")


def failure_of(exc: BaseException, what: str) -> Failure:
    """The Failure a request ends with, logged: one of the engine's errors (``OmlxError``) by its
    message, anything else (a bug, out of memory) with its traceback, which the window's banner
    points to (``Failure.logged``)."""
    if isinstance(exc, OmlxError):
        log.info("%s: %s", what, exc.user_message)
        return Failure.of(exc)
    log.error("%s", what, exc_info=exc)
    return Failure.of(exc, logged=True)


class WorkerHost(Protocol):
    """The EngineWorker, as its request groups use it (all in the worker's thread)."""

    engine: object | None           # engine.engine.Engine, None while none is loaded
    session: object | None          # engine.session.Session or engine.remote.RemoteSession
    conv: int | None
    ctx: int | None                 # the wanted context (None: the model's)
    kv_wanted: object | None        # the wanted KVConfig (None: the default preset)
    abort: threading.Event
    error: SignalInstance
    documentProgress: SignalInstance
    documentAdded: SignalInstance
    documentFailed: SignalInstance
    documentPinned: SignalInstance
    documentsChanged: SignalInstance
    kvProfileProgress: SignalInstance
    kvProfileReady: SignalInstance
    kvProfileFailed: SignalInstance
    arithApplied: SignalInstance
    arithCostReady: SignalInstance
    arithCostFailed: SignalInstance
    draftApplied: SignalInstance
    draftNeedsConfirmation: SignalInstance

    def check_conv(self, conv: int) -> None: ...

    def apply_settings(self) -> None: ...

    def prepare_pinned(self, conv: int) -> None: ...

    def publish_kv(self) -> None: ...

    def max_ctx(self, engine=None) -> int: ...

    def whole_ctx(self, n_tokens: int) -> int: ...
