"""`omlx serve`'s saved prefixes: a request's system turn saved to the cache folder off the engine
thread, found again by a new server on the same folder (cached_tokens > 0), damaged files and
partial saves left behind skipped, a full disk logged while serving goes on.

The fast tests drive servers in this process on a tiny random model; the one that SIGKILLs a real
`omlx serve` process on SmolLM2 and restarts it is at the end.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from engine.engine import Engine
from engine.kv import prefix as prefix_module
from engine.serve import OpenAIServer, ServeConfig, ServeLimits, ServerThread

from .test_serve import CHAT_TEMPLATE, TINY_CTX, metric
from .tiny_gguf import write_tiny_model

from gguf.constants import GGMLQuantizationType as QT

SYSTEM = "You answer questions about cats. " + "The cat sat on the mat. " * 3
OTHER_SYSTEM = "Dogs only. " + "A dog ran after a ball. " * 3


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve-disk") / "tiny-chat.gguf", context_length=TINY_CTX,
                            chat_template=CHAT_TEMPLATE, weight_type=QT.Q8_0, seed=3)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def start(path, **limits) -> ServerThread:
    engine = Engine.load(path, kv="k8v8")  # disk_cache on, as `omlx serve` runs
    limits.setdefault("ctx", TINY_CTX)
    server = OpenAIServer(engine, ServeLimits(max_batch=2, **limits), ServeConfig(port=0, model_id="m"))
    return ServerThread(server).start()


def ask(thread, system, question, max_tokens=8):
    c = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return c.chat.completions.create(model="m", max_tokens=max_tokens, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])


def saved(folder: Path) -> list[Path]:
    return sorted((folder / "prefixes").glob("*.kvprefix"))


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_new_server_serves_the_system_prompt_saved_by_the_last_one(tiny_path, cache_dir, caplog):
    thread = start(tiny_path)
    try:
        first = ask(thread, SYSTEM, "Where did the cat sit?")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        wait_for(lambda: len(saved(cache_dir)) == 1)
        cat_file = saved(cache_dir)[0]
        assert ask(thread, OTHER_SYSTEM, "What did the dog chase?").usage.prompt_tokens_details.cached_tokens == 0
        wait_for(lambda: len(saved(cache_dir)) == 2)
        dog_file = next(p for p in saved(cache_dir) if p != cat_file)
        # the same system prompt again: from memory, and nothing written again
        again = ask(thread, SYSTEM, "Was the door open?")
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert thread.server.scheduler.saver.saved == 2
        # no system message: nothing to save
        c = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
        c.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": SYSTEM}])
        time.sleep(0.3)
        assert len(saved(cache_dir)) == 2
    finally:
        thread.stop()
    # what a crash can leave: a damaged file (truncated), another process's partial save
    dog_file.write_bytes(dog_file.read_bytes()[: dog_file.stat().st_size // 2])
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stray = cat_file.with_name(f"{'ab' * 32}.kvprefix.{gone}.0.tmp")
    stray.write_bytes(cat_file.read_bytes()[:1000])
    (cache_dir / "prefixes" / "notes.txt").write_text("not ours")

    thread = start(tiny_path)
    try:
        with caplog.at_level(logging.INFO, logger="omlx.kv.prefix"):
            wait_for(lambda: not stray.exists())  # swept when the server starts
            r = ask(thread, SYSTEM, "What color was the mat?")
            n_system = len(thread.server.engine.encode_chat([{"role": "system", "content": SYSTEM}],
                                                            add_generation_prompt=False))
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert n_system - 16 < cached <= n_system  # the system turn's full blocks, from disk
            assert r.choices[0].finish_reason in ("stop", "length")
            d = ask(thread, OTHER_SYSTEM, "Was the ball red?")
            assert d.usage.prompt_tokens_details.cached_tokens == 0 and d.choices[0].finish_reason
        assert metric(thread, "omlx_disk_cached_prompt_tokens_total") == cached
        assert "loaded" in caplog.text and "ignoring cached prefix" in caplog.text and "truncated" in caplog.text
        wait_for(lambda: dog_file.exists())  # saved again, whole
        thread.server.scheduler.saver.wait_idle(30)
    finally:
        thread.stop()
    assert (cache_dir / "prefixes" / "notes.txt").exists()  # not ours: left alone
    assert not list((cache_dir / "prefixes").glob("*.tmp"))

    thread = start(tiny_path)  # the file written by the second server reads back too
    try:
        assert ask(thread, OTHER_SYSTEM, "Where was the park?").usage.prompt_tokens_details.cached_tokens > 0
    finally:
        thread.stop()


def test_a_full_disk_during_a_save_is_logged_and_serving_goes_on(tiny_path, cache_dir, monkeypatch, caplog):
    real_open = open

    def full(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".tmp"):
            f = real_open(path, mode, *args, **kwargs)  # a partial file, then no space
            f.write(b"OMLXKVP\0partial")
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(prefix_module, "open", full, raising=False)
    thread = start(tiny_path)
    try:
        with caplog.at_level(logging.WARNING, logger="omlx.kv.prefix"):
            first = ask(thread, SYSTEM, "Where did the cat sit?")
            assert first.choices[0].finish_reason in ("stop", "length")
            saver = thread.server.scheduler.saver
            wait_for(lambda: saver.failed == 1)
            wait_for(lambda: metric(thread, "omlx_prefix_saves_total", '{result="failed"}') == 1)
        assert "cannot save the cached prefix" in caplog.text and "No space left" in caplog.text
        assert not list((cache_dir / "prefixes").glob("*"))  # no partial file holds the space
        # serving goes on, the prefix from memory; the failed save is not retried at once
        assert ask(thread, SYSTEM, "Was the door open?").usage.prompt_tokens_details.cached_tokens > 0
        time.sleep(0.3)
        assert saver.failed == 1
        monkeypatch.setattr(prefix_module, "open", real_open, raising=False)  # room again
        saver.retry_s = 0
        ask(thread, SYSTEM, "Was the mat red?")
        wait_for(lambda: saver.saved == 1)
        assert len(saved(cache_dir)) == 1
    finally:
        thread.stop()


def test_no_disk_cache_keeps_the_prefixes_in_memory(tiny_path, cache_dir):
    engine = Engine.load(tiny_path, kv="k8v8")
    engine.disk_cache = False  # what `omlx serve --no-disk-cache` sets
    server = OpenAIServer(engine, ServeLimits(ctx=TINY_CTX, max_batch=2), ServeConfig(port=0, model_id="m"))
    thread = ServerThread(server).start()
    try:
        ask(thread, SYSTEM, "Where did the cat sit?")
        assert ask(thread, SYSTEM, "Was the door open?").usage.prompt_tokens_details.cached_tokens > 0
        assert server.scheduler.saver is None
    finally:
        thread.stop()
    assert not (cache_dir / "prefixes").exists()


# -- a real process, killed -------------------------------------------------------------------
LONG_SYSTEM = ("You are the help desk of the Riverside Public Library. Opening hours: Monday to Friday "
               "9:00 to 20:00, Saturday 10:00 to 17:00, closed on Sunday. Members may borrow up to "
               "twelve items for three weeks and renew them twice online. The reading room on the second "
               "floor is quiet; group study rooms on the first floor can be booked for two hours. ") * 4
OTHER_LONG_SYSTEM = ("Tu es un assistant de cuisine. Réponds en une phrase, avec une recette simple et des "
                     "ingrédients de saison, sans viande le vendredi. ") * 4


def test_a_killed_server_restarted_on_its_cache_folder_serves_from_its_saved_prefixes(smollm2_path, tmp_path):
    """SIGKILL (no shutdown code runs) after a system prompt's prefix was saved; a damaged prefix
    file and a killed save's temporary file in the folder; the restarted server reads the saved
    prefix (cached_tokens > 0 on both APIs), skips the damaged file with a warning, sweeps the
    temporary one and answers."""
    import anthropic

    from .serve_process import ServeProcess

    cache = tmp_path / "cache"
    args = ("--ctx", "2048", "--max-batch", "2")
    env = {"OMLX_CACHE_DIR": str(cache)}

    def client(server):
        return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask_library(server, question):
        return client(server).chat.completions.create(model=smollm2_path.stem, max_tokens=24, temperature=0, messages=[
            {"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}])

    server = ServeProcess(smollm2_path, *args, env=env).__enter__()
    try:
        first = ask_library(server, "When is the library open on Saturday?")
        assert first.usage.prompt_tokens > 256 and first.usage.prompt_tokens_details.cached_tokens == 0
        wait_for(lambda: len(saved(cache)) == 1)
        library_file = saved(cache)[0]
        client(server).chat.completions.create(model=smollm2_path.stem, max_tokens=4, messages=[
            {"role": "system", "content": OTHER_LONG_SYSTEM}, {"role": "user", "content": "Une soupe ?"}])
        wait_for(lambda: len(saved(cache)) == 2)
        other_file = next(p for p in saved(cache) if p != library_file)
    finally:
        server.kill()
    assert server.returncode == -9
    other_file.write_bytes(other_file.read_bytes()[:-4096])  # damaged (truncated)
    stray = library_file.with_name(f"{'cd' * 32}.kvprefix.{server.proc.pid}.0.tmp")  # a killed save's
    stray.write_bytes(library_file.read_bytes()[:8192])

    with ServeProcess(smollm2_path, *args, env=env) as server:
        r = ask_library(server, "How many items can a member borrow?")
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 64, (cached, first.usage.prompt_tokens)
        assert r.choices[0].message.content.strip() and r.choices[0].finish_reason in ("stop", "length")
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        m = claude.messages.create(model=smollm2_path.stem, max_tokens=16, system=LONG_SYSTEM,
                                   messages=[{"role": "user", "content": "Is the library open on Sunday?"}])
        assert m.usage.cache_read_input_tokens >= cached and m.content[0].text.strip()
        other = client(server).chat.completions.create(model=smollm2_path.stem, max_tokens=4, messages=[
            {"role": "system", "content": OTHER_LONG_SYSTEM}, {"role": "user", "content": "Un gâteau ?"}])
        assert other.usage.prompt_tokens_details.cached_tokens == 0 and other.choices[0].finish_reason
        wait_for(lambda: not stray.exists())
        wait_for(lambda: other_file.exists())  # saved again by this server
    assert server.returncode == 0, server.stderr
    assert "ignoring cached prefix" in server.stderr and "truncated" in server.stderr, server.stderr
    assert f"loaded {cached} cached tokens" in server.stderr, server.stderr
    assert "Traceback" not in server.stderr, server.stderr
    assert not list((cache / "prefixes").glob("*.tmp"))


GEMMA_LIKE_TEMPLATE = (  # Gemma's construct: the system prompt written into the first user turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (first if loop.first else '') + m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, GEMMA_LIKE_TEMPLATE], ids=["chatml", "gemma-like"])
def test_the_system_turn_is_found_whatever_the_template_does_with_it(tmp_path, template):
    path = write_tiny_model(tmp_path / "t.gguf", context_length=TINY_CTX, chat_template=template, seed=3)
    engine = Engine.load(path, kv="k8v8")
    server = OpenAIServer(engine, ServeLimits(ctx=TINY_CTX, max_batch=2), ServeConfig(port=0, model_id="m"))
    system = [{"role": "system", "content": SYSTEM}]
    turns = [system + [{"role": "user", "content": q}] for q in ("Where did it sit?", "Was the door open?")]
    ids = [engine.encode_chat(t) for t in turns]
    n = server.prompts.system_turn_tokens(turns[0], None, ids[0])
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert len(engine.tokenizer.encode(SYSTEM, add_bos=False)) - 2 < n <= shared  # the system text, no question
    assert server.prompts.system_turn_tokens(turns[1], None, ids[1]) == n  # remembered, the same
    assert server.prompts.system_turn_tokens(turns[0][1:], None, engine.encode_chat(turns[0][1:])) == 0
