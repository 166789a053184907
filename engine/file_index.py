"""Retrieval over a plain-text file too large to hold as one string (engine.documents.DocumentFile,
files over documents.STREAM_BYTES), built in one streamed pass with bounded memory.

The file is read in blocks and cut into the same units and chunks as the text would be by
engine.retrieval (the same paragraphs, pieces, line numbers, packing and words: a test holds the
two to each other), but a unit keeps its byte offset and length in the file instead of its text,
and the BM25 statistics go to disk as they come:

    units.bin        a record per unit: lines, paragraph, tokens, byte offset and length, and the
                     crc32 of its text (a unit read back that no longer matches is refused)
    chunks.npy       first and last unit and tokens per chunk; lengths.npy: its words (BM25's dl)
    postings/NNN     (term, chunk, tf) records, a file per PARTITIONS-th of the terms: a term is
                     the crc32 of the word, so no vocabulary is held; a question reads the one
                     partition file per word it has (about 1/PARTITIONS of the postings)
    meta.json        the counts, the average chunk length, the file's size and sha256

Scores are BM25 as bm25s computes them by default ("lucene": k1 1.5, b 0.75). The folder is
saved in the retrieval cache under the file's sha256 (as an index of a text is under its text's),
the model and the chunking parameters, so opening the file again loads it. A chunk's text is
read from the file when a question retrieves it: a file that was removed or changed since says
so (DocumentError), and the session and its other documents stay as they were.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import shutil
import tempfile
import threading
import zlib
from array import array
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from .documents import READ_BLOCK, DocumentFile, size_text
from .errors import DocumentError
from .retrieval import (
    CHUNK_TOKENS, OVERLAP_TOKENS, Chunk, DocumentIndex, Unit, index_dir, pack_texts, paragraph_pieces,
    words,
)

log = logging.getLogger("omlx.retrieval")

FILE_INDEX_FORMAT = 1
PARTITIONS = 256
FLUSH_POSTINGS = 1 << 19  # postings held before they are written to their partitions
READ_POSTINGS = 1 << 18   # postings read from a partition file at a time
K1, B = 1.5, 0.75
UNIT_DTYPE = np.dtype([("start", "<i8"), ("end", "<i8"), ("paragraph", "<i8"), ("n_tokens", "<i4"),
                       ("offset", "<i8"), ("length", "<i4"), ("crc", "<u4")])
POSTING_DTYPE = np.dtype([("term", "<u4"), ("chunk", "<u4"), ("tf", "<u2")])


def term_id(word: str) -> int:
    return zlib.crc32(word.encode("utf-8", "surrogatepass"))


def _normalized(raw: bytes) -> str:
    """A unit's bytes as the text retrieval shows: form feeds and CRLF as line breaks, lines
    without trailing blanks (a unit within one line is its bytes as they are)."""
    text = raw.decode("utf-8").replace("\f", "\n")
    if "\n" not in text:
        return text
    return "\n".join(line.rstrip() for line in text.split("\n"))


# -- the streamed pass ------------------------------------------------------------------------
def _file_lines(path: Path, cancel: threading.Event | None,
                progress: Callable[[int, int], None] | None) -> Iterator[tuple[int, str, int, int]]:
    """(line number, line without trailing blanks, byte offset, its bytes) of every line, read
    in READ_BLOCK blocks (a form feed ends a line, as engine.documents reads a text file)."""
    size = path.stat().st_size
    line_no = 0
    with path.open("rb") as f:
        start = 3 if f.read(3) == codecs.BOM_UTF8 else 0
        f.seek(start)
        rest, at = b"", start
        while True:
            if cancel is not None and cancel.is_set():
                raise DocumentError("reading the document was cancelled")
            block = f.read(READ_BLOCK)
            data = rest + block.replace(b"\f", b"\n")
            if block:
                cut = data.rfind(b"\n")
                if cut < 0:  # a line longer than a block: read on
                    rest = data
                    continue
                complete, rest = data[:cut + 1], data[cut + 1:]
            else:
                complete, rest = data, b""
            lines = complete.split(b"\n")
            if complete.endswith(b"\n"):
                lines.pop()
            for raw in lines:
                line_no += 1
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise DocumentError(f"{path.name} changed while it was read (byte {at} is not "
                                        "UTF-8 any more): add it again") from None
                stripped = text.rstrip()
                yield line_no, stripped, at, len(raw) if len(stripped) == len(text) else len(stripped.encode())
                at += len(raw) + 1
            if progress is not None:
                progress(min(at, size), size)
            if not block:
                return


def _file_units(path: Path, count: Callable[[str], int], piece_tokens: int,
                cancel: threading.Event | None, progress: Callable[[int, int], None] | None
                ) -> Iterator[tuple[int, int, int, int, int, int, str]]:
    """(start, end, paragraph, tokens, offset, length, text) of the file's units, in order: what
    engine.retrieval.split_units gives for the file's text, with each unit's bytes."""
    paragraph: list[tuple[int, str, int, int]] = []
    number = 0

    def units_of(para):
        lines = [(loc, text) for loc, text, _, _ in para]
        for start, end, text, n, i0, i1, c0, c1 in paragraph_pieces(lines, count, piece_tokens):
            line0 = para[i0]
            lo = line0[2] + (len(line0[1][:c0].encode()) if c0 else 0)
            hi = para[i1][2] + para[i1][3] if c1 < 0 else line0[2] + len(line0[1][:c1].encode())
            yield start, end, number, n, lo, hi - lo, text

    for line in _file_lines(path, cancel, progress):
        if line[1].strip():
            paragraph.append(line)
        elif paragraph:
            yield from units_of(paragraph)
            paragraph = []
            number += 1
    if paragraph:
        yield from units_of(paragraph)


class _Postings:
    """(term, chunk, tf) records appended to their partition files in blocks."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.terms, self.chunks, self.tfs = array("I"), array("I"), array("H")

    def add(self, chunk: int, counts: Counter) -> None:
        for word, tf in counts.items():
            self.terms.append(term_id(word))
            self.chunks.append(chunk)
            self.tfs.append(min(tf, 0xFFFF))
        if len(self.terms) >= FLUSH_POSTINGS:
            self.flush()

    def flush(self) -> None:
        n = len(self.terms)
        if not n:
            return
        rec = np.empty(n, POSTING_DTYPE)
        rec["term"] = np.frombuffer(self.terms, dtype=np.uint32)
        rec["chunk"] = np.frombuffer(self.chunks, dtype=np.uint32)
        rec["tf"] = np.frombuffer(self.tfs, dtype=np.uint16)
        self.terms, self.chunks, self.tfs = array("I"), array("I"), array("H")
        part = rec["term"] % PARTITIONS
        order = np.argsort(part, kind="stable")
        rec, part = rec[order], part[order]
        bounds = np.searchsorted(part, np.arange(PARTITIONS + 1))
        for p in range(PARTITIONS):
            if bounds[p] < bounds[p + 1]:
                with open(self.folder / f"{p:03d}", "ab") as f:
                    f.write(rec[bounds[p]:bounds[p + 1]].tobytes())


