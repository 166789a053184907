"""Choosing the next token from a model's logits, and cutting generated text at stop strings.

The sampler applies, in order: the repetition penalty (llama.cpp / CTRL style), greedy argmax
when the temperature is 0, top-k, a temperature softmax computed in float64, top-p (nucleus),
min-p, and finally one draw from the sampler's own seeded random generator. It is written for
large vocabularies (Gemma 3 has 262,144 tokens): top-k uses ``argpartition`` and top-p without
top-k only sorts the few most likely tokens that make up the nucleus.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from .kernels.norms import running_sum

NUCLEUS_FIRST_GUESS = 256
NUCLEUS_GROWTH = 8
MIN_P_PREFILTER_SLACK = 1e-6


def _is_int(value: object) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite real number that is not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to pick tokens.

    - ``temperature``: 0 picks the most likely token (greedy); higher flattens the distribution.
    - ``top_k``: keep only the k most likely tokens (0 = off).
    - ``top_p``: keep the smallest set of most likely tokens whose probability reaches top_p
      (1.0 = off).
    - ``min_p``: drop tokens less likely than min_p times the most likely one (0.0 = off).
    - ``repetition_penalty``: divide positive logits / multiply negative logits of tokens seen
      in the last ``repetition_last_n`` tokens of the history by this (1.0 = off).
    - ``repetition_last_n``: how far back the penalty looks (0 = off, -1 = the whole history).
    - ``presence_penalty`` / ``frequency_penalty``: OpenAI's penalties, subtracted from the logits
      of tokens already generated in this completion (the prompt does not count):
      ``presence * [count > 0] + frequency * count`` (0 = off; negative values favour repeats).
    - ``seed``: seed of the sampler's random generator (None = fresh entropy).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first parameter outside its valid range."""
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in [0, 1] (1 = off), got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                "repetition_penalty must be a finite number > 0 (1 = off), "
                f"got {self.repetition_penalty!r}"
            )
        if not _is_int(self.repetition_last_n) or self.repetition_last_n < -1:
            raise ValueError(
                "repetition_last_n must be an integer >= -1 (0 = off, -1 = whole history), "
                f"got {self.repetition_last_n!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number (0 = off), got {getattr(self, name)!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")


def apply_repetition_penalty(
    logits: np.ndarray, history: Sequence[int], penalty: float, last_n: int
) -> np.ndarray:
    """Logits with the repetition penalty applied to the distinct token ids among the last
    ``last_n`` of ``history`` (all of it when ``last_n`` is -1): positive logits are divided by
    ``penalty``, negative ones multiplied by it. Returns ``logits`` itself when nothing changes,
    otherwise a penalized copy."""
    if penalty == 1.0 or last_n == 0 or len(history) == 0:
        return logits
    recent = history if last_n < 0 else history[-last_n:]
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < logits.shape[0])]
    if ids.size == 0:
        return logits
    out = logits.copy()
    values = out[ids]
    out[ids] = np.where(values > 0, values / penalty, values * penalty)
    return out


def apply_count_penalties(
    logits: np.ndarray, generated: Sequence[int], presence: float, frequency: float
) -> np.ndarray:
    """Logits less OpenAI's presence and frequency penalties: for each token id generated
    ``count`` times so far, ``presence * [count > 0] + frequency * count`` is subtracted from its
    logit. Returns ``logits`` itself when nothing changes, otherwise a penalized copy (in the
    logits' dtype)."""
    if (presence == 0.0 and frequency == 0.0) or len(generated) == 0:
        return logits
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[keep], counts[keep]
    if ids.size == 0:
        return logits
    out = np.array(logits, copy=True)
    out[ids] -= (presence + frequency * counts).astype(out.dtype)
    return out


class RepetitionPenalty:
    """`apply_repetition_penalty` as a logits processor (decoding.TokenStream's)."""

    def __init__(self, penalty: float, last_n: int):
        self.penalty, self.last_n = penalty, last_n

    def __call__(self, history: Sequence[int], logits: np.ndarray) -> np.ndarray:
        return apply_repetition_penalty(logits, history, self.penalty, self.last_n)


class CountPenalties:
    """OpenAI's presence / frequency penalties as a logits processor: counts the tokens of the
    history after its first ``n_prompt`` (the completion's own)."""

    def __init__(self, n_prompt: int, presence: float, frequency: float):
        self.n_prompt, self.presence, self.frequency = n_prompt, presence, frequency

    def __call__(self, history: Sequence[int], logits: np.ndarray) -> np.ndarray:
        return apply_count_penalties(logits, history[self.n_prompt:], self.presence, self.frequency)


def penalty_processors(params: SamplingParams, n_prompt: int) -> list:
    """The logits processors of ``params``' penalties (none when they are off, so that a request
    with every penalty at its neutral value samples exactly as one without them)."""
    out: list = []
    if params.repetition_penalty != 1.0 and params.repetition_last_n != 0:
        out.append(RepetitionPenalty(params.repetition_penalty, params.repetition_last_n))
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        out.append(CountPenalties(n_prompt, params.presence_penalty, params.frequency_penalty))
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(n, vocab) → (n, vocab) float64 log-probabilities."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def _top_p_keep(weights: np.ndarray, top_p: float, total: float) -> int:
    """How many of ``weights`` (sorted descending, out of a distribution summing to ``total``)
    form the nucleus for ``top_p``."""
    cumulative = np.cumsum(weights)
    return min(int(np.searchsorted(cumulative, top_p * total)) + 1, weights.size)


