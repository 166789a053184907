"""Chat through a remote OpenAI-compatible server (vLLM, llama.cpp's server, Ollama, LM Studio,
another machine's ``omlx serve``) instead of a model loaded here.

:class:`RemoteEndpoint` is a base URL (``http://host:port/v1``), an optional API key and a model
id picked from the server's ``/v1/models``. :class:`RemoteSession` has the surface of
:class:`engine.session.Session` that the desktop worker uses (send, regenerate, documents,
load_messages, keep_unanswered, close), so a conversation runs the same way whichever source
answers. What differs, and why:

- The KV cache is the server's: there are no KV settings, no pinned blocks and no overflow
  policy here. Documents are put in the system message as text, as the local session renders
  them, and the server's own prefix cache (if it has one) reuses them across turns.
- Token ids are the server's: ``GenerationResult.ids`` is empty; the token counts come from the
  server's ``usage`` (asked for with ``stream_options.include_usage``), and ``cached_tokens`` from
  ``usage.prompt_tokens_details.cached_tokens`` when the server reports it.
- Time to first token is measured here, so it includes the network.

HTTP, SSE parsing, timeouts and error mapping are the official ``openai`` client's; its errors
become :class:`~engine.errors.EngineError` with a message naming the server and what went wrong.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence
from urllib.parse import urlsplit

from .engine import Generation, GenerationResult, GenerationStats, StreamChunk
from .errors import DocumentError, EngineError, SettingsError
from .session import MessageLog

log = logging.getLogger("omlx.remote")

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 300.0       # a long prefill on a slow server before its first byte
REMOTE_KIND = "remote"


def normalize_base_url(url: str) -> str:
    """``host:port``, ``http://host:port`` or ``http://host:port/v1/`` → ``http://host:port/v1``.

    Raises:
        SettingsError: not an http(s) URL with a host.
    """
    url = (url or "").strip()
    if not url:
        raise SettingsError("the server address is empty (e.g. http://127.0.0.1:8080/v1)")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(f"{url!r} is not an http:// or https:// server address "
                            "(e.g. http://127.0.0.1:8080/v1)")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path = path + "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def _describe_api_error(exc: Exception, base_url: str) -> str:
    import openai

    if isinstance(exc, openai.AuthenticationError):
        return f"{base_url} refused the API key (401): check the key"
    if isinstance(exc, openai.PermissionDeniedError):
        return f"{base_url} denied access (403)"
    if isinstance(exc, openai.NotFoundError):
        return f"{base_url} has no such model or endpoint (404): {_api_message(exc)}"
    if isinstance(exc, openai.RateLimitError):
        return f"{base_url} is busy (429): {_api_message(exc)}; try again in a moment"
    if isinstance(exc, openai.APITimeoutError):
        return f"{base_url} did not answer in time"
    if isinstance(exc, openai.APIConnectionError):
        return f"cannot reach {base_url}: is the server running?"
    if isinstance(exc, openai.APIStatusError):
        return f"{base_url} answered {exc.status_code}: {_api_message(exc)}"
    return f"{base_url}: {exc}"


def _api_message(exc) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return str(getattr(exc, "message", exc))


class RemoteEndpoint:
    """An OpenAI-compatible server: its base URL, API key and (once chosen) model id."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None):
        import httpx2 as httpx  # openai's transport; a Timeout object gives the connect limit
        import openai

        self.base_url = normalize_base_url(base_url)
        self.api_key = api_key or None
        self.model = model
        # The openai client insists on a key; servers without authentication ignore it.
        self.client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none",
                                    timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                                    max_retries=0)

    @property
    def name(self) -> str:
        return f"{self.model} @ {urlsplit(self.base_url).netloc}" if self.model else self.base_url

    def list_models(self) -> list[str]:
        """The server's model ids (``GET /v1/models``), sorted.

        Raises:
            EngineError: unreachable, refused, or not an OpenAI-compatible server.
        """
        try:
            page = self.client.models.list()
            ids = sorted({m.id for m in page.data})
        except Exception as exc:
            raise EngineError(_describe_api_error(exc, self.base_url)) from exc
        if not ids:
            raise EngineError(f"{self.base_url} serves no models")
        return ids

    def connect(self, model: str | None = None) -> "RemoteEndpoint":
        """Checks the server answers and has ``model`` (default: its first model); returns self
        with the model set.

        Raises:
            EngineError: unreachable, or the model is not among the server's.
        """
        ids = self.list_models()
        wanted = model or self.model or ids[0]
        if wanted not in ids:
            raise EngineError(f"{self.base_url} has no model {wanted!r}; it serves: {', '.join(ids)}")
        self.model = wanted
        log.info("connected to %s, model %s", self.base_url, wanted)
        return self

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:   # closing a client never matters to the user
            log.debug("closing the remote client failed", exc_info=True)


