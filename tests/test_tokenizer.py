"""engine.tokenizer against llama.cpp's tokenization of the two real models (tests/data/), plus
decoding, streaming, chat templates, other pre-tokenizers and error reporting on small vocabularies
written here."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from engine.gguf_file import read_metadata
from engine.tokenizer import Tokenizer, TokenizerError

from .conftest import DATA, REFERENCE_NAMES, reference_json

CASES = json.loads((DATA / "tokenizer_cases.json").read_text())
STREAM_TEXTS = [
    "Emoji: 🙂👍🏽🚀 and a family 👨‍👩‍👧‍👦, flags 🇯🇵🇫🇷",
    "量化模型在长上下文里还是爆内存；日本語のテキスト；한국어 텍스트",
    "rare characters: 𠀀𪚥𓀀 ⿰ ꙮ \U0001fae8",
    "mixed: café ∑ x² → ∞ <start_of_turn> <|im_end|>",
]
BUILD_SECONDS: dict[str, float] = {}


@pytest.fixture(scope="session")
def tok(model_name, model_path) -> Tokenizer:
    meta = read_metadata(model_path)
    start = time.perf_counter()
    tokenizer = Tokenizer.from_metadata(meta)
    BUILD_SECONDS[model_name] = time.perf_counter() - start
    return tokenizer


@pytest.fixture(scope="session")
def ref(model_name) -> dict:
    return reference_json(model_name)


def _stream(tokenizer: Tokenizer, ids, skip_special: bool = True) -> list[str]:
    decoder = tokenizer.stream_decoder(skip_special=skip_special)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# --- the real models against llama.cpp -------------------------------------------------------


@pytest.mark.parametrize("index", range(len(CASES)))
def test_tokenize_matches_llama_cpp(tok, ref, index):
    case = ref["tokenize"][index]
    text = CASES[index]
    assert case["text"] == text
    assert tok.encode(text) == case["ids_plain"]
    assert tok.encode(text, parse_special=True) == case["ids_special"]
    assert tok.encode(text, add_bos=True, parse_special=True) == case["ids_bos_special"]


def test_greedy_prompts_match_llama_cpp(tok, ref):
    assert ref["greedy_raw"]
    for run in ref["greedy_raw"]:
        assert tok.encode(run["prompt"], add_bos=True, parse_special=True) == run["prompt_ids"]


def test_chat_prompts_match_llama_cpp(tok, ref, model_name):
    if not ref["greedy_chat"]:
        assert tok.chat_template is None
        with pytest.raises(TokenizerError, match="no chat template"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        return
    for run in ref["greedy_chat"]:
        rendered = tok.apply_chat_template([{"role": "user", "content": run["user"]}])
        assert rendered == run["rendered_prompt"]
        assert tok.encode(rendered, add_bos=True, parse_special=True) == run["prompt_ids"]


def test_long_documents_match_llama_cpp(tok, model_name):
    """The teacher-forced reference runs start with llama.cpp's tokenization of whole documents
    (BOS where the model asks, special tokens not parsed)."""
    ref = REFERENCE_NAMES[model_name]
    for name in ("gpl-3", "kv-cache-article-zh"):
        text = (DATA / "texts" / f"{name}.txt").read_text()
        expected = np.load(DATA / "llama_cpp" / f"{ref}-{name}.npz")["tokens"].tolist()
        assert tok.encode(text, add_bos=True)[: len(expected)] == expected
    long = np.load(DATA / "llama_cpp_f32" / f"{ref}.f32-gpl-3-long.npz")["tokens"].tolist()
    text = (DATA / "texts" / "gpl-3.txt").read_text()
    assert tok.encode(text, add_bos=True)[: len(long)] == long


def test_model_facts(tok, model_name):
    if model_name == "smollm2-135m-instruct":
        assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (49152, 1, 2, False)
        assert {0, 2} <= tok.stop_ids
        assert tok.encode("Hi", add_bos=True) == tok.encode("Hi")
        assert tok.token_bytes(tok.encode(" ")[0]) == b" "
    else:
        assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (262144, 2, 1, True)
        assert {1, 106} <= tok.stop_ids
        assert tok.encode("Hi", add_bos=True) == [2, *tok.encode("Hi")]
        assert tok.token_bytes(106) == b"<end_of_turn>"
        assert 107 not in tok.special_ids and tok.decode([107], skip_special=True) == "\n"
    assert tok.stop_ids <= tok.special_ids
    assert tok.bos_id in tok.special_ids


def test_build_time(tok, model_name):
    """Gemma 3's 262 K vocabulary needs ~0.5 M merges derived from the scores; built vectorised."""
    assert BUILD_SECONDS[model_name] < 10.0, BUILD_SECONDS


# --- decoding and streaming ------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(CASES)))
def test_decode_round_trips(tok, index):
    text = CASES[index]
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, parse_special=True)) == text
    with_bos = tok.encode(text, add_bos=True, parse_special=True)
    assert tok.decode(with_bos, skip_special=True) == tok.decode(
        [i for i in with_bos if i not in tok.special_ids]
    )