# -- reading it back --------------------------------------------------------------------------
class FileUnits(Sequence):
    """The units of a file's index: their records in memory (mapped), their text read from the
    file when asked for."""

    def __init__(self, records: np.ndarray, file: DocumentFile):
        self.records = records
        self.file = file

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        if isinstance(i, slice):
            picked = range(*i.indices(len(self)))
            return self._units(picked.start, picked.stop) if picked.step == 1 and picked \
                else [self[j] for j in picked]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._units(i, i + 1)[0]

    def _units(self, first: int, stop: int) -> list[Unit]:
        recs = self.records[first:stop]
        lo = int(recs["offset"][0])
        raw = self._read(lo, int(recs["offset"][-1]) + int(recs["length"][-1]))
        out = []
        for r in recs:
            at = int(r["offset"]) - lo
            try:
                text = _normalized(raw[at:at + int(r["length"])])
            except UnicodeDecodeError:
                text = None
            if text is None or zlib.crc32(text.encode("utf-8", "surrogatepass")) != int(r["crc"]):
                raise self._changed(f"lines {int(r['start'])}-{int(r['end'])} are not the text indexed")
            out.append(Unit(int(r["start"]), int(r["end"]), int(r["paragraph"]), text, int(r["n_tokens"])))
        return out

    def _changed(self, what: str) -> DocumentError:
        return DocumentError(f"{self.file.name} changed since it was indexed ({what}): add it again "
                             "to read it as it is now")

    def _read(self, lo: int, hi: int) -> bytes:
        path = Path(self.file.path)
        try:
            size = path.stat().st_size
            if size != self.file.size:
                raise self._changed(f"{size_text(self.file.size)} then, {size_text(size)} now")
            with path.open("rb") as f:
                f.seek(lo)
                return f.read(hi - lo)
        except FileNotFoundError:
            raise DocumentError(f"{self.file.name} is no longer at {path}: its sections cannot be "
                                "read (put it back, or remove it from the conversation)") from None
        except OSError as exc:
            raise DocumentError(f"cannot read {self.file.name}: {exc.strerror or exc}") from None


