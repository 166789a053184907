"""The "Serve on localhost" switch: the loaded model behind `omlx serve`'s OpenAI-compatible API
(engine.serve) on 127.0.0.1, with the URL and a copy button, while the window keeps chatting.

Threads: the server gets an Engine of its own over the same GGUF file, made in a starter thread.
Its weights are the file's memory-mapped blocks, so the pages are shared with the window's
engine and only the tokenizer and the server's KV cache are extra; its caches and prefix cache
are its own, so the worker thread and the server's engine thread never touch the same cache
(the matrix kernels' thread pool takes one caller at a time and runs a second one without the
pool). Starting and stopping happen off the UI thread; results come back as queued signals.

KV setting: the server uses the KV panel's setting (`set_kv_spec`, which `install` connects to
the panel), the one the window's chat uses, and the panel shows it ("KV k4v4"). The server's
scheduler builds its block pools, its KV budget (in blocks of the setting's size) and its prefix
cache once, when it starts, and running sequences hold blocks of that layout, so a server cannot
change its setting in place: a new setting restarts it, on the same port. The restart waits
until the setting has been still for SETTLE_S (one restart for a slider drag) and the server has
no request running or queued, for at most RESTART_WAIT_S; requests still running then are cut
off (their clients get an error and can retry). The label says so while the restart is pending.

Draft model: the server drafts with the chat's draft model (Chat → Draft model, `set_draft`,
which `install` connects to the draft menu's applied choice), as `omlx serve --draft` does: a
second draft Engine over the same file, loaded for the server's engine in the starter thread
(engine.speculate.load_draft, its caches at the server's KV setting). The panel shows it ("draft
smollm2-135m-instruct"); a new choice restarts the server as a new KV setting does. A draft model
that cannot be loaded for the server (its file gone; another vocabulary, when a new model restarts
the server before the chat has dropped the old model's draft) leaves the server answering without
drafts, and the panel says why ("not drafting: ...").

Off by default; the switch is disabled until a model is loaded. Binding is 127.0.0.1 only, so no
API key is needed (the CLI's rule for other hosts does not arise here).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QPushButton, QSpinBox, QWidget

log = logging.getLogger("omlx.desktop.serve")

DEFAULT_PORT = 8080
SERVE_CTX = 4096  # context per request the switch serves (the model's, when smaller)
SERVE_BATCH = 4   # sequences decoded together
SETTLE_S = 0.8          # a KV setting must stay unchanged this long before the server restarts on it
RESTART_WAIT_S = 30.0   # longest wait for running requests to finish before that restart
RESTART_POLL_MS = 200


def canonical_spec(spec: str | None) -> str:
    """The KV setting's canonical string (engine.kv.config; None: the default preset)."""
    from engine.kv.config import parse_kv

    return str(parse_kv(spec))


