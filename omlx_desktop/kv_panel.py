"""The KV cache controls: K and V bits, presets, high-precision mode, per-layer precision,
context window and overflow policy, an import of a KV settings file, with a live estimate of the
cache at full context.

The panel only describes a setting; it knows nothing of the engine. The setting is a KVConfig
(:meth:`config`, kept by a :class:`~omlx_desktop.kv_setting.KVSetting`; :meth:`spec` is its
canonical string). It emits ``settingsChanged({"spec", "ctx", "overflow"})`` on every change (the
window hands it to the worker, which applies it before the next turn) and keeps its whole state
in :meth:`state` / :meth:`set_state` (a JSON-able dict the window saves in the Store).

The Auto preset chooses per-layer widths for a memory budget ("KV at full context ≤ X", a
slider) from the model's sensitivity profile (engine.kvtune): the panel asks for the profile with
``tuneRequested`` (the window's AutoTuneController has the worker measure it or read it back) and
its :class:`~omlx_desktop.kv_auto.AutoTuning` solves the choice on every move of the slider;
until a profile arrives the setting stays what it was.

Beside the preset, the weight arithmetic (exact or fast): not part of the KV setting but kept in
the panel's state with it, in a :class:`~omlx_desktop.kv_arith.ArithChoice` (``arith_choice``,
which the window's ArithController is given). Choosing one emits ``arithChanged(mode)``.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QAbstractItemView, QCheckBox, QComboBox, QFileDialog, QFormLayout, QGridLayout, QHBoxLayout,
    QHeaderView, QLabel, QPushButton, QSlider, QSpinBox, QStyledItemDelegate, QTableWidget,
    QTableWidgetItem, QToolButton, QVBoxLayout, QWidget,
)

from engine.kv.config import SELECTABLE_BITS, KVConfig, KVConfigError
from engine.kv.paged import OVERFLOW_POLICIES

from .kv_arith import ERROR_STYLE, NOTE_STYLE, ArithChoice
from .kv_auto import AUTO_STEPS, AutoSection, AutoTuning
from .kv_setting import AUTO, CUSTOM, KVSetting, estimate_html, layer_spec, switch_cost_text

OVERFLOW_LABELS = {
    "stop": "Stop at the limit",
    "rolling": "Rolling (drop oldest)",
    "attention": "Attention (drop least attended)",
}
DEFAULT_CTX = 4096
MIN_CTX = 64
SETTINGS_FILTER = "KV settings (*.json *.toml);;All files (*)"


def _label(text: str = "", *, wrap: bool = True, selectable: bool = True, style: str = "",
           visible: bool = True) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(wrap)
    if selectable:
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    if style:
        label.setStyleSheet(style)
    label.setVisible(visible)
    return label


def _bits_slider(role: str) -> tuple[QSlider, QLabel]:
    slider = QSlider(Qt.Orientation.Horizontal)
    slider.setRange(0, len(SELECTABLE_BITS) - 1)
    slider.setPageStep(1)
    slider.setTickPosition(QSlider.TickPosition.TicksBelow)
    slider.setTickInterval(1)
    slider.setToolTip(f"{role} bits: " + ", ".join(str(b) for b in SELECTABLE_BITS))
    label = QLabel()
    label.setMinimumWidth(label.fontMetrics().horizontalAdvance(f"{role}: 16 bits") + 4)
    return slider, label


def _preset_box() -> QComboBox:
    box = QComboBox()
    for name, label in KVConfig.presets():
        box.addItem(label, name)
    box.addItem("Auto (fit to memory)", AUTO)
    box.addItem("Custom", CUSTOM)
    box.setToolTip("Bits per stored key (K) and value (V) in the KV cache")
    return box


def _context_spin() -> QSpinBox:
    spin = QSpinBox()
    spin.setRange(MIN_CTX, 1 << 20)
    spin.setSingleStep(256)
    spin.setGroupSeparatorShown(True)
    spin.setSuffix(" tokens")
    spin.setValue(DEFAULT_CTX)
    return spin


def _overflow_box() -> QComboBox:
    box = QComboBox()
    for policy in OVERFLOW_POLICIES:
        box.addItem(OVERFLOW_LABELS.get(policy, policy), policy)
    box.setCurrentIndex(OVERFLOW_POLICIES.index("rolling"))
    box.setToolTip("What happens when the conversation reaches the context window")
    return box


def _disclosure_button(text: str) -> QToolButton:
    button = QToolButton()
    button.setText(text)
    button.setCheckable(True)
    button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
    button.setArrowType(Qt.ArrowType.RightArrow)
    button.setAutoRaise(True)
    return button


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


class KVPanel(QWidget):
    """The panel's widgets and their wiring. What it describes is a :class:`KVSetting`; the Auto
    preset's state is an :class:`AutoTuning`, the arithmetic row an :class:`ArithChoice`."""

    settingsChanged = Signal(object)   # {"spec", "ctx", "overflow"}
    tuneRequested = Signal()           # Auto needs the loaded model's sensitivity profile
    tuneCancelled = Signal()           # the user cancelled the running measurement
    importFailed = Signal(str)         # a KV settings file that cannot be used: why (also shown here)
    arithChanged = Signal(str)         # the user chose a weight arithmetic ("exact" or "fast")

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setting = KVSetting()
        self._geometry: dict | None = None
        self._max_ctx: int | None = None
        self._model_path: str | None = None
        # the context was set by the user (or restored as set): a model's default no longer applies
        self._ctx_chosen = False
        self._updating = False

        # presets and high-precision mode
        self.preset_box = _preset_box()
        self.import_button = QPushButton("Import…")
        self.import_button.setToolTip(
            "Load KV cache settings from a JSON or TOML file: this app's keys (k_bits, v_bits, layers, "
            "preset, spec, ...) or llama.cpp's cache_type_k / cache_type_v")
        self.arith_choice = ArithChoice(self)
        self.arith_box, self.arith_label = self.arith_choice.box, self.arith_choice.label
        self.high_precision = QCheckBox("High-precision mode (K8V8)")
        self.high_precision.setToolTip(
            "Switch every layer to 8-bit keys and values; switching it off restores the setting before")

        # sliders
        self.k_slider, self.k_label = _bits_slider("K")
        self.v_slider, self.v_label = _bits_slider("V")
        sliders = QGridLayout()
        sliders.setContentsMargins(0, 0, 0, 0)
        sliders.addWidget(self.k_label, 0, 0)
        sliders.addWidget(self.k_slider, 0, 1)
        sliders.addWidget(self.v_label, 1, 0)
        sliders.addWidget(self.v_slider, 1, 1)
        sliders.setColumnStretch(1, 1)

        # context and overflow
        self.ctx_spin = _context_spin()
        self.overflow_box = _overflow_box()
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
        self.estimate_label = _label()
        self.spec_label = _label(style=NOTE_STYLE)
        self.import_label = _label(visible=False)     # the last import's outcome (an error in red)

        # advanced: per layer
        self.advanced_button = _disclosure_button("Per-layer precision")
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
        self.tuner = AutoTuning(self.auto)

        note = _label("Changes apply from the next message.", wrap=False, selectable=False, style=NOTE_STYLE)
        # what the pending format costs the pinned documents
        self.switch_label = _label(selectable=False, visible=False)

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
        self.arith_choice.changed.connect(self.arithChanged)
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

    # -- what the panel says --------------------------------------------------------------
    def config(self) -> KVConfig:
        """The KV cache setting the panel describes."""
        return self.setting.config()

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
        return dict(self.setting.overrides)

    def is_high_precision(self) -> bool:
        return self.setting.hp

    def state(self) -> dict:
        """Everything needed to restore the panel (JSON-able)."""
        s = self.setting
        return {**s.core(), "high_precision": s.hp, "before_high_precision": s.before_hp,
                "ctx": self.ctx_spin.value(), "ctx_chosen": self._ctx_chosen, "overflow": self.overflow(),
                "advanced_open": self.advanced_button.isChecked(), "auto_position": self.tuner.position,
                "arith": self.arith_choice.mode}

    def set_state(self, state: dict | None) -> None:
        if not state:
            return
        self._updating = True
        try:
            self.setting.restore(state)
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
                self.tuner.position = position
                self.auto_slider.setValue(position)
            self.arith_choice.restore(state.get("arith"))
        finally:
            self._updating = False
        self._changed()

    # -- the model ------------------------------------------------------------------------
    def set_model(self, info: dict | None) -> None:
        """The loaded model (the worker's model info): its geometry for the estimate, its
        layers for the table, its context length as the context's maximum, the arithmetic it runs."""
        path = info.get("path") if info else None
        if path != self._model_path:
            self.tuner.forget()                  # another model's profile
            self.arith_choice.forget_cost()      # and cost
        self._model_path = path
        known = info or {}
        self.arith_choice.show(known.get("arith") or None, known.get("arith_error", ""))
        self._geometry = info["geometry"] if info else None
        n_layers = self._geometry["n_layers"] if self._geometry else None
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
            self.setting.set_layers(n_layers)
            if n_layers:
                self.first_spin.setMaximum(n_layers)
                self.last_spin.setMaximum(n_layers)
        finally:
            self._updating = False
        self._changed()
        if self.setting.preset == AUTO and self.tuner.profile is None and not self.setting.hp:
            self._request_profile()

    def set_default_ctx(self, ctx: int) -> None:
        """The loaded model's default context anew (e.g. beside another draft model): the
        context, unless the user chose one."""
        if self._ctx_chosen or ctx == self.ctx_spin.value():
            return
        self._updating = True
        try:
            self.ctx_spin.setValue(ctx)
        finally:
            self._updating = False
        self._changed()

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
        self.setting.choose_preset(name)
        if name == AUTO and self.tuner.profile is None:
            self._request_profile()
        self._changed()

    def set_bits(self, k: int, v: int) -> None:
        """As moving the sliders (selects Custom)."""
        self.k_slider.setValue(SELECTABLE_BITS.index(k))
        self.v_slider.setValue(SELECTABLE_BITS.index(v))

    def _slider_moved(self) -> None:
        if self._updating or self.setting.hp:
            return
        self.setting.set_bits(*self.bits())
        self._changed()

    def set_high_precision(self, on: bool) -> None:
        """On: K8V8 in every layer, remembering what was set; off: exactly that again."""
        if self.setting.set_high_precision(bool(on)):
            self._changed()
        else:
            self._refresh()

    def set_first_last(self, first: int, last: int, bits: tuple[int, int] | None = None) -> None:
        """Per-layer precision: the first ``first`` and last ``last`` layers at ``bits``
        (default: high precision, K8V8), the rest at the sliders' setting."""
        if self.setting.n_layers:
            self.set_overrides(self.setting.first_last(first, last, bits))

    def set_overrides(self, overrides: dict[int, tuple[int, int]]) -> None:
        self.setting.set_overrides(overrides)
        self._changed()

    def set_layer(self, layer: int, k: int, v: int) -> None:
        self.setting.set_layer(layer, k, v)
        self._changed()

    def import_settings(self, path) -> str | None:
        """Applies a KV settings file (JSON or TOML, read by KVConfig.from_file: this app's keys
        or llama.cpp's cache_type_k / cache_type_v) as the panel's setting, leaving high-precision
        mode. Returns None once applied, else the error, which the panel also shows; on an error
        nothing changes."""
        try:
            self.setting.import_file(path)
        except KVConfigError as exc:
            self._show_import(str(exc), error=True)
            self.importFailed.emit(str(exc))
            return str(exc)
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
        layer = self.config().per_layer(self.setting.n_layers)[row]
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

    # -- the weight arithmetic (kv_arith.ArithChoice) --------------------------------------
    def arith(self) -> str:
        """The chosen arithmetic ("exact" or "fast"), whatever the loaded model runs."""
        return self.arith_choice.mode

    def running_arith(self) -> str | None:
        """The arithmetic the loaded model runs (None: no model, or not known yet)."""
        return self.arith_choice.running

    def select_arith(self, mode: str) -> None:
        """As choosing it in the box."""
        self.arith_choice.select(mode)

    def arith_note(self) -> str:
        """The note under the arithmetic box as plain text ('' when hidden)."""
        return self.arith_label.text() if self.arith_label.isVisibleTo(self) else ""

    # -- the Auto preset (kv_auto.AutoTuning) ----------------------------------------------
    def _request_profile(self) -> None:
        """Asks for the loaded model's sensitivity profile (nothing while no model is loaded or a
        measurement runs)."""
        if self._geometry is None or self.tuner.tuning:
            return
        self.tuner.started()
        self._refresh()
        self.tuneRequested.emit()

    def tune_progress(self, stage: str, fraction: float) -> None:
        """The measurement's progress (from the worker)."""
        self.tuner.progress(stage, fraction, self.setting.n_layers)

    def tune_failed(self, kind: str, message: str) -> None:
        """The measurement stopped (cancelled or failed): the setting stays what it was."""
        self.tuner.failed(kind, message)
        self._refresh()

    def set_profile(self, profile, model_path: str | None = None, from_store: bool = False,
                    seconds: float = 0.0) -> None:
        """The loaded model's sensitivity profile (engine.kvtune.Profile); under the Auto preset
        the widths are chosen from it at once. A profile for another model file is ignored."""
        if model_path is not None and model_path != self._model_path:
            return
        if self.setting.n_layers is not None and profile.n_layers != self.setting.n_layers:
            return
        self.tuner.accept(profile, from_store, seconds)
        self._changed()

    def profile(self):
        return self.tuner.profile

    def auto_choice(self):
        """The Auto preset's last choice (engine.kvtune.Choice: widths, predicted KL, bytes at the
        context, budget), or None."""
        return self.tuner.choice

    def is_tuning(self) -> bool:
        return self.tuner.tuning

    def auto_budget(self) -> float | None:
        """The memory slider's budget in bytes at full context (None without a model)."""
        return self.tuner.budget(self._geometry, self.ctx_spin.value())

    def set_auto_budget(self, budget: float) -> None:
        """As moving the memory slider to the position nearest `budget` bytes (not above it)."""
        self.auto_slider.setValue(self.tuner.position_for(self._geometry, self.ctx_spin.value(), budget))

    def _auto_moved(self, position: int) -> None:
        if self._updating:
            return
        self.tuner.position = int(position)
        self._changed()

    # -- refresh --------------------------------------------------------------------------
    def _ctx_edited(self, _value: int) -> None:
        if not self._updating:
            self._ctx_chosen = True

    def _changed(self) -> None:
        if self._updating:
            return
        s = self.setting
        if s.preset == AUTO and self.tuner.profile is not None and not s.hp:
            # the budget, the context or the profile changed
            choice = self.tuner.choose(self._geometry, self.ctx_spin.value())
            if choice is not None:
                s.use_choice(choice.config, choice.widths)
        if self.import_label.text():
            self._show_import("")
        self._refresh()
        self.settingsChanged.emit(self.settings())

    def show_switch_cost(self, cost: dict) -> None:
        """The note under the preset controls for the engine's Session.switch_cost of the spec
        the panel now asks for ({"spec", "reread", "documents", "source"}); a cost for another
        spec than the panel's (an older request) or for the format in use hides it."""
        text = switch_cost_text(cost, str(self.config()))
        self.switch_label.setText(text)
        self.switch_label.setVisible(bool(text))

    def switch_note(self) -> str:
        return self.switch_label.text() if self.switch_label.isVisibleTo(self) else ""

    def _refresh(self) -> None:
        self._updating = True
        try:
            s = self.setting
            config = s.config()
            k, v = config.k_bits, config.v_bits
            self.k_slider.setValue(SELECTABLE_BITS.index(k))
            self.v_slider.setValue(SELECTABLE_BITS.index(v))
            self.k_label.setText(f"K: {k} bits")
            self.v_label.setText(f"V: {v} bits")
            self.preset_box.setCurrentIndex(max(0, self.preset_box.findData(s.preset_shown())))
            self.high_precision.setChecked(s.hp)
            for w in (self.k_slider, self.v_slider, self.preset_box, self.table,
                      self.apply_first_last, self.clear_layers, self.first_spin, self.last_spin):
                w.setEnabled(not s.hp and (w is not self.table or bool(s.n_layers)))
            self.advanced.fill(config, s.n_layers or 0, set() if s.hp else set(s.overrides))
            self.spec_label.setText(f"Spec: {config}")
            self.estimate_label.setText(estimate_html(config, self._geometry, self.ctx_spin.value()))
            self.tuner.refresh(s.preset == AUTO and not s.hp, self._geometry, self.ctx_spin.value())
            self.arith_choice.refresh()
        finally:
            self._updating = False

    def estimate_text(self) -> str:
        """The estimate as plain text."""
        from PySide6.QtGui import QTextDocumentFragment

        return QTextDocumentFragment.fromHtml(self.estimate_label.text()).toPlainText()

    def sizeHint(self):  # noqa: N802
        hint = super().sizeHint()
        return hint.expandedTo(hint.__class__(320, hint.height()))


__all__ = ["AUTO", "AUTO_STEPS", "KVPanel", "layer_spec"]
