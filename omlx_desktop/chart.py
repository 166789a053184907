"""The live memory chart: this process's RSS and the KV cache's bytes in use and capacity over
the last few minutes.

``MemoryChart(kv_source=...)`` samples 4 times a second with a QTimer. ``kv_source`` is any
callable returning ``(bytes_in_use, capacity_bytes)``; it is called on the UI thread, so it
must be cheap and thread-safe to read (e.g. two ints the engine's worker updates). Without one
the KV lines stay at 0.

Sampling stops while the chart is not on screen: when its window is minimized, when it (or its
window) is hidden, or when :meth:`MemoryChart.set_paused` says so; it resumes with a fresh sample
when it is shown again. A gap in the samples is drawn as a break in the lines.

The samples live in a bounded ring buffer: one window's worth (``minutes × 60 × rate``) plus a
little, and samples older than the window are dropped as new ones arrive.
"""

from __future__ import annotations

import html
import logging
import math
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import psutil
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QObject, Qt, QTimer
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

log = logging.getLogger(__name__)

KVSource = Callable[[], tuple[int, int]]

DEFAULT_MINUTES = 5.0
DEFAULT_INTERVAL_MS = 250          # 4 samples a second
GAP_FACTOR = 3.0                   # samples further apart than 3 intervals are not joined
_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))

RSS_COLOR = "#3b82f6"
KV_COLOR = "#f59e0b"
CAPACITY_COLOR = "#9ca3af"


def _no_kv() -> tuple[int, int]:
    return (0, 0)


def byte_unit(value: float) -> tuple[int, str]:
    """The binary unit to show ``value`` bytes in: the largest with ``value >= 1`` of it."""
    value = abs(value)
    for size, name in _UNITS:
        if value >= size:
            return size, name
    return 1, "B"


def format_bytes(value: float) -> str:
    """``format_bytes(3 * 2**29) == "1.5 GiB"``; three significant digits at most."""
    size, name = byte_unit(value)
    x = value / size
    if name == "B":
        return f"{int(value)} B"
    return f"{x:.0f} {name}" if abs(x) >= 100 else f"{x:.3g} {name}"


def format_ago(seconds: float) -> str:
    """Axis label for ``seconds`` relative to now (<= 0): ``now``, ``-0:30``, ``-2:00``."""
    s = int(round(-seconds))
    if s == 0:
        return "now"
    sign = "-" if s > 0 else "+"
    s = abs(s)
    return f"{sign}{s // 60}:{s % 60:02d}"


def legend_html(entries) -> str:
    """A legend line: each (colour, stroke, name) as the coloured stroke and the name; it wraps only
    between entries (box-drawing strokes and no-break spaces: Qt breaks after a hyphen)."""
    return "&nbsp; ".join(
        f"<span style='color:{color}'>{stroke}</span>&nbsp;{html.escape(name).replace(' ', '&nbsp;')}"
        for color, stroke, name in entries)


