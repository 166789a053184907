"""The main window: the widget tree (:mod:`.ui`), the engine's worker in its own thread, and the
controllers that give the widgets their behaviour, wired together here.

    models          ModelController         fetch / load state machine, KV settings (model_controller.py)
    arith           ArithController         the weight arithmetic setting and its cost (arith.py)
    hub_dialog      HubDialog               File → Download from Hugging Face… (hub_dialog.py)
    remote_dialog   RemoteDialog            File → Connect to a server… (remote_dialog.py)
    conversations   ConversationsController the conversation list, opening one (conversations.py)
    chat            ChatController          a turn: send, stream to the Store, stop (chat.py)
    docs            DocumentsController     pinned documents (documents.py)
    draft_menu      DraftMenu               Chat → Draft model, the draft-model picker (draft_menu.py)

Threads: the window (UI thread) owns the Store and every widget; the worker owns the engine.
Requests go to the worker as :mod:`.protocol` dataclasses through one queued signal
(:meth:`request`); results come back by the worker's signals, delivered in the UI thread. The UI
thread never waits on the worker, except for a bounded wait when the window closes. The one
thing both threads touch is the :class:`~omlx_desktop.worker.KVHolder` (lock-protected) the
memory chart reads.

The window owns the worker thread: closing stops it (the running request ends at its next check
of the abort Event) and waits up to ``CLOSE_WAIT_MS``; a thread still running then (a model
load) is waited for by :meth:`wait_for_engine`, which the application calls before it exits.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from PySide6.QtCore import QByteArray, Qt, QThread, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMainWindow, QMenu

from . import applog
from .arith import ArithController
from .autotune import AutoTuneController
from .chat import ChatController, Turn, stats_text
from .conversations import ConversationsController
from .documents import DocumentsController
from .draft_menu import DraftMenu
from .hub_dialog import HubDialog
from .model_controller import ModelController, model_text
from .protocol import Configure, Failure, SetSpeculate, Shutdown
from .remote_dialog import RemoteDialog
from .serve_panel import install as install_serve_panel
from .smoke import SmokeTestDriver
from .store import Store
from .ui import APP_TITLE, DEFAULT_MAX_TOKENS, setup_widgets
from .widgets import ChatInput, ErrorBanner, app_icon, plain_text, resource_path  # noqa: F401
from .worker import EngineWorker, KVHolder

log = logging.getLogger("omlx.desktop")

CLOSE_WAIT_MS = 60_000          # closing waits this long at most for the worker to finish

__all__ = ["MainWindow", "APP_TITLE", "DEFAULT_MAX_TOKENS", "ChatInput", "ErrorBanner", "Turn",
           "app_icon", "resource_path"]


class MainWindow(QMainWindow):
    requested = Signal(object)          # a protocol request, queued to the worker's thread

    # for whoever drives the window (tests, --smoke-test)
    modelLoaded = Signal(object)
    answerFinished = Signal(object)     # see ChatController.answerFinished
    errorShown = Signal(str)

    def __init__(self, store: Store | None = None, *, data_dir: str | os.PathLike | None = None,
                 model: str | None = None, smoke_test: bool = False,
                 max_tokens: int = DEFAULT_MAX_TOKENS):
        super().__init__()
        self._owns_store = store is None
        if store is None:
            store = Store(Path(data_dir) / "omlx.db" if data_dir is not None else None)
        self.store = store
        self.log_path, self._log_handler = applog.open_log(store.path.parent)
        self.recovered = store.recover_interrupted()
        self.errors: list[str] = []
        self.closed = False
        self.hub_dialog: HubDialog | None = None
        self.remote_dialog: RemoteDialog | None = None

        self.setWindowTitle(APP_TITLE)
        self.setWindowIcon(app_icon())
        self.setMinimumSize(960, 620)
        self.resize(1360, 860)
        self.setAcceptDrops(True)

        self.kv_holder = KVHolder()
        setup_widgets(self)
        self.max_tokens_spin.setValue(max_tokens)
        self.models = ModelController(self)
        self.conversations = ConversationsController(self)
        self.chat = ChatController(self)
        self.docs = DocumentsController(self)
        self._connect_widgets()
        self._build_actions()
        self.serve_panel = install_serve_panel(self)    # after the draft menu: it follows its choice
        self._start_worker()
        self.autotune = AutoTuneController(self)    # the KV panel's Auto preset <-> the worker
        self._restore_layout()
        self.smoke = SmokeTestDriver(self) if smoke_test else None

        panel_state = self.store.get_setting("kv_panel")
        try:
            self.kv_panel.set_state(panel_state)
        except Exception:  # a damaged setting must not keep the app from starting
            log.exception("ignoring the saved KV settings %r", panel_state)
        self.request(Configure.from_panel(self.kv_panel.settings()))
        self.request(SetSpeculate("lookup" if self.speculate_action.isChecked() else "off"))
        self.draft_menu.start()
        self.arith = ArithController(self)          # sends the restored choice before the model loads
        self.kv_panel.settingsChanged.connect(self.models.on_kv_settings_changed)
        self.kv_panel.importFailed.connect(
            lambda message: self.show_error(f"Cannot use these KV settings: {message}", "settings"))

        self.conversations.reload(select=None)
        self.update_buttons()
        self.input.setFocus()
        self.models.start(model, fetch_if_missing=smoke_test)

    # -- wiring ---------------------------------------------------------------------------
    def _connect_widgets(self) -> None:
        self.new_button.clicked.connect(self.new_conversation)
        self.rename_button.clicked.connect(self.conversations.rename_current)
        self.delete_button.clicked.connect(lambda: self.delete_conversation(self.conv_id))
        self.open_button.clicked.connect(self.models.open_dialog)
        self.welcome_open_button.clicked.connect(self.models.open_dialog)
        self.fetch_button.clicked.connect(self.models.fetch_default)
        self.fetch_cancel_button.clicked.connect(self.models.cancel_fetch)
        self.welcome_hub_button.clicked.connect(self.open_hub_dialog)
        self.input.submitted.connect(self.send_message)
        self.send_button.clicked.connect(lambda: self.send_message())   # not clicked(bool) as the text
        self.stop_button.clicked.connect(self.stop_generation)
        self.regenerate_button.clicked.connect(self.regenerate)
        self.copy_button.clicked.connect(self.copy_last_answer)
        self.models.loaded.connect(self.modelLoaded)
        self.chat.answerFinished.connect(self.answerFinished)

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
        self.open_action = action(file_menu, "&Open GGUF…", self.models.open_dialog,
                                  QKeySequence.StandardKey.Open)
        self.fetch_action = action(file_menu, "&Fetch the default model", self.models.fetch_default)
        self.hub_action = action(file_menu, "Download from &Hugging Face…", self.open_hub_dialog)
        self.remote_action = action(file_menu, "&Connect to a server…", self.open_remote_dialog)
        self.add_document_action = action(file_menu, "&Add document…", self.documents.choose_files)
        file_menu.addSeparator()
        action(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        chat_menu = self.menuBar().addMenu("&Chat")
        self.new_action = action(chat_menu, "&New chat", self.new_conversation, QKeySequence.StandardKey.New)
        self.stop_action = action(chat_menu, "&Stop", self.stop_generation, Qt.Key.Key_Escape)
        self.regenerate_action = action(chat_menu, "&Regenerate", self.regenerate, "Ctrl+R")
        self.copy_action = action(chat_menu, "&Copy last answer", self.copy_last_answer, "Ctrl+Shift+C")
        # prompt lookup (engine.speculate): a setting kept in the Store, sent to the worker at
        # start (before the model loads) and on every change
        self.speculate_action = action(chat_menu, "Draft from the &context (prompt lookup)", self.set_speculate)
        self.speculate_action.setCheckable(True)
        self.speculate_action.setChecked(self.store.get_setting("speculate", "off") == "lookup")
        self.draft_menu = DraftMenu(self, chat_menu)    # a draft model instead (draft_menu.py)
        chat_menu.addSeparator()
        action(chat_menu, "Re&name chat", self.conversations.rename_current, "F2")
        action(chat_menu, "&Delete chat", lambda: self.delete_conversation(self.conv_id))

    def _start_worker(self) -> None:
        self.thread = QThread(self)
        self.thread.setObjectName("omlx-engine")
        self.worker = EngineWorker(self.kv_holder)
        self.worker.moveToThread(self.thread)
        self.thread.finished.connect(self.worker.deleteLater)
        self.requested.connect(self.worker.handle)
        w, models, chat, docs = self.worker, self.models, self.chat, self.docs
        w.fetchProgress.connect(models.on_fetch_progress)
        w.fetchFinished.connect(models.on_fetch_finished)
        w.fetchFailed.connect(models.on_fetch_failed)
        w.loadProgress.connect(models.on_load_progress)
        w.loaded.connect(models.on_loaded)
        w.loadFailed.connect(models.on_load_failed)
        w.loadNeedsConfirmation.connect(models.on_needs_confirmation)
        w.settingsApplied.connect(models.on_settings_applied)
        w.draftApplied.connect(models.on_draft_applied)     # before the menu says it is applied
        w.switchCost.connect(self.kv_panel.show_switch_cost)
        w.tokens.connect(chat.on_tokens)
        w.prefillProgress.connect(chat.on_prefill_progress)
        w.turnFinished.connect(chat.on_finished)
        w.turnFailed.connect(chat.on_failed)
        w.turnFinished.connect(self._sample_chart_after_turn)
        w.turnFailed.connect(self._sample_chart_after_turn)
        w.documentProgress.connect(docs.on_progress)
        w.documentAdded.connect(docs.on_added)
        w.documentFailed.connect(docs.on_failed)
        w.documentPinned.connect(docs.on_pinned)
        w.documentsChanged.connect(docs.on_changed)
        w.draftApplied.connect(self.draft_menu.on_applied)
        w.draftNeedsConfirmation.connect(self.draft_menu.on_needs_confirmation)
        w.error.connect(self._on_worker_error)
        self.thread.start()

    def request(self, request) -> None:
        """Sends a :mod:`.protocol` request to the worker (runs after those sent before it)."""
        self.requested.emit(request)

    # -- what tests and scripts drive -----------------------------------------------------
    @property
    def model_info(self) -> dict | None:
        return self.models.model_info

    @property
    def conv_id(self) -> int | None:
        return self.conversations.conv_id

    @property
    def turn(self) -> Turn | None:
        return self.chat.turn

    @property
    def last_stats(self) -> dict | None:
        return self.chat.last_stats

    @property
    def exit_code(self) -> int | None:
        return self.smoke.exit_code if self.smoke is not None else None

    def send_message(self, text: str | None = None, *, max_tokens: int | None = None) -> bool:
        """Sends the input's text (or ``text``); False if nothing was sent."""
        return False if self.closed else self.chat.send(text, max_tokens=max_tokens)

    def regenerate(self) -> bool:
        return self.chat.regenerate()

    def stop_generation(self) -> None:
        self.chat.stop()

    def set_speculate(self, on: bool) -> None:
        """The Chat menu's prompt-lookup switch: kept for the next start and applied from the
        next answer on."""
        mode = "lookup" if on else "off"
        self.store.set_setting("speculate", mode)
        self.request(SetSpeculate(mode))

    def copy_last_answer(self) -> str | None:
        return self.chat.copy_last_answer()

    def load_model(self, spec: str) -> None:
        self.models.load(spec)

    def fetch_model(self, name: str) -> None:
        self.models.fetch(name)

    def open_hub_dialog(self) -> HubDialog:
        """File → Download from Hugging Face…: one dialog, kept (with its download) when closed."""
        if self.hub_dialog is None:
            self.hub_dialog = HubDialog(self)
            self.hub_dialog.downloaded.connect(self.models.load)
        self.hub_dialog.show()
        self.hub_dialog.raise_()
        self.hub_dialog.activateWindow()
        return self.hub_dialog

    def open_remote_dialog(self) -> RemoteDialog:
        """File → Connect to a server…: chat through an OpenAI-compatible server's model."""
        if self.remote_dialog is None:
            self.remote_dialog = RemoteDialog(self)
        self.remote_dialog.show()
        self.remote_dialog.raise_()
        self.remote_dialog.activateWindow()
        return self.remote_dialog

    def ask_remote_key(self, endpoint: dict) -> RemoteDialog:
        """At start: the saved server was used with an API key, which is not saved; the dialog
        opens filled in and asks for it."""
        dialog = self.open_remote_dialog()
        dialog.ask_for_key(endpoint)
        self.statusBar().showMessage(f"Enter the API key for {endpoint['url']} to reconnect "
                                     "(it is not saved on disk)", 15_000)
        return dialog

    def new_conversation(self) -> int:
        return self.conversations.new()

    def open_conversation(self, conv_id: int) -> None:
        self.conversations.open(conv_id)

    def rename_conversation(self, conv_id: int, title: str) -> None:
        self.conversations.rename(conv_id, title)

    def delete_conversation(self, conv_id: int | None, confirm: bool = True) -> None:
        self.conversations.delete(conv_id, confirm)

    def conversation_ids(self) -> list[int]:
        return self.conversations.ids()

    def add_documents(self, paths: list[str]) -> list[str]:
        return self.docs.add(paths)

    def set_document_pinned(self, key: str, pinned: bool) -> None:
        self.docs.set_pinned(key, pinned)

    def remove_document(self, key: str) -> None:
        self.docs.remove(key)

    model_text = staticmethod(model_text)
    stats_text = staticmethod(stats_text)

    def model_summary(self) -> str:
        """The model bar as plain text."""
        return plain_text(self.model_label.text())

    def stats_summary(self) -> str:
        """The stats bar as plain text."""
        return plain_text(self.stats_label.text())

    # -- errors and status ----------------------------------------------------------------
    def show_error(self, message: str, topic: str = "", failure: Failure | None = None) -> None:
        """Shows an error in the banner; ``topic`` ("model", "turn", "document",
        "conversation") lets a later success of the same kind clear it (:meth:`clear_error`).
        A ``failure`` whose traceback went to the log (not one of the engine's errors) gets the
        log's path in the banner's details."""
        if self.closed:
            return
        log.info("error shown: %s", message)
        self.errors.append(message)
        details = ""
        if failure is not None and failure.logged:
            details = (f"This is not an error the app knows how to explain (a bug): its traceback "
                       f"is in the app's log, {self.log_path}. Please include it in a bug report.")
        self.banner.show_message(message, topic, details)
        self.statusBar().showMessage(message.splitlines()[0][:200], 10_000)
        self.errorShown.emit(message)

    def clear_error(self, topic: str) -> None:
        """Something of ``topic`` succeeded: an error about it no longer applies."""
        self.banner.clear(topic)

    def _sample_chart_after_turn(self, _result) -> None:
        """The KV in use after every answer on the chart, even an answer shorter than its 4 Hz
        sampling (16 SmolLM2 tokens take ~0.15 s): the worker publishes the KV figures before it
        sends the turn's result."""
        if self.chart.is_sampling():
            self.chart.sample_now()

    def _on_worker_error(self, failure) -> None:
        topic = "document" if failure.kind == "bad_document" else "conversation"
        self.show_error(failure.message, topic, failure)

    def update_buttons(self) -> None:
        ready = self.models.ready
        busy = self.chat.turn is not None
        self.send_button.setEnabled(ready and not busy)
        self.stop_button.setEnabled(busy)
        self.stop_action.setEnabled(busy)
        has_answer = self.transcript.last_answer() is not None
        self.regenerate_button.setEnabled(ready and not busy and bool(self.transcript.messages))
        self.regenerate_action.setEnabled(self.regenerate_button.isEnabled())
        self.copy_button.setEnabled(has_answer)
        self.copy_action.setEnabled(has_answer)
        self.documents.add_button.setEnabled(ready)
        self.fetch_button.setEnabled(self.models.fetch_cancel is None and self.models.loading is None)

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
            self.models.load(models[-1])
        if documents:
            self.docs.add(documents)

    # -- closing --------------------------------------------------------------------------
    def closeEvent(self, event) -> None:  # noqa: N802
        if self.closed:
            event.accept()
            return
        self.closed = True
        try:
            self._save_layout()
        except Exception:
            log.exception("cannot save the window layout")
        self.hide()  # gone at once; the engine may need a moment to reach a stopping point
        self.worker.abort.set()
        self.chat.abandon()
        if self.models.fetch_cancel is not None:
            self.models.fetch_cancel.set()
        if self.hub_dialog is not None:
            self.hub_dialog.shutdown()
            self.hub_dialog.close()
        self.chart.set_paused(True)
        self.serve_panel.shutdown()
        self.request(Shutdown())
        self.thread.quit()
        if not self.wait_for_engine(CLOSE_WAIT_MS):
            log.warning("the engine thread did not stop within %d ms; it is waited for at exit",
                        CLOSE_WAIT_MS)
        if self._owns_store:
            self.store.close()
        applog.close_log(self._log_handler)
        super().closeEvent(event)

    def wait_for_engine(self, timeout_ms: int | None = None) -> bool:
        """Waits for the worker thread to end after closing (None: as long as it takes); True
        if it has ended. A QThread must not be destroyed while it runs."""
        if timeout_ms is None:
            return self.thread.wait()
        return self.thread.wait(timeout_ms)
