"""Session: a conversation with pinned documents over one Engine, reusing the KV cache.

The prompt of every turn is laid out as

    [system prompt + pinned documents, in the order added]  [conversation so far]  [new message]
     ^ the pinned prefix: prefilled once, its full blocks pinned in the prefix cache and saved
       to disk, so later turns, new conversations and later processes reuse them

The session keeps one live sequence. A new turn whose prompt extends what the live sequence
holds only prefills the new tokens; an edited or regenerated message trims the live sequence
back to the edit; otherwise the longest cached prefix is attached from the prefix cache (memory,
then disk). Near the context limit the sequence's overflow policy applies (stop / rolling /
attention); the pinned prefix is never dropped.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .engine import Engine, EngineError, Generation, GenerationResult, StreamChunk
from .prompt import PromptLayout, system_content  # noqa: F401  (system_content: its old home)
from .sampling import SamplingParams
from .session_kv import SessionKV

log = logging.getLogger("omlx.session")

ANSWER_RESERVE = 256  # context tokens a pinned prefix must leave for a question and its answer
TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".text", ".rst", ".csv", ".log", ".json", ".py"}


from .documents import DocumentFile, document_source, read_document  # noqa: E402,F401  (read_document: its old home)
from .errors import DocumentError  # noqa: E402,F401
from .retrieval import (  # noqa: E402,F401  (the budget, also for Session's callers)
    MIN_RETRIEVAL_TOKENS, RETRIEVAL_TOKENS, check_retrieval_tokens,
)

DOC_MODES = ("auto", "whole", "retrieval")
ANSWER_MARGIN = 32  # tokens kept free beyond max_tokens when retrieved sections fill the context


@dataclass
class Document:
    name: str
    text: str
    path: str | None = None
    pinned: bool = True
    n_tokens: int = 0
    cached: bool = False  # its blocks are prefilled and pinned in the KV cache
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    mode: str = "whole"  # how it is in the prompt now: "whole", or "retrieval" (sections per question)
    index: object | None = None  # its engine.retrieval.DocumentIndex once it needed one
    file: DocumentFile | None = None  # a file too large to hold (text ""): read by retrieval only


class MessageLog:
    """The conversation's messages (``self.messages``: {"role", "content"[, "interrupted"]}) as a
    local Session and a remote one keep them."""

    messages: list[dict]

    def load_messages(self, messages: Sequence[dict]) -> None:
        """Replace the conversation with `messages` ({"role": "user" | "assistant", "content"}),
        e.g. a conversation restored from the app's database; the documents stay.

        Raises:
            EngineError: a message without a user/assistant role or text content.
        """
        loaded = []
        for i, m in enumerate(messages):
            if m.get("role") not in ("user", "assistant") or not isinstance(m.get("content"), str):
                raise EngineError(f"message {i} needs a role 'user' or 'assistant' and text content")
            loaded.append({"role": m["role"], "content": m["content"]})
        self.messages = loaded

    def keep_unanswered(self, text: str) -> None:
        """After a failed turn: the conversation ends with the user message `text`, unanswered
        (an interrupted answer recorded after it is dropped; the message is added back if the
        failure came before it was recorded)."""
        while self.messages and self.messages[-1]["role"] == "assistant" \
                and self.messages[-1].get("interrupted"):
            self.messages.pop()
        if not self.messages or self.messages[-1] != {"role": "user", "content": text}:
            self.messages.append({"role": "user", "content": text})


class Session(MessageLog):
    """A conversation with pinned documents.

    Args:
        engine: the loaded model.
        system_prompt: text put first in the prompt (None: the chat template's default).
        ctx: context limit in tokens (default: the model's trained context).
        overflow: what happens at the limit: "stop", "rolling" (default) or "attention".
        doc_mode: how pinned documents are put in the prompt: "whole" (default: all of each, a
            document that does not fit is refused), "retrieval" (per question, the sections
            that match it best, up to retrieval_tokens) or "auto" (whole while
            the documents fit, retrieval for those that do not).
        retrieval_tokens: per question, the tokens of retrieved sections at most (default
            RETRIEVAL_TOKENS; 0: as many as the context has room for).
        retrieval_min_ratio: sections scoring less than this fraction of the best one's are
            left out (0: none is).
    """

    def __init__(self, engine: Engine, *, system_prompt: str | None = None, ctx: int | None = None,
                 overflow: str = "rolling", doc_mode: str = "whole",
                 retrieval_tokens: int = RETRIEVAL_TOKENS, retrieval_min_ratio: float = 0.0):
        self.engine = engine
        self.system_prompt = system_prompt
        self.ctx = engine.model.context_length if ctx is None else int(ctx)
        if not 64 <= self.ctx <= engine.model.context_length:
            raise EngineError(f"ctx must be between 64 and the model's context of "
                              f"{engine.model.context_length:,} tokens, not {self.ctx:,}")
        self.kv = SessionKV(engine, self.ctx, overflow, on_new_cache=self._documents_uncached)
        if doc_mode not in DOC_MODES:
            raise EngineError(f"document mode must be one of {', '.join(DOC_MODES)}, not {doc_mode!r}")
        self.doc_mode = doc_mode
        self.retrieval_tokens = check_retrieval_tokens(retrieval_tokens)
        if not 0.0 <= retrieval_min_ratio <= 1.0:
            raise EngineError(f"the retrieval cut-off is a fraction of the best section's score "
                              f"between 0 and 1, not {retrieval_min_ratio}")
        self.retrieval_min_ratio = float(retrieval_min_ratio)
        self._plan_key: tuple | None = None
        self.last_sections: list = []  # engine.retrieval.Section: what the last turn was shown
        self.documents: list[Document] = []
        self.messages: list[dict] = []
        self.layout = PromptLayout(engine)

    # -- settings -------------------------------------------------------------------------
    @property
    def overflow(self) -> str:
        """The overflow policy of the conversation's sequence (set_overflow changes it)."""
        return self.kv.overflow

    @property
    def _live(self):
        """The live sequence (SessionKV.live): benchmarks read its offset."""
        return self.kv.live

    def set_overflow(self, policy: str) -> None:
        self.kv.set_overflow(policy)

    def set_ctx(self, ctx: int) -> None:
        if not 64 <= ctx <= self.engine.model.context_length:
            raise EngineError(f"ctx must be between 64 and {self.engine.model.context_length:,}")
        self.ctx = int(ctx)
        self.kv.set_limit(self.ctx)
        self._plan()
        self._repin()

    def set_retrieval_tokens(self, n: int) -> None:
        """The retrieval budget from the next question on (see the class's ``retrieval_tokens``)."""
        self.retrieval_tokens = check_retrieval_tokens(n)

    def set_doc_mode(self, mode: str, *, progress: Callable[[int, int], None] | None = None,
                     cancel: threading.Event | None = None) -> None:
        """Switch how pinned documents are put in the prompt (see the class's ``doc_mode``);
        the retrieval indexes it needs are built (or loaded) now.

        Raises:
            DocumentError: "whole" while the pinned documents do not fit (nothing changes).
        """
        if mode not in DOC_MODES:
            raise EngineError(f"document mode must be one of {', '.join(DOC_MODES)}, not {mode!r}")
        if mode == "whole":
            pinned = [d for d in self.documents if d.pinned]
            total = self.prefix_tokens(pinned)
            if pinned and total + ANSWER_RESERVE > self.ctx:
                raise DocumentError(
                    f"the pinned documents are {total:,} tokens with the system prompt; the context "
                    f"holds {self.ctx:,} and {ANSWER_RESERVE} are kept for the question and answer: "
                    "raise the context, or read them by retrieval")
        old = self.doc_mode
        self.doc_mode = mode
        try:
            self._plan()
            for d in self._retrieval_documents():
                self._ensure_index(d, progress=progress, cancel=cancel)
        except BaseException:
            self.doc_mode = old
            self._plan()
            raise
        self.kv.release_live()
        self._repin()

    def _documents_uncached(self) -> None:
        """The KV config changed (SessionKV.prefix_cache): no document's blocks are cached
        now; one read by retrieval needs only its index."""
        for doc in self.documents:
            doc.cached = doc.mode == "retrieval" and doc.index is not None

    def close(self) -> None:
        """Release the live sequence and this session's pins."""
        self.kv.close()

    # -- documents ------------------------------------------------------------------------
    def _system_content(self, documents: Sequence[Document] | None = None,
                        sections: Sequence = ()) -> str | None:
        """The system turn (see :func:`system_content`): whole ``documents`` (default: the pinned
        ones the plan reads whole), then retrieved ``sections``."""
        docs = [d for d in (self._whole_documents() if documents is None else documents) if d.pinned]
        return system_content(self.system_prompt, docs, sections)

    def render(self, conversation: Sequence[dict], documents: Sequence[Document] | None = None,
               add_generation_prompt: bool = True, sections: Sequence = ()) -> tuple[list[int], int]:
        """Token ids of a prompt and the length of its pinned prefix (0 if there is none). The
        prefix holds the system prompt, the whole documents and the retrieved ``sections``."""
        return self.layout.render(self._system_content(documents, sections), conversation, add_generation_prompt)

    def prefix_tokens(self, documents: Sequence[Document] | None = None) -> int:
        # a file too large to hold (never read whole) counts its tokens, so it never fits
        files = sum(d.n_tokens for d in documents or () if d.file is not None)
        return self.render([], documents, add_generation_prompt=False)[1] + files

    def add_document(self, source: str | Path | None = None, *, text: str | None = None,
                     name: str | None = None, prefill: bool = True,
                     progress: Callable[[int, int], None] | None = None,
                     cancel: threading.Event | None = None, pinned: bool = True,
                     doc_id: str | None = None) -> Document:
        """Pin a document (a file, or `text`): it joins the prompt prefix after the system prompt
        and the documents before it. With ``pinned=False`` it is kept (its tokens counted) but
        not part of the prompt, so it need not fit the context. ``doc_id`` names it for
        :meth:`set_pinned` / :meth:`remove_document` (default: a new random id).

        In "auto" or "retrieval" mode a document read by retrieval is not prefilled: its index
        is built (or loaded from the cache folder) instead, with ``progress``.

        Raises:
            DocumentError: unreadable, too large for the context in "whole" mode, or no room
                left for its sections (nothing changes then).
        """
        name, text = document_source(source, text, name)
        file = text if isinstance(text, DocumentFile) else None
        doc = Document(name=name, text="" if file else text, file=file, pinned=pinned,
                       path=file.path if file else str(source) if source is not None else None)
        if doc_id is not None:
            doc.id = doc_id
        if file is not None:  # about, until its index counts them
            doc.n_tokens = max(file.size // 4, 1)
            if pinned and self.doc_mode == "whole":
                raise DocumentError(f"{name} is {file.size_text}: too large to read whole, it can "
                                    "be read by retrieval")
        else:
            doc.n_tokens = len(self.engine.tokenizer.encode(text, add_bos=False, parse_special=False))
        if not pinned:
            self.documents.append(doc)
            return doc
        if self.doc_mode == "whole":
            others = self.prefix_tokens(self._whole_documents())
            total = self.prefix_tokens(self._whole_documents() + [doc])
            if total + ANSWER_RESERVE > self.ctx:
                raise DocumentError(
                    f"{name} is {doc.n_tokens:,} tokens; with the system prompt and the other pinned "
                    f"documents ({others:,} tokens) the prompt would start with {total:,} tokens, but the "
                    f"context holds {self.ctx:,} and {ANSWER_RESERVE} are kept for the question and answer"
                )
        self.documents.append(doc)
        try:
            self._plan()
            if doc.mode == "retrieval":
                self._check_retrieval_room(doc)
                self._ensure_index(doc, progress=progress, cancel=cancel)
        except BaseException:
            self.documents.remove(doc)
            self._plan()
            raise
        if prefill:
            self.prepare(progress=progress if doc.mode == "whole" else None, cancel=cancel)
        return doc

    # -- whole or retrieval ---------------------------------------------------------------
    def _plan(self) -> None:
        """Decides each pinned document's ``mode`` for the current context and document mode
        (remembered until one of them, the pinned set or the system prompt changes). In "auto",
        documents are taken whole in the order added while the prefix leaves ANSWER_RESERVE
        tokens; a document that does not fit then is read by retrieval."""
        pinned = [d for d in self.documents if d.pinned]
        key = (self.ctx, self.doc_mode, self.system_prompt, tuple(d.id for d in pinned))
        if key == self._plan_key:
            return
        whole: list[Document] = []
        for d in pinned:
            if self.doc_mode == "auto":
                fits = self.prefix_tokens(whole + [d]) + ANSWER_RESERVE <= self.ctx
            else:
                fits = self.doc_mode == "whole"
            d.mode = "whole" if fits else "retrieval"
            if fits:
                whole.append(d)
        self._plan_key = key

    def context_for_whole(self, n_tokens: int) -> int:
        """About the context that would read a document of ``n_tokens`` whole after the
        documents read whole now (its heading and the template's tokens estimated), with
        ANSWER_RESERVE left."""
        return self.prefix_tokens(self._whole_documents()) + n_tokens + 32 + ANSWER_RESERVE

    def _whole_documents(self) -> list[Document]:
        self._plan()
        return [d for d in self.documents if d.pinned and d.mode == "whole"]

    def _retrieval_documents(self) -> list[Document]:
        self._plan()
        return [d for d in self.documents if d.pinned and d.mode == "retrieval"]

    def _count_tokens(self, text: str) -> int:
        return len(self.engine.tokenizer.encode(text, add_bos=False, parse_special=False))

    def _check_retrieval_room(self, doc: Document) -> None:
        before = self.prefix_tokens(self._whole_documents())
        if before + MIN_RETRIEVAL_TOKENS + ANSWER_RESERVE > self.ctx:
            raise DocumentError(
                f"{doc.name} is read by retrieval, but the system prompt and the documents pinned "
                f"whole take {before:,} of the {self.ctx:,} context tokens: no room is left for its "
                "sections (unpin one, or raise the context)")

    def _ensure_index(self, doc: Document, *, progress: Callable[[int, int], None] | None = None,
                      cancel: threading.Event | None = None) -> None:
        """The document's retrieval index: loaded from the cache folder, else built and saved."""
        if doc.index is None and doc.file is not None:
            from .file_index import FileIndex

            doc.index = FileIndex.open(doc.file, self._count_tokens, self.engine.model_id,
                                       cancel=cancel, progress=progress)
            doc.n_tokens = doc.index.n_tokens
        if doc.index is None:
            from .retrieval import DocumentIndex

            doc.index = DocumentIndex.open(doc.text, self._count_tokens, self.engine.model_id,
                                           cancel=cancel, progress=progress)
            log.info("%s: %d sections indexed (%s)", doc.name, len(doc.index.chunks),
                     "loaded" if doc.index.loaded else "built")
        doc.cached = True
        if progress is not None:
            progress(1, 1)

    def _retrieve(self, conversation: list[dict], max_tokens: int) -> list:
        """The sections of the retrieval documents for the conversation's last user message:
        the best chunks that fit the retrieval budget (``retrieval_tokens``) and the context left
        after the system prompt, the whole documents, the conversation (at most half the context:
        the overflow policy drops older turns) and the answer's room (max_tokens + ANSWER_MARGIN,
        at least ANSWER_RESERVE), in document order."""
        from . import retrieval

        docs = self._retrieval_documents()
        for d in docs:
            self._ensure_index(d)
        question = next((m["content"] for m in reversed(conversation) if m["role"] == "user"), "")
        base_ids, base_prefix = self.render(conversation)
        conversation_tokens = min(len(base_ids) - base_prefix, self.ctx // 2)
        answer_room = max(max_tokens + ANSWER_MARGIN, ANSWER_RESERVE)
        room = self.ctx - base_prefix - conversation_tokens - answer_room
        budget = room - 16 * len(docs)  # each document's heading
        if self.retrieval_tokens:
            budget = min(budget, self.retrieval_tokens)
        ranked = retrieval.rank(question, [(d.name, d.index) for d in docs])
        chosen = (retrieval.select(ranked, budget, min_ratio=self.retrieval_min_ratio)
                  if budget >= MIN_RETRIEVAL_TOKENS else [])
        if not chosen:
            names = ", ".join(d.name for d in docs)
            raise DocumentError(
                f"no room for sections of {names}: the prompt takes {base_prefix + conversation_tokens:,} "
                f"and the answer {answer_room:,} of the {self.ctx:,} context tokens (start a new "
                "conversation, ask for a shorter answer, or raise the context)")
        room_for_prefix = self.ctx - conversation_tokens - answer_room
        return retrieval.fit_sections(
            chosen, self._count_tokens,
            lambda found: self.render([], add_generation_prompt=False, sections=found)[1] <= room_for_prefix)

    def set_pinned(self, doc_id: str, pinned: bool, *, prefill: bool = True,
                   progress: Callable[[int, int], None] | None = None) -> None:
        doc = self._document(doc_id)
        if pinned and not doc.pinned and self.doc_mode == "whole":
            total = self.prefix_tokens([d for d in self.documents if d.pinned or d is doc])
            if total + ANSWER_RESERVE > self.ctx:
                raise DocumentError(f"pinning {doc.name} would make the prompt start with {total:,} "
                                    f"tokens; the context holds {self.ctx:,}")
        was = doc.pinned
        doc.pinned = pinned
        if not pinned:
            doc.cached = False
        try:
            self._plan()
            if pinned and doc.mode == "retrieval":
                self._check_retrieval_room(doc)
                self._ensure_index(doc, progress=progress)
        except BaseException:
            doc.pinned = was
            self._plan()
            raise
        self._repin()
        if pinned and prefill:
            self.prepare(progress=progress if doc.mode == "whole" else None)

    def remove_document(self, doc_id: str) -> None:
        self.documents.remove(self._document(doc_id))
        self._plan()
        self._repin()

    def _document(self, doc_id: str) -> Document:
        for d in self.documents:
            if d.id == doc_id:
                return d
        raise DocumentError(f"no document with id {doc_id}")

    def prepare(self, progress: Callable[[int, int], None] | None = None,
                cancel: threading.Event | None = None) -> int:
        """Prefill the pinned prefix now (reusing what is cached) and pin it; returns the number
        of prefix tokens that were already cached."""
        ids, n_prefix = self.render([], add_generation_prompt=False)
        if not n_prefix:
            return 0
        seq, reused, source = self.kv.sequence_for(ids[:n_prefix], n_prefix, progress, cancel)
        if reused:
            log.info("cache hit: %d of %d prompt tokens reused (from %s)", reused, n_prefix, source)
        if reused < n_prefix:
            if self.engine.prefill(ids[reused:n_prefix], seq, progress, cancel) is None:
                return reused - self.kv.master_prefilled
        elif progress:
            progress(n_prefix, n_prefix)
        self._pin(ids, n_prefix)
        return reused - self.kv.master_prefilled

    # -- pinning --------------------------------------------------------------------------
    def _pin(self, ids: Sequence[int], n_prefix: int) -> int:
        """Pin the full blocks of the prefix and save them to disk; returns pinned tokens."""
        pinned = self.kv.pin(ids, n_prefix)
        for doc in self.documents:
            if doc.mode == "retrieval":
                doc.cached = doc.pinned and doc.index is not None
            else:
                doc.cached = doc.pinned and pinned
        return n_prefix if pinned else 0

    def switch_cost(self, kv) -> dict:
        """What switching the engine to the KV layout `kv` would cost the pinned documents, asked
        before the switch: Engine.switch_cost's {"reread", "source"} for the pinned prefix, plus
        "documents", the pinned documents a re-read prefills again (0 when none is needed)."""
        ids, n_prefix = self.render([], add_generation_prompt=False)
        cost = self.engine.switch_cost(kv, ids[:n_prefix] if n_prefix else [])
        cost["documents"] = sum(1 for d in self.documents if d.pinned) if cost["reread"] else 0
        return cost

    def _repin(self) -> None:
        """After the document set changed: unpin what is no longer the prefix."""
        if self.kv.cache is None:
            return  # nothing pinned yet (and no need to render)
        ids, n_prefix = self.render([], add_generation_prompt=False)
        self.kv.repin(ids[:n_prefix])

    # -- turns ----------------------------------------------------------------------------
    def _turn(self, conversation: list[dict], *, record: bool, max_tokens: int = 256,
              sampling: SamplingParams | None = None, stop: Sequence[str] = (),
              cancel: threading.Event | None = None,
              prefill_progress: Callable[[int, int], None] | None = None) -> Generation:
        found = self._retrieve(conversation, max_tokens) if self._retrieval_documents() else []
        ids, n_prefix = self.render(conversation, sections=found)
        self.last_sections = found
        if n_prefix + ANSWER_RESERVE > self.ctx and n_prefix:
            raise DocumentError(f"the pinned documents take {n_prefix:,} of the {self.ctx:,} context tokens")
        t_request = time.perf_counter()
        seq, reused, source = self.kv.sequence_for(ids, n_prefix, prefill_progress, cancel)
        setup_s = time.perf_counter() - t_request  # cache lookup, disk load / derivation, master prefill
        master_prefilled = self.kv.master_prefilled
        if reused:
            log.info("cache hit: %d of %d prompt tokens reused (from %s)", reused, len(ids), source)
        else:
            log.info("cache miss: %d prompt tokens to prefill", len(ids))
        gen = self.engine.stream(ids[reused:], max_tokens=max_tokens, sampling=sampling, stop=stop,
                                 cache=seq, cancel=cancel, prefill_progress=prefill_progress)
        holder: list[GenerationResult] = []

        def run():
            for chunk in gen:
                yield chunk
            result = gen.result
            result.stats.count_reuse(len(ids), reused - master_prefilled, source, setup_s)
            if n_prefix and result.finish_reason != "cancelled":
                result.stats.pinned_tokens = self._pin(ids, n_prefix)
            if record:
                message = {"role": "assistant", "content": result.text}
                if result.finish_reason == "cancelled":
                    message["interrupted"] = True
                self.messages.append(message)
            holder.append(result)

        generation = Generation(run(), holder)
        generation.retrieved = [s.as_dict() for s in found]  # the sections this answer was shown
        return generation

    def send(self, text: str, **options) -> Generation:
        """Add a user message and start the answer (iterate the Generation for text)."""
        if not text.strip():
            raise EngineError("the message is empty")
        self.messages.append({"role": "user", "content": text})
        try:
            return self._turn(self._conversation(), record=True, **options)
        except Exception:
            self.messages.pop()
            raise

    def ask(self, question: str, **options) -> Generation:
        """Answer a question about the pinned documents, outside the conversation (the
        conversation is neither part of the prompt nor extended)."""
        if not question.strip():
            raise EngineError("the question is empty")
        return self._turn([{"role": "user", "content": question}], record=False, **options)

    def regenerate(self, **options) -> Generation:
        """Answer the last user message again (the previous answer is replaced)."""
        while self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages:
            raise EngineError("there is no message to answer")
        return self._turn(self._conversation(), record=True, **options)

    def edit(self, index: int, text: str, **options) -> Generation:
        """Replace user message `index`, forget everything after it, and answer it again."""
        if not 0 <= index < len(self.messages) or self.messages[index]["role"] != "user":
            raise EngineError(f"message {index} is not a user message")
        del self.messages[index:]
        return self.send(text, **options)

    def _conversation(self) -> list[dict]:
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def reset(self) -> None:
        """Start a new conversation with the same documents (their blocks stay pinned)."""
        self.messages.clear()


__all__ = ["Session", "Document", "DocumentError", "read_document", "ANSWER_RESERVE", "DOC_MODES",
           "RETRIEVAL_TOKENS", "MIN_RETRIEVAL_TOKENS", "check_retrieval_tokens", "StreamChunk"]
