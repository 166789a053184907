"""The desktop app's widgets on their own (no model): the KV panel (presets, sliders, high-
precision mode, per-layer spec, the estimate), the input box, the markdown transcript, the
documents panel, the KV holder and the command line."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

from engine.kv.config import estimate_bytes, parse_kv  # noqa: E402
from omlx_desktop.app import build_parser  # noqa: E402
from omlx_desktop.chart import format_bytes  # noqa: E402
from omlx_desktop.documents_panel import DocumentsPanel  # noqa: E402
from omlx_desktop.kv_panel import KVPanel, layer_spec  # noqa: E402
from omlx_desktop.markdown import TranscriptView  # noqa: E402
from omlx_desktop.window import ChatInput, resource_path  # noqa: E402
from omlx_desktop.worker import KVHolder  # noqa: E402

SMOL = {  # SmolLM2-135M's KV geometry, as the worker reports it
    "name": "SmolLM2", "path": "/x.gguf", "file_size": 1, "context_length": 8192, "kv_spec": "k6v4",
    "kv_bytes_per_token": 1.0, "kv_bytes_per_token_16": 2.0,
    "geometry": {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64, "value_dim": 64, "windows": [None] * 30},
}


@pytest.fixture
def panel(qtbot):
    p = KVPanel()
    qtbot.addWidget(p)
    p.set_model(SMOL)
    return p


def estimate(spec: str, ctx: int) -> int:
    return estimate_bytes(parse_kv(spec), 30, 3, 64, ctx, 64, [None] * 30)["total"]


def test_layer_spec_groups_runs_and_parses_back():
    over = {0: (8, 8), 1: (8, 8), 2: (8, 8), 5: (4, 2), 28: (8, 8), 29: (8, 8), 7: (6, 4)}
    spec = layer_spec(6, 4, over, 30)
    assert spec == "k6v4,0-2:k8v8,5:k4v2,28-29:k8v8"  # layer 7 equals the base: left out
    layers = parse_kv(spec).per_layer(30)
    assert [str(x) for x in layers[:3]] == ["k8v8"] * 3 and str(layers[5]) == "k4v2"
    assert str(layers[7]) == "k6v4" and str(layers[29]) == "k8v8"
    assert layer_spec(4, 4, {40: (8, 8)}, 30) == "k4v4"  # past the model's layers: dropped


def test_presets_sliders_and_the_estimate(panel, qtbot):
    assert panel.preset() == "balanced" and panel.bits() == (6, 4) and panel.spec() == "k6v4"
    ctx = panel.ctx_spin.value()
    assert format_bytes(estimate("k6v4", ctx)) in panel.estimate_text()
    assert f"16-bit would be {format_bytes(estimate('full', ctx))}" in panel.estimate_text()

    with qtbot.waitSignal(panel.settingsChanged) as sig:
        panel.select_preset("memory-saver")
    assert sig.args[0]["spec"] == "k4v4" and panel.bits() == (4, 4)
    assert format_bytes(estimate("k4v4", ctx)) in panel.estimate_text()

    panel.k_slider.setValue(panel.k_slider.value() + 1)     # a slider moved: Custom
    assert panel.preset() == "custom" and panel.spec() == "k5v4"
    panel.set_bits(6, 4)                                    # even onto a preset's values
    assert panel.preset() == "custom" and panel.spec() == "k6v4"
    assert "K: 6 bits" == panel.k_label.text()

    panel.select_preset("full")
    assert panel.spec() == "k16v16" and panel.k_label.text() == "K: 16 bits"
    panel.ctx_spin.setValue(2048)
    assert "2,048 tokens" in panel.estimate_text()
    assert format_bytes(estimate("full", 2048)) in panel.estimate_text()
    assert panel.ctx_spin.maximum() == 8192                 # the model's context
    panel.overflow_box.setCurrentIndex(panel.overflow_box.findData("attention"))
    assert panel.settings() == {"spec": "k16v16", "ctx": 2048, "overflow": "attention"}


def test_high_precision_mode_restores_exactly_what_was_set(panel):
    panel.set_bits(5, 3)
    panel.set_first_last(2, 1)
    before = panel.state()
    assert panel.spec() == "k5v3,0-1:k8v8,29:k8v8"
    estimate_before = panel.estimate_text()

    panel.high_precision.click()
    assert panel.is_high_precision() and panel.spec() == "k8v8"
    assert panel.bits() == (8, 8) and panel.preset() == "high-precision"
    assert not panel.k_slider.isEnabled() and not panel.preset_box.isEnabled()
    assert panel.estimate_text() != estimate_before

    panel.high_precision.click()
    assert not panel.is_high_precision()
    assert panel.state() == before
    assert panel.spec() == "k5v3,0-1:k8v8,29:k8v8" and panel.bits() == (5, 3)
    assert panel.preset() == "custom" and panel.k_slider.isEnabled()
    assert panel.estimate_text() == estimate_before

    # and from a preset: back to that preset
    panel.select_preset("memory-saver")
    panel.set_high_precision(True)
    panel.set_high_precision(False)
    assert panel.preset() == "memory-saver" and panel.spec() == "k4v4"


def test_per_layer_table_and_shortcut(panel):
    panel.advanced_button.click()
    assert panel.advanced.isVisible() or not panel.isVisible()
    assert panel.table.rowCount() == 30
    panel.first_spin.setValue(4)
    panel.last_spin.setValue(2)
    panel.apply_first_last.click()
    assert panel.spec() == "k6v4,0-3:k8v8,28-29:k8v8"
    assert panel.table.item(0, 1).text() == "8" and panel.table.item(10, 1).text() == "6"
    assert panel.preset() == "custom"
    panel.table.item(10, 2).setText("2")                     # edit a cell
    assert panel.spec() == "k6v4,0-3:k8v8,10:k6v2,28-29:k8v8"
    panel.table.item(11, 1).setText("7")                     # not a supported width: reverted
    assert panel.table.item(11, 1).text() == "6" and "11:" not in panel.spec()
    full = estimate_bytes(parse_kv(panel.spec()), 30, 3, 64, panel.ctx_spin.value(), 64, [None] * 30)
    assert format_bytes(full["total"]) in panel.estimate_text()
    panel.clear_layers.click()
    assert panel.spec() == "k6v4"


def test_panel_state_round_trips(qtbot, panel):
    panel.set_bits(8, 4)
    panel.set_first_last(1, 0)
    panel.ctx_spin.setValue(1024)
    panel.set_high_precision(True)
    state = panel.state()
    other = KVPanel()
    qtbot.addWidget(other)
    other.set_state(state)
    other.set_model(SMOL)
    assert other.state() == state and other.spec() == "k8v8"
    other.set_high_precision(False)
    assert other.spec() == "k8v4,0:k8v8"
    assert other.bits() == (8, 4) and other.ctx_spin.value() == 1024


def test_panel_without_a_model_says_so(qtbot):
    p = KVPanel()
    qtbot.addWidget(p)
    assert "load a model" in p.estimate_text()
    assert p.table.rowCount() == 0


def test_chat_input_enter_sends_shift_enter_breaks_the_line(qtbot):
    box = ChatInput()
    qtbot.addWidget(box)
    sent = []
    box.submitted.connect(lambda: sent.append(box.toPlainText()))
    qtbot.keyClicks(box, "first line")
    qtbot.keyClick(box, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(box, "second")
    assert box.toPlainText() == "first line\nsecond" and not sent
    qtbot.keyClick(box, Qt.Key.Key_Return)
    assert sent == ["first line\nsecond"]


def test_transcript_renders_markdown_and_streams(qtbot):
    view = TranscriptView()
    qtbot.addWidget(view)
    view.set_messages([{"role": "user", "content": "Show **markdown**", "state": "complete"}])
    assert "Show **markdown**" in view.toPlainText()       # the user's text stays literal
    view.begin_streaming()
    view.update_streaming("Some **bold")
    view.update_streaming("Some **bold** text\n\n- one\n- two\n\n```py\nx = 1\n```")
    plain = view.toPlainText()
    assert "Some bold text" in plain and "**" not in plain.split("Assistant")[1]
    assert "x = 1" in plain
    html = view.toHtml()
    assert "font-weight:700" in html or "font-weight:600" in html
    assert "<li" in html                                    # a real list
    view.finish_streaming("Some **bold** text", "interrupted")
    assert "(stopped)" in view.toPlainText() and view.last_answer() == "Some **bold** text"
    assert not view.is_streaming()


def test_documents_panel_rows(qtbot):
    panel = DocumentsPanel()
    qtbot.addWidget(panel)
    pins, removed = [], []
    panel.pinToggled.connect(lambda k, on: pins.append((k, on)))
    panel.removeRequested.connect(removed.append)
    row = panel.add_row("a", "notes.md")
    assert not panel.empty_label.isVisibleTo(panel)
    panel.set_progress("a", 512, 1000)
    assert row.progress.value() == 512 and "512 / 1,000" in row.info_label.text()
    panel.set_info("a", {"name": "notes.md", "n_tokens": 1000, "pinned": True, "cached": True})
    assert row.info_label.text() == "1,000 tokens" and row.badge.isVisibleTo(row)
    assert not row.progress.isVisibleTo(row)
    row.pin.click()
    assert pins == [("a", False)]
    row.remove.click()
    assert removed == ["a"]
    panel.sync([])
    assert panel.keys() == [] and panel.empty_label.isVisibleTo(panel)


def test_documents_panel_retrieval_budget(qtbot):
    from engine.retrieval import MIN_RETRIEVAL_TOKENS, RETRIEVAL_TOKENS

    panel = DocumentsPanel()
    qtbot.addWidget(panel)
    changes = []
    panel.retrievalTokensChanged.connect(changes.append)
    assert panel.retrieval_tokens() == RETRIEVAL_TOKENS and panel.budget_spin.isEnabled()
    panel.budget_spin.setValue(1200)
    panel.budget_spin.setValue(panel.budget_spin.minimum())  # the lowest value: fill the context
    assert changes == [1200, 0] and panel.budget_spin.text() == "fill the context"
    panel.budget_spin.setValue(100)  # below one section: not a value it takes
    assert panel.budget_spin.value() >= MIN_RETRIEVAL_TOKENS - 1
    panel.set_retrieval_tokens(900)  # shown, not emitted (a conversation opened)
    assert panel.retrieval_tokens() == 900 and panel.budget_spin.text() == "900 tokens"
    panel.set_retrieval_tokens(0)
    assert panel.budget_spin.text() == "fill the context" and changes == [1200, 0]
    panel.mode_box.setCurrentIndex(panel.mode_box.findData("whole"))
    assert not panel.budget_spin.isEnabled()  # read whole: no sections to budget
    panel.set_doc_mode("auto")
    assert panel.budget_spin.isEnabled()


def test_kv_holder_is_read_while_written():
    holder = KVHolder()
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            holder.publish(i, 2 * i)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(2000):
            used, cap = holder.read()
            assert cap == 2 * used
    finally:
        stop.set()
        t.join()


def test_command_line_and_resources():
    args = build_parser().parse_args(["model.gguf", "--data-dir", "/tmp/x", "--smoke-test"])
    assert args.model == "model.gguf" and args.data_dir == "/tmp/x" and args.smoke_test
    assert build_parser().parse_args([]).model is None
    assert resource_path("omlx-desktop.svg").is_file()


@pytest.mark.parametrize("reason, label", [
    ("cancelled", "stopped"), ("context_full", "context full"), ("kv_pool_full", "KV memory full"),
    ("length", "max tokens reached")])
def test_stats_line_names_why_an_answer_ended(reason, label):
    from omlx_desktop.chat import stats_text

    text = stats_text({"finish_reason": reason, "prompt_tokens": 10}).replace("\u00a0", " ")
    assert text.endswith(label)
    assert "KV memory full" not in stats_text({"finish_reason": "stop"}).replace("\u00a0", " ")
