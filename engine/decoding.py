"""TokenStream: the per-sequence work between a model's logits and the text a caller streams.

One stream per generating sequence, fed the logits of each position it samples from:

    logits ─► logits processors ─► Sampler ─► end of turn? ─► stream decoder ─► stop strings
              (per sequence:        (seeded: temperature,      (UTF-8 pieces)   (held-back text)
               penalties: repetition, top-k/p, min-p)
               presence, frequency;
               constraints)

`Engine.stream` (a window turn, the CLI) and the serve scheduler (many sequences batched)
both drive it: they run the model and own the cache and its limits (context, memory); the
stream owns everything that is per sequence and independent of how the logits were computed.

    stream = TokenStream(tokenizer, prompt_ids, sampling=..., stop=..., max_tokens=...)
    while not stream.done:
        step = stream.push(logits)          # (token, text, finish_reason)
        ... show step.text; feed step.token to the model unless step.finish_reason ...
    tail = stream.finish(reason)            # the text held back until the end
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from .sampling import Sampler, SamplingParams, StopStringMatcher, log_softmax, penalty_processors

# Finish reasons a stream decides itself; callers add theirs ("context_full", "kv_pool_full",
# "cancelled", or what their API calls them).
STOP = "stop"  # the model ended its turn (EOS / end-of-turn token)
STOP_STRING = "stop_string"  # the text reached a stop string
LENGTH = "length"  # max_tokens generated


class LogitsProcessor(Protocol):
    """Changes one position's logits before sampling (a grammar's mask, a frequency penalty):
    called with the sequence's token history (prompt + generated) and the (vocab,) logits;
    returns the logits to sample from (a new array, or the given one changed in place)."""

    def __call__(self, history: Sequence[int], logits: np.ndarray) -> np.ndarray: ...


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the `top` most likely ones, under the logits the
    sampler saw (after the processors, before temperature and truncation)."""

    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


class Step(NamedTuple):
    """What one push did. `token` is the sampled id; with finish_reason "stop" it is the end of
    turn token, which is not part of the output (no text, not in `generated`)."""

    token: int
    text: str  # text completed by the token (may be empty: an unfinished UTF-8 character, a held stop)
    finish_reason: str | None  # None: the stream goes on (feed `token` to the model)
    logprob: TokenLogprob | None = None  # with TokenStream(logprobs=...)


class TokenStream:
    """Sampler, stream decoder, stop-string matcher, history and the max_tokens limit of one
    generating sequence.

    Args:
        tokenizer: gives the stream decoder and the ids that end a turn (`stop_ids`).
        prompt_ids: the prompt (the history the repetition penalty and processors see).
        sampling: SamplingParams (default: greedy).
        stop: stop strings; the text ends just before the first one.
        max_tokens: generated tokens at most (0: the stream is done before its first push).
        processors: LogitsProcessors applied in order to every position's logits, after the
            penalties of `sampling` (repetition, presence, frequency), which the stream applies
            as processors of its own (`sampling.penalty_processors`).
        logprobs: when not None, each Step carries the sampled token's log-probability and the
            `logprobs` most likely tokens (under the logits after penalties and processors).
        clock: the time source `first_token_at` is read from (the caller's request clock).
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], *, sampling: SamplingParams | None = None,
                 stop: Sequence[str] = (), max_tokens: int = 256,
                 processors: Sequence[LogitsProcessor] = (), logprobs: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        sampling = sampling or SamplingParams()
        sampling.validate()
        # the penalties run as processors (they see where the prompt ends); the sampler does not
        # apply the repetition penalty a second time
        self.sampler = Sampler(replace(sampling, repetition_penalty=1.0))
        self.decoder = tokenizer.stream_decoder(skip_special=True)
        self.matcher = StopStringMatcher(stop)
        self.stop_ids = tokenizer.stop_ids
        self.history = list(prompt_ids)
        self.n_prompt = len(self.history)
        self.max_tokens = max_tokens
        self.processors = penalty_processors(sampling, self.n_prompt) + list(processors)
        self.logprobs = logprobs
        self.clock = clock
        self.first_token_at: float | None = None  # clock() when the first token was sampled
        self.finish_reason: str | None = LENGTH if max_tokens <= 0 else None
        self._pieces: list[str] = []

    @property
    def generated(self) -> list[int]:
        """The output tokens so far (the end-of-turn token excluded)."""
        return self.history[self.n_prompt:]

    @property
    def n_generated(self) -> int:
        return len(self.history) - self.n_prompt

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All the text streamed so far (with the tail once finished)."""
        return "".join(self._pieces)

    def push(self, logits: np.ndarray) -> Step:
        """Sample the next token from the (vocab,) logits of the sequence's last position."""
        if self.finish_reason is not None:
            raise RuntimeError(f"the stream has finished ({self.finish_reason})")
        for process in self.processors:
            logits = process(self.history, logits)
        return self._take(self.sampler.sample(logits, self.history), logits)

    def verify(self, rows: np.ndarray, draft: Sequence[int]) -> list[Step]:
        """Steps for a speculative draft verified in one pass: rows (len(draft) + 1, vocab), row i
        the logits after the history + draft[:i]. The draft tokens the acceptance rule keeps
        (`speculate.accept_draft`: greedy, the agreeing prefix) are taken as if pushed one by one,
        then one token more drawn from the row after them; it stops early where the stream
        finishes. Every step but the last continues the stream with a draft token."""
        from .speculate import accept_draft

        if self.finish_reason is not None:
            raise RuntimeError(f"the stream has finished ({self.finish_reason})")
        steps: list[Step] = []
        for token, logits in accept_draft(self.sampler, rows, draft, self.history, self.processors):
            steps.append(self._take(token, logits))
            if self.finish_reason is not None:
                break
        return steps

    def _take(self, token: int, logits: np.ndarray) -> Step:
        """Record the token chosen from `logits` (after the processors)."""
        if self.first_token_at is None:
            self.first_token_at = self.clock()
        logprob = None if self.logprobs is None else self._logprob(logits, token)
        if token in self.stop_ids:
            self.finish_reason = STOP
            return Step(token, "", STOP, logprob)
        self.history.append(token)
        text, stopped = self.matcher.push(self.decoder.push(token))
        if text:
            self._pieces.append(text)
        if stopped:
            self.finish_reason = STOP_STRING
        elif self.n_generated >= self.max_tokens:
            self.finish_reason = LENGTH
        return Step(token, text, self.finish_reason, logprob)

    def finish(self, reason: str | None = None) -> str:
        """End the stream (with `reason` unless it already ended) and return the text held back
        until now: the decoder's unfinished bytes and the matcher's possible stop-string start
        (nothing after a stop string matched)."""
        if self.finish_reason is None:
            if reason is None:
                raise ValueError("a stream that has not ended needs a finish reason")
            self.finish_reason = reason
        if self.finish_reason == STOP_STRING:
            return ""
        tail = self.matcher.push(self.decoder.flush())[0] + self.matcher.flush()
        if tail:
            self._pieces.append(tail)
        return tail

    def _logprob(self, logits: np.ndarray, token: int) -> TokenLogprob:
        lp = log_softmax(np.asarray(logits)[None, :])[0]
        k = min(self.logprobs, lp.size)
        top: list[tuple[int, float]] = []
        if k > 0:
            idx = np.argpartition(-lp, k - 1)[:k]
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            top = [(int(i), float(lp[i])) for i in idx]
        return TokenLogprob(float(lp[token]), top)


__all__ = ["TokenStream", "Step", "TokenLogprob", "LogitsProcessor", "STOP", "STOP_STRING", "LENGTH"]
