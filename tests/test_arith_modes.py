"""The arithmetic modes (weights.ARITH_MODES) through every door: `--arith` on the engine
commands (`generate --json` and `info --json` say which ran, `eval-kv --arith fast` measures its
cost against exact arithmetic), `omlx serve --arith fast` (through main() in this process, and
as a real process in the whole suite; the `openai` client),
and a misspelled mode's error naming the closest. The window's setting: tests/test_desktop_arith.py.
The kernels themselves: tests/test_int_kernels.py; the engine's switch: tests/test_weight_arith.py."""

from __future__ import annotations

import json
import logging

import pytest

from engine import weights

from .serve_process import ServeProcess
from .test_entry_points import run_cli

pytestmark = pytest.mark.usefixtures("no_arith_env")


@pytest.fixture
def no_arith_env(monkeypatch):
    monkeypatch.delenv(weights.ARITH_ENV, raising=False)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from pathlib import Path

    path = tmp_path_factory.mktemp("arith") / "gpl.txt"
    path.write_text((Path(__file__).resolve().parents[1] / "resources" / "bench" / "gpl-3.txt").read_text()[:6000])
    return path


@pytest.mark.parametrize("mode", ["exact", "fast", "float"])
def test_generate_and_info_run_and_name_the_mode(capsys, smollm2_path, mode):
    code, out, err = run_cli(capsys, "generate", str(smollm2_path), "--prompt", "The capital of France is",
                             "--max-tokens", "4", "--json", "--arith", mode)
    assert code == 0, err
    result = json.loads(out)
    assert result["stats"]["arith"] == mode and len(result["ids"]) == 4
    code, out, err = run_cli(capsys, "info", str(smollm2_path), "--json", "--arith", mode)
    assert code == 0, err
    kernels = json.loads(out)["weight_kernels"]
    assert kernels["arith"] == mode
    assert ("int8 activations" in kernels["kernels"]) == (mode == "fast")
    assert weights.ARITH_ENV not in __import__("os").environ  # restored after the command


def test_eval_kv_measures_fast_mode_against_exact(capsys, smollm2_path, text_file):
    code, out, err = run_cli(capsys, "eval-kv", str(smollm2_path), "--text-file", str(text_file),
                             "--n-tokens", "256", "--kv", "k6v4", "--arith", "fast", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["spec"] for r in rows] == ["full", "k6v4"] and {r["arith"] for r in rows} == {"fast"}
    assert 1e-4 < rows[0]["mean_kl"] < 0.01  # the arithmetic's own cost: llama.cpp's order
    code, out, err = run_cli(capsys, "eval-kv", str(smollm2_path), "--text-file", str(text_file),
                             "--n-tokens", "32", "--kv", "full", "--json")
    assert code == 0, err
    assert json.loads(out)[0]["mean_kl"] == 0.0 and json.loads(out)[0]["arith"] == "exact"


def test_a_misspelled_mode_names_the_closest(capsys, smollm2_path):
    code, out, err = run_cli(capsys, "generate", str(smollm2_path), "--prompt", "hi", "--arith", "fsat")
    assert code == 2 and "did you mean 'fast'" in err


def test_serve_in_fast_mode_in_process(smollm2_path, monkeypatch, caplog):
    """`omlx serve --arith fast` through main(), uvicorn's blocking run swapped for a background
    thread: a real request answered by the fast engine. The real process: the slow test below."""
    import openai

    from engine import cli, serve
    from engine.serve import ServerThread

    servers = []
    monkeypatch.setattr(serve, "run", lambda server, log_level: servers.append(server))
    with caplog.at_level(logging.INFO):
        assert cli.main(["serve", str(smollm2_path), "--port", "0", "--ctx", "512", "--max-batch", "2",
                         "--arith", "fast"]) == 0
    assert "weight arithmetic: fast" in caplog.text
    thread = ServerThread(servers[0]).start()
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=smollm2_path.stem, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert r.usage.completion_tokens == 4
    finally:
        thread.stop()
    assert servers[0].engine.arith == "fast"


@pytest.mark.slow  # starts a process
def test_serve_in_fast_mode(smollm2_path):
    import openai

    with ServeProcess(smollm2_path, "--ctx", "512", "--max-batch", "2", "--arith", "fast") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=smollm2_path.stem, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert r.usage.completion_tokens == 4
    assert server.returncode == 0, server.stderr
    assert "weight arithmetic: fast" in server.stderr
