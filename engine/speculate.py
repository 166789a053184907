"""Prompt-lookup speculative decoding: draft the continuation of the latest earlier occurrence of
the text's last few tokens, verify the draft in one forward pass, keep what the model agrees with.

Questions about a document, summaries and edits of pasted text answer largely in words already in
the context; where the last n tokens (n = MAX_NGRAM .. MIN_NGRAM, longest first) occurred before,
the tokens that followed are a likely continuation. One pass over the weights checks all of them
(`kv.batch.VerifyBatch`: every row's logits bit-equal to decoding that token alone), and the
rejected rows are rolled back exactly, so greedy output is token-identical to decoding without
speculation. With temperature, the standard speculative-sampling rule keeps the output
distribution: a drafted token d is kept with probability p(d) (the draft is deterministic, q(d)
= 1), and on rejection the token is drawn from p with d removed, renormalised.

    PromptLookup    the drafter: an n-gram index over the history, grown as tokens come
    DraftModel      the drafter for `--draft MODEL`: a small model of the same vocabulary, greedy
    accept_draft    the acceptance rule over the verified rows (TokenStream.verify takes its tokens)
    agreed_tokens   how many drafted tokens the verified steps kept
    drafter_for, check_draft, draft_room   an Engine's speculation setup: the drafter of an
                    answer, the draft model's vocabulary check, the rows a verify pass may add
    load_draft, draft_kv   a draft model loaded for an engine, its caches' KV config
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

import numpy as np

from .errors import SettingsError
from .kernels.norms import running_sum
from .kv.batch import VerifyBatch
from .kv.config import KVConfig
from .sampling import Sampler

MAX_NGRAM = 3
MIN_NGRAM = 2  # a single token recurs too often to predict what follows it
MAX_DRAFT = 7  # + the token before it: 8 rows, what the linear layers compute row-exactly
SPECULATE_MODES = ("off", "lookup")


class PromptLookup:
    """Drafts from the history (prompt + generated tokens) it is shown.

    The draft length adapts: one more after a fully accepted draft (up to `max_draft`), the
    accepted length + 1 after a rejection, so text unlike anything before costs little. An index
    maps every n-gram (MIN_NGRAM <= n <= MAX_NGRAM) of the history to where its latest earlier
    occurrence ended; it grows by the tokens added since the last call (the history only grows
    between calls; a shorter or changed one is indexed afresh).

    A draft ends with a token that ends the answer (`stop_ids`, as DraftModel's): the tokens that
    followed it in the history (the next turn of an earlier exchange) could never be kept."""

    def __init__(self, max_draft: int = MAX_DRAFT, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM,
                 stop_ids: Iterable[int] = ()):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram}")
        self.max_draft = max_draft
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.length = min(4, max_draft)
        self.drafted = self.accepted = 0  # totals, for the stats
        self._index: dict[tuple[int, ...], int] = {}  # n-gram → position just after it
        self._seen: list[int] = []  # the history indexed so far

    def _sync(self, history: Sequence[int]) -> None:
        """Index the n-grams that end before the history's last token (the last n-gram is the
        one looked up: its own occurrence must not answer)."""
        n_seen = len(self._seen)
        if len(history) < n_seen or (n_seen and int(history[n_seen - 1]) != self._seen[-1]):
            self._index.clear()
            self._seen = []
            n_seen = 0
        self._seen.extend(int(t) for t in history[n_seen:])
        seen = self._seen
        # n-grams ending at e (inclusive) for e < len - 1, those not indexed yet
        start = max(0, n_seen - 1)
        for e in range(start, len(seen) - 1):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if e + 1 >= n:
                    self._index[tuple(seen[e + 1 - n : e + 1])] = e + 1

    def draft(self, history: Sequence[int], room: int) -> list[int]:
        """Up to min(length, room) tokens that followed the latest earlier occurrence of the
        history's longest matching tail, up to and including the first stop token among them,
        or [] when none occurred before."""
        k = min(self.length, room, self.max_draft)
        if k <= 0 or len(history) < self.min_ngram + 1:
            return []
        self._sync(history)
        seen = self._seen
        for n in range(min(self.max_ngram, len(seen) - 1), self.min_ngram - 1, -1):
            at = self._index.get(tuple(seen[-n:]))
            if at is not None:
                draft = seen[at : at + k]
                for i, token in enumerate(draft):
                    if token in self.stop_ids:
                        return draft[: i + 1]
                return draft
        return []

    def update(self, n_drafted: int, n_accepted: int) -> None:
        """The verification of a draft of n_drafted kept n_accepted of it."""
        self.drafted += n_drafted
        self.accepted += n_accepted
        if n_accepted == n_drafted:
            self.length = min(self.max_draft, self.length + 1)
        else:
            self.length = max(1, n_accepted + 1)

    def close(self) -> None:
        """Nothing to release (DraftModel's cache is)."""


class DraftModel:
    """Drafts with a small model of the same vocabulary (its own Engine and KV cache), greedily;
    the same draft-length rule as PromptLookup.

    Its cache follows the history it is shown: before drafting, the tokens after the longest
    common prefix of what it holds and the history are trimmed off (a rejected draft) and the
    history's new tokens are fed (`sync`), so each call costs the new tokens plus one step per
    drafted token but the last (its cache then holds history + draft[:-1]). A draft ends early
    with a token that ends the answer (`stop_ids`): nothing after it could be kept. `Engine.stream` makes
    one per answer on a fresh cache (the draft model reads the whole prompt at the answer's first
    draft); `omlx serve` one per sequence on a cache of the draft's own prefix cache, started on
    its cached prefix (`held`), and drafts for a whole batch at once (serve.drafts).

    Args:
        cache: the draft model's cache for this sequence (a fresh `engine.new_cache()` if None).
        held: the tokens `cache` already holds, in order.
        context: the tokens before every history `draft` is shown (an answer's cache held them
            before its prompt: a conversation's earlier turns), so that it drafts from them too.
    """

    def __init__(self, engine, max_draft: int = MAX_DRAFT, cache=None, held: Sequence[int] = (),
                 context: Sequence[int] = ()):
        self.engine = engine
        self.max_draft = max_draft
        self.length = min(4, max_draft)
        self.drafted = self.accepted = 0
        self.cache = engine.new_cache() if cache is None else cache
        self.held = [int(t) for t in held]  # the tokens in self.cache, in order
        self.stop_ids = engine.tokenizer.stop_ids  # a draft ends with a token that ends the answer
        self.context = [int(t) for t in context]

    def want(self, n_history: int, room: int) -> int:
        """Tokens the next draft after a history of n_history tokens should have: the adaptive
        length within `room`, 0 where the draft model's context (or its cache's limit) ends."""
        k = min(self.length, room, self.max_draft)
        limit = min(self.engine.model.context_length, self.cache.limit or self.engine.model.context_length)
        return 0 if k <= 0 or not n_history or n_history + k > limit else k

    def sync(self, history: Sequence[int]) -> list[int]:
        """Trim the cache back to its longest common prefix with `history` and return the history's
        tokens it has yet to take (at least the last, fed again for its logits); the caller feeds
        them and adds them to `held`."""
        # a step's history differs from what the cache holds only in its last few tokens (the
        # rejected draft): all but those compared in one C-level list comparison, not a Python
        # loop over the whole conversation every step (exact: a mismatch there walks it all)
        skip = max(0, min(len(self.held), len(history)) - 2 * (self.max_draft + 1))
        common = skip if skip and self.held[:skip] == list(history[:skip]) else 0
        for a, b in zip(self.held[common:], history[common:]):
            if a != int(b):
                break
            common += 1
        common = min(common, len(history) - 1)
        if len(self.held) > common:
            self.cache.trim(len(self.held) - common)
            del self.held[common:]
        return [int(t) for t in history[common:]]

    def draft(self, history: Sequence[int], room: int) -> list[int]:
        if self.context:
            history = [*self.context, *history]
        k = self.want(len(history), room)
        if not k:
            return []
        feed = self.sync(history)
        logits = self.engine.prefill(feed, self.cache)
        self.held.extend(feed)
        out: list[int] = []
        for i in range(k):
            token = int(np.argmax(logits))
            out.append(token)
            if token in self.stop_ids:
                break
            if i < k - 1:
                logits = self.engine.model.forward([token], self.cache, "last")[0]
                self.held.append(token)
        return out

    def update(self, n_drafted: int, n_accepted: int) -> None:
        PromptLookup.update(self, n_drafted, n_accepted)

    def close(self) -> None:
        release = getattr(self.cache, "release", None)
        if release is not None:
            release()


def drafter_for(engine, speculate: str, context: Sequence[int] = ()) -> PromptLookup | DraftModel | None:
    """The drafter of one answer of `engine`: over its draft model when it has one (`--draft`,
    whatever `speculate` says), prompt lookup for "lookup", else None. Drafts are at most
    engine.exact_batch_rows() - 1 tokens: with the token before them, the rows one verify pass
    computes exactly as each alone. `context`: the tokens the answer's cache holds before its
    prompt (the draft model drafts after them too).

    Raises:
        SettingsError: `speculate` is not one of SPECULATE_MODES.
    """
    if speculate not in SPECULATE_MODES:
        raise SettingsError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, not {speculate!r}")
    max_draft = engine.exact_batch_rows() - 1
    draft = engine.draft_engine
    if draft is not None:
        return DraftModel(draft, max_draft=max_draft, cache=draft.new_cache(draft_kv(engine.kv_config, draft.model)),
                          context=context)
    if speculate == "lookup":
        return PromptLookup(max_draft=max_draft, stop_ids=engine.tokenizer.stop_ids)
    return None


def check_draft(engine, draft) -> None:
    """Raises SettingsError unless the engine `draft` may draft for `engine`: the same byte
    string for every id (the tokenizer's own table), or a drafted id would mean another token."""
    check_vocabulary(engine.name, engine.model.vocab_size, engine.tokenizer,
                     draft.name, draft.model.vocab_size, draft.tokenizer)


def check_vocabulary(name: str, vocab_size: int, tokenizer, draft_name: str, draft_vocab_size: int,
                     draft_tokenizer) -> None:
    """check_draft from what the two files' headers say (their names, vocabulary sizes and
    Tokenizers), before either model loads (`omlx info MODEL --draft DRAFT`)."""
    if vocab_size != draft_vocab_size or not tokenizer.same_vocabulary(draft_tokenizer):
        raise SettingsError(f"the draft model {draft_name} does not have {name}'s vocabulary")


def draft_kv(config: KVConfig, draft_model) -> KVConfig:
    """The KV config of a draft model's caches: the main model's, without its per-layer
    overrides when they name layers the draft model does not have."""
    try:
        config.per_layer(draft_model.n_layers)
        return config
    except SettingsError:
        return replace(config, overrides=())


def load_draft(engine, path) -> object:
    """The Engine of the draft model at `path` for `engine` (`--draft MODEL`, the app's draft
    model), its KV at engine's spec (draft_kv).

    Raises:
        SettingsError: the vocabularies differ (check_draft); the file's own errors as Engine.load.
    """
    draft = type(engine).load(path)
    check_draft(engine, draft)
    draft.set_kv(draft_kv(engine.kv_config, draft.model))
    return draft


def draft_room(cache, limit: int, max_more: int) -> int:
    """Draft tokens a verify pass may add after the next token: no drop by the overflow policy,
    the plain loop's context check still ahead, no more than the answer may take."""
    room = min(VerifyBatch.room(cache), limit - cache.offset) - 1  # the next token's own row
    if not cache.can_drop:
        room -= 1  # keep `offset + 1 < limit` for the step after, as the plain loop checks
    return max(0, min(room, max_more))


def agreed_tokens(steps: Sequence, draft: Sequence[int]) -> int:
    """How many drafted tokens the verified steps kept as drafted (the leading steps whose token
    is the draft's; the drafter's `update` and the drafted / accepted counts take it)."""
    agreed = 0
    while agreed < len(steps) and agreed < len(draft) and steps[agreed].token == draft[agreed]:
        agreed += 1
    return agreed


def accept_draft(sampler: Sampler, rows: np.ndarray, draft: Sequence[int], history: Sequence[int],
                 processors: Sequence = ()) -> Iterator[tuple[int, np.ndarray]]:
    """The tokens a verified draft yields, each with the logits it was chosen from: the draft's
    accepted prefix, then one more drawn from the row after it (len(accepted) + 1 in all, fewer
    if the caller stops early). Lazy: each row's processors see the history with the tokens
    yielded before it: the caller appends each yielded token to `history` before asking for the
    next (TokenStream's own history does).

    Args:
        rows: (len(draft) + 1, vocab) logits; row i is the model's next-token logits after
            history + draft[:i].
        history: the live list of tokens before the row (prompt and generated so far).
        processors: (history, logits) -> logits, applied to each row first (TokenStream's).
    """
    greedy = sampler.params.temperature == 0.0
    for i in range(len(draft) + 1):
        seen = history
        logits = rows[i]
        for process in processors:
            logits = process(seen, logits)
        if i == len(draft):
            yield sampler.sample(logits, seen), logits
            return
        d = int(draft[i])
        if greedy:
            token = sampler.sample(logits, seen)
            yield token, logits
            if token != d:
                return
            continue
        ids, probs = sampler.distribution(logits, seen)
        where = np.flatnonzero(ids == d)
        p_d = float(probs[where[0]]) if where.size else 0.0
        if sampler.rng.random() < p_d:
            yield d, logits
            continue
        residual = probs  # `distribution` made it for this draw: zeroed and summed in place
        if where.size:
            residual[where[0]] = 0.0
        total = residual.sum()
        if total <= 0.0:  # p all on d (kept above but for rounding): keep d
            yield d, logits
            continue
        cumulative = running_sum(residual, residual)  # np.cumsum's bits, by the compiled loop, in place
        index = min(int(np.searchsorted(cumulative, sampler.rng.random() * total, side="right")), ids.size - 1)
        yield int(ids[index]), logits
        return
