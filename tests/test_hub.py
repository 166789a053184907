"""Hugging Face downloads against a stand-in Hub on 127.0.0.1 (tests/hub_standin.py): the code
under test is the real huggingface_hub path (model info, resolve URLs, http_get with Range)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine import catalog, hub
from engine.errors import CatalogError, HubError
from engine.gguf_file import GGUFFile

from . import tiny_gguf
from .hub_standin import COMMIT, HubStandIn, leftovers, sha256_of
from .tiny_gguf import write_tiny_model

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = "test-org/SmolLM2-135M-Instruct-GGUF"


def write_split_model(folder: Path, max_tensors: int) -> list[Path]:
    """The tiny llama model written by gguf's own writer as a split set (llama.cpp's format)."""
    splitting = functools.partial(gguf.GGUFWriter, split_max_tensors=max_tensors)
    original = tiny_gguf.gguf.GGUFWriter
    tiny_gguf.gguf.GGUFWriter = splitting
    try:
        write_tiny_model(folder / "tiny-Q8_0.gguf", weight_type=gguf.GGMLQuantizationType.Q8_0)
    finally:
        tiny_gguf.gguf.GGUFWriter = original
    return sorted(folder.glob("tiny-Q8_0-*-of-*.gguf"))


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_path) -> dict:
    folder = tmp_path_factory.mktemp("hub-files")
    (folder / "whole").mkdir()
    whole = write_tiny_model(folder / "whole" / "tiny-Q8_0.gguf", weight_type=gguf.GGMLQuantizationType.Q8_0)
    (folder / "split").mkdir()
    parts = write_split_model(folder / "split", max_tensors=6)
    assert len(parts) >= 3
    return {"smol": smollm2_path, "whole": whole, "parts": parts}


@pytest.fixture
def standin(files, tmp_path, monkeypatch):
    server = HubStandIn()
    server.add(REPO, SMOL_FILE, files["smol"])
    server.add("test-org/tiny-GGUF", "tiny-Q8_0.gguf", files["whole"])
    for part in files["parts"]:
        server.add("test-org/tiny-GGUF", f"split/{part.name}", part)
    server.add_repo("test-org/safetensors-only")
    yield from server.serve_for_test(monkeypatch, tmp_path)


def omlx(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env or dict(os.environ), **kwargs)


# ------------------------------------------------------------------------------------- names
def test_specs_and_quant_types():
    assert hub.parse_spec("hf:Qwen/Qwen3-0.6B-GGUF") == ("Qwen/Qwen3-0.6B-GGUF", None)
    assert hub.parse_spec("hf:a/b/sub/x-Q4_K_M.gguf") == ("a/b", "sub/x-Q4_K_M.gguf")
    for bad in ("hf:", "hf:onlyowner", "hf:a b/c"):
        with pytest.raises(HubError, match="not a Hugging Face source"):
            hub.parse_spec(bad)
    with pytest.raises(HubError, match="not a .gguf file"):
        hub.parse_spec("hf:a/b/model.safetensors")
    assert hub.quant_type("qwen2.5-0.5b-instruct-q4_k_m.gguf") == "Q4_K_M"
    assert hub.quant_type("Llama-3.2-1B-Instruct-IQ4_XS.gguf") == "IQ4_XS"
    assert hub.quant_type("Qwen3-0.6B-Q8_0.gguf") == "Q8_0"
    assert hub.quant_type("gemma-3-1b-it-BF16-00001-of-00002.gguf") == "BF16"
    assert hub.quant_type("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert hub.quant_type("model.gguf") == "?"


# ----------------------------------------------------------------------------------- listing
def test_list_a_repo(standin, files):
    listing = hub.list_files("test-org/tiny-GGUF")
    assert listing.commit == COMMIT
    by_name = {f.name: f for f in listing.files}
    assert set(by_name) == {"tiny-Q8_0.gguf", f"split/{files['parts'][0].name}"}
    whole = by_name["tiny-Q8_0.gguf"]
    assert whole.size == files["whole"].stat().st_size and whole.quant == "Q8_0" and not whole.is_split
    assert whole.parts[0].sha256 == sha256_of(files["whole"])
    split = by_name[f"split/{files['parts'][0].name}"]
    assert split.is_split and len(split.parts) == len(files["parts"]) and split.quant == "Q8_0"
    assert split.size == sum(p.stat().st_size for p in files["parts"])
    assert split.local_name == "split/tiny-Q8_0.gguf"
    # any part names the set
    assert listing.find(f"split/{files['parts'][1].name}") is split

    out = omlx("models", "fetch", "hf:test-org/tiny-GGUF")
    assert out.returncode == 0, out.stderr
    assert "tiny-Q8_0.gguf" in out.stdout and "Q8_0" in out.stdout
    assert f"in {len(files['parts'])} parts" in out.stdout
    assert "fits" in out.stdout  # a few MiB fit anywhere
    assert not leftovers(Path(os.environ[catalog.MODELS_DIR_ENV]))  # listing downloads nothing


def test_repo_errors_are_specific(standin):
    with pytest.raises(HubError, match="has no GGUF files .*README.md"):
        hub.list_files("test-org/safetensors-only")
    with pytest.raises(HubError, match="no Hugging Face repo 'test-org/nope'"):
        hub.list_files("test-org/nope")
    with pytest.raises(HubError, match="(?s)has no GGUF file 'missing.gguf'.*tiny-Q8_0.gguf"):
        hub.download("hf:test-org/tiny-GGUF/missing.gguf")
    for spec, needle in (("hf:test-org/nope", "no Hugging Face repo"),
                         ("hf:test-org/safetensors-only", "has no GGUF files"),
                         ("hf:test-org/tiny-GGUF/x.bin", "not a .gguf file")):
        out = omlx("models", "fetch", spec)
        assert out.returncode == 2 and needle in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_unreachable_hub_is_a_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(tmp_path))
    with pytest.raises(HubError, match="cannot reach the Hugging Face Hub at http://127.0.0.1:9"):
        hub.list_files("a/b")


# ---------------------------------------------------------------------------------- download
def test_download_with_progress_resumes_a_dropped_connection(standin, files):
    standin.drop_after[SMOL_FILE] = 25 << 20  # the first GET breaks off after 25 MiB
    seen = []
    path = hub.download(f"hf:{REPO}/{SMOL_FILE}", progress=lambda stage, f: seen.append((stage, f)))
    assert path == Path(os.environ[catalog.MODELS_DIR_ENV]) / "hf" / REPO / SMOL_FILE
    assert sha256_of(path) == sha256_of(files["smol"])
    ranges = standin.ranges(SMOL_FILE)
    assert len(ranges) == 1 and ranges[0].startswith("bytes=") and int(ranges[0][6:-1]) > 0
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert any(stage.startswith("downloading") for stage, _ in seen)
    assert any(stage.startswith("verifying") for stage, _ in seen)
    assert leftovers(path.parent) == [path]  # no partial file left behind
    # a second fetch finds it without downloading
    gets = len([r for r in standin.requests if r[0] == "GET" and r[1].endswith(SMOL_FILE)])
    assert hub.download(f"hf:{REPO}/{SMOL_FILE}") == path
    assert len([r for r in standin.requests if r[0] == "GET" and r[1].endswith(SMOL_FILE)]) == gets
    assert catalog.resolve_model(f"hf:{REPO}/{SMOL_FILE}") == path


def test_cancel_keeps_the_partial_file_and_the_next_fetch_resumes(standin, files):
    cancel = threading.Event()

    def progress(stage, fraction):
        if stage.startswith("downloading") and fraction > 0.3:
            cancel.set()

    with pytest.raises(HubError, match="cancelled"):
        hub.download(f"hf:{REPO}/{SMOL_FILE}", progress=progress, cancel=cancel)
    folder = Path(os.environ[catalog.MODELS_DIR_ENV]) / "hf" / REPO
    (partial,) = leftovers(folder)
    assert partial.name.endswith(".partial") and partial.name.startswith(".")
    have = partial.stat().st_size
    assert 0 < have < files["smol"].stat().st_size
    with pytest.raises(CatalogError, match="not downloaded yet; run `omlx models fetch"):
        catalog.resolve_model(f"hf:{REPO}/{SMOL_FILE}")

    path = hub.download(f"hf:{REPO}/{SMOL_FILE}")
    assert standin.ranges(SMOL_FILE) == [f"bytes={have}-"]
    assert sha256_of(path) == sha256_of(files["smol"])
    assert leftovers(folder) == [path]


def test_kill_mid_download_then_fetch_resumes(standin, files):
    standin.throttle = 0.02  # 1 MiB per 20 ms: the kill lands mid-file
    spec = f"hf:{REPO}/{SMOL_FILE}"
    folder = Path(os.environ[catalog.MODELS_DIR_ENV]) / "hf" / REPO
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "models", "fetch", spec],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            partials = list(folder.glob(".*.partial")) if folder.exists() else []
            if partials and partials[0].stat().st_size >= 20 << 20:
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        else:
            pytest.fail("the download never got under way")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    (partial,) = folder.glob(".*.partial")
    have = partial.stat().st_size
    assert not (folder / SMOL_FILE).exists()

    standin.throttle = 0.0
    out = omlx("models", "fetch", spec)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip().splitlines()[-1])  # the contract: the path is the last line
    assert path == folder / SMOL_FILE and sha256_of(path) == sha256_of(files["smol"])
    assert standin.ranges(SMOL_FILE) == [f"bytes={have}-"]
    assert "downloading" in out.stderr and "resuming" in out.stderr

    listed = omlx("models", "list")
    assert f"hf:{REPO}/{SMOL_FILE}" in listed.stdout


def test_corrupted_download_is_rejected_and_nothing_is_left(standin, files):
    standin.corrupt.add(SMOL_FILE)
    with pytest.raises(HubError, match="sha256 mismatch.*corrupted file was deleted"):
        hub.download(f"hf:{REPO}/{SMOL_FILE}")
    assert leftovers(Path(os.environ[catalog.MODELS_DIR_ENV])) == []
    out = omlx("models", "fetch", f"hf:{REPO}/{SMOL_FILE}")
    assert out.returncode == 2 and "sha256 mismatch" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout.strip() == ""
    assert leftovers(Path(os.environ[catalog.MODELS_DIR_ENV])) == []
    standin.corrupt.clear()  # the next fetch starts afresh and succeeds
    assert sha256_of(hub.download(f"hf:{REPO}/{SMOL_FILE}")) == sha256_of(files["smol"])


def test_file_in_the_shared_cache_is_used_where_it_is(standin, files):
    """A file another tool fetched with huggingface_hub's own hf_hub_download is not fetched again."""
    from huggingface_hub import hf_hub_download

    cached = hf_hub_download("test-org/tiny-GGUF", "tiny-Q8_0.gguf", cache_dir=os.environ["HF_HUB_CACHE"],
                             endpoint=os.environ["HF_ENDPOINT"])
    gets = len([r for r in standin.requests if r[0] == "GET" and r[1].endswith("/tiny-Q8_0.gguf")])
    assert gets == 1
    path = hub.download("hf:test-org/tiny-GGUF/tiny-Q8_0.gguf")
    assert path == Path(cached)
    assert len([r for r in standin.requests if r[0] == "GET" and r[1].endswith("/tiny-Q8_0.gguf")]) == 1
    models = hub.downloaded_models()
    assert [(m.spec, m.where) for m in models] == [("hf:test-org/tiny-GGUF/tiny-Q8_0.gguf", "HF cache")]
    assert catalog.resolve_model("hf:test-org/tiny-GGUF/tiny-Q8_0.gguf") == Path(cached)


