"""One layer of one sequence in the paged, quantized KV cache: where its tokens are stored.

Per layer and sequence, the tokens live in three places:

    sinks   positions 0 .. S-1            float16-rounded copy (float32 arrays), never quantized
    blocks  full blocks of B tokens        quantized rows in a LayerBlockPool (block_table order)
    tail    the unfinished block (< B)     float16-rounded (float32 arrays); quantized when full

A query at position p sees a key j through its quantized block when j lies in a block that was
full before p (block(j) < block(p)), and at full precision when j is in p's own block (that block
was the unfinished tail when p was decoded) or is a sink. Prefill of many tokens at once applies
exactly this rule, so chunked prefill, teacher-forced evaluation and token-by-token decode all see
the same cache.

Keys may be stored rotated (k @ H, H an orthonormal Hadamard matrix of the head dimension); the
query is rotated the same way, so q·k is unchanged while outlier channels are spread before
quantizing. Values are never rotated.

`PagedLayerCache` only stores: it appends, trims, attaches, drops and releases blocks, and hands
its attention backend (`paged_attention`) what a step sees, as a `BatchView` or a `DecodeView`
(defined there: they are the backends' input).
"""

from __future__ import annotations

import numpy as np

from ..errors import KVPoolFull
from ..kernels import HAVE_NUMBA
from .cache import LayerKVCache
from .formats import hadamard
from .paged_attention import NO_MASS, BatchView, DecodeView, choose_attention
from .pool import LayerBlockPool

if HAVE_NUMBA:  # (used on the decode kernel's paths only: compiled with them, `warmup._compile_decode`)
    from ..kernels.kv_codes import store_tail_row
else:
    store_tail_row = None


def round_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