@pytest.mark.parametrize("text", CASES + STREAM_TEXTS)
def test_stream_reproduces_decode(tok, text):
    for parse_special in (False, True):
        ids = tok.encode(text, add_bos=True, parse_special=parse_special)
        for skip in (False, True):
            chunks = _stream(tok, ids, skip)
            assert "".join(chunks) == tok.decode(ids, skip_special=skip)
            assert not any("\ufffd" in c for c in chunks)


def test_stream_reproduces_reference_generations(tok, model_name):
    runs = []
    for f32 in (False, True):
        ref = reference_json(model_name, f32=f32)
        runs += ref["greedy_raw"] + ref["greedy_chat"]
    assert runs
    for run in runs:
        chunks = _stream(tok, run["ids"])
        assert "".join(chunks) == run["text"]
        assert tok.decode(run["ids"], skip_special=True) == run["text"]


def test_stream_holds_incomplete_characters(tok):
    """A character spread over tokens (byte fallback, byte-level pieces) comes out only whole."""
    held = 0
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        decoder = tok.stream_decoder()
        out = ""
        for i in ids:
            chunk = decoder.push(i)
            try:
                tok.token_bytes(i).decode("utf-8")
            except UnicodeDecodeError:
                held += chunk == ""
            out += chunk
            assert text.startswith(out)
        assert out + decoder.flush() == text
    assert held > 0


def test_stream_flushes_invalid_leftovers(tok):
    """An unfinished character at the end becomes U+FFFD at flush, as decode() has it."""
    ids = tok.encode("数")
    pieces = b"".join(tok.token_bytes(i) for i in ids)
    assert pieces == "数".encode()
    partial = _byte_tokens(tok, pieces[:2])
    chunks = _stream(tok, partial)
    assert chunks[:-1] == [""] * len(partial)
    assert chunks[-1] == "\ufffd" == tok.decode(partial)


def _byte_tokens(tok: Tokenizer, data: bytes) -> list[int]:
    """Ids of single-byte tokens spelling ``data`` (byte fallback or byte-level)."""
    by_bytes = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if len(b) == 1 and i not in tok.special_ids:
            by_bytes.setdefault(b, i)
    return [by_bytes[bytes((b,))] for b in data]


def test_decode_rejects_bad_ids(tok):
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError, match="out of range"):
        tok.token_bytes(-1)
    with pytest.raises(TokenizerError, match="out of range"):
        tok.stream_decoder().push(tok.vocab_size + 5)


# --- small vocabularies ----------------------------------------------------------------------


def _byte_symbols() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + extra))
            extra += 1
    return out


def _byte_level_meta(extra: list[str], merges: list[str], pre: str = "gpt2", **keys) -> dict:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_symbols(), *extra]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([3, 3, 3] + [1] * (len(tokens) - 3), np.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **keys,
    }


def _spm_meta(pieces: dict[str, float], **keys) -> dict:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (3 + 256) + list(pieces.values())
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.scores": np.array(scores, np.float32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **keys,
    }


def _texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_bytes(i).decode() for i in ids]


DIGITS = _byte_level_meta(["12", "123", "45", "12345", "xyz"], ["1 2", "12 3", "4 5", "123 45"])


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt2", ["12345"]),
        ("gpt-2", ["12345"]),
        ("default", ["123", "45"]),
        ("llama-bpe", ["123", "45"]),
        ("qwen2", ["1", "2", "3", "4", "5"]),
        ("smollm", ["1", "2", "3", "4", "5"]),
    ],
)
def test_pre_tokenizers_split_digits_like_llama_cpp(pre, pieces):
    tok = Tokenizer.from_metadata({**DIGITS, "tokenizer.ggml.pre": pre})
    assert _texts(tok, tok.encode("12345")) == pieces


def test_llama3_pre_tokenizer_takes_whole_tokens_and_adds_bos():
    llama3 = Tokenizer.from_metadata({**DIGITS, "tokenizer.ggml.pre": "llama-bpe"})
    gpt2 = Tokenizer.from_metadata(DIGITS)
    assert _texts(llama3, llama3.encode("xyz")) == ["xyz"]
    assert _texts(gpt2, gpt2.encode("xyz")) == ["x", "y", "z"]
    assert llama3.add_bos and not gpt2.add_bos
    assert llama3.encode("x", add_bos=True)[0] == 1


def test_byte_level_special_tokens_and_spaces():
    tok = Tokenizer.from_metadata(
        _byte_level_meta(["Ġt", "he", "Ġthe"], ["Ġ t", "h e", "Ġt he"])
    )
    ids = tok.encode("<|im_start|> the", parse_special=True)
    assert ids[0] == 1 and _texts(tok, ids[1:]) == [" the"]
    assert tok.encode("<|im_start|>")[0] != 1
    assert tok.stop_ids == {0, 2}
    assert tok.decode(tok.encode("héllo wörld 🙂")) == "héllo wörld 🙂"


