"""Reading documents: plain text (.txt, .md and other UTF-8 text) and PDF, with a specific
DocumentError for each kind of file that cannot be used.

Memory stays bounded while reading: the size is checked before anything is read (a file larger
than MAX_DOCUMENT_BYTES is refused without being opened for reading), text is decoded in blocks
of READ_BLOCK bytes that are checked as they come (a NUL byte or invalid UTF-8 stops the read at
that block), and only a file that passes is joined into the one string the session keeps.

A plain-text file larger than STREAM_BYTES is not held as one string: :func:`open_document`
checks it in one bounded pass (the same messages: binary data, not UTF-8) and returns a
:class:`DocumentFile`, which retrieval indexes in a streamed pass (engine.retrieval.FileIndex)
and reads sections back from by byte offset. A PDF over MAX_DOCUMENT_BYTES is still refused.

A PDF's pages are joined by a blank line with a form feed where each page starts (see
:func:`join_pages`), so retrieval can name pages; :func:`plain_text` removes the marks, which
leaves the pages joined by a blank line (the text a whole document is rendered with).
"""

from __future__ import annotations

import codecs
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import DocumentError

MiB = 1 << 20
MAX_DOCUMENT_BYTES = 64 * MiB  # a plain-text file (UTF-8) or a PDF, on disk
MAX_PDF_TEXT_CHARS = 64 * MiB  # text extracted from a PDF (a small file can hold a lot of text)
STREAM_BYTES = MAX_DOCUMENT_BYTES  # a plain-text file larger than this is streamed (DocumentFile)
READ_BLOCK = 1 * MiB
BINARY_PROBE_BYTES = 64 * 1024
PAGE_BREAK = "\f"


def size_text(n: int) -> str:
    """A byte count as the messages say it: "200 MB", "12 KB"."""
    return f"{n / MiB:,.0f} MB" if n >= MiB else f"{n / 1024:,.0f} KB"


@dataclass(frozen=True)
class DocumentFile:
    """A plain-text file too large to hold as one string (over STREAM_BYTES): checked (UTF-8
    throughout, no binary data) when opened, read by retrieval from the file itself."""

    path: str
    name: str
    size: int
    sha256: str  # of the file's bytes when it was opened

    @property
    def size_text(self) -> str:
        return size_text(self.size)


def document_text(source: str | Path | None, text: "str | DocumentFile | None", name: str | None
                  ) -> tuple[str, str]:
    """(name, text) of a document given as a file or as text (`add_document`'s arguments, local or
    remote): the file read with `read_document` when no text is given; the name defaults to the
    file's name, else "document".

    Raises:
        DocumentError: neither given, the file unreadable, or the text empty.
    """
    if isinstance(text, DocumentFile):
        raise DocumentError(f"{text.name} is {text.size_text}: documents sent whole can be up to "
                            f"{size_text(MAX_DOCUMENT_BYTES)} (a local model reads larger ones by "
                            "retrieval)")
    if text is None:
        if source is None:
            raise DocumentError("add_document needs a file or text")
        text = read_document(source)
    if not text.strip():
        raise DocumentError(f"{name or 'the document'} is empty")
    return name or (Path(source).name if source is not None else "document"), text


def document_source(source: str | Path | None, text: "str | DocumentFile | None", name: str | None
                    ) -> "tuple[str, str | DocumentFile]":
    """As :func:`document_text`, but a plain-text file over ``STREAM_BYTES`` (or a DocumentFile
    given as ``text``) comes back as a :class:`DocumentFile` instead of its text."""
    if isinstance(text, DocumentFile):
        return name or text.name, text
    if text is None and source is not None:
        opened = open_document(source)
        if isinstance(opened, DocumentFile):
            return name or opened.name, opened
        text = opened
    return document_text(source, text, name)


