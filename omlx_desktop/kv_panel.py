"""The KV cache controls: K and V bits, presets, high-precision mode, per-layer precision,
context window and overflow policy, an import of a KV settings file, with a live estimate of the
cache at full context.

The panel only describes a setting; it knows nothing of the engine. The setting is a KVConfig
(:meth:`config`, built with KVConfig's methods; :meth:`spec` is its canonical string). It emits
``settingsChanged({"spec", "ctx", "overflow"})`` on every change (the window hands it to the
worker, which applies it before the next turn) and keeps its whole state in :meth:`state` /
:meth:`set_state` (a JSON-able dict the window saves in the Store).

The Auto preset chooses per-layer widths for a memory budget ("KV at full context ≤ X", a
slider) from the model's sensitivity profile (engine.kvtune): the panel asks for the profile with
``tuneRequested`` (the window's AutoTuneController has the worker measure it or read it back) and
solves the choice itself on every move of the slider; until a profile arrives the setting stays
what it was.

Beside the preset, the weight arithmetic (exact or fast, engine.weights.ARITH_MODES): not part of
the KV setting but kept in the panel's state with it. Choosing one emits ``arithChanged(mode)``;
the window's ArithController applies it in the worker and tells the panel what the model runs
(:meth:`show_arith`) and what fast costs it (:meth:`show_arith_cost`, measured once per model).
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QAbstractItemView, QCheckBox, QComboBox, QFileDialog, QFormLayout, QGridLayout, QHBoxLayout,
    QHeaderView, QLabel, QProgressBar, QPushButton, QSlider, QSpinBox, QStyledItemDelegate, QTableWidget,
    QTableWidgetItem, QToolButton, QVBoxLayout, QWidget,
)

from engine.kv.config import DEFAULT_PRESET, SELECTABLE_BITS, KVConfig, KVConfigError, estimate_bytes
from engine.kv.paged import OVERFLOW_POLICIES

from .chart import format_bytes

CUSTOM = "custom"   # the preset box's entry for anything that is not a preset
AUTO = "auto"       # the preset box's entry for widths chosen from the model's sensitivity profile
AUTO_STEPS = 1000   # the memory slider's positions, from every layer at 2 bits to every layer at 8
DEFAULT_AUTO_POSITION = 400
OVERFLOW_LABELS = {
    "stop": "Stop at the limit",
    "rolling": "Rolling (drop oldest)",
    "attention": "Attention (drop least attended)",
}
DEFAULT_CTX = 4096
MIN_CTX = 64
SETTINGS_FILTER = "KV settings (*.json *.toml);;All files (*)"
ARITH_CHOICES = (   # (mode, label, what it costs)
    ("exact", "Exact", "Integer kernels with 16-bit activations: reference-grade accuracy "
                       "(the answers of the float kernels, within a mean KL of 1e-5)"),
    ("fast", "Fast (int8, llama.cpp-like)", "int8 activations, as llama.cpp computes: faster prompt "
                                           "reading at a small accuracy cost, measured on the loaded model"),
)
ARITH_OFFERED = tuple(mode for mode, _, _ in ARITH_CHOICES)
ERROR_STYLE = "color: #dc2626;"
NOTE_STYLE = "color: palette(mid);"


def _within(overrides: dict[int, tuple[int, int]], n_layers: int | None) -> dict[int, tuple[int, int]]:
    """The overrides of layers the model has (all of them while no model is known)."""
    return {i: kv for i, kv in overrides.items() if n_layers is None or i < n_layers}


def layer_spec(k: int, v: int, overrides: dict[int, tuple[int, int]], n_layers: int | None) -> str:
    """The spec string for base ``kKvV`` and per-layer ``overrides`` (layer -> (k, v)): runs of
    consecutive layers with the same precision become one ``a-b:kXvY`` item."""
    return str(KVConfig(k, v).with_overrides(_within(overrides, n_layers)))


class _BitsDelegate(QStyledItemDelegate):
    """A combo box of the supported bit widths as the K/V cells' editor."""

    def createEditor(self, parent, option, index):  # noqa: N802
        box = QComboBox(parent)
        box.addItems([str(b) for b in SELECTABLE_BITS])
        return box

    def setEditorData(self, editor, index):  # noqa: N802
        editor.setCurrentText(str(index.data()))

    def setModelData(self, editor, model, index):  # noqa: N802
        model.setData(index, editor.currentText())


