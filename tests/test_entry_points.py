"""Every architecture through every door that loads a model, and every error of the family through
every door that can meet it.

The matrix is architectures × entry points. Architectures come from `supported_architectures()`
(the modules of engine/models), so a module added later joins the matrix by itself: it needs a
tiny builder in TINY_FILES below, and the matrix fails naming it until it has one. Entry points:
`omlx info`, `info --ctx --kv`, `tokenize`, `generate --json`, `logprobs`, `ask --json`,
`eval-kv`, `kv-tune`, `omlx serve` (a real process and the `openai` client) and the window's load
(a real window, offscreen: the model header shows, one message is answered).

CLI commands run in-process through `engine.cli.main` (the process' own entry: an exception that
escapes it fails the test, and what it prints is checked for a traceback); the server runs as a
real `omlx serve` process. Tiny random-weight files keep all of it in the fast subset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from engine import cli  # noqa: E402
from engine.gguf_file import GGUFFile  # noqa: E402
from engine.models import supported_architectures  # noqa: E402

from .serve_process import ServeProcess  # noqa: E402
from .tiny_gguf import write_tiny_model  # noqa: E402
from .tiny_variants import write_variant  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# A context that leaves room for a question and its answer beside a small pinned document.
TINY = dict(chat_template=CHATML, context_length=1024)
# name → (architecture the file declares, builder). Add a builder here for a new architecture.
TINY_FILES = {
    "llama": ("llama", lambda p: write_variant(p, "llama", **TINY)),
    "llama-rope_freqs": ("llama", lambda p: write_variant(p, "llama3rope", **TINY)),
    "qwen2": ("qwen2", lambda p: write_variant(p, "qwen2", **TINY)),
    "qwen3": ("qwen3", lambda p: write_variant(p, "qwen3", **TINY)),
    "gemma3": ("gemma3", lambda p: write_tiny_model(p, "gemma3", **TINY)),
}
_COVERED = {arch for arch, _ in TINY_FILES.values()}
MATRIX = list(TINY_FILES) + [arch for arch in supported_architectures() if arch not in _COVERED]

TEXT = ("The cat sat on the mat. The dog sat on the log. " * 12).strip()


@pytest.fixture(scope="module", params=MATRIX)
def tiny(request, tmp_path_factory) -> Path:
    name = request.param
    if name not in TINY_FILES:
        pytest.fail(f"architecture {name!r} (engine/models/{name}.py) has no tiny builder: add one to "
                    "TINY_FILES in tests/test_entry_points.py so every entry point is tried on it")
    arch, build = TINY_FILES[name]
    path = build(tmp_path_factory.mktemp(name.replace("_", "-")) / f"tiny-{name}.gguf")
    assert GGUFFile(path).architecture == arch
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT + "\n")
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`omlx ARGV` in this process: (exit code, stdout, stderr). An exception escaping main fails
    the test by itself; argparse's own exit (bad arguments) comes back as its code."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return code, out, err


# -- every architecture through every entry point --------------------------------------------
def test_info(capsys, tiny):
    code, out, err = run_cli(capsys, "info", str(tiny))
    assert code == 0, err
    assert f"architecture   {GGUFFile(tiny).architecture}," in out
    code, out, err = run_cli(capsys, "info", str(tiny), "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == GGUFFile(tiny).architecture


def test_info_with_ctx_and_kv(capsys, tiny):
    code, out, err = run_cli(capsys, "info", str(tiny), "--ctx", "128", "--kv", "k4v4")
    assert code == 0, err
    assert "k4v4" in out and "128 tokens" in out


def test_tokenize(capsys, tiny):
    code, out, err = run_cli(capsys, "tokenize", str(tiny), "the cat")
    assert code == 0, err
    ids = json.loads(out)
    assert ids and all(isinstance(i, int) for i in ids)


def test_generate_json(capsys, tiny):
    code, out, err = run_cli(capsys, "generate", str(tiny), "--prompt", "Hi", "--max-tokens", "4", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert len(result["ids"]) == 4 and result["stats"]["prompt_tokens"] > 0


def test_logprobs(capsys, tiny, text_file, tmp_path):
    out_path = tmp_path / "lp.npz"
    code, out, err = run_cli(capsys, "logprobs", str(tiny), "--text-file", str(text_file), "--n-tokens", "24",
                             "--out", str(out_path))
    assert code == 0, err
    with np.load(out_path) as data:
        assert all(np.isfinite(data[k]).all() for k in data.files if data[k].dtype.kind == "f")


def test_ask_json(capsys, tiny, tmp_path):
    doc = tmp_path / "note.md"
    doc.write_text("The cat sat on the mat.\n")  # pinned whole: the tiny context holds it
    code, out, err = run_cli(capsys, "ask", str(tiny), "--doc", str(doc), "--question", "Who sat?",
                             "--max-tokens", "3", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert len(result["answers"]) == 1 and result["answers"][0]["stats"]["prompt_tokens"] > 0


def test_eval_kv(capsys, tiny, text_file):
    code, out, err = run_cli(capsys, "eval-kv", str(tiny), "--text-file", str(text_file), "--n-tokens", "48",
                             "--kv", "k4v4", "--json")
    assert code == 0, err
    assert "k4v4" in out


def test_kv_tune(capsys, tiny, text_file):
    code, out, err = run_cli(capsys, "kv-tune", str(tiny), "--bits-per-value", "5", "--text-file",
                             str(text_file), "--n-tokens", "40", "--no-verify", "--json")
    assert code == 0, err
    assert json.loads(out)["spec"]


def test_serve_answers_a_chat_request(tiny):
    import openai

    with ServeProcess(tiny, "--ctx", "512", "--max-batch", "2") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=tiny.stem, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    assert server.returncode == 0, server.stderr
    assert "Traceback" not in server.stderr, server.stderr


def test_window_loads_and_answers(qapp, tiny, tmp_path):
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    from omlx_desktop.window import MainWindow

    from .qt_wait import wait_until

    w = MainWindow(data_dir=tmp_path / "data", model=str(tiny))
    try:
        w.show()
        wait_until(lambda: w.model_info is not None or w.errors, what="the model")
        assert w.model_info is not None, w.errors
        assert w.model_info["name"] in w.model_summary()
        answers: list[dict] = []
        w.answerFinished.connect(answers.append)
        w.max_tokens_spin.setValue(3)
        w.input.setPlainText("hi")
        QTest.keyClick(w.input, Qt.Key.Key_Return)
        wait_until(lambda: answers, timeout=120, what="the answer")
        assert answers[0]["state"] != "failed", answers[0].get("error")
        assert answers[0]["stats"]["generated_tokens"] == 3
    finally:
        w.close()


# -- every error of the family through the CLI -----------------------------------------------
# The commands that load a model, each with the arguments it needs beside the model.
def _loading_commands(text: Path, out: Path) -> dict[str, list[str]]:
    return {
        "info": [],
        "tokenize": ["hi"],
        "generate": ["--prompt", "hi", "--max-tokens", "2"],
        "logprobs": ["--text-file", str(text), "--n-tokens", "8", "--out", str(out)],
        "ask": ["--question", "hi", "--max-tokens", "2"],
        "eval-kv": ["--text-file", str(text), "--n-tokens", "16", "--kv", "k4v4"],
        "kv-tune": ["--bits-per-value", "5", "--text-file", str(text), "--n-tokens", "16", "--no-verify"],
        "chat": ["--max-tokens", "2"],
        "bench": ["--out", str(out.parent / "bench"), "--kv", "k4v4"],
        "serve": ["--port", "0"],  # refused before it would listen
    }


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Model files a user may hand us, each with the words its error must contain."""
    folder = tmp_path_factory.mktemp("bad-models")
    good = write_variant(folder / "good.gguf", "qwen2", **TINY)
    foreign = folder / "notes.gguf"
    foreign.write_text("plain text that is long enough to have a header, but no GGUF\n" * 8)
    cut = folder / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    mamba = folder / "mamba.gguf"
    mamba.write_bytes(good.read_bytes().replace(b"qwen2", b"mamba"))
    return {
        "foreign": (foreign, "not a GGUF file"),
        "truncated": (cut, "truncated"),
        "unsupported": (mamba, "architecture 'mamba' is not supported"),
        "missing": (folder / "absent.gguf", "absent.gguf"),
    }


