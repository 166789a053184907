"""Attention over a paged layer cache: the arithmetic `PagedLayerCache` hands off.

Every path computes the same thing, the visibility rule of `storage` (a key is seen through its
quantized block once its block was full before the query's block began, at full precision in the
query's own block and at sink positions), from what the layer staged:

    ReferenceAttention   numpy, any number of queries; the tests' oracle
    PackedCodeAttention  the reference with the old blocks scored and weighted straight from
                         their packed codes (compiled kernels): short batches
    BatchedAttention     many queries (prefill, teacher forcing): one BLAS product over the keys
                         as stored, the few full-precision scores recomputed, a compiled softmax
    DecodeKernel         one query in one compiled call (`kv_codes.decode_attention`)

`choose_attention` picks, once per layer cache, which of them serve which calls (`PagedAttention`);
`engine.warmup.start_warm_up` compiles the kernels (a first start) in the background, the reference
answering meanwhile.
The backends hold no sequence state: each call gets a `BatchView` or `DecodeView` (defined here,
filled by the layer cache) with the one sequence's blocks, tail, sinks and positions, and the
layouts they keep are their pool's. So one
backend per pool serves every sequence over that pool.

Decoding several sequences in one step (a batch over shared pools): stage every sequence's token
(`PagedLayerCache.stage_tokens` gives their DecodeViews; a full pool fails there, before anything
changes), run `DecodeKernel.attend` per view — or one compiled call over all the views, which
share the pool's layouts and differ only in rows, tail, sinks, positions and query —, then
`commit_token` each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from ..kernels import HAVE_NUMBA, background, helper
from .pool import LayerBlockPool

if HAVE_NUMBA:
    from ..kernels import kv_codes
    from ..kernels import pool as work_pool

# Queries per KV head (query heads per KV head × new tokens) up to which the packed-code kernels
# are used; larger prefill batches dequantize the old blocks once and use BLAS.
KERNEL_MAX_QUERIES = 16
# Stored tokens summed over a decode batch's sequences from which their attention is one call
# shared between threads (`PagedAttention.attend_tokens`): below it, the call's setup and the
# hand-off to the second thread cost about what the second thread saves. SmolLM2's layer 0, 4
# sequences, 16-bit KV, medians of 200, each alone / one call (2026-12-04, Zen 5): 64 tokens each
# 51 / 45-47 us, 96 48 / 37, 250 115 / 82, 500 148 / 90 (1,024 was measured on a Xeon, where 100
# tokens each gave 66 / 76).
TOGETHER_MIN_TOKENS = 256
# One sequence's decode step shares its KV heads between the weight kernels' threads
# (`DecodeKernel.attend`) when the smallest share, stored tokens x its heads, is at least this:
# a long conversation or document's step is mostly attention. One layer, one thread / two,
# medians of 50 (2026-12-04, 2-core Zen 5 EPYC): a 1B shape (8 KV heads in halves of 4, 16-bit
# KV) 256 tokens 62 / 64 us, 512 107 / 83, 1024 183 / 130-145, 4096 512-551 / 354-430 (the
# halves share the memory bandwidth: not 2x); SmolLM2 (3 KV heads: shares of 1 and 2, K6V4)
# 512 50 / 68-71, 1024 75-78 / 90-92, 2048 173-174 / 148-149.
SPLIT_MIN_HEAD_TOKENS = 1536
# Query rows per block of a batched attention's score matrix ((Hkv, G*rows, keys) float32).
ATTEND_ROWS = 128
NO_MASS = np.zeros(0, np.float32)  # the decode kernel's "attention mass not tracked"


@dataclass
class BatchView:
    """What T new tokens attend over, after the layer stored them (`PagedLayerCache.stage_batch`).

    Positions: the new tokens are start .. start+T-1; the recent region (old tail + new tokens)
    starts at tail_start, a block boundary; the old blocks (full before this call) hold positions
    old_first .. old_first + len(old_blocks)*B - 1.
    """

    q: np.ndarray  # (T, H, D) float32, in the stored keys' basis
    start: int
    tail_start: int
    old_blocks: list[int]
    old_first: int
    recent_k: np.ndarray  # (Hkv, R, D) full precision (float16-rounded)
    recent_v: np.ndarray  # (Hkv, R, Dv)
    recent_kq: np.ndarray  # as later queries see them: blocks that filled up now dequantized
    recent_vq: np.ndarray
    sink_k: np.ndarray  # (Hkv, S, D)
    sink_v: np.ndarray  # (Hkv, S, Dv)
    n_sinks: int
    block_size: int
    pool: LayerBlockPool
    mass: np.ndarray | None  # attention mass of positions old_first .. start+T-1 (a view), or None
    slab_runs: Callable[[list[int]], list]  # the layer's `slab_runs`


@dataclass
class DecodeView:
    """One sequence's layer state for one decode step, everything the decode kernel reads
    (`PagedLayerCache.stage_token`); the new token is already the tail's last row.

    A batch of sequences decoded in one step brings one DecodeView per sequence (each with its
    own rows, tail, sinks and positions) over the shared pools.
    """

    query: np.ndarray  # (Hkv, G, D) float32 contiguous, in the stored keys' basis
    position: int  # the new token's position
    k_rows: np.ndarray  # (nb,) int64 addresses of the K pool rows of the block table
    v_rows: np.ndarray
    first_position: int  # position of the first block's first token
    n_sink_old: int  # sink columns at the head of the blocks
    sink_k: np.ndarray
    sink_v: np.ndarray
    tail_k: np.ndarray  # (Hkv, B, D): rows 0 .. n_recent-1 are the recent tokens
    tail_v: np.ndarray
    n_recent: int
    mass: np.ndarray  # attention mass of positions first_position .. position (a view), or NO_MASS
    filled: list[int] = field(default_factory=list)  # the block the token completes (joins after)


def _dequantized_old(view: BatchView) -> tuple[np.ndarray, np.ndarray]:
    """The old blocks as the queries see them: dequantized, sink positions exact.
    ((Hkv, L_old, D), (Hkv, L_old, Dv))."""
    Hkv, S, old_first = view.pool.n_kv_heads, view.n_sinks, view.old_first
    L_old = len(view.old_blocks) * view.block_size
    k_old, v_old = view.pool.dequantize(view.old_blocks)  # (nb, Hkv, B, D)
    k_old = k_old.transpose(1, 0, 2, 3).reshape(Hkv, L_old, -1)
    v_old = v_old.transpose(1, 0, 2, 3).reshape(Hkv, L_old, -1)
    n_sink_old = int(np.clip(S - old_first, 0, L_old))  # sink columns at the head of the old region
    if n_sink_old:
        k_old[:, :n_sink_old] = view.sink_k[:, old_first : old_first + n_sink_old]
        v_old[:, :n_sink_old] = view.sink_v[:, old_first : old_first + n_sink_old]
    return k_old, v_old


class ReferenceAttention:
    """Scores over [old blocks | recent region] for all T queries at once, masked softmax, values;
    numpy only."""

    def attend(self, view: BatchView, *, scale: float, window: int | None) -> np.ndarray:
        q = view.q
        T, H, D = q.shape
        Hkv = view.pool.n_kv_heads
        G = H // Hkv
        B, S = view.block_size, view.n_sinks
        start, old_first = view.start, view.old_first
        recent_k, recent_v, recent_kq, recent_vq = view.recent_k, view.recent_v, view.recent_kq, view.recent_vq

        q_pos = np.arange(start, start + T)
        qg = q.reshape(T, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * T, D)
        q_pos_g = np.tile(q_pos, G)  # (G*T,) query position of row g*T + t
        r_pos = np.arange(view.tail_start, start + T)  # (R,)
        sc = np.float32(scale)

        # Scores over the recent region: quantized where j's block was full before p's block began.
        s_fp = np.matmul(qg, recent_k.transpose(0, 2, 1)) * sc  # (Hkv, G*T, R)
        s_q = np.matmul(qg, recent_kq.transpose(0, 2, 1)) * sc
        same_block = (r_pos[None, :] // B) >= (q_pos_g[:, None] // B)  # (G*T, R)
        use_fp = same_block | (r_pos[None, :] < S)
        s_recent = np.where(use_fp[None], s_fp, s_q)

        # Scores over the old blocks (all quantized before this call).
        L_old = len(view.old_blocks) * B
        old_pos = np.arange(old_first, old_first + L_old)
        if L_old == 0:
            s_old, old_values = np.zeros((Hkv, G * T, 0), np.float32), None
        else:
            s_old, old_values = self._old_scores(view, qg, sc)

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
        if view.mass is not None:  # key positions old_first .. start+T-1 are contiguous
            view.mass += scores.sum(axis=(0, 1))

        p_fp = np.where(use_fp[None], p_recent, np.float32(0))
        out = np.matmul(p_fp, recent_v) + np.matmul(p_recent - p_fp, recent_vq)  # (Hkv, G*T, Dv)
        if L_old:
            self._add_old_values(view, p_old, old_values, out)
        Dv = out.shape[-1]
        return out.reshape(Hkv, G, T, Dv).transpose(2, 0, 1, 3).reshape(T, H, Dv)

    def _old_scores(self, view: BatchView, qg: np.ndarray, sc: np.float32):
        """Scaled scores over the old blocks (Hkv, M, L_old), and what `_add_old_values` needs."""
        k_old, v_old = _dequantized_old(view)
        return np.matmul(qg, k_old.transpose(0, 2, 1)) * sc, v_old

    def _add_old_values(self, view: BatchView, p_old: np.ndarray, v_old, out: np.ndarray) -> None:
        """out (Hkv, M, Dv) += the old blocks' values weighted by p_old (Hkv, M, L_old)."""
        out += np.matmul(p_old, v_old)


