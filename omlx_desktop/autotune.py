"""The KV panel's Auto preset and the worker: when the panel asks for the loaded model's
sensitivity profile, a MeasureKVProfile request goes to the worker (it reads the profile back from
the store, per model file sha256, or measures it); progress, the profile, a failure or a cancel come
back to the panel. One measurement at a time; Cancel sets the request's Event.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Signal

from .protocol import Failure, KVProfileReady, MeasureKVProfile
from .window_surface import WindowSurface


class AutoTuneController(QObject):
    profileReady = Signal(object)      # KVProfileReady, after the panel has it
    profileFailed = Signal(object)     # Failure

    def __init__(self, window: WindowSurface):
        super().__init__(window)
        self.w = window
        self.cancel: threading.Event | None = None   # the running measurement's
        self.n_tokens: int | None = None             # calibration tokens (None: the default)
        panel, worker = window.kv_panel, window.worker
        panel.tuneRequested.connect(self.start)
        panel.tuneCancelled.connect(self.cancel_measurement)
        worker.kvProfileProgress.connect(self.on_progress)
        worker.kvProfileReady.connect(self.on_ready)
        worker.kvProfileFailed.connect(self.on_failed)

    def running(self) -> bool:
        return self.cancel is not None

    def start(self) -> None:
        if self.cancel is not None or self.w.closed:
            return
        self.cancel = threading.Event()
        self.w.request(MeasureKVProfile(self.cancel, self.n_tokens))

    def cancel_measurement(self) -> None:
        if self.cancel is not None:
            self.cancel.set()

    def on_progress(self, stage: str, fraction: float) -> None:
        if not self.w.closed:
            self.w.kv_panel.tune_progress(stage, fraction)

    def on_ready(self, ready: KVProfileReady) -> None:
        self.cancel = None
        if self.w.closed:
            return
        self.w.kv_panel.set_profile(ready.profile, ready.model_path, ready.from_store, ready.seconds)
        self.w.statusBar().showMessage(
            "KV sensitivity profile " + ("read back" if ready.from_store else f"measured in {ready.seconds:.0f} s"),
            5000)
        self.profileReady.emit(ready)

    def on_failed(self, failure: Failure) -> None:
        self.cancel = None
        if self.w.closed:
            return
        self.w.kv_panel.tune_failed(failure.kind, failure.message)
        if failure.logged:      # a bug, not a cancel or a model the tuner refuses: the banner too
            self.w.show_error(f"The KV sensitivity measurement failed: {failure.message}", "model", failure)
        self.profileFailed.emit(failure)