class _Chunks(Sequence):
    """The chunks as an (n, 3) array of first unit, last unit and tokens."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        first, last, n = self.rows[i]
        return Chunk(int(first), int(last), int(n))


class FileIndex(DocumentIndex):
    """A DocumentIndex over a DocumentFile (see the module's docstring): ``units`` and
    ``chunks`` are sequences over arrays, ``scores`` reads the postings from the folder."""

    def __init__(self, file: DocumentFile, folder: Path):
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("format") != FILE_INDEX_FORMAT:
            raise ValueError(f"index format {meta.get('format')}, expected {FILE_INDEX_FORMAT}")
        if meta.get("sha256") != file.sha256 or meta.get("size") != file.size:
            raise ValueError("an index of another file")
        records = np.memmap(folder / "units.bin", dtype=UNIT_DTYPE, mode="r") \
            if meta["n_units"] else np.empty(0, UNIT_DTYPE)
        chunks = np.load(folder / "chunks.npy")
        self.lengths = np.load(folder / "lengths.npy")
        if len(records) != meta["n_units"] or len(chunks) != meta["n_chunks"] != len(self.lengths):
            raise ValueError("the index's files do not match its counts")
        if len(chunks) and int(chunks[:, 1].max()) >= len(records):
            raise ValueError("a chunk past the last unit")
        super().__init__("lines", FileUnits(records, file), _Chunks(chunks), None, folder)
        self.file = file
        self.n_tokens = int(meta["n_tokens"])
        self.avgdl = float(meta["avgdl"])

    @classmethod
    def open(cls, file: DocumentFile, count: Callable[[str], int], model_id: str, *,
             chunk_tokens: int = CHUNK_TOKENS, overlap_tokens: int = OVERLAP_TOKENS,
             directory: str | os.PathLike | None = None, cancel: threading.Event | None = None,
             progress: Callable[[int, int], None] | None = None) -> "FileIndex":
        """The saved index of this file's content for this model if one loads, else one built
        in a streamed pass (in a temporary folder beside it, renamed when complete)."""
        folder = Path(directory) if directory is not None else index_dir()
        path = folder / f"{file.sha256[:32]}-{model_id[:16]}-{chunk_tokens}-{overlap_tokens}-f{FILE_INDEX_FORMAT}"
        if path.is_dir():
            try:
                index = cls(file, path)
                index.loaded = True
                return index
            except Exception as exc:  # a damaged or partial folder: build it again
                log.warning("the saved retrieval index %s cannot be read (%s): building it again",
                            path, exc)
                shutil.rmtree(path, ignore_errors=True)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=folder))
        except OSError as exc:
            log.warning("cannot save the retrieval index in %s (%s): it is kept in a temporary folder",
                        folder, exc)
            tmp = Path(tempfile.mkdtemp(prefix="omlx-index-"))
        try:
            cls.build(file, count, tmp, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens,
                      cancel=cancel, progress=progress)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            tmp.rename(path)
        except OSError:
            if not path.is_dir():
                log.warning("cannot save the retrieval index as %s: it stays in %s", path, tmp)
                return cls(file, tmp)
            shutil.rmtree(tmp, ignore_errors=True)  # another process saved it first
        return cls(file, path)

    @staticmethod
    def build(file: DocumentFile, count: Callable[[str], int], folder: Path, *,
              chunk_tokens: int = CHUNK_TOKENS, overlap_tokens: int = OVERLAP_TOKENS,
              cancel: threading.Event | None = None,
              progress: Callable[[int, int], None] | None = None) -> None:
        """Write the index's files into ``folder`` (see the module's docstring)."""
        postings = _Postings(folder / "postings")
        lengths = array("I")
        chunk_rows = array("i")
        pending: list[tuple] = []
        counts = {"units": 0, "tokens": 0}
        with open(folder / "units.bin", "wb") as units_out:

            def flush_units():
                if pending:
                    units_out.write(np.array(pending, dtype=UNIT_DTYPE).tobytes())
                    pending.clear()

            def units():
                for start, end, paragraph, n, lo, length, text in _file_units(
                        Path(file.path), count, max(chunk_tokens // 4, 16), cancel, progress):
                    pending.append((start, end, paragraph, n, lo, length,
                                    zlib.crc32(text.encode("utf-8", "surrogatepass"))))
                    counts["units"] += 1
                    counts["tokens"] += n
                    if len(pending) >= 8192:
                        flush_units()
                    yield n, text

            for chunk, texts in pack_texts(units(), chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens):
                found = words(" ".join(texts)) or ["_"]  # a chunk without a word still has a row
                postings.add(len(lengths), Counter(found))
                lengths.append(len(found))
                chunk_rows.extend((chunk.first, chunk.last, chunk.n_tokens))
            flush_units()
        postings.flush()
        if not counts["units"]:
            raise DocumentError(f"{file.name} has no text to index")
        n_chunks = len(lengths)
        np.save(folder / "chunks.npy", np.frombuffer(chunk_rows, dtype=np.int32).reshape(n_chunks, 3))
        dl = np.frombuffer(lengths, dtype=np.uint32).astype(np.float32)
        np.save(folder / "lengths.npy", dl)
        meta = {"format": FILE_INDEX_FORMAT, "unit": "lines", "n_units": counts["units"],
                "n_chunks": n_chunks, "n_tokens": counts["tokens"], "avgdl": float(dl.mean()),
                "size": file.size, "sha256": file.sha256, "name": file.name,
                "chunk_tokens": chunk_tokens, "overlap_tokens": overlap_tokens}
        (folder / "meta.json").write_text(json.dumps(meta))

    def chunk_rows(self) -> np.ndarray:
        return self.chunks.rows

    def save(self, path: Path) -> None:  # written where it was built (see open)
        raise NotImplementedError("a file's index is saved as it is built")

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every chunk for ``query`` (bm25s's "lucene" variant, a word counted as
        often as the question has it; zeros when none of its words occurs)."""
        n = len(self.lengths)
        out = np.zeros(n, dtype=np.float32)
        norm = K1 * (1 - B + B * self.lengths / self.avgdl)
        found: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for word in words(query):
            term = term_id(word)
            if term not in found:
                found[term] = self._postings(term)
            c, tf = found[term]
            if not len(c):
                continue
            df = len(c)
            idf = np.log(1 + (n - df + 0.5) / (df + 0.5))
            out[c] += (idf * tf / (tf + norm[c])).astype(np.float32)
        return out

    def _postings(self, term: int) -> tuple[np.ndarray, np.ndarray]:
        """The chunks holding ``term`` and its count in each, from its partition file read
        READ_POSTINGS records at a time."""
        chunks, tfs = [], []
        f = self.path / "postings" / f"{term % PARTITIONS:03d}"
        if f.exists():
            with open(f, "rb") as fh:
                while True:
                    rec = np.fromfile(fh, dtype=POSTING_DTYPE, count=READ_POSTINGS)
                    if not len(rec):
                        break
                    hit = rec["term"] == term
                    if hit.any():
                        chunks.append(rec["chunk"][hit].astype(np.int64))
                        tfs.append(rec["tf"][hit].astype(np.float32))
        if not chunks:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        return np.concatenate(chunks), np.concatenate(tfs)


__all__ = ["FileIndex", "FileUnits", "FILE_INDEX_FORMAT", "PARTITIONS"]
