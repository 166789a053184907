"""Tokenizer built from a GGUF file's vocabulary metadata, on top of HF `tokenizers`.

Two vocabulary kinds (``tokenizer.ggml.model``) are supported, both reproducing llama.cpp:

* ``gpt2``: byte-level BPE from ``tokens`` + ``merges``. Text is split by the regexes of the
  ``tokenizer.ggml.pre`` pre-tokenizer, mapped to GPT-2's byte alphabet, then merged by rank.
* ``llama``: SentencePiece-style. llama.cpp repeatedly merges the adjacent pair whose
  concatenation is the highest-scoring token. That is a BPE whose merges are every split of a
  normal token into two normal tokens, ranked by the merged token's score (highest first).
  Spaces become "▁", nothing else is pre-tokenized, and characters missing from the vocabulary
  fall back to the ``<0xNN>`` byte tokens.

Special-token handling follows llama.cpp rather than HF: user-defined tokens (type 4) are always
split out of the text before BPE, even when special tokens are not parsed; control and unknown
tokens only when ``parse_special=True``. Decoding is done here from a per-token byte table, so
that a stream of tokens can be turned into text without ever emitting a partial UTF-8 character.
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .errors import ModelError

__all__ = ["StreamDecoder", "Tokenizer", "TokenizerError"]


class TokenizerError(ModelError):
    """The vocabulary cannot be used, or a request on it is invalid; the message says why."""


TYPE_UNDEFINED = 0
TYPE_NORMAL = 1
TYPE_UNKNOWN = 2
TYPE_CONTROL = 3
TYPE_USER_DEFINED = 4
TYPE_UNUSED = 5
TYPE_BYTE = 6

SPM_SPACE = "\u2581"

END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})
"""Token texts that end a turn (the list llama.cpp uses to find end-of-generation tokens)."""

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How llama.cpp pre-tokenizes for one ``tokenizer.ggml.pre`` value of a byte-level BPE.

    ``splits`` are applied in order, each one splitting every piece the previous ones left
    (matches and the text between them both become pieces). ``ignore_merges``: a piece that is
    itself a token is emitted whole. ``add_bos``: the default when the metadata has no
    ``tokenizer.ggml.add_bos_token``.
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_DEFAULT = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2 = _PreTokenizer((_GPT2_SPLIT,))
_DIGITS_GPT2 = _PreTokenizer((r"\p{N}", _GPT2_SPLIT))
_LLAMA3 = _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizer((_QWEN2_SPLIT,))

PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _DEFAULT,
    "gpt2": _GPT2, "gpt-2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2,
    "command-r": _DIGITS_GPT2, "codeshell": _DIGITS_GPT2, "exaone": _DIGITS_GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "falcon3": _LLAMA3,
    "dbrx": _PreTokenizer((_LLAMA3_SPLIT,)), "smaug-bpe": _PreTokenizer((_LLAMA3_SPLIT,)),
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "stablelm2": _QWEN2, "megrez": _QWEN2,
    "gpt-4o": _PreTokenizer((_GPT4O_SPLIT,)), "llama4": _PreTokenizer((_GPT4O_SPLIT,)),
}
"""Pre-tokenizers for ``tokenizer.ggml.model = gpt2``, by ``tokenizer.ggml.pre`` value."""

MODELS = ("gpt2", "llama")
"""Supported ``tokenizer.ggml.model`` values."""


def _byte_level_chars() -> list[str]:
    """The character GPT-2's byte-level BPE writes for each byte value 0..255.

    Printable Latin-1 bytes stand for themselves; the other 68 are moved, in order, to U+0100 on,
    so every byte has a visible, non-space character (a space byte is "Ġ", a newline "Ċ").
    """
    visible = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, moved = [], 0
    for b in range(256):
        if b in visible:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + moved))
            moved += 1
    return chars


_BYTE_LEVEL_DECODE = {ord(c): b for b, c in enumerate(_byte_level_chars())}
"""str.translate table: byte-level character -> the code point equal to its byte value."""


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build with :meth:`from_metadata`.

    Attributes:
        vocab_size: number of tokens (ids are 0..vocab_size-1).
        bos_id, eos_id: the metadata's BOS / EOS ids, or None.
        add_bos: whether the model wants BOS first (``tokenizer.ggml.add_bos_token``).
        stop_ids: ids that end generation: EOS, the metadata's EOT/EOM ids and tokens named like
            an end of turn (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``, ...).
        special_ids: control/unknown/unused tokens, the ones ``skip_special`` hides. User-defined
            tokens (Gemma's "\\n", runs of spaces, HTML tags) are text and are not in it.
        add_space_prefix: a space is put before the text (and before the text after each
            special token) when encoding, and taken off the front when decoding.
        chat_template: the Jinja chat template, or None if the file has none.
    """

    def __init__(
        self,
        *,
        plain: HFTokenizer,
        special: HFTokenizer,
        pieces: list[bytes],
        special_ids: frozenset[int],
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_space_prefix: bool,
        stop_ids: frozenset[int],
        chat_template: str | None,
    ):
        self._plain = plain
        self._special = special
        self._pieces = pieces
        self.vocab_size = len(pieces)
        self.special_ids = special_ids
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        self.stop_ids = stop_ids
        self.chat_template = chat_template
        self._template = None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (``engine.gguf_file.read_metadata``): the
        ``tokenizer.ggml.*`` keys and ``tokenizer.chat_template``."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("the GGUF metadata has no tokenizer.ggml.model: no vocabulary")
        if model not in MODELS:
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                f"supported: {', '.join(MODELS)}"
            )
        pre = None
        if model == "gpt2":
            pre_name = meta.get("tokenizer.ggml.pre") or "default"
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise TokenizerError(
                    f"unsupported pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) for a gpt2 "
                    f"(byte-level BPE) vocabulary; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
                )
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("the GGUF metadata has no tokenizer.ggml.tokens: no vocabulary")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        types = _array(meta, "tokenizer.ggml.token_type", n, np.int32, TYPE_NORMAL)
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:
            raise TokenizerError(f"the vocabulary has {n - len(vocab)} duplicate token texts")
        for text in END_OF_GENERATION_TEXTS:
            i = vocab.get(text)
            if i is not None:
                types[i] = TYPE_CONTROL

        if pre is not None:
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
            add_bos_default = pre.add_bos
            bpe = _byte_level_model(meta, vocab, pre)
            normalizer = normalizers.Prepend(" ") if add_space_prefix else None
            pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
            pieces = _byte_level_pieces(tokens, types)
        else:
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            add_bos_default = True
            scores = _array(meta, "tokenizer.ggml.scores", n, np.float32, 0.0)
            bpe = _spm_model(tokens, vocab, types, scores)
            prefix = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
            normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPM_SPACE)])
            pre_tokenizer = None
            pieces = _spm_pieces(tokens, types)

        user_defined = [tokens[i] for i in np.flatnonzero(types == TYPE_USER_DEFINED)]
        parsed_special = [
            tokens[i] for i in np.flatnonzero((types == TYPE_CONTROL) | (types == TYPE_UNKNOWN))
        ]
        plain = _hf_tokenizer(bpe, normalizer, pre_tokenizer, user_defined, [])
        special = _hf_tokenizer(bpe, normalizer, pre_tokenizer, user_defined, parsed_special)

        special_ids = frozenset(
            np.flatnonzero(
                (types != TYPE_NORMAL) & (types != TYPE_USER_DEFINED) & (types != TYPE_BYTE)
            ).tolist()
        )
        bos_id = _token_id(meta, "tokenizer.ggml.bos_token_id", n)
        eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", n)
        stops = {vocab[t] for t in END_OF_GENERATION_TEXTS if t in vocab}
        for key in ("eos", "eot", "eom"):
            i = _token_id(meta, f"tokenizer.ggml.{key}_token_id", n)
            if i is not None:
                stops.add(i)
        return cls(
            plain=plain,
            special=special,
            pieces=pieces,
            special_ids=special_ids,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_space_prefix=add_space_prefix,
            stop_ids=frozenset(stops),
            chat_template=meta.get("tokenizer.chat_template") or None,
        )

    def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``.

        ``parse_special``: control tokens written in the text (``<|im_start|>``) become their
        ids; otherwise they are tokenized as ordinary text. ``add_bos``: put BOS first, but only
        if the model asks for it (:attr:`add_bos`).
        """
        hf = self._special if parse_special else self._plain
        try:
            ids = hf.encode(text, add_special_tokens=False).ids if text else []
        except TypeError as e:
            raise TokenizerError(_not_encodable(text)) from e
        if add_bos and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD.

        ``skip_special`` leaves out :attr:`special_ids` (BOS, EOS, turn markers). With
        ``add_space_prefix`` the space the encoder put in front is removed again, as llama.cpp
        does.
        """
        pieces = self._pieces_of(ids, skip_special)
        if self.add_space_prefix:
            pieces = _strip_first_space(pieces)
        return b"".join(pieces).decode("utf-8", errors="replace")

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Whether every id stands for the same bytes in both (a draft model's ids then mean the
        same tokens)."""
        return self._pieces == other._pieces

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes token ``id`` stands for (a lone byte for ``<0xNN>`` or a byte-level piece
        of a character; the text itself for special tokens)."""
        self._check_id(id)
        return self._pieces[id]

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        """A decoder to feed generated ids one at a time (see :class:`StreamDecoder`)."""
        return StreamDecoder(self, skip_special)

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's template,
        the way HF ``transformers`` does (sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``,
        ``raise_exception``, ``strftime_now``, ``tojson``, ``bos_token``/``eos_token``).
        ``extra`` goes to the template as variables (e.g. ``tools=...``)."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (tokenizer.chat_template)")
        if self._template is None:
            try:
                self._template = _chat_environment().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"the model's chat template does not compile: {e}") from e
        context = {
            "bos_token": self._text_of(self.bos_id),
            "eos_token": self._text_of(self.eos_id),
            **extra,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template failed: {e}") from e

    def _text_of(self, id: int | None) -> str:
        return "" if id is None else self._pieces[id].decode("utf-8", errors="replace")

    def _check_id(self, id: int) -> None:
        if not 0 <= id < self.vocab_size:
            raise TokenizerError(f"token id {id} is out of range 0..{self.vocab_size - 1}")

    def _pieces_of(self, ids: Iterable[int], skip_special: bool) -> list[bytes]:
        pieces, table, n = [], self._pieces, self.vocab_size
        skip = self.special_ids if skip_special else ()
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                self._check_id(i)
            if i not in skip:
                pieces.append(table[i])
        return pieces


class StreamDecoder:
    """Turns ids into text as they are generated; concatenating every ``push`` and the final
    ``flush`` gives exactly ``Tokenizer.decode(ids, skip_special=...)``.

    A character can be spread over several tokens (byte-fallback tokens, byte-level BPE pieces);
    its bytes are held back until it is complete, so no partial character is ever emitted.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_space = tokenizer.add_space_prefix

    def push(self, id: int) -> str:
        """Add one token; return the text completed by it (often "", never a partial character)."""
        id = int(id)
        piece = self._tokenizer.token_bytes(id)
        if id in self._skip or not piece:
            return ""
        if self._strip_space:
            self._strip_space = False
            piece = piece[1:] if piece.startswith(b" ") else piece
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """End of stream: whatever bytes are still held, an incomplete sequence as U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _not_encodable(text: Any) -> str:
    """Why HF refused ``text``: not a str, or a lone surrogate (from surrogateescape decoding)."""
    if not isinstance(text, str):
        return f"can only encode str, not {type(text).__name__}"
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            return f"text is not valid Unicode: lone surrogate U+{ord(ch):04X} at index {i}"
    return "text cannot be encoded"


def _array(meta: Mapping[str, Any], key: str, n: int, dtype: type, default: Any) -> np.ndarray:
    """Per-token metadata array ``key`` as a writable [n] array, or ``default`` everywhere."""
    value = meta.get(key)
    if value is None:
        return np.full(n, default, dtype=dtype)
    arr = np.array(value, dtype=dtype)
    if arr.shape != (n,):
        raise TokenizerError(f"{key} has {arr.size} entries for {n} tokens")
    return arr


def _token_id(meta: Mapping[str, Any], key: str, n: int) -> int | None:
    value = meta.get(key)
    if value is None or not 0 <= int(value) < n:
        return None
    return int(value)


def _hf_tokenizer(
    model: models.Model,
    normalizer: normalizers.Normalizer | None,
    pre_tokenizer: pre_tokenizers.PreTokenizer | None,
    user_defined: list[str],
    special: list[str],
) -> HFTokenizer:
    """An HF tokenizer around ``model`` (shared, not copied) that splits ``user_defined`` and
    ``special`` token texts out of the raw text first, matched exactly (not normalized)."""
    hf = HFTokenizer(model)
    if normalizer is not None:
        hf.normalizer = normalizer
    if pre_tokenizer is not None:
        hf.pre_tokenizer = pre_tokenizer
    if user_defined:
        hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    if special:
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return hf


def _byte_level_model(
    meta: Mapping[str, Any], vocab: dict[str, int], pre: _PreTokenizer
) -> models.BPE:
    """HF BPE over GPT-2 byte-level tokens; merges are "left right" strings, in rank order.

    Merges naming a piece (or a result) outside the vocabulary can never apply in llama.cpp;
    HF refuses them, so they are dropped.
    """
    merges_meta = meta.get("tokenizer.ggml.merges")
    if merges_meta is None:
        raise TokenizerError("a gpt2 (byte-level BPE) vocabulary needs tokenizer.ggml.merges")
    merges = []
    for m in merges_meta:
        cut = m.find(" ", 1)
        if cut < 0:
            continue
        a, b = m[:cut], m[cut + 1:]
        if a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
    return models.BPE(vocab, merges, ignore_merges=pre.ignore_merges)


def _byte_level_pieces(tokens: list[str], types: np.ndarray) -> list[bytes]:
    """[n] raw bytes per token: normal tokens mapped back from the byte alphabet, the others
    (control, user-defined) are their own text."""
    pieces = []
    for text, kind in zip(tokens, types.tolist()):
        if kind == TYPE_NORMAL or kind == TYPE_BYTE:
            try:
                pieces.append(text.translate(_BYTE_LEVEL_DECODE).encode("latin-1"))
                continue
            except UnicodeEncodeError:
                pass
        pieces.append(text.encode("utf-8"))
    return pieces


def _spm_model(
    tokens: list[str], vocab: dict[str, int], types: np.ndarray, scores: np.ndarray
) -> models.BPE:
    """HF BPE equivalent to llama.cpp's SentencePiece merging, with byte fallback."""
    left, right = _spm_merges(tokens, types, scores)
    merges = list(zip(map(tokens.__getitem__, left), map(tokens.__getitem__, right)))
    unknown = np.flatnonzero(types == TYPE_UNKNOWN)
    unk = tokens[unknown[0]] if unknown.size else None
    return models.BPE(vocab, merges, unk_token=unk, byte_fallback=True)


_HASH_BASE = 0x9E3779B97F4A7C15


def _spm_merges(
    tokens: list[str], types: np.ndarray, scores: np.ndarray
) -> tuple[list[int], list[int]]:
    """Every split of a normal token into two normal tokens, as (left ids, right ids), ordered by
    the merged token's score (highest first), then merged id, then split position.

    Checking the more than a million splits of Gemma 3's normal tokens by string slicing takes
    seconds at every load, so it is vectorised: the tokens become rows of code points (longest first, so the tokens longer
    than k are always the first rows), prefixes and suffixes are looked up by a polynomial hash
    (mod 2^64) among the hashes of whole tokens, and every hit is confirmed by comparing code
    points, so a hash collision can never produce a wrong merge.
    """
    ids = np.flatnonzero(types == TYPE_NORMAL)
    lens = np.fromiter(map(len, map(tokens.__getitem__, ids.tolist())), np.int64, ids.size)
    if ids.size == 0 or lens.max() < 2:
        return [], []
    by_length = np.argsort(-lens, kind="stable")
    ids, lens = ids[by_length], lens[by_length]
    n, width = ids.size, int(lens[0])
    codes = _code_points([tokens[i] for i in ids.tolist()], lens, width)
    longer = np.searchsorted(-lens, -np.arange(width + 1), side="left")  # [k]: rows with len > k

    base = np.uint64(_HASH_BASE)
    powers = np.array([pow(_HASH_BASE, j, 1 << 64) for j in range(width + 1)], dtype=np.uint64)
    full = np.zeros(n, dtype=np.uint64)
    for j in range(width):
        c = longer[j]
        full[:c] = full[:c] * base + codes[:c, j] + np.uint64(1)
    lookup = _HashIndex(full)
    if lookup.has_duplicates:
        return _spm_merges_slow(tokens, ids, scores)

    merged, left, right, split = [], [], [], []
    prefix = np.zeros(n, dtype=np.uint64)
    for k in range(1, width):
        c = longer[k]
        prefix[:c] = prefix[:c] * base + codes[:c, k - 1] + np.uint64(1)
        a = lookup(prefix[:c])
        rows = np.flatnonzero(a >= 0)
        a = a[rows]
        b = lookup(full[rows] - prefix[rows] * powers[lens[rows] - k])
        hit = b >= 0
        rows, a, b = rows[hit], a[hit], b[hit]
        ok = (lens[a] == k) & (lens[b] == lens[rows] - k)
        ok &= (codes[a, :k] == codes[rows, :k]).all(axis=1)
        ok &= (codes[b, : width - k] == codes[rows, k:]).all(axis=1)
        merged.append(ids[rows[ok]])
        left.append(ids[a[ok]])
        right.append(ids[b[ok]])
        split.append(np.full(int(ok.sum()), k))
    merged_ids, split_at = np.concatenate(merged), np.concatenate(split)
    rank = np.lexsort((split_at, merged_ids, -scores[merged_ids].astype(np.float64)))
    return np.concatenate(left)[rank].tolist(), np.concatenate(right)[rank].tolist()


def _code_points(texts: list[str], lens: np.ndarray, width: int) -> np.ndarray:
    """[len(texts), width] uint32 code points of each text, zero-padded on the right."""
    flat = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    rows = np.repeat(np.arange(len(texts)), lens)
    cols = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)
    codes = np.zeros((len(texts), width), dtype=np.uint32)
    codes[rows, cols] = flat
    return codes


