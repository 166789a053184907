"""Retrieval for documents longer than the context: chunks along paragraphs and pages with their
locations and overlap, the BM25 index saved and loaded again, sections chosen to fit a budget in
document order, and sessions in auto / whole / retrieval mode (a tiny random model for the
mechanics, the real SmolLM2 for answers and the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import retrieval
from engine.documents import join_pages
from engine.errors import DocumentError, EngineError, SettingsError
from engine.retrieval import DocumentIndex, pack_chunks, render_sections, split_units

from .tiny_gguf import write_tiny_model

GPL = (__import__("pathlib").Path(__file__).parents[1] / "resources" / "bench" / "gpl-3.txt").read_text()


def count_words(text: str) -> int:
    """A stand-in token count: one per word (and one for an empty text's newline)."""
    return max(len(text.split()), 1)


def planted(facts: dict[int, str], n_paragraphs: int = 120) -> str:
    """Paragraphs of filler with ``facts`` as paragraph number -> sentence."""
    filler = [p for p in GPL.split("\n\n") if len(p.split()) > 20]
    out = []
    for i in range(n_paragraphs):
        out.append(facts.get(i, filler[i % len(filler)]))
    return "\n\n".join(out)


# -- chunks -----------------------------------------------------------------------------------
def test_units_follow_paragraphs_with_their_line_ranges():
    text = "Title line\n\nfirst paragraph\nstill first\n\n\nsecond one\n"
    units = split_units(text, count_words, piece_tokens=100)
    assert [(u.start, u.end, u.text) for u in units] == [
        (1, 1, "Title line"), (3, 4, "first paragraph\nstill first"), (7, 7, "second one")]


def test_every_chunk_fits_and_consecutive_chunks_overlap():
    text = planted({})
    lines = text.split("\n")
    index = DocumentIndex.build(text, count_words, chunk_tokens=200, overlap_tokens=60)
    for u in index.units:  # a unit's text is its lines of the document
        assert "\n".join(lines[u.start - 1:u.end]).strip().endswith(u.text.split("\n")[-1].strip())
        assert u.n_tokens <= 50  # pieces of a quarter chunk at most
    assert all(c.n_tokens <= 200 for c in index.chunks)
    covered = set()
    for a, b in zip(index.chunks, index.chunks[1:]):
        assert b.first > a.first and b.first <= a.last + 1
        covered.update(range(a.first, a.last + 1))
    covered.update(range(index.chunks[-1].first, index.chunks[-1].last + 1))
    assert covered == set(range(len(index.units)))
    assert sum(b.first <= a.last for a, b in zip(index.chunks, index.chunks[1:])) >= len(index.chunks) // 2


def test_a_line_longer_than_a_chunk_is_cut_into_word_pieces():
    line = " ".join(f"w{i}" for i in range(1000))
    units = split_units(f"intro\n\n{line}\n", count_words, piece_tokens=80)
    assert units[0].text == "intro"
    assert all(u.start == u.end == 3 and u.n_tokens <= 80 for u in units[1:])
    assert " ".join(u.text for u in units[1:]) == line
    chunks = pack_chunks(units, chunk_tokens=320, overlap_tokens=64)
    assert all(c.n_tokens <= 320 for c in chunks)


def test_pdf_chunks_are_located_by_page():
    text = join_pages(["Page one talks about apples.", "", "Page three talks about the harbour ferry.",
                       "Page four talks about pears."])
    index = DocumentIndex.build(text, count_words, chunk_tokens=8, overlap_tokens=0)
    assert index.unit == "pages"
    assert [(u.start, u.end) for u in index.units] == [(1, 1), (3, 3), (4, 4)]
    found = retrieval.sections(retrieval.select(retrieval.rank("Where does the ferry go?", [("r.pdf", index)]), 30))
    assert [(s.label, s.text) for s in found] == [("page 3", "Page three talks about the harbour ferry.")]


# -- the index --------------------------------------------------------------------------------
def test_the_index_is_saved_and_loaded_instead_of_rebuilt(tmp_path):
    text = planted({40: "The access code for the north gate is 4471."})
    built = DocumentIndex.open(text, count_words, "model-a", directory=tmp_path)
    assert not built.loaded and built.path.is_dir() and built.path.parent == tmp_path

    def refuse(_text):
        raise AssertionError("the saved index should be loaded, not built again")

    loaded = DocumentIndex.open(text, refuse, "model-a", directory=tmp_path)
    assert loaded.loaded and loaded.units == built.units and loaded.chunks == built.chunks
    q = "What is the access code for the north gate?"
    assert (loaded.scores(q) == built.scores(q)).all() and loaded.scores(q).max() > 0
    other_model = DocumentIndex.open(text, count_words, "model-b", directory=tmp_path)
    assert not other_model.loaded  # token counts are the model's: its own index
    (built.path / "chunks.json").write_text("{not json")
    rebuilt = DocumentIndex.open(text, count_words, "model-a", directory=tmp_path)
    assert not rebuilt.loaded and rebuilt.chunks == built.chunks


def test_sections_fill_the_budget_best_first_in_document_order():
    fact_a, fact_b = "The access code for the north gate is 4471.", "The ferry to Lindholm leaves at 6:40."
    text = planted({20: fact_b, 90: fact_a})
    index = DocumentIndex.build(text, count_words, chunk_tokens=120, overlap_tokens=30)
    ranked = retrieval.rank("access code north gate and the ferry to Lindholm", [("doc.txt", index)])
    chosen = retrieval.select(ranked, 400)
    assert sum(c.n_tokens + retrieval.SECTION_OVERHEAD_TOKENS for c in chosen) <= 400
    found = retrieval.sections(chosen)
    assert [s.start for s in found] == sorted(s.start for s in found)
    joined = "\n".join(s.text for s in found)
    assert fact_a in joined and fact_b in joined
    for a, b in zip(found, found[1:]):
        assert a.end < b.start  # overlapping chunks merged: no line shown twice
    assert render_sections("doc.txt", found) == render_sections("doc.txt", retrieval.sections(chosen))
    assert f"[lines {found[0].start}-{found[0].end}]" in render_sections("doc.txt", found)
    # a question matching nothing is shown the beginning
    none = retrieval.sections(retrieval.select(retrieval.rank("zzzz qqqq", [("doc.txt", index)]), 200))
    assert none[0].start == 1 and none[0].score == 0


def test_select_takes_matching_chunks_new_text_first_and_cuts_off_weak_ones():
    fact_a, fact_b = "The access code for the north gate is 4471.", "The ferry to Lindholm leaves at 6:40."
    index = DocumentIndex.build(planted({20: fact_b, 90: fact_a}), count_words, chunk_tokens=120,
                                overlap_tokens=60)
    ranked = retrieval.rank("access code north gate 4471, ferry Lindholm", [("doc.txt", index)])
    chosen = retrieval.select(ranked, 10_000)
    assert chosen and all(c.score > 0 for c in chosen)  # text sharing no word is not shown
    holding_a = [c for c in ranked if fact_a in index.chunk_text(index.chunks[c.chunk])]
    assert len(holding_a) == 2  # the fact is in a chunk's overlap: in two chunks
    two = retrieval.select(ranked, 2 * (120 + retrieval.SECTION_OVERHEAD_TOKENS))
    shown = "\n".join(s.text for s in retrieval.sections(two))
    assert fact_a in shown and fact_b in shown  # the second fact before the first one's neighbour
    best = ranked[0].score
    cut = retrieval.select(ranked, 10_000, min_ratio=0.5)
    assert cut and all(c.score >= 0.5 * best for c in cut) and len(cut) < len(chosen)


def reference_rank(question, documents):
    """rank and select as they were, a Candidate per chunk and a loop over them (the arrays'
    results must be these)."""
    matched, rest = [], []
    for name, index in documents:
        for i, s in enumerate(index.scores(question)):
            (matched if s > 0 else rest).append(retrieval.Candidate(name, index, i, float(s)))
    matched.sort(key=lambda c: -c.score)
    return matched + rest


def reference_select(candidates, budget_tokens, min_ratio=0.0):
    best = max((c.score for c in candidates), default=0.0)
    if best > 0:
        candidates = [c for c in candidates if c.score > 0 and c.score >= min_ratio * best]
    chosen, shown, deferred, used = [], {}, [], 0
    for c in candidates:
        chunk = c.index.chunks[c.chunk]
        units = shown.setdefault(id(c.index), set())
        if any(j in units for j in range(chunk.first, chunk.last + 1)):
            deferred.append(c)
            continue
        cost = c.n_tokens + retrieval.SECTION_OVERHEAD_TOKENS
        if used + cost <= budget_tokens:
            chosen.append(c)
            used += cost
            units.update(range(chunk.first, chunk.last + 1))
    for c in deferred:
        chunk = c.index.chunks[c.chunk]
        units = shown[id(c.index)]
        new = [j for j in range(chunk.first, chunk.last + 1) if j not in units]
        cost = sum(c.index.units[j].n_tokens + 1 for j in new)
        if new and used + cost <= budget_tokens:
            chosen.append(c)
            used += cost
            units.update(new)
    return chosen


def test_rank_and_select_by_arrays_choose_what_a_loop_over_every_chunk_did():
    import random

    rng = random.Random(7)
    vocab = "gate code north ferry lindholm lantern cabinet bakery rye thursday station kessel".split()

    def text(n_paragraphs):
        words = vocab + ["filler"] * 12
        return "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))
                           for _ in range(n_paragraphs))

    a = DocumentIndex.build(text(120), count_words, chunk_tokens=120, overlap_tokens=40)
    b = DocumentIndex.build(text(40), count_words, chunk_tokens=80, overlap_tokens=20)
    documents = [("a.txt", a), ("b.txt", b), ("a again.txt", a)]  # two names on one index
    as_tuples = lambda cs: [(c.document, id(c.index), c.chunk, c.score) for c in cs]  # noqa: E731
    checked = 0
    for question in ["north gate code", "ferry to lindholm on thursday", "zzzz", "filler", "rye", ""]:
        for docs in (documents[:1], documents[1:2], documents):
            ranked = retrieval.rank(question, docs)
            expected = reference_rank(question, docs)
            assert as_tuples(ranked) == as_tuples(expected)
            for budget in (0, 50, 132, 400, 700, 1500, 100_000):
                for min_ratio in (0.0, 0.3, 0.9):
                    got = retrieval.select(ranked, budget, min_ratio=min_ratio)
                    want = reference_select(expected, budget, min_ratio)
                    assert as_tuples(got) == as_tuples(want), (question, len(docs), budget, min_ratio)
                    from_list = retrieval.select(expected, budget, min_ratio=min_ratio)  # Candidates given
                    assert as_tuples(from_list) == as_tuples(want)
                    checked += bool(want)
    assert checked > 200


