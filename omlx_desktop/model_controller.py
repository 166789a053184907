"""The model's fetch / load state machine of the main window.

    no model ──fetch──▶ fetching ──done──▶ loading ──loaded──▶ ready ──load another──▶ loading
        ▲                  │ cancelled / failed        │ failed (the old model, if any, stays)
        └──────────────────┴───────────────────────────┘
                                                       │ does not fit: ask ──yes──▶ loading (forced)
                                                       │                   └─no──▶ as before the load

While a fetch runs ``fetch_cancel`` is its Event; while a load runs ``loading`` is its spec;
``model_info`` is the loaded model's description (None before the first load). The KV panel's
settings reach the worker from here too: they depend on the model (its layers, its context, and
its default context beside the draft model in use, again at every draft model applied).

Which source the app comes back on: a local load saves the file (setting ``last_model``); a
connection to a server saves the endpoint (``remote_endpoint``: base URL, model id and whether an
API key was sent; never the key itself: the app has no secret store, and the database is plain
text) and ``model_source`` says which of the two the user chose last. At start
(:meth:`start`) a saved endpoint is connected in the worker (the UI never waits on the network);
if it cannot be reached the local model loads instead, with a message, and the endpoint stays
saved for the next start or a retry from File → Connect to a server… (filled in). An endpoint
that was used with a key is not connected without it: the local model loads and the dialog
opens, filled in, asking for the key.

Every load (File → Open, a drop, the Hugging Face dialog, the last model at start) goes through
the worker's fit check (engine.fit at the KV panel's context and setting, the chosen draft
model counted): a model that does not fit is loaded only if the user says so
(:meth:`ask_load_anyway`, the question naming the draft model too); a tight one loads with a
warning in the banner.
"""

from __future__ import annotations

import html
import os
import threading
from pathlib import Path

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QFileDialog, QMessageBox

from .chart import format_bytes
from .fit_question import estimate_detail, fit_question, what_does_not_fit
from .protocol import (
    Configure, ConnectRemote, DraftApplied, FetchModel, Failure, FitCheck, KVApplied, LoadModel,
    ModelInfo,
)
from .ui import APP_TITLE
from .window_surface import WindowSurface
from .worker import FROZEN_FETCH_MESSAGE, is_frozen


def model_text(info: dict) -> str:
    """The model bar: name, file and size, KV bytes per token, context (wrapping only between
    the parts); for a remote model its name and server."""
    if info.get("remote"):
        return (f"<b>{html.escape(info['name'])}</b> &nbsp;·&nbsp; remote server "
                f"{html.escape(info['path'])}")
    parts = [
        f"<b>{html.escape(info['name'])}</b>",
        f"{html.escape(Path(info['path']).name)}, {format_bytes(info['file_size'])}",
        f"KV {format_bytes(info['kv_bytes_per_token'])} per token at {info['kv_spec'].upper()} "
        f"(16-bit: {format_bytes(info['kv_bytes_per_token_16'])})",
        f"{info['context_length']:,}-token context",
    ]
    return " &nbsp;·&nbsp; ".join(p.replace(" ", "&nbsp;") if not p.startswith("<b>") else p
                                  for p in parts)


LOCAL, REMOTE = "local", "remote"   # the setting model_source: what the app comes back on