class ServePanel(QWidget):
    """Switch, port, URL, KV setting and copy button. `set_model(path)` names the model to serve
    (the window calls it when a model is loaded), `set_kv_spec(spec)` the KV setting to serve it
    with, `set_draft(spec)` the draft model to draft with; `shutdown()` stops the server (window
    close)."""

    # base URL (…/v1), the KV setting served, the draft model served ("": none), why it does not
    # draft with the one asked for ("": it does); from the starter thread
    started = Signal(str, str, str, str)
    stopped = Signal()
    failed = Signal(str)       # message

    def __init__(self, parent=None):
        super().__init__(parent)
        self.switch = QCheckBox("Serve on localhost")
        self.switch.setToolTip("An OpenAI-compatible API for the loaded model on 127.0.0.1 "
                               "(/v1/chat/completions, /v1/completions, /v1/models), with the KV "
                               "cache setting of the KV panel")
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setValue(DEFAULT_PORT)
        self.port.setToolTip("port (0: any free port)")
        self.url_label = QLabel("")
        self.url_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.kv_label = QLabel("")
        self.kv_label.setToolTip("the KV cache setting the server uses (the KV panel's; a new "
                                 "setting restarts the server)")
        self.draft_label = QLabel("")
        self.draft_label.setToolTip("the draft model the server drafts with (the chat's, Chat → Draft model; "
                                    "a new one restarts the server)")
        self.copy_button = QPushButton("Copy URL")
        self.copy_button.setEnabled(False)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for w in (self.switch, self.port, self.url_label, self.kv_label, self.draft_label, self.copy_button):
            layout.addWidget(w)
        self.model_path: str | None = None
        self.kv_spec: str = canonical_spec(None)    # the setting to serve with
        self.served_spec: str | None = None         # the engine's setting while serving
        self.draft_spec = ""                        # the draft model to serve with ("": none)
        self.served_draft: str | None = None        # the one the server drafts with ("": none)
        self.draft_error: str | None = None         # why the server does not draft with draft_spec
        self.url: str | None = None
        self.error: str | None = None
        self._thread = None          # engine.serve.ServerThread while serving
        self._busy = False           # a start or stop is running in the background
        self._served_path: str | None = None
        self._started_spec: str | None = None       # kv_spec when the running server started
        self._started_draft: str | None = None      # draft_spec then
        self._restart_after_stop = False
        self._restart_port: int | None = None       # the port a restart binds again
        self._spec_changed_at = 0.0
        self._restart_pending_since: float | None = None
        self._restart_timer = QTimer(self)
        self._restart_timer.setInterval(RESTART_POLL_MS)
        self._restart_timer.timeout.connect(self._poll_restart)
        self.switch.setEnabled(False)
        self.switch.toggled.connect(self._on_toggled)
        self.copy_button.clicked.connect(self.copy_url)
        self.started.connect(self._on_started)
        self.stopped.connect(self._on_stopped)
        self.failed.connect(self._on_failed)
        self._show_kv()

    # -- from the window ----------------------------------------------------------------------
    def set_model(self, path: str | None) -> None:
        """The loaded model; a server running another model is restarted on this one."""
        self.model_path = str(path) if path else None
        self.switch.setEnabled(self.model_path is not None and not self._busy)
        if self._thread is not None and not self._busy and self._served_path != self.model_path:
            self._stop(restart=self.model_path is not None)

    def set_kv_spec(self, spec: str | None) -> None:
        """The KV setting to serve with (a spec of engine.kv.config; None: the default preset).
        A running server restarts on it once the setting settles and the server is idle (see
        the module docstring).

        Raises:
            SettingsError: not a valid KV spec.
        """
        spec = canonical_spec(spec)
        if spec == self.kv_spec:
            return
        self.kv_spec = spec
        self._setting_changed()

    def set_draft(self, spec: str | None) -> None:
        """The draft model to serve with (a catalog name or a .gguf path, as the draft menu keeps
        it; "" or None: none). A running server restarts on it as on a new KV setting."""
        spec = spec or ""
        if spec == self.draft_spec:
            return
        self.draft_spec = spec
        self._setting_changed()

    def _setting_changed(self) -> None:
        self._spec_changed_at = time.monotonic()
        if self._thread is not None and not self._busy:
            if self._wanted() != self._started():
                self._schedule_restart()
            else:                          # back to the served setting before the restart
                self._restart_timer.stop()
        self._show_kv()

    def _wanted(self) -> tuple[str, str]:
        return self.kv_spec, self.draft_spec

    def _started(self) -> tuple[str | None, str | None]:
        return self._started_spec, self._started_draft

    def shutdown(self) -> None:
        """Stop serving now (blocking briefly; the window is closing)."""
        self._restart_timer.stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()

    def copy_url(self) -> None:
        if self.url:
            QGuiApplication.clipboard().setText(self.url)

    @property
    def restart_pending(self) -> bool:
        """A new KV setting or draft model waits for the server to restart on it."""
        return self._restart_timer.isActive()

    # -- the KV setting and the draft model ---------------------------------------------------------
    def _show_kv(self) -> None:
        pending = " restarting when the running requests finish"
        if self.restart_pending and self.kv_spec != self._started_spec:
            self.kv_label.setText(f"KV {self.served_spec} → {self.kv_spec}:{pending}")
        elif self._thread is not None and self.served_spec:
            self.kv_label.setText(f"KV {self.served_spec}")
        else:
            self.kv_label.setText(f"KV {self.kv_spec}")
        serving = self._thread is not None and self.served_draft is not None
        if self.restart_pending and self.draft_spec != self._started_draft:
            self.draft_label.setText(f"draft {_draft_name(self.served_draft)} → {_draft_name(self.draft_spec)}:"
                                     + pending)
        elif serving and self.draft_error:
            self.draft_label.setText(f"not drafting: {self.draft_error}")
        elif serving:
            self.draft_label.setText(f"draft {_draft_name(self.served_draft)}" if self.served_draft else "")
        else:
            self.draft_label.setText(f"draft {_draft_name(self.draft_spec)}" if self.draft_spec else "")

    def _schedule_restart(self) -> None:
        if not self.restart_pending:
            self._restart_pending_since = time.monotonic()
            self._restart_timer.start()

    def _poll_restart(self) -> None:
        thread = self._thread
        if thread is None or self._busy or self._wanted() == self._started():
            self._restart_timer.stop()    # stopped meanwhile, or the setting went back
            self._show_kv()
            return
        now = time.monotonic()
        if now - self._spec_changed_at < SETTLE_S:
            self._show_kv()
            return
        metrics = thread.server.metrics
        idle = metrics.running.value == 0 and metrics.queue_length.value == 0
        if idle or now - self._restart_pending_since >= RESTART_WAIT_S:
            if not idle:
                log.info("restarting the server on KV %s, draft %r with requests still running", self.kv_spec,
                         self.draft_spec)
            self._restart_timer.stop()
            self._stop(restart=True)
        else:
            self._show_kv()

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
        path, spec, draft = self.model_path, self.kv_spec, self.draft_spec
        port = self._restart_port if self._restart_port is not None else self.port.value()
        self._restart_port = None
        self.url_label.setText(f"starting with KV {spec}…")

        def start() -> None:
            try:
                from engine.engine import Engine
                from engine.serve import OpenAIServer, ServeConfig, ServeLimits, ServerThread

                engine = Engine.load(path, kv=spec)
                not_drafting = _use_draft(engine, draft)
                limits = ServeLimits(ctx=min(SERVE_CTX, engine.model.context_length), max_batch=SERVE_BATCH)
                server = OpenAIServer(engine, limits, ServeConfig(host="127.0.0.1", port=port))
                self._thread = ServerThread(server).start()
                self._served_path = path
                self._started_spec = spec
                self._started_draft = draft
                self.started.emit(self._thread.url + "/v1", str(engine.kv_config),
                                  "" if not_drafting is not None else draft, not_drafting or "")
            except Exception as exc:  # reported in the panel; the window goes on
                log.exception("cannot start serving")
                from engine.errors import describe

                self.failed.emit(describe(exc)[1])

        threading.Thread(target=start, name="omlx-serve-start", daemon=True).start()

    def _stop(self, restart: bool) -> None:
        self._restart_timer.stop()
        thread, self._thread = self._thread, None
        self._busy = True
        if restart and thread is not None:
            self._restart_port = thread.port       # clients keep their URL
            self.url_label.setText(f"restarting with KV {self.kv_spec}"
                                   + (f", draft {_draft_name(self.draft_spec)}…" if self.draft_spec else "…"))
        else:
            self.url_label.setText("stopping…")
        self.copy_button.setEnabled(False)

        def stop() -> None:
            if thread is not None:
                thread.stop()
            self.stopped.emit()

        self._restart_after_stop = restart
        threading.Thread(target=stop, name="omlx-serve-stop", daemon=True).start()

    def _on_started(self, url: str, served_spec: str, served_draft: str, draft_error: str) -> None:
        self._busy = False
        self.url = url
        self.served_spec = served_spec
        self.served_draft = served_draft
        self.draft_error = draft_error or None
        self.url_label.setText(url)
        self.copy_button.setEnabled(True)
        self.switch.setEnabled(True)
        if not self.switch.isChecked():  # switched off while starting
            self._stop(restart=False)
        elif self._served_path != self.model_path:  # another model was loaded while starting
            self._stop(restart=self.model_path is not None)
        elif self._started() != self._wanted():     # the setting changed while starting
            self._schedule_restart()
        self._show_kv()

    def _on_stopped(self) -> None:
        self._busy = False
        self.url = None
        self.served_spec = None
        self.served_draft = self.draft_error = None
        self.url_label.setText("")
        self.port.setEnabled(True)
        self.switch.setEnabled(self.model_path is not None)
        restart = self._restart_after_stop or self.switch.isChecked()
        self._restart_after_stop = False
        if restart and self.model_path:
            self._start()
        else:
            self._restart_port = None
        self._show_kv()

    def _on_failed(self, message: str) -> None:
        self._busy = False
        self.error = message
        self.served_spec = None
        self.served_draft = self.draft_error = None
        self.url_label.setText(f"not serving: {message}")
        self.port.setEnabled(True)
        self.switch.blockSignals(True)
        self.switch.setChecked(False)
        self.switch.blockSignals(False)
        self.switch.setEnabled(self.model_path is not None)
        self._show_kv()


