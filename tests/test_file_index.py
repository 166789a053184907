"""Plain-text files too large to hold as one string (over engine.documents.STREAM_BYTES): indexed
in a streamed pass into the same units, chunks and BM25 scores as their text would be, sections
read back from the file by offset, a file changed or removed after indexing said so without
losing anything, and (slow) a 200 MB file indexed within 200 MB of RSS growth and answered from
by `omlx ask`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from engine import documents
from engine.documents import DocumentFile, open_document, read_document
from engine.errors import DocumentError
from engine.file_index import FileIndex
from engine.retrieval import DocumentIndex, rank

from .test_retrieval import GPL, count_words, tiny  # noqa: F401  (tiny: the model fixture)

MiB = 1 << 20
FACTS = [
    ("The zephyrine lighthouse keeper is named Orvald Brisk.",
     "What is the name of the zephyrine lighthouse keeper?", "Orvald"),
    ("The access code for the north gate is 4471.",
     "What is the access code for the north gate?", "4471"),
    ("The marmalade festival is held every year in Tollbridge.",
     "Where is the marmalade festival held?", "Tollbridge"),
]


def awkward_text(seed: int = 1) -> str:
    """Text with what a file can hold: a BOM, CRLF and form feeds, blank lines of spaces,
    trailing blanks, lines longer than a chunk, doubled spaces, accents and Chinese."""
    rng = random.Random(seed)
    vocab = "alpha beta gamma delta library gate code fox 42 Café naïve 内存增长公式 résumé zebra".split()
    parts = []
    for _ in range(2500):
        k = rng.random()
        if k < 0.1:
            parts.append("\r\n")
        elif k < 0.15:
            parts.append("\f")
        elif k < 0.2:
            parts.append("   \t\n")
        elif k < 0.22:
            parts.append(" ".join(rng.choice(vocab) for _ in range(400)) + "  \n")
        elif k < 0.23:
            parts.append("a  b   c " * 50 + "\n")
        else:
            parts.append(" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 30)))
                         + rng.choice(["\n", "\r\n", " \n", "\n\n"]))
    return "\ufeff" + "".join(parts) + FACTS[0][0]


def write_planted(path, size: int) -> list[int]:
    """About ``size`` bytes of paragraphs of the GPL with FACTS planted at a quarter, half and
    three quarters of the way; returns their line numbers."""
    paragraphs = GPL.rstrip("\n").split("\n\n")
    half = "\n\n".join(paragraphs[:len(paragraphs) // 2]) + "\n\n"
    block = (GPL.rstrip("\n") + "\n\n").encode()
    copies = max(size // len(block), 4)
    at = {copies * (i + 1) // (len(FACTS) + 1): fact for i, (fact, _, _) in enumerate(FACTS)}
    lines = []
    with open(path, "wb") as f:
        line = 1
        for i in range(copies):
            if i in at:  # in the middle of this copy, as a paragraph of its own
                lines.append(line + half.count("\n"))
                f.write((half + at[i] + "\n\n").encode())
                f.write(block[len(half.encode()):])
                line += block.count(b"\n") + 2
            else:
                f.write(block)
                line += block.count(b"\n")
    return lines


def test_a_streamed_file_gives_the_units_chunks_and_scores_its_text_does(tmp_path):
    path = tmp_path / "awkward.txt"
    path.write_bytes(awkward_text().encode())
    text = read_document(path)
    whole = DocumentIndex.build(text, count_words, chunk_tokens=120, overlap_tokens=30)
    opened = open_document(path, stream_bytes=1024)
    assert isinstance(opened, DocumentFile) and opened.size == path.stat().st_size
    streamed = FileIndex.open(opened, count_words, "model-a", chunk_tokens=120, overlap_tokens=30,
                              directory=tmp_path / "index")
    assert not streamed.loaded and len(streamed.chunks) > 100
    assert list(streamed.units) == whole.units  # text, lines, paragraphs and tokens, read back
    assert list(streamed.chunks) == whole.chunks
    assert streamed.n_tokens == sum(u.n_tokens for u in whole.units)
    for question in ("zephyrine lighthouse keeper", "zebra gamma", "内存增长", "Café naïve library",
                     "nothing matches"):
        assert np.allclose(streamed.scores(question), whole.scores(question), rtol=1e-4, atol=1e-5)
    best = rank(FACTS[0][1], [("awkward.txt", streamed)])[0]
    assert FACTS[0][0] in streamed.chunk_text(streamed.chunks[best.chunk])
    again = FileIndex.open(opened, lambda s: 1 / 0, "model-a", chunk_tokens=120, overlap_tokens=30,
                           directory=tmp_path / "index")
    assert again.loaded and list(again.chunks) == whole.chunks


def test_opening_a_large_file_checks_it_as_reading_does(tmp_path):
    late = tmp_path / "late.txt"
    late.write_bytes(b"plain words on a line\n" * 200_000 + b"\x00tail")
    with pytest.raises(DocumentError, match=r"late\.txt has binary data \(a NUL byte\) after 4 MB"):
        open_document(late, stream_bytes=MiB)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"words\n" * 400_000 + "Caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DocumentError, match=r"latin\.txt is not UTF-8 text \(byte 2400003\)"):
        open_document(latin, stream_bytes=MiB)
    small = tmp_path / "small.txt"
    small.write_text("Short and sweet.\n")
    assert open_document(small, stream_bytes=MiB) == read_document(small)
    big = tmp_path / "big.txt"
    big.write_bytes(b"words on a line\n" * 100_000)
    opened = open_document(big, stream_bytes=MiB)
    assert isinstance(opened, DocumentFile) and opened.name == "big.txt"
    with pytest.raises(DocumentError, match=r"big\.txt is 2 MB: documents sent whole can be up to 64 MB"):
        documents.document_text(None, opened, None)  # what a remote server's session is given


def test_a_session_reads_a_large_file_by_retrieval_and_says_when_it_changed(tiny, tmp_path, monkeypatch):  # noqa: F811
    from engine.session import Session

    monkeypatch.setattr(documents, "STREAM_BYTES", MiB)
    path = tmp_path / "big.txt"
    fact_lines = write_planted(path, 3 * MiB)
    assert path.stat().st_size > 2 * MiB

    whole = Session(tiny, ctx=1024)
    with pytest.raises(DocumentError, match=r"big\.txt is 3 MB: too large to read whole"):
        whole.add_document(path)
    assert whole.documents == []

    session = Session(tiny, ctx=1024, doc_mode="auto")
    seen = []
    doc = session.add_document(path, progress=lambda done, total: seen.append((done, total)))
    assert doc.file is not None and doc.text == "" and doc.mode == "retrieval" and doc.cached
    assert doc.n_tokens == doc.index.n_tokens > 100 * session.ctx
    assert seen and seen[-1] == (1, 1)
    with pytest.raises(DocumentError, match="read them by retrieval"):
        session.set_doc_mode("whole")
    for (fact, question, _), line in zip(FACTS, fact_lines):
        gen = session.ask(question, max_tokens=4)
        assert gen.result.stats.prompt_tokens + 4 <= session.ctx
        assert any(fact in s.text for s in session.last_sections)
        assert any(r["start"] <= line <= r["end"] for r in gen.retrieved), (line, gen.retrieved)
    session.send("Who keeps the zephyrine lighthouse?", max_tokens=4).result

    # the file changes after indexing: said, and the session is as it was
    original = path.read_bytes()
    path.write_bytes(original.replace(b"Orvald Brisk", b"Orvald Brusk"))
    messages = list(session.messages)
    with pytest.raises(DocumentError, match=r"big\.txt changed since it was indexed"):
        session.send(FACTS[0][1], max_tokens=4)
    assert session.messages == messages and session.documents == [doc]
    path.write_bytes(original + b"more\n")
    with pytest.raises(DocumentError, match=r"big\.txt changed since it was indexed \(3 MB then"):
        session.ask(FACTS[1][1], max_tokens=4)
    path.unlink()
    with pytest.raises(DocumentError, match=r"big\.txt is no longer at .*: its sections cannot be read"):
        session.ask(FACTS[1][1], max_tokens=4)
    path.write_bytes(original)  # back: answered again, nothing lost
    assert session.ask(FACTS[1][1], max_tokens=4).retrieved

    # another session loads the saved index instead of reading the file again
    later = Session(tiny, ctx=1024, doc_mode="retrieval")
    assert later.add_document(path).index.loaded


RSS_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from engine.engine import Engine
    from engine.memory import rss_bytes
    from engine.retrieval import rank
    from engine.session import Session

    def high_water():  # VmHWM: ru_maxrss carries a large parent's (pytest's) peak across fork and exec
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024

    model, path, questions = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    session = Session(Engine.load(model, kv="k6v4"), ctx=2048, doc_mode="auto")
    session.engine.model_id  # the model file's sha256 (read through its mapping): not the document's
    base = rss_bytes()
    t = time.perf_counter()
    doc = session.add_document(path, prefill=False)
    seconds = time.perf_counter() - t
    indexed = high_water() - base
    best = [doc.index.chunk_text(doc.index.chunks[rank(q, [(doc.name, doc.index)])[0].chunk])
            for q in questions]
    peak = high_water()
    print(json.dumps({"growth": peak - base, "indexed": indexed, "base": base, "seconds": seconds, "mode": doc.mode,
                      "tokens": doc.n_tokens, "chunks": len(doc.index.chunks), "best": best}))
""")