@pytest.mark.parametrize("case", ["foreign", "truncated", "unsupported", "missing"])
def test_bad_model_files_get_their_message_from_every_command(capsys, bad_models, text_file, tmp_path, case):
    path, words = bad_models[case]
    for command, extra in _loading_commands(text_file, tmp_path / "o.npz").items():
        if case == "unsupported" and command == "tokenize":
            continue  # the vocabulary is all tokenize reads: a well-formed file of any architecture has one
        code, out, err = run_cli(capsys, command, str(path), *extra)
        assert code == 2, (command, err)
        assert err.startswith("omlx: error: ") and words in err, (command, err)


@pytest.fixture(scope="module")
def bad_documents(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    folder = tmp_path_factory.mktemp("bad-docs")
    binary = folder / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 8)
    latin1 = folder / "latin1.txt"
    latin1.write_bytes("Caf\u00e9 cr\u00e8me, \u00e0 la fran\u00e7aise.\n".encode("latin-1") * 4)
    empty = folder / "empty.md"
    empty.write_text("   \n\n")
    return {"binary": (binary, "looks like a binary file"), "latin-1": (latin1, "is not UTF-8 text"),
            "empty": (empty, "is empty"), "missing": (folder / "gone.txt", "gone.txt")}


@pytest.mark.parametrize("case", ["binary", "latin-1", "empty", "missing"])
def test_bad_documents_get_their_message_from_ask(capsys, tiny, bad_documents, case):
    path, words = bad_documents[case]
    code, out, err = run_cli(capsys, "ask", str(tiny), "--doc", str(path), "--question", "hi", "--max-tokens", "2")
    assert code == 2, err
    assert err.startswith("omlx: error: ") and words in err, err