class ModelController(QObject):
    loadStarted = Signal(str)       # a load or a connection to a server begins (its spec or URL)
    loaded = Signal(object)         # the model info dict
    failed = Signal(str)            # no model: a fetch or load failed (the message shown)

    def __init__(self, window: WindowSurface):
        super().__init__(window)
        self.w = window
        self.model_info: dict | None = None
        self.loading: str | None = None
        self.fetch_cancel: threading.Event | None = None
        # the load running keeps model_source as it is (a fallback at start, not the user's choice)
        self._keep_source = False
        self._connecting: dict | None = None    # the endpoint being connected: url, model, key_needed
        self._restoring_remote = False          # that connection is the saved endpoint at start
        self._fetch_if_missing = False          # start()'s, for the fallback to the local model

    # -- the saved remote endpoint ----------------------------------------------------------
    def saved_endpoint(self) -> dict | None:
        """The last server connected to: ``{"url", "model", "key_needed"}`` (None: none)."""
        saved = self.w.store.get_setting("remote_endpoint")
        if isinstance(saved, dict) and isinstance(saved.get("url"), str) and saved["url"].strip():
            model = saved.get("model")
            return {"url": saved["url"], "model": model if isinstance(model, str) and model else None,
                    "key_needed": bool(saved.get("key_needed"))}
        legacy = self.w.store.get_setting("remote_url")   # saved by earlier versions: the URL alone
        if isinstance(legacy, str) and legacy.strip():
            return {"url": legacy, "model": None, "key_needed": False}
        return None

    @property
    def restores_remote(self) -> bool:
        """The app comes back on the saved endpoint at its next start."""
        return self.w.store.get_setting("model_source") == REMOTE and self.saved_endpoint() is not None

    @property
    def ready(self) -> bool:
        return self.model_info is not None and self.loading is None

    # -- starting -------------------------------------------------------------------------
    def start(self, model: str | None, *, fetch_if_missing: bool = False) -> None:
        """The model given on the command line, else the last one, else the default one if it
        is fetched (or ``fetch_if_missing``), else the welcome page."""
        from engine import catalog

        if model:
            if model in catalog.CATALOG and not catalog.is_fetched(model):
                self.fetch(model)
            else:
                self.load(model)
            return
        endpoint = self.saved_endpoint() if self.restores_remote else None
        if endpoint is not None and endpoint["key_needed"]:
            self._start_local(fetch_if_missing, keep_source=True)
            self.w.ask_remote_key(endpoint)
        elif endpoint is not None:
            self._restoring_remote = True
            self._fetch_if_missing = fetch_if_missing
            self.connect_remote(endpoint["url"], None, endpoint["model"])
        else:
            self._start_local(fetch_if_missing)

    def _start_local(self, fetch_if_missing: bool, *, keep_source: bool = False) -> None:
        """The last local model, else the default one if it is fetched (or
        ``fetch_if_missing``), else the welcome page; ``keep_source``: a fallback, so the app
        still comes back on the saved server next time."""
        from engine import catalog

        w = self.w
        last = w.store.get_setting("last_model")
        if last and Path(last).is_file():
            self.load(last, keep_source=keep_source)
        elif catalog.is_fetched(catalog.DEFAULT_MODEL):
            self.load(catalog.DEFAULT_MODEL, keep_source=keep_source)
        elif fetch_if_missing:
            self.fetch(catalog.DEFAULT_MODEL)
        else:
            w.stack.setCurrentWidget(w.welcome)
            w.model_label.setText("No model loaded")
            w.statusBar().showMessage("No model yet: fetch the default model or open a .gguf file")

    def load(self, spec: str, *, force: bool = False, keep_source: bool = False) -> None:
        """Loads a catalog model, an ``hf:`` source or a .gguf file in the worker (the current
        model stays until the new one is ready); ``force`` skips asking about one that does not
        fit; ``keep_source``: the app still comes back on a saved server next time (a fallback)."""
        w = self.w
        self.loading = str(spec)
        self._keep_source = keep_source
        self._restoring_remote = False      # a load chosen while the saved server was connecting
        name = Path(spec).name if os.sep in str(spec) or str(spec).endswith(".gguf") else spec
        w.load_progress.set_stage("loading", 0.0)
        w.load_progress.show()
        w.statusBar().showMessage(f"Loading {name}…")
        if self.model_info is None:
            w.model_label.setText(f"Loading <b>{name}</b>…")
            w.fetch_progress.setValue(0)
            w.fetch_progress.show()
            w.welcome_status.setText(f"Loading {name}…")
        w.update_buttons()
        self.loadStarted.emit(str(spec))
        w.request(LoadModel(str(spec), force=force))

    def connect_remote(self, base_url: str, api_key: str | None, model: str | None) -> None:
        """Chats through ``model`` on an OpenAI-compatible server (answered like a load: the
        current model stays until the server answered)."""
        w = self.w
        self.loading = f"remote:{base_url}"
        self._connecting = {"url": base_url, "model": model, "key_needed": bool(api_key)}
        w.load_progress.set_stage("connecting", 0.0)
        w.load_progress.show()
        w.statusBar().showMessage(f"Connecting to {base_url}…")
        if self.model_info is None:
            w.model_label.setText(f"Connecting to <b>{html.escape(base_url)}</b>…")
            w.welcome_status.setText(f"Connecting to {base_url}…")
        w.update_buttons()
        self.loadStarted.emit(base_url)
        w.request(ConnectRemote(base_url, api_key, model))

    def open_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.w, "Open a GGUF model", "",
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.load(path)

    # -- fetching -------------------------------------------------------------------------
    def fetch_default(self) -> None:
        from engine.catalog import DEFAULT_MODEL

        self.fetch(DEFAULT_MODEL)

    def fetch(self, name: str) -> None:
        w = self.w
        if self.fetch_cancel is not None:
            return
        if self.model_info is None:
            w.stack.setCurrentWidget(w.welcome)
        if is_frozen():
            w.welcome_status.setText(FROZEN_FETCH_MESSAGE)
            w.show_error(FROZEN_FETCH_MESSAGE, "model")
            self.failed.emit(FROZEN_FETCH_MESSAGE)
            return
        self.fetch_cancel = threading.Event()
        w.fetch_progress.setValue(0)
        w.fetch_progress.show()
        w.fetch_cancel_button.show()
        w.fetch_cancel_button.setEnabled(True)
        w.welcome_status.setText(f"Fetching {name}…")
        w.statusBar().showMessage(f"Fetching {name}…")
        w.update_buttons()
        w.request(FetchModel(name, self.fetch_cancel))

    def cancel_fetch(self) -> None:
        if self.fetch_cancel is not None:
            self.fetch_cancel.set()
            self.w.fetch_cancel_button.setEnabled(False)
            self.w.welcome_status.setText("Cancelling…")

    def _fetch_ended(self) -> None:
        self.fetch_cancel = None
        self.w.fetch_cancel_button.hide()
        self.w.update_buttons()

    def on_fetch_progress(self, stage: str, fraction: float) -> None:
        if self.w.closed:
            return
        self.w.fetch_progress.setValue(int(fraction * 1000))
        self.w.welcome_status.setText(f"{stage[:1].upper()}{stage[1:]}… {fraction:.0%}")

    def on_fetch_finished(self, path: str) -> None:
        if self.w.closed:
            return
        self._fetch_ended()
        self.w.welcome_status.setText("Fetched.")
        self.load(path)

    def on_fetch_failed(self, failure: Failure) -> None:
        if self.w.closed:
            return
        w = self.w
        self._fetch_ended()
        w.fetch_progress.hide()
        if failure.kind == "cancelled":
            w.welcome_status.setText("Download cancelled.")
            w.statusBar().showMessage("Download cancelled", 5000)
        else:
            w.welcome_status.setText(f"Download failed: {failure.message}")
            w.show_error(f"Cannot fetch the model: {failure.message}", "model", failure)
        self.failed.emit(failure.message)

    # -- loading --------------------------------------------------------------------------
    def on_load_progress(self, stage: str, fraction: float) -> None:
        if self.w.closed:
            return
        w = self.w
        w.load_progress.set_stage(stage, fraction)
        if self.model_info is None:
            w.fetch_progress.setValue(int(fraction * 1000))
            w.welcome_status.setText(f"Loading: {stage}…")

    def on_needs_confirmation(self, check: FitCheck) -> None:
        """The worker did not load a model that does not fit: ask; load it anyway or go back."""
        if self.w.closed:
            return
        if self.ask_load_anyway(check):
            self.load(check.spec, force=True, keep_source=self._keep_source)
            return
        name = what_does_not_fit(check)
        self._load_ended()
        if self.model_info is None:
            self.w.welcome_status.setText(f"{name} was not loaded: it does not fit in memory.")
        self.w.statusBar().showMessage(f"{name} not loaded: it does not fit in memory", 10_000)
        self.w.update_buttons()
        self.failed.emit(f"{name} does not fit")

    def ask_load_anyway(self, check: FitCheck) -> bool:
        """Asks whether to load a model that does not fit (tests replace this method)."""
        return self.fit_question(check).exec() == QMessageBox.StandardButton.Yes

    def fit_question(self, check: FitCheck) -> QMessageBox:
        """The question :meth:`ask_load_anyway` asks: Load anyway (Yes) or Don't load (No, the
        default); with the draft model counted, naming both."""
        return fit_question(self.w, check)

    def on_loaded(self, model: ModelInfo) -> None:
        if self.w.closed:
            return
        w = self.w
        info = model.as_dict()
        self.loading = None
        self.model_info = info
        w.load_progress.hide()
        w.fetch_progress.hide()
        w.welcome_status.setText("")
        w.clear_error("model")
        remote = bool(info.get("remote"))
        if remote:
            endpoint = dict(self._connecting or {}, url=info["path"], model=info["remote_model"])
            w.store.set_setting("remote_endpoint", endpoint)
            w.store.set_setting("model_source", REMOTE)
            w.clear_error("remote")
        else:
            w.store.set_setting("last_model", info["path"])
            if not self._keep_source:
                w.store.set_setting("model_source", LOCAL)
        self._connecting, self._restoring_remote, self._keep_source = None, False, False
        w.model_label.setText(model_text(info))
        w.model_label.setToolTip(info["path"])
        w.setWindowTitle(f"{info['name']} — {APP_TITLE}")
        w.stack.setCurrentWidget(w.transcript)
        # A remote server keeps its own KV cache: the panel is shown disabled, with a note why.
        w.kv_panel.setEnabled(not remote)
        w.kv_remote_note.setVisible(remote)
        if not remote:
            w.kv_panel.set_model(info)   # may clamp the context: configures the worker first
            w.request(Configure.from_panel(w.kv_panel.settings()))
        w.statusBar().showMessage(f"{info['name']} ready", 5000)
        w.conversations.model_changed()
        w.update_buttons()
        if info.get("fit_verdict") == "tight":
            w.show_error(f"Memory is tight for {info['name']}: it {estimate_detail(info['fit_summary'])}. "
                         "Answers may slow down if the system starts swapping; a smaller context or "
                         "KV setting needs less.", "model")
        self.loaded.emit(info)

    def _load_ended(self) -> None:
        """A load that did not happen: back to the model there was (or the welcome page)."""
        w = self.w
        self.loading = None
        w.load_progress.hide()
        if self.model_info is None:
            w.fetch_progress.hide()
            w.model_label.setText("No model loaded")
            w.stack.setCurrentWidget(w.welcome)

    def on_load_failed(self, failure: Failure) -> None:
        if self.w.closed:
            return
        w = self.w
        spec = self.loading
        name = (spec[len("remote:"):] if spec.startswith("remote:") else Path(spec).name) \
            if spec else "the model"
        restoring, endpoint = self._restoring_remote, self._connecting
        self._connecting, self._restoring_remote, self._keep_source = None, False, False
        if restoring and endpoint is not None:
            self._remote_fallback(endpoint, failure)
            return
        self._load_ended()
        w.show_error(f"Cannot load {name}: {failure.message}", "model", failure)
        if self.model_info is None:
            w.welcome_status.setText(f"Cannot load {name}: {failure.message}")
        w.update_buttons()
        self.failed.emit(failure.message)

    def _remote_fallback(self, endpoint: dict, failure: Failure) -> None:
        """The saved server did not answer at start: the local model instead, the endpoint kept
        (the app tries it again at the next start; the dialog is filled in with it)."""
        w = self.w
        self.loading = None
        model = f" (model {endpoint['model']})" if endpoint.get("model") else ""
        w.show_error(f"Cannot connect to the saved server {endpoint['url']}{model}: {failure.message} "
                     "Using the local model instead. The server stays saved: File → Connect to a "
                     "server… (filled in) tries it again.", "remote", failure)
        self._start_local(self._fetch_if_missing, keep_source=True)
        if self.loading is None and self.fetch_cancel is None:     # no local model either
            w.load_progress.hide()
        w.update_buttons()

    # -- KV settings ----------------------------------------------------------------------
    def on_settings_applied(self, applied: KVApplied) -> None:
        if self.w.closed:
            return
        if self.model_info is None:
            return
        self.model_info.update(kv_spec=applied.kv_spec, kv_bytes_per_token=applied.kv_bytes_per_token)
        self.w.model_label.setText(model_text(self.model_info))
        self.w.statusBar().showMessage(f"KV cache now {applied.kv_spec}", 5000)

    def on_draft_applied(self, applied: DraftApplied) -> None:
        """The loaded model's default context beside the draft model now in use: the KV panel's
        context, unless the user chose one."""
        if self.w.closed or self.model_info is None or not applied.default_ctx:
            return
        self.model_info["default_ctx"] = applied.default_ctx
        self.w.kv_panel.set_default_ctx(applied.default_ctx)

    def on_kv_settings_changed(self, settings: dict) -> None:
        self.w.store.set_setting("kv_panel", self.w.kv_panel.state())
        self.w.request(Configure.from_panel(settings))
