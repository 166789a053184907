"""The KV panel's Auto preset on a given sensitivity profile (no model): asking for the profile,
progress and cancel, the memory slider choosing per-layer widths within the budget at the context,
the per-layer table and the estimated quality, and the saved state."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine import kvtune  # noqa: E402
from engine.kv.config import KVConfig, estimate_bytes  # noqa: E402
from omlx_desktop.chart import format_bytes  # noqa: E402
from omlx_desktop.kv_panel import AUTO, AUTO_STEPS, KVPanel  # noqa: E402

from .test_desktop_widgets import SMOL, panel  # noqa: E402, F401  (the model geometry and the fixture)

N_LAYERS = SMOL["geometry"]["n_layers"]


def synthetic_profile(seed: int = 0, n_layers: int = N_LAYERS) -> kvtune.Profile:
    """KL falling with width, a few layers far more sensitive than the rest."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.2, 1.0, (n_layers, 2, 1))
    scale[[3, 11], :, :] *= 30.0
    bits = np.array(kvtune.CANDIDATE_BITS, float)
    kl = scale * 4.0 ** -bits[None, None, :]
    return kvtune.Profile("sha", "text", 512, 32, 4, False, kvtune.CANDIDATE_BITS, kl, kl, np.ones(n_layers))


def kv_bytes(panel: KVPanel) -> int:
    g = SMOL["geometry"]
    return estimate_bytes(panel.config(), g["n_layers"], g["n_kv_heads"], g["head_dim"], panel.ctx_spin.value(),
                          g["value_dim"], g["windows"])["total"]


def table_widths(panel: KVPanel) -> np.ndarray:
    return np.array([[int(panel.table.item(r, 1).text()), int(panel.table.item(r, 2).text())]
                     for r in range(panel.table.rowCount())])


def test_auto_asks_for_the_profile_shows_progress_and_can_be_cancelled(panel, qtbot):
    before = panel.spec()
    with qtbot.waitSignal(panel.tuneRequested):
        panel.select_preset(AUTO)
    assert panel.preset() == AUTO and panel.is_tuning()
    assert panel.spec() == before                       # nothing chosen yet: the setting stays
    assert panel.auto.isVisible() or not panel.isVisible()
    assert not panel.auto.cancel_button.isHidden() and panel.auto.measure_button.isHidden()
    panel.tune_progress("sensitivity", 0.5)
    assert panel.auto.progress.value() == 500
    assert "15 of 30 layers" in panel.auto.status_label.text()
    with qtbot.waitSignal(panel.tuneCancelled):
        panel.auto.cancel_button.click()
    panel.tune_failed("cancelled", "the KV sensitivity measurement was cancelled")
    assert not panel.is_tuning() and panel.spec() == before
    assert "Cancelled" in panel.auto.status_label.text()
    assert not panel.auto.measure_button.isHidden() and panel.auto.cancel_button.isHidden()
    with qtbot.waitSignal(panel.tuneRequested):        # Measure starts it again
        panel.auto.measure_button.click()
    assert panel.is_tuning()


def test_the_slider_chooses_widths_within_the_budget(panel, qtbot):
    with qtbot.waitSignal(panel.tuneRequested):
        panel.select_preset(AUTO)
    profile = synthetic_profile()
    with qtbot.waitSignal(panel.settingsChanged) as sig:
        panel.set_profile(profile, SMOL["path"])
    assert not panel.is_tuning()
    choice = panel.auto_choice()
    assert sig.args[0]["spec"] == panel.spec() == choice.spec
    assert KVConfig.parse(panel.spec()) == panel.config()
    assert (kvtune.spec_widths(panel.config(), N_LAYERS) == choice.widths).all()
    assert (table_widths(panel) == choice.widths).all()   # the per-layer table shows the choice
    assert kv_bytes(panel) <= panel.auto_budget()
    assert f"{choice.predicted_kl:.4f}" in panel.auto.quality_label.text()
    assert format_bytes(panel.auto_budget()) in panel.auto.budget_label.text()
    # the sensitive layers get more bits than the rest at a middling budget
    assert choice.widths[[3, 11]].min() >= np.median(choice.widths)
    previous_bytes, previous_kl = np.inf, -np.inf
    for position in (AUTO_STEPS, 700, 400, 150, 0):
        with qtbot.waitSignal(panel.settingsChanged):
            panel.auto_slider.setValue(position)
        choice = panel.auto_choice()
        assert panel.preset() == AUTO and panel.spec() == choice.spec
        assert kv_bytes(panel) <= panel.auto_budget() + 1e-6
        assert kv_bytes(panel) <= previous_bytes and choice.predicted_kl >= previous_kl
        previous_bytes, previous_kl = kv_bytes(panel), choice.predicted_kl
    assert (choice.widths == 2).all()                   # the bottom of the range: everything at 2 bits
    panel.auto_slider.setValue(AUTO_STEPS)
    assert (panel.auto_choice().widths == 8).all()


