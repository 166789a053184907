"""The desktop's "Serve on localhost" switch: a request from the official `openai` client is
answered while the switch is on, nothing listens once it is off; in the window, the served model
follows the loaded one and the window keeps chatting while the server answers."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading  # noqa: E402

import httpx2 as httpx  # noqa: E402  (the HTTP client the openai package is built on)
import openai  # noqa: E402
import pytest  # noqa: E402
from gguf.constants import GGMLQuantizationType as QT  # noqa: E402
from PySide6.QtGui import QGuiApplication  # noqa: E402

from omlx_desktop.serve_panel import ServePanel  # noqa: E402

from .qt_wait import wait_until  # noqa: E402
from .test_serve import CHAT_TEMPLATE  # noqa: E402
from .tiny_gguf import write_tiny_model  # noqa: E402


def _models(url: str) -> list[str]:
    return [m.id for m in openai.OpenAI(base_url=url, api_key="unused", max_retries=0).models.list().data]


def test_the_switch_serves_the_model_and_stops(qapp, tmp_path):
    path = write_tiny_model(tmp_path / "tiny-chat.gguf", context_length=512, chat_template=CHAT_TEMPLATE,
                            weight_type=QT.Q8_0)
    panel = ServePanel()
    assert not panel.switch.isEnabled() and not panel.switch.isChecked()  # off, and no model yet
    panel.port.setValue(0)  # any free port
    panel.set_model(str(path))
    panel.switch.setChecked(True)
    wait_until(lambda: panel.url or panel.error, timeout=60, what="the server")
    assert panel.error is None
    url = panel.url
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    panel.copy_button.click()
    assert QGuiApplication.clipboard().text() == url
    c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    model = _models(url)[0]
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                  temperature=0)
    assert r.usage.completion_tokens == 5
    panel.switch.setChecked(False)
    wait_until(lambda: panel.url is None and panel.switch.isEnabled(), timeout=60, what="the server to stop")
    with pytest.raises(httpx.TransportError):
        httpx.get(url.removesuffix("/v1") + "/health", timeout=2)
    panel.shutdown()


@pytest.mark.slow
def test_the_window_serves_its_model_while_it_chats(qapp, tmp_path, smollm2_path):
    from omlx_desktop.window import MainWindow

    from .test_desktop_chat import ask

    window = MainWindow(data_dir=tmp_path, model=str(smollm2_path))
    try:
        window.show()
        wait_until(lambda: window.model_info is not None or window.errors, what="the model")
        assert window.model_info is not None, window.errors
        panel = window.serve_panel
        assert panel.model_path == str(smollm2_path) and not panel.switch.isChecked()
        panel.port.setValue(0)
        panel.switch.setChecked(True)
        wait_until(lambda: panel.url or panel.error, what="the server")
        assert panel.error is None
        served: list = []

        def client():
            c = openai.OpenAI(base_url=panel.url, api_key="unused", max_retries=0, timeout=300)
            served.append(c.chat.completions.create(
                model=_models(panel.url)[0], messages=[{"role": "user", "content": "What is 2+2?"}],
                max_tokens=12, temperature=0))

        t = threading.Thread(target=client)
        t.start()
        answer = ask(window, "Name a color.", 8)  # the window keeps working meanwhile
        wait_until(lambda: not t.is_alive(), what="the served answer")
        assert answer["state"] != "failed"
        assert served and served[0].choices[0].message.content.strip()
    finally:
        window.close()
    assert window.serve_panel._thread is None
