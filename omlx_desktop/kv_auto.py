"""The KV panel's Auto preset: its section of the panel (:class:`AutoSection`) and its state
(:class:`AutoTuning`): the loaded model's sensitivity profile (engine.kvtune.Profile), the memory
slider's position, the last choice of widths, and the measurement's progress. The panel asks for
the profile (its ``tuneRequested``) and tells this what comes back; the choice is solved here on
every move of the slider, from the model's KV geometry and the panel's context.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QSlider, QVBoxLayout, QWidget

from engine.kv.config import KVConfig

from .chart import format_bytes

AUTO_STEPS = 1000   # the memory slider's positions, from every layer at 2 bits to every layer at 8
DEFAULT_AUTO_POSITION = 400
ERROR_SPAN = "<span style='color:#dc2626'>{}</span>"


class AutoSection(QWidget):
    """The Auto preset's controls: the memory slider with its budget, the estimated quality, and
    the sensitivity measurement's progress with Cancel (or Measure, to start it again). It only
    shows what :class:`AutoTuning` tells it."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, AUTO_STEPS)
        self.slider.setPageStep(AUTO_STEPS // 20)
        self.slider.setValue(DEFAULT_AUTO_POSITION)
        self.slider.setToolTip("Memory for the KV cache at full context; the Auto preset gives the layers "
                               "that matter most the bits")
        self.budget_label = QLabel()
        self.quality_label = QLabel()
        self.quality_label.setWordWrap(True)
        self.quality_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status_label = QLabel()
        self.status_label.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(False)
        self.progress.setMaximumHeight(10)
        self.cancel_button = QPushButton("Cancel")
        self.measure_button = QPushButton("Measure")
        self.measure_button.setToolTip("Measure how sensitive each layer's keys and values are (once per model file)")
        running = QHBoxLayout()
        running.setContentsMargins(0, 0, 0, 0)
        running.addWidget(self.progress, 1)
        running.addWidget(self.cancel_button)
        running.addWidget(self.measure_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.budget_label)
        layout.addWidget(self.slider)
        layout.addWidget(self.quality_label)
        layout.addWidget(self.status_label)
        layout.addLayout(running)

    def show_running(self, running: bool, can_measure: bool) -> None:
        self.progress.setVisible(running)
        self.cancel_button.setVisible(running)
        self.measure_button.setVisible(not running and can_measure)


class AutoTuning:
    """The Auto preset's state, shown in ``section``. ``geometry`` (the model's KV geometry, the
    worker's model info's) and ``ctx`` are the panel's, passed in where a budget needs them."""

    def __init__(self, section: AutoSection):
        self.section = section
        self.profile = None            # engine.kvtune.Profile of the loaded model
        self.position = DEFAULT_AUTO_POSITION
        self.choice = None             # engine.kvtune.Choice last made
        self.tuning = False            # a measurement runs
        self.message = ""

    # -- the measurement -----------------------------------------------------------------------
    def started(self) -> None:
        self.tuning = True
        self.message = "Measuring each layer's sensitivity…"
        self.section.progress.setValue(0)

    def progress(self, stage: str, fraction: float, n_layers: int | None) -> None:
        self.tuning = True
        self.section.progress.setValue(int(round(max(0.0, min(1.0, fraction)) * 1000)))
        if stage == "sensitivity" and n_layers:
            done = min(n_layers, int(fraction * n_layers))
            self.message = f"Measuring each layer's sensitivity: {done} of {n_layers} layers"
        else:
            self.message = f"Measuring each layer's sensitivity: {stage}"
        self.section.status_label.setText(self.message)
        self.section.show_running(True, False)

    def failed(self, kind: str, message: str) -> None:
        self.tuning = False
        self.message = ("Cancelled: the setting stays as it was." if kind == "cancelled"
                        else ERROR_SPAN.format(f"Cannot measure: {message}"))

    def accept(self, profile, from_store: bool, seconds: float) -> None:
        self.tuning = False
        self.profile = profile
        self.message = ("Sensitivity profile read back from the store" if from_store
                        else f"Sensitivity measured in {seconds:.0f} s (kept for this model file)")

    def forget(self) -> None:
        """Another model: its profile is its own."""
        self.profile, self.choice = None, None

    # -- the budget and the choice -------------------------------------------------------------
    def budget(self, geometry: dict | None, ctx: int) -> float | None:
        """The memory slider's budget in bytes at full context (None without a model)."""
        if geometry is None:
            return None
        from engine import kvtune

        low, high = kvtune.memory_range(geometry, ctx)
        return low + (high - low) * self.position / AUTO_STEPS

    def position_for(self, geometry: dict, ctx: int, budget: float) -> int:
        """The slider's position nearest ``budget`` bytes (not above it)."""
        from engine import kvtune

        low, high = kvtune.memory_range(geometry, ctx)
        position = int((budget - low) / (high - low) * AUTO_STEPS) if high > low else AUTO_STEPS
        return max(0, min(AUTO_STEPS, position))

    def choose(self, geometry: dict | None, ctx: int):
        """The profile's best choice (engine.kvtune.Choice) for the budget, kept as
        :attr:`choice`; None without a profile or a model, or when none fits (said in the
        status)."""
        from engine import kvtune

        budget = self.budget(geometry, ctx)
        if budget is None or self.profile is None:
            return None
        try:
            self.choice = kvtune.choose_for_memory(self.profile, geometry, ctx, budget)
        except kvtune.KVTuneError as exc:
            self.choice = None
            self.message = ERROR_SPAN.format(exc)
        return self.choice

    def refresh(self, show: bool, geometry: dict | None, ctx: int) -> None:
        s = self.section
        s.setVisible(show)
        if not show:
            return
        s.slider.setValue(self.position)
        s.slider.setEnabled(geometry is not None)
        budget = self.budget(geometry, ctx)
        if budget is None:
            s.budget_label.setText("KV at full context ≤ … (load a model)")
        else:
            s.budget_label.setText(f"KV at full context ≤ <b>{format_bytes(budget)}</b>")
        choice, profile = self.choice, self.profile
        if choice is not None and profile is not None:
            from engine import kvtune

            uniform = ", ".join(f"{spec.upper()} {kvtune.predicted_kl(profile, KVConfig.parse(spec)):.4f}"
                                for spec in ("k4v4", "k6v4"))
            s.quality_label.setText(f"Estimated quality: mean KL {choice.predicted_kl:.4f} vs 16-bit KV "
                                    f"(uniform {uniform}; lower is better)")
        elif profile is None:
            s.quality_label.setText("Estimated quality: after the model's sensitivity is measured")
        else:
            s.quality_label.setText("")
        s.status_label.setText(self.message)
        s.show_running(self.tuning, profile is None and geometry is not None)
