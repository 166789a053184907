"""Sessions on the real SmolLM2: pinned documents, prefix reuse (memory and disk), multi-turn
reuse, the overflow policies over many rounds, and documents that are refused."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine.engine import Engine
from engine.sampling import log_softmax
from engine.session import ANSWER_RESERVE, DocumentError, Session, read_document

from .conftest import DATA

pytestmark = pytest.mark.slow  # real-model turns, overflow rounds and CLI subprocesses

GPL = (DATA / "texts" / "gpl-3.txt").read_text()


def doc_text(engine: Engine, n_tokens: int) -> str:
    """The first ~n_tokens tokens of the GPL, cut at a line end."""
    ids = engine.tokenizer.encode(GPL, add_bos=False)[:n_tokens]
    text = engine.tokenizer.decode(ids)
    return text[: text.rfind("\n")]


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return Engine.load(smollm2_path, kv="full")


def fresh_engine(path, kv):
    e = Engine.load(path, kv=kv)
    return e


def test_cache_hit_answers_are_the_same_tokens_with_16_bit_kv(smol):
    session = Session(smol, ctx=2048)
    doc = session.add_document(text=doc_text(smol, 600), name="gpl.txt")
    assert doc.cached and doc.n_tokens > 550
    questions = ["What does this license protect?", "Can I sell copies of the program?"]
    for q in questions:
        hit = session.ask(q, max_tokens=24).result
        assert hit.stats.cached_tokens >= 0.99 * doc.n_tokens
        assert hit.stats.cache_source == "memory"
        assert hit.stats.pinned_tokens >= doc.n_tokens
        ids, _ = session.render([{"role": "user", "content": q}])
        cold = smol.generate(ids, max_tokens=24, cache=smol.new_cache())  # no reuse at all
        assert hit.ids == cold.ids, q


def test_cache_hit_with_quantized_kv_is_as_close_as_eval_kv_says(smollm2_path):
    engine = fresh_engine(smollm2_path, "k4v4")
    # blocks computed in this layout (a master copy's derived blocks are compared with direct
    # ones by tests/test_master_copy.py)
    engine.master_copies = False
    session = Session(engine, ctx=2048)
    session.add_document(text=doc_text(engine, 400), name="gpl.txt")
    ids, _ = session.render([{"role": "user", "content": "Who may copy the program, and under which terms?"}])
    seq, reused, _ = session.kv.sequence_for(ids, session.prefix_tokens())
    assert reused >= 380
    hit = engine.model.forward(np.asarray(ids[reused:]), seq, "all")
    cold = engine.model.forward(np.asarray(ids), engine.new_cache(), "all")[reused:]
    # The reused blocks are the blocks a cold prefill writes, but a different chunking moves
    # float rounding enough to flip a few 4-bit codes: the two runs may differ by a little,
    # never by more than k4v4 itself differs from 16-bit KV (eval-kv at 2,048 tokens: mean KL
    # 0.00725, docs/performance.md).
    lp_hit, lp_cold = log_softmax(hit), log_softmax(cold)
    kl = float(np.mean(np.sum(np.exp(lp_cold) * (lp_cold - lp_hit), axis=-1)))
    assert kl < 0.00725
    assert np.mean(hit.argmax(-1) == cold.argmax(-1)) >= 0.9


def test_multi_turn_reuses_the_previous_conversation_and_edits_reuse_up_to_the_edit(smol):
    session = Session(smol, system_prompt="You are brief.", ctx=2048)
    first = session.send("Name a colour.", max_tokens=12).result
    second = session.send("Name another one.", max_tokens=12).result
    previous_prompt = first.stats.prompt_tokens
    assert second.stats.cached_tokens >= previous_prompt + first.stats.generated_tokens - 2
    assert second.stats.prompt_tokens - second.stats.cached_tokens < 30
    regen = session.regenerate(max_tokens=12).result
    assert regen.stats.cached_tokens == regen.stats.prompt_tokens - 1 or \
        regen.stats.cached_tokens >= second.stats.prompt_tokens - 1
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    edited = session.edit(2, "Name a fruit.", max_tokens=12).result
    assert edited.stats.cached_tokens >= previous_prompt + first.stats.generated_tokens - 2
    assert session.messages[2]["content"] == "Name a fruit."


def test_a_new_process_loads_the_pinned_document_from_disk(smollm2_path, tmp_path):
    text = doc_text(smol_engine := fresh_engine(smollm2_path, "k6v4"), 500)
    (tmp_path / "doc.txt").write_text(text)
    first = Session(smol_engine)
    doc = first.add_document(tmp_path / "doc.txt")
    cold = first.ask("What is this?", max_tokens=4).result
    del first, smol_engine
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "ask", str(smollm2_path), "--doc", str(tmp_path / "doc.txt"),
         "--question", "What is this?", "--question", "Is it free?", "--max-tokens", "4", "--json",
         "--kv", "k6v4"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    a1, a2 = report["answers"]
    assert a1["stats"]["cache_source"] == "disk" and "loaded" in out.stderr
    assert a1["stats"]["cached_tokens"] >= 0.99 * doc.n_tokens
    assert a1["ids"] == cold.ids  # the same blocks, read back
    assert a2["stats"]["cache_source"] == "memory"
    assert report["documents"][0]["tokens"] == doc.n_tokens
    assert "cache hit:" in out.stderr


def test_overflow_over_twenty_rounds_keeps_the_pinned_document(smollm2_path):
    engine = fresh_engine(smollm2_path, "k6v4")
    session = Session(engine, ctx=2048, overflow="rolling")
    doc = session.add_document(text=doc_text(engine, 1000), name="gpl.txt")
    cache = session.kv.prefix_cache()
    pinned = list(session.kv.pinned_keys)
    assert len(pinned) == session.prefix_tokens() // cache.B
    pinned_blocks = [list(cache.entries[k].blocks) for k in pinned]
    filler = doc_text(engine, 90).replace("\n", " ")
    dropped = 0
    for i in range(20):
        result = session.send(f"Round {i}. Say something about: {filler}", max_tokens=40).result
        assert result.finish_reason in ("stop", "length")
        dropped += result.stats.dropped_tokens
        live = session._live
        assert live.offset <= 2048
        # The pinned document's blocks are never evicted, moved or dropped.
        assert [list(cache.entries[k].blocks) for k in pinned] == pinned_blocks
        assert all(cache.entries[k].pins for k in pinned)
        for layer, table in zip(live.layers, zip(*pinned_blocks)):
            assert layer.block_table[: len(pinned)] == list(table)
        assert live.token_ids[: session.prefix_tokens()] == session.render([])[0][: session.prefix_tokens()]
    assert dropped >= 2 * 512  # the context overflowed several times
    assert doc.cached


def test_documents_that_cannot_be_used_are_refused_clearly(smol, tmp_path):
    session = Session(smol, ctx=1024)
    with pytest.raises(DocumentError, match=r"gpl-3.txt is [\d,]+ tokens.*context holds 1,024"):
        session.add_document(DATA / "texts" / "gpl-3.txt")
    assert session.documents == []
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(DocumentError, match="binary"):
        session.add_document(binary)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DocumentError, match="not UTF-8"):
        read_document(latin)
    empty = tmp_path / "empty.md"
    empty.write_text("  \n")
    with pytest.raises(DocumentError, match="empty"):
        read_document(empty)
    fake_pdf = tmp_path / "broken.pdf"
    fake_pdf.write_bytes(b"%PDF-1.4\n this is not really a pdf")
    with pytest.raises(DocumentError, match="broken.pdf"):
        read_document(fake_pdf)
    with pytest.raises(DocumentError, match="cannot read"):
        read_document(tmp_path / "missing.txt")
    assert ANSWER_RESERVE < 1024


def _minimal_pdf(text: str) -> bytes:
    """A one-page PDF with `text` in Helvetica (hand-built: offsets in the xref must be exact)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length " + str(len(stream)).encode() + b" >>\nstream\n" + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def test_pdf_and_markdown_documents_are_read(tmp_path):
    pdf = tmp_path / "note.pdf"
    pdf.write_bytes(_minimal_pdf("The launch code is 4242."))
    assert "launch code is 4242" in read_document(pdf)
    md = tmp_path / "notes.md"
    md.write_text("# Title\r\n\r\nSome *markdown*.\r\n")
    assert read_document(md) == "# Title\n\nSome *markdown*.\n"


