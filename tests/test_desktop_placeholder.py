"""`omlx-desktop` (the placeholder window until the desktop issue): it loads the model in a worker
thread and answers a prompt while the UI thread stays free."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from omlx_desktop.app import MainWindow  # noqa: E402


def test_window_loads_model_and_answers(qtbot, smollm2_path):
    window = MainWindow(str(smollm2_path))
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: "ready" in window.status.text(), timeout=120_000)
    window.input.setText("What is the capital of France?")
    with qtbot.waitSignal(window.worker.finished, timeout=120_000):
        window.send.click()
    assert "Paris" in window.transcript.toPlainText()
    assert "tok/s" in window.status.text()
    window.close()


def test_window_reports_a_bad_file(qtbot, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    window = MainWindow(str(bad))
    qtbot.addWidget(window)
    qtbot.waitUntil(lambda: window.status.text().startswith("error:"), timeout=30_000)
    assert "bad.gguf" in window.status.text() and "too small" in window.status.text()
    window.close()