class LayerTable(QWidget):
    """The per-layer part of the KV panel: the first/last-layers shortcut and a table of each
    layer's K and V bits (editable; overridden layers in bold). It only shows a config: edits go
    back to the panel, which owns the setting."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.first_spin = QSpinBox()
        self.last_spin = QSpinBox()
        for spin, value in ((self.first_spin, 4), (self.last_spin, 2)):
            spin.setRange(0, 512)
            spin.setValue(value)
        self.apply_first_last = QPushButton("Apply")
        self.clear_layers = QPushButton("Clear")
        shortcut = QHBoxLayout()
        shortcut.setContentsMargins(0, 0, 0, 0)
        shortcut.addWidget(QLabel("First"))
        shortcut.addWidget(self.first_spin)
        shortcut.addWidget(QLabel("and last"))
        shortcut.addWidget(self.last_spin)
        shortcut.addWidget(QLabel("layers at K8V8"))
        shortcut.addStretch(1)
        shortcut_buttons = QHBoxLayout()
        shortcut_buttons.setContentsMargins(0, 0, 0, 0)
        shortcut_buttons.addStretch(1)
        shortcut_buttons.addWidget(self.apply_first_last)
        shortcut_buttons.addWidget(self.clear_layers)
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["Layer", "K bits", "V bits"])
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.table.setItemDelegateForColumn(1, _BitsDelegate(self.table))
        self.table.setItemDelegateForColumn(2, _BitsDelegate(self.table))
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked
                                   | QAbstractItemView.EditTrigger.SelectedClicked
                                   | QAbstractItemView.EditTrigger.EditKeyPressed)
        self.table.setMinimumHeight(140)
        adv = QVBoxLayout(self)
        adv.setContentsMargins(0, 0, 0, 0)
        adv.addLayout(shortcut)
        adv.addLayout(shortcut_buttons)
        adv.addWidget(self.table)

    def fill(self, config: KVConfig, n_layers: int, overridden: set[int]) -> None:
        """Show `config`'s precision of each of `n_layers` layers; layers in `overridden` bold."""
        self.table.setRowCount(n_layers)
        bold = QFont(self.table.font())
        bold.setBold(True)
        for i, layer in enumerate(config.per_layer(n_layers) if n_layers else []):
            for col, text in ((0, str(i)), (1, str(layer.k_bits)), (2, str(layer.v_bits))):
                item = self.table.item(i, col)
                if item is None:
                    item = QTableWidgetItem()
                    item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                    self.table.setItem(i, col, item)
                item.setText(text)
                item.setFont(bold if i in overridden and col else self.table.font())
                flags = Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable
                if col:
                    flags |= Qt.ItemFlag.ItemIsEditable
                item.setFlags(flags)


class AutoSection(QWidget):
    """The Auto preset's controls: the memory slider with its budget, the estimated quality, and
    the sensitivity measurement's progress with Cancel (or Measure, to start it again). It only
    shows what the panel tells it; the panel owns the setting."""

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


