"""Block storage for one layer: quantized K and V blocks in slabs, with reference counts.

A block holds `block_size` tokens of one layer's keys and values, each quantized into one flat
byte row by its `KVFormat`. Rows live in slabs of `slab_blocks` rows, allocated as they are
needed, so `nbytes` is the memory really held and the pool never copies to grow.

    block id b  →  slab b // slab_blocks, row b % slab_blocks
    k slab: (slab_blocks, k_format.bytes_per_block(Hkv, block_size, D))  uint8
    v slab: (slab_blocks, v_format.bytes_per_block(Hkv, block_size, Dv)) uint8
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .formats import KVFormat, get_format

SLAB_BLOCKS = 16


class LayerBlockPool:
    """Fixed-size K/V blocks of one layer, allocated and freed block by block.

    Args:
        k_format, v_format: storage formats of full blocks.
        n_kv_heads, block_size, head_dim, value_dim: block geometry.
        max_blocks: allocation beyond this many blocks in use fails (returns None); None = no limit.
        slab_blocks: rows per slab.
    """

    def __init__(self, k_format: KVFormat, v_format: KVFormat, n_kv_heads: int, block_size: int,
                 head_dim: int, value_dim: int, *, max_blocks: int | None = None,
                 slab_blocks: int = SLAB_BLOCKS):
        self.k_format, self.v_format = k_format, v_format
        self.n_kv_heads, self.block_size = n_kv_heads, block_size
        self.head_dim, self.value_dim = head_dim, value_dim
        self.max_blocks = max_blocks
        self.slab_blocks = slab_blocks
        self.k_row_bytes = k_format.bytes_per_block(n_kv_heads, block_size, head_dim)
        self.v_row_bytes = v_format.bytes_per_block(n_kv_heads, block_size, value_dim)
        self.k_slabs: list[np.ndarray] = []
        self.v_slabs: list[np.ndarray] = []
        self._k_bases = np.zeros(0, np.int64)  # (n_slabs,) address of each slab's first row
        self._v_bases = np.zeros(0, np.int64)
        self.ref_cnt: list[int] = []
        self._free: deque[int] = deque()

    # -- allocation -------------------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        """Block rows that exist (in use or free)."""
        return len(self.ref_cnt)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self._free)

    def allocate(self) -> int | None:
        """A block id with reference count 1, or None when `max_blocks` are in use."""
        if self._free:
            block = self._free.popleft()
        else:
            if self.max_blocks is not None and self.n_blocks >= self.max_blocks:
                return None
            block = self.n_blocks
            if block % self.slab_blocks == 0:
                self.k_slabs.append(np.zeros((self.slab_blocks, self.k_row_bytes), np.uint8))
                self.v_slabs.append(np.zeros((self.slab_blocks, self.v_row_bytes), np.uint8))
                self._k_bases = np.append(self._k_bases, self.k_slabs[-1].ctypes.data)
                self._v_bases = np.append(self._v_bases, self.v_slabs[-1].ctypes.data)
            self.ref_cnt.append(0)
        self.ref_cnt[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_cnt[block] <= 0:
            raise ValueError(f"block {block} is free")
        self.ref_cnt[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; the block returns to the free queue at zero."""
        if self.ref_cnt[block] <= 0:
            raise ValueError(f"block {block} is already free")
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self._free.append(block)

    # -- data ----------------------------------------------------------------------------------
    def _locate(self, block: int) -> tuple[int, int]:
        return divmod(block, self.slab_blocks)

    def write(self, blocks: list[int], k: np.ndarray, v: np.ndarray) -> None:
        """Quantize and store full blocks.

        Args:
            blocks: (n,) ids; k: (n, Hkv, block_size, D) float32; v: (n, Hkv, block_size, Dv).
        """
        k_rows = self.k_format.quantize(k)  # (n, k_row_bytes)
        v_rows = self.v_format.quantize(v)
        for i, block in enumerate(blocks):
            slab, row = self._locate(block)
            self.k_slabs[slab][row] = k_rows[i]
            self.v_slabs[slab][row] = v_rows[i]

    def write_rows(self, block: int, k_row: np.ndarray, v_row: np.ndarray) -> None:
        """Store already-quantized rows (as `v_row`/`k_row` return them, or read from disk)."""
        slab, row = self._locate(block)
        self.k_slabs[slab][row] = k_row
        self.v_slabs[slab][row] = v_row

    def row_addresses(self, blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(nb,) int64 addresses of the K and of the V rows of `blocks` (for kernels that read
        the rows by address). Valid while the pool lives: slabs are never freed or moved."""
        slab, row = np.divmod(np.array(blocks, np.int64), self.slab_blocks)
        return self._k_bases[slab] + row * self.k_row_bytes, self._v_bases[slab] + row * self.v_row_bytes

    def k_row(self, block: int) -> np.ndarray:
        slab, row = self._locate(block)
        return self.k_slabs[slab][row]

    def v_row(self, block: int) -> np.ndarray:
        slab, row = self._locate(block)
        return self.v_slabs[slab][row]

    @property
    def n_free(self) -> int:
        """Blocks allocate() can still hand out without growing past max_blocks."""
        if self.max_blocks is None:
            return 1 << 62
        return len(self._free) + self.max_blocks - len(self.ref_cnt)

    def runs(self, blocks: list[int]) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Group a sequence's blocks by slab: [(slab, rows in the slab, indices into `blocks`)]."""
        ids = np.asarray(blocks, dtype=np.int64)
        slabs = ids // self.slab_blocks
        out = []
        for slab in np.unique(slabs):
            where = np.nonzero(slabs == slab)[0]
            out.append((int(slab), ids[where] - slab * self.slab_blocks, where))
        return out

    def dequantize(self, blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Full dequantized copies: ((n, Hkv, B, D), (n, Hkv, B, Dv)) float32, in `blocks` order."""
        n, B = len(blocks), self.block_size
        k = np.empty((n, self.n_kv_heads, B, self.head_dim), np.float32)
        v = np.empty((n, self.n_kv_heads, B, self.value_dim), np.float32)
        for slab, rows, where in self.runs(blocks):
            k[where] = self.k_format.dequantize(self.k_slabs[slab][rows], self.n_kv_heads, B, self.head_dim)
            v[where] = self.v_format.dequantize(self.v_slabs[slab][rows], self.n_kv_heads, B, self.value_dim)
        return k, v

    # -- accounting --------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the slabs actually allocated (every slab slab_blocks rows of one row size)."""
        return len(self.k_slabs) * self.slab_blocks * (self.k_row_bytes + self.v_row_bytes)

    @property
    def used_bytes(self) -> int:
        """Bytes of the rows of blocks in use (each a row of an allocated slab)."""
        return self.n_used * (self.k_row_bytes + self.v_row_bytes)


def build_pools(config, n_layers: int, n_kv_heads: int, head_dim: int, value_dim: int, *,
                max_tokens: int | None = None) -> list[LayerBlockPool]:
    """One LayerBlockPool per layer with the formats `config` gives that layer (a `KVConfig`).

    Args:
        max_tokens: tokens each pool may hold, rounded up to whole blocks (None: no limit).
    """
    B = config.block_size
    max_blocks = None if max_tokens is None else -(-max_tokens // B)
    return [LayerBlockPool(get_format(p.k_bits, "k"), get_format(p.v_bits, "v"), n_kv_heads, B,
                           head_dim, value_dim, max_blocks=max_blocks)
            for p in config.per_layer(n_layers)]
