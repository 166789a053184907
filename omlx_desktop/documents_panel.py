"""The pinned documents of the open conversation: one row per document with its name, token
count, a progress bar while it is read into the KV cache, a "cached" badge once its blocks are
pinned, and pin / remove controls. Above them, the conversation's document mode: Auto (whole
while documents fit the context, else retrieval), Whole document, Retrieval; and its retrieval
budget, the tokens of sections per answer (a spin box; its lowest value means "fill the context").

A document read by retrieval says so ("retrieval, 30 sections") and, when a context the model
and the memory allow would hold it whole, offers to raise the context (a button in its row). A
document that could not be pinned because it does not fit keeps its row with the ways to make
it fit (raise the context, use retrieval) instead of vanishing.

Rows are keyed by the string the window and the worker use for the document. The panel emits
requests (``addFilesRequested``, ``pinToggled``, ``removeRequested``, ``docModeChanged``,
``raiseContextRequested``, ``useRetrievalRequested``, ``retrievalTokensChanged``) and shows what it is told; it never talks
to the engine or the Store itself.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox, QComboBox, QFileDialog, QFrame, QHBoxLayout, QLabel, QProgressBar, QPushButton,
    QScrollArea, QSpinBox, QToolButton, QVBoxLayout, QWidget,
)

from engine.retrieval import MIN_RETRIEVAL_TOKENS, RETRIEVAL_TOKENS

DOCUMENT_FILTER = "Documents (*.txt *.md *.markdown *.pdf);;All files (*)"
DOCUMENT_SUFFIXES = (".txt", ".md", ".markdown", ".text", ".rst", ".pdf", ".csv", ".log", ".json")

DOC_MODES = (("auto", "Auto"), ("whole", "Whole document"), ("retrieval", "Retrieval"))
DOC_MODE_TIPS = {
    "auto": "Documents that fit the context are read whole; longer ones by retrieval",
    "whole": "Every pinned document is read whole (one that does not fit the context is refused)",
    "retrieval": "Per question, the sections that match it best, up to the budget below",
}
FILL_CONTEXT = MIN_RETRIEVAL_TOKENS - 1  # the budget spin box's lowest value: "fill the context" (0)
MAX_RETRIEVAL_TOKENS = 131_072

BADGE_STYLE = ("QLabel { background: #16a34a; color: white; border-radius: 7px;"
               " padding: 1px 7px; font-size: 11px; font-weight: 600; }")


class DocumentRow(QFrame):
    def __init__(self, key: str, name: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.key = key
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setObjectName("documentRow")
        self.name_label = QLabel(name)
        font = self.name_label.font()
        font.setBold(True)
        self.name_label.setFont(font)
        self.name_label.setToolTip(name)
        self.name_label.setMinimumWidth(60)
        self.info_label = QLabel("waiting…")
        self.info_label.setStyleSheet("color: palette(mid);")
        self.badge = QLabel("cached")
        self.badge.setStyleSheet(BADGE_STYLE)
        self.badge.setToolTip("Its KV blocks are prefilled and pinned: questions reuse them")
        self.badge.setVisible(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)
        self.progress.setMaximumHeight(12)
        self.progress.setTextVisible(False)
        self.pin = QCheckBox("Pinned")
        self.pin.setChecked(True)
        self.pin.setEnabled(False)
        self.pin.setToolTip("Pinned documents are part of every prompt of this conversation")
        self.remove = QToolButton()
        self.remove.setText("✕")
        self.remove.setToolTip("Remove the document from this conversation")
        self.remove.setAutoRaise(True)
        self.remove.setEnabled(False)  # once it is in the conversation
        # the way to make it fit: a message and up to two buttons (hidden while not needed)
        self.offer = QWidget()
        self.offer_label = QLabel()
        self.offer_label.setWordWrap(True)
        self.raise_button = QPushButton()
        self.retrieval_button = QPushButton("Use retrieval")
        self.retrieval_button.setToolTip("Read this conversation's documents by retrieval: per "
                                         "question, the sections that match it best")
        self.raise_ctx = 0
        offer_buttons = QHBoxLayout()
        offer_buttons.setContentsMargins(0, 0, 0, 0)
        offer_buttons.addWidget(self.raise_button)
        offer_buttons.addWidget(self.retrieval_button)
        offer_buttons.addStretch(1)
        offer_layout = QVBoxLayout(self.offer)
        offer_layout.setContentsMargins(0, 2, 0, 0)
        offer_layout.setSpacing(2)
        offer_layout.addWidget(self.offer_label)
        offer_layout.addLayout(offer_buttons)
        self.offer.setVisible(False)
        self.failed = False  # not pinned: it does not fit (the offer says how to make it fit)

        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.name_label, 1)
        top.addWidget(self.badge)
        top.addWidget(self.remove)
        bottom = QHBoxLayout()
        bottom.setContentsMargins(0, 0, 0, 0)
        bottom.addWidget(self.info_label, 1)
        bottom.addWidget(self.pin)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(2)
        layout.addLayout(top)
        layout.addLayout(bottom)
        layout.addWidget(self.progress)
        layout.addWidget(self.offer)

    @property
    def name(self) -> str:
        return self.name_label.text()

    def set_progress(self, done: int, total: int) -> None:
        """Being read into the KV cache (again, e.g. for a new KV preset): not cached until
        :meth:`set_info` says so."""
        self.badge.setVisible(False)
        self.offer.setVisible(False)
        self.failed = False
        self.progress.setVisible(True)
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(min(done, total))
        self.info_label.setText(f"reading… {done:,} / {total:,} tokens")

    def set_info(self, info: dict) -> None:
        self.name_label.setText(info.get("name", self.name))
        n = info.get("n_tokens")
        pinned = bool(info.get("pinned", True))
        retrieval = pinned and info.get("mode") == "retrieval"
        text = f"{n:,} tokens" if n else "not counted yet"
        if retrieval:
            sections = info.get("sections") or 0
            text += f" · retrieval, {sections:,} sections" if sections else " · retrieval"
        self.info_label.setText(text)
        self.badge.setText("indexed" if retrieval else "cached")
        self.badge.setToolTip("Its sections are indexed: each question is shown the best ones"
                              if retrieval else
                              "Its KV blocks are prefilled and pinned: questions reuse them")
        self.badge.setVisible(bool(info.get("cached")) and pinned)
        self.progress.setVisible(False)
        self.failed = False
        whole_ctx = int(info.get("whole_ctx") or 0) if retrieval else 0
        if whole_ctx:
            self._show_offer("Longer than the context: questions see its best sections.",
                             whole_ctx, False)
        else:
            self.offer.setVisible(False)
        self.pin.blockSignals(True)
        self.pin.setChecked(pinned)
        self.pin.blockSignals(False)
        self.pin.setEnabled(True)
        self.remove.setEnabled(True)

    def _show_offer(self, message: str, raise_ctx: int, can_retrieve: bool) -> None:
        self.raise_ctx = raise_ctx
        self.offer_label.setText(message)
        self.raise_button.setText(f"Raise context to {raise_ctx:,}" if raise_ctx else "")
        self.raise_button.setToolTip("The model and the memory allow this context: the document "
                                     "is read whole")
        self.raise_button.setVisible(bool(raise_ctx))
        self.retrieval_button.setVisible(can_retrieve)
        self.offer.setVisible(True)

    def set_failed(self, message: str, raise_ctx: int, can_retrieve: bool) -> None:
        """Not pinned: ``message`` says why, and the buttons offer what would make it fit."""
        self.failed = True
        self.progress.setVisible(False)
        self.badge.setVisible(False)
        self.info_label.setText("not pinned: it does not fit")
        if not raise_ctx and not can_retrieve:
            message += " No larger context fits the model and memory."
        self._show_offer(message, raise_ctx, can_retrieve)
        self.pin.setEnabled(False)
        self.remove.setEnabled(True)  # dismisses it


class DocumentsPanel(QWidget):
    addFilesRequested = Signal(list)        # [path]
    pinToggled = Signal(str, bool)          # key, pinned
    removeRequested = Signal(str)           # key
    docModeChanged = Signal(str)            # "auto" | "whole" | "retrieval"
    raiseContextRequested = Signal(str, int)  # key, context
    useRetrievalRequested = Signal(str)     # key
    retrievalTokensChanged = Signal(int)    # tokens of sections per answer (0: fill the context)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.rows: dict[str, DocumentRow] = {}
        self.add_button = QPushButton("Add document…")
        self.add_button.setToolTip("Pin a .txt, .md or .pdf file to this conversation")
        hint = QLabel("or drop .txt / .md / .pdf files on the window")
        hint.setStyleSheet("color: palette(mid);")
        hint.setWordWrap(True)
        head = QHBoxLayout()
        head.setContentsMargins(0, 0, 0, 0)
        head.addWidget(self.add_button)
        head.addWidget(hint, 1)
        self.mode_box = QComboBox()
        for mode, label in DOC_MODES:
            self.mode_box.addItem(label, mode)
            self.mode_box.setItemData(self.mode_box.count() - 1, DOC_MODE_TIPS[mode],
                                      Qt.ItemDataRole.ToolTipRole)
        self.mode_box.setToolTip("How this conversation's documents are put in the prompt")
        self.mode_box.currentIndexChanged.connect(
            lambda i: self.docModeChanged.emit(self.mode_box.itemData(i)))
        self.mode_box.currentIndexChanged.connect(lambda _i: self._enable_budget())
        mode_row = QHBoxLayout()
        mode_row.setContentsMargins(0, 0, 0, 0)
        mode_row.addWidget(QLabel("Read documents:"))
        mode_row.addWidget(self.mode_box, 1)
        self.budget_spin = QSpinBox()
        self.budget_spin.setRange(FILL_CONTEXT, MAX_RETRIEVAL_TOKENS)
        self.budget_spin.setSingleStep(100)
        self.budget_spin.setSpecialValueText("fill the context")
        self.budget_spin.setSuffix(" tokens")
        self.budget_spin.setKeyboardTracking(False)  # one change when the typing is done
        self.budget_spin.setToolTip(
            "Documents read by retrieval: per answer, the best sections up to this many tokens. "
            "Fewer tokens answer sooner and mix in less unrelated text; more can hold facts "
            "spread over several sections")
        self.budget_spin.valueChanged.connect(
            lambda _v: self.retrievalTokensChanged.emit(self.retrieval_tokens()))
        budget_row = QHBoxLayout()
        budget_row.setContentsMargins(0, 0, 0, 0)
        self.budget_label = QLabel("Sections per answer:")
        budget_row.addWidget(self.budget_label)
        budget_row.addWidget(self.budget_spin, 1)

        self.empty_label = QLabel("No documents pinned to this conversation.")
        self.empty_label.setStyleSheet("color: palette(mid);")
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._list = QWidget()
        self._list_layout = QVBoxLayout(self._list)
        self._list_layout.setContentsMargins(0, 0, 0, 0)
        self._list_layout.setSpacing(4)
        self._list_layout.addWidget(self.empty_label)
        self._list_layout.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(self._list)
        # room for one document's row under the three rows of controls: the splitter's pane
        # cannot squeeze the list away (it showed a sliver of the row under "Sections per answer")
        sample = DocumentRow("", "sample.txt")
        self.row_height = sample.sizeHint().height()
        sample.deleteLater()
        scroll.setMinimumHeight(self.row_height)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addLayout(head)
        layout.addLayout(mode_row)
        layout.addLayout(budget_row)
        layout.addWidget(scroll, 1)
        self.add_button.clicked.connect(self.choose_files)
        self.set_retrieval_tokens(RETRIEVAL_TOKENS)
        self._enable_budget()

    def choose_files(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Pin documents", "", DOCUMENT_FILTER)
        if paths:
            self.addFilesRequested.emit(paths)

    def doc_mode(self) -> str:
        return self.mode_box.currentData()

    def set_doc_mode(self, mode: str) -> None:
        """Shows ``mode`` (without emitting docModeChanged)."""
        index = max(self.mode_box.findData(mode), 0)
        self.mode_box.blockSignals(True)
        self.mode_box.setCurrentIndex(index)
        self.mode_box.blockSignals(False)
        self._enable_budget()

    def _enable_budget(self) -> None:
        self.budget_spin.setEnabled(self.doc_mode() != "whole")

    def retrieval_tokens(self) -> int:
        value = self.budget_spin.value()
        return 0 if value == FILL_CONTEXT else value

    def set_retrieval_tokens(self, tokens: int) -> None:
        """Shows the budget ``tokens`` (0: fill the context) without emitting
        retrievalTokensChanged."""
        self.budget_spin.blockSignals(True)
        self.budget_spin.setValue(FILL_CONTEXT if not tokens else int(tokens))
        self.budget_spin.blockSignals(False)

    # -- rows -----------------------------------------------------------------------------
    def add_row(self, key: str, name: str) -> DocumentRow:
        row = self.rows.get(key)
        if row is None:
            row = DocumentRow(key, name, self._list)
            row.pin.toggled.connect(lambda on, k=key: self.pinToggled.emit(k, on))
            row.remove.clicked.connect(lambda _=False, k=key: self.removeRequested.emit(k))
            row.raise_button.clicked.connect(
                lambda _=False, r=row: self.raiseContextRequested.emit(r.key, r.raise_ctx))
            row.retrieval_button.clicked.connect(
                lambda _=False, k=key: self.useRetrievalRequested.emit(k))
            self.rows[key] = row
            self._list_layout.insertWidget(self._list_layout.count() - 1, row)
        self.empty_label.setVisible(False)
        return row

    def set_progress(self, key: str, done: int, total: int) -> None:
        if key in self.rows:
            self.rows[key].set_progress(done, total)

    def set_failed(self, key: str, name: str, message: str, raise_ctx: int, can_retrieve: bool) -> None:
        (self.rows.get(key) or self.add_row(key, name)).set_failed(message, raise_ctx, can_retrieve)

    def set_info(self, key: str, info: dict) -> None:
        row = self.rows.get(key) or self.add_row(key, info.get("name", key))
        row.set_info(info)

    def sync(self, infos: list[dict]) -> None:
        """The worker's list of the conversation's documents: rows follow it (rows still being
        read stay)."""
        keys = {i["key"] for i in infos}
        for key in list(self.rows):
            row = self.rows[key]
            if key not in keys and row.pin.isEnabled() and not row.failed:
                self.remove_row(key)
        for info in infos:
            self.set_info(info["key"], info)

    def remove_row(self, key: str) -> None:
        row = self.rows.pop(key, None)
        if row is not None:
            # hidden and deleted in place: setParent(None) would make it a top-level window for
            # a moment, and one holding the focus would become the active window (taking the
            # window's shortcuts with it)
            self._list_layout.removeWidget(row)
            row.hide()
            row.deleteLater()
        self.empty_label.setVisible(not self.rows)

    def clear(self) -> None:
        for key in list(self.rows):
            self.remove_row(key)

    def keys(self) -> list[str]:
        return list(self.rows)