class KVPanel(QWidget):
    settingsChanged = Signal(object)   # {"spec", "ctx", "overflow"}
    tuneRequested = Signal()           # Auto needs the loaded model's sensitivity profile
    tuneCancelled = Signal()           # the user cancelled the running measurement
    importFailed = Signal(str)         # a KV settings file that cannot be used: why (also shown here)
    arithChanged = Signal(str)         # the user chose a weight arithmetic ("exact" or "fast")

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        # the setting: base precision and options (no overrides) + per-layer precision by layer;
        # a layer keeps its entry while it equals the base, so moving the sliders reveals it again
        self._base = KVConfig.preset(DEFAULT_PRESET)
        self._preset = DEFAULT_PRESET
        self._overrides: dict[int, tuple[int, int]] = {}
        self._hp = False
        self._before_hp: dict | None = None
        self._geometry: dict | None = None
        self._n_layers: int | None = None
        self._max_ctx: int | None = None
        # the context was set by the user (or restored as set): a model's default no longer applies
        self._ctx_chosen = False
        self._updating = False
        # the Auto preset: the loaded model's profile (engine.kvtune.Profile), the slider's
        # position, the last choice, and whether a measurement is running
        self._profile = None
        self._auto_position = DEFAULT_AUTO_POSITION
        self._auto_choice = None
        self._tuning = False
        self._tune_message = ""
        self._model_path: str | None = None
        # the weight arithmetic: the one chosen, the one the loaded model runs (None: no model or
        # not known yet), why it cannot run the chosen one, and the note on fast's cost
        self._arith = "exact"
        self._running_arith: str | None = None
        self._arith_error = ""
        self._arith_note = ("", False, "")     # (text, is an error, tooltip)

        # presets and high-precision mode
        self.preset_box = QComboBox()
        for name, label in KVConfig.presets():
            self.preset_box.addItem(label, name)
        self.preset_box.addItem("Auto (fit to memory)", AUTO)
        self.preset_box.addItem("Custom", CUSTOM)
        self.preset_box.setToolTip("Bits per stored key (K) and value (V) in the KV cache")
        self.import_button = QPushButton("Import…")
        self.import_button.setToolTip(
            "Load KV cache settings from a JSON or TOML file: this app's keys (k_bits, v_bits, layers, "
            "preset, spec, ...) or llama.cpp's cache_type_k / cache_type_v")
        self.arith_box = QComboBox()
        for mode, label, cost in ARITH_CHOICES:
            self.arith_box.addItem(label, mode)
            self.arith_box.setItemData(self.arith_box.count() - 1, cost, Qt.ItemDataRole.ToolTipRole)
        self.arith_box.setToolTip("The weight products' arithmetic (not the KV cache's)\n"
                                  + "\n".join(f"{label}: {cost}" for _, label, cost in ARITH_CHOICES))
        self.arith_label = QLabel()      # what fast costs this model, or why it cannot switch
        self.arith_label.setWordWrap(True)
        self.arith_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.arith_label.setStyleSheet(NOTE_STYLE)
        self.arith_label.setVisible(False)
        self.high_precision = QCheckBox("High-precision mode (K8V8)")
        self.high_precision.setToolTip(
            "Switch every layer to 8-bit keys and values; switching it off restores the setting before")

        # sliders
        self.k_slider, self.k_label = self._slider("K")
        self.v_slider, self.v_label = self._slider("V")
        sliders = QGridLayout()
        sliders.setContentsMargins(0, 0, 0, 0)
        sliders.addWidget(self.k_label, 0, 0)
        sliders.addWidget(self.k_slider, 0, 1)
        sliders.addWidget(self.v_label, 1, 0)
        sliders.addWidget(self.v_slider, 1, 1)
        sliders.setColumnStretch(1, 1)

        # context and overflow
        self.ctx_spin = QSpinBox()
        self.ctx_spin.setRange(MIN_CTX, 1 << 20)
        self.ctx_spin.setSingleStep(256)
        self.ctx_spin.setGroupSeparatorShown(True)
        self.ctx_spin.setSuffix(" tokens")
        self.ctx_spin.setValue(DEFAULT_CTX)
        self.overflow_box = QComboBox()
        for policy in OVERFLOW_POLICIES:
            self.overflow_box.addItem(OVERFLOW_LABELS.get(policy, policy), policy)
        self.overflow_box.setCurrentIndex(OVERFLOW_POLICIES.index("rolling"))
        self.overflow_box.setToolTip("What happens when the conversation reaches the context window")
        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        preset_row = QHBoxLayout()
        preset_row.setContentsMargins(0, 0, 0, 0)
        preset_row.addWidget(self.preset_box, 1)
        preset_row.addWidget(self.import_button)
        form.addRow("Preset", preset_row)
        form.addRow("Arithmetic", self.arith_box)
        form.addRow(self.arith_label)
        form.addRow("Context", self.ctx_spin)
        form.addRow("At the limit", self.overflow_box)

        # the estimate
        self.estimate_label = QLabel()
        self.estimate_label.setWordWrap(True)
        self.estimate_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.spec_label = QLabel()
        self.spec_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.spec_label.setStyleSheet("color: palette(mid);")
        self.spec_label.setWordWrap(True)
        self.import_label = QLabel()     # the last import's outcome (an error in red)
        self.import_label.setWordWrap(True)
        self.import_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.import_label.setVisible(False)

        # advanced: per layer
        self.advanced_button = QToolButton()
        self.advanced_button.setText("Per-layer precision")
        self.advanced_button.setCheckable(True)
        self.advanced_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.advanced_button.setArrowType(Qt.ArrowType.RightArrow)
        self.advanced_button.setAutoRaise(True)
        self.advanced = LayerTable()
        # the table's widgets under the panel's names (tests and the window reach them here)
        self.first_spin, self.last_spin = self.advanced.first_spin, self.advanced.last_spin
        self.apply_first_last, self.clear_layers = self.advanced.apply_first_last, self.advanced.clear_layers
        self.table = self.advanced.table
        self.advanced.setVisible(False)

        # the Auto preset
        self.auto = AutoSection()
        self.auto_slider = self.auto.slider
        self.auto.setVisible(False)

        note = QLabel("Changes apply from the next message.")
        note.setStyleSheet("color: palette(mid);")
        self.switch_label = QLabel()  # what the pending format costs the pinned documents
        self.switch_label.setWordWrap(True)
        self.switch_label.setVisible(False)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.setSpacing(6)
        layout.addLayout(form)
        layout.addLayout(sliders)
        layout.addWidget(self.auto)
        layout.addWidget(self.high_precision)
        layout.addWidget(self.switch_label)
        layout.addWidget(self.estimate_label)
        layout.addWidget(self.spec_label)
        layout.addWidget(self.import_label)
        layout.addWidget(self.advanced_button)
        layout.addWidget(self.advanced, 1)
        layout.addWidget(note)
        layout.addStretch(0)

        self.preset_box.activated.connect(self._preset_chosen)
        self.import_button.clicked.connect(self._choose_settings_file)
        self.k_slider.valueChanged.connect(lambda _: self._slider_moved())
        self.v_slider.valueChanged.connect(lambda _: self._slider_moved())
        self.arith_box.activated.connect(self._arith_chosen)
        for box in (self.preset_box, self.overflow_box, self.arith_box):
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            box.setMinimumContentsLength(14)
        self.high_precision.toggled.connect(self.set_high_precision)
        self.ctx_spin.valueChanged.connect(lambda _: self._changed())
        self.ctx_spin.valueChanged.connect(self._ctx_edited)
        self.overflow_box.currentIndexChanged.connect(lambda _: self._changed())
        self.advanced_button.toggled.connect(self._toggle_advanced)
        self.apply_first_last.clicked.connect(
            lambda: self.set_first_last(self.first_spin.value(), self.last_spin.value()))
        self.clear_layers.clicked.connect(lambda: self.set_overrides({}))
        self.table.itemChanged.connect(self._cell_edited)
        self.auto_slider.valueChanged.connect(self._auto_moved)
        self.auto.cancel_button.clicked.connect(self.tuneCancelled.emit)
        self.auto.measure_button.clicked.connect(self._request_profile)
        self._refresh()

    def _slider(self, role: str) -> tuple[QSlider, QLabel]:
        slider = QSlider(Qt.Orientation.Horizontal)
        slider.setRange(0, len(SELECTABLE_BITS) - 1)
        slider.setPageStep(1)
        slider.setTickPosition(QSlider.TickPosition.TicksBelow)
        slider.setTickInterval(1)
        slider.setToolTip(f"{role} bits: " + ", ".join(str(b) for b in SELECTABLE_BITS))
        label = QLabel()
        label.setMinimumWidth(label.fontMetrics().horizontalAdvance(f"{role}: 16 bits") + 4)
        return slider, label

    # -- what the panel says --------------------------------------------------------------
    def config(self) -> KVConfig:
        """The KV cache setting the panel describes."""
        if self._hp:
            return self._base.with_high_precision()
        return self._base.with_overrides(_within(self._overrides, self._n_layers))

    def spec(self) -> str:
        return str(self.config())

    def settings(self) -> dict:
        return {"spec": self.spec(), "ctx": self.ctx_spin.value(), "overflow": self.overflow()}

    def overflow(self) -> str:
        return self.overflow_box.currentData()

    def bits(self) -> tuple[int, int]:
        return SELECTABLE_BITS[self.k_slider.value()], SELECTABLE_BITS[self.v_slider.value()]

    def preset(self) -> str:
        return self.preset_box.currentData()

    def overrides(self) -> dict[int, tuple[int, int]]:
        return dict(self._overrides)

    def is_high_precision(self) -> bool:
        return self._hp

    def _core(self) -> dict:
        b = self._base
        return {"k": b.k_bits, "v": b.v_bits, "preset": self._preset,
                "overrides": {str(i): list(kv) for i, kv in sorted(self._overrides.items())},
                "block_size": b.block_size, "sinks": b.sinks, "rotation": b.rotation}

    def state(self) -> dict:
        """Everything needed to restore the panel (JSON-able)."""
        return {**self._core(), "high_precision": self._hp, "before_high_precision": self._before_hp,
                "ctx": self.ctx_spin.value(), "ctx_chosen": self._ctx_chosen, "overflow": self.overflow(),
                "advanced_open": self.advanced_button.isChecked(), "auto_position": self._auto_position,
                "arith": self._arith}

    def set_state(self, state: dict | None) -> None:
        if not state:
            return
        self._updating = True
        try:
            self._set_core(state)
            self._hp = bool(state.get("high_precision"))
            self._before_hp = state.get("before_high_precision") if self._hp else None
            if state.get("ctx"):
                self.ctx_spin.setValue(int(state["ctx"]))
            # a state saved before the flag existed: a context other than the default was chosen
            self._ctx_chosen = bool(state.get("ctx_chosen",
                                              int(state.get("ctx") or DEFAULT_CTX) != DEFAULT_CTX))
            if state.get("overflow") in OVERFLOW_POLICIES:
                self.overflow_box.setCurrentIndex(OVERFLOW_POLICIES.index(state["overflow"]))
            self.advanced_button.setChecked(bool(state.get("advanced_open")))
            position = state.get("auto_position")
            if isinstance(position, int) and 0 <= position <= AUTO_STEPS:
                self._auto_position = position
                self.auto_slider.setValue(position)
            if state.get("arith") in ARITH_OFFERED:
                self._arith = state["arith"]
                self.arith_box.setCurrentIndex(self.arith_box.findData(self._arith))
        finally:
            self._updating = False
        self._changed()

    def _set_core(self, core: dict) -> None:
        """Restores a saved setting; a value no longer valid falls back to the default's."""
        default = KVConfig.preset(DEFAULT_PRESET)
        k, v = int(core.get("k", default.k_bits)), int(core.get("v", default.v_bits))
        k = k if k in SELECTABLE_BITS else default.k_bits
        v = v if v in SELECTABLE_BITS else default.v_bits
        try:
            self._base = KVConfig(k, v, block_size=core.get("block_size", default.block_size),
                                  sinks=core.get("sinks", default.sinks),
                                  rotation=core.get("rotation", default.rotation))
        except KVConfigError:
            self._base = default.with_bits(k, v)
        known = {*dict(KVConfig.presets()), AUTO}
        self._preset = core.get("preset") if core.get("preset") in known else CUSTOM
        self._overrides = {int(i): (int(kv[0]), int(kv[1]))
                           for i, kv in (core.get("overrides") or {}).items()
                           if int(i) >= 0 and int(kv[0]) in SELECTABLE_BITS and int(kv[1]) in SELECTABLE_BITS}

    # -- the model ------------------------------------------------------------------------
    def set_model(self, info: dict | None) -> None:
        """The loaded model (the worker's model info): its geometry for the estimate, its
        layers for the table, its context length as the context's maximum, the arithmetic it runs."""
        path = info.get("path") if info else None
        if self._profile is not None and path != self._model_path:
            self._profile, self._auto_choice = None, None   # another model's profile
        if path != self._model_path:
            self._arith_note = ("", False, "")              # another model's cost
        self._model_path = path
        known = info or {}
        self.show_arith(known.get("arith") or None, known.get("arith_error", ""))
        self._geometry = info["geometry"] if info else None
        self._n_layers = self._geometry["n_layers"] if self._geometry else None
        self._max_ctx = info["context_length"] if info else None
        self._updating = True
        try:
            if self._max_ctx:
                self.ctx_spin.setMaximum(self._max_ctx)
                if not self._ctx_chosen and info.get("default_ctx"):
                    # the model's own context, capped by what fits in memory (engine.fit)
                    self.ctx_spin.setValue(int(info["default_ctx"]))
            else:
                self.ctx_spin.setMaximum(1 << 20)
            if self._n_layers:
                self._overrides = {i: kv for i, kv in self._overrides.items() if i < self._n_layers}
                self.first_spin.setMaximum(self._n_layers)
                self.last_spin.setMaximum(self._n_layers)
        finally:
            self._updating = False
        self._changed()
        if self._preset == AUTO and self._profile is None and not self._hp:
            self._request_profile()

    # -- user actions ---------------------------------------------------------------------
    def select_preset(self, name: str) -> None:
        """As choosing it in the box: a preset sets both sliders, clears per-layer precision
        and sets the options (block size, sinks, rotation) to the defaults; "custom" keeps what
        is set."""
        index = self.preset_box.findData(name)
        if index < 0:
            raise ValueError(f"no preset {name!r}")
        self.preset_box.setCurrentIndex(index)
        self._preset_chosen(index)

    def _preset_chosen(self, index: int) -> None:
        name = self.preset_box.itemData(index)
        self._preset = name
        if name == AUTO:
            if self._profile is None:
                self._request_profile()
        elif name != CUSTOM:
            self._base = KVConfig.preset(name)
            self._overrides = {}
        self._changed()

    def set_bits(self, k: int, v: int) -> None:
        """As moving the sliders (selects Custom)."""
        self.k_slider.setValue(SELECTABLE_BITS.index(k))
        self.v_slider.setValue(SELECTABLE_BITS.index(v))

    def _slider_moved(self) -> None:
        if self._updating or self._hp:
            return
        self._base = self._base.with_bits(*self.bits())
        self._preset = CUSTOM
        self._changed()

    def set_high_precision(self, on: bool) -> None:
        """On: K8V8 in every layer, remembering what was set; off: exactly that again."""
        on = bool(on)
        if on == self._hp:
            self._refresh()
            return
        if on:
            self._before_hp = self._core()
            self._hp = True
        else:
            self._hp = False
            if self._before_hp:
                self._set_core(self._before_hp)
            self._before_hp = None
        self._changed()

    def set_first_last(self, first: int, last: int, bits: tuple[int, int] | None = None) -> None:
        """Per-layer precision: the first ``first`` and last ``last`` layers at ``bits``
        (default: high precision, K8V8), the rest at the sliders' setting."""
        n = self._n_layers
        if not n:
            return
        if bits is None:
            high = self._base.with_high_precision().base
            bits = (high.k_bits, high.v_bits)
        overrides = {i: bits for i in range(min(first, n))}
        overrides.update({i: bits for i in range(max(0, n - last), n)})
        self.set_overrides(overrides)

    def set_overrides(self, overrides: dict[int, tuple[int, int]]) -> None:
        self._overrides = {int(i): (int(k), int(v)) for i, (k, v) in overrides.items()}
        if self._overrides and self._preset != CUSTOM:
            self._preset = CUSTOM
        self._changed()

    def set_layer(self, layer: int, k: int, v: int) -> None:
        if (k, v) == (self._base.k_bits, self._base.v_bits):
            self._overrides.pop(layer, None)
        else:
            self._overrides[layer] = (k, v)
            self._preset = CUSTOM
        self._changed()

    def import_settings(self, path) -> str | None:
        """Applies a KV settings file (JSON or TOML, read by KVConfig.from_file: this app's keys
        or llama.cpp's cache_type_k / cache_type_v) as the panel's setting, leaving high-precision
        mode. Returns None once applied, else the error, which the panel also shows; on an error
        nothing changes."""
        try:
            config = KVConfig.from_file(path)
            try:
                layers = config.overrides_by_layer(self._n_layers)
            except KVConfigError as exc:
                hint = "; load a model first" if self._n_layers is None else ""
                raise KVConfigError(f"{path}: {exc}{hint}") from None
        except KVConfigError as exc:
            self._show_import(str(exc), error=True)
            self.importFailed.emit(str(exc))
            return str(exc)
        self._hp = False
        self._before_hp = None
        self._base = config.with_overrides(())
        self._overrides = {i: (p.k_bits, p.v_bits) for i, p in layers.items()}
        self._preset = config.preset_name() or CUSTOM
        self._changed()
        self._show_import(f"Imported {Path(path).name}")
        return None

    def _choose_settings_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import KV cache settings", "", SETTINGS_FILTER)
        if path:
            self.import_settings(path)

    def _show_import(self, text: str, error: bool = False) -> None:
        self.import_label.setStyleSheet(ERROR_STYLE if error else NOTE_STYLE)
        self.import_label.setText(text)
        self.import_label.setVisible(bool(text))

    def import_message(self) -> str:
        """What the last import said (its error, or which file it applied); '' after a change."""
        return self.import_label.text()

    def _cell_edited(self, item: QTableWidgetItem) -> None:
        if self._updating or item.column() == 0:
            return
        row = item.row()
        try:
            bits = int(item.text().strip())
            if bits not in SELECTABLE_BITS:
                raise ValueError
        except ValueError:
            self._refresh()  # puts the old value back
            return
        layer = self.config().per_layer(self._n_layers)[row]
        k, v = layer.k_bits, layer.v_bits
        if item.column() == 1:
            k = bits
        else:
            v = bits
        self.set_layer(row, k, v)

    def _toggle_advanced(self, open_: bool) -> None:
        self.advanced.setVisible(open_)
        self.advanced_button.setArrowType(Qt.ArrowType.DownArrow if open_ else Qt.ArrowType.RightArrow)
        if not self._updating:
            self.settingsChanged.emit(self.settings())

    # -- the weight arithmetic ------------------------------------------------------------
    def arith(self) -> str:
        """The chosen arithmetic ("exact" or "fast"), whatever the loaded model runs."""
        return self._arith

    def running_arith(self) -> str | None:
        """The arithmetic the loaded model runs (None: no model, or not known yet)."""
        return self._running_arith

    def select_arith(self, mode: str) -> None:
        """As choosing it in the box."""
        index = self.arith_box.findData(mode)
        if index < 0:
            raise ValueError(f"no arithmetic {mode!r}")
        self.arith_box.setCurrentIndex(index)
        self._arith_chosen(index)

    def _arith_chosen(self, index: int) -> None:
        mode = self.arith_box.itemData(index)
        if mode == self._arith:
            return
        self._arith = mode
        self.arithChanged.emit(mode)

    def show_arith(self, running: str | None, error: str = "") -> None:
        """What the loaded model runs, and why not the chosen arithmetic (``error``). A model
        on the float kernels cannot switch: the box is disabled (the choice stays for the next
        model)."""
        self._running_arith = running
        self._arith_error = error
        self._refresh_arith()

    def arith_measuring(self) -> None:
        self._arith_note = ("Fast: measuring its cost on this model…", False, "")
        self._refresh_arith()

    def show_arith_cost(self, mean_kl: float, top1_agreement: float, n_tokens: int) -> None:
        """The fast arithmetic's cost on the loaded model (ArithCost's figures)."""
        self._arith_note = (f"Fast: mean KL {mean_kl:.4f} vs exact (measured on this model)", False,
                            f"Over {n_tokens} tokens of the calibration text, both with 16-bit KV: mean KL "
                            f"{mean_kl:.5f} nats, the same top token at {top1_agreement:.1%} of positions")
        self._refresh_arith()

    def arith_cost_failed(self, kind: str, message: str) -> None:
        cancelled = kind == "cancelled"     # by a load: the next model's figure follows
        self._arith_note = ("", False, "") if cancelled else (f"Cannot measure fast's cost: {message}", True, "")
        self._refresh_arith()

    def arith_note(self) -> str:
        """The note under the arithmetic box as plain text ('' when hidden)."""
        return self.arith_label.text() if self.arith_label.isVisibleTo(self) else ""

    def _refresh_arith(self) -> None:
        self.arith_box.setCurrentIndex(self.arith_box.findData(self._arith))
        float_only = self._running_arith == "float"
        self.arith_box.setEnabled(not float_only)
        if self._arith_error:
            text, error, tip = f"Not available for this model: {self._arith_error}", True, ""
        elif float_only:
            text, error, tip = "This model runs on the float kernels: exact and fast need integer ones.", False, ""
        else:
            text, error, tip = self._arith_note
        self.arith_label.setText(text)
        self.arith_label.setToolTip(tip)
        self.arith_label.setStyleSheet(ERROR_STYLE if error else NOTE_STYLE)
        self.arith_label.setVisible(bool(text))

    # -- the Auto preset ------------------------------------------------------------------
    def _request_profile(self) -> None:
        """Asks for the loaded model's sensitivity profile (nothing while no model is loaded or a
        measurement runs)."""
        if self._geometry is None or self._tuning:
            return
        self._tuning = True
        self._tune_message = "Measuring each layer's sensitivity…"
        self.auto.progress.setValue(0)
        self._refresh()
        self.tuneRequested.emit()

    def tune_progress(self, stage: str, fraction: float) -> None:
        """The measurement's progress (from the worker)."""
        self._tuning = True
        self.auto.progress.setValue(int(round(max(0.0, min(1.0, fraction)) * 1000)))
        if stage == "sensitivity" and self._n_layers:
            done = min(self._n_layers, int(fraction * self._n_layers))
            self._tune_message = f"Measuring each layer's sensitivity: {done} of {self._n_layers} layers"
        else:
            self._tune_message = f"Measuring each layer's sensitivity: {stage}"
        self.auto.status_label.setText(self._tune_message)
        self.auto.show_running(True, False)

    def tune_failed(self, kind: str, message: str) -> None:
        """The measurement stopped (cancelled or failed): the setting stays what it was."""
        self._tuning = False
        self._tune_message = ("Cancelled: the setting stays as it was." if kind == "cancelled"
                              else f"<span style='color:#dc2626'>Cannot measure: {message}</span>")
        self._refresh()

    def set_profile(self, profile, model_path: str | None = None, from_store: bool = False,
                    seconds: float = 0.0) -> None:
        """The loaded model's sensitivity profile (engine.kvtune.Profile); under the Auto preset
        the widths are chosen from it at once. A profile for another model file is ignored."""
        if model_path is not None and model_path != self._model_path:
            return
        if self._n_layers is not None and profile.n_layers != self._n_layers:
            return
        self._tuning = False
        self._profile = profile
        self._tune_message = ("Sensitivity profile read back from the store" if from_store
                              else f"Sensitivity measured in {seconds:.0f} s (kept for this model file)")
        self._changed()

    def profile(self):
        return self._profile

    def auto_choice(self):
        """The Auto preset's last choice (engine.kvtune.Choice: widths, predicted KL, bytes at the
        context, budget), or None."""
        return self._auto_choice

    def is_tuning(self) -> bool:
        return self._tuning

    def auto_budget(self) -> float | None:
        """The memory slider's budget in bytes at full context (None without a model)."""
        if self._geometry is None:
            return None
        from engine import kvtune

        low, high = kvtune.memory_range(self._geometry, self.ctx_spin.value())
        return low + (high - low) * self._auto_position / AUTO_STEPS

    def set_auto_budget(self, budget: float) -> None:
        """As moving the memory slider to the position nearest `budget` bytes (not above it)."""
        from engine import kvtune

        low, high = kvtune.memory_range(self._geometry, self.ctx_spin.value())
        position = int((budget - low) / (high - low) * AUTO_STEPS) if high > low else AUTO_STEPS
        self.auto_slider.setValue(max(0, min(AUTO_STEPS, position)))

    def _auto_moved(self, position: int) -> None:
        if self._updating:
            return
        self._auto_position = int(position)
        self._changed()

    def _apply_auto(self) -> None:
        """Sets the base and per-layer widths to the profile's best choice for the budget."""
        from engine import kvtune

        budget = self.auto_budget()
        if budget is None or self._profile is None:
            return
        try:
            choice = kvtune.choose_for_memory(self._profile, self._geometry, self.ctx_spin.value(), budget)
        except kvtune.KVTuneError as exc:
            self._auto_choice = None
            self._tune_message = f"<span style='color:#dc2626'>{exc}</span>"
            return
        self._auto_choice = choice
        config = choice.config
        self._base = config.with_overrides(())
        self._overrides = {i: (int(k), int(v)) for i, (k, v) in enumerate(choice.widths)
                           if (int(k), int(v)) != (config.k_bits, config.v_bits)}

    def _refresh_auto(self) -> None:
        show = self._preset == AUTO and not self._hp
        self.auto.setVisible(show)
        if not show:
            return
        self.auto_slider.setValue(self._auto_position)
        self.auto_slider.setEnabled(self._geometry is not None)
        budget = self.auto_budget()
        if budget is None:
            self.auto.budget_label.setText("KV at full context ≤ … (load a model)")
        else:
            self.auto.budget_label.setText(f"KV at full context ≤ <b>{format_bytes(budget)}</b>")
        choice, profile = self._auto_choice, self._profile
        if choice is not None and profile is not None:
            from engine import kvtune

            uniform = ", ".join(f"{spec.upper()} {kvtune.predicted_kl(profile, KVConfig.parse(spec)):.4f}"
                                for spec in ("k4v4", "k6v4"))
            self.auto.quality_label.setText(
                f"Estimated quality: mean KL {choice.predicted_kl:.4f} vs 16-bit KV "
                f"(uniform {uniform}; lower is better)")
        elif profile is None:
            self.auto.quality_label.setText("Estimated quality: after the model's sensitivity is measured")
        else:
            self.auto.quality_label.setText("")
        self.auto.status_label.setText(self._tune_message)
        self.auto.show_running(self._tuning, self._profile is None and self._geometry is not None)

    # -- refresh --------------------------------------------------------------------------
    def _ctx_edited(self, _value: int) -> None:
        if not self._updating:
            self._ctx_chosen = True

    def _changed(self) -> None:
        if self._updating:
            return
        if self._preset == AUTO and self._profile is not None and not self._hp:
            self._apply_auto()      # the budget, the context or the profile changed
        if self.import_label.text():
            self._show_import("")
        self._refresh()
        self.settingsChanged.emit(self.settings())

    def show_switch_cost(self, cost: dict) -> None:
        """The note under the preset controls for the engine's Session.switch_cost of the spec
        the panel now asks for ({"spec", "reread", "documents", "source"}); a cost for another
        spec than the panel's (an older request) or for the format in use hides it."""
        spec = cost.get("spec")
        text = ""
        if spec == str(self.config()):
            name = spec.upper()
            if cost.get("reread"):
                n = cost.get("documents", 0)
                text = (f"Switching to {name} re-reads {n} document{'s' if n != 1 else ''} "
                        f"({cost['reread']:,} tokens).")
            elif cost.get("source") == "master":
                text = f"Switching to {name}: pinned documents are derived from their 8-bit master copy, no re-read."
            elif cost.get("source") in ("memory", "disk"):
                text = f"Switching to {name}: pinned documents are already cached in it, no re-read."
        self.switch_label.setText(text)
        self.switch_label.setVisible(bool(text))

    def switch_note(self) -> str:
        return self.switch_label.text() if self.switch_label.isVisibleTo(self) else ""

    def _refresh(self) -> None:
        self._updating = True
        try:
            config = self.config()
            k, v = config.k_bits, config.v_bits
            self.k_slider.setValue(SELECTABLE_BITS.index(k))
            self.v_slider.setValue(SELECTABLE_BITS.index(v))
            self.k_label.setText(f"K: {k} bits")
            self.v_label.setText(f"V: {v} bits")
            preset = (config.preset_name() or CUSTOM) if self._hp else self._preset
            self.preset_box.setCurrentIndex(max(0, self.preset_box.findData(preset)))
            self.high_precision.setChecked(self._hp)
            for w in (self.k_slider, self.v_slider, self.preset_box, self.table,
                      self.apply_first_last, self.clear_layers, self.first_spin, self.last_spin):
                w.setEnabled(not self._hp and (w is not self.table or bool(self._n_layers)))
            self._fill_table(config)
            self.spec_label.setText(f"Spec: {config}")
            self._update_estimate(config)
            self._refresh_auto()
            self._refresh_arith()
        finally:
            self._updating = False

    def _fill_table(self, config: KVConfig) -> None:
        self.advanced.fill(config, self._n_layers or 0, set() if self._hp else set(self._overrides))

    def _update_estimate(self, config: KVConfig) -> None:
        g = self._geometry
        ctx = self.ctx_spin.value()
        if not g:
            self.estimate_label.setText("KV at full context: load a model to estimate")
            return
        try:
            args = dict(n_layers=g["n_layers"], n_kv_heads=g["n_kv_heads"], head_dim=g["head_dim"],
                        n_tokens=ctx, value_dim=g["value_dim"], windows=list(g["windows"]))
            est = estimate_bytes(config, **args)
            full = estimate_bytes(KVConfig.preset("full"), **args)
        except KVConfigError as exc:
            self.estimate_label.setText(f"<span style='color:#dc2626'>{exc}</span>")
            return
        self.estimate_label.setText(
            f"KV at full context ({ctx:,} tokens): <b>{format_bytes(est['total'])}</b> "
            f"(16-bit would be {format_bytes(full['total'])}), "
            f"{est['bits_per_value']:.1f} bits/value")

    def estimate_text(self) -> str:
        """The estimate as plain text."""
        from PySide6.QtGui import QTextDocumentFragment

        return QTextDocumentFragment.fromHtml(self.estimate_label.text()).toPlainText()

    def sizeHint(self):  # noqa: N802
        hint = super().sizeHint()
        return hint.expandedTo(hint.__class__(320, hint.height()))


__all__ = ["AUTO", "KVPanel", "layer_spec"]
