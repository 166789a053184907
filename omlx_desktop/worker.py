"""The engine's worker: a QObject living in its own QThread that owns every engine object
(Engine, Session, the prefix cache). The UI thread never touches them; it talks to the worker
through queued signals and hears back through the worker's signals.

Requests are the dataclasses of :mod:`omlx_desktop.protocol`; connect one queued signal of the
window to :meth:`EngineWorker.handle` (queued because the worker lives in another thread, so
requests run one after another in the worker's thread). Results come back as the worker's
signals, carrying the protocol's result dataclasses. Every exception becomes a failure result
with a :class:`~omlx_desktop.protocol.Failure` (kind and message, from
:func:`engine.errors.describe`), never a dead thread. Generated text is coalesced: one ``tokens``
signal per ~50 ms.

The requests for documents are :class:`~omlx_desktop.worker_documents.DocumentRequests` (which also
lists the session's documents for the window and restores an opened conversation's), those of the
KV panel's tuning (the Auto preset's profile, the weight arithmetic)
:class:`~omlx_desktop.worker_tuning.TuningRequests`; both are given the worker as a
:class:`~omlx_desktop.worker_host.WorkerHost`.

KV figures for the live chart go through :class:`KVHolder`, a lock-protected pair of ints the
worker writes (after each turn, each document, and every 16 tokens while generating) and the
UI's chart reads.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from engine.errors import OmlxError

from .protocol import (
    AddDocument, ArithApplied, Configure, ConnectRemote, DocumentFailed, Failure,
    FetchModel, KVApplied, ListRemoteModels, LoadModel, MeasureArithCost, MeasureKVProfile, ModelInfo,
    OpenConversation, RemoteModels, RemoveDocument, SendMessage, SetArith, SetDocMode, SetPinned,
    SetDraft, SetRetrievalTokens, SetSpeculate, Shutdown, TurnFailed, TurnFinished,
)
from .worker_documents import DocumentRequests
from .worker_draft import DraftRequests
from .worker_fit import default_context, does_not_fit, draft_path, fit_estimate
from .worker_host import failure_of, log
from .worker_tuning import TuningRequests

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


def is_frozen() -> bool:
    return bool(getattr(sys, "frozen", False))


def model_info(e, default_ctx: int) -> ModelInfo:
    """What the window shows of the local engine ``e`` (``default_ctx``: its largest context here)."""
    g = e.model.kv_geometry
    try:
        size = Path(e.path).stat().st_size
    except OSError:
        size = 0
    return ModelInfo(
        name=e.name, path=str(e.path), file_size=size,
        architecture=getattr(e.model, "architecture", ""),
        context_length=e.model.context_length, kv_spec=str(e.kv_config),
        kv_bytes_per_token=e.kv_bytes_per_token(),
        kv_bytes_per_token_16=e.model.kv_bytes_per_token(),
        has_chat_template=e.has_chat_template,
        geometry={"n_layers": g.n_layers, "n_kv_heads": g.n_kv_heads, "head_dim": g.head_dim,
                  "value_dim": g.value_dim, "windows": list(g.windows)},
        default_ctx=default_ctx,
        model_id=e.model_id,
        arith=e.arith,
    )


class EngineWorker(QObject):
    # model
    fetchProgress = Signal(str, float)
    fetchFinished = Signal(str)                 # path of the fetched file
    fetchFailed = Signal(object)                # Failure (kind "cancelled" when cancelled)
    loadProgress = Signal(str, float)
    loaded = Signal(object)                     # ModelInfo
    loadFailed = Signal(object)                 # Failure
    loadNeedsConfirmation = Signal(object)      # FitCheck: does not fit, not loaded (force to load)
    draftNeedsConfirmation = Signal(object)     # FitCheck: the picked draft model does not fit beside it
    remoteModels = Signal(object)               # RemoteModels: a server's model ids (or why none)
    # chat
    tokens = Signal(int, str)                   # request id, text since the last signal
    prefillProgress = Signal(int, int, int)     # request id, done, total
    turnFinished = Signal(object)               # TurnFinished
    turnFailed = Signal(object)                 # TurnFailed
    # documents
    documentProgress = Signal(int, str, int, int)   # conv, key, done, total
    documentAdded = Signal(object)              # DocumentAdded
    documentFailed = Signal(object)             # DocumentFailed
    documentPinned = Signal(object)             # DocumentPinned
    documentsChanged = Signal(object)           # DocumentsChanged
    conversationOpened = Signal(int)
    error = Signal(object)                      # Failure not tied to one request's result
    settingsApplied = Signal(object)            # KVApplied
    switchCost = Signal(object)                 # {"spec", "reread", "documents", "source"}: Session.switch_cost
    # the KV panel's Auto preset
    kvProfileProgress = Signal(str, float)      # stage, fraction done
    kvProfileReady = Signal(object)             # KVProfileReady
    kvProfileFailed = Signal(object)            # Failure (kind "cancelled" when cancelled)
    # the KV panel's arithmetic setting
    arithApplied = Signal(object)               # ArithApplied
    arithCostReady = Signal(object)             # ArithCost
    arithCostFailed = Signal(object)            # Failure (kind "cancelled" when cancelled)
    draftApplied = Signal(object)               # DraftApplied

    def __init__(self, kv_holder: KVHolder | None = None):
        super().__init__()
        self.kv = kv_holder or KVHolder()
        self.engine = None
        self.remote = None                      # engine.remote.RemoteEndpoint when chatting through a server
        self.session = None
        self.conv: int | None = None
        self.kv_wanted = None                   # wanted KVConfig, parsed once from Configure (None: the default preset)
        self.ctx: int | None = None
        self.overflow = "rolling"
        self.speculate = "off"                  # wanted speculative decoding (SetSpeculate)
        # Set by the window when it closes (from the UI thread: an Event is safe to share):
        # prefills stop at their next chunk and queued requests are skipped.
        self.abort = threading.Event()
        self.docs = DocumentRequests(self)
        self.tuning = TuningRequests(self)      # also holds the wanted weight arithmetic
        self.drafts = DraftRequests(self)       # the wanted draft model
        self._handlers = {
            FetchModel: self.fetch, LoadModel: self.load, Configure: self.configure,
            OpenConversation: self.open_conversation, SendMessage: self.send,
            AddDocument: self.docs.add_document, SetPinned: self.docs.set_pinned,
            RemoveDocument: self.docs.remove_document, SetDocMode: self.docs.set_doc_mode,
            SetRetrievalTokens: self.docs.set_retrieval_tokens,
            MeasureKVProfile: self.tuning.measure_kv_profile, SetArith: self.tuning.set_arith,
            MeasureArithCost: self.tuning.measure_arith_cost,
            ListRemoteModels: self.list_remote_models, ConnectRemote: self.connect_remote,
            Shutdown: self.shutdown, SetSpeculate: self.set_speculate, SetDraft: self.drafts.set_draft,
        }

    @Slot(object)
    def handle(self, request) -> None:
        """Runs one request of :mod:`omlx_desktop.protocol` (after the window closed, only
        Shutdown)."""
        if self.abort.is_set() and not isinstance(request, Shutdown):
            return
        handler = self._handlers.get(type(request))
        if handler is None:
            raise TypeError(f"the engine worker has no request {type(request).__name__}")
        try:
            handler(request)
        except Exception as exc:  # escaped its handler (a bug): the request still ends, as failed
            self._fail(request, failure_of(exc, f"{type(request).__name__} failed"))

    def _fail(self, request, failure: Failure) -> None:
        """Ends ``request`` with ``failure`` on the signal the window waits on for it, so no
        part of the window stays loading or busy."""
        if isinstance(request, FetchModel):
            self.fetchFailed.emit(failure)
        elif isinstance(request, (LoadModel, ConnectRemote)):
            self.loadFailed.emit(failure)
        elif isinstance(request, SendMessage):
            self.turnFailed.emit(TurnFailed(request.id, failure))
        elif isinstance(request, (AddDocument, SetPinned)):
            self.documentFailed.emit(DocumentFailed(request.conv, request.key, failure))
        elif isinstance(request, MeasureKVProfile):
            self.kvProfileFailed.emit(failure)
        elif isinstance(request, MeasureArithCost):
            self.arithCostFailed.emit(failure)
        elif isinstance(request, SetArith):
            self.arithApplied.emit(ArithApplied(self.engine.arith if self.engine is not None else "", failure))
        elif isinstance(request, ListRemoteModels):
            self.remoteModels.emit(RemoteModels(request.base_url, (), failure))
        else:
            self.error.emit(failure)
        conv = getattr(request, "conv", None)
        if conv is not None:    # rows left "reading…" show what the engine holds
            try:
                self.documentsChanged.emit(self.docs.documents_of(conv))
            except Exception:
                log.exception("listing the documents after a failure failed")
        if isinstance(request, OpenConversation):
            self.conversationOpened.emit(request.conv)

    # -- model ----------------------------------------------------------------------------
    def fetch(self, request: FetchModel) -> None:
        if is_frozen():
            self.fetchFailed.emit(Failure("frozen", FROZEN_FETCH_MESSAGE))
            return
        from engine import catalog

        try:
            path = catalog.fetch(request.name, cancel=request.cancel,
                                 progress=lambda s, f: self.fetchProgress.emit(s, float(f)))
        except Exception as exc:
            failure = Failure("cancelled", "cancelled") if request.cancel.is_set() \
                else failure_of(exc, f"fetching {request.name} failed")
            self.fetchFailed.emit(failure)
            return
        self.fetchFinished.emit(str(path))

    def load(self, request: LoadModel) -> None:
        from engine.catalog import resolve_model
        from engine.engine import Engine
        from engine.errors import SettingsError

        try:
            path = resolve_model(request.spec, fetch_missing=False)
            draft = draft_path(self.drafts.spec)    # counted as `omlx --draft` counts it
            estimate = fit_estimate(path, self.ctx, self.kv_wanted, draft)
            check = does_not_fit(request.spec, path, estimate, draft)
            if check is not None and not request.force:
                self.loadNeedsConfirmation.emit(check)
                return
            engine = Engine.load(path, progress=lambda s, f: self.loadProgress.emit(s, float(f)))
            engine.speculate = self.speculate
            if self.kv_wanted is not None:
                try:
                    engine.set_kv(self.kv_wanted)
                except SettingsError as exc:  # e.g. per-layer overrides past its last layer:
                    # the window trims them to the model's layers and configures again
                    log.info("KV setting %s does not fit %s (%s); using %s until the next "
                             "setting", self.kv_wanted, engine.name, exc, engine.kv_config)
            arith_error = self.tuning.use_arith(engine)
            # all of the new model's description before it replaces the loaded one: a failure
            # here leaves the previous model (and its conversation) answering
            info = replace(model_info(engine, self.max_ctx(engine)), arith_error=arith_error)
            if estimate is not None:
                info = replace(info, fit_verdict=estimate.verdict, fit_summary=estimate.summary())
        except Exception as exc:
            self.loadFailed.emit(failure_of(exc, f"loading {request.spec} failed"))
            return
        self._use_source(engine=engine)
        if self.ctx is not None:
            self.ctx = max(64, min(self.ctx, engine.model.context_length))
        self.loaded.emit(info)
        self.drafts.use(engine)                 # the wanted draft model, or why it cannot draft

    # -- remote source ----------------------------------------------------------------------
    def list_remote_models(self, request: ListRemoteModels) -> None:
        from engine.remote import RemoteEndpoint

        try:
            endpoint = RemoteEndpoint(request.base_url, request.api_key)
            try:
                ids = endpoint.list_models()
            finally:
                endpoint.close()
        except Exception as exc:
            self.remoteModels.emit(RemoteModels(
                request.base_url, (), failure_of(exc, f"listing the models of {request.base_url} failed")))
            return
        self.remoteModels.emit(RemoteModels(endpoint.base_url, tuple(ids)))

    def connect_remote(self, request: ConnectRemote) -> None:
        """Chats through a server from now on: the local model (and its KV) is let go once the
        server answered, so a failed connection leaves the current model as it was."""
        from engine.remote import RemoteEndpoint

        try:
            endpoint = RemoteEndpoint(request.base_url, request.api_key).connect(request.model)
        except Exception as exc:
            self.loadFailed.emit(failure_of(exc, f"connecting to {request.base_url} failed"))
            return
        self._use_source(remote=endpoint)   # frees the local model's weights and KV pools
        self.loaded.emit(ModelInfo(
            name=endpoint.name, path=endpoint.base_url, file_size=0, architecture="remote",
            context_length=0, kv_spec="", kv_bytes_per_token=0.0, kv_bytes_per_token_16=0.0,
            has_chat_template=True, remote=True, remote_model=endpoint.model))

    def _use_source(self, *, engine=None, remote=None) -> None:
        """Answers from now on with a local ``engine`` or a ``remote`` endpoint (one of them): the
        open session and the other source are let go; no conversation is open until the window
        opens one again."""
        self._close_session()
        self._drop_remote()
        self.engine, self.remote = engine, remote
        self.conv = None
        self.kv.publish(0, 0)

    def _drop_remote(self) -> None:
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    # -- settings -------------------------------------------------------------------------
    def configure(self, request: Configure) -> None:
        """Remembers the wanted KV spec, context and overflow policy; they apply before the
        next turn (a new KV format starts a new prefix cache). The spec is parsed here, once: a
        bad one fails this request and leaves the wanted settings as they were."""
        from engine.kv.config import parse_kv

        self.kv_wanted = parse_kv(request.spec) if request.spec else None
        if request.ctx:
            self.ctx = request.ctx
        if request.overflow:
            self.overflow = request.overflow
        self._report_switch_cost()

    def _report_switch_cost(self) -> None:
        """Tells the KV panel, before the switch, whether the wanted KV format re-reads the
        pinned documents (or derives them from their master copy, or finds them cached)."""
        if self.engine is None or self.session is None:
            return
        from engine.kv.config import parse_kv

        config = parse_kv(self.kv_wanted)  # None: the default preset
        try:
            cost = self.session.switch_cost(config)
        except Exception:  # a spec for another model's layers, a document that cannot render
            log.debug("no switch cost for %s", config, exc_info=True)
            return
        self.switchCost.emit(dict(cost, spec=str(config)))

    def apply_settings(self) -> None:
        """Brings the engine and the session to the wanted settings. A new KV format reads the
        pinned documents again into it (with their progress shown), before the request that
        needs them."""
        e, s = self.engine, self.session
        if e is None:               # a remote server: its KV and context are its own
            return
        if self.kv_wanted is not None:
            if str(self.kv_wanted) != str(e.kv_config):
                e.set_kv(self.kv_wanted)
                self.settingsApplied.emit(KVApplied(str(e.kv_config), e.kv_bytes_per_token()))
                if s is not None and any(d.pinned for d in s.documents):
                    self.prepare_pinned(self.conv)
                self._report_switch_cost()  # now the current format: the panel's note goes
        if s is not None:
            ctx = min(self.ctx or e.model.context_length, e.model.context_length)
            if s.ctx != ctx:
                s.set_ctx(ctx)
            if s.overflow != self.overflow:
                s.set_overflow(self.overflow)

    def prepare_pinned(self, conv: int) -> None:
        """Prefills the session's pinned prefix, reporting progress on every pinned document's
        row, then their state."""
        keys = [d.id for d in self.session.documents if d.pinned]

        def progress(done: int, total: int) -> None:
            for key in keys:
                self.documentProgress.emit(conv, key, int(done), int(total))
            self.publish_kv()

        for key in keys:
            self.documentProgress.emit(conv, key, 0, 1)
        self.session.prepare(progress=progress, cancel=self.abort)
        self.documentsChanged.emit(self.docs.documents_of(conv))

    def publish_kv(self) -> None:
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

    def _new_session(self, system_prompt: str | None, doc_mode: str = "auto",
                     retrieval_tokens: int | None = None):
        from engine.session import Session

        if self.remote is not None:
            from engine.remote import RemoteSession

            return RemoteSession(self.remote, system_prompt=system_prompt, overflow=self.overflow,
                                 doc_mode=doc_mode)
        e = self.engine
        ctx = min(self.ctx or e.model.context_length, e.model.context_length)
        session = Session(e, system_prompt=system_prompt, ctx=ctx, overflow=self.overflow,
                          doc_mode=doc_mode)
        if retrieval_tokens is not None:
            try:
                session.set_retrieval_tokens(retrieval_tokens)
            except OmlxError as exc:  # a bad stored value: the default stays, and it is said
                self.error.emit(Failure(exc.kind, f"retrieval budget not applied: {exc.user_message}"))
        return session

    def open_conversation(self, request: OpenConversation) -> None:
        """A new Session for the conversation: its messages, then its documents re-added (the
        pinned prefix comes back from the prefix cache, in memory or on disk)."""
        if self.engine is None and self.remote is None:
            return
        conv = request.conv
        try:
            self._close_session()
            self.apply_settings()
            session = self._new_session(request.system_prompt, request.doc_mode,
                                        request.retrieval_tokens)
            self.session, self.conv = session, conv
            session.load_messages(request.messages)
            self.docs.restore(session, request.documents)
            if any(d.pinned for d in session.documents):
                self.prepare_pinned(conv)
        except Exception as exc:
            failure = failure_of(exc, f"opening conversation {conv} failed")
            self.error.emit(replace(failure, message=f"cannot open the conversation: {failure.message}"))
        self.publish_kv()
        self.documentsChanged.emit(self.docs.documents_of(conv))
        self.conversationOpened.emit(conv)

    def max_ctx(self, engine=None) -> int:
        """The largest context for ``engine`` (default: the loaded one): its own, capped by what
        fits in memory at the wanted KV setting beside the wanted draft model (engine.fit)."""
        return default_context((engine or self.engine).gguf, self.kv_wanted, draft_path(self.drafts.spec))

    def whole_ctx(self, n_tokens: int) -> int:
        """A context that holds the pinned whole documents plus one of ``n_tokens`` read whole,
        with the answer's reserve (rounded up to engine.fit's step), if one that large is
        allowed and larger than the current one; else 0."""
        from engine import fit

        s = self.session
        if s is None:
            return 0
        needed = s.context_for_whole(n_tokens)
        needed = -(-needed // fit.CONTEXT_STEP) * fit.CONTEXT_STEP
        return needed if s.ctx < needed <= self.max_ctx() else 0

    def check_conv(self, conv: int) -> None:
        from engine.errors import EngineError

        if self.engine is None and self.remote is None:
            raise EngineError("no model is loaded yet: open a .gguf file or fetch the default model")
        if self.session is None or self.conv != conv:
            raise EngineError("this conversation is not open in the engine (open it again)")

    # -- turns ----------------------------------------------------------------------------
    def send(self, request: SendMessage) -> None:
        rid, cancel = request.id, request.cancel
        try:
            self.check_conv(request.conv)
            self.apply_settings()
            session = self.session
            options = {"max_tokens": request.max_tokens, "cancel": cancel,
                       "prefill_progress": self._prefill_reporter(rid)}
            if request.regenerate:
                gen = session.regenerate(**options)
            else:
                gen = session.send(request.text, **options)
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
                    self.publish_kv()
            if pending:
                self.tokens.emit(rid, "".join(pending))
            result = gen.result
        except Exception as exc:
            failure = failure_of(exc, f"turn {rid} failed")
            if self.session is not None and self.conv == request.conv and not request.regenerate:
                self.session.keep_unanswered(request.text)   # as the Store keeps it
            self.publish_kv()
            self.turnFailed.emit(TurnFailed(rid, failure))
            return
        set_at = getattr(cancel, "set_at", None)
        stopped_in = time.monotonic() - set_at if set_at is not None else None
        self.publish_kv()
        stats = result.stats.as_dict()
        stats["finish_reason"] = result.finish_reason
        if stopped_in is not None:
            stats["engine_stop_s"] = stopped_in   # Stop pressed -> the engine's loop ended
        stats["kv_spec"] = str(self.engine.kv_config) if self.engine is not None else "remote"
        if self.engine is None:
            stats.pop("arith", None)          # the server's own arithmetic, unknown here
        stats["retrieved"] = list(getattr(gen, "retrieved", []))  # sections the answer was shown
        self.turnFinished.emit(TurnFinished(rid, result.text, result.finish_reason, stats))
        self.documentsChanged.emit(self.docs.documents_of(self.conv))

    def set_speculate(self, request: SetSpeculate) -> None:
        """Prompt lookup on or off for the loaded model's next answers and every later model
        (greedy answers are the same token for token; the stats count drafted and kept tokens)."""
        from engine.speculate import SPECULATE_MODES

        if request.mode not in SPECULATE_MODES:
            raise ValueError(f"speculate must be one of {SPECULATE_MODES}, not {request.mode!r}")
        self.speculate = request.mode
        if self.engine is not None:
            self.engine.speculate = request.mode

    def _prefill_reporter(self, rid: int):
        def report(done: int, total: int) -> None:
            self.prefillProgress.emit(rid, int(done), int(total))
            self.publish_kv()
        return report

    def shutdown(self, _request: Shutdown | None = None) -> None:
        self._close_session()
        self._drop_remote()
