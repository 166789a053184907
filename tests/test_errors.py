"""Bad input gets a clear, specific error: from the loader and from the CLI (no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.engine import Engine
from engine.gguf_file import GGUFError, GGUFFile
from engine.models import UnsupportedArchitecture, load_model

from .tiny_gguf import write_tiny_model


def omlx(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=300)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("just some text that is long enough to have a header\n" * 4)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(bad)


def test_tiny_and_empty_files(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="too small"):
        GGUFFile(empty)
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "missing.gguf")


def test_truncated_in_the_tensor_data(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        cut.write_bytes(src.read(40_000_000))
    with pytest.raises(GGUFError, match="truncated.*Download it again"):
        GGUFFile(cut)


def test_truncated_in_the_header(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        cut.write_bytes(src.read(100_000))
    with pytest.raises(GGUFError, match="ends inside its header"):
        GGUFFile(cut)


def test_missing_tensor(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", skip_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(GGUFError, match="'blk.1.ffn_up.weight' is missing"):
        load_model(GGUFFile(path))


def test_unsupported_architecture(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf")
    # Same file, other architecture name: rewrite the metadata key's value in place.
    data = path.read_bytes().replace(b"llama", b"mamba")
    (tmp_path / "mamba.gguf").write_bytes(data)
    with pytest.raises(UnsupportedArchitecture, match=r"'mamba' is not supported; supported: gemma3, llama, qwen2, qwen3"):
        Engine.load(tmp_path / "mamba.gguf")


def test_cli_reports_bad_files_without_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x00" * 4096)
    for args in (["info", str(bad)], ["tokenize", str(bad), "hi"], ["generate", str(bad), "--prompt", "x"]):
        proc = omlx(*args)
        assert proc.returncode == 2, proc.stderr
        assert "omlx: error: bad.gguf: not a GGUF file" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_cli_unknown_model_name_suggests(tmp_path):
    proc = omlx("info", "smollm2")
    assert proc.returncode == 2
    assert "smollm2-135m-instruct" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_missing_path():
    proc = omlx("info", "/nonexistent/model.gguf")
    assert proc.returncode == 2 and "no such file" in proc.stderr.lower()
