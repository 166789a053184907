"""The KV panel built on KVConfig: presets and bits from the engine's lists, and the import of a KV
settings file (this app's keys or llama.cpp's names) with its errors shown in the panel."""

from __future__ import annotations

import json
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtWidgets import QFileDialog  # noqa: E402

from engine.kv.config import SELECTABLE_BITS, KVConfig, estimate_bytes  # noqa: E402
from omlx_desktop.chart import format_bytes  # noqa: E402
from omlx_desktop.kv_panel import KVPanel  # noqa: E402

from .test_desktop_widgets import SMOL, panel  # noqa: E402, F401  (the model geometry and the fixture)


def write(path, data) -> str:
    path.write_text(json.dumps(data) if isinstance(data, dict) else data, encoding="utf-8")
    return str(path)


def test_the_panel_offers_the_engines_presets_and_bits(panel):
    box = [(panel.preset_box.itemData(i), panel.preset_box.itemText(i)) for i in range(panel.preset_box.count())]
    assert box == KVConfig.presets() + [("auto", "Auto (fit to memory)"), ("custom", "Custom")]
    assert panel.k_slider.maximum() == len(SELECTABLE_BITS) - 1
    for index, bits in enumerate(SELECTABLE_BITS):
        panel.k_slider.setValue(index)
        assert panel.bits()[0] == bits and panel.config().k_bits == bits
    for name, _ in KVConfig.presets():
        panel.select_preset(name)
        assert panel.config() == KVConfig.preset(name) and panel.spec() == str(KVConfig.preset(name))


def test_config_is_what_the_spec_says(panel):
    panel.set_bits(5, 3)
    panel.set_first_last(2, 1)
    panel.set_layer(10, 4, 2)
    assert panel.config() == KVConfig.parse(panel.spec())
    assert panel.spec() == "k5v3,0-1:k8v8,10:k4v2,29:k8v8"
    panel.set_high_precision(True)
    assert panel.config() == KVConfig(8, 8)


def test_import_llama_cpp_names(panel, tmp_path, qtbot):
    path = write(tmp_path / "llama.json", {"cache_type_k": "q8_0", "cache_type_v": "q4_0"})
    with qtbot.waitSignal(panel.settingsChanged) as sig:
        assert panel.import_settings(path) is None
    assert sig.args[0]["spec"] == "k8v4"
    assert panel.bits() == (8, 4) and panel.preset() == "custom"
    assert panel.k_label.text() == "K: 8 bits"
    assert "Imported llama.json" in panel.import_message()
    ctx = panel.ctx_spin.value()
    expected = estimate_bytes(KVConfig(8, 4), 30, 3, 64, ctx, 64, [None] * 30)["total"]
    assert format_bytes(expected) in panel.estimate_text()


def test_import_toml_with_layers_options_and_a_preset(panel, tmp_path):
    path = write(tmp_path / "kv.toml", 'preset = "memory-saver"\nrotation = true\nblock_size = 16\n'
                                       'layers = [{layers = "first2", k_bits = 8}, "-1:f16"]\n')
    assert panel.import_settings(path) is None
    assert panel.spec() == "k4v4,0-1:k8v4,29:k16v16,bs=16,rot"
    assert panel.overrides() == {0: (8, 4), 1: (8, 4), 29: (16, 16)}
    assert panel.table.item(0, 1).text() == "8" and panel.table.item(29, 2).text() == "16"
    assert panel.preset() == "custom"

    # the options travel with the setting: the sliders, high-precision mode and the saved state keep them
    panel.set_bits(6, 4)
    assert panel.spec() == "k6v4,0-1:k8v4,29:k16v16,bs=16,rot"
    assert panel.import_message() == ""                       # a later change clears the note
    panel.set_high_precision(True)
    assert panel.spec() == "k8v8,bs=16,rot"
    panel.set_high_precision(False)
    state = panel.state()
    other = KVPanel()
    other.set_state(state)
    other.set_model(SMOL)
    assert other.spec() == panel.spec() and other.state() == state
    other.deleteLater()

    # a preset is the whole setting: options back to their defaults
    panel.select_preset("balanced")
    assert panel.spec() == "k6v4" and panel.config() == KVConfig.preset("balanced")