# -- sessions on a tiny model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.engine import Engine

    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context_length=4096,
                            chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                          "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return Engine.load(path, kv="k8v8")


def test_auto_reads_a_document_whole_when_it_fits_and_by_retrieval_when_not(tiny):
    from engine.session import Session

    session = Session(tiny, ctx=1024, doc_mode="auto")
    small = session.add_document(text="The meeting is on Tuesday.", name="small.txt")
    big = session.add_document(text=planted({60: "The access code for the north gate is 4471."}),
                               name="big.txt")
    assert small.mode == "whole" and big.mode == "retrieval" and big.cached
    assert big.n_tokens > 4 * session.ctx
    gen = session.ask("What is the access code for the north gate?", max_tokens=4)
    result = gen.result
    assert result.stats.prompt_tokens + 4 <= session.ctx
    assert gen.retrieved and all(r["document"] == "big.txt" for r in gen.retrieved)
    assert {"start", "end", "tokens", "score"} <= set(gen.retrieved[0])
    assert any("4471" in s.text for s in session.last_sections)
    # the same sections again: the prompt prefix is reused from the cache
    again = session.ask("What is the access code for the north gate?", max_tokens=4)
    assert again.retrieved == gen.retrieved
    assert again.result.stats.cached_tokens >= result.stats.prompt_tokens - 16
    # whole mode refuses what does not fit, and nothing changes
    with pytest.raises(DocumentError, match="raise the context, or read them by retrieval"):
        session.set_doc_mode("whole")
    assert session.doc_mode == "auto" and big.mode == "retrieval"
    session.set_doc_mode("retrieval")
    assert small.mode == "retrieval"
    with pytest.raises(EngineError, match="document mode"):
        session.set_doc_mode("sometimes")


