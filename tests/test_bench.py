"""`omlx bench`, the standard test set, on a short document (the real run uses the GPL-3 text)."""

from __future__ import annotations

import json

import pytest

from engine.bench import DEFAULT_DOC, DEFAULT_QUESTIONS, read_questions
from engine.cli import main

from .conftest import DATA


def test_default_test_set_is_shipped():
    assert DEFAULT_DOC.read_text() == (DATA / "texts" / "gpl-3.txt").read_text()
    assert len(read_questions(DEFAULT_QUESTIONS)) == 6


@pytest.mark.slow
def test_bench_writes_table_json_and_plot(smollm2_path, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text((DATA / "texts" / "apache-2.0.txt").read_text()[:1500])
    questions = tmp_path / "q.txt"
    questions.write_text("# two questions\nWhat is this?\nWho wrote it?\n")
    out = tmp_path / "out"
    rc = main(["-q", "bench", str(smollm2_path), "--doc", str(doc), "--questions", str(questions),
               "--kv", "full", "--kv", "k4v4", "--max-tokens", "4", "--kl-tokens", "96", "--out", str(out)])
    assert rc == 0
    table = (out / "bench.md").read_text()
    assert "| k16v16 |" in table and "| k4v4 |" in table and "KL vs 16-bit" in table
    data = json.loads((out / "bench.json").read_text())
    full, k4 = data["results"]
    assert full["mean_kl"] < 1e-6 < k4["mean_kl"] < 0.05  # 16-bit KV against itself is exact
    assert k4["kv_bytes"] < 0.5 * full["kv_bytes"]
    for r in (full, k4):
        assert r["cached_share"] >= 0.95 and len(r["answers"]) == 2 and len(r["timeline"]) >= 2
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| k4v4 |" in capsys.readouterr().out
