"""The second Python thread (`engine.kernels.helper`): work shared in task order, BLAS held to one
thread and given back, and a prefill (its attention and quantized inputs, which share work with the
helper) the same bits with or without it, on both architectures' paths."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.engine import Engine
from engine.kernels import helper


def test_share_gives_results_in_task_order_from_both_threads():
    ran_on = []

    def task(i):
        ran_on.append(threading.current_thread().name)
        time.sleep(0.01)  # releases the GIL, as numpy and the kernels do
        return i * i

    assert helper.share(task, [(i,) for i in range(12)]) == [i * i for i in range(12)]
    if helper.helper_thread() is not None:
        assert len(set(ran_on)) == 2
    assert helper.share(task, []) == []


def test_a_failing_task_raises_after_both_threads_stopped():
    def task(i):
        if i == 3:
            raise ValueError("task 3")
        time.sleep(0.005)

    with pytest.raises(ValueError, match="task 3"):
        helper.share(task, [(i,) for i in range(8)])
    assert helper.share(lambda i: i, [(1,), (2,)]) == [1, 2]  # the helper is still usable


def test_share_called_from_a_task_on_the_helper_runs_there_instead_of_waiting_for_itself():
    def inner(i):
        return helper.share(lambda j: i * 10 + j, [(0,), (1,)])

    assert helper.share(inner, [(i,) for i in range(4)]) == [[i * 10, i * 10 + 1] for i in range(4)]


def test_one_blas_thread_inside_the_block_and_the_count_restored():
    blas_threads = helper.blas_threads  # numpy's BLAS (a library loaded later is not its matmul's)
    before = blas_threads()
    assert before, "numpy's BLAS not found by threadpoolctl"
    with helper.one_blas_thread():
        assert set(blas_threads()) <= {1}
    assert blas_threads() == before


@pytest.mark.parametrize("model,spec", [("smollm2", "full"), ("smollm2", "k6v4"), ("gemma3", "k6v4")])
def test_a_prefill_is_the_same_with_and_without_the_helper(smollm2_path, gemma3_path, monkeypatch, model, spec):
    engine = Engine.load(smollm2_path if model == "smollm2" else gemma3_path)
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)[:300]

    def logits():
        cache = engine.new_cache(spec)
        try:
            return engine.prefill(ids, cache)
        finally:
            cache.release()

    shared = logits()
    monkeypatch.setattr(helper, "helper_thread", lambda: None)
    alone = logits()
    assert np.array_equal(shared.view(np.uint32), alone.view(np.uint32))