# -------------------------------------------------------------------------------- split sets
def test_split_set_is_downloaded_and_joined(standin, files):
    from engine.engine import Engine

    first = f"split/{files['parts'][0].name}"
    path = hub.download(f"hf:test-org/tiny-GGUF/{first}")
    assert path == Path(os.environ[catalog.MODELS_DIR_ENV]) / "hf" / "test-org/tiny-GGUF" / "split" / "tiny-Q8_0.gguf"
    assert leftovers(path.parent) == [path]  # the parts are gone once joined
    joined, whole = GGUFFile(path), GGUFFile(files["whole"])
    assert list(joined.tensors) == list(whole.tensors)
    for name, info in whole.tensors.items():
        assert joined.tensors[name].shape == info.shape and joined.tensors[name].ggml_type == info.ggml_type
        assert np.array_equal(joined.raw(name), whole.raw(name))
    assert not any(k.startswith("split.") for k in joined.metadata)
    for key, value in whole.metadata.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(joined.metadata[key], value), key
        else:
            assert joined.metadata[key] == value, key
    ids = [1, 5, 70, 200]
    a = Engine.load(path, kv="full").teacher_forced(ids)
    b = Engine.load(files["whole"], kv="full").teacher_forced(ids)
    assert np.array_equal(a.top_ids, b.top_ids) and np.allclose(a.top_logprobs, b.top_logprobs)
    assert catalog.resolve_model(f"hf:test-org/tiny-GGUF/{first}") == path