def test_spm_merges_by_score():
    """The highest-scoring pair merges first: "ab" beats "bc" on "abc", and the reverse."""
    no_prefix = {"tokenizer.ggml.add_space_prefix": False}
    ab_first = Tokenizer.from_metadata(
        _spm_meta({"a": -5, "b": -5, "c": -5, "ab": -1, "bc": -2}, **no_prefix)
    )
    bc_first = Tokenizer.from_metadata(
        _spm_meta({"a": -5, "b": -5, "c": -5, "ab": -2, "bc": -1}, **no_prefix)
    )
    assert _texts(ab_first, ab_first.encode("abc")) == ["ab", "c"]
    assert _texts(bc_first, bc_first.encode("abc")) == ["a", "bc"]


def test_spm_spaces_prefix_and_byte_fallback():
    pieces = {"▁": -1, "h": -2, "i": -2, "hi": -1.5, "▁hi": -1}
    plain = Tokenizer.from_metadata(_spm_meta(pieces, **{"tokenizer.ggml.add_space_prefix": False}))
    prefixed = Tokenizer.from_metadata(_spm_meta(pieces))
    assert _texts(plain, plain.encode("hi hi")) == ["hi", " hi"]
    assert _texts(prefixed, prefixed.encode("hi hi")) == [" hi", " hi"]
    assert prefixed.decode(prefixed.encode("hi hi")) == "hi hi"
    assert "".join(_stream(prefixed, prefixed.encode("hi hi"))) == "hi hi"
    assert prefixed.add_bos and prefixed.encode("hi", add_bos=True)[0] == 1
    ids = plain.encode("hé")
    assert [plain.token_bytes(i) for i in ids] == [b"h", b"\xc3", b"\xa9"]
    assert _stream(plain, ids) == ["h", "", "é", ""]


def test_tiny_model_file_builds(tmp_path):
    from .tiny_gguf import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny.gguf", chat_template="{{ messages[0]['content'] }}")
    tok = Tokenizer.from_metadata(read_metadata(path))
    assert _texts(tok, tok.encode(" the")) == [" the"]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


# --- chat templates --------------------------------------------------------------------------


def _with_template(template: str) -> Tokenizer:
    return Tokenizer.from_metadata(
        _byte_level_meta([], [], **{"tokenizer.chat_template": template})
    )


def test_chat_template_environment():
    tok = _with_template(
        "{% for m in messages %}\n"
        "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "{{ bos_token }}{{ m | tojson }}|{{ eos_token }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ strftime_now('%Y') }}{{ extra_var }}{% endif %}"
    )
    out = tok.apply_chat_template(
        [{"role": "user", "content": "é"}, {"role": "skip", "content": "-"}], extra_var="!"
    )
    year = time.strftime("%Y")
    assert out == f'<|im_start|>{{"role": "user", "content": "é"}}|<|im_end|>\n{year}!'
    assert not tok.apply_chat_template([], add_generation_prompt=False)


def test_chat_template_errors():
    tok = _with_template("{{ raise_exception('only user turns, please') }}")
    with pytest.raises(TokenizerError, match="only user turns, please"):
        tok.apply_chat_template([])
    with pytest.raises(TokenizerError):
        _with_template("{{ messages.append(1) }}").apply_chat_template([])
    with pytest.raises(TokenizerError, match="does not compile"):
        _with_template("{% for %}").apply_chat_template([])


# --- errors ----------------------------------------------------------------------------------


def test_unsupported_tokenizer_model():
    meta = {**DIGITS, "tokenizer.ggml.model": "bert"}
    with pytest.raises(TokenizerError, match=r"'bert'.*supported: gpt2, llama"):
        Tokenizer.from_metadata(meta)


def test_unsupported_pre_tokenizer():
    with pytest.raises(TokenizerError, match=r"pre-tokenizer 'klingon'.*llama-bpe.*qwen2.*smollm"):
        Tokenizer.from_metadata({**DIGITS, "tokenizer.ggml.pre": "klingon"})


def test_missing_vocabulary():
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({"general.architecture": "llama"})
    for missing in (None, []):
        meta = {**DIGITS, "tokenizer.ggml.tokens": missing}
        with pytest.raises(TokenizerError, match="no tokenizer.ggml.tokens"):
            Tokenizer.from_metadata(meta)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges"):
        Tokenizer.from_metadata({**DIGITS, "tokenizer.ggml.merges": None})
    with pytest.raises(TokenizerError, match="token_type has 3 entries"):
        Tokenizer.from_metadata({**DIGITS, "tokenizer.ggml.token_type": np.ones(3, np.int32)})


def test_encode_rejects_what_is_not_text():
    tok = Tokenizer.from_metadata(DIGITS)
    with pytest.raises(TokenizerError, match="lone surrogate U\\+DC80 at index 1"):
        tok.encode("a\udc80b")
    with pytest.raises(TokenizerError, match="not bytes"):
        tok.encode(b"abc")
