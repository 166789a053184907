"""The remote source: chatting through an OpenAI-compatible server. The server is a real
``omlx serve`` (engine.serve on 127.0.0.1, started by the test as the stand-in for a remote
vLLM / llama.cpp / Ollama server); the client is the app's RemoteSession and, in the window, the
File → Connect to a server… dialog."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import socket  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402
from gguf.constants import GGMLQuantizationType as QT  # noqa: E402

from engine.engine import Engine  # noqa: E402
from engine.errors import EngineError, SettingsError  # noqa: E402
from engine.remote import RemoteEndpoint, RemoteSession, normalize_base_url  # noqa: E402
from engine.serve import OpenAIServer, ServeConfig, ServeLimits, ServerThread  # noqa: E402

from .qt_wait import wait_until  # noqa: E402
from .test_serve import CHAT_TEMPLATE  # noqa: E402
from .tiny_gguf import write_tiny_model  # noqa: E402

KEY = "s3cret-key"


def serve(path, *, api_key=None, model_id="remote-model", port=0) -> ServerThread:
    engine = Engine.load(path, kv="full")
    engine.disk_cache = False
    server = OpenAIServer(engine, ServeLimits(ctx=min(512, engine.model.context_length), max_batch=2),
                          ServeConfig(port=port, api_key=api_key, model_id=model_id))
    return ServerThread(server).start()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("remote") / "tiny-chat.gguf", context_length=512,
                            chat_template=CHAT_TEMPLATE, weight_type=QT.Q8_0, seed=5)
    thread = serve(path, api_key=KEY)
    yield thread
    thread.stop()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_addresses_are_normalized():
    assert normalize_base_url("127.0.0.1:8080") == "http://127.0.0.1:8080/v1"
    assert normalize_base_url("http://box:1234/") == "http://box:1234/v1"
    assert normalize_base_url("https://api.example.com/v1/") == "https://api.example.com/v1"
    assert normalize_base_url(" http://h/proxy/v1 ") == "http://h/proxy/v1"
    for bad in ("", "   ", "ftp://host/v1", "http://"):
        with pytest.raises(SettingsError):
            normalize_base_url(bad)


def test_an_unreachable_server_is_a_clear_error():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    with pytest.raises(EngineError, match=f"cannot reach {url}: is the server running"):
        RemoteEndpoint(url).list_models()


def test_a_wrong_key_and_an_unknown_model_are_named(tiny_server):
    url = tiny_server.url + "/v1"
    with pytest.raises(EngineError, match="refused the API key"):
        RemoteEndpoint(url, "wrong").list_models()
    with pytest.raises(EngineError, match="has no model 'nope'; it serves: remote-model"):
        RemoteEndpoint(url, KEY).connect("nope")


def test_a_conversation_through_the_server(tiny_server):
    endpoint = RemoteEndpoint(tiny_server.url, KEY).connect()
    assert endpoint.model == "remote-model" and endpoint.list_models() == ["remote-model"]
    session = RemoteSession(endpoint, system_prompt="You are brief.")
    doc = session.add_document(text="The north gate code is 4471.\n" * 3, name="gate.txt")
    assert doc.pinned and doc.n_tokens > 0

    gen = session.send("What is the code?", max_tokens=6)
    pieces = [c.text for c in gen]
    result = gen.result
    assert result.finish_reason == "length" and result.text == "".join(pieces) and result.text
    assert result.stats.generated_tokens == 6 and result.stats.prompt_tokens > 0
    assert session.messages[-1] == {"role": "assistant", "content": result.text}

    # the next turn resends the conversation: the server's prefix cache answers part of it
    second = session.send("And again?", max_tokens=4).result
    assert second.stats.cached_tokens > 0 and second.stats.cache_source == "remote"
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]

    regenerated = session.regenerate(max_tokens=4).result
    assert regenerated.text == second.text          # greedy: the same answer again
    assert len(session.messages) == 4


def test_stopping_a_remote_answer_keeps_what_arrived(tiny_server):
    session = RemoteSession(RemoteEndpoint(tiny_server.url, KEY).connect())
    cancel = threading.Event()
    gen = session.send("Tell me a long story.", max_tokens=200, cancel=cancel)
    got = []
    for chunk in gen:
        got.append(chunk.text)
        if len(got) == 3:
            cancel.set()
    result = gen.result
    assert result.finish_reason == "cancelled" and result.text == "".join(got)
    assert session.messages[-1].get("interrupted")
    wait_until(lambda: _running(tiny_server) == 0, timeout=30, what="the server to drop the sequence")


def _running(thread: ServerThread) -> int:
    import httpx2 as httpx

    text = httpx.get(thread.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    for line in text.splitlines():
        if line.startswith("omlx_running_sequences "):
            return int(float(line.split()[-1]))
    raise AssertionError(f"no omlx_running_sequences metric in {text[:200]!r}")


@pytest.mark.slow
def test_the_window_chats_through_a_remote_omlx_serve(qapp, tmp_path, smollm2_path):
    """The window's remote source against `omlx serve` on SmolLM2: connect from the dialog, chat,
    the KV panel is disabled with its note, and opening a local model brings it back."""
    from omlx_desktop.window import MainWindow

    from .test_desktop_chat import ask

    server = serve(smollm2_path, api_key=KEY, model_id="smollm2")
    window = MainWindow(data_dir=tmp_path / "data", model=str(smollm2_path))
    try:
        window.show()
        wait_until(lambda: window.model_info is not None, timeout=300, what="the local model")
        dialog = window.open_remote_dialog()
        dialog.url_edit.setText(server.url)          # without /v1: the dialog adds it
        dialog.key_edit.setText("wrong")
        dialog.list_button.click()
        wait_until(lambda: not dialog._busy, timeout=60, what="the model list")
        assert "refused the API key" in dialog.status.text() and dialog.model_box.count() == 0
        dialog.key_edit.setText(KEY)
        dialog.list_button.click()
        wait_until(lambda: dialog.model_box.count() == 1 and not dialog._busy, timeout=60,
                   what="the model list")
        assert dialog.model_box.currentText() == "smollm2"
        dialog.connect_button.click()
        wait_until(lambda: window.model_info.get("remote"), timeout=60, what="the connection")
        assert not dialog.isVisible()
        assert window.model_info["name"].startswith("smollm2 @ 127.0.0.1:")
        assert not window.kv_panel.isEnabled() and window.kv_remote_note.isVisibleTo(window)
        assert not window.serve_panel.switch.isEnabled()   # a remote model is not served from here

        first = ask(window, "What is the capital of France?", 8, enter=False)   # the Send button
        assert first["state"] == "complete" and first["text"].strip()
        assert first["stats"]["kv_spec"] == "remote" and 0 < first["stats"]["generated_tokens"] <= 8
        # the same question through the openai client directly: greedy, the same text
        import openai

        direct = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8, temperature=0)
        assert direct.choices[0].message.content == first["text"]
        second = ask(window, "And of Italy?", 6)
        assert second["stats"]["cached_tokens"] > 0      # the server's prefix cache
        assert "server cache: " in window.stats_label.text().replace("\xa0", " ")

        window.load_model(str(smollm2_path))             # back to the local model
        wait_until(lambda: window.model_info and not window.model_info.get("remote")
                   and window.models.ready, timeout=300, what="the local model again")
        assert window.kv_panel.isEnabled() and not window.kv_remote_note.isVisibleTo(window)
        local = ask(window, "Hello", 4)
        assert local["stats"]["kv_spec"] != "remote"
    finally:
        window.close()
        window.wait_for_engine()
        server.stop()


def _connect_from_dialog(window, url: str, key: str | None = None) -> None:
    dialog = window.open_remote_dialog()
    dialog.url_edit.setText(url)
    dialog.key_edit.setText(key or "")
    dialog.list_button.click()
    wait_until(lambda: dialog.model_box.count() > 0 and not dialog._busy, timeout=60, what="the model list")
    dialog.connect_button.click()
    wait_until(lambda: window.model_info.get("remote"), timeout=60, what="the connection")


def _closed(window) -> None:
    window.close()
    window.wait_for_engine()


@pytest.mark.slow
def test_the_window_comes_back_on_its_remote_server(qapp, tmp_path, smollm2_path):
    """A user who chatted through a server finds the app on it after a restart; when the server
    is down at start, the app falls back to the local model with a message, keeps the server
    saved, and the dialog (filled in) reconnects once it is back."""
    from omlx_desktop.window import MainWindow

    from .test_desktop_chat import ask

    data = tmp_path / "data"
    server = serve(smollm2_path, model_id="smollm2")
    port = server.port
    try:
        first = MainWindow(data_dir=data, model=str(smollm2_path))
        try:
            wait_until(lambda: first.model_info is not None, timeout=300, what="the local model")
            _connect_from_dialog(first, server.url)
            name = first.model_info["name"]
        finally:
            _closed(first)

        # a restart: the app connects to the saved server by itself and answers through it
        second = MainWindow(data_dir=data)
        try:
            second.show()
            wait_until(lambda: second.model_info is not None or second.errors, timeout=120,
                       what="the saved server")
            assert second.model_info is not None and second.model_info["remote"], second.errors
            assert second.model_info["name"] == name and second.model_info["path"] == server.url + "/v1"
            assert not second.kv_panel.isEnabled()
            answer = ask(second, "What is the capital of France?", 6)
            assert answer["state"] == "complete" and answer["text"].strip()
            assert answer["stats"]["kv_spec"] == "remote"
            saved = second.store.get_setting("remote_endpoint")
        finally:
            _closed(second)
        assert saved == {"url": server.url + "/v1", "model": "smollm2", "key_needed": False}
    finally:
        server.stop()

    # the server is down at the next start: the local model, a message, the server still saved
    third = MainWindow(data_dir=data)
    restarted = None
    try:
        third.show()
        wait_until(lambda: third.model_info is not None, timeout=300, what="the local fallback")
        assert not third.model_info["remote"] and third.model_info["path"] == str(smollm2_path)
        assert any("Cannot connect to the saved server" in e and "cannot reach" in e for e in third.errors), \
            third.errors
        assert third.banner.isVisible() and "The server stays saved" in third.banner.text()
        assert third.store.get_setting("remote_endpoint") == saved
        assert third.models.restores_remote          # the next start tries the server again
        assert ask(third, "Hello", 4)["stats"]["kv_spec"] != "remote"
        assert third.banner.isVisible()              # a local success does not hide it

        # the server is back: the dialog comes filled in, Connect reconnects
        restarted = serve(smollm2_path, model_id="smollm2", port=port)
        dialog = third.open_remote_dialog()
        assert dialog.url_edit.text() == saved["url"] and dialog.model_box.currentText() == "smollm2"
        assert dialog.connect_button.isEnabled()
        dialog.connect_button.click()
        wait_until(lambda: third.model_info.get("remote"), timeout=60, what="the reconnection")
        assert not third.banner.isVisible()
        assert ask(third, "And of Italy?", 4)["text"].strip()

        # choosing a local model again: the next start comes back on it
        third.load_model(str(smollm2_path))
        wait_until(lambda: not third.model_info.get("remote") and third.models.ready, timeout=300,
                   what="the local model")
        assert not third.models.restores_remote
        assert third.store.get_setting("remote_endpoint") == saved    # still offered in the dialog
    finally:
        _closed(third)
        if restarted is not None:
            restarted.stop()


@pytest.mark.slow
def test_a_server_key_is_asked_for_again_not_saved(qapp, tmp_path, smollm2_path):
    """The API key is never written to disk: after a restart the dialog opens filled in with the
    server and model, says the key is not saved, and connects once it is typed again."""
    from omlx_desktop.window import MainWindow

    from .test_desktop_chat import ask

    data = tmp_path / "data"
    server = serve(smollm2_path, api_key=KEY, model_id="smollm2")
    try:
        first = MainWindow(data_dir=data, model=str(smollm2_path))
        try:
            wait_until(lambda: first.model_info is not None, timeout=300, what="the local model")
            _connect_from_dialog(first, server.url, KEY)
            assert ask(first, "Hi", 3)["state"] == "complete"
        finally:
            _closed(first)
        files = [p for p in data.rglob("*") if p.is_file()]
        assert files and not any(KEY.encode() in p.read_bytes() for p in files)

        second = MainWindow(data_dir=data)
        try:
            second.show()
            wait_until(lambda: second.model_info is not None, timeout=300, what="the local model")
            assert not second.model_info["remote"]
            dialog = second.remote_dialog
            assert dialog is not None and dialog.isVisible()
            assert dialog.url_edit.text() == server.url + "/v1" and dialog.model_box.currentText() == "smollm2"
            assert dialog.key_edit.text() == "" and "not saved on disk" in dialog.status.text()
            assert second.models.restores_remote
            dialog.key_edit.setText(KEY)
            dialog.connect_button.click()
            wait_until(lambda: second.model_info.get("remote"), timeout=60, what="the connection")
            assert ask(second, "What is the capital of France?", 5)["text"].strip()
        finally:
            _closed(second)
        files = [p for p in data.rglob("*") if p.is_file()]
        assert not any(KEY.encode() in p.read_bytes() for p in files)
    finally:
        server.stop()
