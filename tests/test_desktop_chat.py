"""The desktop window on the real SmolLM2, driven as a user would: send and stream, stop, regenerate
and copy, KV presets and high-precision mode reaching the engine, pinned documents reused from
the cache, the live chart, bad files, conversations, and a restart over the same data folder.

One window (one loaded engine) is shared by the tests of this module, in file order; answers are
kept short (8-16 tokens).
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QGuiApplication  # noqa: E402
from PySide6.QtTest import QTest  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from engine.kv.config import estimate_bytes, parse_kv  # noqa: E402
from omlx_desktop.chart import format_bytes  # noqa: E402
from omlx_desktop.store import Store  # noqa: E402
from omlx_desktop.window import MainWindow  # noqa: E402

from .qt_wait import pump, wait_until  # noqa: E402

from .conftest import DATA  # noqa: E402

pytestmark = pytest.mark.slow  # a window on a real model, generating answers

TIMEOUT = 120.0
SHORT = 10


def ask(window: MainWindow, text: str, max_tokens: int = SHORT, *, enter: bool = True,
        timeout: float = 120.0) -> dict:
    """Types the message, sends it (Enter in the input box) and waits for the answer (up to
    `timeout` seconds: a prompt of a whole context on a busy machine can take minutes)."""
    answers: list[dict] = []
    window.answerFinished.connect(answers.append)
    try:
        window.max_tokens_spin.setValue(max_tokens)
        window.input.setPlainText(text)
        if enter:
            QTest.keyClick(window.input, Qt.Key.Key_Return)
        else:
            window.send_button.click()
        assert window.turn is not None, window.errors[-1:] or "nothing was sent"
        wait_until(lambda: answers, timeout=timeout, what=f"the answer to {text!r}")
    finally:
        window.answerFinished.disconnect(answers.append)
    assert answers[0]["state"] != "failed", answers[0].get("error")
    if os.environ.get("OMLX_TEST_DEBUG"):
        s = answers[0]["stats"]
        print(f"\n{text!r}: ttft {s['ttft_s']:.2f} s, {s['cached_tokens']}/{s['prompt_tokens']} cached, {s['generated_tokens']} tokens, total {s['total_s']:.2f} s")
    return answers[0]


def drop(window: MainWindow, *paths: Path) -> None:
    """A drag of local files entering the window and dropped on it."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    centre = window.rect().center()
    enter = QDragEnterEvent(centre, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(window, enter)
    assert enter.isAccepted()
    event = QDropEvent(QPointF(centre), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                       Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(window, event)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("desktop-data")


def open_window(data_dir: Path, model: Path):
    """A shown main window on `model` with its model loaded; closed after the module's tests
    (use as the body of a module-scoped fixture: `yield from open_window(...)`)."""
    w = MainWindow(data_dir=data_dir, model=str(model))
    w.resize(1280, 820)
    w.show()
    wait_until(lambda: w.model_info is not None or w.errors, what="the model")
    assert w.model_info is not None, w.errors
    yield w
    if not w.closed:
        w.close()


@pytest.fixture(scope="module")
def window(qapp, data_dir, smollm2_path):
    yield from open_window(data_dir, smollm2_path)


@pytest.fixture(scope="module")
def excerpt(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    path = folder / "apache-2.0.txt"
    lines = (DATA / "texts" / "apache-2.0.txt").read_text().splitlines()[:26]  # ~250 tokens
    path.write_text("\n".join(lines).strip("\n") + "\n")
    return path


def store_messages(window: MainWindow):
    return window.store.messages(window.conv_id)


def test_the_model_loads_and_shows_its_name_size_and_kv_per_token(window, smollm2_path):
    info = window.model_info
    text = window.model_summary()
    assert info["name"] in text and format_bytes(smollm2_path.stat().st_size) in text
    assert format_bytes(info["kv_bytes_per_token"]) + " per token" in text
    assert window.store.get_setting("last_model") == str(smollm2_path)
    assert window.stack.currentWidget() is window.transcript
    assert window.windowIcon().isNull() is False


def test_in_a_narrow_window_the_model_header_keeps_the_columns_width(window):
    """The serve switch and Open sit in a row under the header: at the window's narrowest the
    header wraps into at most three lines, over the whole model bar's width."""
    size = window.size()
    try:
        window.resize(900, 700)
        pump(0.3)
        label = window.model_label
        assert window.serve_panel.isVisible() and window.model_tools.indexOf(window.serve_panel) == 0
        assert label.width() >= label.parentWidget().width() - 20
        assert label.height() <= 3 * label.fontMetrics().lineSpacing() + 4, label.height()
    finally:
        window.resize(size)
        pump(0.1)


def test_the_documents_pane_shows_a_whole_document_row(window):
    """Under its three rows of controls the pinned documents' list keeps room for a document's
    whole row (it was squeezed to a sliver of one under "Sections per answer"), at the window's
    default size and at its narrowest."""
    from PySide6.QtWidgets import QScrollArea

    docs = window.documents
    scroll = docs.findChild(QScrollArea)
    assert docs.row_height >= 2 * docs.fontMetrics().lineSpacing()  # a row: name and details
    assert scroll.height() >= docs.row_height, (scroll.height(), docs.row_height)
    size = window.size()
    try:
        window.resize(900, 700)
        pump(0.3)
        assert scroll.height() >= docs.row_height
    finally:
        window.resize(size)
        pump(0.1)


def test_send_streams_the_answer_and_persists_it(window):
    answer = ask(window, "What is the capital of France?")
    assert answer["state"] == "complete" and answer["text"].strip()
    assert answer["updates"] >= 2                       # streamed in pieces, not at the end
    assert window.input.toPlainText() == ""
    assert answer["text"].split()[0] in window.transcript.toPlainText()
    user, assistant = store_messages(window)[-2:]
    assert (user.role, user.content) == ("user", "What is the capital of France?")
    assert assistant.role == "assistant" and assistant.state == "complete"
    assert assistant.content == answer["text"]
    assert assistant.stats["generated_tokens"] == answer["stats"]["generated_tokens"] > 0
    stats = window.stats_summary()
    assert "TTFT" in stats and "tok/s" in stats and "peak RSS" in stats and "KV " in stats
    assert window.conv_list.currentItem().text().startswith("What is the capital")


def test_stop_keeps_the_partial_answer_marked_interrupted(window):
    window.max_tokens_spin.setValue(300)
    window.input.setPlainText("Write a long story about a dragon who learns to bake bread.")
    QTest.keyClick(window.input, Qt.Key.Key_Return)
    turn = window.turn
    assert turn is not None
    # streaming: the message is in the store while it grows (flushed ~4 times a second)
    wait_until(lambda: len(window.store.message(turn.message_id).content) > 0, what="streamed text")
    assert window.store.message(turn.message_id).state == "streaming"
    answers = []
    window.answerFinished.connect(answers.append)
    window.activateWindow()
    QTest.keyClick(window.input, Qt.Key.Key_Escape)     # Esc stops
    assert turn.cancel.is_set()
    wait_until(lambda: answers, 30, "the stop")
    window.answerFinished.disconnect(answers.append)
    answer = answers[0]
    latency = answer["stats"]["stop_latency_s"]
    print(f"stop latency: {latency * 1000:.0f} ms (engine {answer['stats']['engine_stop_s'] * 1000:.0f} ms)"
          f" after {answer['stats']['generated_tokens']} tokens")
    assert latency < 1.5                                 # one token plus the signal round trip
    assert answer["state"] == "interrupted" and answer["stats"]["generated_tokens"] < 300
    stored = window.store.message(turn.message_id)
    assert stored.state == "interrupted" and stored.content == answer["text"] and stored.content
    assert "(stopped)" in window.transcript.toPlainText()
    assert "stopped" in window.stats_summary()
    assert window.send_button.isEnabled() and not window.stop_button.isEnabled()


def test_regenerate_replaces_the_last_answer_and_copy_copies_it(window):
    before = store_messages(window)
    answers = []
    window.answerFinished.connect(answers.append)
    window.max_tokens_spin.setValue(SHORT)
    assert window.regenerate()
    wait_until(lambda: answers, what="the regenerated answer")
    window.answerFinished.disconnect(answers.append)
    after = store_messages(window)
    assert len(after) == len(before)
    assert after[-1].state == "complete" and after[-1].content == answers[0]["text"]
    assert after[-2].content == before[-2].content      # the same question
    window.copy_button.click()
    assert QGuiApplication.clipboard().text() == answers[0]["text"]


def test_presets_change_the_estimate_and_the_next_answers_kv_bytes(window):
    ctx = window.kv_panel.ctx_spin.value()
    g = window.model_info["geometry"]

    def expected(spec):
        return format_bytes(estimate_bytes(parse_kv(spec), g["n_layers"], g["n_kv_heads"], g["head_dim"],
                                           ctx, g["value_dim"], g["windows"])["total"])

    kv_bytes = {}
    for preset, spec in (("memory-saver", "k4v4"), ("high-precision", "k8v8")):
        window.kv_panel.select_preset(preset)
        assert f"KV at full context ({ctx:,} tokens): {expected(spec)}" in window.kv_panel.estimate_text()
        window.new_conversation()                       # the same prompt under each preset
        answer = ask(window, "Name a colour.", 8)
        assert answer["stats"]["kv_spec"] == spec
        kv_bytes[spec] = answer["stats"]["kv_bytes"]
        assert format_bytes(kv_bytes[spec]) in window.stats_summary()
        assert spec.upper() in window.model_summary()   # applied: the model bar says so
    assert kv_bytes["k8v8"] > kv_bytes["k4v4"]
    assert window.store.get_setting("kv_panel")["preset"] == "high-precision"


def test_high_precision_mode_on_and_back_to_the_previous_setting(window):
    panel = window.kv_panel
    panel.set_bits(5, 4)
    panel.set_first_last(2, 0)
    before = panel.state()
    spec_before = panel.spec()
    estimate_before = panel.estimate_text()
    assert spec_before == "k5v4,0-1:k8v8"
    panel.high_precision.click()
    assert panel.spec() == "k8v8" and panel.estimate_text() != estimate_before
    assert window.store.get_setting("kv_panel")["high_precision"] is True
    panel.high_precision.click()
    assert panel.state() == before and panel.spec() == spec_before
    assert panel.estimate_text() == estimate_before
    answer = ask(window, "Name a fruit.", 6)
    assert answer["stats"]["kv_spec"] == spec_before    # what reached the engine
    panel.select_preset("balanced")


def test_a_dropped_document_is_pinned_cached_and_reused(window, excerpt):
    window.new_conversation()
    progress = []
    original = window.documents.set_progress
    window.documents.set_progress = lambda k, d, t: (progress.append((k, d, t)), original(k, d, t))
    try:
        drop(window, excerpt)
        key = window.documents.keys()[-1]
        wait_until(lambda: key in window.docs.doc_ids or window.errors[-1:], what="the document")
    finally:
        window.documents.set_progress = original
    assert key in window.docs.doc_ids, window.errors[-1:]
    assert progress and progress[-1][1] == progress[-1][2]   # prefill progress reached the end
    row = window.documents.rows[key]
    stored = window.store.documents(window.conv_id)
    assert [d.name for d in stored] == ["apache-2.0.txt"] and stored[0].pinned
    n_tokens = stored[0].n_tokens
    assert n_tokens > 200 and row.info_label.text() == f"{n_tokens:,} tokens"
    assert row.badge.isVisibleTo(row)                   # "cached"

    first = ask(window, "Who is the Licensor?", 8)
    second = ask(window, "What is a Contribution?", 8)
    for answer in (first, second):
        assert answer["stats"]["cached_tokens"] >= n_tokens
    cached = second["stats"]["cached_tokens"]
    assert f"cache: {cached:,} of {second['stats']['prompt_tokens']:,} prompt tokens reused" \
        in window.stats_summary()

    row.pin.click()                                     # unpin: out of the prefix
    wait_until(lambda: not window.store.document(window.docs.doc_ids[key]).pinned, what="unpinning")
    wait_until(lambda: row.pin.isEnabled() and not row.badge.isVisibleTo(row), what="the row")
    row.pin.click()                                     # pin again: read from the cache
    wait_until(lambda: row.badge.isVisibleTo(row), what="the cached badge")
    assert window.store.document(window.docs.doc_ids[key]).pinned


def test_the_chart_grows_while_generating(window):
    chart = window.chart
    assert chart.is_sampling()
    before = len(chart.series()[0])
    updates = window.kv_holder.updates
    started = time.monotonic()
    answer = ask(window, "And who is You?", 16)
    ended = time.monotonic()
    pump(0.3)
    times, rss, kv, cap = chart.series()
    assert len(times) > before
    during = (times >= started) & (times <= ended)
    assert during.sum() >= max(1, int(answer["stats"]["total_s"] / 0.25) - 2)   # 4 Hz meanwhile
    assert window.kv_holder.updates > updates           # the worker published during the turn
    assert kv.max() > 0 and cap.max() >= kv.max() and rss.min() > 0
    assert "in use of" in chart.summary.text()


def test_bad_files_show_errors_and_the_window_stays_usable(window, smollm2_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as f:
        truncated.write_bytes(f.read(1000))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 8)
    model_before = window.model_info
    n_errors = len(window.errors)

    drop(window, truncated)
    wait_until(lambda: len(window.errors) > n_errors and window.models.loading is None, what="the load error")
    assert "truncated.gguf" in window.errors[-1]
    assert window.banner.isVisible() and "truncated.gguf" in window.banner.text()
    assert window.model_info is model_before            # the loaded model stays
    assert window.store.get_setting("last_model") == str(smollm2_path)

    rows = len(window.documents.keys())
    drop(window, binary)
    wait_until(lambda: len(window.errors) > n_errors + 1, what="the document error")
    assert "binary.txt" in window.errors[-1] and "binary" in window.errors[-1]
    assert len(window.documents.keys()) == rows         # its row is gone again
    window.banner.close_button.click()
    assert not window.banner.isVisible()

    # an error inside the worker: the pinned document no longer fits a 256-token context
    window.kv_panel.ctx_spin.setValue(256)
    n_messages = len(store_messages(window))
    answers = []
    window.answerFinished.connect(answers.append)
    assert window.send_message("Does this fit?")
    wait_until(lambda: answers, what="the failure")
    window.answerFinished.disconnect(answers.append)
    assert answers[0]["state"] == "failed" and "context" in answers[0]["error"]
    assert window.banner.isVisible() and "The answer failed" in window.banner.text()
    messages = store_messages(window)
    assert len(messages) == n_messages + 1 and messages[-1].content == "Does this fit?"  # no empty answer
    assert window.send_button.isEnabled()
    window.kv_panel.ctx_spin.setValue(4096)

    answer = ask(window, "Say hi.", 6)                  # still works
    assert answer["state"] == "complete"


def test_a_later_success_clears_a_stale_error_and_a_new_preset_rereads_the_document(window, excerpt):
    previous = window.conv_id
    mine = window.new_conversation()
    n_errors = len(window.errors)
    window.kv_panel.ctx_spin.setValue(256)              # too small for the document
    drop(window, excerpt)
    wait_until(lambda: len(window.errors) > n_errors, what="the refusal")
    assert "context" in window.errors[-1] and window.banner.isVisible()
    window.kv_panel.ctx_spin.setValue(4096)
    drop(window, excerpt)                               # the same file, now it fits
    key = window.documents.keys()[-1]
    wait_until(lambda: key in window.docs.doc_ids or len(window.errors) > n_errors + 1,
               what="the document")
    assert key in window.docs.doc_ids, window.errors[-1]
    assert not window.banner.isVisible()                # the refusal no longer applies
    row = window.documents.rows[key]
    assert row.badge.isVisibleTo(row)

    # a new KV preset: the pinned document is read again into the new format before the
    # answer, its row saying so (not "cached" meanwhile), then cached again
    seen = []
    original = window.documents.set_progress

    def record(k, done, total):
        original(k, done, total)
        seen.append((k, row.badge.isVisibleTo(row), row.info_label.text()))

    window.documents.set_progress = record
    try:
        window.kv_panel.select_preset("memory-saver")
        answer = ask(window, "What is this?", 6)
    finally:
        window.documents.set_progress = original
        window.kv_panel.select_preset("balanced")
    assert answer["stats"]["kv_spec"] == "k4v4"
    reading = [s for s in seen if s[0] == key]
    assert reading and all(not cached and text.startswith("reading") for _, cached, text in reading)
    wait_until(lambda: row.badge.isVisibleTo(row), what="the cached badge again")

    window.delete_conversation(mine, confirm=False)
    window.open_conversation(previous)
    for restored in window.documents.rows.values():
        wait_until(lambda: restored.badge.isVisibleTo(restored), what="the documents restored")


def test_out_of_memory_in_a_turn_is_reported_as_such_and_the_app_keeps_working(window, monkeypatch):
    def no_memory(*args, **kwargs):     # runs in the worker thread, inside the session's turn
        raise MemoryError("simulated")
        yield

    monkeypatch.setattr(window.worker.engine, "stream", no_memory)
    n_messages = len(store_messages(window))
    answers = []
    window.answerFinished.connect(answers.append)
    try:
        assert window.send_message("Is there memory left?")
        wait_until(lambda: answers, what="the failure")
    finally:
        window.answerFinished.disconnect(answers.append)
        monkeypatch.undo()
    failed = answers[0]
    assert failed["state"] == "failed" and failed["kind"] == "out_of_memory"
    assert "out of memory" in failed["error"] and "context" not in failed["error"]
    assert window.banner.isVisible() and "out of memory" in window.banner.text()
    messages = store_messages(window)
    assert len(messages) == n_messages + 1 and messages[-1].content == "Is there memory left?"

    answer = ask(window, "Say yes.", 6)                 # the next message works
    assert answer["state"] == "complete" and answer["text"]
    assert not window.banner.isVisible()


def test_conversations_new_rename_delete_and_switch(window):
    first = window.conv_id
    first_messages = [(m.role, m.content) for m in store_messages(window)]
    n = window.conv_list.count()
    window.activateWindow()
    QTest.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)   # Ctrl+N
    assert window.conv_list.count() == n + 1 and window.conv_id != first
    new = window.conv_id
    assert window.transcript.messages == [] and window.documents.keys() == []

    item = window.conv_list.currentItem()
    item.setText("Scratch")                             # edited in place
    assert window.store.conversation(new).title == "Scratch"
    window.rename_conversation(new, "Scratch 2")
    assert window.conv_list.currentItem().text() == "Scratch 2"
    window.delete_conversation(new, confirm=False)
    assert new not in window.conversation_ids() and window.conv_list.count() == n

    window.open_conversation(first)                     # switching back rebuilds from the Store
    assert window.conv_id == first
    assert [(m["role"], m["content"]) for m in window.transcript.messages] == first_messages
    row = window.documents.rows[window.documents.keys()[0]]
    wait_until(lambda: row.badge.isVisibleTo(row), what="the document restored")
    answer = ask(window, "Thanks!", 6)
    assert answer["stats"]["cached_tokens"] > row_tokens(row)   # the document and the chat so far


def row_tokens(row) -> int:
    return int(row.info_label.text().split()[0].replace(",", ""))


def test_restart_finds_the_conversation_and_its_document(window, data_dir, smollm2_path):
    conv = window.conv_id
    title = window.store.conversation(conv).title
    messages = [(m.role, m.content, m.state) for m in store_messages(window)]
    window.kv_panel.overflow_box.setCurrentIndex(window.kv_panel.overflow_box.findData("attention"))
    window.resize(980, 700)                             # (the offscreen screen is 800x800)
    window.right.setSizes([300, 150, 250])
    pump(0.05)
    right_sizes = window.right.sizes()
    # closed in the middle of an answer: it stops, the thread ends, the answer is kept
    window.max_tokens_spin.setValue(300)
    assert window.send_message("Tell me a long story about a lighthouse keeper.")
    turn = window.turn
    wait_until(lambda: len(turn.text) > 0, what="streamed text")
    started = time.monotonic()
    window.close()
    assert time.monotonic() - started < 5.0
    assert not window.thread.isRunning() and turn.cancel.is_set()
    with Store(data_dir / "omlx.db") as store:          # closed cleanly, all committed
        stored = store.messages(conv)
        assert [(m.role, m.content, m.state) for m in stored[:-2]] == messages
        assert stored[-1].state == "interrupted" and stored[-1].content
        messages = [(m.role, m.content, m.state) for m in stored]
        # a message a killed process left 'streaming' is recovered as 'interrupted' at start
        killed = store.add_message(conv, "assistant", "half an answer", state="streaming")
        messages.append(("assistant", "half an answer", "interrupted"))

    again = MainWindow(data_dir=data_dir)               # no model given: the last one
    try:
        again.show()
        wait_until(lambda: again.model_info is not None or again.errors, what="the model")
        assert again.model_info["path"] == str(smollm2_path)
        assert again.height() == 700 and again.right.sizes() == right_sizes
        assert again.kv_panel.overflow() == "attention" and again.kv_panel.spec() == "k6v4"
        assert conv in again.conversation_ids()
        assert again.recovered == [killed.id]
        again.open_conversation(conv)
        assert again.conv_list.currentItem().text() == title
        assert [(m["role"], m["content"], m["state"]) for m in again.transcript.messages] == messages
        assert [again.documents.rows[k].name for k in again.documents.keys()] == ["apache-2.0.txt"]
        row = again.documents.rows[again.documents.keys()[0]]
        wait_until(lambda: row.badge.isVisibleTo(row), what="the document re-added and cached")
        answer = ask(again, "One more question: what is a Work?", 6)
        assert answer["stats"]["cached_tokens"] >= row_tokens(row)
    finally:
        again.close()
    assert not again.thread.isRunning()