def test_import_of_a_preset_selects_it(panel, tmp_path):
    panel.set_high_precision(True)
    assert panel.import_settings(write(tmp_path / "a.json", {"kv": "memory-saver"})) is None
    assert panel.preset() == "memory-saver" and not panel.is_high_precision()
    assert panel.import_settings(write(tmp_path / "b.json", {"k_bits": 6, "v_bits": 4})) is None
    assert panel.preset() == "balanced" and panel.spec() == "k6v4"


@pytest.mark.parametrize(
    "name, content, needles",
    [
        ("typo.json", {"cache_typ_k": "q8_0"}, ["unknown setting 'cache_typ_k'", "did you mean 'cache_type_k'"]),
        ("value.json", {"cache_type_k": "q8_O"}, ["'q8_O' is not a supported cache type", "did you mean 'q8_0'"]),
        ("f32.toml", 'cache_type_v = "f32"\n', ["f32 is not supported"]),
        ("range.json", {"layers": {"40": "k8v8"}}, ["out of range", "30 layers"]),
        ("broken.json", "{not json", ["invalid JSON"]),
    ],
)
def test_a_bad_file_changes_nothing_and_says_why(panel, tmp_path, qtbot, name, content, needles):
    panel.set_bits(5, 4)
    before, spec = panel.state(), panel.spec()
    path = write(tmp_path / name, content)
    with qtbot.assertNotEmitted(panel.settingsChanged):
        error = panel.import_settings(path)
    assert error and name in error
    for needle in needles:
        assert needle in error, (needle, error)
    assert panel.state() == before and panel.spec() == spec
    assert panel.import_message() == error and panel.import_label.isVisibleTo(panel)
    assert "#dc2626" in panel.import_label.styleSheet()
    assert panel.import_settings(write(tmp_path / "ok.json", {"cache_type_k": "f16"})) is None
    assert "#dc2626" not in panel.import_label.styleSheet() and "Imported ok.json" in panel.import_message()


def test_a_missing_file(panel, tmp_path):
    error = panel.import_settings(tmp_path / "nowhere.toml")
    assert "no such settings file" in error and panel.spec() == "k6v4"


def test_layers_from_the_end_need_a_model(qtbot, tmp_path):
    p = KVPanel()
    qtbot.addWidget(p)
    path = write(tmp_path / "last.json", {"spec": "k4v4,last2:k8v8"})
    error = p.import_settings(path)
    assert "counts layers from the end" in error and "load a model first" in error and p.spec() == "k6v4"
    assert p.import_settings(write(tmp_path / "first.json", {"spec": "k4v4,first2:k8v8"})) is None
    assert p.spec() == "k4v4,0-1:k8v8"
    p.set_model(SMOL)
    assert p.import_settings(path) is None and p.spec() == "k4v4,28-29:k8v8"


def test_the_import_button_opens_a_file_dialog(panel, tmp_path, monkeypatch):
    path = write(tmp_path / "kv.json", {"type_k": "q5_0", "type_v": "q5_0"})
    asked = []

    def fake_dialog(parent, caption, directory, filter_):
        asked.append((parent, filter_))
        return path, ""

    monkeypatch.setattr(QFileDialog, "getOpenFileName", staticmethod(fake_dialog))
    panel.import_button.click()
    assert asked and asked[0][0] is panel and "*.json" in asked[0][1] and "*.toml" in asked[0][1]
    assert panel.spec() == "k5v5"

    monkeypatch.setattr(QFileDialog, "getOpenFileName", staticmethod(lambda *a: ("", "")))
    panel.import_button.click()                               # cancelled: nothing changes
    assert panel.spec() == "k5v5"
