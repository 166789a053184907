"""What crosses the thread between the window and the engine's worker: requests the window sends
(one queued signal carries any of them to :meth:`EngineWorker.handle`) and the results the worker
sends back by its signals. All are frozen dataclasses; the Events inside some (``cancel``) are
the only shared objects and are thread-safe.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

from engine.errors import describe


# -- requests (window -> worker) --------------------------------------------------------------

@dataclass(frozen=True)
class FetchModel:
    """Download a catalog model (``cancel`` set: stop at the next chunk)."""

    name: str
    cancel: threading.Event


@dataclass(frozen=True)
class LoadModel:
    """Load a catalog name, an ``hf:`` source or a .gguf path; the current model stays until the
    new one is ready. A model the fit check says does not fit is not loaded unless ``force``:
    the worker answers with a :class:`FitCheck` instead, for the window to ask the user."""

    spec: str
    force: bool = False


@dataclass(frozen=True)
class ListRemoteModels:
    """Ask an OpenAI-compatible server which models it serves (answered by ``remoteModels``)."""

    base_url: str
    api_key: str | None = None


@dataclass(frozen=True)
class ConnectRemote:
    """Chat through ``model`` on an OpenAI-compatible server instead of a local model (answered
    like a load: ``loaded`` with a remote ModelInfo, or ``loadFailed``); the local model is
    unloaded once connected."""

    base_url: str
    api_key: str | None = None
    model: str | None = None


@dataclass(frozen=True)
class Configure:
    """The KV panel's settings, applied before the next turn or document (None: unchanged;
    ``spec`` None: the default preset)."""

    spec: str | None = None
    ctx: int | None = None
    overflow: str | None = None

    @classmethod
    def from_panel(cls, settings: dict) -> "Configure":
        """From :meth:`KVPanel.settings` (``{"spec", "ctx", "overflow"}``)."""
        ctx = settings.get("ctx")
        return cls(spec=settings.get("spec") or None, ctx=int(ctx) if ctx else None,
                   overflow=settings.get("overflow") or None)


@dataclass(frozen=True)
class StoredDocument:
    """A document of a conversation as the Store keeps it; ``key`` names it in both threads."""

    key: str
    name: str
    text: str                   # "": a file too large to hold, read again from ``path``
    path: str | None = None
    pinned: bool = True


@dataclass(frozen=True)
class OpenConversation:
    """Rebuild the worker's Session: the messages ({"role", "content"}), then the documents."""

    conv: int
    system_prompt: str | None = None
    messages: tuple[dict, ...] = ()
    documents: tuple[StoredDocument, ...] = ()
    doc_mode: str = "auto"      # engine.session.DOC_MODES: how its documents are in the prompt
    retrieval_tokens: int | None = None  # per answer, the tokens of retrieved sections (None: the
                                         # engine's default; 0: the room the context leaves)


@dataclass(frozen=True)
class SendMessage:
    """Answer ``text`` (or, with ``regenerate``, the last user message again)."""

    id: int
    conv: int
    text: str
    max_tokens: int
    cancel: threading.Event
    regenerate: bool = False


@dataclass(frozen=True)
class AddDocument:
    """Read a file (or take ``text``) and pin it to the open conversation."""

    conv: int
    key: str
    path: str | None = None
    text: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class SetPinned:
    conv: int
    key: str
    pinned: bool


@dataclass(frozen=True)
class SetDocMode:
    """The conversation's document mode ("auto", "whole", "retrieval"); also sent after the
    context was raised for a document, to read the pinned documents as the new context allows."""

    conv: int
    mode: str


@dataclass(frozen=True)
class SetRetrievalTokens:
    """The conversation's retrieval budget: per answer, the tokens of retrieved sections at most
    (0: as many as the context has room for); from the next answer on."""

    conv: int
    tokens: int


@dataclass(frozen=True)
class RemoveDocument:
    conv: int
    key: str


