"""The KV budget the scheduler admits sequences under, in pool blocks per layer.

Every pool has `max_blocks` blocks of `block_size` tokens (`kv_tokens` rounded up to whole blocks).
An admitted sequence reserves the blocks of its worst case, prompt + max_tokens tokens; admission
needs the reservations of all running sequences plus the new one to fit in `max_blocks` less the
blocks pinned in the prefix cache (`PrefixCache.pinned_blocks`: eviction never frees them). Blocks
the prefix cache holds for no sequence are evicted on demand, and shared blocks count in each
reservation, so a running sequence always finds its blocks: it is never failed for lack of KV
memory; a new one waits instead.
"""

from __future__ import annotations


class KVBudget:
    def __init__(self, kv_tokens: int, block_size: int):
        self.kv_tokens = kv_tokens
        self.block_size = block_size
        self.max_blocks = -(-kv_tokens // block_size)

    def blocks_for(self, n_tokens: int) -> int:
        """Pool blocks a sequence of n_tokens holds in each layer: its full blocks (the unfinished
        one lives in the sequence's tail buffer). A job's sequence stores at most prompt +
        max_tokens - 1 tokens (the last token sampled is never fed back)."""
        return n_tokens // self.block_size

    def fits(self, n_prompt: int, max_tokens: int) -> bool:
        """Whether a request could ever be admitted (alone, the budget empty)."""
        return self.blocks_for(n_prompt + max_tokens) <= self.max_blocks

    def admits(self, need: int, reserved: int, prefix) -> bool:
        """Whether a sequence reserving `need` blocks fits beside the `reserved` blocks of the
        running sequences, with the blocks pinned in `prefix` (their shared PrefixCache) kept."""
        return reserved + need <= self.max_blocks - prefix.pinned_blocks()

    def capacity_bytes(self, prefix) -> int:
        """The budget's bytes in the pools of `prefix` (every layer's K and V rows)."""
        return self.max_blocks * prefix.block_bytes
