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
from .kv.paged import OVERFLOW_POLICIES, PagedKVCache
from .kv.prefix import PrefixCache
from .sampling import SamplingParams

log = logging.getLogger("omlx.session")

ANSWER_RESERVE = 256  # context tokens a pinned prefix must leave for a question and its answer
TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".text", ".rst", ".csv", ".log", ".json", ".py"}


from .documents import document_text, plain_text, read_document  # noqa: E402,F401  (read_document: its old home)
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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def system_content(system_prompt: str | None, documents: Sequence, sections: Sequence = ()) -> str | None:
    """The system turn every source renders the same way: the system prompt, each whole document
    (``.name``, ``.text``), then retrieved ``sections`` (engine.retrieval.Section) grouped per
    document in the order they come; None when there is nothing."""
    from .retrieval import render_sections

    parts = [system_prompt] if system_prompt else []
    if documents or sections:
        parts.append("Answer using these documents.")
        for d in documents:
            parts.append(f"Document: {d.name}\n\n{plain_text(d.text).strip()}")
        names = list(dict.fromkeys(s.document for s in sections))
        for name in names:
            parts.append(render_sections(name, [s for s in sections if s.document == name]))
    return "\n\n".join(parts) if parts else None


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
        if overflow not in OVERFLOW_POLICIES:
            raise EngineError(f"overflow policy must be one of {', '.join(OVERFLOW_POLICIES)}, not {overflow!r}")
        self.overflow = overflow
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
        self._cache: PrefixCache | None = None
        self._live: PagedKVCache | None = None
        self._pinned_keys: list[bytes] = []
        self._saved_key: bytes | None = None
        self._prefix_memo: tuple[str, str, list[int]] | None = None  # (system content, text, ids)
        self._master_prefilled = 0  # tokens the last _sequence_for prefilled into the master copy

    # -- settings -------------------------------------------------------------------------
    def set_overflow(self, policy: str) -> None:
        if policy not in OVERFLOW_POLICIES:
            raise EngineError(f"overflow policy must be one of {', '.join(OVERFLOW_POLICIES)}, not {policy!r}")
        self.overflow = policy
        self._release_live()

    def set_ctx(self, ctx: int) -> None:
        if not 64 <= ctx <= self.engine.model.context_length:
            raise EngineError(f"ctx must be between 64 and {self.engine.model.context_length:,}")
        self.ctx = int(ctx)
        self._release_live()
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
        self._release_live()
        self._repin()

    def _prefix_cache(self) -> PrefixCache:
        """The engine's prefix cache for its current KV config; a config change drops the live
        sequence and the pins made under the old one (their blocks go with the old cache)."""
        cache = self.engine.prefix_cache()
        if cache is not self._cache:
            self._release_live()
            if self._cache is not None:
                self._cache.unpin(self._pinned_keys)
            self._pinned_keys = []
            self._saved_key = None
            for doc in self.documents:
                doc.cached = doc.mode == "retrieval" and doc.index is not None
            self._cache = cache
        return cache

    def _release_live(self) -> None:
        if self._live is not None:
            self._live.release()
            self._live = None

    def close(self) -> None:
        """Release the live sequence and this session's pins."""
        self._release_live()
        if self._cache is not None:
            self._cache.unpin(self._pinned_keys)
        self._pinned_keys = []

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
        e, tok = self.engine, self.engine.tokenizer
        system = self._system_content(documents, sections)
        if e.has_chat_template:
            system_msgs = [{"role": "system", "content": system}] if system else []
            if not system_msgs:
                return e.encode_chat(list(conversation), add_generation_prompt), 0
            prefix_text, prefix_ids = self._encoded_prefix(system)
            full_text = tok.apply_chat_template(system_msgs + list(conversation),
                                                add_generation_prompt=add_generation_prompt)
            if not full_text.startswith(prefix_text):  # a template that rewrites the system turn
                return e.encode_chat(system_msgs + list(conversation), add_generation_prompt), 0
            rest = full_text[len(prefix_text):]
            return prefix_ids + (tok.encode(rest, add_bos=False, parse_special=True) if rest else []), len(prefix_ids)
        # A base model: a plain transcript.
        lines = []
        for m in conversation:
            who = "Question" if m["role"] == "user" else "Answer"
            lines.append(f"{who}: {m['content'].strip()}")
        rest = "\n".join(lines) + ("\nAnswer:" if add_generation_prompt else "")
        if not system:
            return tok.encode(rest, add_bos=True, parse_special=False), 0
        prefix_ids = self._encoded_prefix(system)[1]
        return prefix_ids + tok.encode(rest, add_bos=False, parse_special=False), len(prefix_ids)

    def _encoded_prefix(self, system: str) -> tuple[str, list[int]]:
        """The pinned prefix's rendered text and token ids for a system content. Remembered for
        the last content: every turn renders the prefix, and tokenizing pinned documents again
        each time (thousands of tokens) is work the first turn already did."""
        if self._prefix_memo is None or self._prefix_memo[0] != system:
            e, tok = self.engine, self.engine.tokenizer
            if e.has_chat_template:
                system_msgs = [{"role": "system", "content": system}]
                text = tok.apply_chat_template(system_msgs, add_generation_prompt=False)
                ids = e.encode_chat(system_msgs, add_generation_prompt=False)
            else:
                text = system + "\n\n"
                ids = tok.encode(text, add_bos=True, parse_special=False)
            self._prefix_memo = (system, text, ids)
        return self._prefix_memo[1], list(self._prefix_memo[2])

    def prefix_tokens(self, documents: Sequence[Document] | None = None) -> int:
        return self.render([], documents, add_generation_prompt=False)[1]

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
        name, text = document_text(source, text, name)
        doc = Document(name=name, text=text, path=str(source) if source is not None else None,
                       pinned=pinned)
        if doc_id is not None:
            doc.id = doc_id
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
        while True:
            found = retrieval.sections(chosen, self._count_tokens)
            n_prefix = self.render([], add_generation_prompt=False, sections=found)[1]
            if n_prefix <= self.ctx - conversation_tokens - answer_room or len(chosen) <= 1:
                return found
            # the labels took more than estimated: the weakest chunk goes
            weakest = min(range(len(chosen)), key=lambda i: (chosen[i].score, -i))
            chosen = chosen[:weakest] + chosen[weakest + 1:]

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
        seq, reused, source = self._sequence_for(ids[:n_prefix], n_prefix, progress, cancel)
        if reused:
            log.info("cache hit: %d of %d prompt tokens reused (from %s)", reused, n_prefix, source)
        if reused < n_prefix:
            if self.engine.prefill(ids[reused:n_prefix], seq, progress, cancel) is None:
                return reused - self._master_prefilled
        elif progress:
            progress(n_prefix, n_prefix)
        self._pin(ids, n_prefix)
        return reused - self._master_prefilled

    # -- pinning --------------------------------------------------------------------------
    def _pin(self, ids: Sequence[int], n_prefix: int) -> int:
        """Pin the full blocks of the prefix and save them to disk; returns pinned tokens."""
        cache = self._prefix_cache()
        n_blocks = n_prefix // cache.B
        keys = cache.chain_keys(ids[: n_blocks * cache.B])
        keys = keys[: cache.usable_blocks(keys)]  # the leading blocks that are really cached
        cache.pin(keys)
        cache.unpin(self._pinned_keys)
        self._pinned_keys = keys
        if keys and self._saved_key != keys[-1]:
            cache.save(keys)
            self._saved_key = keys[-1]
        for doc in self.documents:
            if doc.mode == "retrieval":
                doc.cached = doc.pinned and doc.index is not None
            else:
                doc.cached = doc.pinned and bool(keys)
        return n_prefix if keys else 0

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
        if self._cache is None:
            return
        ids, n_prefix = self.render([], add_generation_prompt=False)
        keep = set(self._cache.chain_keys(ids[: n_prefix - n_prefix % self._cache.B])) if n_prefix else set()
        dropped = [k for k in self._pinned_keys if k not in keep]
        self._cache.unpin(dropped)
        self._pinned_keys = [k for k in self._pinned_keys if k in keep]

    # -- turns ----------------------------------------------------------------------------
    def _sequence_for(self, ids: Sequence[int], n_prefix: int,
                      progress: Callable[[int, int], None] | None = None,
                      cancel: threading.Event | None = None) -> tuple[PagedKVCache, int, str]:
        """A sequence holding the longest reusable prefix of `ids` (leaving at least one token
        to prefill): the live one, trimmed or extended, or a new one from the prefix cache.

        A pinned prefix the cache cannot supply is computed in the master layout first (when
        the current layout derives from it: kv.requantize) and derived, so a later switch to
        another derivable layout does not prefill it again; `_master_prefilled` says how many
        tokens that took (progress and cancel apply to it)."""
        self._master_prefilled = 0
        cache = self._prefix_cache()
        live = self._live
        if live is not None:
            history = live.history
            common = _common_prefix(history, ids)
            if live.dropped_tokens:
                if common == len(history) and len(ids) > common:
                    live.protected_tokens = n_prefix
                    return live, common, "memory"
            else:
                common = min(common, len(ids) - 1)
                in_memory = cache.usable_blocks(cache.chain_keys(ids, (len(ids) - 1) // cache.B)) * cache.B
                if common > 0 and common >= in_memory:
                    try:
                        live.trim(len(history) - common)
                        live.protected_tokens = n_prefix
                        return live, common, "memory"
                    except ValueError:
                        pass  # a sliding window already released what the trim needs
            self._release_live()
        seq = cache.new_sequence(limit=self.ctx, overflow=self.overflow, protected_tokens=n_prefix)
        reuse = cache.attach(seq, ids)
        prefix_blocks = min(n_prefix, len(ids) - 1) // cache.B
        if reuse.tokens < prefix_blocks * cache.B and cache.derives_from_master:
            before = reuse.tokens
            if self.engine.prefill_master(ids[:n_prefix], progress, cancel):
                seq.release()
                seq = cache.new_sequence(limit=self.ctx, overflow=self.overflow, protected_tokens=n_prefix)
                reuse = cache.attach(seq, ids)
                self._master_prefilled = max(0, reuse.tokens - before)
        self._live = seq
        return seq, reuse.tokens, reuse.source

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
        seq, reused, source = self._sequence_for(ids, n_prefix, prefill_progress, cancel)
        setup_s = time.perf_counter() - t_request  # cache lookup, disk load / derivation, master prefill
        master_prefilled = self._master_prefilled
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
            st = result.stats
            st.prompt_tokens = len(ids)
            st.cached_tokens = reused - master_prefilled
            st.cache_source = source if st.cached_tokens else "none"
            if st.ttft_s:
                st.ttft_s += setup_s  # from the question, not from the start of the prefill
            if n_prefix and result.finish_reason != "cancelled":
                st.pinned_tokens = self._pin(ids, n_prefix)
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