def open_document(path: str | Path, *, stream_bytes: int | None = None) -> "str | DocumentFile":
    """:func:`read_document`'s text, or for a plain-text file over ``stream_bytes`` (default
    STREAM_BYTES) a :class:`DocumentFile`, after one pass over the file in READ_BLOCK blocks
    that checks it as :func:`read_document` does and takes its sha256.

    Raises:
        DocumentError: as :func:`read_document` (a PDF over MAX_DOCUMENT_BYTES is refused).
    """
    path = Path(path)
    limit = STREAM_BYTES if stream_bytes is None else int(stream_bytes)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
    except OSError:
        return read_document(path)  # its message for a missing or unreadable file, or a folder
    if size <= limit or path.suffix.lower() == ".pdf" or head.startswith(b"%PDF-"):
        return read_document(path)
    digest = hashlib.sha256()
    blank = True
    for block, _offset in _checked_blocks(path):
        digest.update(block)
        if blank and block.strip():
            blank = False
    if blank:
        raise DocumentError(f"{path.name} is empty (it holds only blank space)")
    return DocumentFile(str(path), path.name, size, digest.hexdigest())


def _checked_blocks(path: Path) -> Iterator[tuple[bytes, int]]:
    """The file's bytes in READ_BLOCK blocks with their offsets, each checked as it comes: no
    NUL byte (binary data), valid UTF-8 (a leading BOM allowed).

    Raises:
        DocumentError: binary data, not UTF-8, or the file unreadable.
    """
    for block, offset, _text in _decoded_blocks(path):
        if block:
            yield block, offset


