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
    ("气温是零下三十一度。", ["零下三十一"], True),  # letters of any script are kept
    ("气温是三十一度。", ["零下三十一"], False),
])
def test_answers_count_by_normalized_containment(answer, accepted, ok):
    assert bench.is_correct(answer, accepted) is ok


def test_the_held_out_set_is_another_set_in_other_filler():
    shipped, held_out = bench.read_facts(), bench.read_facts(bench.QA_DIR / "facts-heldout.json")
    assert len(held_out["facts"]) == 6 and held_out["depths"] != shipped["depths"]
    assert [f.name for f in held_out["filler"]] == ["psf-license.txt", "idle-news.txt"]
    assert not set(held_out["filler"]) & set(shipped["filler"])
    assert not {f["question"] for f in held_out["facts"]} & {f["question"] for f in shipped["facts"]}
    for fact in held_out["facts"]:  # each fact's own sentence counts as a correct answer
        assert bench.is_correct(fact["fact"], fact["answers"])
    zh = bench.read_facts(bench.QA_DIR / "facts-zh.json")
    assert [f.name for f in zh["filler"]] == ["zh-filler.txt"]


@pytest.mark.parametrize("content, message", [
    ("{", "is not JSON"),
    ('{"facts": [], "depths": [0.5]}', "one depth per fact"),
    ('{"facts": [{"fact": "A.", "question": "B?", "answers": ["a"]}], "depths": [1.5]}', "0 to 1"),
    ('{"facts": [{"fact": "A.", "question": "B?"}], "depths": [0.5]}', 'a list of "answers"'),
    ('{"facts": [{"fact": "A.", "question": "B?", "answers": ["?!"]}], "depths": [0.5]}',
     "an answer without a letter or digit"),
    ('{"facts": [], "depths": [], "filler": "gpl.txt"}', "a list of text files"),
])
def test_a_malformed_qa_set_is_refused_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "set.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        bench.read_facts(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.engine import Engine

    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context_length=4096)
    return Engine.load(path, kv="k8v8")


@pytest.mark.parametrize("name", ["facts.json", "facts-heldout.json"])
def test_a_qa_document_has_its_facts_at_their_depths_and_about_its_size(tiny, name):
    facts = bench.read_facts(bench.QA_DIR / name)
    assert len(facts["facts"]) == 6
    text = bench.qa_document(tiny.tokenizer, 20_000, facts)
    n = len(tiny.tokenizer.encode(text))
    assert 18_000 <= n <= 20_000
    positions = [text.index(f["fact"]) for f in facts["facts"]]
    assert positions == sorted(positions)
    for pos, depth in zip(positions, facts["depths"]):
        assert abs(pos / len(text) - depth) < 0.05
    first_paragraph = facts["filler"][0].read_text().split("\n\n")[0].strip()
    assert text.startswith(first_paragraph)


def test_a_qa_document_in_filler_given(tiny, tmp_path):
    filler = tmp_path / "filler.txt"
    filler.write_text("\n\n".join(f"Paragraph {i} of the filler about nothing much." for i in range(40)))
    facts = bench.read_facts()
    text = bench.qa_document(tiny.tokenizer, 4000, facts, [filler])
    assert text.startswith("Paragraph 0 of the filler") and "GNU" not in text
    assert all(f["fact"] in text for f in facts["facts"])


def test_bench_qa_flags_refuse_a_missing_set_or_filler_before_loading_a_model(tmp_path, capsys):
    from engine.cli import main

    assert main(["-q", "bench", "--qa", "--qa-facts", str(tmp_path / "none.json")]) == 2
    assert "--qa-facts: no file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"facts": [], "depths": [0.5]}')
    assert main(["-q", "bench", "--qa", "--qa-facts", str(bad)]) == 2
    assert "one depth per fact" in capsys.readouterr().err
    assert main(["-q", "bench", "--qa", "--qa-filler", str(tmp_path / "none.txt")]) == 2
    assert "--qa-filler: no file" in capsys.readouterr().err
    assert main(["-q", "bench", "--qa-facts", str(bad)]) == 2
    assert "--qa-facts goes with --qa" in capsys.readouterr().err
    assert main(["-q", "bench", "--qa-sizes", "4,16"]) == 2  # was ignored: a plain bench ran instead
    assert "--qa-sizes goes with --qa" in capsys.readouterr().err


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
    assert "QA set facts.json, planted in gpl-3.txt, apache-2.0.txt." in table
    held_out = bench.QA_DIR / "facts-heldout.json"
    paths = bench.write_qa_report(rows, tmp_path / "held-out", model="tiny", ctx=1024, facts_path=held_out)
    assert "QA set facts-heldout.json, planted in psf-license.txt, idle-news.txt." in paths["markdown"].read_text()
    assert json.loads(paths["json"].read_text())["facts"] == "facts-heldout.json"