def test_incomplete_split_set_is_refused(standin, files):
    del standin.repos["test-org/tiny-GGUF"][f"split/{files['parts'][1].name}"]
    with pytest.raises(HubError, match=f"lists {len(files['parts']) - 1} of its {len(files['parts'])} parts"):
        hub.download(f"hf:test-org/tiny-GGUF/split/{files['parts'][0].name}")
    assert leftovers(Path(os.environ[catalog.MODELS_DIR_ENV])) == []


# ----------------------------------------------------------------------------------- catalog
def test_hub_catalog_entries_are_listed_offline(monkeypatch, tmp_path):
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # any network use would fail
    expected = {"qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", "qwen3-0.6b", "qwen3-1.7b",
                "llama3.2-1b-instruct", "llama3.2-3b-instruct", "gemma3-1b-it"}
    assert set(catalog.HUB_CATALOG) == expected
    for entry in catalog.HUB_CATALOG.values():
        repo, filename = hub.parse_spec(entry.spec)
        assert repo == entry.repo and filename == entry.file_name and entry.size > 100 << 20
        assert hub.quant_type(entry.file_name) in {"Q4_K_M", "Q8_0"}
        assert catalog.hub_entry_path(entry.name) is None
        with pytest.raises(CatalogError, match=f"not downloaded yet; run `omlx models fetch {entry.name}`"):
            catalog.resolve_model(entry.name)
    out = omlx("models", "list")
    assert out.returncode == 0, out.stderr
    for entry in catalog.HUB_CATALOG.values():
        assert entry.name in out.stdout and entry.spec in out.stdout


