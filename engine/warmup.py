"""Compiling (first start) or loading (numba's disk cache) the kernels of a decode step, off the path
to the first answer: the norms and RoPE (`engine.kernels.norms`), the matvec thread pool
(`engine.kernels.quant_matvec`) and the paged cache's attention paths (`engine.kv.paged_attention`).

It sits above the models and the KV cache because it runs them: each attention group is run once
on a tiny paged cache (numba compiles per argument types, and every format's layout is the same
tuple of ints, so one format serves all): the decode step with every width's code path, the
batched softmax, the packed-code kernels short batches use.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import numpy as np

from .kernels import HAVE_NUMBA, background, norms
from .kv.config import KVConfig
from .kv.paged import PagedKVCache
from .kv.paged_attention import (
    BATCHED_KERNELS,
    DECODE_KERNELS,
    PACKED_KERNELS,
    BatchedAttention,
    DecodeKernel,
    PackedCodeAttention,
    PagedAttention,
    ReferenceAttention,
)

if HAVE_NUMBA:
    from .kernels import pool

POOL_KERNELS = "matvec thread pool"
WARM_UP_ENV = "OMLX_KERNEL_WARMUP"  # "background" (default) or "wait": compile everything before the first token


def _tiny_layer(decode: bool):
    """A one-layer K4V4 cache (1 KV head, head dim 32, blocks of 16) holding 36 tokens — two full
    blocks and a tail — stored through the reference, with ungated paths; and a query source."""
    layer = PagedKVCache(KVConfig.parse("k4v4,bs=16"), n_layers=1, n_kv_heads=1, head_dim=32)[0]
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((40, 2, 32)).astype(np.float32), rng.standard_normal((40, 1, 32)).astype(np.float32)
    layer.attention = PagedAttention(ReferenceAttention(), None, DecodeKernel(layer.pool) if decode else None,
                                     gated=False)
    layer.attend(q[:36], k[:36], k[:36], scale=0.25, window=None)
    return layer, q, k


def _compile_batched() -> None:
    layer, q, k = _tiny_layer(False)
    layer.attention = PagedAttention(ReferenceAttention(), BatchedAttention(), gated=False)
    layer.attend(q[:36], k[:36], k[:36], scale=0.25, window=None)  # 72 query rows per KV head: batched


def _compile_decode() -> None:
    layer, q, k = _tiny_layer(True)
    layer.attend(q[36:37], k[36:37], k[36:37], scale=0.25, window=None)  # one decode step (intrinsics)
    view = layer.stage_token(q[37:38], k[37:38], k[37:38])  # and its batch form (one call, 2 rows)
    layer.attention.decode.attend_many([view, view], scale=0.25, window=None)
    layer.commit_token(view)
    layer.attention.attend_rows(layer, q[38:40], k[38:40], k[38:40], scale=0.25, window=None)  # a draft's rows


def _compile_packed() -> None:
    layer, q, k = _tiny_layer(False)
    layer.attention = PagedAttention(PackedCodeAttention(), gated=False)
    layer.attend(q[37:40], k[37:40], k[37:40], scale=0.25, window=None)  # a short batch: packed codes


@functools.cache
def _compile_attention_kernels() -> float:
    """Run every compiled attention path once on a tiny cache (numba compiles on first call, or
    loads its on-disk cache) and log the time; the result is remembered for the process."""
    t0 = time.perf_counter()
    _compile_batched()
    _compile_decode()
    _compile_packed()
    seconds = time.perf_counter() - t0
    logging.getLogger("omlx.kernels").info("attention kernels ready in %.2f s", seconds)
    return seconds


def warm_up_attention() -> float:
    """Compile, or load from numba's on-disk cache, the attention kernels (the decode step with
    every width's code path, the batched softmax, the packed-code kernels short batches use) once
    per process, on a tiny cache, before returning; logs the time (the first start on a machine
    compiles them). Returns the seconds spent (0 when already done or numba is missing)."""
    if not HAVE_NUMBA:
        return 0.0
    done = _compile_attention_kernels.cache_info().currsize > 0
    seconds = _compile_attention_kernels()
    return 0.0 if done else seconds


def _compile_rope() -> None:
    """The model's RoPE kernel (`engine.kernels.norms`), compiled in the foreground: the
    first decode step calls it, and would otherwise wait on numba's compiler lock for whatever the
    background thread is compiling then."""
    one = np.ones((1, 4), np.float32)
    for neox in (False, True):
        norms.apply_rope(np.zeros((1, 2, 8), np.float32), one, one, neox)


def start_warm_up(wait: bool | None = None) -> None:
    """Make the compiled paths of a decode step ready without holding up the first answer
    (`Engine.load` calls this once the model's weight kernels are ready).

    wait=False (default, unless OMLX_KERNEL_WARMUP=wait): compile the RoPE kernel now,
    and have the norms, the thread pool and the attention kernels compiled in the background
    (`engine.kernels.background`: norms, pool, batched, decode, packed-code, in that order; a
    first start compiles them in a child process); until each is ready its calls take the exact
    fallback (the numpy norm, see `PagedAttention`; matvecs on the calling thread). With numba's
    cache filled this all loads in well under a second. wait=True: everything now, before
    returning."""
    if not HAVE_NUMBA:
        return
    if wait is None:
        mode = os.environ.get(WARM_UP_ENV, "").strip().lower() or "background"
        if mode not in ("background", "wait"):
            raise ValueError(f"{WARM_UP_ENV}={mode!r}: expected background or wait")
        wait = mode == "wait"
    _compile_rope()
    if wait:
        norms._compile_norms()
        pool.warm_up_pool()
        warm_up_attention()
        return
    pool.defer_pool()
    kv = "engine.kernels.kv_codes"
    background.start([
        (norms.NORM_KERNELS, "engine.kernels.norms:_compile_norms",
         ["engine.kernels.norms:_rms_rows", "engine.kernels.norms:_running_sum"]),
        (POOL_KERNELS, "engine.kernels.pool:warm_up_pool",
         ["engine.kernels.pool:_pool_matvec", "engine.kernels.pool:_worker_loop"]),
        (BATCHED_KERNELS, f"{__name__}:_compile_batched", [f"{kv}:masked_softmax"]),
        (DECODE_KERNELS, f"{__name__}:_compile_decode", [f"{kv}:decode_attention", f"{kv}:store_tail_row",
                                                          f"{kv}:decode_rows_attention"]),
        (PACKED_KERNELS, f"{__name__}:_compile_packed", [f"{kv}:_run"]),
    ])