def test_whole_mode_refuses_a_document_that_does_not_fit_and_names_the_way_out(tiny):
    from engine.session import Session

    session = Session(tiny, ctx=512)
    assert session.doc_mode == "whole"
    with pytest.raises(DocumentError, match=r"big.txt is [\d,]+ tokens.*context holds 512"):
        session.add_document(text=planted({}), name="big.txt")
    assert session.documents == []


def test_a_conversation_with_a_retrieval_document_keeps_within_the_context(tiny):
    from engine.session import Session

    session = Session(tiny, ctx=1024, doc_mode="retrieval")
    session.add_document(text=planted({10: "Boats leave at noon."}), name="big.txt")
    for i in range(3):
        result = session.send(f"When do boats leave? ({i})", max_tokens=8).result
        assert result.stats.prompt_tokens + 8 <= session.ctx
    assert len(session.messages) == 6


def test_the_retrieval_budget_bounds_the_sections_of_each_question(tiny):
    from engine.session import MIN_RETRIEVAL_TOKENS, RETRIEVAL_TOKENS, Session

    text = planted({10: "Boats leave at noon.", 60: "The access code for the north gate is 4471."})
    question = "What is the access code for the north gate?"
    room = Session(tiny, ctx=2048, doc_mode="retrieval", retrieval_tokens=0)
    room.add_document(text=text, name="big.txt")
    filled = room.ask(question, max_tokens=2)
    assert filled.result.stats.prompt_tokens > 1400
    session = Session(tiny, ctx=2048, doc_mode="retrieval")
    assert session.retrieval_tokens == RETRIEVAL_TOKENS
    session.add_document(text=text, name="big.txt")
    for budget in (MIN_RETRIEVAL_TOKENS, RETRIEVAL_TOKENS, 800):
        session.set_retrieval_tokens(budget)
        gen = session.ask(question, max_tokens=2)
        gen.result
        shown = sum(s.n_tokens + retrieval.SECTION_OVERHEAD_TOKENS for s in session.last_sections)
        assert 0 < shown <= budget
        assert any("4471" in s.text for s in session.last_sections)
        assert gen.result.stats.prompt_tokens < filled.result.stats.prompt_tokens
    assert sum(r["tokens"] for r in filled.retrieved) > RETRIEVAL_TOKENS * 3 // 2  # 0: the whole room
    for bad in (100, -5, 1.5, "800", True):
        with pytest.raises(SettingsError, match="retrieval budget must be"):
            session.set_retrieval_tokens(bad)
    assert session.retrieval_tokens == 800  # a refused budget changes nothing
    with pytest.raises(SettingsError, match=f"at least {MIN_RETRIEVAL_TOKENS} tokens"):
        Session(tiny, ctx=2048, retrieval_tokens=200)