class PackedCodeAttention(ReferenceAttention):
    """The reference, with the old blocks read from their packed codes (no dequantized copy);
    sink positions among them are taken from the exact sinks."""

    def _old_scores(self, view: BatchView, qg: np.ndarray, sc: np.float32):
        pool, B = view.pool, view.block_size
        Hkv, M, _ = qg.shape
        s_old = np.empty((Hkv, M, len(view.old_blocks) * B), np.float32)
        for slab, rows, cols in view.slab_runs(view.old_blocks):
            s_old[:, :, cols] = kv_codes.attention_scores(pool.k_format, pool.k_slabs[slab], rows, qg, B)
        s_old = s_old * sc
        n_sink_old = self._n_sink_old(view)
        if n_sink_old:
            sink_k = view.sink_k[:, view.old_first : view.old_first + n_sink_old]
            s_old[:, :, :n_sink_old] = np.matmul(qg, sink_k.transpose(0, 2, 1)) * sc
        return s_old, None

    def _add_old_values(self, view: BatchView, p_old: np.ndarray, _, out: np.ndarray) -> None:
        pool, B = view.pool, view.block_size
        n_sink_old = self._n_sink_old(view)
        if n_sink_old:
            p_sink = p_old[:, :, :n_sink_old].copy()
            p_old = p_old.copy()
            p_old[:, :, :n_sink_old] = 0
            out += np.matmul(p_sink, view.sink_v[:, view.old_first : view.old_first + n_sink_old])
        part_sum = None
        for slab, rows, cols in view.slab_runs(view.old_blocks):
            part = kv_codes.weighted_values(pool.v_format, pool.v_slabs[slab], rows, p_old[:, :, cols], B,
                                            pool.value_dim)
            part_sum = part if part_sum is None else part_sum + part
        out += part_sum

    @staticmethod
    def _n_sink_old(view: BatchView) -> int:
        return int(np.clip(view.n_sinks - view.old_first, 0, len(view.old_blocks) * view.block_size))


