"""Retrieval for documents longer than the context: chunks, a BM25 index saved with them, and
the sections a question gets.

A document is cut into *units* along its structure: paragraphs (runs of non-blank lines) of a
text file, paragraphs within each page of a PDF (pages are marked by form feeds, see
engine.documents.join_pages). A unit longer than a quarter of a chunk is cut into runs of lines,
and a line longer than that into runs of words, so any unit fits in a chunk. Units are packed in
order into *chunks* of up to ``chunk_tokens`` tokens; a chunk starts with the trailing units of
the one before, up to ``overlap_tokens``, so a fact cut by a chunk border is whole in one of them.
Every unit knows its location: its first and last line (text) or page (PDF), 1-based.

The index (units, chunks and the bm25s index over the chunks' words) is saved in the cache
folder under the document's sha256, the model's fingerprint (token counts are the model's) and
the chunking parameters, so opening the document again, in this process or a later one, loads it.

Per question, :meth:`DocumentIndex.rank` scores every chunk; :func:`select` fills the token
budget (RETRIEVAL_TOKENS by default) best first with the chunks that match, then the chosen chunks are merged into sections: runs of
consecutive units, in document order, each rendered once with its location
(:func:`render_sections`). The same chunks give the same text, so a question that selects the
same sections renders the same prompt prefix and reuses its KV blocks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .documents import PAGE_BREAK
from .errors import DocumentError, SettingsError

log = logging.getLogger("omlx.retrieval")

CHUNK_TOKENS = 320
OVERLAP_TOKENS = 64
INDEX_FORMAT = 1
SECTION_OVERHEAD_TOKENS = 12  # a section's "[lines 120-161]" label and the blank lines around it
MIN_RETRIEVAL_TOKENS = CHUNK_TOKENS + SECTION_OVERHEAD_TOKENS  # room for one chunk and its label
# Tokens of retrieved sections per question (the best chunks up to this, if the context has the
# room); 0 fills the room left. Chosen by measurement (docs/performance.md, "The retrieval
# budget"): one chunk and the overlap's neighbour answered 5/6 at 4x and 16x the context, more
# sections 4-5/6 (the model mixes up facts from unrelated text), at a third of the prefill.
RETRIEVAL_TOKENS = 400


def check_retrieval_tokens(n) -> int:
    """``n`` as a retrieval budget: 0 (fill the room the context leaves) or at least
    MIN_RETRIEVAL_TOKENS (one section and its label).

    Raises:
        SettingsError: anything else.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise SettingsError(f"the retrieval budget must be a whole number of tokens, not {n!r}")
    value = int(n)
    if value != 0 and value < MIN_RETRIEVAL_TOKENS:
        raise SettingsError(f"the retrieval budget must be 0 (fill the context) or at least "
                            f"{MIN_RETRIEVAL_TOKENS} tokens (one section and its label), not {value:,}")
    return value


# Scripts written without spaces between words: Han (CJK ideographs, extensions A and B and the
# compatibility block), Japanese kana, Hangul (syllables, jamo) and Thai (with its vowel and tone
# marks, which \w does not match). A run of them is indexed as overlapping character bigrams, as
# Lucene's CJK analyzer does ("内存增长" -> 内存 存增 增长; a lone character stays a unigram): no
# dictionary, and a question's bigrams meet the document's wherever the same words occur.
_UNSPACED = ("\u0e00-\u0e7f\u1100-\u11ff\u3040-\u309f\u30a0-\u30ff\u3130-\u318f\u3400-\u4dbf"
             "\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0002ebef")
_WORD = re.compile(rf"([{_UNSPACED}]+)|((?:(?![{_UNSPACED}])\w)+)", re.UNICODE)


@dataclass(frozen=True)
class Unit:
    """A paragraph (or a piece of a long one): lines ``start``..``end`` of a text, or pages
    ``start``..``end`` of a PDF. ``paragraph`` numbers the paragraph it belongs to (pieces of
    one paragraph are joined by a newline, paragraphs by a blank line)."""

    start: int
    end: int
    paragraph: int
    text: str
    n_tokens: int


@dataclass(frozen=True)
class Chunk:
    """Units ``first``..``last`` (indices into the index's units)."""

    first: int
    last: int
    n_tokens: int