class _HashIndex:
    """Finds uint64 keys among ``keys`` (which should be distinct): position or -1.

    Keys are scrambled (a bijection, so equality is kept), sorted and bucketed by their top bits,
    about two buckets per key: a lookup is one or two probes instead of a binary search, several
    times faster on millions of random queries.
    """

    def __init__(self, keys: np.ndarray):
        mixed = _mix64(keys)
        self._order = np.argsort(mixed)
        self._sorted = mixed[self._order]
        self.has_duplicates = bool(np.any(self._sorted[1:] == self._sorted[:-1]))
        bits = max(1, int(keys.size).bit_length() + 1)
        self._shift = np.uint64(64 - bits)
        firsts = np.arange(1 << bits, dtype=np.uint64) << self._shift
        self._start = np.append(np.searchsorted(self._sorted, firsts), keys.size)

    def __call__(self, queries: np.ndarray) -> np.ndarray:
        queries = _mix64(queries)
        bucket = (queries >> self._shift).astype(np.intp)
        probe, end = self._start[bucket], self._start[bucket + 1]
        found = np.full(queries.size, -1, dtype=np.int64)
        pending = np.flatnonzero(probe < end)
        while pending.size:
            at = probe[pending]
            hit = self._sorted[at] == queries[pending]
            found[pending[hit]] = self._order[at[hit]]
            probe[pending] += 1
            pending = pending[~hit & (probe[pending] < end[pending])]
        return found