@dataclass(frozen=True)
class MeasureKVProfile:
    """Measure (or read back from the store) the loaded model's per-layer KV sensitivity profile
    for the KV panel's Auto preset (engine.kvtune.default_profile); ``cancel`` set: stop at the
    next layer step. ``n_tokens`` None: the default calibration length."""

    cancel: threading.Event
    n_tokens: int | None = None


@dataclass(frozen=True)
class SetArith:
    """The weight arithmetic the loaded model runs from now on, and every model loaded after it
    ("exact" or "fast", engine.weights.ARITH_MODES; answered by ``arithApplied``)."""

    mode: str


@dataclass(frozen=True)
class SetSpeculate:
    """Speculative decoding for the loaded model's answers and every model loaded after it
    ("off" or "lookup": drafts from the context, engine.speculate.SPECULATE_MODES)."""

    mode: str


@dataclass(frozen=True)
class SetDraft:
    """Draft the loaded model's answers, and every model's loaded after it, with the small model
    ``spec`` (a catalog name, ``hf:`` source or .gguf path; "": no draft model). Answered by
    ``draftApplied``; a model of another vocabulary is refused and the draft before it stays.
    When the loaded model and it do not fit in memory together, the worker asks first
    (``draftNeedsConfirmation``) unless ``force``."""

    spec: str
    force: bool = False


@dataclass(frozen=True)
class MeasureArithCost:
    """Measure what the fast arithmetic costs the loaded model: mean KL of its next-token
    distributions against exact arithmetic's (both with 16-bit KV) over ``n_tokens`` of the
    shipped calibration text (engine.evaluate.evaluate_kv); ``cancel`` set: stop at the next pass."""

    cancel: threading.Event
    n_tokens: int = 256


@dataclass(frozen=True)
class Shutdown:
    """Close the session (the last request before the thread quits)."""


# -- results (worker -> window) ---------------------------------------------------------------

@dataclass(frozen=True)
class Failure:
    """Why a request failed: ``kind`` as :func:`engine.errors.describe` names it
    ("context_full", "out_of_memory", "bad_document", ..., "cancelled", "internal") and the
    message for the user. ``logged``: not one of the engine's errors (a bug, out of memory): its
    traceback is in the app's log, which the window's banner names."""

    kind: str
    message: str
    logged: bool = False

    @classmethod
    def of(cls, exc: BaseException, *, logged: bool = False) -> "Failure":
        return cls(*describe(exc), logged=logged)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    file_size: int
    architecture: str
    context_length: int
    kv_spec: str
    kv_bytes_per_token: float
    kv_bytes_per_token_16: float
    has_chat_template: bool
    geometry: dict = field(default_factory=dict)   # n_layers, n_kv_heads, head_dim, value_dim, windows
    fit_verdict: str = ""       # engine.fit's verdict at the context and KV setting it loaded with
    fit_summary: str = ""       # FitEstimate.summary(): the verdict with the estimate's parts
    remote: bool = False        # a model on an OpenAI-compatible server (path is its base URL):
                                # no local file, no KV settings
    default_ctx: int = 0        # the model's context, capped by what fits in memory at the KV
                                # setting (engine.fit.default_context): the panel's default
    remote_model: str = ""      # remote: the server's model id answering (its /v1/models id)
    model_id: str = ""          # the file's sha256 (Engine.model_id): the key of per-model data
    arith: str = ""             # the weight arithmetic it runs (engine.weights.ARITH_MODES; "float":
                                # no integer kernels, or loaded with OMLX_ARITH=float)
    arith_error: str = ""       # why it does not run the arithmetic the app asks for

    def as_dict(self) -> dict:
        """The form the window and the KV panel read (``info["name"]``, ``info["geometry"]``)."""
        return asdict(self)


@dataclass(frozen=True)
class RemoteModels:
    """A server's model ids, or why there are none (``failure``)."""

    base_url: str
    ids: tuple[str, ...] = ()
    failure: Failure | None = None


