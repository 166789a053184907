"""Reading documents: each kind of file that cannot be used gets its own message, memory stays
bounded while reading, a refused file leaves the session (conversation and other documents)
as it was, and PDF pages keep their numbers."""

from __future__ import annotations

import os
import tracemalloc

import pytest

from engine.documents import MAX_DOCUMENT_BYTES, PAGE_BREAK, join_pages, plain_text, read_document
from engine.errors import DocumentError

from .tiny_gguf import write_tiny_model

MiB = 1 << 20


def pdf_bytes(pages: list[str | None]) -> bytes:
    """A PDF with one page per entry: the text in Helvetica, or None for a page that only draws
    a filled rectangle (no text layer, as a scan has). Hand-built: xref offsets must be exact."""
    n = len(pages)
    page_ids = [3 + 2 * i for i in range(n)]
    font_id = 3 + 2 * n
    objects: dict[int, bytes] = {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        2: b"<< /Type /Pages /Kids [" + b" ".join(f"{p} 0 R".encode() for p in page_ids)
           + f"] /Count {n} >>".encode(),
        font_id: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    }
    for i, text in enumerate(pages):
        page, content = page_ids[i], page_ids[i] + 1
        stream = (f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET" if text is not None
                  else "0.5 g 72 72 400 600 re f").encode()
        objects[page] = (f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {content} 0 R "
                         f"/Resources << /Font << /F1 {font_id} 0 R >> >> >>").encode()
        objects[content] = b"<< /Length " + str(len(stream)).encode() + b" >>\nstream\n" + stream + b"\nendstream"
    out, offsets = bytearray(b"%PDF-1.4\n"), {}
    for i in sorted(objects):
        offsets[i] = len(out)
        out += f"{i} 0 obj\n".encode() + objects[i] + b"\nendobj\n"
    xref = len(out)
    size = max(objects) + 1
    out += f"xref\n0 {size}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offsets[i]:010d} 00000 n \n".encode() for i in range(1, size))
    out += f"trailer\n<< /Size {size} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def peak_traced(fn) -> int:
    """Peak bytes Python allocated while ``fn`` ran (it is expected to raise DocumentError)."""
    tracemalloc.start()
    try:
        with pytest.raises(DocumentError) as info:
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    fn.error = str(info.value)
    return peak


def test_an_empty_document_is_refused_as_empty(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DocumentError, match=r"empty\.txt is empty \(0 bytes\)"):
        read_document(empty)
    blank = tmp_path / "blank.md"
    blank.write_text(" \n\n\t\n")
    with pytest.raises(DocumentError, match=r"blank\.md is empty \(it holds only blank space\)"):
        read_document(blank)


def test_a_200_mb_text_file_is_refused_without_reading_it(tmp_path):
    big = tmp_path / "huge.txt"
    line = b"All work and no play makes a long document.\n"
    with big.open("wb") as f:  # 200 MB of real text, written a block at a time
        block = line * (MiB // len(line))
        while f.tell() + len(block) <= 200 * MiB:
            f.write(block)
        f.write(line * ((200 * MiB - f.tell()) // len(line)))
    assert 199 * MiB < big.stat().st_size <= 200 * MiB and big.stat().st_size > MAX_DOCUMENT_BYTES

    def read():
        read_document(big)

    peak = peak_traced(read)
    assert "huge.txt is 200 MB" in read.error and "up to 64 MB" in read.error, read.error
    assert peak < 4 * MiB, peak


def test_text_is_read_in_blocks_and_binary_data_stops_the_read(tmp_path):
    # 24 MB of text, then a NUL: refused at the block holding it, before the text is joined
    late = tmp_path / "late.txt"
    with late.open("wb") as f:
        f.write(b"plain words on a line\n" * (24 * MiB // 22))
        f.write(b"\x00\x01binary tail")

    def read():
        read_document(late)

    peak = peak_traced(read)
    assert "late.txt has binary data (a NUL byte) after 24 MB of text" in read.error, read.error
    assert peak < 120 * MiB, peak  # the decoded blocks read so far, never a joined copy of them


def test_a_binary_file_renamed_txt_is_refused_as_binary(tmp_path):
    png = tmp_path / "photo.txt"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + os.urandom(4096))
    with pytest.raises(DocumentError, match=r"photo\.txt looks like a binary file, not a document"):
        read_document(png)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DocumentError, match=r"latin\.txt is not UTF-8 text \(byte 3\)"):
        read_document(latin)


def test_a_pdf_without_a_text_layer_is_refused_as_a_scan(tmp_path):
    scan = tmp_path / "scan.pdf"
    scan.write_bytes(pdf_bytes([None, None]))
    with pytest.raises(DocumentError, match=r"scan\.pdf has no text layer \(2 pages of images"):
        read_document(scan)
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4\nnot really a pdf")
    with pytest.raises(DocumentError, match=r"broken\.pdf is not a readable PDF"):
        read_document(broken)


def test_pdf_pages_keep_their_numbers_and_render_as_before(tmp_path):
    pdf = tmp_path / "report.pdf"
    pdf.write_bytes(pdf_bytes(["First page words.", None, "Third page words."]))
    text = read_document(pdf)
    assert text.count(PAGE_BREAK) == 2  # one per page started, the empty one included
    assert plain_text(text) == "First page words.\n\nThird page words."
    assert join_pages(["", "a", "", "b"]) == "\fa\n\n\f\fb"


def test_a_refused_document_leaves_the_session_as_it_was(tmp_path):
    from engine.engine import Engine
    from engine.session import Session

    model = write_tiny_model(tmp_path / "tiny.gguf", context_length=4096)
    session = Session(Engine.load(model, kv="k8v8"), ctx=2048, doc_mode="auto")
    good = tmp_path / "notes.txt"
    good.write_text("The meeting is on Tuesday.\n")
    doc = session.add_document(good, prefill=False)
    session.load_messages([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
    scan = tmp_path / "scan.pdf"
    scan.write_bytes(pdf_bytes([None]))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\x00" * 100)
    big = tmp_path / "big.txt"
    with big.open("wb") as f:
        f.truncate(200 * MiB)  # sparse: 200 MB on paper
    messages = [dict(m) for m in session.messages]
    for bad in (scan, empty, binary, big):
        with pytest.raises(DocumentError, match=bad.name):
            session.add_document(bad, prefill=False)
        assert session.documents == [doc] and session.messages == messages