def _decoded_blocks(path: Path) -> Iterator[tuple[bytes, int, str]]:
    """(block, its offset, its text) for each READ_BLOCK block of the file, checked as in
    `_checked_blocks`, then (b"", the file's size, the decoder's last text) at its end."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    offset = 0
    try:
        with path.open("rb") as f:
            while True:
                block = f.read(READ_BLOCK)
                final = not block
                _check_block(path, block, offset)
                try:
                    text = decoder.decode(block, final=final)
                except UnicodeDecodeError as exc:
                    raise DocumentError(
                        f"{path.name} is not UTF-8 text (byte {offset + exc.start}): save it as UTF-8, "
                        "or use .txt, .md or .pdf") from None
                yield block, offset, text
                if final:
                    return
                offset += len(block)
    except OSError as exc:
        raise DocumentError(f"cannot read {path.name}: {exc.strerror or exc}") from None


def _check_block(path: Path, block: bytes, offset: int) -> None:
    if offset < BINARY_PROBE_BYTES and b"\x00" in block[:BINARY_PROBE_BYTES - offset]:
        raise DocumentError(
            f"{path.name} looks like a binary file, not a document (use .txt, .md or .pdf)")
    if b"\x00" in block:
        at = offset + block.index(b"\x00")
        raise DocumentError(
            f"{path.name} has binary data (a NUL byte) after {size_text(at)} of "
            "text: it is not a plain-text document")


def read_document(path: str | Path) -> str:
    """The text of a .txt / .md (or other plain text) or .pdf file (a PDF's pages joined by
    :func:`join_pages`).

    Raises:
        DocumentError: missing or unreadable, empty, larger than MAX_DOCUMENT_BYTES, binary,
            not UTF-8 text, or a PDF that cannot be parsed or has no text layer.
    """
    path = Path(path)
    if path.is_dir():
        raise DocumentError(f"{path.name} is a folder, not a document")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise DocumentError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    if size == 0:
        raise DocumentError(f"{path.name} is empty (0 bytes)")
    if size > MAX_DOCUMENT_BYTES:
        raise DocumentError(
            f"{path.name} is {size_text(size)}; documents up to {size_text(MAX_DOCUMENT_BYTES)} can "
            "be read (split it into smaller files)"
        )
    if path.suffix.lower() == ".pdf" or head.startswith(b"%PDF-"):
        return _pdf_text(path)
    return _plain_text(path)


def _plain_text(path: Path) -> str:
    parts = [text for _block, _offset, text in _decoded_blocks(path)]
    text = "".join(parts)
    del parts
    if not text.strip():
        raise DocumentError(f"{path.name} is empty (it holds only blank space)")
    # a form feed in a text file is not a page mark of ours: PDF pages are the only pages
    return text.replace("\r\n", "\n").replace(PAGE_BREAK, "\n")


def _pdf_text(path: Path) -> str:
    try:
        from pypdf import PdfReader
        from pypdf.errors import PdfReadError
    except ImportError:  # pragma: no cover - a declared dependency
        raise DocumentError("reading PDF files needs the 'pypdf' package") from None
    pages: list[str] = []
    chars = 0
    try:
        with path.open("rb") as f:
            reader = PdfReader(f)
            n_pages = len(reader.pages)
            for page in reader.pages:
                text = (page.extract_text() or "").replace(PAGE_BREAK, "\n").strip()
                chars += len(text)
                if chars > MAX_PDF_TEXT_CHARS:
                    raise DocumentError(
                        f"{path.name} holds more than {size_text(MAX_PDF_TEXT_CHARS)} of text; "
                        "split it into smaller files")
                pages.append(text)
    except DocumentError:
        raise
    except OSError as exc:
        raise DocumentError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    except (PdfReadError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise DocumentError(f"{path.name} is not a readable PDF ({exc})") from None
    if not any(pages):
        raise DocumentError(
            f"{path.name} has no text layer ({n_pages} page{'s' if n_pages != 1 else ''} of images, "
            "e.g. a scan): run OCR on it first, or paste its text into a .txt file")
    return join_pages(pages)


def read_lines(path: str | Path, start: int, end: int) -> str:
    """Lines ``start``..``end`` (1-based, as retrieval numbers them: a form feed ends a line too)
    of a plain-text file, read a block at a time (a DocumentFile's section, shown again).

    Raises:
        DocumentError: the file cannot be read, or is not UTF-8 there.
    """
    path = Path(path)
    out: list[bytes] = []
    line_no, rest = 0, b""
    try:
        with path.open("rb") as f:
            if f.read(3) != codecs.BOM_UTF8:
                f.seek(0)
            while line_no < end:
                block = f.read(READ_BLOCK)
                data = rest + block.replace(b"\f", b"\n")
                breaks = data.count(b"\n")
                if block and line_no + breaks < start:  # all before the lines asked for
                    line_no += breaks
                    rest = data[data.rfind(b"\n") + 1:] if breaks else data
                    continue
                lines = data.split(b"\n")
                rest = lines.pop() if block else b""
                if not block:
                    lines.append(rest)
                for raw in lines:
                    line_no += 1
                    if start <= line_no <= end:
                        out.append(raw.rstrip(b"\r"))
                if not block:
                    break
    except OSError as exc:
        raise DocumentError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    try:
        return b"\n".join(out).decode("utf-8")
    except UnicodeDecodeError:
        raise DocumentError(f"{path.name} is not UTF-8 text there any more") from None


def join_pages(pages: list[str]) -> str:
    """Pages' texts as one document: non-empty pages joined by a blank line, with one form feed
    per page started before each (so the number of form feeds before a character is its page
    number minus one, pages without text included); without the form feeds this is exactly the
    non-empty pages joined by "\n\n"."""
    out: list[str] = []
    breaks = 0
    for number, page in enumerate(pages):
        if number:
            breaks += 1
        if page:
            out.append(("\n\n" if out else "") + PAGE_BREAK * breaks + page)
            breaks = 0
    return "".join(out)


def plain_text(text: str) -> str:
    """The text as a whole document is rendered: without the page marks."""
    return text.replace(PAGE_BREAK, "")


__all__ = ["read_document", "open_document", "document_source", "DocumentFile", "STREAM_BYTES", "plain_text",
           "DocumentError", "MAX_DOCUMENT_BYTES", "PAGE_BREAK", "join_pages", "size_text", "read_lines"]
