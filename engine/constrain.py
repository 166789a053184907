"""Grammar-constrained decoding: a JSON schema (or "any JSON object") as a logits processor of a
sequence's `decoding.TokenStream`, computed by llguidance (a maintained Rust library: a token mask
from the grammar's lexer and parser per step, ~0.3 ms per token on SmolLM2's 49K vocabulary
against a ~20 ms decode step).

    constraint = JsonConstraint(engine.tokenizer, schema, n_prompt=len(prompt_ids))
    TokenStream(..., processors=[constraint])

Each call consumes the tokens generated since the last one, then sets every token the grammar
does not allow next to -inf; the end-of-turn tokens are allowed only where the JSON is complete.
"""

from __future__ import annotations

import json
import weakref
from typing import Sequence

import numpy as np

from .errors import SettingsError

ANY_OBJECT = {"type": "object"}  # response_format json_object


_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> its llguidance one


def _ll_tokenizer(tokenizer):
    """The llguidance tokenizer of our tokenizer (built once per tokenizer, ~0.1 s)."""
    cached = _LL_TOKENIZERS.get(tokenizer)
    if cached is not None:
        return cached
    import llguidance as llg

    class _Vocab:
        def __init__(self):
            self.eos_token_id = tokenizer.eos_id
            self.bos_token_id = tokenizer.bos_id
            self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
            self.special_token_ids = sorted(tokenizer.special_ids)

        def __call__(self, text):
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return tokenizer.encode(text, add_bos=False, parse_special=False)

    ll = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), eos_token=sorted(tokenizer.stop_ids))
    _LL_TOKENIZERS[tokenizer] = ll
    return ll


def json_grammar(schema: dict | str) -> str:
    """llguidance's grammar for a JSON schema; SettingsError naming what is wrong with it."""
    import llguidance as llg

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise SettingsError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise SettingsError("the JSON schema must be an object")
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except ValueError as exc:
        raise SettingsError(f"the JSON schema cannot be compiled: {exc}") from None
    problem = llg.LLMatcher.validate_grammar(grammar)
    if problem:
        raise SettingsError(f"the JSON schema cannot be used: {problem}")
    return grammar


class JsonConstraint:
    """A logits processor allowing only continuations of JSON that matches `schema` (after the
    first `n_prompt` tokens of the history, the prompt)."""

    def __init__(self, tokenizer, schema: dict | str | None, n_prompt: int, *, grammar: str | None = None):
        import llguidance as llg

        self.matcher = llg.LLMatcher(_ll_tokenizer(tokenizer), grammar or json_grammar(schema))
        if self.matcher.is_error():
            raise SettingsError(f"the JSON schema cannot be used: {self.matcher.get_error()}")
        self.n_prompt = n_prompt
        self.consumed = 0
        self.vocab = tokenizer.vocab_size
        self._mask = np.full((self.vocab + 31) // 32, -1, np.int32)

    def __call__(self, history: Sequence[int], logits: np.ndarray) -> np.ndarray:
        new = history[self.n_prompt + self.consumed:]
        for token in new:
            self.matcher.consume_token(int(token))
        self.consumed += len(new)
        if self.matcher.is_error():  # cannot happen for tokens this mask allowed
            raise SettingsError(f"constrained decoding failed: {self.matcher.get_error()}")
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        n = min(self.vocab, logits.shape[0])
        out[:n] = np.where(allowed[:n], logits[:n], -np.inf)
        return out