class PagedLayerCache(LayerKVCache):
    """One layer of one sequence over a shared LayerBlockPool.

    Attributes:
        block_table: ids of the quantized full blocks, in position order.
        first_position: position of block_table[0]'s first token (> 0 once a sliding-window layer
            has freed blocks that no query can see again).
        attention: the backend `attend` hands its work to (`paged_attention.choose_attention`).
        track_attention: keep `attn_mass`, the attention each key position received, summed over
            heads and queries (H2O eviction); (positions,) float32, index = position.
        defer_release: leave out-of-window blocks to `release_out_of_window` (a prefix cache
            publishes them first, after the forward pass) instead of releasing them in `attend`.
    """

    def __init__(self, pool: LayerBlockPool, *, sinks: int = 4, window: int | None = None,
                 rotation: bool = False, use_kernels: bool | None = None, attention=None,
                 track_attention: bool = False, defer_release: bool = False):
        self.pool = pool
        self.B = pool.block_size
        self.window = window
        self.n_sinks = sinks
        Hkv, D, Dv = pool.n_kv_heads, pool.head_dim, pool.value_dim
        self.rotation = hadamard(D) if rotation else None
        self.attention = attention if attention is not None else choose_attention(pool, use_kernels)
        self.offset = 0
        self.block_table: list[int] = []
        self.first_position = 0
        self.tail_k = np.zeros((Hkv, self.B, D), np.float32)  # (Hkv, B, D)
        self.tail_v = np.zeros((Hkv, self.B, Dv), np.float32)
        self.n_tail = 0
        self.sink_k = np.zeros((Hkv, sinks, D), np.float32)  # (Hkv, S, D)
        self.sink_v = np.zeros((Hkv, sinks, Dv), np.float32)
        self._runs_key: tuple = ()
        self._runs: list = []
        # row_addresses() of the table when it had _rows_n blocks; code that puts blocks into
        # the table sets _rows to None (taking blocks out only shortens it: never back to _rows_n)
        self._rows: tuple[np.ndarray, np.ndarray] | None = None
        self._rows_n = 0
        self.track_attention = track_attention
        self.attn_mass = np.zeros(0, np.float32)
        self.defer_release = defer_release
        # The rows of up to two full blocks as they were before quantizing, (pool id, K (Hkv, B,
        # D), V (Hkv, B, Dv)) in float16 (the values are float16-rounded: exact); a trim that
        # reopens one of them gets its rows back exactly instead of dequantized:
        #   _closed  the block that filled last: a rolled-back speculative draft leaves the layer
        #            as if it had never held the draft
        #   _kept    the block holding position `keep_at` (`keep_exact`) once it filled: a trim
        #            back to that position (a regenerated answer) leaves the layer as if the
        #            answer had never been there, however many blocks the answer filled
        self._closed: tuple[int, np.ndarray, np.ndarray] | None = None
        self._kept: tuple[int, np.ndarray, np.ndarray] | None = None
        self.keep_at: int | None = None

    @property
    def use_kernels(self) -> bool:
        """Whether this layer's attention reads packed codes with the compiled kernels."""
        return self.attention.uses_kernels

    # -- attention (the backend's) -----------------------------------------------------------
    def attend(self, q, k, v, *, scale, window):
        out = self.attention.attend(self, q, k, v, scale=scale, window=window)
        if not self.defer_release:
            self.release_out_of_window()
        return out

    @staticmethod
    def attend_tokens(layers: list[LayerKVCache], q, k, v, *, scale, window):
        """One new token for each of `layers` (one layer of different sequences: q, k, v row i is
        layers[i]'s) attended in one call where the layers allow it (see
        `PagedAttention.attend_tokens`): (n, H, Dv), each row what layers[i].attend would give;
        None, with nothing stored, when they do not."""
        first = layers[0]
        if not all(isinstance(layer, PagedLayerCache) for layer in layers):
            return None
        out = first.attention.attend_tokens(layers, q, k, v, scale=scale, window=window)
        if out is not None:
            for layer in layers:
                if not layer.defer_release:
                    layer.release_out_of_window()
        return out

    def stage_batch(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> BatchView:
        """Store T new tokens (q (T, H, D), k (T, Hkv, D), v (T, Hkv, Dv)) and return what their
        queries see. Raises KVPoolFull before any block changes."""
        T = q.shape[0]
        start = self.offset
        q, k16, v16 = self._as_stored(q, k, v)
        tail_start = start - self.n_tail  # block-aligned: the recent region starts a block
        old_blocks = list(self.block_table)
        old_first = self.first_position
        recent_k, recent_v, recent_kq, recent_vq = self._append(k16, v16, dequantized=True)
        mass = self._mass_upto(start + T)[old_first : start + T] if self.track_attention else None
        return BatchView(q, start, tail_start, old_blocks, old_first, recent_k, recent_v, recent_kq,
                         recent_vq, self.sink_k, self.sink_v, self.n_sinks, self.B, self.pool, mass,
                         self.slab_runs)

    def stage_token(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> DecodeView:
        """Put one new token (q (1, H, D), k (1, Hkv, D), v (1, Hkv, Dv)) at the end of the tail
        and return the decode step's view; `commit_token` finishes the step.

        The block the token completes is quantized here, so that a full pool raises KVPoolFull
        before the layer changes; it joins the table in `commit_token` (this query sees it whole,
        as the tail).
        """
        _, H, D = q.shape
        Hkv = self.pool.n_kv_heads
        q, k = self._rotated(q, k)
        query = np.ascontiguousarray(q[0].reshape(Hkv, H // Hkv, D), dtype=np.float32)
        return self._stage(query, k[0], v[0])

    @staticmethod
    def stage_tokens(layers: list[PagedLayerCache], q: np.ndarray, k: np.ndarray,
                     v: np.ndarray) -> tuple[list[DecodeView], np.ndarray]:
        """`stage_token` for one new token in each of `layers` (one layer of n sequences over one
        pool, all with or all without the rotation; q (n, H, D), k (n, Hkv, D), v (n, Hkv, Dv), row
        i layers[i]'s), the rotation and the queries' layout done once for the n rows.
        Returns (views, queries): views[i] bit for bit what layers[i].stage_token(q[i:i+1],
        k[i:i+1], v[i:i+1]) gives (np.matmul multiplies a stack matrix by matrix, as it does a
        stack of one), and their queries as one C-contiguous (n, Hkv, G, D) float32 array (each
        view's query is a row of it). `commit_token` each view finishes the step.

        Raises KVPoolFull before any layer changes when the pool lacks a block for every token
        that completes one.
        """
        first = layers[0]
        n, H, D = q.shape
        Hkv, B = first.pool.n_kv_heads, first.B
        if sum(layer.n_tail + 1 == B for layer in layers) > first.pool.n_free:
            raise KVPoolFull("the KV block pool is full")
        if first.rotation is not None:
            q, k = q @ first.rotation, k @ first.rotation
        queries = np.ascontiguousarray(q.reshape(n, Hkv, H // Hkv, D), dtype=np.float32)
        k, v = np.ascontiguousarray(k, dtype=np.float32), np.ascontiguousarray(v, dtype=np.float32)
        views = []
        try:
            for i, layer in enumerate(layers):
                views.append(layer._stage(queries[i], k[i], v[i]))
        except BaseException:  # the blocks staged so far go back to the pool
            for view in views:
                for block in view.filled:
                    first.pool.decref(block)
            raise
        return views, queries

    def _stage(self, query: np.ndarray, k: np.ndarray, v: np.ndarray) -> DecodeView:
        """`stage_token`'s work on the token in the stored keys' basis: query (Hkv, G, D) float32
        contiguous, k (Hkv, D), v (Hkv, Dv)."""
        B, S = self.B, self.n_sinks
        start, n = self.offset, self.n_tail
        # float16-rounded, as stored everywhere else (the compiled copy gives numpy's bits)
        if (store_tail_row is not None and k.dtype == v.dtype == np.float32 and k.flags.c_contiguous
                and v.flags.c_contiguous):
            store_tail_row(k, v, self.tail_k, self.tail_v, n)
        else:
            self.tail_k[:, n] = k.astype(np.float16)
            self.tail_v[:, n] = v.astype(np.float16)
        if start < S:
            self.sink_k[:, start] = self.tail_k[:, n]
            self.sink_v[:, start] = self.tail_v[:, n]
        old_first = self.first_position
        n_sink_old = int(min(max(S - old_first, 0), len(self.block_table) * B))
        # key positions old_first .. start are contiguous
        mass = self._mass_upto(start + 1)[old_first : start + 1] if self.track_attention else NO_MASS
        k_rows, v_rows = self.row_addresses()
        filled = self._store(self.tail_k, self.tail_v, 1) if n + 1 == B else []
        if filled:
            self._note_filled(filled[0], start - n, self.tail_k, self.tail_v)
        return DecodeView(query, start, k_rows, v_rows, old_first, n_sink_old, self.sink_k, self.sink_v,
                          self.tail_k, self.tail_v, n + 1, mass, filled)

    def stage_rows(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[DecodeView, np.ndarray]:
        """Store T new tokens (q (T, H, D), k (T, Hkv, D), v (T, Hkv, Dv)) as T `stage_token` +
        `commit_token` would, when they fill no block, are past the sinks and no attention mass
        is kept (the caller checks: a verified draft, `PagedAttention.attend_rows`). Returns the
        first token's decode view and every token's query (T, Hkv, G, D); token i's step is
        that view at position + i with n_recent + i."""
        T, H, D = q.shape
        Hkv = self.pool.n_kv_heads
        if self.rotation is not None:  # row by row: the products of stage_token's shapes
            q, k = (np.concatenate(parts) for parts in zip(*(self._rotated(q[i : i + 1], k[i : i + 1])
                                                              for i in range(T))))
        start, n = self.offset, self.n_tail
        self.tail_k[:, n : n + T] = k.transpose(1, 0, 2).astype(np.float16)
        self.tail_v[:, n : n + T] = v.transpose(1, 0, 2).astype(np.float16)
        n_sink_old = int(min(max(self.n_sinks - self.first_position, 0), len(self.block_table) * self.B))
        k_rows, v_rows = self.row_addresses()
        queries = np.ascontiguousarray(q.reshape(T, Hkv, H // Hkv, D), dtype=np.float32)
        self.offset, self.n_tail = start + T, n + T
        return DecodeView(queries[0], start, k_rows, v_rows, self.first_position, n_sink_old, self.sink_k,
                          self.sink_v, self.tail_k, self.tail_v, n + 1, NO_MASS), queries

    def commit_token(self, view: DecodeView) -> None:
        """The decode step of `view` is done: the token counts as stored."""
        self.offset = view.position + 1
        self.n_tail = view.n_recent
        if view.filled:  # later queries see the full block quantized
            self.block_table.extend(view.filled)
            self._rows = None
            self.n_tail = 0

    # -- storing -----------------------------------------------------------------------------
    def _store(self, recent_k: np.ndarray, recent_v: np.ndarray, n_full: int) -> list[int]:
        """Quantize the first n_full blocks of the recent region into new pool blocks."""
        if n_full == 0:
            return []
        B = self.B
        Hkv, _, D = recent_k.shape
        blocks = []
        for _ in range(n_full):
            block = self.pool.allocate()
            if block is None:
                for b in blocks:
                    self.pool.decref(b)
                raise KVPoolFull("the KV block pool is full")
            blocks.append(block)
        k = recent_k[:, : n_full * B].reshape(Hkv, n_full, B, D).transpose(1, 0, 2, 3)
        v = recent_v[:, : n_full * B].reshape(Hkv, n_full, B, -1).transpose(1, 0, 2, 3)
        self.pool.write(blocks, k, v)
        return blocks

    def release_out_of_window(self) -> None:
        """Release blocks no later query can see (sliding-window layers only)."""
        if self.window is None:
            return
        first_visible = self.offset - self.window + 1  # the next query's oldest visible key
        while self.block_table and self.first_position + self.B <= first_visible:
            self._forget_exact(self.block_table[0])
            self.pool.decref(self.block_table.pop(0))
            self.first_position += self.B

    # -- exact rows of filled blocks -----------------------------------------------------------
    def keep_exact(self, position: int | None) -> None:
        """Keep the rows of the block holding `position` as they are before it is quantized,
        once it fills (None: no block), so that a trim back to `position` leaves the layer as
        one that never held later tokens (`trims_exactly`). One block's rows at most: a later
        call replaces the block."""
        block = None if position is None else self.block_at(position // self.B)
        self.keep_at = position
        # already full: its rows are known only if it is the block that filled last
        self._kept = next((rows for rows in (self._kept, self._closed)
                           if rows is not None and block is not None and rows[0] == block), None)

    def _note_filled(self, block: int, first: int, k: np.ndarray, v: np.ndarray) -> None:
        """Pool block `block` now holds positions first .. first+B-1, quantized from the
        float16-rounded rows k (Hkv, B, D), v (Hkv, B, Dv)."""
        rows = (block, k.astype(np.float16), v.astype(np.float16))
        self._closed = rows
        if self.keep_at is not None and first <= self.keep_at < first + self.B:
            self._kept = rows

    def _exact_rows(self, block: int | None) -> tuple[np.ndarray, np.ndarray] | None:
        """(K (Hkv, B, D), V (Hkv, B, Dv)) of pool block `block` before it was quantized, when
        this layer kept them."""
        for rows in (self._closed, self._kept):
            if rows is not None and block is not None and rows[0] == block:
                return rows[1], rows[2]
        return None

    def trims_exactly(self, target: int) -> bool:
        """Whether `trim` back to `target` tokens leaves this layer as one that never held the
        later tokens: no quantized block is reopened with tokens kept (target in the tail, at
        a block start, or inside the sinks, which stay exact), or the one reopened has its
        rows kept (`_closed`, `_kept`)."""
        if target >= self.offset - self.n_tail or target % self.B == 0 or target <= self.n_sinks:
            return True
        return self._exact_rows(self.block_at(target // self.B)) is not None

    def _forget_exact(self, block: int | None = None) -> None:
        """Kept rows no longer apply once their block leaves the table by any way but `trim`
        (its pool id may come back as another block's); None: every block's."""
        if self._closed is not None and (block is None or self._closed[0] == block):
            self._closed = None
        if self._kept is not None and (block is None or self._kept[0] == block):
            self._kept = None

    def _append(self, k16: np.ndarray, v16: np.ndarray, dequantized: bool = False):
        """Store new tokens' float16-rounded keys/values (Hkv, T, D), (Hkv, T, Dv) (keys already
        rotated): sinks, then full blocks into the pool, the rest into the tail.

        Returns the recent region (old tail + new tokens) at full precision and, when
        `dequantized`, as later queries see it (blocks that filled up replaced by their
        dequantized values): (recent_k, recent_v, recent_kq, recent_vq).
        """
        start, T, B, S = self.offset, k16.shape[1], self.B, self.n_sinks
        Hkv, D = k16.shape[0], k16.shape[2]
        if start < S:
            n = min(S, start + T) - start
            self.sink_k[:, start : start + n] = k16[:, :n]
            self.sink_v[:, start : start + n] = v16[:, :n]
        recent_k = np.concatenate([self.tail_k[:, : self.n_tail], k16], axis=1)  # (Hkv, R, D)
        recent_v = np.concatenate([self.tail_v[:, : self.n_tail], v16], axis=1)
        R = recent_k.shape[1]
        n_full = R // B
        new_blocks = self._store(recent_k, recent_v, n_full)
        recent_kq = recent_vq = None
        if dequantized:
            recent_kq, recent_vq = recent_k.copy(), recent_v.copy()
            if n_full:
                kq, vq = self.pool.dequantize(new_blocks)  # (n_full, Hkv, B, D)
                recent_kq[:, : n_full * B] = kq.transpose(1, 0, 2, 3).reshape(Hkv, n_full * B, D)
                recent_vq[:, : n_full * B] = vq.transpose(1, 0, 2, 3).reshape(Hkv, n_full * B, -1)
        self.block_table.extend(new_blocks)
        self._rows = None
        first = start - self.n_tail  # position of recent column 0 (a block start)
        keep = -1 if self.keep_at is None else (self.keep_at - first) // B
        for j in sorted({keep, n_full - 1}):  # the kept block if it filled now, and the last
            if 0 <= j < n_full:
                cols = slice(j * B, (j + 1) * B)
                self._note_filled(new_blocks[j], first + j * B, recent_k[:, cols], recent_v[:, cols])
        n_rest = R - n_full * B
        self.tail_k[:, :n_rest] = recent_k[:, n_full * B :]
        self.tail_v[:, :n_rest] = recent_v[:, n_full * B :]
        self.n_tail = n_rest
        self.offset = start + T
        return recent_k, recent_v, recent_kq, recent_vq

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Store keys/values (T, Hkv, D), (T, Hkv, Dv) without attending (e.g. `omlx kv-sim`)."""
        _, k = self._rotated(None, k)
        self._append(round_f16(k).transpose(1, 0, 2), round_f16(v).transpose(1, 0, 2))
        self.release_out_of_window()

    def _rotated(self, q, k):
        """(q, k) in the stored keys' basis: multiplied by the Hadamard rotation when the layout
        has one (q·k unchanged); q may be None."""
        if self.rotation is None:
            return q, k
        return (None if q is None else q @ self.rotation), k @ self.rotation

    def _as_stored(self, q, k, v):
        """New tokens as the cache stores them: (q rotated like the keys, k16 (Hkv, T, D), v16
        (Hkv, T, Dv)), keys rotated when the layout says so, both rounded to float16."""
        q, k = self._rotated(q, k)
        return q, round_f16(k).transpose(1, 0, 2), round_f16(v).transpose(1, 0, 2)

    def _mass_upto(self, end: int) -> np.ndarray:
        """attn_mass with room for positions < end (grown, doubling, with zeros)."""
        if self.attn_mass.shape[0] < end:
            grown = np.zeros(max(end, 2 * self.attn_mass.shape[0]), np.float32)
            grown[: self.attn_mass.shape[0]] = self.attn_mass
            self.attn_mass = grown
        return self.attn_mass

    # -- where the blocks are ----------------------------------------------------------------
    def row_addresses(self) -> tuple[np.ndarray, np.ndarray]:
        """Addresses of the K and V pool rows of the block table (`LayerBlockPool.row_addresses`),
        cached until blocks join the table or leave it."""
        if self._rows is None or self._rows_n != len(self.block_table):
            self._rows = self.pool.row_addresses(self.block_table)
            self._rows_n = len(self.block_table)
        return self._rows

    def slab_runs(self, blocks: list[int]) -> list[tuple[int, np.ndarray, slice | np.ndarray]]:
        """pool.runs(blocks) with each run's token columns (a slice when the run's blocks are
        consecutive in the sequence, as they are when allocated in order); cached until the
        block list changes."""
        key = tuple(blocks)
        if self._runs_key != key:
            B = self.B
            runs = []
            for slab, rows, where in self.pool.runs(blocks):
                if len(where) and where[-1] - where[0] == len(where) - 1:
                    cols = slice(int(where[0]) * B, (int(where[-1]) + 1) * B)
                else:
                    cols = (where[:, None] * B + np.arange(B)).ravel()
                runs.append((slab, rows, cols))
            self._runs_key, self._runs = key, runs
        return self._runs

    def block_at(self, index: int) -> int | None:
        """Pool id of full block `index` (position index*B ..), None if released or not full."""
        j = index - self.first_position // self.B
        return self.block_table[j] if 0 <= j < len(self.block_table) else None

    def blocks_needed(self, n_tokens: int) -> int:
        """New pool blocks that appending n_tokens would allocate."""
        return (self.n_tail + n_tokens) // self.B

    def first_needed_block(self, n_blocks: int) -> int:
        """The oldest block a query right after n_blocks full blocks can see (window layers)."""
        if self.window is None:
            return 0
        return max(0, (n_blocks * self.B - self.window + 1) // self.B)

    # -- bookkeeping -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """This sequence's own buffers (tail and sinks); pool blocks are counted by the pool."""
        return self.tail_k.nbytes + self.tail_v.nbytes + self.sink_k.nbytes + self.sink_v.nbytes

    def trim(self, n: int) -> None:
        """Forget the last n tokens. Tokens of a quantized block that stay come back into the tail:
        exactly as they were before the block filled when it is the block that filled last (a
        rolled-back speculative draft, see `kv.batch.VerifyBatch`) or the kept one (`keep_exact`:
        a regenerated answer), else as stored (dequantized), which is what later queries would
        have seen anyway except that they are now in the unfinished block (`trims_exactly` says
        which)."""
        target = max(0, self.offset - n)
        # The next query (at `target`) needs the window - 1 keys before it too.
        lowest = target if self.window is None else max(0, target - self.window + 1)
        if lowest < self.first_position:
            raise ValueError("cannot trim into blocks a sliding window already released")
        while self.offset - self.n_tail > target:  # the tail starts after target: reopen a block
            block = self.block_table.pop()
            exact = self._exact_rows(block)
            if exact is not None:
                self.tail_k[:], self.tail_v[:] = exact
            else:
                k, v = self.pool.dequantize([block])
                self.tail_k[:] = k[0]
                self.tail_v[:] = v[0]
            self._forget_exact(block)
            self.pool.decref(block)
            self.offset -= self.n_tail
            self.n_tail = self.B
            s = self.offset - self.B
            n_sink = int(np.clip(self.n_sinks - s, 0, self.B))
            if n_sink:  # sinks stay exact
                self.tail_k[:, :n_sink] = self.sink_k[:, s : s + n_sink]
                self.tail_v[:, :n_sink] = self.sink_v[:, s : s + n_sink]
        self.n_tail -= self.offset - target
        self.offset = target
        self.attn_mass[target:] = 0  # the forgotten positions' attention is not the next tokens'

    def attach(self, blocks: list[int | None], sink_k: np.ndarray | None, sink_v: np.ndarray | None) -> None:
        """Start this empty layer on cached full blocks for positions 0 .. len(blocks)*B - 1
        (one reference taken per block). Blocks a window layer cannot see again may be None."""
        if self.offset:
            raise ValueError("attach needs an empty layer cache")
        n = len(blocks)
        first = self.first_needed_block(n)
        table = blocks[first:]
        if any(b is None for b in table):
            raise ValueError("a block this layer still needs is missing")
        for b in table:
            self.pool.incref(b)
        self.block_table = list(table)
        self._rows = None
        self.first_position = first * self.B
        self.offset = n * self.B
        self.n_tail = 0
        if sink_k is not None and n:
            S = min(self.n_sinks, self.offset, sink_k.shape[1])
            self.sink_k[:, :S] = sink_k[:, :S]
            self.sink_v[:, :S] = sink_v[:, :S]

    def drop_blocks(self, dropped: np.ndarray, rerotate, allocate) -> None:
        """Forget full blocks (sorted global block indices, none of them a sink block) and move
        every later token down so positions stay contiguous: keys of later blocks are
        re-rotated (dequantized, rotated by -shift, quantized into new blocks; values copied as
        stored), the float tail is rotated in place.

        Args:
            rerotate: (keys (T, Hkv, D), by (T,)) → keys at position + by.
            allocate: () → a new pool block id (may evict cached blocks), or None.
        """
        self._forget_exact()
        self.keep_at = None  # positions move
        B = self.B
        dropped = np.asarray(dropped, dtype=np.int64)
        base = self.first_position // B
        dropped_set = set(int(d) for d in dropped)
        kept, moved = [], []  # moved: (index in kept, old block, shift in tokens)
        for j, block in enumerate(self.block_table):
            index = base + j
            if index in dropped_set:
                self.pool.decref(block)
                continue
            shift = B * int(np.searchsorted(dropped, index))
            if shift:
                moved.append((len(kept), block, shift))
            kept.append(block)
        if moved:
            old = [b for _, b, _ in moved]
            k, _ = self.pool.dequantize(old)  # (n, Hkv, B, D)
            n, Hkv, _, D = k.shape
            if self.rotation is not None:
                k = k @ self.rotation.T
            by = -np.repeat(np.array([m[2] for m in moved], dtype=np.int64), B)  # (n*B,)
            tokens = rerotate(k.transpose(0, 2, 1, 3).reshape(n * B, Hkv, D), by)
            k = tokens.reshape(n, B, Hkv, D).transpose(0, 2, 1, 3)
            if self.rotation is not None:
                k = k @ self.rotation
            k_rows = self.pool.k_format.quantize(np.ascontiguousarray(k, dtype=np.float32))
            for i, (where, old_block, _) in enumerate(moved):
                new_block = allocate()
                if new_block is None:
                    raise KVPoolFull("the KV block pool is full")
                self.pool.write_rows(new_block, k_rows[i], self.pool.v_row(old_block))
                self.pool.decref(old_block)
                kept[where] = new_block
        total = B * len(dropped)
        if self.n_tail and total:
            tail = self.tail_k[:, : self.n_tail]  # (Hkv, n_tail, D)
            if self.rotation is not None:
                tail = tail @ self.rotation.T
            tail = rerotate(tail.transpose(1, 0, 2), np.full(self.n_tail, -total, np.int64)).transpose(1, 0, 2)
            if self.rotation is not None:
                tail = tail @ self.rotation
            self.tail_k[:, : self.n_tail] = round_f16(tail)
        if self.attn_mass.shape[0]:
            keep = np.ones(self.offset, bool)
            for d in dropped:
                keep[d * B : (d + 1) * B] = False
            self.attn_mass = self.attn_mass[: self.offset][keep[: self.attn_mass.shape[0]]]
        self.first_position -= B * int(np.searchsorted(dropped, base))
        self.offset -= total
        self.block_table = kept
        self._rows = None

    def release(self) -> None:
        """Return every block to the pool."""
        self._forget_exact()
        self.keep_at = None
        for block in self.block_table:
            self.pool.decref(block)
        self.block_table.clear()
        self.offset = self.n_tail = 0
        self.first_position = 0
