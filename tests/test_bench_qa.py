"""`omlx bench --qa`: answers checked by normalized containment, documents with the facts at
their depths and the size asked for, and the run's table, JSON and PNG (a tiny random model:
the mechanics, not the answers)."""

from __future__ import annotations

import json

import pytest

from engine import bench

from .tiny_gguf import write_tiny_model


@pytest.mark.parametrize("answer, accepted, ok", [
    ("The access code is 4471.", ["4471"], True),
    ("It is 4417.", ["4471"], False),
    ("At 6:40 in the morning", ["6:40"], True),
    ("It recorded -31 degrees.", ["minus 31", "-31"], True),
    ("It recorded 31 degrees.", ["minus 31", "-31"], False),
    ("A tree called OLD MARTEN!", ["Old Marten"], True),
    ("on thursdays", ["Thursday"], True),
])
def test_answers_count_by_normalized_containment(answer, accepted, ok):
    assert bench.is_correct(answer, accepted) is ok


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.engine import Engine

    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context_length=4096)
    return Engine.load(path, kv="k8v8")


def test_a_qa_document_has_its_facts_at_their_depths_and_about_its_size(tiny):
    facts = bench.read_facts()
    assert len(facts["facts"]) == 6
    text = bench.qa_document(tiny.tokenizer, 20_000, facts)
    n = len(tiny.tokenizer.encode(text))
    assert 18_000 <= n <= 20_000
    positions = [text.index(f["fact"]) for f in facts["facts"]]
    assert positions == sorted(positions)
    for pos, depth in zip(positions, facts["depths"]):
        assert abs(pos / len(text) - depth) < 0.05


def test_run_qa_writes_the_table_json_and_png(tiny, tmp_path):
    rows = bench.run_qa(tiny, ["k8v8"], ctx=1024, sizes=("ctx", 0.5, 4.0), max_tokens=2)
    assert [(r.size, r.mode) for r in rows] == [("ctx", "whole"), (0.5, "whole"), (4.0, "retrieval")]
    for r in rows:
        assert r.n_questions == 6 and 0 <= r.correct <= 6 and len(r.answers) == 6
        assert r.prompt_tokens <= 1024 and r.kv_bytes > 0 and r.ttft_cold_s > 0
    paths = bench.write_qa_report(rows, tmp_path, model="tiny", ctx=1024)
    table = paths["markdown"].read_text()
    assert "| k8v8 | 4× |" in table and "retrieval" in table
    assert json.loads(paths["json"].read_text())["rows"][2]["mode"] == "retrieval"
    assert paths["png"].stat().st_size > 10_000
