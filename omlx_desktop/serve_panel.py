"""The "Serve on localhost" switch: the loaded model behind `omlx serve`'s OpenAI-compatible API
(engine.serve) on 127.0.0.1, with the URL and a copy button, while the window keeps chatting.

Threads: the server gets an Engine of its own over the same GGUF file, made in a starter thread.
Its weights are the file's memory-mapped blocks, so the pages are shared with the window's
engine and only the tokenizer and the server's KV cache are extra; its caches and prefix cache
are its own, so the worker thread and the server's engine thread never touch the same cache
(the matrix kernels' thread pool takes one caller at a time and runs a second one without the
pool). Starting and stopping happen off the UI thread; results come back as queued signals.

Off by default; the switch is disabled until a model is loaded. Binding is 127.0.0.1 only, so no
API key is needed (the CLI's rule for other hosts does not arise here).
"""

from __future__ import annotations

import logging
import threading

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QPushButton, QSpinBox, QWidget

log = logging.getLogger("omlx.desktop.serve")

DEFAULT_PORT = 8080
SERVE_CTX = 4096  # context per request the switch serves (the model's, when smaller)
SERVE_BATCH = 4   # sequences decoded together


class ServePanel(QWidget):
    """Switch, port, URL and copy button. `set_model(path)` names the model to serve (the window
    calls it when a model is loaded); `shutdown()` stops the server (window close)."""

    started = Signal(str)      # base URL (…/v1), from the starter thread
    stopped = Signal()
    failed = Signal(str)       # message

    def __init__(self, parent=None):
        super().__init__(parent)
        self.switch = QCheckBox("Serve on localhost")
        self.switch.setToolTip("An OpenAI-compatible API for the loaded model on 127.0.0.1 "
                               "(/v1/chat/completions, /v1/completions, /v1/models)")
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setValue(DEFAULT_PORT)
        self.port.setToolTip("port (0: any free port)")
        self.url_label = QLabel("")
        self.url_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.copy_button = QPushButton("Copy URL")
        self.copy_button.setEnabled(False)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for w in (self.switch, self.port, self.url_label, self.copy_button):
            layout.addWidget(w)
        self.model_path: str | None = None
        self.url: str | None = None
        self.error: str | None = None
        self._thread = None          # engine.serve.ServerThread while serving
        self._busy = False           # a start or stop is running in the background
        self._served_path: str | None = None
        self.switch.setEnabled(False)
        self.switch.toggled.connect(self._on_toggled)
        self.copy_button.clicked.connect(self.copy_url)
        self.started.connect(self._on_started)
        self.stopped.connect(self._on_stopped)
        self.failed.connect(self._on_failed)

    # -- from the window ----------------------------------------------------------------------
    def set_model(self, path: str | None) -> None:
        """The loaded model; a server running another model is restarted on this one."""
        self.model_path = str(path) if path else None
        self.switch.setEnabled(self.model_path is not None and not self._busy)
        if self._thread is not None and self._served_path != self.model_path:
            self._stop(restart=self.model_path is not None)

    def shutdown(self) -> None:
        """Stop serving now (blocking briefly; the window is closing)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()

    def copy_url(self) -> None:
        if self.url:
            QGuiApplication.clipboard().setText(self.url)

    # -- switching ------------------------------------------------------------------------------
    def _on_toggled(self, on: bool) -> None:
        if on and self._thread is None and not self._busy:
            self._start()
        elif not on and self._thread is not None and not self._busy:
            self._stop(restart=False)

    def _start(self) -> None:
        if self.model_path is None:
            self.switch.setChecked(False)
            return
        self._busy = True
        self.error = None
        self.port.setEnabled(False)
        self.url_label.setText("starting…")
        path, port = self.model_path, self.port.value()

        def start() -> None:
            try:
                from engine.engine import Engine
                from engine.errors import describe
                from engine.serve import OpenAIServer, ServeConfig, ServeLimits, ServerThread

                engine = Engine.load(path)
                limits = ServeLimits(ctx=min(SERVE_CTX, engine.model.context_length), max_batch=SERVE_BATCH)
                server = OpenAIServer(engine, limits, ServeConfig(host="127.0.0.1", port=port))
                self._thread = ServerThread(server).start()
                self._served_path = path
                self.started.emit(self._thread.url + "/v1")
            except Exception as exc:  # reported in the panel; the window goes on
                log.exception("cannot start serving")
                from engine.errors import describe

                self.failed.emit(describe(exc)[1])

        threading.Thread(target=start, name="omlx-serve-start", daemon=True).start()

    def _stop(self, restart: bool) -> None:
        thread, self._thread = self._thread, None
        self._busy = True
        self.url_label.setText("stopping…")
        self.copy_button.setEnabled(False)

        def stop() -> None:
            if thread is not None:
                thread.stop()
            self.stopped.emit()

        self._restart_after_stop = restart
        threading.Thread(target=stop, name="omlx-serve-stop", daemon=True).start()

    def _on_started(self, url: str) -> None:
        self._busy = False
        self.url = url
        self.url_label.setText(url)
        self.copy_button.setEnabled(True)
        self.switch.setEnabled(True)
        if not self.switch.isChecked():  # switched off while starting
            self._stop(restart=False)

    def _on_stopped(self) -> None:
        self._busy = False
        self.url = None
        self.url_label.setText("")
        self.port.setEnabled(True)
        self.switch.setEnabled(self.model_path is not None)
        if getattr(self, "_restart_after_stop", False) or (self.switch.isChecked() and self.model_path):
            self._restart_after_stop = False
            self._start()

    def _on_failed(self, message: str) -> None:
        self._busy = False
        self.error = message
        self.url_label.setText(f"not serving: {message}")
        self.port.setEnabled(True)
        self.switch.blockSignals(True)
        self.switch.setChecked(False)
        self.switch.blockSignals(False)
        self.switch.setEnabled(self.model_path is not None)


def install(window) -> ServePanel:
    """Put the panel in the window's model bar (before the Open button) and follow its model."""
    panel = ServePanel(window)
    bar = window.open_button.parentWidget().layout()
    bar.insertWidget(bar.indexOf(window.open_button), panel)
    def follow(info) -> None:
        # a remote server's model (path is its URL) cannot be served from here
        if isinstance(info, dict):
            panel.set_model(None if info.get("remote") else info.get("path"))
        else:
            panel.set_model(None if getattr(info, "remote", False) else getattr(info, "path", None))

    window.models.loaded.connect(follow)
    return panel
