"""The engine worker's document requests: add, pin, remove, the conversation's document mode and
retrieval budget. Each checks that the conversation is the open one, brings the engine to the
wanted settings first where the document is read, and ends with the documents the session holds
(``documentsChanged``, :meth:`DocumentRequests.documents_of`) so no row stays "reading…". A
conversation being opened gets its stored documents back through :meth:`DocumentRequests.restore`.
"""

from __future__ import annotations

from pathlib import Path

from .protocol import (
    AddDocument, DocumentAdded, DocumentFailed, DocumentInfo, DocumentPinned, DocumentsChanged, Failure,
    RemoveDocument, SetDocMode, SetPinned, SetRetrievalTokens,
)
from .worker_host import WorkerHost, failure_of


class DocumentRequests:
    def __init__(self, host: WorkerHost):
        self.w = host

    def documents_of(self, conv: int) -> DocumentsChanged:
        """The open session's documents as the window's rows show them."""
        docs = self.w.session.documents if self.w.session is not None else []
        return DocumentsChanged(conv, tuple(self.document_info(d) for d in docs))

    def document_info(self, d) -> DocumentInfo:
        retrieval = d.pinned and d.mode == "retrieval"
        return DocumentInfo(key=d.id, name=d.name, path=d.path, n_tokens=d.n_tokens,
                            pinned=d.pinned, cached=d.cached, mode=d.mode if d.pinned else "whole",
                            sections=len(d.index.chunks) if retrieval and d.index is not None else 0,
                            whole_ctx=self.w.whole_ctx(d.n_tokens) if retrieval else 0)

    def restore(self, session, documents) -> None:
        """Adds a conversation's stored documents (``OpenConversation.documents``) to its new
        ``session`` without reading them into the cache (the caller prepares the pinned prefix);
        one that no longer fits pinned is kept unpinned, one that cannot be read is left out,
        each said on ``error``."""
        from engine.errors import DocumentError

        w = self.w
        for d in documents:
            if not d.text and d.path:       # a file too large to hold: read from it again
                try:
                    try:
                        doc = session.add_document(d.path, name=d.name, prefill=False,
                                                   pinned=d.pinned, doc_id=d.key)
                    except DocumentError as exc:  # e.g. whole mode: kept unpinned if it reads
                        doc = session.add_document(d.path, name=d.name, pinned=False, doc_id=d.key)
                        w.error.emit(Failure(exc.kind, f"{d.name} is no longer pinned: {exc.user_message}"))
                except DocumentError as exc:
                    w.error.emit(Failure(exc.kind, f"{d.name} cannot be read: {exc.user_message}"))
                    continue
                doc.path = d.path
                continue
            try:
                doc = session.add_document(text=d.text, name=d.name, prefill=False,
                                           pinned=d.pinned, doc_id=d.key)
            except DocumentError as exc:    # no longer fits (a smaller context): kept unpinned
                doc = session.add_document(text=d.text, name=d.name, pinned=False, doc_id=d.key)
                w.error.emit(Failure(exc.kind, f"{d.name} is no longer pinned: {exc.user_message}"))
            doc.path = d.path

    def add_document(self, request: AddDocument) -> None:
        from engine.documents import DocumentFile, open_document
        from engine.errors import DocumentError

        w = self.w
        conv, key, path = request.conv, request.key, request.path
        text = None
        try:
            w.check_conv(conv)
            w.apply_settings()          # read it into the cache format the next turn uses
            # a file too large to hold comes as a DocumentFile: read by retrieval from the file
            text = request.text if request.text is not None else open_document(path)
            name = request.name or Path(path).name
            for d in w.session.documents:
                if d.text == text or (getattr(d, "file", None) is not None
                                      and isinstance(text, DocumentFile)
                                      and d.file.sha256 == text.sha256):
                    raise DocumentError(f"{name} is already in this conversation (as {d.name})")

            def progress(done: int, total: int) -> None:
                w.documentProgress.emit(conv, key, int(done), int(total))
                w.publish_kv()

            doc = w.session.add_document(text=text, name=name, progress=progress,
                                         cancel=w.abort, doc_id=key)
            doc.path = str(path) if path else None
        except Exception as exc:
            failure = failure_of(exc, f"document {path or request.name} refused")
            needs_ctx, can_retrieve = 0, False
            if isinstance(text, DocumentFile):  # refused whole: retrieval reads it
                can_retrieve = isinstance(exc, DocumentError) and w.session is not None \
                    and getattr(w.session, "doc_mode", None) == "whole"
            elif isinstance(exc, DocumentError) and text is not None and w.session is not None \
                    and w.engine is not None and not any(d.text == text for d in w.session.documents):
                # it was read but does not fit: the ways to make it fit
                n_tokens = len(w.engine.tokenizer.encode(text))
                needs_ctx = w.whole_ctx(n_tokens)
                can_retrieve = w.session.doc_mode == "whole"
            w.documentFailed.emit(DocumentFailed(conv, key, failure, needs_ctx, can_retrieve))
            return
        w.publish_kv()
        file = getattr(doc, "file", None)
        w.documentAdded.emit(DocumentAdded(conv, self.document_info(doc), doc.text,
                                           file.sha256 if file is not None else None))
        w.documentsChanged.emit(self.documents_of(conv))

    def set_pinned(self, request: SetPinned) -> None:
        w = self.w
        conv, key = request.conv, request.key
        try:
            w.check_conv(conv)
            w.apply_settings()

            def progress(done: int, total: int) -> None:
                w.documentProgress.emit(conv, key, int(done), int(total))

            w.session.set_pinned(key, request.pinned, progress=progress)
        except Exception as exc:
            w.documentFailed.emit(DocumentFailed(conv, key, failure_of(exc, f"pinning {key} failed")))
        else:
            w.documentPinned.emit(DocumentPinned(conv, key, request.pinned))
        w.publish_kv()
        w.documentsChanged.emit(self.documents_of(conv))

    def set_doc_mode(self, request: SetDocMode) -> None:
        """The conversation's document mode (after the current settings, e.g. a raised
        context, are applied); the pinned documents are read as it says, with their progress."""
        w = self.w
        conv = request.conv
        try:
            w.check_conv(conv)
            w.apply_settings()
            keys = [d.id for d in w.session.documents if d.pinned]

            def progress(done: int, total: int) -> None:
                for key in keys:
                    w.documentProgress.emit(conv, key, int(done), int(total))

            w.session.set_doc_mode(request.mode, progress=progress, cancel=w.abort)
            w.prepare_pinned(conv)
        except Exception as exc:
            w.error.emit(failure_of(exc, f"document mode {request.mode} refused"))
        else:
            for d in w.session.documents:
                if d.pinned:
                    w.documentPinned.emit(DocumentPinned(conv, d.id, True))
        w.publish_kv()
        w.documentsChanged.emit(self.documents_of(conv))

    def set_retrieval_tokens(self, request: SetRetrievalTokens) -> None:
        """The conversation's retrieval budget, from its next answer on (a remote server reads
        documents whole: nothing to set)."""
        w = self.w
        try:
            w.check_conv(request.conv)
            setter = getattr(w.session, "set_retrieval_tokens", None)
            if setter is not None:
                setter(request.tokens)
        except Exception as exc:
            w.error.emit(failure_of(exc, f"retrieval budget {request.tokens} refused"))

    def remove_document(self, request: RemoveDocument) -> None:
        w = self.w
        try:
            w.check_conv(request.conv)
            w.session.remove_document(request.key)
        except Exception as exc:
            w.error.emit(failure_of(exc, f"removing {request.key} failed"))
        w.publish_kv()
        w.documentsChanged.emit(self.documents_of(request.conv))
