"""The KV panel's arithmetic setting in the window on the real SmolLM2: choosing Fast switches the
engine (the answer's stats say "fast"), its cost against exact is measured once in the worker and
shown, and after a restart the choice and the figure come back from the store without measuring
again; a model that cannot run fast (float kernels only) says so and keeps answering.
The engine's side: tests/test_arith_modes.py, tests/test_weight_arith.py."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

from engine import weights  # noqa: E402
from omlx_desktop import arith as arith_controller  # noqa: E402
from omlx_desktop.arith import COST_SETTING, COST_TOKENS  # noqa: E402
from omlx_desktop.window import MainWindow  # noqa: E402

from .qt_wait import pump, wait_until  # noqa: E402
from .test_desktop_chat import ask  # noqa: E402
from .tiny_gguf import write_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def no_arith_env(monkeypatch):
    monkeypatch.delenv(weights.ARITH_ENV, raising=False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("arith-data")


def open_window(data_dir, model) -> MainWindow:
    w = MainWindow(data_dir=data_dir, model=str(model))
    w.show()
    wait_until(lambda: (w.model_info is not None and w.models.ready) or w.errors, what="the model")
    assert w.model_info is not None, w.errors
    return w


def load(window: MainWindow, model) -> dict:
    loaded = []
    window.modelLoaded.connect(loaded.append)
    try:
        window.load_model(str(model))
        wait_until(lambda: loaded or not window.models.loading, what=f"loading {model}")
    finally:
        window.modelLoaded.disconnect(loaded.append)
    assert loaded, window.errors[-1:]
    return loaded[0]


@pytest.fixture(scope="module")
def window(qapp, data_dir, smollm2_path):
    w = open_window(data_dir, smollm2_path)
    yield w
    if not w.closed:
        w.close()


def test_fast_switches_the_engine_and_its_cost_is_measured(window):
    panel = window.kv_panel
    assert panel.arith() == "exact" and panel.running_arith() == "exact" and panel.arith_box.isEnabled()
    assert panel.arith_note() == ""                  # nothing measured while exact runs
    shown = []
    window.arith.costShown.connect(shown.append)
    panel.select_arith("fast")
    wait_until(lambda: "measuring" in panel.arith_note() or shown, what="the measurement to start")
    assert shown or window.arith.measuring()
    wait_until(lambda: shown, timeout=120, what="the fast arithmetic's cost")
    cost = shown[0]
    assert 0 < cost.mean_kl < 0.05 and cost.top1_agreement > 0.9 and cost.n_tokens == COST_TOKENS
    assert f"Fast: mean KL {cost.mean_kl:.4f} vs exact" in panel.arith_note()
    # on a CPU where int8 is no faster (AVX2 without VNNI) the note and the item's tooltip say so
    from omlx_desktop.kv_arith import NO_GAIN

    fast_tip = panel.arith_box.itemData(panel.arith_box.findData("fast"), Qt.ItemDataRole.ToolTipRole)
    assert (NO_GAIN in panel.arith_note()) == (NO_GAIN in fast_tip) == (not weights.fast_arith_pays())
    assert panel.running_arith() == "fast"
    model_id = window.model_info["model_id"]
    assert cost.model_id == model_id
    assert window.store.get_setting(COST_SETTING)[model_id]["mean_kl"] == cost.mean_kl
    assert window.store.get_setting("kv_panel")["arith"] == "fast"

    window.new_conversation()
    answer = ask(window, "Name a colour.", 6)
    assert answer["stats"]["arith"] == "fast"        # the engine really ran fast
    assert "fast arithmetic" in window.stats_summary()


def test_after_a_restart_fast_and_its_cost_come_back_without_measuring(window, data_dir, smollm2_path):
    window.close()
    pump(0.2)
    again = MainWindow(data_dir=data_dir, model=str(smollm2_path))
    try:
        measured = []
        again.worker.arithCostReady.connect(measured.append)
        assert again.kv_panel.arith() == "fast"      # the saved choice, before the model is there
        again.show()
        wait_until(lambda: again.model_info is not None or again.errors, what="the model")
        assert again.model_info is not None, again.errors
        panel = again.kv_panel
        assert panel.running_arith() == "fast" and "Fast: mean KL" in panel.arith_note()
        assert not again.arith.measuring()
        again.new_conversation()
        assert ask(again, "Name a colour.", 6)["stats"]["arith"] == "fast"
        pump(0.3)
        assert measured == []                        # the figure came from the store

        panel.select_arith("exact")
        wait_until(lambda: panel.running_arith() == "exact", what="exact arithmetic")
        assert "Fast: mean KL" in panel.arith_note()  # still this model's figure
        answer = ask(again, "Name a fruit.", 6)
        assert answer["stats"]["arith"] == "exact" and "fast arithmetic" not in again.stats_summary()
        panel.select_arith("fast")
        wait_until(lambda: panel.running_arith() == "fast", what="fast arithmetic")
    finally:
        again.close()
    pump(0.2)


def test_a_model_without_integer_kernels_says_why_and_still_answers(qapp, data_dir, smollm2_path, tmp_path,
                                                                    monkeypatch):
    tiny = write_tiny_model(tmp_path / "tiny-f32.gguf")     # float32 matrices: no integer kernels
    w = open_window(data_dir, tiny)
    try:
        panel = w.kv_panel
        assert panel.arith() == "fast" and panel.running_arith() == "float"
        assert not panel.arith_box.isEnabled()
        assert any("Cannot use fast arithmetic" in e and "integer kernels" in e for e in w.errors), w.errors
        assert "Not available for this model" in panel.arith_note()
        assert "#dc2626" in panel.arith_label.styleSheet()
        assert not w.arith.measuring()
        w.new_conversation()
        assert ask(w, "Hello", 4)["stats"]["arith"] == "float"

        info = load(w, smollm2_path)                     # back on a model that can: fast again
        assert info["arith"] == "fast" and info["arith_error"] == ""
        assert panel.arith_box.isEnabled() and "Fast: mean KL" in panel.arith_note()
        assert not w.banner.isVisible()

        monkeypatch.setenv(weights.ARITH_ENV, "float")   # the float kernels chosen at load
        n_errors = len(w.errors)
        info = load(w, smollm2_path)
        assert info["arith"] == "float" and weights.ARITH_ENV in info["arith_error"]
        assert len(w.errors) > n_errors and weights.ARITH_ENV in w.errors[-1]
        assert not panel.arith_box.isEnabled() and panel.arith() == "fast"
        assert w.store.get_setting("kv_panel")["arith"] == "fast"   # kept for the next model
    finally:
        w.close()


def test_loading_another_model_cancels_the_measurement(qapp, data_dir, smollm2_path, tmp_path, monkeypatch):
    tiny = write_tiny_model(tmp_path / "tiny-f32.gguf")
    w = open_window(data_dir, smollm2_path)
    try:
        panel = w.kv_panel
        w.store.delete_setting(COST_SETTING)
        panel.select_arith("exact")
        wait_until(lambda: panel.running_arith() == "exact", what="exact arithmetic")
        failures, shown = [], []
        w.worker.arithCostFailed.connect(failures.append)
        w.arith.costShown.connect(shown.append)
        panel.select_arith("fast")
        wait_until(lambda: w.arith.measuring(), what="the measurement to start")
        load(w, tiny)                                    # queued behind it: cancels it first
        assert [f.kind for f in failures] == ["cancelled"] and shown == []
        assert w.store.get_setting(COST_SETTING) in (None, {})
        assert "Not available for this model" in panel.arith_note()
        # the cancelled measurement had to be long enough to be cancelled; the next one only has
        # to happen (its figure over COST_TOKENS: test_fast_switches_the_engine_and_its_cost_is_measured)
        monkeypatch.setattr(arith_controller, "COST_TOKENS", 32)
        load(w, smollm2_path)
        wait_until(lambda: shown, timeout=120, what="the cost measured again")
        assert shown[0].model_id == w.model_info["model_id"] and "Fast: mean KL" in panel.arith_note()
    finally:
        w.close()
