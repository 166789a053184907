"""The pinned documents of the main window: add (read and prefilled in the worker, then kept in
the Store), pin / unpin, remove, and the panel's rows following what the engine holds.

Rows and the worker know a document by a key: ``d<id>`` for one from the Store, ``new<n>`` for
one still being read; ``doc_ids`` maps keys to Store ids once a document is in the Store.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject

from .protocol import (
    AddDocument, DocumentAdded, DocumentFailed, DocumentPinned, DocumentsChanged, RemoveDocument,
    SetPinned, StoredDocument,
)
from .store import NotFound

if TYPE_CHECKING:
    from .window import MainWindow


class DocumentsController(QObject):
    def __init__(self, window: "MainWindow"):
        super().__init__(window)
        self.w = window
        self.doc_ids: dict[str, int] = {}       # panel/worker key -> Store document id
        self._new_keys = itertools.count(1)
        panel = window.documents
        panel.addFilesRequested.connect(self.add)
        panel.pinToggled.connect(self.set_pinned)
        panel.removeRequested.connect(self.remove)

    def _conv(self) -> int | None:
        return self.w.conversations.conv_id

    # -- a conversation opened ------------------------------------------------------------
    def show_stored(self, conv_id: int) -> None:
        """The panel shows the conversation's documents as the Store has them."""
        panel = self.w.documents
        panel.clear()
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
                                       pinned=info.pinned, n_tokens=info.n_tokens)
        except NotFound:  # the conversation was deleted meanwhile
            return
        self.doc_ids[info.key] = doc.id
        if result.conv == self._conv():
            w.documents.set_info(info.key, info.as_dict())
            w.clear_error("document")
            w.statusBar().showMessage(f"Pinned {info.name} ({info.n_tokens:,} tokens)", 5000)

    def on_failed(self, result: DocumentFailed) -> None:
        w = self.w
        if w.closed:
            return
        if result.key not in self.doc_ids and result.conv == self._conv():
            w.documents.remove_row(result.key)
        w.show_error(result.failure.message, "document")

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
