"""Errors reaching the window on the real SmolLM2: an unexpected exception inside a worker request
ends that request (no loading or busy state left behind) with the error in the banner, its
traceback in the app's log and the log's path in the banner's details, and the previous model
still answers; each of the engine's own errors (OmlxError) the window can meet shows its message
in the banner, without a traceback.

One window (one loaded engine) is shared by the tests of this module, in file order.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine import fit  # noqa: E402
from engine.engine import GenerationStats  # noqa: E402
from omlx_desktop.applog import LOG_NAME  # noqa: E402
from omlx_desktop.window import MainWindow  # noqa: E402

from .qt_wait import wait_until  # noqa: E402
from .tiny_gguf import write_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def window(qapp, tmp_path_factory, smollm2_path):
    w = MainWindow(data_dir=tmp_path_factory.mktemp("desktop-errors"), model=str(smollm2_path))
    w.resize(1280, 820)
    w.show()
    wait_until(lambda: w.model_info is not None or w.errors, what="the model")
    assert w.model_info is not None, w.errors
    yield w
    if not w.closed:
        w.close()


def answer(window: MainWindow, text: str, max_tokens: int = 4) -> dict:
    answers: list[dict] = []
    window.answerFinished.connect(answers.append)
    try:
        assert window.send_message(text, max_tokens=max_tokens), window.errors[-1:]
        wait_until(lambda: answers, what=f"the answer to {text!r}")
    finally:
        window.answerFinished.disconnect(answers.append)
    return answers[0]


def load_and_wait_for_error(window: MainWindow, path: Path) -> str:
    n_errors = len(window.errors)
    window.load_model(str(path))
    wait_until(lambda: window.models.loading is None and len(window.errors) > n_errors,
               what=f"the load of {path.name} to fail")
    return window.errors[-1]


def assert_not_loading(window: MainWindow) -> None:
    assert window.models.ready and not window.load_progress.isVisible()
    assert window.send_button.isEnabled()


def assert_banner_without_traceback(window: MainWindow, *words: str) -> None:
    assert window.banner.isVisible()
    text = window.banner.text()
    for word in words:
        assert word in text, text
    assert "Traceback" not in text and window.banner.details() == ""
    assert not window.banner.details_button.isVisible()


def test_an_unexpected_error_while_loading_ends_the_load_and_the_previous_model_answers(
        window, smollm2_path, monkeypatch):
    def broken(*_args, **_kwargs):     # runs in the worker thread, inside the load's max_ctx
        raise AttributeError("module 'engine.models.qwen2' has no attribute 'ModelArgs'")

    before = window.model_info
    monkeypatch.setattr(fit, "default_context", broken)
    try:
        message = load_and_wait_for_error(window, smollm2_path)
    finally:
        monkeypatch.undo()
    assert "AttributeError" in message and "ModelArgs" in message
    assert_not_loading(window)
    assert window.model_info is before
    assert window.banner.isVisible() and "ModelArgs" in window.banner.text()
    log_path = window.log_path
    assert log_path.name == LOG_NAME and log_path.parent == window.store.path.parent
    assert str(log_path) in window.banner.details()
    window.banner.details_button.click()
    assert window.banner.details_label.isVisible()
    logged = log_path.read_text()
    assert "Traceback" in logged and "in max_ctx" in logged and "ModelArgs" in logged

    assert answer(window, "Say hi.")["state"] == "complete"    # the previous model answers


def test_an_exception_that_escapes_a_handler_still_ends_the_turn(window, monkeypatch):
    def broken(_self):                 # after the answer, outside the turn's own error handling
        raise KeyError("ttft_s")

    monkeypatch.setattr(GenerationStats, "as_dict", broken)
    try:
        failed = answer(window, "Are you there?")
    finally:
        monkeypatch.undo()
    assert failed["state"] == "failed" and failed["kind"] == "internal" and "KeyError" in failed["error"]
    assert window.turn is None and window.send_button.isEnabled() and not window.stop_button.isEnabled()
    assert "KeyError" in window.banner.text() and str(window.log_path) in window.banner.details()
    assert "in handle" in window.log_path.read_text()

    assert answer(window, "Say yes.")["state"] == "complete"
    assert not window.banner.isVisible()    # the turn's error no longer applies


def test_a_truncated_model_file_shows_its_message(window, smollm2_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as f:
        truncated.write_bytes(f.read(1000))
    message = load_and_wait_for_error(window, truncated)
    assert "truncated.gguf" in message
    assert_banner_without_traceback(window, "Cannot load truncated.gguf")
    assert_not_loading(window)


def test_an_unsupported_architecture_shows_its_message(window, tmp_path):
    tiny = write_tiny_model(tmp_path / "tiny.gguf")
    mamba = tmp_path / "mamba.gguf"
    mamba.write_bytes(tiny.read_bytes().replace(b"llama", b"mamba"))
    message = load_and_wait_for_error(window, mamba)
    assert "'mamba' is not supported" in message
    assert_banner_without_traceback(window, "mamba.gguf", "not supported")
    assert_not_loading(window)


def test_a_binary_document_shows_its_message(window, tmp_path):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 8)
    n_errors = len(window.errors)
    window.add_documents([str(binary)])
    wait_until(lambda: len(window.errors) > n_errors, what="the document error")
    assert "binary.txt" in window.errors[-1]
    assert_banner_without_traceback(window, "binary.txt", "binary")
    assert window.documents.keys() == []


def test_a_misspelled_kv_settings_file_shows_its_message(window, tmp_path):
    settings = tmp_path / "kv.json"
    settings.write_text('{"cache_type_k": "q4_9"}')
    spec = window.kv_panel.spec()
    assert window.kv_panel.import_settings(settings) is not None
    assert_banner_without_traceback(window, "KV settings", "q4_9")
    assert window.kv_panel.spec() == spec       # nothing changed


def test_a_full_context_under_the_stop_policy_shows_its_message(window):
    """A prompt longer than the context, which the stop policy may not shorten. (The engine
    reports a prefill that meets ContextFull as an EngineError, kind "engine"; a full context
    while answering is the finish reason "context_full", not an error.)"""
    panel = window.kv_panel
    ctx, overflow = panel.ctx_spin.value(), panel.overflow_box.currentIndex()
    panel.overflow_box.setCurrentIndex(panel.overflow_box.findData("stop"))
    panel.ctx_spin.setValue(64)
    try:
        failed = answer(window, "Tell me everything about the sea. " * 20, max_tokens=8)
    finally:
        panel.ctx_spin.setValue(ctx)
        panel.overflow_box.setCurrentIndex(overflow)
    assert failed["state"] == "failed" and failed["kind"] in ("context_full", "engine"), failed
    assert "the context holds 64" in failed["error"]
    assert_banner_without_traceback(window, "The answer failed", "context holds 64")
    assert window.send_button.isEnabled()
    assert answer(window, "Say hi.")["state"] == "complete"
