"""The work-sharing pool: a job's rows computed by the calling thread and the pool's workers,
without a barrier (see "Work sharing" below), by a compute function called through its address.

A compute function is a numba `cfunc` of `COMPUTE_SIG` (11 int64s: raw_addr, n_rows, row_bytes,
x_addr, T, K, out_addr, out_cols, out_off, r0, r1) that writes out[:, r - out_off] for the rows
r0..r1-1 of the (n_rows, row_bytes) uint8 array at raw_addr, from the (T, K) float32 x at x_addr:
the weight kernels of every type (`quant_matvec`, `int_matvec`) and the batched decode attention
(`kv_codes`: its "rows" are sequences) each make their own, so the pool's code holds none of them
and compiles once (`warm_up_pool`; `defer_pool` lets a background thread do it while jobs run on
the calling thread).

Public: `run_rows` (share a job), `run_here` (the calling thread alone), `COMPUTE_SIG`,
`call_compute` (a compute function called by its address from compiled code),
`BUF_VALUES` (the most outputs a shared chunk holds), `MAX_CHUNKS`, `CHUNK_BYTES` (the bytes of
rows per chunk the weight kernels aim for), `readonly`, `kernel_threads`, `get_pool`,
`defer_pool`, `warm_up_pool`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .vector_ir import I32, I64, address_of, f32_pointer

log = logging.getLogger("omlx.kernels")

COMPUTE_ARGS = 11  # raw_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1
COMPUTE_SIG = types.void(*([types.int64] * COMPUTE_ARGS))
_COMPUTE_ARGS = COMPUTE_ARGS


@intrinsic
def _call_compute(typingctx, fn, raw_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1):
    """Call the compute function at address `fn` (a `_compute_<type>` cfunc: void of 11 int64s)."""
    sig = types.void(fn, raw_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), [I64] * _COMPUTE_ARGS)
        ptr = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(ptr, [context.cast(builder, a, t, types.int64) for a, t in zip(args[1:], signature.args[1:])])
        return context.get_dummy_value()

    return sig, codegen


call_compute = _call_compute  # (public: a compute function that runs others, `int_matvec.IntMatvecGroup`)


# ---------------------------------------------------------------------------------------------
# Work sharing between cores without a barrier
# ---------------------------------------------------------------------------------------------
# numba's `prange` (OpenMP here) ends every parallel region with a barrier: the caller waits until
# each thread has run its share. Whenever another process keeps the other cores busy, the woken
# worker waits for the scheduler, milliseconds per call against a matvec of microseconds, so decode
# with two threads became many times slower than with one. Here the caller never waits long for
# another thread:
#
# * A job is a row range cut into chunks (CHUNK_BYTES of blocks each); each chunk's state is claimed
#   by a compare-and-swap. Each thread first takes the chunks of its own share (the caller the
#   first 1/parts of them, worker i the i-th), in order, then any chunk still free, nearest to its
#   share first, so threads meet at the ends of their shares and touch the same cache lines
#   (states, y) only there. The caller runs every chunk nobody else took.
# * A worker computes a chunk into its own buffer, then commits: a CAS of the chunk's state from
#   "computing" to "committing", a copy into y, then "done". The caller, out of free chunks, waits
#   for the chunks workers hold; one still "computing" after a grace period (~3x a chunk's
#   expected time, once per job) is stolen by a CAS to "caller" and computed by the caller. The
#   worker's commit CAS then fails and its result is dropped, so y is never written after the
#   caller returns; x is copied into a buffer the pool owns, so a late worker never reads memory
#   the caller may have freed; a worker cannot claim a chunk of a finished job (every chunk's
#   state then carries the job's number).
# * A worker reads the job descriptor under a seqlock (desc seq written before and after).
# * A worker spins briefly for the next job (decode issues one every ~10-100 µs), yielding its
#   core to any other thread that wants it, then polls with short sleeps, then parks in Python
#   until a job wakes it (the caller runs that job alone).
#
# ctl (int64 array, one field per 64-byte line); states: int64 per chunk, (seq << 2) | state.

_WORD, _DSEQ, _DESC, _STOP, _CTL_SIZE = 0, 8, 16, 40, 48  # WORD = (seq << 32) | n_chunks; desc 16..25
_MAX_CHUNKS = 4096
BUF_VALUES = 1 << 14  # a worker's chunk buffer (T x rows per chunk floats): the most a shared job holds
_ST_CALLER, _ST_COMPUTING, _ST_COMMITTING, _ST_DONE = 0, 1, 2, 3


@intrinsic
def _aload(typingctx, arr, idx):
    sig = types.int64(arr, idx)

    def codegen(context, builder, signature, args):
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0],
                                       context.make_array(signature.args[0])(context, builder, args[0]),
                                       [args[1]])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return sig, codegen


@intrinsic
def _astore(typingctx, arr, idx, val):
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0],
                                       context.make_array(signature.args[0])(context, builder, args[0]),
                                       [args[1]])
        builder.store_atomic(args[2], ptr, "seq_cst", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _acas(typingctx, arr, idx, expected, new):
    """Compare-and-swap; returns the value found (== expected when it swapped)."""
    sig = types.int64(arr, idx, expected, new)

    def codegen(context, builder, signature, args):
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0],
                                       context.make_array(signature.args[0])(context, builder, args[0]),
                                       [args[1]])
        res = builder.cmpxchg(ptr, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(res, 0)

    return sig, codegen


_MACHINE = __import__("platform").machine().lower()


@intrinsic
def _pause(typingctx):
    """A spin-wait hint to the CPU (x86 `pause`, arm `yield`)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _MACHINE in ("x86_64", "amd64"):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        elif _MACHINE in ("arm64", "aarch64"):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [I32]),
                                                "llvm.aarch64.hint")
            builder.call(fn, [ir.Constant(I32, 1)])  # YIELD
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _usleep(typingctx, us):
    """libc usleep (resolved by symbol when the code is linked, so the function can be cached)."""
    sig = types.void(us)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [I32]), "usleep")
        builder.call(fn, [builder.trunc(args[0], I32)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _yield(typingctx):
    """libc sched_yield: let other threads waiting for this core run."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def _compute(fn, raw_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1):
    """Rows r0..r1 of a job into out (T, out_cols) at columns r - out_off (arrays by address), by
    the job type's compute function at address fn."""
    _call_compute(fn, raw_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1)


@njit(nogil=True, cache=True)
def _caller_take(states, c, base):
    """The caller claims chunk c if nobody has in this job."""
    st = _aload(states, c)
    return st < base and _acas(states, c, st, base | _ST_CALLER) == st


@njit(nogil=True, cache=True)
def _pool_matvec(ctl, states, fn, raw, x, xbuf, y, chunk, grace, parts):
    """y = x @ W.T as one job (see above), `parts` = 1 + the pool's workers; fn: the address of
    W's type's compute function (`_compute_address`). xbuf: the pool's copy
    of x; grace: pause-loops to wait on a worker's chunk before stealing it. Returns (chunks run
    by workers, chunks stolen from them)."""
    n_rows, row_bytes, T, K = raw.shape[0], raw.shape[1], x.shape[0], x.shape[1]
    n = (n_rows + chunk - 1) // chunk
    seq = ((_aload(ctl, _WORD) >> 32) + 1) & 0x7FFFFFFF
    base = seq << 2
    for t in range(T):
        for k in range(K):
            xbuf[t * K + k] = x[t, k]
    raw_addr, x_addr, y_addr = address_of(raw), address_of(xbuf), address_of(y)
    _astore(ctl, _DSEQ, -1)  # (atomic stores: the compiler keeps them in this order)
    _astore(ctl, _DESC, fn)
    _astore(ctl, _DESC + 1, raw_addr)
    _astore(ctl, _DESC + 2, n_rows)
    _astore(ctl, _DESC + 3, row_bytes)
    _astore(ctl, _DESC + 4, x_addr)
    _astore(ctl, _DESC + 5, T)
    _astore(ctl, _DESC + 6, K)
    _astore(ctl, _DESC + 7, y_addr)
    _astore(ctl, _DESC + 8, chunk)
    _astore(ctl, _DESC + 9, parts)
    _astore(ctl, _DSEQ, seq)
    _astore(ctl, _WORD, (seq << 32) | n)
    home = n // parts  # the caller's share: chunks 0..home-1, then others' from the far end
    for c in range(home):
        if _caller_take(states, c, base):
            _compute(fn, raw_addr, n_rows, row_bytes, x_addr, T, K, y_addr, n_rows, 0,
                     c * chunk, min(n_rows, c * chunk + chunk))
    for c in range(n - 1, home - 1, -1):
        if _caller_take(states, c, base):
            _compute(fn, raw_addr, n_rows, row_bytes, x_addr, T, K, y_addr, n_rows, 0,
                     c * chunk, min(n_rows, c * chunk + chunk))
    by_workers = 0
    stolen = 0
    waited = 0  # one grace period for the whole job
    for c in range(n):  # chunks workers hold: wait for them, or steal them
        while True:
            st = _aload(states, c)
            if st == base | _ST_CALLER:
                break
            if st == base | _ST_DONE:
                by_workers += 1
                break
            if st == base | _ST_COMMITTING or waited < grace:
                _pause()
                waited += 1
                continue
            if _acas(states, c, st, base | _ST_CALLER) == st:
                _compute(fn, raw_addr, n_rows, row_bytes, x_addr, T, K, y_addr, n_rows, 0,
                         c * chunk, min(n_rows, c * chunk + chunk))
                stolen += 1
                break
    return by_workers, stolen


@njit(nogil=True, cache=True)
def _pauses(n):
    for _ in range(n):
        _pause()


@njit(nogil=True, cache=True)
def _worker_chunk(states, base, buf, fn, raw_addr, n_rows, row_bytes, x_addr, T, K, y_addr, chunk, c):
    """Claim chunk c for a worker, compute it into buf, and commit it to y unless stolen."""
    st = _aload(states, c)
    if st >= base or _acas(states, c, st, base | _ST_COMPUTING) != st:
        return  # taken
    r0 = c * chunk
    r1 = min(n_rows, r0 + chunk)
    _compute(fn, raw_addr, n_rows, row_bytes, x_addr, T, K, address_of(buf), chunk, r0, r0, r1)
    if _acas(states, c, base | _ST_COMPUTING, base | _ST_COMMITTING) != base | _ST_COMPUTING:
        return  # stolen while computing: drop the result
    y = carray(f32_pointer(y_addr), (T, n_rows))  # the caller waits while the chunk is committing
    for t in range(T):
        for r in range(r0, r1):
            y[t, r] = buf[t * chunk + r - r0]
    _astore(states, c, base | _ST_DONE)


@njit(nogil=True, cache=True)
def _worker_job(ctl, states, buf, seq, part):
    """Worker `part` (1..) of job seq: its share of the chunks, then the rest, nearest first."""
    if _aload(ctl, _DSEQ) != seq:
        return
    fn, raw_addr = _aload(ctl, _DESC), _aload(ctl, _DESC + 1)
    n_rows, row_bytes = _aload(ctl, _DESC + 2), _aload(ctl, _DESC + 3)
    x_addr, T, K = _aload(ctl, _DESC + 4), _aload(ctl, _DESC + 5), _aload(ctl, _DESC + 6)
    y_addr, chunk, parts = _aload(ctl, _DESC + 7), _aload(ctl, _DESC + 8), _aload(ctl, _DESC + 9)
    if _aload(ctl, _DSEQ) != seq or T * chunk > buf.shape[0] or part >= parts:
        return  # the caller moved on, or the job does not fit this worker
    base = seq << 2
    n = (n_rows + chunk - 1) // chunk
    lo, hi = n * part // parts, n * (part + 1) // parts
    for c in range(lo, hi):
        _worker_chunk(states, base, buf, fn, raw_addr, n_rows, row_bytes, x_addr, T, K, y_addr, chunk, c)
    for c in range(lo - 1, -1, -1):
        _worker_chunk(states, base, buf, fn, raw_addr, n_rows, row_bytes, x_addr, T, K, y_addr, chunk, c)
    for c in range(n - 1, hi - 1, -1):
        _worker_chunk(states, base, buf, fn, raw_addr, n_rows, row_bytes, x_addr, T, K, y_addr, chunk, c)


@njit(nogil=True, cache=True)
def _worker_loop(ctl, states, buf, part, spin, poll_us, polls):
    """Pool thread `part` (1..): run the chunks of each new job; after `spin` idle yields and
    `polls` sleeps of `poll_us` µs without a new job return 1 (park), or 0 when STOP is set."""
    last = -1  # (the job current on entry is joined: a parked worker is woken for it)
    idle = 0
    while True:
        seq = _aload(ctl, _WORD) >> 32
        if seq != last:
            last = seq
            _worker_job(ctl, states, buf, seq, part)
            idle = 0
            continue
        if _aload(ctl, _STOP):
            return 0
        idle += 1
        if idle <= spin:
            _yield()  # returns at once on an idle core; lets a waiting thread run on a busy one
        elif idle <= spin + polls:
            _usleep(poll_us)
        else:
            return 1


class _Pool:
    """Worker threads for `_pool_matvec` (cores - 1 of them) and the buffers jobs use."""

    SPIN = 4000  # sched_yield loops (a few ms) before sleeping between polls
    POLL_US = 50  # µs per sleep while polling (longer in effect: the kernel's timer slack)
    POLLS = 1000  # sleeps (about a tenth of a second) before parking until the next job wakes it
    BUF_VALUES = BUF_VALUES
    # Grace before stealing a worker's chunk: GRACE x the time the chunk should take at
    # RATE bytes/s (below what one core reads of blocks, so the estimate errs long).
    GRACE, RATE = 3.0, 4e9
    # Back-off: after STRIKES jobs in a row that had to steal (the worker keeps losing its core to
    # other processes), run matvecs on the calling thread alone for BACKOFF_S seconds (the
    # worker then sleeps and leaves the core to whoever needs it).
    STRIKES, BACKOFF_S = 8, 0.05
    RAW_RETAIN_S = 60.0  # seconds a matrix stays referenced after its last job (see _raws)

    def __init__(self, n_workers: int):
        self.ctl = np.zeros(_CTL_SIZE, dtype=np.int64)
        self.states = np.zeros(_MAX_CHUNKS, dtype=np.int64)
        self.xbuf = np.zeros(1 << 14, dtype=np.float32)
        self._old_xbufs = []  # kept: a late worker may still read one
        # The matrices of recent jobs that had a chunk stolen (id → (raw, last use)), each kept
        # RAW_RETAIN_S after its last such job: a worker the OS preempted in a chunk the caller
        # then took over may read the blocks after the call returned, when the model that owned
        # them may be gone (its file unmapped: a segfault in the worker).
        self._raws: dict[int, tuple[np.ndarray, float]] = {}
        self._raws_pruned = time.monotonic()
        self.n_workers = n_workers
        self.lock = threading.Lock()  # one job at a time; a second caller runs without the pool
        self.wake = threading.Event()
        self.parked = True  # every worker is waiting on `wake` (set by the workers, read per call)
        self.strikes = 0
        self.serial_until = 0.0
        self.jobs = self.steals = self.backoffs = 0  # statistics
        _pauses(10)
        t0 = time.perf_counter()
        _pauses(20000)
        pause_s = max(1e-9, (time.perf_counter() - t0) / 20000)
        self.grace_per_byte = self.GRACE / self.RATE / pause_s  # pause-loops per byte of a chunk
        self.threads = []
        for i in range(n_workers):
            buf = np.zeros(self.BUF_VALUES, dtype=np.float32)
            t = threading.Thread(target=self._run, args=(buf, i + 1), name=f"omlx-matvec-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    def run_job(self, fn: int, raw: np.ndarray, x: np.ndarray, out: np.ndarray, chunk: int,
                chunk_bytes: int, keep: object = None) -> bool:
        """Run the rows of `raw` as a pool job by the compute function at address fn (see
        `run_rows`); chunk_bytes: what one chunk reads, for the grace before stealing it; keep:
        what else the job reads (by address), held like `raw` when a chunk was stolen (its worker
        may still be reading after the call returns). False when the caller should run it
        alone."""
        if not self.lock.acquire(False):
            return False
        try:
            if self.serial_until:
                if time.monotonic() < self.serial_until:
                    return False
                self.serial_until = 0.0
            if self.parked:
                self.kick()
            grace = int(self.grace_per_byte * chunk_bytes)
            _, stolen = _pool_matvec(self.ctl, self.states, fn, raw, x, self.x_buffer(x.size), out,
                                     chunk, grace, self.n_workers + 1)
            self.jobs += 1
            if stolen:
                # only the worker of a stolen chunk may read on after the job (every other chunk
                # was done, its worker finished with raw, when _pool_matvec returned)
                self._keep(raw)
                if keep is not None:
                    self._keep(keep)
                self.steals += 1
                self.strikes += 1
                if self.strikes >= self.STRIKES:
                    self.strikes = 0
                    self.backoffs += 1
                    self.serial_until = time.monotonic() + self.BACKOFF_S
            else:
                self.strikes = 0
            return True
        finally:
            self.lock.release()

    def _keep(self, raw: object) -> None:
        """Hold `raw` (a matrix, or what a job read by address) until RAW_RETAIN_S after its last
        job (call with the lock held)."""
        now = time.monotonic()
        self._raws[id(raw)] = (raw, now)
        if now - self._raws_pruned > self.RAW_RETAIN_S:
            self._raws = {k: v for k, v in self._raws.items() if now - v[1] <= self.RAW_RETAIN_S}
            self._raws_pruned = now

    def _run(self, buf, part):
        while True:
            self.wake.wait()
            if _worker_loop(self.ctl, self.states, buf, part, self.SPIN, self.POLL_US, self.POLLS) == 0:
                return
            self.wake.clear()
            self.parked = True

    def kick(self):
        """Wake parked workers (the job being published runs without them until they are up)."""
        self.parked = False
        self.wake.set()

    def x_buffer(self, n: int) -> np.ndarray:
        """The pool's copy of x (call with the lock held)."""
        if self.xbuf.size < n:
            self._old_xbufs.append(self.xbuf)
            self.xbuf = np.zeros(max(n, 2 * self.xbuf.size), dtype=np.float32)
        return self.xbuf

    def stop(self):
        self.ctl[_STOP] = 1
        self.wake.set()
        for t in self.threads:
            t.join(timeout=1.0)


THREADS_ENV = "OMLX_KERNEL_THREADS"


def kernel_threads() -> int:
    """Threads a matvec uses: OMLX_KERNEL_THREADS, else the CPUs this process may run on (≤ 8)."""
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        return max(1, int(env))
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except AttributeError:  # not on Linux
        return max(1, min(8, os.cpu_count() or 1))


# Bytes of quantized rows per chunk of a job: claiming a chunk is an atomic on a line both cores
# touch, an order of magnitude cheaper than computing a chunk this size; a matrix of a few hundred
# KiB still splits into enough chunks to share.
CHUNK_BYTES = 32768
_pool: _Pool | None = None
_pool_made = False
_pool_lock = threading.Lock()


def _get_pool() -> _Pool | None:
    """The process's pool (None when one thread is asked for), made on first use."""
    global _pool, _pool_made
    if not _pool_made:
        with _pool_lock:
            if not _pool_made:
                n = kernel_threads() - 1
                _pool = _Pool(n) if n > 0 else None
                if _pool is not None:
                    atexit.register(_pool.stop)
                _pool_made = True
    return _pool


def _forget_pool_in_child() -> None:  # a forked child has no worker threads: make a new pool
    global _pool, _pool_made, _pool_lock
    _pool, _pool_made, _pool_lock = None, False, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def readonly(raw: np.ndarray) -> np.ndarray:
    """A read-only view: the kernels are compiled (and cached) for the read-only (rows, bytes)
    uint8 views of the memory-mapped file; writable arrays (tests) get the same specialization."""
    if raw.flags.writeable:
        raw = raw.view()
        raw.flags.writeable = False
    return raw


def run_rows(fn: int, raw: np.ndarray, x: np.ndarray, out: np.ndarray, chunk: int, chunk_bytes: int,
             keep: object = None) -> np.ndarray:
    """A job of the pool's shape that is not a matvec: out[:, r] for each row r of `raw` by the
    compute function at address fn (a cfunc of `COMPUTE_SIG`, called with raw, x and out by
    address and a range of rows), rows shared with the pool's workers in chunks of `chunk` rows
    when there are several chunks, else all on the calling thread. raw: read-only C-contiguous
    (rows, bytes) uint8 (what a row means is fn's: `kv_codes` passes a table of sequences);
    x: C-contiguous float32 (T, K); out: C-contiguous float32 (T, rows), T * chunk at most
    BUF_VALUES to share. The compute function must write only out's columns r0..r1-1 and
    give the same values whichever thread runs a chunk (a chunk may be run twice: a stolen one).
    keep: the objects owning any other memory fn reads by address (held for a while when a
    worker's chunk was stolen: that worker may read on after the call returned)."""
    # more than _MAX_CHUNKS chunks would run past the pool's state array: the caller does it alone
    if (raw.shape[0] > chunk and not _pool_deferred and x.shape[0] * chunk <= BUF_VALUES
            and -(-raw.shape[0] // chunk) <= _MAX_CHUNKS):
        pool = _pool if _pool_made else _get_pool()
        if pool is not None and pool.run_job(fn, raw, x, out, chunk, chunk_bytes, keep):
            return out
    _matvec_here(fn, raw, x, out)
    return out


@njit(nogil=True, cache=True)
def _matvec_here(fn, raw, x, y):
    """y = x @ W.T on the calling thread alone, by the compute function at address fn (one
    compiled function for every type: a type costs only its cfunc and its dequantizer)."""
    _call_compute(fn, address_of(raw), raw.shape[0], raw.shape[1], address_of(x), x.shape[0], x.shape[1],
                  address_of(y), y.shape[1], 0, 0, raw.shape[0])


# True while `defer_pool` holds the pool back (its functions not compiled yet): matvecs then run on
# the calling thread alone, the same products (each output row is one thread's dot product either way)
_pool_deferred = False
_pool_warm = False


def _cache_misses(funcs) -> int:
    return sum(sum(f.stats.cache_misses.values()) for f in funcs)


def defer_pool() -> None:
    """Run matvecs on the calling thread alone until `warm_up_pool` has made the pool's functions
    ready (which a background thread can then do while the calling thread computes)."""
    global _pool_deferred
    if not _pool_warm:
        _pool_deferred = True


def warm_up_pool() -> float:
    """Compile, or load from numba's cache, the work-sharing pool's functions (they hold no type's
    code: a job calls its type's compute function by address) and start the pool; once per
    process. Ends a `defer_pool`. Returns the seconds spent."""
    global _pool_deferred, _pool_warm
    if _pool_warm:
        return 0.0
    t0 = time.perf_counter()
    funcs = (_pool_matvec, _worker_loop, _worker_job, _worker_chunk, _compute, _pauses, _caller_take)
    misses = _cache_misses(funcs)
    pool = _get_pool()
    if pool is not None:  # a job as matvec runs it for larger matrices (the workers may join in)
        fn = _zero_rows_address()
        raw = readonly(np.zeros((2, 32), np.uint8))  # two rows (the compute function reads none)
        x = np.zeros((1, 16), np.float32)
        with pool.lock:
            _pool_matvec(pool.ctl, pool.states, fn, raw, x, pool.x_buffer(x.size), np.empty((1, 2), np.float32),
                         1, 100, pool.n_workers + 1)
            if not _worker_loop.signatures:  # compiled here rather than in the worker thread
                _worker_loop(pool.ctl, pool.states, np.zeros(16, np.float32), 1, 0, 0, 0)
    _pool_warm = True
    _pool_deferred = False
    seconds = time.perf_counter() - t0
    if pool is not None:
        log.info("matvec thread pool (%d workers) ready in %.2f s (%s)", pool.n_workers, seconds,
                 "compiled" if _cache_misses(funcs) > misses else "loaded from numba's cache")
    return seconds


def _zero_rows(raw_addr, n_rows, row_bytes, x_addr, T, K, out_addr, out_cols, out_off, r0, r1):
    """A compute function that writes zeros (the pool's warm-up job: no weight type compiled)."""
    y = carray(f32_pointer(out_addr), (T, out_cols))
    for t in range(T):
        for r in range(r0, r1):
            y[t, r - out_off] = 0.0


_zero_rows_cfunc = None


def _zero_rows_address() -> int:
    global _zero_rows_cfunc
    if _zero_rows_cfunc is None:
        _zero_rows_cfunc = cfunc(COMPUTE_SIG, nogil=True, cache=True)(_zero_rows)
    return _zero_rows_cfunc.address


# Public names of the pool's parts (the underscored ones are what its numba code refers to)
MAX_CHUNKS = _MAX_CHUNKS
get_pool = _get_pool
pool_matvec = _pool_matvec
run_here = _matvec_here