def test_a_budget_in_bytes_and_a_new_context_are_chosen_again(panel, qtbot):
    panel.select_preset(AUTO)
    panel.set_profile(synthetic_profile(), SMOL["path"])
    k4v4 = estimate_bytes(KVConfig(4, 4), 30, 3, 64, panel.ctx_spin.value(), 64, [None] * 30)["total"]
    panel.set_auto_budget(k4v4)
    assert kv_bytes(panel) <= k4v4
    with qtbot.waitSignal(panel.settingsChanged):
        panel.ctx_spin.setValue(1024)
    assert kv_bytes(panel) <= panel.auto_budget()
    assert panel.auto_budget() < k4v4                  # the same position, a shorter context
    assert panel.spec() == panel.auto_choice().spec


def test_leaving_auto_and_editing_a_layer_is_custom(panel):
    panel.select_preset(AUTO)
    panel.set_profile(synthetic_profile(), SMOL["path"])
    panel.set_layer(0, 8, 8)
    assert panel.preset() == "custom" and panel.config().per_layer(30)[0].k_bits == 8
    panel.select_preset("memory-saver")
    assert panel.spec() == "k4v4" and panel.auto.isHidden()
    panel.select_preset(AUTO)                           # the profile is kept: chosen at once
    assert panel.spec() == panel.auto_choice().spec and not panel.is_tuning()


def test_state_keeps_auto_and_a_new_model_needs_its_own_profile(panel, qtbot):
    panel.select_preset(AUTO)
    panel.set_profile(synthetic_profile(), SMOL["path"])
    panel.auto_slider.setValue(250)
    state = panel.state()
    assert state["preset"] == AUTO and state["auto_position"] == 250
    other = KVPanel()
    qtbot.addWidget(other)
    other.set_state(state)
    assert other.spec() == panel.spec()                 # the last choice, before any profile
    assert other.auto_slider.value() == 250
    with qtbot.waitSignal(other.tuneRequested):        # the model: its profile is asked for
        other.set_model(SMOL)
    other.set_profile(synthetic_profile(), "/another-model.gguf")   # not this model's: ignored
    assert other.profile() is None
    other.set_profile(synthetic_profile(), SMOL["path"])
    assert other.spec() == panel.spec()
    with qtbot.waitSignal(other.tuneRequested):
        other.set_model({**SMOL, "path": "/y.gguf"})
    assert other.profile() is None


def test_a_profile_of_another_size_is_ignored(panel):
    panel.select_preset(AUTO)
    panel.set_profile(synthetic_profile(n_layers=12), SMOL["path"])
    assert panel.profile() is None


@pytest.mark.parametrize("position", [0, AUTO_STEPS])
def test_the_ends_of_the_slider_are_the_memory_range(panel, position):
    panel.select_preset(AUTO)
    panel.set_profile(synthetic_profile(), SMOL["path"])
    panel.auto_slider.setValue(position)
    low, high = kvtune.memory_range(SMOL["geometry"], panel.ctx_spin.value())
    assert panel.auto_budget() == pytest.approx(low if position == 0 else high)
    assert kv_bytes(panel) == pytest.approx(panel.auto_budget())