def test_hub_catalog_name_fetches_through_the_hub(standin, files, monkeypatch):
    entry = catalog.HubEntry("tiny-hub", "tiny test model", "test-org/tiny-GGUF", "tiny-Q8_0.gguf",
                             files["whole"].stat().st_size, chat=True)
    monkeypatch.setitem(catalog.HUB_CATALOG, entry.name, entry)
    with pytest.raises(CatalogError, match="not downloaded yet"):
        catalog.resolve_model("tiny-hub")
    path = catalog.fetch("tiny-hub")
    assert path == Path(os.environ[catalog.MODELS_DIR_ENV]) / "hf" / entry.repo / entry.file_name
    assert catalog.hub_entry_path("tiny-hub") == path == catalog.resolve_model("tiny-hub")
    assert sha256_of(path) == sha256_of(files["whole"])


def test_a_second_fetch_of_the_same_file_waits_for_the_first(standin, files):
    """Two fetches of one file (two windows, or the app and `omlx models fetch`) never append to
    the same partial file together: the second waits for the first, then finds the file complete."""
    import shutil

    import filelock

    target = hub.hub_models_dir() / REPO / SMOL_FILE
    lock_path = hub.hub_models_dir() / ".locks" / REPO / f"{SMOL_FILE}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    held, waiting = threading.Event(), threading.Event()

    def other_download():   # another process's download, as far as this one can tell
        with filelock.FileLock(str(lock_path)):
            held.set()
            waiting.wait(30)     # until the second fetch says it waits
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(files["smol"], target)

    def progress(stage, fraction):
        stages.append(stage)
        if stage.startswith("waiting for another download"):
            waiting.set()

    thread = threading.Thread(target=other_download)
    thread.start()
    held.wait(5)
    stages = []
    try:
        path = hub.download(f"hf:{REPO}/{SMOL_FILE}", progress=progress)
    finally:
        waiting.set()
    thread.join()
    assert path == target
    assert any(s.startswith("waiting for another download") for s in stages)
    assert stages[-1] == "already downloaded"            # found complete, not downloaded again
    assert not [r for r in standin.requests if r[0] == "GET" and r[1].endswith(SMOL_FILE)]
    assert sha256_of(path) == sha256_of(files["smol"])
    assert leftovers(target.parent) == [path]


def test_waiting_for_another_download_can_be_cancelled(standin, files):
    import filelock

    lock_path = hub.hub_models_dir() / ".locks" / REPO / f"{SMOL_FILE}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    cancel = threading.Event()
    held, release = threading.Event(), threading.Event()

    def holder():          # another process's download, as far as this one can tell
        with filelock.FileLock(str(lock_path)):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(5)
    threading.Timer(0.5, cancel.set).start()
    try:
        with pytest.raises(HubError, match="cancelled while another download"):
            hub.download(f"hf:{REPO}/{SMOL_FILE}", cancel=cancel)
    finally:
        release.set()
        thread.join()
    assert not (hub.hub_models_dir() / REPO / SMOL_FILE).exists()