@pytest.mark.slow
def test_a_200_mb_text_file_is_indexed_within_200_mb_and_answered_from(smollm2_path, tmp_path):
    path = tmp_path / "huge.txt"
    fact_lines = write_planted(path, 200 * MiB)
    assert 195 * MiB < path.stat().st_size <= 200 * MiB
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(smollm2_path), str(path),
                          json.dumps([q for _, q, _ in FACTS])],  # kernels ready before the baseline
                         capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "OMLX_KERNEL_WARMUP": "wait"})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    print(f"200 MB: indexed in {report['seconds']:.0f} s, peak RSS growth "
          f"{report['growth'] / MiB:.0f} MiB over {report['base'] / MiB:.0f} MiB "
          f"({report['indexed'] / MiB:.0f} MiB when indexed), "
          f"{report['chunks']:,} chunks, {report['tokens']:,} tokens")
    assert report["mode"] == "retrieval" and report["tokens"] > 40_000_000
    assert report["growth"] <= 200 * MiB, report
    for (fact, _, _), best in zip(FACTS, report["best"]):
        assert fact in best

    # `omlx ask` on it: the saved index is loaded, the answer is read from the file's sections
    ask = subprocess.run(
        [sys.executable, "-m", "engine.cli", "ask", str(smollm2_path), "--doc", str(path), "--ctx", "2048",
         "--kv", "k6v4", "--question", FACTS[1][1], "--max-tokens", "24", "--json"],
        capture_output=True, text=True, timeout=1800)
    assert ask.returncode == 0, ask.stderr
    answer = json.loads(ask.stdout)
    assert answer["documents"][0]["mode"] == "retrieval"
    assert answer["documents"][0]["tokens"] == report["tokens"]
    first = answer["answers"][0]
    assert any(r["start"] <= fact_lines[1] <= r["end"] for r in first["retrieved"]), first["retrieved"]
    assert FACTS[1][2] in first["text"], first["text"]
