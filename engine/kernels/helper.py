"""One Python worker thread beside the calling one, for work that numpy or a compiled kernel does
with the GIL released (a prefill tile's second half dequantized, the second half of a long input's
activations quantized, half of a prefill's attention heads), and BLAS held to one thread while two
Python threads each call it.

Why not BLAS's own threads for the attention products: each multi-threaded BLAS call ends in a
barrier that waits for every BLAS thread, and when another process holds one of the cores that
wait is a scheduler time slice. A 1B model's 512-token prefill makes ~1,000 such calls in its
attention: 0.3 s on a quiet machine, 2.4-9 s beside two busy processes. Two threads that each
take the next piece of work from a shared list only wait for each other once, at the end.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence

_lock = threading.Lock()
_helper: concurrent.futures.ThreadPoolExecutor | None = None
_helper_made = False
_blas = None  # threadpoolctl's BLAS controllers, or False when it is missing
_blas_made = False
_HELPER_NAME = "omlx-helper"


def helper_thread() -> concurrent.futures.ThreadPoolExecutor | None:
    """The one worker thread (made on first use); None when the kernels use one thread
    (OMLX_KERNEL_THREADS=1, or one CPU)."""
    global _helper, _helper_made
    if not _helper_made:
        with _lock:
            if not _helper_made:
                try:
                    from .pool import kernel_threads

                    threads = kernel_threads()
                except ImportError:  # no numba: no compiled kernels to share either
                    threads = 1
                if threads > 1:
                    _helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=_HELPER_NAME)
                _helper_made = True
    return _helper


def share(fn: Callable, tasks: Sequence[tuple]) -> list:
    """[fn(*task) for task in tasks], the tasks taken in turn by this thread and the helper (fn
    must release the GIL for most of its time to gain anything, and be safe to run two at once).
    Results in task order, whichever thread ran each."""
    results: list = [None] * len(tasks)
    order: Iterator[int] = iter(range(len(tasks)))  # next() on it is atomic under the GIL

    def work() -> None:
        for i in order:
            results[i] = fn(*tasks[i])

    helper = helper_thread() if len(tasks) > 1 else None
    if helper is None or threading.current_thread().name.startswith(_HELPER_NAME):
        work()  # one thread; or called from a task on the helper, which would wait for itself
        return results
    job = helper.submit(work)
    try:
        work()
    finally:
        job.result()
    return results


def share_rows(fn: Callable[[int, int], object], n_rows: int, step: int) -> list:
    """fn(r0, r1) for the ranges of `step` rows that cover 0..n_rows, shared as `share` shares
    tasks: how a long input's row-wise work (each row computed on its own, so the same bits in
    any split) goes to both threads."""
    return share(fn, [(r0, min(n_rows, r0 + step)) for r0 in range(0, n_rows, step)])


def _blas_libraries() -> list:
    """threadpoolctl's controllers of the BLAS libraries loaded when first asked (numpy's: the
    one its matmul calls); [] without threadpoolctl."""
    global _blas, _blas_made
    if not _blas_made:
        with _lock:
            if not _blas_made:
                try:
                    from threadpoolctl import ThreadpoolController

                    _blas = ThreadpoolController().select(user_api="blas").lib_controllers or False
                except ImportError:
                    _blas = False
                _blas_made = True
    return _blas or []


def blas_threads() -> list[int]:
    """The thread count of each BLAS library `one_blas_thread` holds."""
    return [lib.get_num_threads() for lib in _blas_libraries()]


@contextlib.contextmanager
def one_blas_thread():
    """BLAS on one thread inside the block (its previous count restored after). Costs ~1 µs: the
    library's own set-threads call, found once through threadpoolctl."""
    if not _blas_libraries():
        yield
        return
    before = [lib.get_num_threads() for lib in _blas]
    for lib in _blas:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, n in zip(_blas, before):
            lib.set_num_threads(n)


def _forget_in_child() -> None:  # a forked child has no helper thread: make a new one
    global _helper, _helper_made, _lock
    _helper, _helper_made, _lock = None, False, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
