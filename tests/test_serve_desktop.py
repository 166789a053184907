"""The desktop's "Serve on localhost" switch: a request from the official `openai` client is
answered while the switch is on, nothing listens once it is off; in the window, the served model
follows the loaded one and the window keeps chatting while the server answers. The server uses
the KV panel's setting: its `/metrics` KV capacity is that setting's bytes for the server's
blocks, and a new setting restarts it on the same URL."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import threading  # noqa: E402

import httpx2 as httpx  # noqa: E402  (the HTTP client the openai package is built on)
import openai  # noqa: E402
import pytest  # noqa: E402
from gguf.constants import GGMLQuantizationType as QT  # noqa: E402
from PySide6.QtGui import QGuiApplication  # noqa: E402

from engine.kv.config import estimate_bytes, parse_kv  # noqa: E402
from omlx_desktop.serve_panel import ServePanel  # noqa: E402

from .qt_wait import wait_until  # noqa: E402
from .test_serve import CHAT_TEMPLATE  # noqa: E402
from .tiny_gguf import write_tiny_model  # noqa: E402


def _models(url: str) -> list[str]:
    return [m.id for m in openai.OpenAI(base_url=url, api_key="unused", max_retries=0).models.list().data]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} metric in {text[:300]!r}")


def _capacity_for(spec: str, panel: ServePanel) -> int:
    """The KV budget's bytes at `spec` for the running server's model and block count: every
    layer's K and V rows of max_blocks blocks, as the KV estimator computes them."""
    server = panel._thread.server
    g = server.engine.model.kv_geometry
    n_tokens = server.scheduler.budget.max_blocks * server.scheduler.budget.block_size
    layers = estimate_bytes(parse_kv(spec), g.n_layers, g.n_kv_heads, g.head_dim, n_tokens,
                            g.value_dim)["per_layer"]
    return sum(layer["k_blocks"] + layer["v_blocks"] for layer in layers)


def _ask_served(url: str, text: str = "hi", max_tokens: int = 4):
    c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    return c.chat.completions.create(model=_models(url)[0], messages=[{"role": "user", "content": text}],
                                     max_tokens=max_tokens, temperature=0)


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


def test_the_switch_serves_with_the_kv_setting_and_restarts_on_a_new_one(qapp, tmp_path):
    path = write_tiny_model(tmp_path / "tiny-chat.gguf", context_length=512, chat_template=CHAT_TEMPLATE,
                            weight_type=QT.Q8_0)
    panel = ServePanel()
    try:
        panel.port.setValue(0)
        panel.set_model(str(path))
        panel.set_kv_spec("k4v4")
        assert panel.kv_label.text() == "KV k4v4"     # what it will serve with
        panel.switch.setChecked(True)
        wait_until(lambda: panel.url or panel.error, timeout=60, what="the server")
        assert panel.error is None and panel.served_spec == "k4v4"
        url = panel.url
        assert _ask_served(url).usage.completion_tokens == 4
        k4v4_bytes = _metric(url, "omlx_kv_bytes_capacity")
        assert k4v4_bytes == _capacity_for("k4v4", panel)

        # a new setting: the panel says a restart is pending, then the server runs it on the same URL
        panel.set_kv_spec("k8v8")
        assert panel.restart_pending and "k4v4 → k8v8" in panel.kv_label.text()
        wait_until(lambda: panel.served_spec == "k8v8" and panel.url, timeout=60,
                   what="the restart on the new setting")
        assert panel.url == url and panel.kv_label.text() == "KV k8v8" and not panel.restart_pending
        assert _ask_served(url).usage.completion_tokens == 4
        k8v8_bytes = _metric(url, "omlx_kv_bytes_capacity")
        assert k8v8_bytes == _capacity_for("k8v8", panel) and k8v8_bytes > k4v4_bytes

        # a setting changed and changed back before it settled: no restart
        panel.set_kv_spec("k4v4")
        panel.set_kv_spec("k8v8")
        assert not panel.restart_pending and panel.served_spec == "k8v8"
    finally:
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


