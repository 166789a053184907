"""The engine's worker: a QObject living in its own QThread that owns every engine object
(Engine, Session, the prefix cache). The UI thread never touches them; it talks to the worker
through queued signals and hears back through the worker's signals.

Requests (connect a signal of the window to these slots; the connection is queued because the
worker lives in another thread, so calls run one after another in the worker's thread):

    fetch(name, cancel)                     catalog.fetch with progress and a cancel Event
    load(spec)                              a catalog name or a .gguf path (the old model stays
                                            loaded until the new one is ready)
    configure(settings)                     {"spec", "ctx", "overflow"}: applied before the next turn
    open_conversation(request)              {"conv", "messages", "documents", "system_prompt"}
    send(request)                           {"id", "conv", "text", "max_tokens", "cancel",
                                             "regenerate"}
    add_document(request)                   {"conv", "key", "path"}
    set_pinned(conv, key, pinned) / remove_document(conv, key)

Every result comes back as a signal; every exception becomes a failure signal with a message for
the user, never a dead thread. Generated text is coalesced: one ``tokens`` signal per ~50 ms.

KV figures for the live chart go through :class:`KVHolder`, a lock-protected pair of ints the
worker writes (after each turn, each document, and every 16 tokens while generating) and the
UI's chart reads.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from engine.errors import describe

log = logging.getLogger("omlx.desktop.worker")

TOKEN_BATCH_S = 0.05        # coalesce streamed text into one signal per 50 ms
KV_PUBLISH_EVERY = 16       # tokens between KV publications while generating
FROZEN_FETCH_MESSAGE = (
    "This build of oMLX Desktop cannot download models itself: fetch the model with "
    "`omlx models fetch smollm2-135m-instruct` or open a .gguf file (Ctrl+O)."
)


class StopEvent(threading.Event):
    """A cancel Event that remembers when it was set (for the stop latency in the stats)."""

    set_at: float | None = None

    def set(self) -> None:
        if self.set_at is None:
            self.set_at = time.monotonic()
        super().set()


class KVHolder:
    """KV bytes in use and capacity, written by the worker and read by the UI thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = (0, 0)
        self.updates = 0

    def publish(self, in_use: int, capacity: int) -> None:
        with self._lock:
            self._value = (int(in_use), int(capacity))
            self.updates += 1

    def read(self) -> tuple[int, int]:
        with self._lock:
            return self._value


def _message(exc: BaseException) -> str:
    """The text shown for a failure: the error family's own message, "out of memory: …" for a
    real MemoryError, the class name beside the text for anything else (a bug to report)."""
    return describe(exc)[1]


def is_frozen() -> bool:
    return bool(getattr(sys, "frozen", False))