@dataclass(frozen=True)
class Section:
    """A run of consecutive units of one document the model is shown, with the best score of
    the chunks it came from."""

    document: str
    unit: str  # "lines" or "pages"
    start: int
    end: int
    text: str
    n_tokens: int
    score: float

    @property
    def label(self) -> str:
        word = "line" if self.unit == "lines" else "page"
        if self.start == self.end:
            return f"{word} {self.start}"
        return f"{word}s {self.start}-{self.end}"

    def as_dict(self) -> dict:
        return {"document": self.document, "unit": self.unit, "start": self.start, "end": self.end,
                "tokens": self.n_tokens, "score": round(float(self.score), 4), "label": self.label}


def words(text: str) -> list[str]:
    """The words BM25 counts: lower-cased runs of letters/digits (two characters at least, or
    any number), English stop words left out, a plural "s" taken off; a run of Chinese,
    Japanese, Korean or Thai characters as its character bigrams (see _UNSPACED)."""
    from bm25s.stopwords import STOPWORDS_EN

    out = []
    for unspaced, w in _WORD.findall(text.lower()):
        if unspaced:
            if len(unspaced) == 1:
                out.append(unspaced)
            else:
                out.extend(unspaced[i:i + 2] for i in range(len(unspaced) - 1))
            continue
        if not (len(w) >= 2 or w.isdigit()) or w in STOPWORDS_EN:
            continue
        if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(w)
    return out


# -- units and chunks -------------------------------------------------------------------------
def _paragraphs(text: str) -> Iterator[list[tuple[int, str]]]:
    """[(location, line)] per paragraph (a run of non-blank lines); the location is the line
    number, or the page number when the text has page marks."""
    paged = PAGE_BREAK in text
    page, line_no = 1, 0
    current: list[tuple[int, str]] = []
    for line in text.split("\n"):
        line_no += 1
        if paged and PAGE_BREAK in line:
            if current:
                yield current
                current = []
            page += line.count(PAGE_BREAK)
            line = line.replace(PAGE_BREAK, "")
        loc = page if paged else line_no
        if line.strip():
            current.append((loc, line.rstrip()))
        elif current:
            yield current
            current = []
    if current:
        yield current


def paragraph_pieces(lines: list[tuple[int, str]], count: Callable[[str], int], limit: int
                     ) -> Iterator[tuple[int, int, str, int, int, int, int, int]]:
    """A paragraph's lines as (start, end, text, tokens, i0, i1, c0, c1) pieces of at most
    ``limit`` tokens (one piece when the paragraph fits): the piece is lines ``i0``..``i1`` of
    the paragraph, from character ``c0`` of line i0 to character ``c1`` of line i1 (c1 = -1: to
    its end)."""
    text = "\n".join(line for _, line in lines)
    n = count(text)
    if n <= limit:
        yield lines[0][0], lines[-1][0], text, n, 0, len(lines) - 1, 0, -1
        return
    run: list[int] = []  # indices of the run's lines
    run_tokens = 0  # the lines' counts and one per joining newline: what their text counts, about

    def piece() -> tuple[int, int, str, int, int, int, int, int]:
        joined = "\n".join(lines[i][1] for i in run)
        return lines[run[0]][0], lines[run[-1]][0], joined, count(joined), run[0], run[-1], 0, -1

    for i, (loc, line) in enumerate(lines):
        n_line = count(line)
        if n_line > limit:  # one line longer than a piece: cut it into runs of words
            if run:
                yield piece()
                run, run_tokens = [], 0
            for start, end, words_text, n_words, c0, c1 in _word_pieces(loc, line, count, limit):
                yield start, end, words_text, n_words, i, i, c0, c1
            continue
        if run and run_tokens + 1 + n_line > limit:
            yield piece()
            run, run_tokens = [], 0
        run_tokens += n_line + (1 if run else 0)
        run.append(i)
    if run:
        yield piece()