class BatchedAttention:
    """Many new tokens: one BLAS product over the keys as stored (old blocks and the blocks that
    fill up now, dequantized), then the few scores that see full precision recomputed — each
    query's own block and the sinks —, the masked softmax in one compiled pass per row, and the
    values likewise. Needs numba (`kv_codes.masked_softmax`)."""

    def attend(self, view: BatchView, *, scale: float, window: int | None) -> np.ndarray:
        q = view.q
        T, H, D = q.shape
        Hkv, B, S = view.pool.n_kv_heads, view.block_size, view.n_sinks
        G = H // Hkv
        start, tail_start, old_first = view.start, view.tail_start, view.old_first
        recent_k, recent_v, recent_kq, recent_vq = view.recent_k, view.recent_v, view.recent_kq, view.recent_vq
        R = recent_k.shape[1]
        L_old = len(view.old_blocks) * B
        if L_old:
            k_old, v_old = _dequantized_old(view)
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
        Dv = values.shape[-1]
        out = np.empty((T, Hkv, G, Dv), np.float32)

        def rows(r0: int, r1: int, h0: int, h1: int):
            """out[r0:r1, h0:h1]; returns the columns c_lo:c_hi and those KV heads' attention mass
            over them (None when not tracked)."""
            n, c_lo, c_hi, nh = r1 - r0, int(lo[r0]), int(hi[r1 - 1]), h1 - h0
            q_rows = q4[h0:h1, :, r0:r1]  # (nh, G, n, D)
            scores = np.matmul(q_rows.reshape(nh, G * n, D), keys[h0:h1, c_lo:c_hi].transpose(0, 2, 1))
            s4 = scores.reshape(nh, G, n, c_hi - c_lo)
            row_fixes = []  # (rows a:b of this block, columns a..b of s4, recent columns c0:c1)
            for t0, t1, c0, c1 in fixes:
                a, b = max(t0, r0) - r0, min(t1, r1) - r0
                c0, c1 = max(c0, c_lo - L_old), min(c1, c_hi - L_old)  # the columns in view
                if a < b and c0 < c1:
                    cols = (L_old + c0 - c_lo, L_old + c1 - c_lo)
                    row_fixes.append((a, b, cols, c0, c1))
                    s4[:, :, a:b, cols[0] : cols[1]] = np.matmul(
                        q_rows[:, :, a:b], recent_k[h0:h1, None, c0:c1].transpose(0, 1, 3, 2))
            kv_codes.masked_softmax(scores, lo[r0:r1] - c_lo, hi[r0:r1] - c_lo, np.float32(scale))
            mass = scores.sum(axis=(0, 1)) if view.mass is not None else None
            # The fixed regions' weights go to the full-precision values instead of the stored
            # ones (taken out of the big product rather than corrected by a difference, so that a
            # float16 cache, where both copies are equal, gives bit-identical results).
            p_fix = []
            for a, b, (x0, x1), _, _ in row_fixes:
                p_fix.append(s4[:, :, a:b, x0:x1].copy())
                s4[:, :, a:b, x0:x1] = 0
            o = np.matmul(scores, values[h0:h1, c_lo:c_hi]).reshape(nh, G, n, Dv)
            for (a, b, _, c0, c1), p in zip(row_fixes, p_fix):
                o[:, :, a:b] += np.matmul(p, recent_v[h0:h1, None, c0:c1])
            out[r0:r1, h0:h1] = o.transpose(2, 0, 1, 3)
            return c_lo, c_hi, mass

        # Rows in blocks of ATTEND_ROWS queries, each over the columns its rows can see (the
        # score matrix stays small, at long contexts too, and the causal triangle is skipped),
        # one KV head at a time: the pieces shared between two threads, each calling BLAS on one
        # thread (`helper`: no BLAS barrier per call). The pieces are the same whatever the
        # threads, so the result is too.
        tasks = [(r0, min(T, r0 + ATTEND_ROWS), h, h + 1) for r0 in range(0, T, ATTEND_ROWS) for h in range(Hkv)]
        with helper.one_blas_thread():
            parts = helper.share(rows, tasks)
        if view.mass is not None:  # key positions old_first + c_lo .. are contiguous
            for c_lo, c_hi, mass in parts:
                view.mass[c_lo:c_hi] += mass
        return out.reshape(T, H, Dv)