class Sampler:
    """Picks token ids from logits according to :class:`SamplingParams`, with its own random
    generator (seeded from ``params.seed``)."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self._scratch: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, size: int) -> np.ndarray:
        """A reusable float64 work array of ``size`` elements (fresh multi-megabyte arrays on
        every token cost more in page faults than the arithmetic done in them)."""
        buffer = self._scratch.get(name)
        if buffer is None or buffer.size != size:
            buffer = self._scratch[name] = np.empty(size, dtype=np.float64)
        return buffer

    def distribution(
        self, logits: np.ndarray, history: Sequence[int] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        """The candidates a draw chooses from: (token ids, probabilities summing to 1). They
        come most likely first once top-k or top-p has cut the list, in id order otherwise.
        Greedy sampling gives the single argmax with probability 1."""
        ids, weights = self._candidates(logits, history)
        if ids is None:
            ids = np.arange(weights.size, dtype=np.int64)
        return ids, weights / weights.sum()

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """Pick the next token id. ``history`` holds the previous token ids (prompt and
        generated so far) for the repetition penalty. (The presence / frequency penalties need to
        know where the prompt ends: `decoding.TokenStream` applies them, and the repetition
        penalty, as logits processors, see `penalty_processors`.)"""
        ids, weights = self._candidates(logits, history)
        if weights.size == 1:
            return int(ids[0]) if ids is not None else 0
        cumulative = running_sum(weights, self._buffer("cumulative", weights.size))
        index = int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))
        index = min(index, weights.size - 1)
        return int(ids[index]) if ids is not None else index

    def _candidates(
        self, logits: np.ndarray, history: Sequence[int]
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """(token ids or None for "the whole vocabulary in id order", unnormalized float64
        weights) after every filtering step."""
        p = self.params
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
        logits = apply_repetition_penalty(
            logits, history, p.repetition_penalty, p.repetition_last_n
        )
        vocab = logits.shape[0]

        if p.temperature == 0.0:
            best = int(np.argmax(logits))
            if not math.isfinite(logits[best]):
                raise ValueError("logits have no finite maximum (all -inf, or NaN/inf present)")
            return np.array([best], dtype=np.int64), np.ones(1)

        ids: np.ndarray | None = None
        is_sorted = False
        if 0 < p.top_k < vocab:
            ids = np.argpartition(logits, vocab - p.top_k)[vocab - p.top_k :].astype(np.int64)
            candidates = logits[ids].astype(np.float64)
            order = np.argsort(-candidates, kind="stable")
            ids, candidates = ids[order], candidates[order]
            is_sorted = True
        else:
            candidates = self._buffer("weights", vocab)
            np.copyto(candidates, logits)

        top = candidates.max()
        if not math.isfinite(top):
            raise ValueError("logits have no finite maximum (all -inf, or NaN/inf present)")

        if p.min_p > 0.0 and p.top_p >= 1.0 and ids is None:
            floor = top + p.temperature * (math.log(p.min_p) - MIN_P_PREFILTER_SLACK)
            ids = np.flatnonzero(candidates >= floor)
            candidates = candidates[ids]

        weights = candidates
        weights -= top
        weights *= 1.0 / p.temperature
        np.exp(weights, out=weights)

        if p.top_p < 1.0:
            total = weights.sum()
            if not is_sorted:
                ids, weights = self._nucleus_candidates(weights, p.top_p * total)
            keep = _top_p_keep(weights, p.top_p, total)
            ids, weights = ids[:keep], weights[:keep]

        if p.min_p > 0.0:
            mask = weights >= p.min_p * weights.max()
            if ids is None:
                ids = np.flatnonzero(mask)
                weights = weights[ids]
            else:
                ids, weights = ids[mask], weights[mask]

        return ids, weights

    @staticmethod
    def _nucleus_candidates(weights: np.ndarray, mass: float) -> tuple[np.ndarray, np.ndarray]:
        """The heaviest tokens, sorted descending, enough of them for their weights to reach
        ``mass``: grows an ``argpartition`` guess instead of sorting the whole vocabulary."""
        vocab = weights.size
        m = min(NUCLEUS_FIRST_GUESS, vocab)
        while True:
            if m >= vocab:
                ids = np.argsort(-weights, kind="stable")
                break
            ids = np.argpartition(weights, vocab - m)[vocab - m :]
            if weights[ids].sum() >= mass:
                ids = ids[np.argsort(-weights[ids], kind="stable")]
                break
            m = min(vocab, m * NUCLEUS_GROWTH)
        return ids.astype(np.int64, copy=False), weights[ids]


class StopStringMatcher:
    """Cuts streamed text at the first stop string, even when it spans several chunks.

    :meth:`push` returns only text that cannot be the start of a stop string; the possible start
    is held back until later text settles it (or :meth:`flush` releases it at the end).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.stopped = False
        self.matched: str | None = None
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add generated text; return (text safe to show now, whether a stop string matched).
        On a match, the returned text ends just before the stop string and later pushes return
        ("", True)."""
        if self.stopped:
            return "", True
        buffer = self._held + text
        if not self.stops:
            self._held = ""
            return buffer, False
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            self.stopped = True
            self.matched = best[1]
            self._held = ""
            return buffer[: best[0]], True
        hold = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest end of ``buffer`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def flush(self) -> str:
        """Release the held-back text at the end of generation (nothing if a stop matched)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