def _word_pieces(loc: int, line: str, count: Callable[[str], int], limit: int
                 ) -> Iterator[tuple[int, int, str, int, int, int]]:
    """A line longer than ``limit`` tokens as runs of words of at most ``limit`` (a run that
    still counts more, words of uneven length, is halved until it fits; a single word is
    kept whatever it counts), each with its characters ``c0``..``c1`` in the line."""
    tokens = line.split(" ")
    starts = [0]  # starts[k]: the character token k starts at (one past the end for k = len)
    for t in tokens:
        starts.append(starts[-1] + len(t) + 1)
    step = max(1, len(tokens) * limit // max(count(line), 1))
    pending = [(i, min(i + step, len(tokens))) for i in range(0, len(tokens), step)]
    while pending:
        a, b = pending.pop(0)
        c0, c1 = starts[a], starts[b] - 1
        text = line[c0:c1]  # " ".join(tokens[a:b])
        n = count(text)
        if n > limit and b - a > 1:
            half = (b - a) // 2
            pending[:0] = [(a, a + half), (a + half, b)]
            continue
        if text.strip():
            yield loc, loc, text, n, c0, c1


def split_units(text: str, count: Callable[[str], int], *, piece_tokens: int,
                cancel: threading.Event | None = None,
                progress: Callable[[int, int], None] | None = None) -> list[Unit]:
    """The document's units (see the module's docstring)."""
    units: list[Unit] = []
    total = max(len(text), 1)
    done = 0
    for number, lines in enumerate(_paragraphs(text)):
        if cancel is not None and cancel.is_set():
            raise DocumentError("reading the document was cancelled")
        for start, end, piece, n, *_ in paragraph_pieces(lines, count, piece_tokens):
            units.append(Unit(start, end, number, piece, n))
        done += sum(len(line) + 1 for _, line in lines)
        if progress is not None and number % 64 == 0:
            progress(min(done, total), total)
    return units


def pack_chunks(units: Sequence[Unit], *, chunk_tokens: int, overlap_tokens: int) -> list[Chunk]:
    """Units packed in order into chunks of at most ``chunk_tokens`` (a unit is never larger
    than that), each starting with the previous chunk's trailing units up to ``overlap_tokens``."""
    return [c for c, _ in pack_texts(((u.n_tokens, u.text) for u in units), chunk_tokens=chunk_tokens,
                                     overlap_tokens=overlap_tokens)]


def pack_texts(units: Iterable[tuple[int, str]], *, chunk_tokens: int, overlap_tokens: int
               ) -> Iterator[tuple[Chunk, list[str]]]:
    """:func:`pack_chunks` over (tokens, text) of the units as they come, each chunk with its
    units' texts: only the current chunk's units are held."""
    window: list[tuple[int, str]] = []  # units first.. of the chunk being filled
    first, tokens, i = 0, 0, -1
    for i, (n, text) in enumerate(units):
        if i > first and tokens + n > chunk_tokens:
            yield Chunk(first, i - 1, tokens), [t for _, t in window]
            carry, carried = i, 0
            while carry - 1 > first and carried + window[carry - 1 - first][0] <= overlap_tokens:
                carry -= 1
                carried += window[carry - first][0]
            window = window[carry - first:]
            first, tokens = carry, carried
        tokens += n
        window.append((n, text))
    if i >= 0:
        yield Chunk(first, i, tokens), [t for _, t in window]


# -- the index --------------------------------------------------------------------------------
def index_dir() -> Path:
    from .kv.prefix import cache_dir

    return cache_dir() / "retrieval"


def index_key(text: str, model_id: str, chunk_tokens: int, overlap_tokens: int) -> str:
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{digest[:32]}-{model_id[:16]}-{chunk_tokens}-{overlap_tokens}-v{INDEX_FORMAT}"


class DocumentIndex:
    """A document's units and chunks with a BM25 index over the chunks.

    Attributes:
        unit: "lines" (a text file) or "pages" (a PDF).
        units, chunks: see the module's docstring.
        path: the folder it is saved in (None: not saved).
    """

    def __init__(self, unit: str, units: list[Unit], chunks: list[Chunk], bm25,
                 path: Path | None = None):
        self.unit = unit
        self.units = units
        self.chunks = chunks
        self.bm25 = bm25
        self.path = path
        self.loaded = False  # True when it came from disk instead of being built
        self._chunk_rows: np.ndarray | None = None  # chunk_rows(), made when first asked for

    @classmethod
    def build(cls, text: str, count: Callable[[str], int], *, chunk_tokens: int = CHUNK_TOKENS,
              overlap_tokens: int = OVERLAP_TOKENS, cancel: threading.Event | None = None,
              progress: Callable[[int, int], None] | None = None) -> "DocumentIndex":
        """Cut ``text`` into units and chunks (token counts by ``count``) and index them."""
        import bm25s

        units = split_units(text, count, piece_tokens=max(chunk_tokens // 4, 16), cancel=cancel,
                            progress=progress)
        if not units:
            raise DocumentError("the document has no text to index")
        chunks, corpus = [], []
        for chunk, texts in pack_texts(((u.n_tokens, u.text) for u in units), chunk_tokens=chunk_tokens,
                                       overlap_tokens=overlap_tokens):
            chunks.append(chunk)
            corpus.append(words(" ".join(texts)))
        # a chunk without a countable word still needs a row in the index
        corpus = [w or ["_"] for w in corpus]
        bm25 = bm25s.BM25()
        bm25.index(corpus, show_progress=False)
        unit = "pages" if PAGE_BREAK in text else "lines"
        return cls(unit, units, chunks, bm25)

    @classmethod
    def open(cls, text: str, count: Callable[[str], int], model_id: str, *,
             chunk_tokens: int = CHUNK_TOKENS, overlap_tokens: int = OVERLAP_TOKENS,
             directory: str | os.PathLike | None = None, cancel: threading.Event | None = None,
             progress: Callable[[int, int], None] | None = None) -> "DocumentIndex":
        """The saved index for this text and model if there is one that loads, else a new one,
        built and saved."""
        folder = Path(directory) if directory is not None else index_dir()
        path = folder / index_key(text, model_id, chunk_tokens, overlap_tokens)
        if path.is_dir():
            try:
                index = cls.load(path)
                index.loaded = True
                return index
            except Exception as exc:  # a damaged or partial folder: build it again
                log.warning("the saved retrieval index %s cannot be read (%s): building it again",
                            path, exc)
        index = cls.build(text, count, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens,
                          cancel=cancel, progress=progress)
        try:
            index.save(path)
        except OSError as exc:
            log.warning("cannot save the retrieval index in %s: %s", path, exc)
        return index

    def save(self, path: Path) -> None:
        """Written to a temporary folder next to ``path``, then renamed (a reader never sees a
        partial index)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
        try:
            meta = {
                "format": INDEX_FORMAT, "unit": self.unit,
                "units": [[u.start, u.end, u.paragraph, u.n_tokens, u.text] for u in self.units],
                "chunks": [[c.first, c.last, c.n_tokens] for c in self.chunks],
            }
            (tmp / "chunks.json").write_text(json.dumps(meta, ensure_ascii=False))
            self.bm25.save(str(tmp / "bm25"), show_progress=False)
            try:
                tmp.rename(path)
            except OSError:  # another process saved it first
                if not path.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.path = path

    @classmethod
    def load(cls, path: Path) -> "DocumentIndex":
        import bm25s

        meta = json.loads((Path(path) / "chunks.json").read_text())
        if meta.get("format") != INDEX_FORMAT:
            raise ValueError(f"index format {meta.get('format')}, expected {INDEX_FORMAT}")
        units = [Unit(int(s), int(e), int(p), str(t), int(n)) for s, e, p, n, t in meta["units"]]
        chunks = [Chunk(int(f), int(l), int(n)) for f, l, n in meta["chunks"]]
        bm25 = bm25s.BM25.load(str(Path(path) / "bm25"), show_progress=False)
        if any(c.last >= len(units) for c in chunks):
            raise ValueError("a chunk past the last unit")
        return cls(meta["unit"], units, chunks, bm25, Path(path))

    # -- questions ------------------------------------------------------------------------
    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every chunk for ``query`` (zeros when none of its words occurs)."""
        vocab = self.bm25.vocab_dict
        terms = [w for w in words(query) if w in vocab]
        if not terms:
            return np.zeros(len(self.chunks), dtype=np.float32)
        return np.asarray(self.bm25.get_scores(terms), dtype=np.float32)

    def chunk_text(self, chunk: Chunk) -> str:
        return _join_units(self.units[chunk.first:chunk.last + 1])

    def chunk_rows(self) -> np.ndarray:
        """The chunks as an (n, 3) int array of first unit, last unit and tokens."""
        if self._chunk_rows is None:
            self._chunk_rows = np.array([(c.first, c.last, c.n_tokens) for c in self.chunks],
                                        np.int64).reshape(-1, 3)
        return self._chunk_rows


def _join_units(units: Sequence[Unit]) -> str:
    parts: list[str] = []
    for i, u in enumerate(units):
        if i:
            parts.append("\n" if u.paragraph == units[i - 1].paragraph else "\n\n")
        parts.append(u.text)
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A chunk of one of the documents being asked about."""

    document: str
    index: DocumentIndex
    chunk: int
    score: float

    @property
    def n_tokens(self) -> int:
        return self.index.chunks[self.chunk].n_tokens


class Ranking(Sequence):
    """Candidates in order as arrays (a 200 MB file has 173,000 chunks, too many to make a
    Candidate each per question): entry k is chunk ``chunk[k]`` of ``documents[doc[k]]`` with
    ``score[k]``; a Candidate is made for the entries looked at."""

    def __init__(self, documents: Sequence[tuple[str, DocumentIndex]], doc: np.ndarray,
                 chunk: np.ndarray, score: np.ndarray):
        self.documents = list(documents)
        self.doc, self.chunk, self.score = doc, chunk, score

    @classmethod
    def of(cls, candidates: Iterable[Candidate]) -> "Ranking":
        """Candidates given one by one, in their order."""
        documents: list[tuple[str, DocumentIndex]] = []
        number: dict[tuple[str, int], int] = {}
        doc, chunk, score = [], [], []
        for c in candidates:
            key = (c.document, id(c.index))
            if key not in number:
                number[key] = len(documents)
                documents.append((c.document, c.index))
            doc.append(number[key])
            chunk.append(c.chunk)
            score.append(c.score)
        return cls(documents, np.asarray(doc, np.int64), np.asarray(chunk, np.int64),
                   np.asarray(score, np.float64))

    def __len__(self) -> int:
        return len(self.doc)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        name, index = self.documents[int(self.doc[i])]
        return Candidate(name, index, int(self.chunk[i]), float(self.score[i]))


def rank(question: str, documents: Iterable[tuple[str, DocumentIndex]]) -> Ranking:
    """Every chunk of the documents, best first: those sharing words with the question by BM25
    score (ties in document order), then the rest in document order (a question without a
    matching word, "summarize this", is shown the beginning)."""
    documents = list(documents)
    scores = [np.asarray(index.scores(question), np.float64) for _, index in documents]
    lengths = [len(s) for s in scores]
    doc = np.repeat(np.arange(len(documents), dtype=np.int64), lengths)
    chunk = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths] or [np.empty(0, np.int64)])
    score = np.concatenate(scores or [np.empty(0)])
    matched = np.flatnonzero(score > 0)
    # stable: ties keep document order
    order = np.concatenate([matched[np.argsort(-score[matched], kind="stable")], np.flatnonzero(score <= 0)])
    return Ranking(documents, doc[order], chunk[order], score[order])


def select(candidates: Sequence[Candidate], budget_tokens: int, *, min_ratio: float = 0.0
           ) -> list[Candidate]:
    """The best candidates whose tokens (with a section label each) fit ``budget_tokens``.

    When some candidates match the question (score > 0), only those are taken, and only those
    scoring at least ``min_ratio`` times the best: text sharing no word with the question is
    not shown beside the text that does. A chunk overlapping one already chosen (the fact in a
    chunk's overlap is in both) waits until the chunks that add other text are taken; it then
    costs only its units not yet shown. A question matching nothing gets the candidates in
    their order (the beginning of the documents).

    In candidate order, each one either overlaps the units chosen so far (it waits), or is
    taken if it fits, or is passed over: the order is walked a chosen chunk at a time, the
    candidates up to the next one that fits judged together (arrays; a 200 MB file's 173,000)."""
    ranking = candidates if isinstance(candidates, Ranking) else Ranking.of(candidates)
    documents, doc, chunk, score = ranking.documents, ranking.doc, ranking.chunk, ranking.score
    best = float(score.max()) if len(score) else 0.0
    if best > 0:
        keep = np.flatnonzero((score > 0) & (score >= min_ratio * best))
        doc, chunk, score = doc[keep], chunk[keep], score[keep]
    # per candidate: its index (documents sharing one index share its shown units), first and
    # last unit, and cost (tokens and a label)
    group_of: dict[int, int] = {}
    group = np.array([group_of.setdefault(id(index), len(group_of)) for _, index in documents], np.int64)
    tables = [index.chunk_rows() for _, index in documents]
    rows = np.zeros((len(doc), 3), np.int64)
    for k, table in enumerate(tables):
        mine = doc == k
        if mine.any():
            rows[mine] = table[chunk[mine]]
    first, last = rows[:, 0], rows[:, 1]
    cost = rows[:, 2] + SECTION_OVERHEAD_TOKENS
    group = group[doc]

    chosen: list[int] = []  # positions in the candidates
    deferred: list[int] = []
    overlaps = np.zeros(len(doc), bool)  # sharing a unit with a chosen chunk
    used, at = 0, 0
    while at < len(doc):
        fits = np.flatnonzero(~overlaps[at:] & (used + cost[at:] <= budget_tokens))
        stop = at + int(fits[0]) if len(fits) else len(doc)
        deferred.extend((at + np.flatnonzero(overlaps[at:stop])).tolist())
        if not len(fits):
            break
        chosen.append(stop)
        used += int(cost[stop])
        overlaps |= (group == group[stop]) & (first <= last[stop]) & (last >= first[stop])
        at = stop + 1
    shown: dict[int, set[int]] = {}  # group -> the units of its chosen chunks
    for k in chosen:
        shown.setdefault(int(group[k]), set()).update(range(int(first[k]), int(last[k]) + 1))
    taken = list(chosen)
    for k in deferred:
        units = shown[int(group[k])]
        index = documents[int(doc[k])][1]
        new = [j for j in range(int(first[k]), int(last[k]) + 1) if j not in units]
        extra = sum(index.units[j].n_tokens + 1 for j in new)
        if new and used + extra <= budget_tokens:
            taken.append(k)
            used += extra
            units.update(new)
    out = []
    for k in taken:
        name, index = documents[int(doc[k])]
        out.append(Candidate(name, index, int(chunk[k]), float(score[k])))
    return out


def sections(chosen: Iterable[Candidate], count: Callable[[str], int] | None = None) -> list[Section]:
    """The chosen chunks as sections: per document (in the order first seen), the union of their
    units cut into runs of consecutive units, in document order; each section's score is the
    best of the chunks that cover it. ``count`` gives the sections' token counts (default: the
    sum of their units')."""
    by_doc: dict[str, tuple[DocumentIndex, dict[int, float]]] = {}
    for c in chosen:
        index, unit_scores = by_doc.setdefault(c.document, (c.index, {}))
        chunk = index.chunks[c.chunk]
        for j in range(chunk.first, chunk.last + 1):
            unit_scores[j] = max(unit_scores.get(j, float("-inf")), c.score)
    out: list[Section] = []
    for name, (index, unit_scores) in by_doc.items():
        order = sorted(unit_scores)
        runs: list[list[int]] = []
        for j in order:
            if runs and j == runs[-1][-1] + 1:
                runs[-1].append(j)
            else:
                runs.append([j])
        for run in runs:
            units = index.units[run[0]:run[-1] + 1]
            text = _join_units(units)
            n = count(text) if count is not None else sum(u.n_tokens for u in units)
            out.append(Section(name, index.unit, units[0].start, units[-1].end, text, n,
                               max(unit_scores[j] for j in run)))
    return out


def fit_sections(chosen: Sequence[Candidate], count: Callable[[str], int],
                 fits: Callable[[list[Section]], bool]) -> list[Section]:
    """`sections(chosen, count)`, the weakest chunk (the lowest score, the later one of a tie)
    left out until `fits` takes them or one chunk is left: `select` estimated each label's
    tokens, and the rendered prompt may take more."""
    chosen = list(chosen)
    while True:
        found = sections(chosen, count)
        if len(chosen) <= 1 or fits(found):
            return found
        weakest = min(range(len(chosen)), key=lambda i: (chosen[i].score, -i))
        chosen = chosen[:weakest] + chosen[weakest + 1:]


def render_sections(document: str, found: Sequence[Section]) -> str:
    """The text the model is shown for one document's sections (deterministic: the same
    sections give the same text)."""
    parts = [f"Document: {document} (the sections relevant to the question)"]
    for s in found:
        parts.append(f"[{s.label}]\n{s.text}")
    return "\n\n".join(parts)


__all__ = ["Unit", "Chunk", "Section", "Candidate", "Ranking", "DocumentIndex", "rank", "select",
           "sections", "render_sections", "words", "split_units", "paragraph_pieces", "pack_chunks",
           "pack_texts", "CHUNK_TOKENS", "OVERLAP_TOKENS", "SECTION_OVERHEAD_TOKENS", "MIN_RETRIEVAL_TOKENS",
           "RETRIEVAL_TOKENS", "check_retrieval_tokens"]
