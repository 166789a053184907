"""File → Connect to a server…: chat through a model on an OpenAI-compatible server (another
machine's ``omlx serve``, vLLM, llama.cpp's server, Ollama, LM Studio) instead of a local model.

The dialog asks the worker for the server's models (``ListRemoteModels``: the request runs in the
worker's thread, so an unreachable server never freezes the window) and connects through the
model controller (``ConnectRemote``, answered like a load). The server's address and model come
back filled in from the last connection (the model controller saves them); the API key stays in
memory for this run: it is never written to the app's database (a plain file), so a server used
with a key asks for it again after a restart (:meth:`ask_for_key`).
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox, QDialog, QDialogButtonBox, QFormLayout, QHBoxLayout, QLabel, QLineEdit, QPushButton,
    QVBoxLayout,
)

from .protocol import ListRemoteModels, RemoteModels
from .window_surface import WindowSurface

DEFAULT_URL = "http://127.0.0.1:8080/v1"


class RemoteDialog(QDialog):
    def __init__(self, window: WindowSurface):
        super().__init__(window)
        self.w = window
        self.setWindowTitle("Connect to a server")
        self.setMinimumWidth(480)
        saved = window.models.saved_endpoint() or {}
        self.url_edit = QLineEdit(saved.get("url") or DEFAULT_URL)
        self.url_edit.setPlaceholderText(DEFAULT_URL)
        self.key_edit = QLineEdit()
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setPlaceholderText("optional (sent as a Bearer token)")
        self.key_edit.setToolTip("Kept in memory while the app runs, never saved to disk: after a "
                                 "restart the app asks for it again.")
        self.list_button = QPushButton("List models")
        self.model_box = QComboBox()
        self.model_box.setEditable(True)
        self.model_box.setMinimumContentsLength(24)
        if saved.get("model"):
            self.model_box.setCurrentText(saved["model"])
        self.status = QLabel("Any OpenAI-compatible server: omlx serve, vLLM, llama.cpp's server, "
                             "Ollama, LM Studio.")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.connect_button = self.buttons.addButton("Connect", QDialogButtonBox.ButtonRole.AcceptRole)
        self.connect_button.setEnabled(bool(self.model_box.currentText().strip()))

        model_row = QHBoxLayout()
        model_row.addWidget(self.model_box, 1)
        model_row.addWidget(self.list_button)
        form = QFormLayout()
        form.addRow("Server", self.url_edit)
        form.addRow("API key", self.key_edit)
        form.addRow("Model", model_row)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.status)
        layout.addWidget(self.buttons)

        self.list_button.clicked.connect(self.list_models)
        self.url_edit.returnPressed.connect(self.list_models)
        self.buttons.rejected.connect(self.reject)
        self.connect_button.clicked.connect(self.connect_to_server)
        self.model_box.currentTextChanged.connect(
            lambda text: self.connect_button.setEnabled(bool(text.strip()) and not self._busy))
        window.worker.remoteModels.connect(self.on_models)
        window.models.loaded.connect(self._on_loaded)
        window.models.failed.connect(self._on_failed)
        self._busy = False
        self._connecting = False

    def ask_for_key(self, endpoint: dict) -> None:
        """Filled in with a saved ``endpoint`` ({"url", "model"}) whose API key was not saved:
        says so and waits for the key."""
        self.url_edit.setText(endpoint["url"])
        if endpoint.get("model"):
            self.model_box.setCurrentText(endpoint["model"])
        self.key_edit.clear()
        self.status.setText(f"The API key for {html.escape(endpoint['url'])} is not saved on disk "
                            "(the app keeps no secrets in its files): enter it again and Connect. "
                            "The local model answers meanwhile.")
        self.key_edit.setFocus()

    def _set_busy(self, busy: bool, text: str | None = None) -> None:
        self._busy = busy
        self.list_button.setEnabled(not busy)
        self.connect_button.setEnabled(not busy and bool(self.model_box.currentText().strip()))
        if text is not None:
            self.status.setText(text)

    def list_models(self) -> None:
        url = self.url_edit.text().strip()
        self._set_busy(True, f"Asking {url} for its models…")
        self.w.request(ListRemoteModels(url, self.key_edit.text().strip() or None))

    def on_models(self, answer: RemoteModels) -> None:
        if not self.isVisible() and not self._busy:
            return
        if answer.failure is not None:
            self._set_busy(False)
            self.status.setText(f"<span style='color:#b00020'>{html.escape(answer.failure.message)}</span>")
            return
        current = self.model_box.currentText()
        self.model_box.clear()
        self.model_box.addItems(list(answer.ids))
        if current in answer.ids:
            self.model_box.setCurrentText(current)
        self._set_busy(False, f"{html.escape(answer.base_url)} serves {len(answer.ids)} model"
                              f"{'' if len(answer.ids) == 1 else 's'}.")

    def connect_to_server(self) -> None:
        url = self.url_edit.text().strip()
        model = self.model_box.currentText().strip() or None
        self._connecting = True
        self._set_busy(True, f"Connecting to {model or 'the server'}…")
        self.w.models.connect_remote(url, self.key_edit.text().strip() or None, model)

    def _on_loaded(self, info: dict) -> None:
        if self._connecting:
            self._connecting = False
            self._set_busy(False, f"Connected: {html.escape(info['name'])}")
            self.accept()

    def _on_failed(self, message: str) -> None:
        if self._connecting:
            self._connecting = False
            self._set_busy(False)
            self.status.setText(f"<span style='color:#b00020'>{html.escape(message)}</span>")