def _mix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer: a bijection of uint64 that spreads every input bit over
    all output bits (polynomial hashes of short strings differ only in their low bits)."""
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51AFD7ED558CCD)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> np.uint64(33))


def _spm_merges_slow(
    tokens: list[str], ids: np.ndarray, scores: np.ndarray
) -> tuple[list[int], list[int]]:
    """:func:`_spm_merges` by string slicing, for the (astronomically unlikely) vocabulary where
    two tokens share a hash."""
    normal = {tokens[i]: int(i) for i in ids}
    found = []
    for text, i in normal.items():
        for k in range(1, len(text)):
            a = normal.get(text[:k])
            if a is not None:
                b = normal.get(text[k:])
                if b is not None:
                    found.append((-float(scores[i]), i, k, a, b))
    found.sort()
    return [f[3] for f in found], [f[4] for f in found]


def _spm_pieces(tokens: list[str], types: np.ndarray) -> list[bytes]:
    """[n] raw bytes per token: "▁" is a space in normal tokens, ``<0xNN>`` is byte NN, the
    others (control, user-defined) are their own text."""
    pieces = []
    for text, kind in zip(tokens, types.tolist()):
        if kind == TYPE_NORMAL:
            pieces.append(text.replace(SPM_SPACE, " ").encode("utf-8"))
        elif kind == TYPE_BYTE and len(text) == 6 and text.startswith("<0x") and text[-1] == ">":
            pieces.append(bytes((int(text[3:5], 16),)))
        else:
            pieces.append(text.encode("utf-8"))
    return pieces


def _strip_first_space(pieces: Sequence[bytes]) -> list[bytes]:
    """``pieces`` with one leading space removed from the first non-empty piece."""
    pieces = list(pieces)
    for i, p in enumerate(pieces):
        if p:
            if p.startswith(b" "):
                pieces[i] = p[1:]
            break
    return pieces


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which HF uses to mark assistant text in
    training templates; rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _chat_environment() -> ImmutableSandboxedEnvironment:
    """Sandboxed Jinja environment set up the way HF ``transformers`` renders chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