def test_questions_that_share_sections_share_a_kv_prefix(tiny):
    """Sections come in document order after the system prompt, so a question whose first
    sections are another's reuses their KV blocks instead of prefilling them again."""
    from engine.session import Session

    facts = {8: "The lighthouse keeper Oskarine feeds the seven herons.",
             60: "The ferry to Lindholm leaves at twenty to seven.",
             110: "Doctor Okafor keeps the spare lanterns in the blue cupboard."}
    session = Session(tiny, ctx=2048, doc_mode="retrieval", system_prompt="Answer from the documents.",
                      retrieval_tokens=800)
    session.add_document(text=planted(facts, 130), name="town.txt")
    n_system = session.render([], add_generation_prompt=False)[1]  # the system prompt alone
    session.ask("Oskarine herons lighthouse keeper, and the ferry to Lindholm?", max_tokens=2).result
    first_ids = session.render([{"role": "user", "content": "x"}], sections=session.last_sections)[0]
    shown_first = [s.text for s in session.last_sections]
    second = session.ask("Oskarine herons lighthouse keeper, and Okafor's spare lanterns?", max_tokens=2)
    stats = second.result.stats
    shown_second = [s.text for s in session.last_sections]
    assert facts[8] in shown_first[0] and facts[8] in shown_second[0]  # the same first section
    assert any(facts[60] in t for t in shown_first) and not any(facts[60] in t for t in shown_second)
    assert any(facts[110] in t for t in shown_second)
    second_ids = session.render([{"role": "user", "content": "x"}], sections=session.last_sections)[0]
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    first_section = session.last_sections[0].n_tokens
    assert common > n_system + first_section
    assert stats.cached_tokens > n_system + first_section // 2, (stats.cached_tokens, n_system, common)
    assert stats.cached_tokens <= common
    assert stats.prompt_tokens - stats.cached_tokens < stats.prompt_tokens - n_system - first_section // 2