@dataclass(frozen=True)
class FitCheck:
    """A load stopped before it began: the model's memory estimate says it does not fit (send
    the LoadModel again with ``force`` to load it anyway). With a draft model chosen, the
    estimate counts it (``draft``: its file); as ``draftNeedsConfirmation``, the loaded model
    at ``path`` with the draft model ``spec`` just picked (send the SetDraft again with ``force``)."""

    spec: str
    path: str
    verdict: str
    summary: str                # FitEstimate.summary()
    total_bytes: int
    available_bytes: int
    draft: str = ""             # the draft model's file counted in the estimate ("": none)


@dataclass(frozen=True)
class KVApplied:
    """A new KV format is in use (the next answers' cache)."""

    kv_spec: str
    kv_bytes_per_token: float


@dataclass(frozen=True)
class KVProfileReady:
    """The sensitivity profile of the model at ``model_path`` (an engine.kvtune.Profile, read
    only once sent)."""

    model_path: str
    profile: object
    from_store: bool
    seconds: float


@dataclass(frozen=True)
class ArithApplied:
    """The arithmetic the loaded model runs after a SetArith ("" without a local model), and the
    failure when it cannot run the one asked for."""

    mode: str
    failure: Failure | None = None


@dataclass(frozen=True)
class DraftApplied:
    """The draft model in use after a SetDraft or a model load: its ``spec`` ("" for none) and
    display ``name`` ("" until a model is loaded to draft for), the failure when the one
    asked for cannot draft (e.g. another vocabulary), and the loaded model's ``default_ctx``
    beside it (as ModelInfo's; 0: no model loaded)."""

    spec: str
    name: str = ""
    failure: Failure | None = None
    default_ctx: int = 0


@dataclass(frozen=True)
class ArithCost:
    """What the fast arithmetic costs the model ``model_id``: mean KL (nats) and top-1 agreement
    of its next-token distributions against exact arithmetic's over ``n_tokens``."""

    model_id: str
    mean_kl: float
    top1_agreement: float
    n_tokens: int
    seconds: float


@dataclass(frozen=True)
class TurnFinished:
    id: int
    text: str
    finish_reason: str          # "stop", "length", "cancelled", "context_full", "kv_pool_full"
    stats: dict                 # the engine's stats, with finish_reason, kv_spec, engine_stop_s


@dataclass(frozen=True)
class TurnFailed:
    id: int
    failure: Failure


@dataclass(frozen=True)
class DocumentInfo:
    key: str
    name: str
    path: str | None
    n_tokens: int
    pinned: bool
    cached: bool                # its blocks are prefilled and pinned in the KV cache
    mode: str = "whole"         # "whole", or "retrieval": sections per question
    sections: int = 0           # retrieval: the chunks of its index
    whole_ctx: int = 0          # retrieval: a context that would read it whole, if the model
                                # and the memory allow one (0: none does)

    def as_dict(self) -> dict:
        """The form :class:`DocumentsPanel` shows."""
        return asdict(self)


@dataclass(frozen=True)
class DocumentAdded:
    conv: int
    info: DocumentInfo
    text: str                   # "" for a file read from the file (engine.documents.DocumentFile)
    sha256: str | None = None   # such a file's, when it was read


@dataclass(frozen=True)
class DocumentFailed:
    conv: int
    key: str
    failure: Failure
    needs_ctx: int = 0          # a context that would hold it, if the model and memory allow (0: none)
    can_retrieve: bool = False  # read by retrieval it would fit (the conversation reads whole)


@dataclass(frozen=True)
class DocumentPinned:
    """A pin or unpin request that succeeded."""

    conv: int
    key: str
    pinned: bool


@dataclass(frozen=True)
class DocumentsChanged:
    """The open conversation's documents as the engine has them now."""

    conv: int
    documents: tuple[DocumentInfo, ...]
