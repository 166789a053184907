"""The KV panel's Auto preset in the window on the real SmolLM2: the sensitivity measurement runs in
the worker with progress and can be cancelled; once measured, moving the memory slider applies a
valid per-layer spec, within the budget, to the next message; after a restart the profile comes
back from the store (per model file) in under a second."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine import kvtune  # noqa: E402
from engine.kv.config import KVConfig, estimate_bytes, parse_kv  # noqa: E402
from omlx_desktop.kv_panel import AUTO  # noqa: E402
from omlx_desktop.window import MainWindow  # noqa: E402

from .qt_wait import pump, wait_until  # noqa: E402
from .test_desktop_chat import ask  # noqa: E402

pytestmark = pytest.mark.slow  # a window on a real model, measuring it and generating answers

CALIBRATION_TOKENS = 96  # a short calibration keeps the measurement to seconds


def open_window(data_dir, model_path) -> MainWindow:
    w = MainWindow(data_dir=data_dir, model=str(model_path))
    w.show()
    wait_until(lambda: w.model_info is not None or w.errors, what="the model")
    assert w.model_info is not None, w.errors
    return w


def kv_at_full_context(window: MainWindow, spec: str) -> int:
    g = window.model_info["geometry"]
    return estimate_bytes(parse_kv(spec), g["n_layers"], g["n_kv_heads"], g["head_dim"],
                          window.kv_panel.ctx_spin.value(), g["value_dim"], g["windows"])["total"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("autotune-data")


@pytest.fixture(scope="module")
def window(qapp, data_dir, smollm2_path):
    w = open_window(data_dir, smollm2_path)
    yield w
    if not w.closed:
        w.close()


def test_the_measurement_shows_progress_and_cancel_keeps_the_setting(window):
    panel = window.kv_panel
    panel.select_preset("memory-saver")
    failures = []
    window.autotune.profileFailed.connect(failures.append)
    panel.select_preset(AUTO)                            # the default calibration: minutes, cancelled
    assert window.autotune.running() and panel.is_tuning()
    wait_until(lambda: "Measuring each layer's sensitivity:" in panel.auto.status_label.text(),
               what="the measurement's progress")      # the worker's first report (the 16-bit pass)
    assert not panel.auto.progress.isHidden() and not panel.auto.cancel_button.isHidden()
    panel.auto.cancel_button.click()
    # stops at the next check: after the forward pass under way (at most a few of them)
    wait_until(lambda: failures, timeout=600, what="the cancel")
    assert failures[0].kind == "cancelled"
    assert not window.autotune.running() and panel.profile() is None
    assert panel.spec() == "k4v4"
    window.new_conversation()
    answer = ask(window, "Name a colour.", 6)            # the engine is free again
    assert answer["stats"]["kv_spec"] == "k4v4"


def test_moving_the_slider_applies_a_valid_spec_on_the_next_message(window):
    panel = window.kv_panel
    window.autotune.n_tokens = CALIBRATION_TOKENS
    ready = []
    window.autotune.profileReady.connect(ready.append)
    panel.auto.measure_button.click()
    wait_until(lambda: ready, timeout=600, what="the sensitivity profile")
    assert not ready[0].from_store and panel.profile() is not None
    assert panel.profile().n_layers == window.model_info["geometry"]["n_layers"]
    assert panel.preset() == AUTO and panel.auto_choice() is not None
    specs = []
    for position in (150, 600):
        panel.auto_slider.setValue(position)
        spec = panel.spec()
        choice = panel.auto_choice()
        config = KVConfig.parse(spec)                    # a valid spec in the engine's grammar
        assert spec == choice.spec and config == panel.config()
        n = window.model_info["geometry"]["n_layers"]
        assert (kvtune.spec_widths(config, n) == choice.widths).all()
        rows = np.array([[int(panel.table.item(r, 1).text()), int(panel.table.item(r, 2).text())]
                         for r in range(panel.table.rowCount())])
        assert (rows == choice.widths).all()             # the per-layer table shows the choice
        assert kv_at_full_context(window, spec) <= panel.auto_budget()
        assert f"{choice.predicted_kl:.4f}" in panel.auto.quality_label.text()
        window.new_conversation()
        answer = ask(window, "Name a colour.", 6)
        assert answer["stats"]["kv_spec"] == spec        # applied to the next message
        assert spec.upper() in window.model_summary()
        specs.append(spec)
    assert specs[0] != specs[1]
    assert kv_at_full_context(window, specs[0]) < kv_at_full_context(window, specs[1])
    assert window.store.get_setting("kv_panel")["preset"] == AUTO
    assert window.store.get_setting("kv_panel")["auto_position"] == 600


def test_after_a_restart_the_profile_comes_back_from_the_store(window, data_dir, smollm2_path):
    spec = window.kv_panel.spec()
    window.close()
    pump(0.2)
    again = MainWindow(data_dir=data_dir, model=str(smollm2_path))
    try:
        again.autotune.n_tokens = CALIBRATION_TOKENS
        ready = []
        again.autotune.profileReady.connect(ready.append)
        again.show()
        assert again.kv_panel.preset() == AUTO and again.kv_panel.spec() == spec   # the saved choice
        wait_until(lambda: again.model_info is not None or again.errors, what="the model")
        assert again.model_info is not None, again.errors
        # set_model asked for the profile: a Configure and the store's answer away
        t0 = time.monotonic()
        wait_until(lambda: ready, timeout=30, what="the stored profile")
        assert time.monotonic() - t0 < 1.0
        assert ready[0].from_store and ready[0].seconds < 1.0
        assert again.kv_panel.spec() == spec
        again.new_conversation()
        assert ask(again, "Name a colour.", 6)["stats"]["kv_spec"] == spec
    finally:
        again.close()