def test_chat_command_pins_documents_and_reports_reuse(smollm2_path, tmp_path):
    doc = tmp_path / "notes.md"
    doc.write_text("# Notes\n\nThe project's code name is BLUE HERON. It ships in March.\n")
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "chat", str(smollm2_path), "--doc", str(doc), "--ctx", "1024",
         "--overflow", "attention", "--max-tokens", "6", "--temperature", "0"],
        input="What is the code name?\nWhen does it ship?\n/quit\n", capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "pinned notes.md" in out.stderr and "overflow attention" in out.stderr
    stats = [line for line in out.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 2
    assert "(memory)" in stats[1]  # the second turn continues the first
    bad = subprocess.run([sys.executable, "-m", "engine.cli", "chat", str(smollm2_path), "--overflow", "rolling",
                          "--ctx", "10"], input="", capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "ctx must be between 64" in bad.stderr


def test_rolling_context_keeps_perplexity_close_to_a_full_context(smollm2_path):
    from engine.kv.config import parse_kv

    engine = fresh_engine(smollm2_path, "k6v4")
    ids = engine.tokenizer.encode(GPL, add_bos=True)[:1601]

    def perplexity(cache) -> float:
        return float(np.exp(-np.mean(engine.teacher_forced(ids, cache=cache).next_logprob)))

    full = perplexity(engine.new_cache())
    rolling_cache = engine.model.new_cache(parse_kv("k6v4"), limit=512, overflow="rolling")
    rolling = perplexity(rolling_cache)
    assert rolling_cache.dropped_tokens >= 1000 and rolling_cache.offset <= 512
    assert rolling < 1.5 * full, (rolling, full)  # the bench's bar, at 1,600 tokens and a 512 context
