"""What the main window's controllers use of the window, as a :class:`typing.Protocol`.

The controllers (model_controller, conversations, chat, documents, autotune, arith,
remote_dialog, smoke) are given the window and annotate it as :class:`WindowSurface` rather than importing
:mod:`.window`, which imports them: the window satisfies the Protocol by its shape, nothing
registers it. The sibling controllers a controller reaches through the window (``w.models``,
``w.conversations``, ``w.chat``, ``w.docs``) are Protocols here too, for the same reason.

Each Protocol lists exactly the members the controllers touch (tests/test_desktop_surface.py
compares them with the controllers' source and checks a real window has them): a controller
that needs more of the window adds it here first. The window is also each controller's Qt
parent (``super().__init__(window)``, the parent of its dialogs and menus), a QMainWindow; a
Protocol cannot say that as well, so only the three QWidget methods called on it are listed.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from PySide6.QtCore import SignalInstance
from PySide6.QtWidgets import (
    QDialog, QLabel, QListWidget, QProgressBar, QPushButton, QSpinBox, QStackedWidget, QStatusBar,
    QWidget,
)

from .documents_panel import DocumentsPanel
from .kv_panel import KVPanel
from .markdown import TranscriptView
from .protocol import Failure, StoredDocument
from .store import Message, Store
from .widgets import ChatInput, StageProgressBar
from .worker import EngineWorker


@runtime_checkable
class ModelsSurface(Protocol):
    """``window.models`` (a ModelController), as the other controllers use it."""

    model_info: dict | None
    loadStarted: SignalInstance
    loaded: SignalInstance
    failed: SignalInstance

    @property
    def ready(self) -> bool: ...

    def saved_endpoint(self) -> dict | None: ...

    def connect_remote(self, base_url: str, api_key: str | None, model: str | None) -> None: ...


@runtime_checkable
class ConversationsSurface(Protocol):
    """``window.conversations`` (a ConversationsController), as the other controllers use it."""

    conv_id: int | None

    def new(self) -> int: ...

    def title_from_first_message(self, conv_id: int, text: str) -> None: ...

    def show_messages(self, conv_id: int) -> None: ...

    def model_changed(self) -> None: ...


@runtime_checkable
class ChatSurface(Protocol):
    """``window.chat`` (a ChatController), as the other controllers use it."""

    def stop_if_in(self, conv_id: int) -> None: ...

    def stop_unless_in(self, conv_id: int) -> None: ...

    def show_last_stats(self, messages: list[Message]) -> None: ...


@runtime_checkable
class DocsSurface(Protocol):
    """``window.docs`` (a DocumentsController), as the other controllers use it."""

    def show_stored(self, conv_id: int) -> None: ...

    def stored_for_worker(self, conv_id: int) -> tuple[StoredDocument, ...]: ...

    def mode_for(self, conv_id: int) -> str: ...

    def budget_for(self, conv_id: int) -> int: ...


@runtime_checkable
class WindowSurface(Protocol):
    """The main window, as its controllers use it."""

    # state and the worker
    store: Store
    worker: EngineWorker
    closed: bool
    # the other controllers
    models: ModelsSurface
    conversations: ConversationsSurface
    chat: ChatSurface
    docs: DocsSurface
    # widgets (built by ui.setup_widgets)
    conv_list: QListWidget
    input: ChatInput
    transcript: TranscriptView
    stack: QStackedWidget
    welcome: QWidget
    welcome_status: QLabel
    model_label: QLabel
    stats_label: QLabel
    load_progress: StageProgressBar
    fetch_progress: QProgressBar
    fetch_cancel_button: QPushButton
    stop_button: QPushButton
    max_tokens_spin: QSpinBox
    kv_panel: KVPanel
    kv_remote_note: QLabel
    documents: DocumentsPanel
    # signals for whoever drives the window (the smoke test)
    modelLoaded: SignalInstance
    answerFinished: SignalInstance
    errorShown: SignalInstance

    @property
    def model_info(self) -> dict | None: ...

    def request(self, request: object) -> None: ...

    def show_error(self, message: str, topic: str = "", failure: Failure | None = None) -> None: ...

    def clear_error(self, topic: str) -> None: ...

    def update_buttons(self) -> None: ...

    def send_message(self, text: str | None = None, *, max_tokens: int | None = None) -> bool: ...

    def ask_remote_key(self, endpoint: dict) -> QDialog: ...

    # QWidget's, called on the window
    def statusBar(self) -> QStatusBar: ...

    def setWindowTitle(self, title: str) -> None: ...

    def close(self) -> bool: ...