def _draft_name(spec: str | None) -> str:
    """A draft spec as the panel shows it: a catalog name, or a path's file name."""
    if not spec:
        return "none"
    return Path(spec).name if spec.lower().endswith(".gguf") else spec


def _use_draft(engine, spec: str) -> str | None:
    """The draft model `spec` set on the server's `engine` (a second Engine over its file, its
    vocabulary checked, speculate.load_draft); None when it drafts (or none is asked for), else
    why it cannot, the server then answering without drafts."""
    if not spec:
        return None
    try:
        from engine.catalog import resolve_model
        from engine.speculate import load_draft

        engine.set_draft(load_draft(engine, resolve_model(spec, fetch_missing=False)))
        return None
    except Exception as exc:
        from engine.errors import describe

        log.warning("serving without the draft model %s: %s", spec, exc)
        return describe(exc)[1]


def install(window) -> ServePanel:
    """Put the panel first in the model bar's row of controls (``window.model_tools``, under the
    model's header); it follows the window's model, the KV panel's setting and the draft model
    the chat drafts with (``window.draft_menu``)."""
    panel = ServePanel(window)
    window.model_tools.insertWidget(0, panel)

    def follow(info) -> None:
        # a remote server's model (path is its URL) cannot be served from here
        if isinstance(info, dict):
            panel.set_model(None if info.get("remote") else info.get("path"))
        else:
            panel.set_model(None if getattr(info, "remote", False) else getattr(info, "path", None))

    def follow_kv(settings: dict) -> None:
        try:
            panel.set_kv_spec(settings.get("spec"))
        except Exception:  # the panel builds its specs from KVConfig: a bad one is a bug there
            log.exception("the KV panel's setting %r cannot be served", settings.get("spec"))

    window.models.loaded.connect(follow)
    window.kv_panel.settingsChanged.connect(follow_kv)
    follow_kv(window.kv_panel.settings())
    window.draft_menu.applied.connect(lambda applied: panel.set_draft(applied.spec))
    panel.set_draft(window.draft_menu.spec)
    return panel