class EngineWorker(QObject):
    # model
    fetchProgress = Signal(str, float)
    fetchFinished = Signal(str)                 # path of the fetched file
    fetchFailed = Signal(str)
    loadProgress = Signal(str, float)
    loaded = Signal(object)                     # model info dict (see _model_info)
    loadFailed = Signal(str)
    # chat
    tokens = Signal(int, str)                   # request id, text since the last signal
    prefillProgress = Signal(int, int, int)     # request id, done, total
    turnFinished = Signal(int, object)          # request id, {"text", "finish_reason", "stats"}
    turnFailed = Signal(int, str)
    # documents
    documentProgress = Signal(int, str, int, int)   # conv, key, done, total
    documentAdded = Signal(int, str, object)        # conv, key, document info
    documentFailed = Signal(int, str, str)          # conv, key, message
    documentsChanged = Signal(int, object)          # conv, [document info]
    conversationOpened = Signal(int)
    error = Signal(str)
    settingsApplied = Signal(object)            # {"kv_spec", "kv_bytes_per_token"} now in use

    def __init__(self, kv_holder: KVHolder | None = None):
        super().__init__()
        self.kv = kv_holder or KVHolder()
        self.engine = None
        self.session = None
        self.conv: int | None = None
        self.spec: str | None = None            # wanted KV spec (None: the default preset)
        self.ctx: int | None = None
        self.overflow = "rolling"
        self.system_prompt: str | None = None
        # Set by the window when it closes (from the UI thread: an Event is safe to share):
        # prefills stop at their next chunk and queued requests are skipped.
        self.abort = threading.Event()

    # -- model ----------------------------------------------------------------------------
    @Slot(str, object)
    def fetch(self, name: str, cancel) -> None:
        if self.abort.is_set():
            return
        if is_frozen():
            self.fetchFailed.emit(FROZEN_FETCH_MESSAGE)
            return
        from engine import catalog

        try:
            path = catalog.fetch(name, progress=lambda s, f: self.fetchProgress.emit(s, float(f)),
                                 cancel=cancel)
        except Exception as exc:
            log.info("fetch of %s failed: %s", name, exc)
            self.fetchFailed.emit(_message(exc))
            return
        self.fetchFinished.emit(str(path))

    @Slot(str)
    def load(self, spec: str) -> None:
        if self.abort.is_set():
            return
        from engine.engine import load_engine
        from engine.kv.config import KVConfigError

        try:
            engine = load_engine(spec, fetch_missing=False,
                                 progress=lambda s, f: self.loadProgress.emit(s, float(f)))
            if self.spec:
                try:
                    engine.set_kv(self.spec)
                except KVConfigError as exc:  # e.g. per-layer overrides past its last layer:
                    # the window trims them to the model's layers and configures again
                    log.info("KV setting %s does not fit %s (%s); using %s until the next "
                             "setting", self.spec, engine.name, exc, engine.kv_config)
            if self.ctx is not None:
                self.ctx = max(64, min(self.ctx, engine.model.context_length))
        except Exception as exc:
            log.info("loading %s failed: %s", spec, exc)
            self.loadFailed.emit(_message(exc))
            return
        self._close_session()
        self.engine = engine
        self.conv = None
        self.kv.publish(0, 0)
        self.loaded.emit(self._model_info())

    def _model_info(self) -> dict:
        e = self.engine
        g = e.model.kv_geometry
        try:
            size = Path(e.path).stat().st_size
        except OSError:
            size = 0
        return {
            "name": e.name,
            "path": str(e.path),
            "file_size": size,
            "architecture": getattr(e.model, "architecture", ""),
            "context_length": e.model.context_length,
            "kv_spec": str(e.kv_config),
            "kv_bytes_per_token": e.kv_bytes_per_token(),
            "kv_bytes_per_token_16": e.model.kv_bytes_per_token(),
            "has_chat_template": e.has_chat_template,
            "geometry": {
                "n_layers": g.n_layers, "n_kv_heads": g.n_kv_heads, "head_dim": g.head_dim,
                "value_dim": g.value_dim, "windows": list(g.windows),
            },
        }

    # -- settings -------------------------------------------------------------------------
    @Slot(object)
    def configure(self, settings: dict) -> None:
        """Remembers the wanted KV spec, context and overflow policy; they apply before the
        next turn (a new KV format starts a new prefix cache)."""
        self.spec = settings.get("spec") or None
        if settings.get("ctx"):
            self.ctx = int(settings["ctx"])
        if settings.get("overflow"):
            self.overflow = settings["overflow"]

    def _apply_settings(self) -> None:
        e, s = self.engine, self.session
        if self.spec:
            from engine.kv.config import parse_kv

            if str(parse_kv(self.spec)) != str(e.kv_config):
                e.set_kv(self.spec)
                self.settingsApplied.emit({"kv_spec": str(e.kv_config),
                                           "kv_bytes_per_token": e.kv_bytes_per_token()})
        if s is not None:
            ctx = min(self.ctx or e.model.context_length, e.model.context_length)
            if s.ctx != ctx:
                s.set_ctx(ctx)
            if s.overflow != self.overflow:
                s.set_overflow(self.overflow)

    def _publish_kv(self) -> None:
        if self.engine is None:
            return
        self.kv.publish(*self.engine.kv_usage())

    # -- conversations --------------------------------------------------------------------
    def _close_session(self) -> None:
        if self.session is not None:
            try:
                self.session.close()
            except Exception:  # never let cleanup break the next request
                log.exception("closing the session failed")
            self.session = None

    def _new_session(self, system_prompt: str | None):
        from engine.session import Session

        e = self.engine
        ctx = min(self.ctx or e.model.context_length, e.model.context_length)
        return Session(e, system_prompt=system_prompt, ctx=ctx, overflow=self.overflow)

    @Slot(object)
    def open_conversation(self, request: dict) -> None:
        """A new Session for the conversation: its messages, then its documents re-added (the
        pinned prefix comes back from the prefix cache, in memory or on disk)."""
        if self.abort.is_set():
            return
        if self.engine is None:
            return
        from engine.session import Document, DocumentError

        conv = int(request["conv"])
        try:
            self._close_session()
            self._apply_settings()
            session = self._new_session(request.get("system_prompt"))
            self.session, self.conv = session, conv
            session.messages = [dict(m) for m in request.get("messages", [])]
            for d in request.get("documents", []):
                try:
                    doc = session.add_document(text=d["text"], name=d["name"], prefill=False)
                    doc.pinned = bool(d.get("pinned", True))
                except DocumentError as exc:
                    doc = Document(name=d["name"], text=d["text"], pinned=False)
                    doc.n_tokens = len(self.engine.tokenizer.encode(d["text"], add_bos=False,
                                                                      parse_special=False))
                    session.documents.append(doc)
                    self.error.emit(f"{d['name']} is no longer pinned: {exc}")
                doc.id = d["key"]
                doc.path = d.get("path")
            if any(d.pinned for d in session.documents):
                keys = [d.id for d in session.documents if d.pinned]

                def progress(done: int, total: int) -> None:
                    for key in keys:
                        self.documentProgress.emit(conv, key, done, total)

                session.prepare(progress=progress, cancel=self.abort)
        except Exception as exc:
            log.exception("opening conversation %s failed", request.get("conv"))
            self.error.emit(f"cannot open the conversation: {_message(exc)}")
        self._publish_kv()
        self.documentsChanged.emit(conv, self._documents())
        self.conversationOpened.emit(conv)

    def _documents(self) -> list[dict]:
        if self.session is None:
            return []
        return [{"key": d.id, "name": d.name, "path": d.path, "n_tokens": d.n_tokens,
                 "pinned": d.pinned, "cached": d.cached} for d in self.session.documents]

    def _check_conv(self, conv: int) -> None:
        from engine.engine import EngineError

        if self.engine is None:
            raise EngineError("no model is loaded yet: open a .gguf file or fetch the default model")
        if self.session is None or self.conv != conv:
            raise EngineError("this conversation is not open in the engine (open it again)")

    # -- turns ----------------------------------------------------------------------------
    @Slot(object)
    def send(self, request: dict) -> None:
        rid = int(request["id"])
        cancel: threading.Event = request["cancel"]
        try:
            self._check_conv(int(request["conv"]))
            self._apply_settings()
            session = self.session
            options = {"max_tokens": int(request.get("max_tokens", 256)), "cancel": cancel,
                       "prefill_progress": self._prefill_reporter(rid)}
            if request.get("regenerate"):
                gen = session.regenerate(**options)
            else:
                gen = session.send(request["text"], **options)
            pending: list[str] = []
            last_emit = 0.0
            for n, chunk in enumerate(gen, 1):
                if chunk.text:
                    pending.append(chunk.text)
                now = time.monotonic()
                if pending and (now - last_emit >= TOKEN_BATCH_S or n == 1):
                    self.tokens.emit(rid, "".join(pending))
                    pending.clear()
                    last_emit = now
                if n % KV_PUBLISH_EVERY == 0:
                    self._publish_kv()
            if pending:
                self.tokens.emit(rid, "".join(pending))
            result = gen.result
        except Exception as exc:
            log.exception("turn %d failed", rid)
            self._keep_user_message(request)
            self._publish_kv()
            self.turnFailed.emit(rid, _message(exc))
            return
        set_at = getattr(cancel, "set_at", None)
        stopped_in = time.monotonic() - set_at if set_at is not None else None
        self._publish_kv()
        stats = result.stats.as_dict()
        stats["finish_reason"] = result.finish_reason
        if stopped_in is not None:
            stats["engine_stop_s"] = stopped_in   # Stop pressed -> the engine's loop ended
        stats["kv_spec"] = str(self.engine.kv_config)
        self.turnFinished.emit(rid, {"text": result.text, "finish_reason": result.finish_reason,
                                     "stats": stats})
        self.documentsChanged.emit(self.conv, self._documents())

    def _keep_user_message(self, request: dict) -> None:
        """After a failed turn the session ends with the user's message, as the store does."""
        s = self.session
        if s is None or request.get("regenerate") or self.conv != request.get("conv"):
            return
        while s.messages and s.messages[-1]["role"] == "assistant" and s.messages[-1].get("interrupted"):
            s.messages.pop()
        if not s.messages or s.messages[-1] != {"role": "user", "content": request["text"]}:
            s.messages.append({"role": "user", "content": request["text"]})

    def _prefill_reporter(self, rid: int):
        def report(done: int, total: int) -> None:
            self.prefillProgress.emit(rid, int(done), int(total))
            self._publish_kv()
        return report

    # -- documents ------------------------------------------------------------------------
    @Slot(object)
    def add_document(self, request: dict) -> None:
        if self.abort.is_set():
            return
        from engine.session import DocumentError, read_document

        conv, key, path = int(request["conv"]), request["key"], request.get("path")
        try:
            self._check_conv(conv)
            self._apply_settings()          # read it into the cache format the next turn uses
            text = request.get("text")
            if text is None:
                text = read_document(path)
            name = request.get("name") or Path(path).name
            for d in self.session.documents:
                if d.text == text:
                    raise DocumentError(f"{name} is already in this conversation (as {d.name})")

            def progress(done: int, total: int) -> None:
                self.documentProgress.emit(conv, key, int(done), int(total))
                self._publish_kv()

            doc = self.session.add_document(text=text, name=name, progress=progress, cancel=self.abort)
            doc.id = key
            doc.path = str(path) if path else None
        except Exception as exc:
            log.info("document %s refused: %s", path, exc)
            self.documentFailed.emit(conv, key, _message(exc))
            return
        self._publish_kv()
        self.documentAdded.emit(conv, key, {
            "key": key, "name": doc.name, "path": doc.path, "text": doc.text,
            "n_tokens": doc.n_tokens, "pinned": doc.pinned, "cached": doc.cached})
        self.documentsChanged.emit(conv, self._documents())

    @Slot(int, str, bool)
    def set_pinned(self, conv: int, key: str, pinned: bool) -> None:
        if self.abort.is_set():
            return
        try:
            self._check_conv(conv)
            self._apply_settings()

            def progress(done: int, total: int) -> None:
                self.documentProgress.emit(conv, key, int(done), int(total))

            self.session.set_pinned(key, pinned, progress=progress)
        except Exception as exc:
            self.documentFailed.emit(conv, key, _message(exc))
        self._publish_kv()
        self.documentsChanged.emit(conv, self._documents())

    @Slot(int, str)
    def remove_document(self, conv: int, key: str) -> None:
        if self.abort.is_set():
            return
        try:
            self._check_conv(conv)
            self.session.remove_document(key)
        except Exception as exc:
            self.error.emit(_message(exc))
        self._publish_kv()
        self.documentsChanged.emit(conv, self._documents())

    @Slot()
    def shutdown(self) -> None:
        self._close_session()