@pytest.mark.parametrize("argv, words", [
    (["--kv", "balanced-ish"], "balanced"),       # a misspelled preset: the closest name is offered
    (["--kv", "k5v9"], "v9"),                     # a width the formats do not have
    (["--kv", "k4v4,0-99:k8v8"], "layer"),        # an override past the model's layers
])
def test_bad_settings_get_their_message(capsys, tiny, argv, words):
    code, out, err = run_cli(capsys, "generate", str(tiny), "--prompt", "hi", "--max-tokens", "2", *argv)
    assert code == 2, err
    assert words in err and "error" in err, err


def test_a_full_context_is_said_not_raised(capsys, tiny):
    code, out, err = run_cli(capsys, "ask", str(tiny), "--question", "the cat " * 200, "--ctx", "512",
                             "--overflow", "stop", "--max-tokens", "2")
    assert code == 2, err
    assert err.startswith("omlx: error: ") and "context" in err, err


def test_a_bug_is_one_line_without_traceback_and_exit_1(capsys, tiny, monkeypatch):
    from engine import models

    def broken(gguf):
        raise AttributeError("module 'engine.models.x' has no attribute 'ModelArgs'")

    monkeypatch.setattr(models, "model_args", broken)
    monkeypatch.setattr(cli, "model_args", broken, raising=False)
    code, out, err = run_cli(capsys, "info", str(tiny))
    assert code == 1
    assert err.startswith("omlx: internal error") and "has no attribute 'ModelArgs'" in err, err


def test_a_real_process_prints_no_traceback_for_a_bad_document(tmp_path, bad_documents):
    """The same contract end to end, as a user's shell sees it (one process, not the matrix)."""
    path = write_variant(tmp_path / "m.gguf", "qwen3", **TINY)
    doc, words = bad_documents["binary"]
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "ask", str(path), "--doc", str(doc),
                           "--question", "hi"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


# -- the server: an unexpected error is a 500 object, the next request is answered ------------
def test_serve_turns_an_unexpected_error_into_a_500_and_keeps_serving(tmp_path):
    import httpx2 as httpx  # the HTTP client the openai package is built on
    import openai

    from engine.engine import Engine
    from engine.serve import OpenAIServer, ServeConfig, ServeLimits
    from engine.serve.app import ServerThread

    path = write_variant(tmp_path / "m.gguf", "qwen2", **TINY)
    engine = Engine.load(path, kv="full")
    server = OpenAIServer(engine, ServeLimits(ctx=512, max_batch=2), ServeConfig(port=0))
    thread = ServerThread(server).start()
    try:
        real = server.scheduler.budget.fits
        calls = {"n": 0}

        def failing_once(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyError("injected")
            return real(*args, **kwargs)

        server.scheduler.budget.fits = failing_once
        r = httpx.post(thread.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal" and "injected" in error["message"]
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2)
        assert answer.usage.completion_tokens == 2
    finally:
        thread.stop()