def test_retrieval_tokens_on_the_command_line():
    from engine.cli import build_parser
    from engine.retrieval import RETRIEVAL_TOKENS

    parser = build_parser()
    for command in ("ask", "chat"):
        assert parser.parse_args([command, "m"]).retrieval_tokens == RETRIEVAL_TOKENS
        assert parser.parse_args([command, "m", "--retrieval-tokens", "1200"]).retrieval_tokens == 1200
        assert parser.parse_args([command, "m", "--retrieval-tokens", "0"]).retrieval_tokens == 0
    assert parser.parse_args(["bench", "--qa", "--retrieval-tokens", "400"]).retrieval_tokens == 400
    for bad, says in (("100", "at least 332 tokens"), ("lots", "a number of tokens, not 'lots'")):
        out = subprocess.run([sys.executable, "-m", "engine.cli", "ask", "m", "--retrieval-tokens", bad,
                              "--question", "q"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and says in out.stderr, out.stderr


# -- the real model ---------------------------------------------------------------------------
FACT = "The access code for the north gate is 4471."


@pytest.mark.slow
def test_ask_with_a_small_context_answers_a_long_document_by_retrieval(smollm2_path, tmp_path):
    from engine.engine import Engine

    engine = Engine.load(smollm2_path, kv="k6v4")
    doc = tmp_path / "manual.txt"
    paragraphs = GPL.split("\n\n")
    paragraphs.insert(len(paragraphs) * 2 // 3, FACT)
    doc.write_text("\n\n".join(paragraphs))
    n_tokens = len(engine.tokenizer.encode(doc.read_text()))
    assert 7500 <= n_tokens <= 8500
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "ask", str(smollm2_path), "--doc", str(doc), "--ctx", "2048",
         "--kv", "k6v4", "--question", "What is the access code for the north gate?",
         "--question", "What is the access code for the north gate?", "--max-tokens", "24", "--json"],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for key in ("model", "kv", "ctx", "overflow", "documents", "answers"):
        assert key in report
    assert report["ctx"] == 2048 and report["doc_mode"] == "auto"
    assert report["documents"][0]["mode"] == "retrieval" and report["documents"][0]["tokens"] == n_tokens
    first, second = report["answers"]
    for key in ("question", "text", "ids", "finish_reason", "stats"):
        assert key in first
    assert "4471" in first["text"]
    lines = doc.read_text().split("\n")
    fact_line = lines.index(FACT) + 1
    assert any(r["start"] <= fact_line <= r["end"] for r in first["retrieved"])
    assert all(r["tokens"] > 0 and r["score"] >= 0 and r["start"] <= r["end"] for r in first["retrieved"])
    assert first["stats"]["prompt_tokens"] <= 2048
    assert second["retrieved"] == first["retrieved"]
    assert second["stats"]["cached_tokens"] >= first["stats"]["prompt_tokens"] - 32
    refused = subprocess.run(
        [sys.executable, "-m", "engine.cli", "ask", str(smollm2_path), "--doc", str(doc), "--ctx", "2048",
         "--doc-mode", "whole", "--question", "What is the code?"],
        capture_output=True, text=True, timeout=900,
    )
    assert refused.returncode != 0 and "context holds 2,048" in refused.stderr


# -- Chinese, Japanese, Korean, Thai ----------------------------------------------------------
def test_unspaced_scripts_are_indexed_as_character_bigrams():
    assert retrieval.words("内存增长公式是什么？") == ["内存", "存增", "增长", "长公", "公式", "式是", "是什", "什么"]
    assert retrieval.words("东 and 京") == ["东", "京"]  # a lone character: a unigram
    assert retrieval.words("SmolLM2模型的 KV cache") == ["smollm2", "模型", "型的", "kv", "cache"]
    assert retrieval.words("東京タワー") == ["東京", "京タ", "タワ", "ワー"]
    assert retrieval.words("한국어 문서") == ["한국", "국어", "문서"]
    assert retrieval.words("ภาษาไทย") == ["ภา", "าษ", "ษา", "าไ", "ไท", "ทย"]  # vowel marks kept
    # Latin words as before
    assert retrieval.words("The access codes for gate 7") == ["access", "code", "gate", "7"]


def chinese_document(repeat: int = 2) -> tuple[str, list[dict]]:
    """The Chinese QA set: zh-filler.txt ``repeat`` times with its six facts at their depths."""
    from engine import bench

    facts = bench.read_facts(bench.QA_DIR / "facts-zh.json")
    filler = facts["filler"][0].read_text().strip().split("\n\n") * repeat
    for depth, fact in sorted(zip(facts["depths"], facts["facts"]), key=lambda x: -x[0]):
        filler.insert(round(depth * len(filler)), fact["fact"])
    return "\n\n".join(filler), facts["facts"]


def test_a_chinese_question_ranks_the_chunk_holding_its_fact_first():
    text, facts = chinese_document()
    assert len(text) > 4000
    index = DocumentIndex.build(text, len)  # about one token per character
    assert len(index.chunks) >= 12
    first = 0
    for fact in facts:
        best = retrieval.rank(fact["question"], [("镇志.txt", index)])[0]
        first += fact["fact"] in index.chunk_text(index.chunks[best.chunk])
    assert first >= 5, f"{first} of 6 facts ranked first"