class DecodeKernel:
    """One new token over one sequence's layer in one compiled call: the visibility rule where a
    single query's own block is the tail (with the new token) and every earlier full block is
    seen quantized. Built per pool (the row layouts of its formats); the sequence's state comes
    in the DecodeView."""

    def __init__(self, pool: LayerBlockPool):
        Hkv, B = pool.n_kv_heads, pool.block_size
        self.pool = pool  # its slabs are read by address (attend_many keeps them for late workers)
        self.block_size = B
        self.value_dim = pool.value_dim
        self.k_layout = kv_codes.decode_layout(pool.k_format, Hkv, B, pool.head_dim)
        self.v_layout = kv_codes.decode_layout(pool.v_format, Hkv, B, pool.value_dim)
        from ..kernels.pool import kernel_threads

        self.threads = kernel_threads()  # a long sequence's heads shared between this many (`attend`)
        # attend_many's table fields from DF_HKV on, by (G, D, sinks, tail rows, scale): the same
        # in every call of a model's layer; each holds the address of its float32 scale, kept here
        self._shared_fields: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._rows_fields: dict[float, tuple] = {}  # scale -> what every rows job's table shares

    def attend(self, view: DecodeView, *, scale: float, window: int | None) -> np.ndarray:
        """(Hkv, G, Dv) float32: the new token's attention output per query head. From
        SPLIT_MIN_HEAD_TOKENS on (and without attention-mass tracking) the KV heads are
        shared between the weight kernels' threads, each head computed as in one call."""
        Hkv, G, _ = view.query.shape
        parts = min(Hkv, self.threads)
        if (parts > 1 and not view.mass.shape[0]
                and len(view.k_rows) * self.block_size * (Hkv // parts) >= SPLIT_MIN_HEAD_TOKENS):
            return self.attend_many([view], scale=scale, window=window, head_parts=parts)[0]
        first_visible = 0 if window is None else max(0, view.position - window + 1 - view.first_position)
        out = np.empty((Hkv, G, self.value_dim), np.float32)
        kv_codes.decode_attention(
            view.k_rows, view.v_rows, self.k_layout, self.v_layout, self.block_size, view.query,
            np.float32(scale), view.sink_k, view.sink_v, view.first_position, view.n_sink_old,
            view.tail_k, view.tail_v, view.n_recent, first_visible, view.mass, out)
        return out

    def attend_rows(self, view: DecodeView, queries: np.ndarray, *, scale: float,
                    window: int | None) -> np.ndarray | None:
        """(T, Hkv, G, Dv) float32: `attend` of each of T consecutive tokens of one sequence (a
        verified draft, `PagedLayerCache.stage_rows`: `view` the first token's step, token i's
        the same at position + i with n_recent + i; queries (T, Hkv, G, D); no mass tracked),
        each bit for bit, from one pool job whose rows are the KV heads
        (`kv_codes.decode_rows_attention`: each block read once for up to ROWS_GROUP_Q of the
        rows' queries). None when the rows' windows start in different blocks."""
        T, Hkv, G, D = queries.shape
        Dv, B = self.value_dim, self.block_size
        if window is None:
            visible0 = kv_codes.NO_WINDOW
        else:
            visible0 = view.position - window + 1 - view.first_position
            if max(0, visible0) // B != max(0, visible0 + T - 1) // B:
                return None
        shared = self._rows_fields.get(scale)
        if shared is None:  # the fields every head's row shares; the scale read by address, kept
            box = np.array([scale], np.float32)
            shared = self._rows_fields[scale] = (box, np.array(
                (Hkv, G, D, Dv, view.sink_k.shape[1], view.tail_k.shape[1], B, box.ctypes.data,
                 *self.k_layout, *self.v_layout), np.int64))
        table = np.empty((Hkv, kv_codes.ROWS_FIELDS), np.int64)  # new each call: late workers read it
        table[:, kv_codes.DF_HKV : kv_codes.DECODE_FIELDS] = shared[1]
        kv_codes.fill_rows_table(table, view.k_rows, view.v_rows, view.sink_k, view.sink_v, view.first_position,
                                 view.n_sink_old, view.tail_k, view.tail_v, view.n_recent, visible0, T)
        n_out, n_q = T * G * Dv, queries.size  # a head's outputs of every row: one column
        x = np.empty(n_out * -(-n_q // n_out), np.float32)  # the queries, as the pool's (n_out, K) x
        x[:n_q] = queries.reshape(-1)
        out = np.empty((n_out, Hkv), np.float32)
        work = (len(view.k_rows) * B + view.n_recent) * (D + Dv) * 2  # a head's keys and values as float16
        work_pool.run_rows(kv_codes.rows_heads_address(), work_pool.readonly(table.view(np.uint8)),
                           x.reshape(n_out, -1), out, 1, work, (view, self.pool))
        return out.reshape(T, G, Dv, Hkv).transpose(0, 3, 1, 2)

    def attend_many(self, views: list[DecodeView], *, scale: float, window: int | None,
                    head_parts: int = 1, queries: np.ndarray | None = None) -> np.ndarray:
        """(n, Hkv, G, Dv) float32: `attend` of each view (sequences over this kernel's pool,
        without attention-mass tracking), from one compiled call whose rows the weight kernels'
        thread pool shares out (`kv_codes.decode_rows_address`); each output equals the view's
        own `attend`. head_parts: each sequence as that many rows of consecutive KV heads.
        queries: the views' queries as one C-contiguous (n, Hkv, G, D) float32 array (as
        `PagedLayerCache.stage_tokens` makes them), taken as the call's input without a copy."""
        n = len(views)
        Hkv, G, D = views[0].query.shape
        Dv = self.value_dim
        T = Hkv * G * max(D, Dv)
        bounds = [Hkv * i // head_parts for i in range(head_parts + 1)]
        table = np.empty((n * head_parts, kv_codes.DECODE_FIELDS), np.int64)
        key = (G, D, views[0].sink_k.shape[1], views[0].tail_k.shape[1], scale)
        shared = self._shared_fields.get(key)
        if shared is None:
            scale_box = np.array([scale], np.float32)  # read by address
            shared = (np.array((Hkv, G, D, Dv) + key[2:4] + (self.block_size, scale_box.ctypes.data)
                               + self.k_layout + self.v_layout, np.int64), scale_box)
            self._shared_fields[key] = shared
        table[:, kv_codes.DF_HKV :] = shared[0]
        if queries is not None and head_parts == 1 and D >= Dv:
            x = queries.reshape(n, T)  # row i: its sequence's query (kv_codes' layout)
        else:
            x = np.zeros((n * head_parts, T), np.float32)
            for i, view in enumerate(views):
                x[i * head_parts : (i + 1) * head_parts, : Hkv * G * D] = view.query.reshape(-1)
        most_tokens = 0
        for i, view in enumerate(views):
            first_visible = 0 if window is None else max(0, view.position - window + 1 - view.first_position)
            for part in range(head_parts):
                kv_codes.fill_decode_row(table, i * head_parts + part, view.k_rows, view.v_rows, view.sink_k,
                                         view.sink_v, view.first_position, view.n_sink_old, view.tail_k,
                                         view.tail_v, view.n_recent, first_visible, bounds[part], bounds[part + 1])
            most_tokens = max(most_tokens, len(view.k_rows) * self.block_size + view.n_recent)
        n_rows = n * head_parts
        out = np.empty((T, n_rows), np.float32)
        # the grace before the caller takes over a worker's sequence: its keys and values read as
        # if float16 (the quantized formats take longer per byte)
        work = most_tokens * Hkv * (D + Dv) * 2 // head_parts
        # what the cfunc reads by address: the views' arrays, the scale (self's), the pool's slabs
        keep = (views, self)
        work_pool.run_rows(kv_codes.decode_rows_address(), work_pool.readonly(table.view(np.uint8)),
                              x.reshape(T, n_rows), out, 1, work, keep)
        if head_parts == 1:
            return out[: Hkv * G * Dv].T.reshape(n, Hkv, G, Dv)
        result = np.empty((n, Hkv * G * Dv), np.float32)
        for part in range(head_parts):  # column i * head_parts + part: sequence i's heads of that part
            a, b = bounds[part] * G * Dv, bounds[part + 1] * G * Dv
            result[:, a:b] = out[a:b, part::head_parts].T
        return result.reshape(n, Hkv, G, Dv)


class PagedAttention:
    """Which path serves which call, fixed when the layer cache is made:

        one new token                              `decode`, when set
        more query rows than KERNEL_MAX_QUERIES    `batched`, when set (G*T rows per KV head)
        anything else                              `general` (the reference, or its packed-code form)

    While `start_warm_up` has a compiled path's kernels compiling in the background (a first start
    with an empty numba cache), calls it would serve go to the numpy reference instead — the same
    visibility rule on the same stored values, so the same answer up to float32 summation order —
    and switch to the compiled path from the first call after it is ready. `gated=False` ignores
    the background state (the warm-up itself uses that)."""

    def __init__(self, general: ReferenceAttention, batched: BatchedAttention | None = None,
                 decode: DecodeKernel | None = None, gated: bool = True):
        self.general, self.batched, self.decode = general, batched, decode
        self.gated = gated

    @property
    def uses_kernels(self) -> bool:
        return self.decode is not None

    def _compiling(self, group: str) -> bool:
        """Whether `group`'s kernels are still compiling in the background (the call then takes the
        reference, and is counted for the log)."""
        if self.gated and background.pending(group):
            background.count_fallback(group)
            return True
        return False

    def attend_tokens(self, layers: list, q, k, v, *, scale: float, window: int | None) -> np.ndarray | None:
        """One new token for each of `layers` (PagedLayerCaches of different sequences over one
        pool, this backend's layer first): store them in one call (q, k, v row i for layers[i],
        `PagedLayerCache.stage_tokens`) and return the attention outputs (n, H, Dv), each equal
        to its layer's own `attend`: from one compiled call (`DecodeKernel.attend_many`) with
        TOGETHER_MIN_TOKENS stored tokens in all or more, else one sequence after the other (as
        fast, the work being too little to share). None, with nothing stored, when the decode
        kernel does not apply: none, its kernels still compiling, layers over other pools, with
        another rotation or tracking attention mass."""
        if self.decode is None or len(layers) < 2:
            return None
        first = layers[0]
        pool, rotated = first.pool, first.rotation is not None
        if any(layer.pool is not pool or layer.track_attention or layer.attention.decode is None
               or (layer.rotation is not None) != rotated for layer in layers):
            return None
        if self._compiling(DECODE_KERNELS):
            return None
        n, H = q.shape[0], q.shape[1]
        views, queries = first.stage_tokens(layers, q, k, v)
        if sum(view.position for view in views) >= TOGETHER_MIN_TOKENS:
            out = self.decode.attend_many(views, scale=scale, window=window, queries=queries)
        else:
            out = np.empty((n,) + views[0].query.shape[:2] + (pool.value_dim,), np.float32)
            for i, view in enumerate(views):
                out[i] = self.decode.attend(view, scale=scale, window=window)
        for layer, view in zip(layers, views):
            layer.commit_token(view)
        return out.reshape(n, H, -1)

    def attend_rows(self, layer, q, k, v, *, scale: float, window: int | None) -> np.ndarray | None:
        """T new tokens of one sequence (`layer` a PagedLayerCache), each attended exactly as its
        own decode step would be (a verified draft, `kv.batch.VerifyBatch`), from one compiled
        call: the rows are stored together first (`PagedLayerCache.stage_rows`), then row i's
        step reads the tail's first n_tail + i + 1 columns (later rows only write past what an
        earlier one reads) and `DecodeKernel.attend_rows` computes each as its own `attend`
        (`attend_many` of the rows' views where their windows start in different blocks).
        (T, H, Dv), or None with nothing stored when one call cannot stand for the steps: no
        decode kernel or its kernels compiling, attention mass tracked, a block filling among
        the rows (the tail is then reused for the next block) or a sink position among them
        (stage_token writes those)."""
        T, H, _ = q.shape
        if (self.decode is None or T < 2 or layer.track_attention or layer.n_tail + T >= layer.B
                or layer.offset < layer.n_sinks or self._compiling(DECODE_KERNELS)):
            return None
        view, queries = layer.stage_rows(q, k, v)
        out = self.decode.attend_rows(view, queries, scale=scale, window=window)
        if out is None:
            views = [replace(view, query=queries[i], position=view.position + i, n_recent=view.n_recent + i)
                     for i in range(T)]
            out = self.decode.attend_many(views, scale=scale, window=window)
        return out.reshape(T, H, -1)

    def attend(self, layer, q, k, v, *, scale: float, window: int | None) -> np.ndarray:
        """Store the T new tokens in `layer` (a PagedLayerCache) and return their attention
        output (T, H, Dv)."""
        T, H, _ = q.shape
        if T == 1 and self.decode is not None and not self._compiling(DECODE_KERNELS):
            view = layer.stage_token(q, k, v)
            out = self.decode.attend(view, scale=scale, window=window)
            layer.commit_token(view)
            return out.reshape(1, H, -1)
        view = layer.stage_batch(q, k, v)
        if self.batched is not None and (H // layer.pool.n_kv_heads) * T > KERNEL_MAX_QUERIES:
            if self._compiling(BATCHED_KERNELS):
                return _REFERENCE.attend(view, scale=scale, window=window)
            return self.batched.attend(view, scale=scale, window=window)
        if isinstance(self.general, PackedCodeAttention) and self._compiling(PACKED_KERNELS):
            return _REFERENCE.attend(view, scale=scale, window=window)
        return self.general.attend(view, scale=scale, window=window)


_REFERENCE = ReferenceAttention()


def choose_attention(pool: LayerBlockPool, use_kernels: bool | None = None) -> PagedAttention:
    """The paths for caches over `pool`: the compiled ones when numba is there (`use_kernels`
    None or True) and the formats' rows suit the kernels (head and value dims multiples of 8);
    without numba, the numpy reference for everything."""
    if not HAVE_NUMBA:
        return PagedAttention(ReferenceAttention())
    kernel_formats = pool.head_dim % 8 == 0 and pool.value_dim % 8 == 0
    if (use_kernels is None or use_kernels) and kernel_formats:
        return PagedAttention(PackedCodeAttention(), BatchedAttention(), DecodeKernel(pool))
    return PagedAttention(ReferenceAttention(), BatchedAttention())


# the background groups (`engine.kernels.background`) of the compiled paths above, by the names the
# log shows; `engine.warmup` compiles them, and until each is ready PagedAttention takes the fallback
DECODE_KERNELS, BATCHED_KERNELS, PACKED_KERNELS = "decode attention", "batched attention", "packed-code attention"
