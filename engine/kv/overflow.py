"""What a context-limited paged cache does when the next tokens would pass its `limit`.

    stop       raise ContextFull
    rolling    drop the oldest unprotected full blocks (protected: the first `protected_tokens` —
               system prompt and pinned documents — and at least the sink block), a quarter of
               the context at a time
    attention  drop the unprotected full blocks that received the least accumulated attention
               (H2O), keeping the most recent eighth of the context

A policy only chooses block indices; the sequence (`PagedKVCache.drop_blocks`) drops them and
moves the later tokens down.
"""

from __future__ import annotations

import numpy as np

from ..errors import ContextFull

OVERFLOW_POLICIES = ("stop", "rolling", "attention")


class OverflowPolicy:
    """Chooses the full blocks to drop so that n_tokens more fit under the sequence's limit."""

    name = ""
    tracks_attention = False  # whether the layers must keep their attention mass

    def blocks_to_drop(self, seq, n_tokens: int) -> np.ndarray:
        """Sorted global indices of the blocks to drop from `seq` (a PagedKVCache over its limit).

        Raises:
            ContextFull: when the policy cannot make room.
        """
        raise NotImplementedError


class StopPolicy(OverflowPolicy):
    name = "stop"

    def blocks_to_drop(self, seq, n_tokens: int) -> np.ndarray:
        raise ContextFull(f"the context of {seq.limit:,} tokens is full")


class _DroppingPolicy(OverflowPolicy):
    """Drops at least what is needed and at least a quarter of the context, never the protected
    leading blocks nor the `_keep_recent` most recent full blocks."""

    def _keep_recent(self, limit: int, block_size: int) -> int:
        return 0

    def _pick(self, seq, candidates: np.ndarray, n_drop: int) -> np.ndarray:
        raise NotImplementedError

    def blocks_to_drop(self, seq, n_tokens: int) -> np.ndarray:
        B, limit = seq.config.block_size, seq.limit
        need = seq.offset + n_tokens - limit
        n_full = seq.offset // B
        first = seq.protected_blocks()
        candidates = np.arange(first, max(first, n_full - self._keep_recent(limit, B)))
        n_needed = -(-need // B)
        if len(candidates) < n_needed:
            raise ContextFull(
                f"{n_tokens:,} new tokens do not fit in the context of {limit:,}: "
                f"{seq.protected_tokens:,} are pinned (system prompt and documents) and only "
                f"{len(candidates) * B:,} may be dropped"
            )
        n_drop = min(len(candidates), max(n_needed, -(-limit // 4 // B)))
        return self._pick(seq, candidates, n_drop)


class RollingPolicy(_DroppingPolicy):
    name = "rolling"

    def _pick(self, seq, candidates: np.ndarray, n_drop: int) -> np.ndarray:
        return candidates[:n_drop]


class AttentionPolicy(_DroppingPolicy):
    name = "attention"
    tracks_attention = True

    def _keep_recent(self, limit: int, block_size: int) -> int:
        return max(1, limit // 8 // block_size)

    def _pick(self, seq, candidates: np.ndarray, n_drop: int) -> np.ndarray:
        B = seq.config.block_size
        mass = np.zeros(len(candidates), np.float64)
        for layer in seq.layers:
            m = layer.attn_mass
            for j, c in enumerate(candidates):
                mass[j] += m[c * B : (c + 1) * B].sum() if m.shape[0] > c * B else 0.0
        return np.sort(candidates[np.argsort(mass, kind="stable")[:n_drop]])


_POLICIES = {p.name: p for p in (StopPolicy, RollingPolicy, AttentionPolicy)}


def overflow_policy(name: str) -> OverflowPolicy:
    """The policy called `name` (one of OVERFLOW_POLICIES)."""
    if name not in _POLICIES:
        raise ValueError(f"overflow policy must be one of {', '.join(OVERFLOW_POLICIES)}, not {name!r}")
    return _POLICIES[name]()
