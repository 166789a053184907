"""The pinned documents of the main window: add (read and prefilled in the worker, then kept in
the Store), pin / unpin, remove, and the panel's rows following what the engine holds.

Rows and the worker know a document by a key: ``d<id>`` for one from the Store, ``new<n>`` for
one still being read; ``doc_ids`` maps keys to Store ids once a document is in the Store.

Each conversation has a document mode (Auto, Whole document, Retrieval; a Store setting
``doc_mode:<conversation id>``, Auto when never chosen) and a retrieval budget, the tokens of
sections per answer (``retrieval_tokens:<conversation id>``, engine.retrieval.RETRIEVAL_TOKENS
when never chosen, 0 for "fill the context"). A document that does not fit keeps its
row with the fix in place: raise the context (when the model and memory allow one that holds
it) or use retrieval; either re-adds it. The sections an answer was shown are listed under it in
the transcript; clicking one opens :class:`SectionPreview` on the document's text.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QPlainTextEdit, QVBoxLayout

from .protocol import (
    AddDocument, DocumentAdded, DocumentFailed, DocumentPinned, DocumentsChanged, RemoveDocument,
    SetDocMode, SetPinned, SetRetrievalTokens, StoredDocument,
)
from engine.retrieval import RETRIEVAL_TOKENS

from .store import NotFound
from .window_surface import WindowSurface


DEFAULT_DOC_MODE = "auto"


def excerpt(text: str, section: dict) -> str:
    """The part of a document's ``text`` a section names: its lines ``start``..``end``, or its
    pages (a PDF's pages start at form feeds, see engine.documents.join_pages)."""
    start, end = int(section["start"]), int(section["end"])
    if section.get("unit") == "pages":
        pages = text.split("\f")  # pages[i] is page i + 1 (from its first form feed on)
        return "\n\n".join(p.strip() for p in pages[start - 1:end] if p.strip())
    return "\n".join(text.split("\n")[start - 1:end])


def file_excerpt(path: str, section: dict) -> str:
    """:func:`excerpt` of a file too large to hold (its text is not in the Store): its lines
    read from the file, a block at a time; what is wrong if it cannot be read."""
    from engine.documents import read_lines
    from engine.errors import DocumentError

    try:
        return read_lines(path, int(section["start"]), int(section["end"]))
    except DocumentError as exc:
        return exc.user_message


class SectionPreview(QDialog):
    """A section of a document, as the model was shown it, in a read-only view."""

    def __init__(self, parent, name: str, section: dict, text: str):
        super().__init__(parent)
        self.setWindowTitle(f"{name} — {section.get('label', '')}")
        self.resize(640, 480)
        heading = QLabel(f"<b>{name}</b>, {section.get('label', '')} "
                         f"({section.get('tokens', 0):,} tokens, score {section.get('score', 0):.2f})")
        self.view = QPlainTextEdit(text)
        self.view.setReadOnly(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.close)
        layout = QVBoxLayout(self)
        layout.addWidget(heading)
        layout.addWidget(self.view, 1)
        layout.addWidget(buttons)


class DocumentsController(QObject):
    def __init__(self, window: WindowSurface):
        super().__init__(window)
        self.w = window
        self.doc_ids: dict[str, int] = {}       # panel/worker key -> Store document id
        self._new_keys = itertools.count(1)
        self._refused: dict[str, str] = {}      # key -> path of a document that did not fit
        self._paths: dict[str, str] = {}        # key -> path of a file being added
        self.preview: SectionPreview | None = None
        panel = window.documents
        panel.addFilesRequested.connect(self.add)
        panel.pinToggled.connect(self.set_pinned)
        panel.removeRequested.connect(self.remove)
        panel.docModeChanged.connect(self.set_mode)
        panel.retrievalTokensChanged.connect(self.set_budget)
        panel.raiseContextRequested.connect(self.raise_context)
        panel.useRetrievalRequested.connect(self.use_retrieval)
        sections = getattr(window.transcript, "sectionRequested", None)
        if sections is not None:
            sections.connect(self.preview_section)

    def _conv(self) -> int | None:
        return self.w.conversations.conv_id

    # -- the document mode ----------------------------------------------------------------
    def mode_for(self, conv_id: int) -> str:
        return self.w.store.get_setting(f"doc_mode:{conv_id}", DEFAULT_DOC_MODE)

    def set_mode(self, mode: str) -> None:
        """The open conversation reads its documents as ``mode`` from now on."""
        conv = self._conv()
        if conv is None:
            conv = self.w.conversations.new()
        self.w.store.set_setting(f"doc_mode:{conv}", mode)
        self.w.documents.set_doc_mode(mode)
        if self.w.models.model_info is not None:
            for key, row in self.w.documents.rows.items():
                if key in self.doc_ids and row.pin.isChecked():
                    self.w.documents.set_progress(key, 0, 1)
            self.w.request(SetDocMode(conv, mode))

    def budget_for(self, conv_id: int) -> int:
        """The conversation's retrieval budget (tokens of sections per answer, 0: fill the
        context)."""
        value = self.w.store.get_setting(f"retrieval_tokens:{conv_id}", RETRIEVAL_TOKENS)
        return value if isinstance(value, int) and not isinstance(value, bool) else RETRIEVAL_TOKENS

    def set_budget(self, tokens: int) -> None:
        """The open conversation's retrieval budget from its next answer on."""
        conv = self._conv()
        if conv is None:
            conv = self.w.conversations.new()
        self.w.store.set_setting(f"retrieval_tokens:{conv}", int(tokens))
        self.w.documents.set_retrieval_tokens(int(tokens))
        if self.w.models.model_info is not None:
            self.w.request(SetRetrievalTokens(conv, int(tokens)))

    def raise_context(self, key: str, ctx: int) -> None:
        """The row's offer: the context goes up to ``ctx`` (the KV panel's setting, which the
        worker applies first), then the document is read again: re-added if it was refused,
        else the conversation's documents are planned again (it is now read whole)."""
        conv = self._conv()
        if conv is None or ctx <= 0:
            return
        self.w.kv_panel.ctx_spin.setValue(max(ctx, self.w.kv_panel.ctx_spin.value()))
        if key in self._refused:
            self._retry(key)
        else:
            self.w.documents.set_progress(key, 0, 1)
            self.w.request(SetDocMode(conv, self.mode_for(conv)))

    def use_retrieval(self, key: str) -> None:
        """The row's offer: the conversation switches to retrieval and the document is re-added."""
        self.set_mode("retrieval")
        if key in self._refused:
            self._retry(key)

    def _retry(self, key: str) -> None:
        path = self._refused.pop(key)
        self.w.documents.set_progress(key, 0, 1)
        self.w.request(AddDocument(self._conv(), key, path))

    # -- sections in the transcript -------------------------------------------------------
    def preview_section(self, section: dict) -> SectionPreview | None:
        """Opens the text of a section an answer was shown (from the open conversation's
        document of that name)."""
        conv = self._conv()
        if conv is None:
            return None
        doc = next((d for d in self.w.store.documents(conv) if d.name == section.get("document")), None)
        if doc is None:
            self.w.statusBar().showMessage(f"{section.get('document')} is no longer in this conversation", 5000)
            return None
        if self.preview is not None:
            self.preview.close()
        text = excerpt(doc.text, section) if doc.text or not doc.path else file_excerpt(doc.path, section)
        self.preview = SectionPreview(self.w, doc.name, section, text)
        self.preview.show()
        return self.preview

    # -- a conversation opened ------------------------------------------------------------
    def show_stored(self, conv_id: int) -> None:
        """The panel shows the conversation's documents as the Store has them."""
        panel = self.w.documents
        panel.clear()
        self._refused.clear()
        panel.set_doc_mode(self.mode_for(conv_id))
        panel.set_retrieval_tokens(self.budget_for(conv_id))
        for d in self.w.store.documents(conv_id):
            key = f"d{d.id}"
            self.doc_ids[key] = d.id
            panel.add_row(key, d.name).set_info(
                {"name": d.name, "n_tokens": d.n_tokens, "pinned": d.pinned, "cached": False})

    def stored_for_worker(self, conv_id: int) -> tuple[StoredDocument, ...]:
        """The conversation's documents for the worker's Session (the pinned ones' rows show
        that they are being read)."""
        docs = self.w.store.documents(conv_id)
        for d in docs:
            if d.pinned:
                self.w.documents.set_progress(f"d{d.id}", 0, max(d.n_tokens or 0, 1))
        return tuple(StoredDocument(f"d{d.id}", d.name, d.text, d.path, d.pinned) for d in docs)

    # -- requests -------------------------------------------------------------------------
    def _path_of(self, key: str) -> str:
        return self._paths.get(key, "")

    def add(self, paths: list[str]) -> list[str]:
        """Pins files to the open conversation (read and prefilled in the worker); returns the
        rows' keys."""
        w = self.w
        if w.models.model_info is None:
            w.show_error("Load a model before adding documents (their size depends on its tokenizer)",
                         "document")
            return []
        if self._conv() is None:
            w.conversations.new()
        keys = []
        for path in paths:
            key = f"new{next(self._new_keys)}"
            row = w.documents.add_row(key, Path(path).name)
            row.info_label.setText("waiting…")
            self._paths[key] = str(path)
            w.request(AddDocument(self._conv(), key, str(path)))
            keys.append(key)
        return keys

    def set_pinned(self, key: str, pinned: bool) -> None:
        doc_id = self.doc_ids.get(key)
        conv = self._conv()
        if doc_id is None or conv is None:
            return
        self.w.store.set_document_pinned(doc_id, pinned)
        if pinned:
            self.w.documents.set_progress(key, 0, 1)
        self.w.request(SetPinned(conv, key, pinned))

    def remove(self, key: str) -> None:
        if self._refused.pop(key, None) is not None:  # never added: only its row to dismiss
            self.w.documents.remove_row(key)
            return
        doc_id = self.doc_ids.pop(key, None)
        conv = self._conv()
        if doc_id is None or conv is None:
            return
        try:
            self.w.store.remove_document(doc_id)
        except NotFound:
            pass
        self.w.documents.remove_row(key)
        self.w.request(RemoveDocument(conv, key))

    # -- results --------------------------------------------------------------------------
    def on_progress(self, conv: int, key: str, done: int, total: int) -> None:
        if not self.w.closed and conv == self._conv():
            self.w.documents.set_progress(key, done, total)

    def on_added(self, result: DocumentAdded) -> None:
        w = self.w
        if w.closed:
            return
        info = result.info
        try:
            doc = w.store.add_document(result.conv, info.name, result.text, path=info.path,
                                       pinned=info.pinned, n_tokens=info.n_tokens,
                                       sha256=result.sha256)
        except NotFound:  # the conversation was deleted meanwhile
            return
        self.doc_ids[info.key] = doc.id
        self._refused.pop(info.key, None)
        for key, path in list(self._refused.items()):  # the same file added again meanwhile
            if path == info.path:
                self._refused.pop(key)
                w.documents.remove_row(key)
        if result.conv == self._conv():
            w.documents.set_info(info.key, info.as_dict())
            w.clear_error("document")
            w.statusBar().showMessage(f"Pinned {info.name} ({info.n_tokens:,} tokens)", 5000)

    def on_failed(self, result: DocumentFailed) -> None:
        w = self.w
        if w.closed:
            return
        if result.key not in self.doc_ids and result.conv == self._conv():
            row = w.documents.rows.get(result.key)
            if (result.needs_ctx or result.can_retrieve) and row is not None:
                # it was read but does not fit: the row stays, offering what would make it fit
                self._refused[result.key] = self._path_of(result.key)
                w.documents.set_failed(result.key, row.name, result.failure.message,
                                       result.needs_ctx, result.can_retrieve)
            else:
                w.documents.remove_row(result.key)
        w.show_error(result.failure.message, "document", result.failure)

    def on_pinned(self, result: DocumentPinned) -> None:
        if not self.w.closed and result.conv == self._conv():
            self.w.clear_error("document")

    def on_changed(self, result: DocumentsChanged) -> None:
        w = self.w
        if w.closed:
            return
        for info in result.documents:
            doc_id = self.doc_ids.get(info.key)
            if doc_id is None:
                continue
            try:
                stored = w.store.document(doc_id)
                if stored.n_tokens != info.n_tokens:
                    w.store.set_document_tokens(doc_id, info.n_tokens)
                if stored.pinned != info.pinned:
                    w.store.set_document_pinned(doc_id, info.pinned)
            except NotFound:
                pass
        if result.conv == self._conv():
            w.documents.sync([info.as_dict() for info in result.documents])