class BytesAxis(pg.AxisItem):
    """A y axis whose values are bytes: ticks fall on round numbers of MiB (or KiB, GiB ...,
    chosen from the visible range) and read ``256 MiB``, ``1.5 GiB``. pyqtgraph's automatic SI
    scale is off: the ticks carry the unit, so the label gets no "(x1e+09)" beside them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.enableAutoSIPrefix(False)

    def _unit(self) -> int:
        lo, hi = self.range
        return byte_unit(max(abs(lo), abs(hi)))[0]

    def tickSpacing(self, minVal, maxVal, size):  # noqa: N802 (Qt naming)
        if self._tickSpacing is not None:
            return self._tickSpacing
        unit = byte_unit(max(abs(minVal), abs(maxVal)))[0]
        levels = super().tickSpacing(minVal / unit, maxVal / unit, size)
        return [(spacing * unit, offset * unit) for spacing, offset in levels]

    def tickStrings(self, values, scale, spacing):  # noqa: N802
        unit = self._unit()
        name = dict(_UNITS)[unit]
        step = spacing / unit if spacing else 1
        decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
        return [f"{v / unit:.{decimals}f} {name}" if v else "0" for v in values]


class TimeAgoAxis(pg.AxisItem):
    """An x axis in seconds relative to now (negative: the past), ticks every 5/10/15/30 s or
    1/2/5/10 min, read as ``-m:ss``."""

    STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)

    def tickSpacing(self, minVal, maxVal, size):  # noqa: N802
        if self._tickSpacing is not None:
            return self._tickSpacing
        span = abs(maxVal - minVal)
        if span == 0:
            return []
        max_ticks = max(2, int(size / 70))  # a label is ~5 characters wide
        major = next((s for s in self.STEPS if span / s <= max_ticks), self.STEPS[-1])
        minors = [s for s in self.STEPS if s < major and major % s == 0 and span / s <= 4 * max_ticks]
        levels = [(float(major), 0.0)]
        if minors:
            levels.append((float(minors[-1]), 0.0))
        return levels

    def tickStrings(self, values, scale, spacing):  # noqa: N802
        return [format_ago(v) for v in values]


class MemoryChart(QWidget):
    """RSS, KV in use and KV capacity over the last ``minutes`` minutes.

    API: :meth:`set_kv_source`, :meth:`set_paused` / :meth:`is_paused`, :meth:`is_sampling`
    (the timer runs), :meth:`sample_now` (take one sample now, as the timer does),
    :meth:`series` (the samples), :meth:`clear`, :attr:`capacity_points` (ring size).
    """

    def __init__(self, parent: QWidget | None = None, *, kv_source: KVSource | None = None,
                 minutes: float = DEFAULT_MINUTES, interval_ms: int = DEFAULT_INTERVAL_MS,
                 rss_source: Callable[[], int] | None = None, kv_axis: bool = False,
                 fit_time: bool = False):
        """``kv_axis``: draw the KV lines against their own axis on the right (the KV cache is
        often a few MiB beside hundreds of MiB of RSS). ``fit_time``: show only the time the
        samples span (at least a minute, rounded up to 30 s), not always the whole window."""
        super().__init__(parent)
        self.kv_axis = bool(kv_axis)
        self.fit_time = bool(fit_time)
        if minutes <= 0 or interval_ms <= 0:
            raise ValueError("minutes and interval_ms must be positive")
        self.window_s = float(minutes) * 60.0
        self.interval_ms = int(interval_ms)
        self._kv_source: KVSource = kv_source or _no_kv
        process = psutil.Process()
        self._rss_source = rss_source or (lambda: process.memory_info().rss)
        self.capacity_points = int(math.ceil(self.window_s * 1000 / self.interval_ms)) + 8
        self._samples: deque[tuple[float, int, int, int]] = deque(maxlen=self.capacity_points)
        self._paused = False
        self._watched: QWidget | None = None
        self._kv_error_logged = False

        self._timer = QTimer(self)
        self._timer.setInterval(self.interval_ms)
        self._timer.timeout.connect(self.sample_now)

        self.summary = QLabel("RSS –  ·  KV –", self)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # the legend above the plot, not in it: inside, it covered the lines near the top
        kv_names = ("KV in use (right)", "KV capacity (right)") if self.kv_axis else ("KV in use", "KV capacity")
        self.legend = QLabel(legend_html(((RSS_COLOR, "━━", "RSS (this process)"),
                                          (KV_COLOR, "━━", kv_names[0]),
                                          (CAPACITY_COLOR, "╍╍", kv_names[1]))), self)
        self.legend.setWordWrap(True)
        axes = {"left": BytesAxis("left"), "bottom": TimeAgoAxis("bottom")}
        if self.kv_axis:
            axes["right"] = BytesAxis("right")
        self.plot = pg.PlotWidget(parent=self, axisItems=axes)
        self.plot.setBackground(None)
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        self.plot.showGrid(x=True, y=True, alpha=0.15)
        self.plot.setLabel("bottom", "time (m:ss ago)")
        self.plot.setXRange(-self.window_s, 0, padding=0)
        self.plot.setYRange(0, 2**20, padding=0)
        self.rss_curve = self.plot.plot(name="RSS (this process)", pen=pg.mkPen(RSS_COLOR, width=2))
        kv_pen = pg.mkPen(KV_COLOR, width=2)
        cap_pen = pg.mkPen(CAPACITY_COLOR, width=1.5, style=Qt.PenStyle.DashLine)
        self.kv_view = None
        if self.kv_axis:
            item = self.plot.getPlotItem()
            self.kv_view = pg.ViewBox(enableMouse=False)
            self.kv_view.setMenuEnabled(False)
            item.showAxis("right")
            item.scene().addItem(self.kv_view)
            right = item.getAxis("right")
            right.linkToView(self.kv_view)
            right.setLabel("KV", color=KV_COLOR)
            self.plot.setLabel("left", "RSS", color=RSS_COLOR)
            self.kv_view.setXLink(item)
            self.kv_view.setYRange(0, 2**20, padding=0)

            def follow() -> None:
                self.kv_view.setGeometry(item.vb.sceneBoundingRect())
                self.kv_view.linkedViewChanged(item.vb, self.kv_view.XAxis)

            item.vb.sigResized.connect(follow)
            self.kv_curve = pg.PlotDataItem(pen=kv_pen, fillLevel=0, brush=pg.mkBrush(KV_COLOR + "40"))
            self.capacity_curve = pg.PlotDataItem(pen=cap_pen)
            self.kv_view.addItem(self.kv_curve)
            self.kv_view.addItem(self.capacity_curve)
        else:
            self.kv_curve = self.plot.plot(
                name="KV in use", pen=kv_pen, fillLevel=0, brush=pg.mkBrush(KV_COLOR + "40"))
            self.capacity_curve = self.plot.plot(name="KV capacity", pen=cap_pen)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.summary)
        layout.addWidget(self.legend)
        layout.addWidget(self.plot, 1)

    # -- sources

    @property
    def kv_source(self) -> KVSource:
        return self._kv_source

    def set_kv_source(self, source: KVSource | None) -> None:
        """Where KV figures come from from now on; ``None``: none (0, 0)."""
        self._kv_source = source or _no_kv
        self._kv_error_logged = False

    # -- sampling

    def sample_now(self) -> None:
        """Takes one sample (RSS, KV in use, KV capacity) and redraws."""
        now = time.monotonic()
        try:
            rss = int(self._rss_source())
        except (psutil.Error, OSError):
            rss = self._samples[-1][1] if self._samples else 0
        try:
            used, capacity = self._kv_source()
            used, capacity = int(used), int(capacity)
        except Exception:  # a broken source must not kill the timer; say so once
            if not self._kv_error_logged:
                log.exception("kv_source failed; showing 0")
                self._kv_error_logged = True
            used, capacity = 0, 0
        self._samples.append((now, rss, used, capacity))
        horizon = now - self.window_s - self.interval_ms / 1000.0
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        self._redraw(now)

    def series(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The samples, oldest first: ``(times, rss, kv, capacity)``; times are
        :func:`time.monotonic` seconds, the rest bytes (int64)."""
        if not self._samples:
            empty = np.zeros(0, dtype=np.int64)
            return np.zeros(0), empty, empty.copy(), empty.copy()
        arr = np.array(self._samples, dtype=np.float64)
        return (arr[:, 0].copy(), arr[:, 1].astype(np.int64), arr[:, 2].astype(np.int64),
                arr[:, 3].astype(np.int64))

    def visible_span(self, now: float | None = None) -> float:
        """Seconds of history the x axis shows: the whole window, or with ``fit_time`` the span
        of the samples (at least 60 s, rounded up to 30 s, at most the window)."""
        if not self.fit_time or not self._samples:
            return self.window_s
        now = time.monotonic() if now is None else now
        span = now - self._samples[0][0]
        return float(min(self.window_s, max(60.0, math.ceil(span / 30.0) * 30.0)))

    def clear(self) -> None:
        self._samples.clear()
        self._redraw(time.monotonic())

    def _redraw(self, now: float) -> None:
        t, rss, kv, cap = self.series()
        x = t - now
        if len(t) > 1:
            connect = np.append(np.diff(t) <= GAP_FACTOR * self.interval_ms / 1000.0, False)
        else:
            connect = "all"
        for curve, y in ((self.rss_curve, rss), (self.kv_curve, kv), (self.capacity_curve, cap)):
            curve.setData(x, y.astype(np.float64), connect=connect)
        if self.kv_view is not None:
            top = max(int(rss.max(initial=0)), 2**20)
            kv_top = max(int(cap.max(initial=0)), int(kv.max(initial=0)), 2**20)
            self.kv_view.setYRange(0, kv_top * 1.08, padding=0)
        else:
            top = max(int(rss.max(initial=0)), int(cap.max(initial=0)), int(kv.max(initial=0)), 2**20)
        self.plot.setYRange(0, top * 1.08, padding=0)
        self.plot.setXRange(-self.visible_span(now), 0, padding=0)
        if len(t):
            self.summary.setText(
                f"RSS {format_bytes(rss[-1])}  ·  KV {format_bytes(kv[-1])} in use"
                f" of {format_bytes(cap[-1])}")

    # -- pausing

    def set_paused(self, paused: bool) -> None:
        """Stops (True) or allows (False) sampling, whatever the window does; e.g. while the
        chart's panel is collapsed."""
        self._paused = bool(paused)
        self._update_running()

    def is_paused(self) -> bool:
        return self._paused

    def is_sampling(self) -> bool:
        """Whether the timer runs: not paused, visible, and its window not minimized."""
        return self._timer.isActive()

    def _should_run(self) -> bool:
        if self._paused or not self.isVisible():
            return False
        return not self.window().isMinimized()

    def _update_running(self) -> None:
        run = self._should_run()
        if run and not self._timer.isActive():
            self._timer.start()
            self.sample_now()  # start (or resume after a gap) with a point right away
        elif not run and self._timer.isActive():
            self._timer.stop()

    def _watch_window(self) -> None:
        top = self.window()
        if top is self._watched:
            return
        if self._watched is not None:
            self._watched.removeEventFilter(self)
        self._watched = top if top is not self else None
        if self._watched is not None:
            self._watched.installEventFilter(self)

    def showEvent(self, event) -> None:  # noqa: N802
        super().showEvent(event)
        self._watch_window()
        self._update_running()

    def hideEvent(self, event) -> None:  # noqa: N802
        super().hideEvent(event)
        self._update_running()

    def changeEvent(self, event) -> None:  # noqa: N802 (when the chart is its own window)
        super().changeEvent(event)
        if event.type() == QEvent.Type.WindowStateChange:
            self._update_running()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802
        if watched is self._watched and event.type() in (
                QEvent.Type.WindowStateChange, QEvent.Type.Show, QEvent.Type.Hide):
            self._update_running()
        return False
