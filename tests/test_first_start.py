"""First start with an empty kernel cache: only the loaded model's weight types are compiled, the
rest compiles in the background while exact fallbacks answer, and the log says which path did."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from engine import warmup
from engine.kernels import background
from engine.kv import paged_attention
from engine.kv.config import KVConfig
from engine.kv.paged import PagedKVCache

from .conftest import reference_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


@pytest.fixture
def fresh_groups(monkeypatch):
    """The background module's group table, empty for the test (as in a new process)."""
    monkeypatch.setattr(background, "_groups", {})
    return background._groups


# -- weight kernels: only the types asked for ------------------------------------------------


def test_warm_up_compiles_only_the_types_asked_for():
    """A process that warms up Q4_0 and runs a pool-sized matvec makes Q4_0's compute function
    and nothing of any other type: the pool reaches the kernel through its address (before, its
    dispatch on a type code compiled all fourteen types into every pool function)."""
    proc = _python("""
        import json, numpy as np
        from gguf.constants import GGMLQuantizationType as QT
        from engine.kernels import pool, quant_matvec as qm
        qm.warm_up([QT.Q4_0])
        raw = np.zeros((4096, 18 * 8), np.uint8)  # 4096 rows of 256 values: many chunks, the pool's path
        y = qm.matvec(QT.Q4_0, raw, np.ones((1, 256), np.float32))
        kernels = [name for name in dir(qm) if name.startswith(("_rows_", "_dq_"))]
        print(json.dumps({"cfuncs": sorted(t.name for t in qm._compute_cfuncs),
                          "compiled": sorted(n for n in kernels if getattr(qm, n).signatures),
                          "pool_ready": pool._pool_warm, "y": float(np.abs(y).max())}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["cfuncs"] == ["Q4_0"]
    # _rows_q4_0 only when the cfunc it is inlined into was compiled here rather than loaded
    assert "_dq_q4_0" in out["compiled"] and set(out["compiled"]) <= {"_dq_q4_0", "_rows_q4_0"}
    assert out["pool_ready"] and out["y"] == 0.0


def test_integer_kernels_load_from_the_disk_cache_in_a_second_process(tmp_path):
    """The integer kernels are made at import from `INT_TYPES` (not written out): a first process
    with an empty cache compiles Q4_0's (exact and fast), and the layer groups' segment function,
    and no other type's; a second one loads them from numba's disk cache without compiling
    anything."""
    from engine.kernels import int_dot

    if int_dot.kernel_isa() == "float":
        pytest.skip("no integer kernels on this CPU")
    code = """
        import json
        from gguf.constants import GGMLQuantizationType as QT
        from engine.kernels import int_dot, int_matvec as m
        isa = int_dot.kernel_isa()
        m.warm_up([QT.Q4_0], isa)
        m.warm_up([QT.Q4_0], isa, fast=True)
        loops = [n for n in dir(m) if n.startswith(("_irows_", "_frows_"))]
        # (the exact AMX kernels: a background group, loaded here whenever its child has cached them)
        fns = [f for key, f in m._cfuncs.items() if key[1:] != ("amx", False)]
        print(json.dumps({"hits": sorted(f.cache_hits for f in (*fns, m._segments_cfunc)),
                          "compiled": sorted(n for n in loops if getattr(m, n).signatures)}))
    """
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    runs = []
    for _ in range(2):
        proc = _python(code, env=env)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    isa = int_dot.kernel_isa()
    amx = isa == "avx512amx"  # + the fast mode's AMX compute function (warm_up(fast=True) makes it)
    n = 4 if amx else 3
    assert runs[0] == {"hits": [0] * n, "compiled": [f"_frows_q4_0_{isa}", f"_irows_q4_0_{isa}"]}
    assert runs[1] == {"hits": [1] * n, "compiled": []}
    cached = {p.name.split("-")[0] for p in (tmp_path / "numba").rglob("int_matvec.*.nbi")}
    want = ({f"int_matvec.{kind}_q4_0_{isa}" for kind in ("_c", "_cf", "_irows", "_frows")}
            | {"int_matvec._compute_segments"} | ({"int_matvec._caf_q4_0", "int_matvec._af_q4_0rows"} if amx else set()))
    # (the exact AMX kernels compile in a background child, which may or may not finish before
    # the process exits)
    assert want <= cached <= want | {"int_matvec._ca_q4_0", "int_matvec._a_q4_0rows"}


def test_deferred_pool_gives_the_same_products(monkeypatch):
    """While the pool is held back (its functions compiling elsewhere) a matvec runs on the
    calling thread alone: the same numbers, bit for bit (each output row is one thread's dot)."""
    from gguf.constants import GGMLQuantizationType as QT

    from engine.kernels import pool
    from engine.kernels import quant_matvec as qm

    from .test_quant_kernels import quantized_from_floats

    rng = np.random.default_rng(5)
    raw = quantized_from_floats(QT.Q8_0, 2048, 512, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    qm.warm_up([QT.Q8_0])
    shared = qm.matvec(QT.Q8_0, raw, x)
    monkeypatch.setattr(pool, "_pool_deferred", True)
    alone = qm.matvec(QT.Q8_0, raw, x)
    np.testing.assert_array_equal(shared, alone)


# -- attention: the reference answers while a compiled path is pending ------------------------


def _layer(spec="k4v4,bs=16", tokens=40, seed=0):
    layer = PagedKVCache(KVConfig.parse(spec), n_layers=1, n_kv_heads=2, head_dim=32)[0]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((tokens, 4, 32)).astype(np.float32)
    k = rng.standard_normal((tokens, 2, 32)).astype(np.float32)
    v = rng.standard_normal((tokens, 2, 32)).astype(np.float32)
    return layer, q, k, v


def _pending(groups, name):
    groups[name] = background._Group(name, "gc:collect", state="compiling")


def test_pending_decode_kernels_take_the_reference_then_switch(fresh_groups, monkeypatch):
    """One token while the decode kernels compile: the numpy reference answers (counted for the
    log), with the output the kernel gives; once ready, the next token takes the kernel."""
    calls = []
    real_attend = paged_attention.DecodeKernel.attend
    monkeypatch.setattr(paged_attention.DecodeKernel, "attend",
                        lambda self, view, **kw: calls.append(1) or real_attend(self, view, **kw))
    fallback, kernel = _layer(), _layer()
    for layer, q, k, v in (fallback, kernel):
        layer.attend(q[:36], k[:36], v[:36], scale=0.2, window=None)
    _pending(fresh_groups, paged_attention.DECODE_KERNELS)
    layer, q, k, v = fallback
    out_fallback = layer.attend(q[36:37], k[36:37], v[36:37], scale=0.2, window=None)
    assert calls == [] and fresh_groups[paged_attention.DECODE_KERNELS].fallback_calls == 1
    fresh_groups[paged_attention.DECODE_KERNELS].state = "ready"
    layer, q, k, v = kernel
    out_kernel = layer.attend(q[36:37], k[36:37], v[36:37], scale=0.2, window=None)
    assert calls == [1]
    np.testing.assert_allclose(out_fallback, out_kernel, rtol=0, atol=1e-5 * np.abs(out_kernel).max())
    # the two caches hold the same state: the next step agrees too
    a = fallback[0].attend(fallback[1][37:38], fallback[2][37:38], fallback[3][37:38], scale=0.2, window=None)
    b = kernel[0].attend(kernel[1][37:38], kernel[2][37:38], kernel[3][37:38], scale=0.2, window=None)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_pending_batched_and_packed_kernels_take_the_reference(fresh_groups, monkeypatch):
    """A short batch (packed-code path) and a long one (batched path) while their kernels compile:
    the reference answers both, counted per group."""
    def forbidden(*_a, **_k):
        raise AssertionError("a pending compiled path was called")

    layer, q, k, v = _layer()
    layer.attend(q[:36], k[:36], v[:36], scale=0.2, window=None)
    layer2, q2, k2, v2 = _layer(seed=1)
    monkeypatch.setattr(paged_attention.BatchedAttention, "attend", forbidden)
    monkeypatch.setattr(paged_attention.PackedCodeAttention, "_old_scores", forbidden)
    for name in (paged_attention.BATCHED_KERNELS, paged_attention.PACKED_KERNELS):
        _pending(fresh_groups, name)
    reference_attend, seen = paged_attention.ReferenceAttention.attend, []

    def spy(self, view, **kw):
        seen.append(len(view.q))
        return reference_attend(self, view, **kw)

    monkeypatch.setattr(paged_attention.ReferenceAttention, "attend", spy)
    layer.attend(q[36:39], k[36:39], v[36:39], scale=0.2, window=None)  # 6 rows per KV head: packed codes
    layer2.attend(q2[:36], k2[:36], v2[:36], scale=0.2, window=None)  # 72 rows: batched
    assert seen == [3, 36]
    assert fresh_groups[paged_attention.PACKED_KERNELS].fallback_calls == 1
    assert fresh_groups[paged_attention.BATCHED_KERNELS].fallback_calls == 1


def test_ungated_attention_ignores_the_background(fresh_groups):
    """The warm-up's own caches (gated=False) run the compiled path even while it is pending."""
    _pending(fresh_groups, paged_attention.DECODE_KERNELS)
    att = paged_attention.choose_attention(_layer()[0].pool)
    att.gated = False
    assert not att._compiling(paged_attention.DECODE_KERNELS)
    att.gated = True
    assert att._compiling(paged_attention.DECODE_KERNELS)


# -- the background compiler ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_background_groups_ready_or_failed_and_logged(fresh_groups, monkeypatch, caplog, mode):
    """Groups run in order, in a child process (then loaded here) or a thread; a failing group
    stays pending (its callers keep the fallback) and the log says so."""
    monkeypatch.setenv(background.MODE_ENV, mode)
    with caplog.at_level(logging.INFO, logger="omlx.kernels"):
        background.start([("ok", "gc:collect", ()), ("bad", "json:dumps", ())])  # dumps() lacks its argument
        assert background.wait(timeout=120)
    assert background.ready("ok") and not background.pending("ok")
    assert background.pending("bad") and not background.ready("bad")
    assert background.status() == "ok: ready, bad: failed"
    text = caplog.text
    assert "ok kernels ready" in text and ("child process" if mode == "process" else "background thread") in text
    assert "compiling the bad kernels failed" in text


@pytest.mark.parametrize("finish", ["on", "off"])
def test_a_compiler_whose_parent_ended_finishes_its_groups_at_low_priority(tmp_path, finish):
    """A process starts two groups in a child and exits before the first is done (a user who
    closes the app within the minute a first start compiles): with OMLX_KERNEL_FINISH on (the
    default) the child compiles both, the second at a lower priority, so that the next start finds
    them in the cache; off, it ends with its parent and compiles neither."""
    marker = tmp_path / "marker.txt"
    marker.touch()
    parent = textwrap.dedent("""
        import time
        from engine.kernels import background
        background.start([("first", "tests.background_targets:first", ()),
                          ("second", "tests.background_targets:second", ())])
        deadline = time.monotonic() + 30
        while "first: compiling" not in background.status() and time.monotonic() < deadline:
            time.sleep(0.02)  # until the child runs (the first target takes it 1.5 s)
        print("parent leaving:", background.status(), flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, OMLX_TEST_BACKGROUND_MARKER=str(marker))
    env[background.FINISH_ENV] = finish
    env.pop(background.MODE_ENV, None)
    proc = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0 and "parent leaving: first: compiling" in proc.stdout, proc.stdout + proc.stderr
    deadline = time.monotonic() + (60 if finish == "on" else 6)
    while time.monotonic() < deadline and len(marker.read_text().splitlines()) < 2:
        time.sleep(0.2)
    lines = [line.split() for line in marker.read_text().splitlines()]
    if finish == "off":
        assert lines == []
        return
    assert [name for _, name, _ in lines] == ["first", "second"]
    (pid1, _, _), (pid2, _, priority2) = lines
    assert pid1 == pid2  # both in the child (the parent was gone before either was done)
    if hasattr(os, "getpriority"):
        assert int(priority2) >= min(19, os.getpriority(os.PRIO_PROCESS, 0) + background.FINISH_NICE)


def test_background_loads_cached_groups_without_a_child(fresh_groups, monkeypatch, caplog):
    monkeypatch.setattr(background, "_in_cache", lambda probe: True)
    monkeypatch.setattr(background, "_run_child", lambda *a: pytest.fail("a child was started"))
    with caplog.at_level(logging.INFO, logger="omlx.kernels"):
        background.start([("cached", "gc:collect", ("gc:collect",))])
        assert background.wait(timeout=60)
    assert background.ready("cached") and "found in numba's cache" in caplog.text


def test_in_cache_probe_reads_numba_index():
    from engine.kernels import pool

    assert not background._in_cache("gc:collect")  # not a numba dispatcher
    pool.warm_up_pool()
    assert background._in_cache("engine.kernels.pool:_pool_matvec")


def test_warm_up_mode_is_validated(monkeypatch):
    monkeypatch.setenv(warmup.WARM_UP_ENV, "later")
    with pytest.raises(ValueError, match="OMLX_KERNEL_WARMUP"):
        warmup.start_warm_up()


# -- a whole first start --------------------------------------------------------------------


@pytest.mark.slow
def test_first_start_with_an_empty_kernel_cache_answers_and_names_the_path(smollm2_path, tmp_path):
    """`omlx generate` in a new process with an empty numba cache: the greedy answer is llama.cpp's
    (the same as with every kernel ready), and the log says the exact fallbacks answered."""
    case = reference_json("smollm2-135m-instruct", f32=True)["greedy_raw"][0]
    env = dict(os.environ, PYTHONPATH=ROOT, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env.pop(warmup.WARM_UP_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "generate", str(smollm2_path), "--prompt",
                           case["prompt"], "--max-tokens", "8", "--json"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ids"] == case["ids"][:8]
    # the matrices take the integer kernels (compiled for their types alone), or on a CPU without
    # them the float kernels; the float kernels are not compiled beside the integer ones
    from engine.kernels import int_dot

    if int_dot.kernel_isa() != "float":
        assert f"integer kernels ({int_dot.kernel_isa()}) for Q4_1, Q8_0 ready" in proc.stderr
        assert "quantized-weight kernels for" not in proc.stderr and "Q8_0 row dequantizer ready" in proc.stderr
    else:
        assert "quantized-weight kernels for Q4_1, Q8_0 ready" in proc.stderr and "compiled Q4_1, Q8_0" in proc.stderr
    first = [line for line in proc.stderr.splitlines() if line.startswith("first token")]
    assert len(first) == 1 and "exact fallbacks answered" in first[0] and "decode attention: " in first[0]
