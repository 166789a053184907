"""The KV panel's weight arithmetic row (exact or fast, engine.weights.ARITH_MODES): the box and
the note under it. Not part of the KV setting, but kept in the panel's state with it. Choosing
one emits ``changed(mode)``; the window's ArithController applies it in the worker and says what
the model runs (:meth:`ArithChoice.show`) and what fast costs it (:meth:`ArithChoice.show_cost`,
measured once per model).
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QComboBox, QLabel

from engine import weights

ARITH_CHOICES = (   # (mode, label, what it costs)
    ("exact", "Exact", "Integer kernels with 16-bit activations: reference-grade accuracy "
                       "(the answers of the float kernels, within a mean KL of 1e-5)"),
    ("fast", "Fast (int8, llama.cpp-like)", "int8 activations, as llama.cpp computes: faster prompt "
                                           "reading at a small accuracy cost, measured on the loaded model"),
)
ARITH_OFFERED = tuple(mode for mode, _, _ in ARITH_CHOICES)
NO_GAIN = "no faster than exact on this CPU (AVX2 without VNNI)"
ERROR_STYLE = "color: #dc2626;"
NOTE_STYLE = "color: palette(mid);"


class ArithChoice(QObject):
    """The chosen arithmetic, the one the loaded model runs (None: no model or not known yet), why
    it cannot run the chosen one, and the note on fast's cost; shown in :attr:`box` and
    :attr:`label`, which the panel lays out."""

    changed = Signal(str)   # the user chose a weight arithmetic

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.mode = "exact"
        self.running: str | None = None
        self.error = ""
        self.note = ("", False, "")     # (text, is an error, tooltip)
        self.box = QComboBox()
        for mode, label, cost in ARITH_CHOICES:
            self.box.addItem(label, mode)
            self.box.setItemData(self.box.count() - 1, cost, Qt.ItemDataRole.ToolTipRole)
        self.box.setToolTip("The weight products' arithmetic (not the KV cache's)\n"
                            + "\n".join(f"{label}: {cost}" for _, label, cost in ARITH_CHOICES))
        self.fast_pays = weights.fast_arith_pays()  # False on AVX2 without VNNI
        if not self.fast_pays:
            fast = self.box.findData("fast")
            self.box.setItemData(fast, ARITH_CHOICES[1][2] + ". " + NO_GAIN, Qt.ItemDataRole.ToolTipRole)
        self.label = QLabel()      # what fast costs this model, or why it cannot switch
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.label.setStyleSheet(NOTE_STYLE)
        self.label.setVisible(False)
        self.box.activated.connect(self._chosen)

    def select(self, mode: str) -> None:
        """As choosing it in the box."""
        index = self.box.findData(mode)
        if index < 0:
            raise ValueError(f"no arithmetic {mode!r}")
        self.box.setCurrentIndex(index)
        self._chosen(index)

    def restore(self, mode) -> None:
        """A saved choice (an unknown one is ignored), without ``changed``."""
        if mode in ARITH_OFFERED:
            self.mode = mode
            self.box.setCurrentIndex(self.box.findData(mode))

    def _chosen(self, index: int) -> None:
        mode = self.box.itemData(index)
        if mode == self.mode:
            return
        self.mode = mode
        self.changed.emit(mode)

    def show(self, running: str | None, error: str = "") -> None:
        """What the loaded model runs, and why not the chosen arithmetic (``error``). A model
        on the float kernels cannot switch: the box is disabled (the choice stays for the next
        model)."""
        self.running = running
        self.error = error
        self.refresh()

    def forget_cost(self) -> None:
        """Another model: fast's cost is its own."""
        self.note = ("", False, "")

    def measuring(self) -> None:
        self.note = ("Fast: measuring its cost on this model…", False, "")
        self.refresh()

    def show_cost(self, mean_kl: float, top1_agreement: float, n_tokens: int) -> None:
        """The fast arithmetic's cost on the loaded model (ArithCost's figures)."""
        gain = "" if self.fast_pays else f"; {NO_GAIN}"
        self.note = (f"Fast: mean KL {mean_kl:.4f} vs exact (measured on this model){gain}", False,
                     f"Over {n_tokens} tokens of the calibration text, both with 16-bit KV: mean KL "
                     f"{mean_kl:.5f} nats, the same top token at {top1_agreement:.1%} of positions")
        self.refresh()

    def cost_failed(self, kind: str, message: str) -> None:
        cancelled = kind == "cancelled"     # by a load: the next model's figure follows
        self.note = ("", False, "") if cancelled else (f"Cannot measure fast's cost: {message}", True, "")
        self.refresh()

    def refresh(self) -> None:
        self.box.setCurrentIndex(self.box.findData(self.mode))
        float_only = self.running == "float"
        self.box.setEnabled(not float_only)
        if self.error:
            text, error, tip = f"Not available for this model: {self.error}", True, ""
        elif float_only:
            text, error, tip = "This model runs on the float kernels: exact and fast need integer ones.", False, ""
        else:
            text, error, tip = self.note
        self.label.setText(text)
        self.label.setToolTip(tip)
        self.label.setStyleSheet(ERROR_STYLE if error else NOTE_STYLE)
        self.label.setVisible(bool(text))