@dataclass
class RemoteDocument:
    """A document of a remote conversation: its text goes into the system message."""

    name: str
    text: str
    id: str
    path: str | None = None
    pinned: bool = True
    n_tokens: int = 0      # estimated (no tokenizer of the remote model here): characters / 4
    cached: bool = False   # whether the server reuses it is the server's business
    mode: str = "whole"    # always read whole: retrieval needs the model's tokenizer and context
    index: None = None


class RemoteSession(MessageLog):
    """A conversation answered by a :class:`RemoteEndpoint` (see the module docstring); its
    messages are kept as the local Session keeps them (:class:`~engine.session.MessageLog`)."""

    def __init__(self, endpoint: RemoteEndpoint, *, system_prompt: str | None = None,
                 ctx: int | None = None, overflow: str = "rolling", doc_mode: str = "auto"):
        if not endpoint.model:
            raise EngineError("connect to the server and choose a model first")
        self.endpoint = endpoint
        self.system_prompt = system_prompt
        self.ctx = ctx or 0            # the server's context: unknown here, kept for the worker
        self.overflow = overflow       # the server decides what happens at its limit
        self.documents: list[RemoteDocument] = []
        self.messages: list[dict] = []
        self.doc_mode = "whole"
        if doc_mode not in ("auto", "whole"):   # a conversation saved in retrieval mode: read whole
            log.info("a remote server reads documents whole (the conversation asked for %s)", doc_mode)

    def set_doc_mode(self, mode: str, progress=None, cancel=None) -> None:
        """Documents go to a server whole ("auto" means that here): choosing sections needs the
        model's tokenizer and context, which a remote server does not share.

        Raises:
            DocumentError: "retrieval" (or an unknown mode).
        """
        if mode not in ("auto", "whole"):
            raise DocumentError(f"a remote server reads documents whole; {mode!r} reading needs a "
                                "local model (its tokenizer and context)")
        self.doc_mode = "whole"

    # Settings the worker applies to every session; a remote server has its own.
    def set_ctx(self, ctx: int) -> None:
        self.ctx = int(ctx)

    def set_overflow(self, policy: str) -> None:
        self.overflow = policy

    def close(self) -> None:
        pass

    # -- documents ------------------------------------------------------------------------
    def add_document(self, source: str | Path | None = None, *, text: str | None = None,
                     name: str | None = None, prefill: bool = True,
                     progress: Callable[[int, int], None] | None = None,
                     cancel: threading.Event | None = None, pinned: bool = True,
                     doc_id: str | None = None) -> RemoteDocument:
        import uuid

        from .documents import document_text

        name, text = document_text(source, text, name)
        doc = RemoteDocument(name=name, text=text,
                             id=doc_id or uuid.uuid4().hex,
                             path=str(source) if source is not None else None, pinned=pinned,
                             n_tokens=max(1, len(text) // 4))
        self.documents.append(doc)
        return doc

    def set_pinned(self, doc_id: str, pinned: bool, **_options) -> None:
        self._document(doc_id).pinned = pinned

    def remove_document(self, doc_id: str) -> None:
        self.documents.remove(self._document(doc_id))

    def _document(self, doc_id: str) -> RemoteDocument:
        for d in self.documents:
            if d.id == doc_id:
                return d
        raise DocumentError(f"no document with id {doc_id}")

    def prepare(self, progress=None, cancel=None) -> int:
        """Nothing to prefill here: the server reads the documents with the next message."""
        return 0

    def _system_content(self) -> str | None:
        # The same wording as the local session's, so a document reads the same to either model.
        from .prompt import system_content

        return system_content(self.system_prompt, [d for d in self.documents if d.pinned])

    # -- conversation ---------------------------------------------------------------------
    def send(self, text: str, **options) -> Generation:
        if not text.strip():
            raise EngineError("the message is empty")
        self.messages.append({"role": "user", "content": text})
        try:
            return self._turn(record=True, **options)
        except Exception:
            self.messages.pop()
            raise

    def regenerate(self, **options) -> Generation:
        while self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages:
            raise EngineError("there is no message to answer")
        return self._turn(record=True, **options)

    def _request_messages(self) -> list[dict]:
        system = self._system_content()
        msgs = [{"role": "system", "content": system}] if system else []
        return msgs + [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def _turn(self, *, record: bool, max_tokens: int = 256, sampling=None, stop: Sequence[str] = (),
              cancel: threading.Event | None = None,
              prefill_progress: Callable[[int, int], None] | None = None) -> Generation:
        ep = self.endpoint
        kwargs = dict(model=ep.model, messages=self._request_messages(), stream=True,
                      max_tokens=int(max_tokens), stream_options={"include_usage": True})
        if stop:
            kwargs["stop"] = list(stop)
        if sampling is not None:
            kwargs["temperature"] = float(sampling.temperature)
            if getattr(sampling, "top_p", None) is not None:
                kwargs["top_p"] = float(sampling.top_p)
            if getattr(sampling, "seed", None) is not None:
                kwargs["seed"] = int(sampling.seed)
        else:
            kwargs["temperature"] = 0.0
        start = time.monotonic()
        try:
            stream = ep.client.chat.completions.create(**kwargs)
        except Exception as exc:
            raise EngineError(_describe_api_error(exc, ep.base_url)) from exc
        holder: list[GenerationResult] = []

        def run() -> Iterator[StreamChunk]:
            parts: list[str] = []
            finish = "stop"
            usage = None
            first_at = None
            n_chunks = 0
            try:
                for event in stream:
                    if cancel is not None and cancel.is_set():
                        finish = "cancelled"
                        break
                    if getattr(event, "usage", None) is not None:
                        usage = event.usage
                    for choice in event.choices or ():
                        piece = getattr(choice.delta, "content", None) or ""
                        if piece:
                            if first_at is None:
                                first_at = time.monotonic()
                            n_chunks += 1
                            parts.append(piece)
                            yield StreamChunk(-1, piece)
                        if choice.finish_reason:
                            finish = choice.finish_reason
            except Exception as exc:
                if record and parts:
                    self.messages.append({"role": "assistant", "content": "".join(parts),
                                          "interrupted": True})
                raise EngineError(_describe_api_error(exc, ep.base_url)) from exc
            finally:
                stream.close()   # a cancelled stream closes its connection: the server stops
            end = time.monotonic()
            text = "".join(parts)
            stats = GenerationStats()
            stats.ttft_s = (first_at or end) - start
            stats.total_s = end - start
            if usage is not None:
                stats.prompt_tokens = int(usage.prompt_tokens or 0)
                stats.generated_tokens = int(usage.completion_tokens or 0)
                details = getattr(usage, "prompt_tokens_details", None)
                stats.cached_tokens = int(getattr(details, "cached_tokens", 0) or 0)
                stats.cache_source = "remote" if stats.cached_tokens else "none"
            else:
                stats.generated_tokens = n_chunks
            if first_at is not None and end > first_at and stats.generated_tokens > 1:
                stats.decode_tok_s = (stats.generated_tokens - 1) / (end - first_at)
            if record:
                message = {"role": "assistant", "content": text}
                if finish == "cancelled":
                    message["interrupted"] = True
                self.messages.append(message)
            holder.append(GenerationResult([], text, finish, stats))

        return Generation(run(), holder)


__all__ = ["RemoteEndpoint", "RemoteSession", "RemoteDocument", "normalize_base_url", "REMOTE_KIND"]
