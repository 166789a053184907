"""The paged, quantized KV cache: what decode really sees.

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
"""

from __future__ import annotations

import numpy as np

from ..errors import ContextFull, KVPoolFull  # noqa: F401  (ContextFull re-exported)
from .cache import KVCache, LayerKVCache
from .config import KVConfig
from .formats import get_format, hadamard
from .pool import LayerBlockPool

try:  # compiled attention over packed codes; the numpy path below is the reference
    from ..kernels import HAVE_NUMBA

    if HAVE_NUMBA:
        from ..kernels import kv_codes
except ImportError:  # pragma: no cover
    HAVE_NUMBA = False

# Queries per KV head (query heads per KV head × new tokens) up to which the packed-code kernels
# are used; larger prefill batches dequantize the old blocks once and use BLAS.
KERNEL_MAX_QUERIES = 16
_NO_MASS = np.zeros(0, np.float32)
# Query rows per block of a batched attention's score matrix ((Hkv, G*rows, keys) float32).
ATTEND_ROWS = 128


def _round_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


class PagedLayerCache(LayerKVCache):
    """One layer of one sequence over a shared LayerBlockPool.

    Attributes:
        block_table: ids of the quantized full blocks, in position order.
        first_position: position of block_table[0]'s first token (> 0 once a sliding-window layer
            has freed blocks that no query can see again).
    """

    def __init__(self, pool: LayerBlockPool, *, sinks: int = 4, window: int | None = None,
                 rotation: bool = False, use_kernels: bool | None = None):
        self.pool = pool
        self.B = pool.block_size
        self.window = window
        self.n_sinks = sinks
        Hkv, D, Dv = pool.n_kv_heads, pool.head_dim, pool.value_dim
        self.rotation = hadamard(D) if rotation else None
        kernel_formats = D % 8 == 0 and Dv % 8 == 0
        wanted = HAVE_NUMBA if use_kernels is None else (use_kernels and HAVE_NUMBA)
        self.use_kernels = wanted and kernel_formats
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
        self._rows_key: tuple = ()
        self._rows: tuple = ()
        if self.use_kernels:
            self._k_layout = kv_codes.decode_layout(pool.k_format, Hkv, self.B, D)
            self._v_layout = kv_codes.decode_layout(pool.v_format, Hkv, self.B, Dv)
        # Attention each key position received, summed over heads and queries (H2O eviction);
        # only kept when track_attention is set. (positions,) float32, index = position.
        self.track_attention = False
        self.attn_mass = np.zeros(0, np.float32)
        # With a prefix cache, out-of-window blocks are released after the forward pass, once
        # they are published (the cache keeps its own reference), not inside attend.
        self.defer_release = False

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

    def _free_out_of_window(self) -> None:
        """Release blocks no later query can see (sliding-window layers only)."""
        if self.window is None:
            return
        first_visible = self.offset - self.window + 1  # the next query's oldest visible key
        while self.block_table and self.first_position + self.B <= first_visible:
            self.pool.decref(self.block_table.pop(0))
            self.first_position += self.B

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
        n_rest = R - n_full * B
        self.tail_k[:, :n_rest] = recent_k[:, n_full * B :]
        self.tail_v[:, :n_rest] = recent_v[:, n_full * B :]
        self.n_tail = n_rest
        self.offset = start + T
        return recent_k, recent_v, recent_kq, recent_vq

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Store keys/values (T, Hkv, D), (T, Hkv, Dv) without attending (e.g. `omlx kv-sim`)."""
        _, k = self._rotated(None, k)
        self._append(_round_f16(k).transpose(1, 0, 2), _round_f16(v).transpose(1, 0, 2))
        self._free_out_of_window()

    # -- attention ---------------------------------------------------------------------------
    def attend(self, q, k, v, *, scale, window):
        if q.shape[0] == 1 and self.use_kernels:
            return self._attend_one(q, k, v, scale, window)
        T, H, D = q.shape
        if HAVE_NUMBA and (H // self.pool.n_kv_heads) * T > KERNEL_MAX_QUERIES:
            return self._attend_many(q, k, v, scale, window)
        Hkv = self.pool.n_kv_heads
        G = H // Hkv
        B, S = self.B, self.n_sinks
        start = self.offset
        q, k16, v16 = self._as_stored(q, k, v)
        tail_start = start - self.n_tail
        old_blocks = list(self.block_table)
        old_first = self.first_position
        recent_k, recent_v, recent_kq, recent_vq = self._append(k16, v16, dequantized=True)

        q_pos = np.arange(start, start + T)
        qg = q.reshape(T, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * T, D)
        q_pos_g = np.tile(q_pos, G)  # (G*T,) query position of row g*T + t
        r_pos = np.arange(tail_start, start + T)  # (R,)
        sc = np.float32(scale)

        # Scores over the recent region: quantized where j's block was full before p's block began.
        s_fp = np.matmul(qg, recent_k.transpose(0, 2, 1)) * sc  # (Hkv, G*T, R)
        s_q = np.matmul(qg, recent_kq.transpose(0, 2, 1)) * sc
        same_block = (r_pos[None, :] // B) >= (q_pos_g[:, None] // B)  # (G*T, R)
        use_fp = same_block | (r_pos[None, :] < S)
        s_recent = np.where(use_fp[None], s_fp, s_q)

        # Scores over the old blocks (all quantized before this call).
        L_old = len(old_blocks) * B
        old_pos = np.arange(old_first, old_first + L_old)
        n_sink_old = int(np.clip(S - old_first, 0, L_old))  # sink columns at the head of the old region
        via_kernel = self.use_kernels and L_old > 0 and G * T <= KERNEL_MAX_QUERIES
        if L_old == 0:
            s_old = np.zeros((Hkv, G * T, 0), np.float32)
        elif via_kernel:
            s_old = self._kernel_scores(qg, old_blocks) * sc
        else:
            k_old, v_old = self.pool.dequantize(old_blocks)  # (nb, Hkv, B, D)
            k_old = k_old.transpose(1, 0, 2, 3).reshape(Hkv, L_old, D)
            v_old = v_old.transpose(1, 0, 2, 3).reshape(Hkv, L_old, -1)
            if n_sink_old:
                k_old[:, :n_sink_old] = self.sink_k[:, old_first : old_first + n_sink_old]
                v_old[:, :n_sink_old] = self.sink_v[:, old_first : old_first + n_sink_old]
            s_old = np.matmul(qg, k_old.transpose(0, 2, 1)) * sc
        if via_kernel and n_sink_old:
            sink_k = self.sink_k[:, old_first : old_first + n_sink_old]
            s_old[:, :, :n_sink_old] = np.matmul(qg, sink_k.transpose(0, 2, 1)) * sc

        # Softmax over [old | recent] with the causal and sliding-window mask.
        scores = np.concatenate([s_old, s_recent], axis=2)  # (Hkv, G*T, L_old + R)
        k_pos = np.concatenate([old_pos, r_pos])
        visible = k_pos[None, :] <= q_pos_g[:, None]
        if window is not None:
            visible &= (q_pos_g[:, None] - k_pos[None, :]) < window
        scores = np.where(visible[None], scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        p_old, p_recent = scores[:, :, :L_old], scores[:, :, L_old:]
        if self.track_attention:  # key positions old_first .. start+T-1 are contiguous
            self._mass_upto(start + T)[old_first : start + T] += scores.sum(axis=(0, 1))

        p_fp = np.where(use_fp[None], p_recent, np.float32(0))
        out = np.matmul(p_fp, recent_v) + np.matmul(p_recent - p_fp, recent_vq)  # (Hkv, G*T, Dv)
        if L_old:
            if via_kernel:
                if n_sink_old:
                    p_sink = p_old[:, :, :n_sink_old].copy()
                    p_old = p_old.copy()
                    p_old[:, :, :n_sink_old] = 0
                    out += np.matmul(p_sink, self.sink_v[:, old_first : old_first + n_sink_old])
                out += self._kernel_values(p_old, old_blocks)
            else:
                out += np.matmul(p_old, v_old)
        if not self.defer_release:
            self._free_out_of_window()
        Dv = out.shape[-1]
        return out.reshape(Hkv, G, T, Dv).transpose(2, 0, 1, 3).reshape(T, H, Dv)

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
        return q, _round_f16(k).transpose(1, 0, 2), _round_f16(v).transpose(1, 0, 2)

    def _mass_upto(self, end: int) -> np.ndarray:
        """attn_mass with room for positions < end (grown, doubling, with zeros)."""
        if self.attn_mass.shape[0] < end:
            grown = np.zeros(max(end, 2 * self.attn_mass.shape[0]), np.float32)
            grown[: self.attn_mass.shape[0]] = self.attn_mass
            self.attn_mass = grown
        return self.attn_mass

    def _attend_many(self, q, k, v, scale, window):
        """`attend` for a batch of new tokens (prefill, teacher forcing): one BLAS product over
        the keys as stored (old blocks and the blocks that fill up now, dequantized), then the
        few scores that see full precision recomputed — each query's own block and the sinks —,
        the masked softmax in one compiled pass per row, and the values likewise."""
        T, H, D = q.shape
        Hkv, B, S = self.pool.n_kv_heads, self.B, self.n_sinks
        G = H // Hkv
        start = self.offset
        q, k16, v16 = self._as_stored(q, k, v)
        tail_start = start - self.n_tail  # block-aligned: the recent region starts a block
        old_blocks = list(self.block_table)
        old_first = self.first_position
        recent_k, recent_v, recent_kq, recent_vq = self._append(k16, v16, dequantized=True)
        R = recent_k.shape[1]
        L_old = len(old_blocks) * B
        if L_old:
            k_old, v_old = self.pool.dequantize(old_blocks)  # (nb, Hkv, B, D)
            k_old = k_old.transpose(1, 0, 2, 3).reshape(Hkv, L_old, D)
            v_old = v_old.transpose(1, 0, 2, 3).reshape(Hkv, L_old, -1)
            n_sink_old = int(np.clip(S - old_first, 0, L_old))
            if n_sink_old:
                k_old[:, :n_sink_old] = self.sink_k[:, old_first : old_first + n_sink_old]
                v_old[:, :n_sink_old] = self.sink_v[:, old_first : old_first + n_sink_old]
            keys = np.concatenate([k_old, recent_kq], axis=1)  # (Hkv, L, D)
            values = np.concatenate([v_old, recent_vq], axis=1)
        else:
            keys, values = recent_kq, recent_vq
        q4 = q.reshape(T, Hkv, G, D).transpose(1, 2, 0, 3)  # (Hkv, G, T, D)
        # Full precision where the stored copy differs: each query's own block (a block that
        # filled up during this call) and sink positions inside the recent region.
        fixes = []  # (query rows t0:t1, recent columns c0:c1), disjoint
        for c0 in range(0, R - R % B, B):  # recent blocks that are now full (quantized)
            t0 = min(T, max(0, tail_start + c0 - start))
            t1 = min(T, max(0, tail_start + c0 + B - start))
            if t0 < t1:  # the block's own queries
                fixes.append((t0, t1, c0, c0 + B))
            sinks_end = min(c0 + B, S - tail_start)
            if sinks_end > c0 and t1 < T:  # sinks in this block, for the later queries
                fixes.append((t1, T, c0, sinks_end))
        # Visible columns of query t: [lo, hi), causal and sliding-window.
        q_pos = np.arange(start, start + T)
        hi = q_pos - old_first + 1
        lo = np.zeros(T, np.int64) if window is None else np.maximum(0, q_pos - window + 1 - old_first)
        if self.track_attention:
            self._mass_upto(start + T)
        Dv = values.shape[-1]
        out = np.empty((T, Hkv, G, Dv), np.float32)
        # Rows in blocks of ATTEND_ROWS queries, each over the columns its rows can see: the score
        # matrix stays small (peak memory at long contexts) and the causal triangle is skipped.
        for r0 in range(0, T, ATTEND_ROWS):
            r1 = min(T, r0 + ATTEND_ROWS)
            n, c_lo, c_hi = r1 - r0, int(lo[r0]), int(hi[r1 - 1])
            q_rows = q4[:, :, r0:r1]  # (Hkv, G, n, D)
            scores = np.matmul(q_rows.reshape(Hkv, G * n, D), keys[:, c_lo:c_hi].transpose(0, 2, 1))
            s4 = scores.reshape(Hkv, G, n, c_hi - c_lo)
            row_fixes = []  # (rows a:b of this block, columns a..b of s4, recent columns c0:c1)
            for t0, t1, c0, c1 in fixes:
                a, b = max(t0, r0) - r0, min(t1, r1) - r0
                c0, c1 = max(c0, c_lo - L_old), min(c1, c_hi - L_old)  # the columns in view
                if a < b and c0 < c1:
                    cols = (L_old + c0 - c_lo, L_old + c1 - c_lo)
                    row_fixes.append((a, b, cols, c0, c1))
                    s4[:, :, a:b, cols[0] : cols[1]] = np.matmul(
                        q_rows[:, :, a:b], recent_k[:, None, c0:c1].transpose(0, 1, 3, 2))
            kv_codes.masked_softmax(scores, lo[r0:r1] - c_lo, hi[r0:r1] - c_lo, np.float32(scale))
            if self.track_attention:  # key positions old_first + c_lo .. are contiguous
                self.attn_mass[old_first + c_lo : old_first + c_hi] += scores.sum(axis=(0, 1))
            # The fixed regions' weights go to the full-precision values instead of the stored
            # ones (taken out of the big product rather than corrected by a difference, so that a
            # float16 cache, where both copies are equal, gives bit-identical results).
            p_fix = []
            for a, b, (x0, x1), _, _ in row_fixes:
                p_fix.append(s4[:, :, a:b, x0:x1].copy())
                s4[:, :, a:b, x0:x1] = 0
            o = np.matmul(scores, values[:, c_lo:c_hi]).reshape(Hkv, G, n, Dv)
            for (a, b, _, c0, c1), p in zip(row_fixes, p_fix):
                o[:, :, a:b] += np.matmul(p, recent_v[:, None, c0:c1])
            out[r0:r1] = o.transpose(2, 0, 1, 3)
        if not self.defer_release:
            self._free_out_of_window()
        return out.reshape(T, H, Dv)

    def _attend_one(self, q, k, v, scale, window):
        """`attend` for one new token (decode) in one compiled call (`kv_codes.decode_attention`):
        the same visibility rule as the general path, where a single query's own block is the
        tail (plus the new token) and every earlier full block is seen quantized."""
        _, H, D = q.shape
        Hkv, B, S = self.pool.n_kv_heads, self.B, self.n_sinks
        q, k = self._rotated(q, k)
        start, n = self.offset, self.n_tail
        self.tail_k[:, n] = k[0].astype(np.float16)  # float16-rounded, as stored everywhere else
        self.tail_v[:, n] = v[0].astype(np.float16)
        if start < S:
            self.sink_k[:, start] = self.tail_k[:, n]
            self.sink_v[:, start] = self.tail_v[:, n]
        old_first = self.first_position
        n_sink_old = int(min(max(S - old_first, 0), len(self.block_table) * B))
        first_visible = 0 if window is None else max(0, start - window + 1 - old_first)
        if self.track_attention:  # key positions old_first .. start are contiguous
            mass = self._mass_upto(start + 1)[old_first : start + 1]
        else:
            mass = _NO_MASS
        k_rows, v_rows = self._row_addresses()
        # The block the new token completes is quantized first, so that a full pool raises
        # before anything changes (it joins the table after the step: this query sees it whole).
        filled = self._store(self.tail_k, self.tail_v, 1) if n + 1 == B else []
        out = np.empty((Hkv, H // Hkv, self.pool.value_dim), np.float32)
        kv_codes.decode_attention(
            k_rows, v_rows, self._k_layout, self._v_layout, B,
            np.ascontiguousarray(q[0].reshape(Hkv, H // Hkv, D), dtype=np.float32), np.float32(scale),
            self.sink_k, self.sink_v, old_first, n_sink_old, self.tail_k, self.tail_v, n + 1, first_visible, mass, out)
        self.offset = start + 1
        self.n_tail = n + 1
        if filled:  # later queries see the full block quantized
            self.block_table.extend(filled)
            self.n_tail = 0
        if not self.defer_release:
            self._free_out_of_window()
        return out.reshape(1, H, -1)

    def _row_addresses(self) -> tuple[np.ndarray, np.ndarray]:
        """Addresses of the K and V pool rows of the block table (`kv_codes.row_addresses`),
        cached until the table or the pool's slabs change."""
        pool = self.pool
        key = (tuple(self.block_table), len(pool.k_slabs))
        if self._rows_key != key:
            self._rows = (kv_codes.row_addresses(pool.k_slabs, pool.slab_blocks, self.block_table),
                          kv_codes.row_addresses(pool.v_slabs, pool.slab_blocks, self.block_table))
            self._rows_key = key
        return self._rows

    def _slab_runs(self, blocks: list[int]) -> list[tuple[int, np.ndarray, slice | np.ndarray]]:
        """pool.runs(blocks) with each run's token columns (a slice when the run's blocks are
        consecutive in the sequence, as they are when allocated in order); cached until the
        block table changes."""
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

    def _kernel_scores(self, qg: np.ndarray, blocks: list[int]) -> np.ndarray:
        """q·k over quantized blocks straight from their packed codes: (Hkv, M, nb*B)."""
        pool, B = self.pool, self.B
        Hkv, M, _ = qg.shape
        out = np.empty((Hkv, M, len(blocks) * B), np.float32)
        for slab, rows, cols in self._slab_runs(blocks):
            out[:, :, cols] = kv_codes.attention_scores(pool.k_format, pool.k_slabs[slab], rows, qg, B)
        return out

    def _kernel_values(self, p: np.ndarray, blocks: list[int]) -> np.ndarray:
        """Σ p·v over quantized blocks straight from their packed codes: (Hkv, M, Dv)."""
        pool, B = self.pool, self.B
        out = None
        for slab, rows, cols in self._slab_runs(blocks):
            part = kv_codes.weighted_values(pool.v_format, pool.v_slabs[slab], rows, p[:, :, cols], B,
                                            pool.value_dim)
            out = part if out is None else out + part
        return out

    # -- bookkeeping -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """This sequence's own buffers (tail and sinks); pool blocks are counted by the pool."""
        return self.tail_k.nbytes + self.tail_v.nbytes + self.sink_k.nbytes + self.sink_v.nbytes

    def trim(self, n: int) -> None:
        """Forget the last n tokens. Tokens of a quantized block that stay come back into the tail
        as stored (dequantized), which is what later queries would have seen anyway except that
        they are now in the unfinished block."""
        target = max(0, self.offset - n)
        # The next query (at `target`) needs the window - 1 keys before it too.
        lowest = target if self.window is None else max(0, target - self.window + 1)
        if lowest < self.first_position:
            raise ValueError("cannot trim into blocks a sliding window already released")
        while self.offset - self.n_tail > target:  # the tail starts after target: reopen a block
            block = self.block_table.pop()
            k, v = self.pool.dequantize([block])
            self.pool.decref(block)
            self.tail_k[:] = k[0]
            self.tail_v[:] = v[0]
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

    def first_needed_block(self, n_blocks: int) -> int:
        """The oldest block a query right after n_blocks full blocks can see (window layers)."""
        if self.window is None:
            return 0
        return max(0, (n_blocks * self.B - self.window + 1) // self.B)

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
        self.first_position = first * self.B
        self.offset = n * self.B
        self.n_tail = 0
        if sink_k is not None and n:
            S = min(self.n_sinks, self.offset, sink_k.shape[1])
            self.sink_k[:, :S] = sink_k[:, :S]
            self.sink_v[:, :S] = sink_v[:, :S]

    def block_at(self, index: int) -> int | None:
        """Pool id of full block `index` (position index*B ..), None if released or not full."""
        j = index - self.first_position // self.B
        return self.block_table[j] if 0 <= j < len(self.block_table) else None

    def drop_blocks(self, dropped: np.ndarray, rerotate, allocate) -> None:
        """Forget full blocks (sorted global block indices, none of them a sink block) and move
        every later token down so positions stay contiguous: keys of later blocks are
        re-rotated (dequantized, rotated by -shift, quantized into new blocks; values copied as
        stored), the float tail is rotated in place.

        Args:
            rerotate: (keys (T, Hkv, D), by (T,)) → keys at position + by.
            allocate: () → a new pool block id (may evict cached blocks), or None.
        """
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
            self.tail_k[:, : self.n_tail] = _round_f16(tail)
        if self.attn_mass.shape[0]:
            keep = np.ones(self.offset, bool)
            for d in dropped:
                keep[d * B : (d + 1) * B] = False
            self.attn_mass = self.attn_mass[: self.offset][keep[: self.attn_mass.shape[0]]]
        self.first_position -= B * int(np.searchsorted(dropped, base))
        self.offset -= total
        self.block_table = kept

    def blocks_needed(self, n_tokens: int) -> int:
        """New pool blocks that appending n_tokens would allocate."""
        return (self.n_tail + n_tokens) // self.B

    def release(self) -> None:
        """Return every block to the pool."""
        for block in self.block_table:
            self.pool.decref(block)
        self.block_table.clear()
        self.offset = self.n_tail = 0
        self.first_position = 0


_attention_warm = False


def warm_up_attention() -> float:
    """Compile, or load from numba's on-disk cache, the attention kernels (the decode step with
    every width's code path, the batched softmax, the packed-code kernels short batches use) once
    per process, on a tiny cache; logs the time (first start on a machine: tens of seconds; later:
    a fraction of one). One format is enough: numba compiles per argument types, and every
    format's layout is the same tuple of ints. Returns the seconds spent (0 when already done or
    numba is missing)."""
    global _attention_warm
    if _attention_warm or not HAVE_NUMBA:
        return 0.0
    import logging
    import time

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    layer = PagedKVCache(KVConfig.parse("k4v4,bs=16"), n_layers=1, n_kv_heads=1, head_dim=32)[0]
    q, k = rng.standard_normal((40, 2, 32)).astype(np.float32), rng.standard_normal((40, 1, 32)).astype(np.float32)
    layer.attend(q[:36], k[:36], k[:36], scale=0.25, window=None)  # batched: fills 2 blocks
    layer.attend(q[36:37], k[36:37], k[36:37], scale=0.25, window=None)  # one decode step (intrinsics)
    layer.attend(q[37:40], k[37:40], k[37:40], scale=0.25, window=None)  # a short batch: packed-code path
    _attention_warm = True
    seconds = time.perf_counter() - t0
    logging.getLogger("omlx.kernels").info("attention kernels ready in %.2f s", seconds)
    return seconds


OVERFLOW_POLICIES = ("stop", "rolling", "attention")


class PagedKVCache(KVCache):
    """One sequence's paged cache over per-layer pools, built from a KVConfig.

    The pools are the sequence's own, or shared with other sequences through a PrefixCache
    (which then also publishes the blocks that fill up, and evicts cached blocks for room).

    Context limit: with `limit` set, appending past it applies `overflow`:
        stop       raise ContextFull
        rolling    drop the oldest unprotected full blocks (protected: the first
                   `protected_tokens` — system prompt and pinned documents — and at least the
                   sink block), a quarter of the context at a time
        attention  drop the unprotected full blocks that received the least accumulated
                   attention (H2O), keeping the most recent eighth of the context
    Later tokens move down (keys re-rotated) so positions never pass `limit`; `dropped_tokens`
    counts what was dropped.
    """

    def __init__(self, config: KVConfig, *, n_layers: int, n_kv_heads: int, head_dim: int,
                 value_dim: int | None = None, windows: list[int | None] | None = None,
                 max_tokens: int | None = None, use_kernels: bool | None = None,
                 pools: list[LayerBlockPool] | None = None, prefix_cache=None,
                 limit: int | None = None, overflow: str = "stop", protected_tokens: int = 0,
                 rerotate=None):
        value_dim = head_dim if value_dim is None else value_dim
        windows = windows or [None] * n_layers
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow policy must be one of {', '.join(OVERFLOW_POLICIES)}, not {overflow!r}")
        self.config = config
        self.precisions = config.per_layer(n_layers)
        self.prefix_cache = prefix_cache
        if pools is None:
            max_blocks = None if max_tokens is None else -(-max_tokens // config.block_size)
            pools = [LayerBlockPool(get_format(p.k_bits, "k"), get_format(p.v_bits, "v"), n_kv_heads,
                                    config.block_size, head_dim, value_dim, max_blocks=max_blocks)
                     for p in self.precisions]
        self.pools = pools
        layers: list[LayerKVCache] = [
            PagedLayerCache(pool, sinks=config.sinks, window=windows[i], rotation=config.rotation,
                            use_kernels=use_kernels)
            for i, pool in enumerate(pools)
        ]
        super().__init__(layers)
        self.limit = limit
        self.overflow = overflow
        self.protected_tokens = protected_tokens
        self.rerotate = rerotate  # (layer, keys (T, Hkv, D), by (T,)) → keys; the model's
        self.dropped_tokens = 0
        self.keep_sink_blocks = max(1, -(-config.sinks // config.block_size))
        self.token_ids: list[int] = []  # the tokens the cache holds, in position order
        self.history: list[int] = []  # every token appended, dropped ones included
        self.chain_keys: list[bytes] = []  # prefix-cache keys of the leading full blocks
        self.n_published = 0  # leading full blocks already handed to the prefix cache
        self.chain_end: int | None = None  # blocks from here on no longer extend a token prefix
        for layer in self.layers:
            layer.track_attention = overflow == "attention"
            layer.defer_release = prefix_cache is not None

    # -- forward hooks -------------------------------------------------------------------------
    def begin_forward(self, tokens: np.ndarray) -> None:
        T = len(tokens)
        if self.limit is not None and self.offset + T > self.limit:
            self.make_room(T)
        self.reserve(T)
        new = [int(t) for t in tokens]
        self.token_ids.extend(new)
        self.history.extend(new)

    def end_forward(self) -> None:
        if self.prefix_cache is None:
            return
        n_full = self.offset // self.config.block_size
        if self.chain_end is not None:
            n_full = min(n_full, self.chain_end)
        if n_full > self.n_published:
            self.prefix_cache.publish(self, self.n_published, n_full)
        for layer in self.layers:
            layer._free_out_of_window()

    # -- room ----------------------------------------------------------------------------------
    def _allocate(self, layer: int) -> int | None:
        pool = self.pools[layer]
        if pool.n_free == 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(layer_needs={layer: 1})
        return pool.allocate()

    def reserve(self, n_tokens: int) -> None:
        """Fail before any layer changes if some layer's pool cannot take n_tokens more (after
        evicting unused cached blocks, when the pools are shared).

        Raises:
            KVPoolFull: naming the layer whose pool is full.
        """
        needs = {i: layer.blocks_needed(n_tokens)  # free blocks each short layer must reach
                 for i, (pool, layer) in enumerate(zip(self.pools, self.layers))
                 if layer.blocks_needed(n_tokens) > pool.n_free}
        if needs and self.prefix_cache is not None:
            self.prefix_cache.evict(layer_needs=needs)
        for i, (pool, layer) in enumerate(zip(self.pools, self.layers)):
            if layer.blocks_needed(n_tokens) > pool.n_free:
                raise KVPoolFull(f"the KV cache of layer {i} is full ({pool.max_blocks} blocks)")

    def protected_blocks(self) -> int:
        """Leading full blocks no policy drops: the pinned prefix, and the sink block(s) unless
        `keep_sink_blocks` was set to 0 (window-only dropping, for comparison in benchmarks)."""
        B = self.config.block_size
        return max(self.keep_sink_blocks, -(-self.protected_tokens // B))

    def protected_tokens_floor(self) -> int:
        return self.protected_blocks() * self.config.block_size

    def make_room(self, n_tokens: int) -> int:
        """Apply the overflow policy so n_tokens more fit under `limit`; returns tokens dropped.

        Raises:
            ContextFull: under `stop`, or when the protected prefix leaves too little room.
        """
        B = self.config.block_size
        need = self.offset + n_tokens - self.limit
        if need <= 0:
            return 0
        if self.overflow == "stop":
            raise ContextFull(f"the context of {self.limit:,} tokens is full")
        n_full = self.offset // B
        first = self.protected_blocks()
        keep_recent = 0 if self.overflow == "rolling" else max(1, self.limit // 8 // B)
        candidates = np.arange(first, max(first, n_full - keep_recent))
        n_needed = -(-need // B)
        if len(candidates) < n_needed:
            raise ContextFull(
                f"{n_tokens:,} new tokens do not fit in the context of {self.limit:,}: "
                f"{self.protected_tokens:,} are pinned (system prompt and documents) and only "
                f"{len(candidates) * B:,} may be dropped"
            )
        n_drop = min(len(candidates), max(n_needed, -(-self.limit // 4 // B)))
        if self.overflow == "rolling":
            dropped = candidates[:n_drop]
        else:
            mass = np.zeros(len(candidates), np.float64)
            for layer in self.layers:
                m = layer.attn_mass
                for j, c in enumerate(candidates):
                    mass[j] += m[c * B : (c + 1) * B].sum() if m.shape[0] > c * B else 0.0
            dropped = np.sort(candidates[np.argsort(mass, kind="stable")[:n_drop]])
        self.drop_blocks(dropped)
        return n_drop * B

    def drop_blocks(self, dropped: np.ndarray) -> None:
        """Drop full blocks by index in every layer and keep positions contiguous."""
        if self.rerotate is None:
            raise ContextFull("this cache cannot move keys, so it cannot drop old tokens")
        B = self.config.block_size
        dropped = np.asarray(dropped, dtype=np.int64)
        for i, layer in enumerate(self.layers):
            layer.drop_blocks(dropped, lambda k, by, i=i: self.rerotate(i, k, by),
                              lambda i=i: self._allocate(i))
        keep = np.ones(len(self.token_ids), bool)
        for d in dropped:
            keep[d * B : (d + 1) * B] = False
        self.token_ids = [t for t, k in zip(self.token_ids, keep) if k]
        first = int(dropped[0])
        self.chain_end = first if self.chain_end is None else min(self.chain_end, first)
        del self.chain_keys[first:]
        self.n_published = min(self.n_published, first)
        self.dropped_tokens += B * len(dropped)

    # -- bookkeeping ---------------------------------------------------------------------------
    def trim(self, n: int) -> None:
        before = self.offset
        super().trim(n)
        del self.token_ids[self.offset :]
        del self.history[len(self.history) - (before - self.offset) :]
        n_full = self.offset // self.config.block_size
        del self.chain_keys[n_full:]
        self.n_published = min(self.n_published, n_full)

    @property
    def nbytes(self) -> int:
        """Bytes this sequence holds: the rows of its blocks plus each layer's tail and sink
        buffers (sizes of the allocated arrays, not the formula). Shared blocks count fully."""
        total = 0
        for pool, layer in zip(self.pools, self.layers):
            total += len(layer.block_table) * (pool.k_row_bytes + pool.v_row_bytes) + layer.nbytes
        return total

    @property
    def capacity_bytes(self) -> int:
        """Bytes allocated: whole pool slabs (in use, cached or free) plus tail/sink buffers."""
        return sum(p.nbytes for p in self.pools) + sum(layer.nbytes for layer in self.layers)

    def release(self) -> None:
        """Return every block (the prefix cache keeps the ones it holds, tails evicted first)."""
        if self.prefix_cache is not None:
            self.prefix_cache.touch(reversed(self.chain_keys))
        for layer in self.layers:
            layer.release()
        self.token_ids.clear()
        self.history.clear()
        self.chain_keys.clear()
        self.n_published = 0
        self.chain_end = None