@pytest.mark.slow
def test_the_window_serves_with_the_kv_panels_setting(qapp, tmp_path, smollm2_path):
    """A user who set K4V4 in the KV panel and turns serving on gets K4V4 in the served requests;
    a later change of the panel reaches the server as it reaches the next chat message."""
    from .test_desktop_chat import ask, open_window

    windows = open_window(tmp_path, smollm2_path)
    window = next(windows)
    try:
        assert window.kv_panel.spec() != "k4v4"     # the default is another setting
        window.kv_panel.set_bits(4, 4)
        assert window.kv_panel.spec() == "k4v4"
        panel = window.serve_panel
        assert panel.kv_label.text() == "KV k4v4"
        panel.port.setValue(0)
        panel.switch.setChecked(True)
        wait_until(lambda: panel.url or panel.error, what="the server")
        assert panel.error is None and panel.served_spec == "k4v4"
        answer = _ask_served(panel.url, "What is 2+2?", 6)
        assert answer.choices[0].message.content.strip()
        assert _metric(panel.url, "omlx_kv_bytes_capacity") == _capacity_for("k4v4", panel)
        assert _metric(panel.url, "omlx_kv_bytes_in_use") > 0   # the answer's blocks, kept as a prefix

        window.kv_panel.set_bits(8, 8)
        assert ask(window, "Name a color.", 4)["stats"]["kv_spec"] == "k8v8"   # the chat's next turn
        wait_until(lambda: panel.served_spec == "k8v8" and panel.url, what="the server on the new setting")
        assert _ask_served(panel.url).usage.completion_tokens == 4
        assert _metric(panel.url, "omlx_kv_bytes_capacity") == _capacity_for("k8v8", panel)
    finally:
        window.close()
    assert window.closed and window.serve_panel._thread is None


def test_the_switch_serves_with_the_draft_model_and_restarts_on_a_new_one(qapp, tmp_path):
    """The chat's draft model (set_draft) reaches the server: the tiny model drafting for itself
    has every drafted token accepted; no draft model restarts it without drafts; one that cannot
    draft (another vocabulary) leaves the server answering without drafts, and the panel says why."""
    path = write_tiny_model(tmp_path / "tiny-chat.gguf", context_length=512, chat_template=CHAT_TEMPLATE,
                            weight_type=QT.Q8_0)
    foreign = write_tiny_model(tmp_path / "tiny-foreign.gguf", context_length=512, chat_template=CHAT_TEMPLATE,
                               weight_type=QT.Q8_0, seed=3, extra_tokens=("Ġcat",))
    panel = ServePanel()
    try:
        panel.port.setValue(0)
        panel.set_model(str(path))
        panel.set_draft(str(path))
        assert panel.draft_label.text() == "draft tiny-chat.gguf"     # what it will serve with
        panel.switch.setChecked(True)
        wait_until(lambda: panel.url or panel.error, timeout=60, what="the server")
        assert panel.error is None and panel.served_draft == str(path) and panel.draft_error is None
        url = panel.url
        plain = _ask_served(url, "the cat sat", 24)
        drafted = _metric(url, "omlx_drafted_tokens_total")
        assert drafted > 0 and _metric(url, "omlx_accepted_tokens_total") == drafted
        assert _metric(url, "omlx_draft_kv_bytes_capacity") > 0
        assert plain.usage.completion_tokens_details.accepted_prediction_tokens > 0

        panel.set_draft("")                          # Chat → Draft model → None
        assert panel.restart_pending and "draft tiny-chat.gguf → none" in panel.draft_label.text()
        wait_until(lambda: panel.served_draft == "" and panel.url, timeout=60, what="the restart without a draft")
        assert panel.url == url and panel.draft_label.text() == "" and panel.kv_label.text().startswith("KV ")
        again = _ask_served(url, "the cat sat", 24)
        assert again.choices[0].message.content == plain.choices[0].message.content
        assert _metric(url, "omlx_drafted_tokens_total") == 0 and _metric(url, "omlx_draft_kv_bytes_capacity") == 0

        panel.set_draft(str(foreign))
        wait_until(lambda: panel.draft_error and panel.url, timeout=60, what="the restart with a foreign draft")
        assert "vocabulary" in panel.draft_label.text() and panel.draft_label.text().startswith("not drafting: ")
        assert _ask_served(url, "the cat sat", 24).choices[0].message.content == plain.choices[0].message.content
        assert _metric(url, "omlx_drafted_tokens_total") == 0
    finally:
        panel.shutdown()
