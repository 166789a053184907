"""The KV panel's arithmetic setting and the worker: the choice (exact or fast) is saved with the
panel's state and sent to the worker (SetArith), which switches the loaded model at once and every
model loaded after it; what the model then runs, or why it cannot, comes back to the panel (and a
refusal to the banner).

What fast costs a model, its mean KL against exact arithmetic, is measured by the worker the first
time the model runs fast (MeasureArithCost, a few seconds) and kept in the store per model file
(Engine.model_id), so the panel shows it at once after that. A load started meanwhile cancels the
measurement; a result for a model no longer loaded is kept but not shown.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Signal

from .protocol import ArithApplied, ArithCost, Failure, MeasureArithCost, SetArith
from .window_surface import WindowSurface

COST_SETTING = "arith_cost"     # {model_id: {"mean_kl", "top1_agreement", "n_tokens"}}
COST_TOKENS = 256               # calibration tokens the cost is measured over


class ArithController(QObject):
    costShown = Signal(object)      # ArithCost the panel now shows (measured, or from the store)

    def __init__(self, window: WindowSurface):
        """Sends the panel's choice to the worker: construct it after the panel's state is restored
        and before the first model loads."""
        super().__init__(window)
        self.w = window
        self.cancel: threading.Event | None = None   # the running measurement's
        panel, worker = window.kv_panel, window.worker
        self.view = panel.arith_choice      # the panel's arithmetic row (kv_arith.ArithChoice)
        panel.arithChanged.connect(self.choose)
        worker.arithApplied.connect(self.on_applied)
        worker.arithCostReady.connect(self.on_cost)
        worker.arithCostFailed.connect(self.on_cost_failed)
        window.models.loadStarted.connect(self.cancel_measurement)
        window.models.loaded.connect(self.on_model_loaded)
        window.models.failed.connect(lambda _message: self._show_or_measure())
        window.request(SetArith(panel.arith()))

    def measuring(self) -> bool:
        return self.cancel is not None

    def choose(self, mode: str) -> None:
        self.w.store.set_setting("kv_panel", self.w.kv_panel.state())
        self.w.request(SetArith(mode))

    def cancel_measurement(self) -> None:
        if self.cancel is not None:
            self.cancel.set()

    def stored_cost(self, model_id: str) -> ArithCost | None:
        saved = (self.w.store.get_setting(COST_SETTING) or {}).get(model_id)
        try:
            return ArithCost(model_id, float(saved["mean_kl"]), float(saved["top1_agreement"]),
                             int(saved["n_tokens"]), 0.0)
        except (TypeError, KeyError, ValueError):   # none, or damaged: measured again
            return None

    def _local_model(self) -> dict | None:
        info = self.w.models.model_info
        return info if info is not None and not info.get("remote") and info.get("model_id") else None

    def _show_or_measure(self) -> None:
        """The loaded model's cost from the store; measured when it runs fast and none is stored."""
        info = self._local_model()
        if info is None or self.w.closed:
            return
        cost = self.stored_cost(info["model_id"])
        if cost is not None and cost.n_tokens == COST_TOKENS:
            self.view.show_cost(cost.mean_kl, cost.top1_agreement, cost.n_tokens)
            self.costShown.emit(cost)
        elif self.view.running == "fast" and self.cancel is None:
            self.cancel = threading.Event()
            self.view.measuring()
            self.w.request(MeasureArithCost(self.cancel, COST_TOKENS))

    def _show_refusal(self, error: str, failure: Failure | None = None) -> None:
        if error:
            self.w.show_error(f"Cannot use fast arithmetic: {error}", "arith", failure)
        else:
            self.w.clear_error("arith")

    # -- the worker's answers ---------------------------------------------------------------
    def on_model_loaded(self, info: dict) -> None:
        if self.w.closed or info.get("remote"):
            return
        self._show_refusal(info.get("arith_error", ""))
        self._show_or_measure()

    def on_applied(self, applied: ArithApplied) -> None:
        if self.w.closed:
            return
        error = applied.failure.message if applied.failure is not None else ""
        self.view.show(applied.mode or None, error)
        self._show_refusal(error, applied.failure)
        if applied.mode and not error:
            self.w.statusBar().showMessage(f"Weight arithmetic: {applied.mode}", 5000)
        self._show_or_measure()

    def on_cost(self, cost: ArithCost) -> None:
        self.cancel = None
        if self.w.closed:
            return
        costs = dict(self.w.store.get_setting(COST_SETTING) or {})
        costs[cost.model_id] = {"mean_kl": cost.mean_kl, "top1_agreement": cost.top1_agreement,
                                "n_tokens": cost.n_tokens}
        self.w.store.set_setting(COST_SETTING, costs)
        info = self._local_model()
        if info is not None and info["model_id"] == cost.model_id:
            self.view.show_cost(cost.mean_kl, cost.top1_agreement, cost.n_tokens)
            self.costShown.emit(cost)

    def on_cost_failed(self, failure: Failure) -> None:
        self.cancel = None
        if self.w.closed:
            return
        self.view.cost_failed(failure.kind, failure.message)
        if failure.logged:      # a bug, not a cancel or a model that cannot run fast: the banner too
            self.w.show_error(f"Measuring the fast arithmetic failed: {failure.message}", "arith", failure)
