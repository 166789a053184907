"""The paged, quantized KV cache (engine.kv.paged): what decode sees, block accounting, trim,
sinks, memory, on tiny random-weight models and on the two real catalog models.

"What decode sees": a query at position p sees key j quantized when j's block was full before p's
block began, at full (float16) precision when j is in p's own block or is a sink. Prefill applies
the same rule, so one-pass prefill, chunked prefill and token-by-token decode (with or without the
packed-code kernels) agree — exactly up to float rounding as long as the cache receives the same
k/v. In a model with several layers the k/v of layer 1 depend on layer 0's attention, which the
paths compute in a different order (BLAS blocking, kernels); a last-bit difference can move a
value across a float16 or quantization rounding boundary, and then it differs by a whole
quantization step. So the exact checks feed identical inputs (one layer, or a single cache layer
directly) and the multi-layer checks use a tolerance tied to the quantization error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import weights
from engine.errors import KVPoolFull
from engine.gguf_file import GGUFFile
from engine.kv.cache import FullPrecisionLayerCache, KVCache
from engine.kv.config import PRESETS, KVConfig, estimate_bytes
from engine.kv.formats import get_format
from engine.kv.paged import PagedKVCache, PagedLayerCache
from engine.models import load_model

from .tiny_gguf import write_tiny_model

TINY = dict(head_dim=64, dim=128, n_heads=4, n_kv_heads=2, context_length=512)
ARCHS = ("llama", "gemma3")
TEXTS = Path(__file__).parent / "data" / "texts"

# Specs of the equivalence tests: one per precision family, rotation and per-layer overrides.
EQUIV_SPECS = ["k8v8", "k6v4", "k4v4", "k4v4,rot", "k2v2", "k8v4", "k4v4,0:k8v8"]

def _tiny(tmp_path_factory, arch: str, **kw):
    name = f"{arch}-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / f"{name}.gguf", arch, **{**TINY, **kw})
    return load_model(GGUFFile(path))


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    """Two layers; gemma3's are both local (sliding window 8)."""
    return _tiny(tmp_path_factory, request.param, n_layers=2)


@pytest.fixture(scope="module", params=ARCHS)
def tiny_wide(request, tmp_path_factory):
    """Two layers; gemma3's window (64) is longer than the tests' sequences: no block is released."""
    return _tiny(tmp_path_factory, request.param, n_layers=2, sliding_window=64)


@pytest.fixture(scope="module", params=ARCHS)
def tiny1(request, tmp_path_factory):
    """One layer: its k/v depend only on the token embeddings."""
    return _tiny(tmp_path_factory, request.param, n_layers=1)


@pytest.fixture(scope="module", params=ARCHS)
def tiny1_wide(request, tmp_path_factory):
    """One layer whose window (gemma3: 128) is longer than the tests' sequences."""
    return _tiny(tmp_path_factory, request.param, n_layers=1, sliding_window=128)


@pytest.fixture(scope="module")
def gemma6(tmp_path_factory):
    """Six gemma3 layers: 0-4 local (window 8), 5 global."""
    m = _tiny(tmp_path_factory, "gemma3", n_layers=6, sliding_window=8)
    assert [m.layer_window(i) for i in range(6)] == [8, 8, 8, 8, 8, None]
    return m


def ids_for(model, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, model.vocab_size, size=n)


def prefill(model, cache, ids):
    return model.forward(ids, cache, "all")


def chunked(model, cache, ids, size: int = 13):
    return np.concatenate([model.forward(ids[s : s + size], cache, "all") for s in range(0, len(ids), size)])


def decode(model, cache, ids):
    return np.concatenate([model.forward(ids[i : i + 1], cache, "last") for i in range(len(ids))])


def f16_like(spec: str) -> str:
    """The float16 spec with the same block size, sinks and rotation (rotated keys round to
    float16 differently)."""
    c = KVConfig.parse(spec)
    return str(KVConfig(16, 16, block_size=c.block_size, sinks=c.sinks, rotation=c.rotation))


def maxdiff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def record_kv(cache) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Wrap each layer's attend to record the k, v it is given: [layer][call] = (k, v)."""
    calls: list[list] = [[] for _ in cache.layers]
    for i, layer in enumerate(cache.layers):
        inner = layer.attend

        def attend(q, k, v, *, scale, window, _inner=inner, _calls=calls[i]):
            _calls.append((k.copy(), v.copy()))
            return _inner(q, k, v, scale=scale, window=window)

        layer.attend = attend
    return calls


def stacked(calls):
    return [(np.concatenate([k for k, _ in layer]), np.concatenate([v for _, v in layer])) for layer in calls]


@pytest.fixture
def row_wise_linears(monkeypatch):
    """Linear layers computed one token row at a time, so a token's k/v do not depend on how
    many tokens share the call (BLAS picks other kernels/blocking for other shapes)."""

    def call(self, x):
        if x.shape[0] == 0:
            return x @ self.weight.T
        return np.stack([self.weight @ row for row in x])

    monkeypatch.setattr(weights.DenseLinear, "__call__", call)


def expected_blocks(n_tokens: int, bs: int, window: int | None) -> tuple[int, int]:
    """(blocks held, first_position) of a layer after n_tokens, from the release rule: blocks that
    end before the next query's oldest visible key (n_tokens - window + 1) are released."""
    n_full = n_tokens // bs
    if window is None:
        return n_full, 0
    released = min(n_full, max(0, (n_tokens - window + 1) // bs))
    return n_full - released, released * bs


def check_accounting(model, cache, n_tokens: int):
    bs = cache.config.block_size
    assert cache.offset == n_tokens
    for i, (layer, pool) in enumerate(zip(cache.layers, cache.pools)):
        held, first = expected_blocks(n_tokens, bs, model.layer_window(i))
        assert layer.offset == n_tokens, i
        assert len(layer.block_table) == held, (i, n_tokens)
        assert layer.first_position == first, (i, n_tokens)
        assert layer.n_tail == n_tokens % bs, (i, n_tokens)
        assert pool.n_used == held, (i, n_tokens)
        assert len(set(layer.block_table)) == held
        assert all(pool.ref_cnt[b] == 1 for b in layer.block_table)
        assert first + held * bs + layer.n_tail == n_tokens
    windows = [model.layer_window(i) for i in range(model.n_layers)]
    est = estimate_bytes(cache.config, model.n_layers, model.n_kv_heads, model.head_dim, n_tokens,
                         model.value_dim, windows=windows)
    assert cache.nbytes == est["total"]
    assert cache.capacity_bytes >= cache.nbytes


# ---- float16 paged cache == the plain float16 cache ---------------------------------------------------


@pytest.mark.parametrize("spec", ["f16", "full,bs=16", "fp16,bs=8,sinks=0"])
def test_f16_paged_cache_matches_reference_cache(tiny, spec):
    ids = ids_for(tiny, 40)
    ref = prefill(tiny, tiny.new_cache(), ids)
    tol = dict(rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    cache = tiny.new_cache(spec)
    assert isinstance(cache, PagedKVCache)
    assert {p.k_format.name for p in cache.pools} == {p.v_format.name for p in cache.pools} == {"f16"}
    np.testing.assert_allclose(prefill(tiny, cache, ids), ref, **tol)
    np.testing.assert_allclose(chunked(tiny, tiny.new_cache(spec), ids), ref, **tol)
    np.testing.assert_allclose(decode(tiny, tiny.new_cache(spec, use_kernels=False), ids), ref, **tol)
    np.testing.assert_allclose(decode(tiny, tiny.new_cache(spec, use_kernels=True), ids), ref, **tol)


def test_new_cache_builds_the_configured_pools(tiny):
    cache = tiny.new_cache("k4v4,0:k8v8,bs=16,sinks=2,rot")
    assert isinstance(cache, PagedKVCache) and len(cache) == tiny.n_layers
    assert cache.config == KVConfig.parse("k4v4,0:k8v8,bs=16,sinks=2,rot")
    assert [p.k_format for p in cache.pools] == [get_format(8, "k")] + [get_format(4, "k")] * (tiny.n_layers - 1)
    assert [p.v_format for p in cache.pools] == [get_format(8, "v")] + [get_format(4, "v")] * (tiny.n_layers - 1)
    for i, (layer, pool) in enumerate(zip(cache.layers, cache.pools)):
        assert isinstance(layer, PagedLayerCache)
        assert layer.pool is pool and pool.block_size == 16 and layer.n_sinks == 2
        assert layer.rotation is not None and layer.window == tiny.layer_window(i)
        assert (pool.n_kv_heads, pool.head_dim, pool.value_dim) == (2, 64, 64)
    assert len({id(p) for p in cache.pools}) == tiny.n_layers  # one pool per layer
    plain = tiny.new_cache()
    assert not isinstance(plain, PagedKVCache)
    assert isinstance(plain[0], FullPrecisionLayerCache)
    assert isinstance(tiny.new_cache(KVConfig.parse("k6v4")), PagedKVCache)


# ---- one pass == chunked == decode (kernels or not) ---------------------------------------------------


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("spec", ["f16"] + EQUIV_SPECS + ["k2v2,sinks=0", "k3v5,sinks=20", "k5v3,bs=8"])
def test_layer_prefill_chunks_and_decode_agree(spec, window):
    """One cache layer fed identical q, k, v: the three ways of feeding agree to float rounding."""
    rng = np.random.default_rng(7)
    T, H, Hkv, D = 70, 4, 2, 64
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    k[:, :, 3] *= 8  # an outlier channel
    config = KVConfig.parse(spec if "bs=" in spec else spec + ",bs=16")

    def run(sizes, use_kernels=None):
        cache = PagedKVCache(config, n_layers=1, n_kv_heads=Hkv, head_dim=D, windows=[window],
                             use_kernels=use_kernels)
        out, s = [], 0
        for n in sizes:
            out.append(cache[0].attend(q[s : s + n], k[s : s + n], v[s : s + n], scale=0.125, window=window))
            s += n
        assert s == T and cache.offset == T
        return np.concatenate(out)

    one = run([T])
    assert one.shape == (T, H, D)
    np.testing.assert_allclose(run([13] * 5 + [5]), one, atol=2e-5, rtol=0)
    np.testing.assert_allclose(run([1] * T, use_kernels=False), one, atol=2e-5, rtol=0)
    np.testing.assert_allclose(run([3, 1, 1, 30, 2] + [1] * 33, use_kernels=False), one, atol=2e-5, rtol=0)
    np.testing.assert_allclose(run([1] * T, use_kernels=True), one, atol=2e-5, rtol=0)
    if spec != "f16":  # and it is not the float16 answer
        f16 = PagedKVCache(KVConfig.parse("f16,bs=16"), n_layers=1, n_kv_heads=Hkv, head_dim=D, windows=[window])
        assert maxdiff(f16[0].attend(q, k, v, scale=0.125, window=window), one) > 1e-3


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("spec", ["f16", "k4v4", "k6v4,rot", "k8v2,sinks=20"])
def test_decode_kernel_matches_numpy_decode_and_attention_mass(spec, window):
    """The one-call decode kernel and the numpy path agree on outputs and on the attention each
    position received (H2O eviction reads it), block fills and sinks included; trimming forgets
    the trimmed positions' mass."""
    rng = np.random.default_rng(3)
    T, H, Hkv, D = 75, 6, 2, 64
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    config = KVConfig.parse(spec + ",bs=16")
    caches = []
    for use_kernels in (True, False):
        cache = PagedKVCache(config, n_layers=1, n_kv_heads=Hkv, head_dim=D, windows=[window],
                             use_kernels=use_kernels, overflow="attention")
        outs = [cache[0].attend(q[:20], k[:20], v[:20], scale=0.125, window=window)]
        outs += [cache[0].attend(q[t : t + 1], k[t : t + 1], v[t : t + 1], scale=0.125, window=window)
                 for t in range(20, T)]
        caches.append((cache, np.concatenate(outs)))
    (fast, out_fast), (ref, out_ref) = caches
    np.testing.assert_allclose(out_fast, out_ref, atol=2e-5, rtol=0)
    assert fast[0].block_table == ref[0].block_table and fast[0].n_tail == ref[0].n_tail
    np.testing.assert_allclose(fast[0].attn_mass[:T], ref[0].attn_mass[:T], atol=2e-4, rtol=1e-5)
    assert fast[0].attn_mass[:T].sum() == pytest.approx(H * T, rel=1e-4)  # one per query and head
    fast.trim(2)
    assert not fast[0].attn_mass[T - 2 :].any()


def _qkv(T=40, H=4, Hkv=2, D=64, seed=11):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    k[:, :, 3] *= 8
    return q, k, v


def test_rotation_stores_rotated_keys_and_keeps_scores():
    from engine.kv.formats import hadamard

    q, k, v = _qkv()
    plain = PagedKVCache(KVConfig.parse("f16,bs=16"), n_layers=1, n_kv_heads=2, head_dim=64)
    rot = PagedKVCache(KVConfig.parse("f16,bs=16,rot"), n_layers=1, n_kv_heads=2, head_dim=64)
    out_plain = plain[0].attend(q, k, v, scale=0.125, window=None)
    out_rot = rot[0].attend(q, k, v, scale=0.125, window=None)
    np.testing.assert_allclose(out_rot, out_plain, atol=2e-3, rtol=0)  # q.k unchanged (f16 rounding apart)
    kd, vd = rot.pools[0].dequantize(rot[0].block_table)  # (2, Hkv, 16, D)
    kr = (k @ hadamard(64)).astype(np.float16).astype(np.float32)  # (T, Hkv, D)
    np.testing.assert_array_equal(kd, kr[:32].reshape(2, 16, 2, 64).transpose(0, 2, 1, 3))
    vp = plain.pools[0].dequantize(plain[0].block_table)[1]
    np.testing.assert_array_equal(vd, vp)  # values are never rotated


@pytest.mark.parametrize("window", [None, 8])
def test_append_stores_what_attend_stores(window):
    """`append` (store without attending, used by the real-model memory test below) leaves the
    cache exactly as `attend` does."""
    q, k, v = _qkv(T=70)
    config = KVConfig.parse("k4v4,bs=16,sinks=6,rot")
    a = PagedKVCache(config, n_layers=1, n_kv_heads=2, head_dim=64, windows=[window])
    b = PagedKVCache(config, n_layers=1, n_kv_heads=2, head_dim=64, windows=[window])
    s = 0
    for n in (5, 1, 20, 13, 31):
        a[0].attend(q[s : s + n], k[s : s + n], v[s : s + n], scale=0.125, window=window)
        b[0].append(k[s : s + n], v[s : s + n])
        s += n
        la, lb = a[0], b[0]
        assert (la.offset, la.n_tail, la.first_position, la.block_table) == (
            lb.offset, lb.n_tail, lb.first_position, lb.block_table)
        assert a.nbytes == b.nbytes and a.capacity_bytes == b.capacity_bytes
    for name in ("tail_k", "tail_v", "sink_k", "sink_v"):
        np.testing.assert_array_equal(getattr(a[0], name), getattr(b[0], name))
    for x, y in zip(a.pools[0].k_slabs + a.pools[0].v_slabs, b.pools[0].k_slabs + b.pools[0].v_slabs):
        np.testing.assert_array_equal(x, y)
    # and later queries see the same cache
    qn, kn, vn = _qkv(T=3, seed=12)
    np.testing.assert_array_equal(a[0].attend(qn, kn, vn, scale=0.125, window=window),
                                  b[0].attend(qn, kn, vn, scale=0.125, window=window))


@pytest.mark.parametrize("spec", EQUIV_SPECS)
def test_model_one_layer_prefill_chunks_and_decode_agree_exactly(tiny1, spec, row_wise_linears):
    """A one-layer model whose k/v do not depend on the call's shape: every path gives the cache
    the same k/v (checked), and the logits agree to float rounding."""
    spec += ",bs=16"
    ids = ids_for(tiny1, 40)

    def run(feed, **kw):
        cache = tiny1.new_cache(spec, **kw)
        calls = record_kv(cache)
        out = feed(tiny1, cache, ids)
        check_accounting(tiny1, cache, len(ids))
        return out, stacked(calls)

    one, kv_one = run(prefill)
    f16 = prefill(tiny1, tiny1.new_cache(f16_like(spec)), ids)
    tol = dict(rtol=0, atol=1e-5 * np.abs(one).max())
    paths = [run(chunked), run(decode, use_kernels=False)]
    paths.append(run(decode, use_kernels=True))
    for out, kv in paths:
        for (k1, v1), (k2, v2) in zip(kv_one, kv):  # the premise: the cache got the same inputs
            np.testing.assert_array_equal(k2, k1)
            np.testing.assert_array_equal(v2, v1)
        np.testing.assert_allclose(out, one, **tol)
    # positions in the first block see only their own (float16) block; later ones see quantized keys
    np.testing.assert_allclose(one[:16], f16[:16], **tol)
    assert maxdiff(one[16:], f16[16:]) > 10 * tol["atol"]


@pytest.mark.parametrize("spec", EQUIV_SPECS)
def test_model_prefill_chunks_and_decode_agree(tiny, spec):
    """The real code path on a two-layer model: the paths agree up to rare rounding flips, far
    below the quantization error itself; the first block is float16 in every path."""
    spec += ",bs=16"
    ids = ids_for(tiny, 40)
    f16 = prefill(tiny, tiny.new_cache(f16_like(spec)), ids)
    cache = tiny.new_cache(spec)
    one = prefill(tiny, cache, ids)
    check_accounting(tiny, cache, len(ids))
    quant_err = maxdiff(one, f16)
    assert quant_err > 1e-4 * np.abs(f16).max()
    fp_tol = 1e-4 * np.abs(f16).max()
    np.testing.assert_allclose(one[:16], f16[:16], rtol=0, atol=fp_tol)
    paths = {"chunked": chunked(tiny, tiny.new_cache(spec), ids)}
    paths["decode"] = decode(tiny, tiny.new_cache(spec, use_kernels=False), ids)
    cache = tiny.new_cache(spec, use_kernels=True)
    assert all(layer.use_kernels for layer in cache.layers)
    paths["decode+kernels"] = decode(tiny, cache, ids)
    check_accounting(tiny, cache, len(ids))
    for name, out in paths.items():
        np.testing.assert_allclose(out[:16], f16[:16], rtol=0, atol=fp_tol, err_msg=name)
        assert maxdiff(out, one) <= 0.25 * quant_err, name
        assert (out.argmax(axis=1) == one.argmax(axis=1)).mean() >= 0.9, name


# ---- quantization is real, and more bits are closer ---------------------------------------------------


def test_quantized_specs_differ_from_f16_and_more_bits_are_closer(tiny):
    ids = ids_for(tiny, 64, seed=1)
    f16 = prefill(tiny, tiny.new_cache("f16,bs=16"), ids)
    scale = np.abs(f16).max()

    def err(spec):
        cache = tiny.new_cache(spec + ",bs=16")
        out = prefill(tiny, cache, ids)
        np.testing.assert_allclose(out[:16], f16[:16], rtol=0, atol=1e-4 * scale)  # own block: float16
        return float(np.sqrt(np.mean((out[16:] - f16[16:]) ** 2)))

    chain = ["k8v8", "k6v6", "k5v5", "k4v4", "k3v3", "k2v2"]
    errs = {spec: err(spec) for spec in chain + ["k8v4", "k4v8"]}
    assert errs["k8v8"] > 1e-4 * np.sqrt(np.mean(f16**2))  # not silently full precision
    for hi, lo in zip(chain, chain[1:]):
        assert errs[hi] < errs[lo], (hi, lo, errs)
    assert errs["k8v8"] * 10 < errs["k2v2"]
    assert errs["k8v4"] < errs["k4v4"] and errs["k4v8"] < errs["k4v4"]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_stored_blocks_are_quantized(tiny_wide, bits):
    ids = ids_for(tiny_wide, 40)
    q = tiny_wide.new_cache(f"k{bits}v{bits},bs=16")
    f = tiny_wide.new_cache("f16,bs=16")
    prefill(tiny_wide, q, ids)
    prefill(tiny_wide, f, ids)
    for lq, lf in zip(q.layers, f.layers):
        assert lq.pool.k_format == get_format(bits, "k") and lq.pool.v_format == get_format(bits, "v")
        assert len(lq.block_table) == len(lf.block_table) > 0
    # layer 0 gets the same k/v in both caches (later layers see layer 0's different outputs)
    lq, lf = q.layers[0], f.layers[0]
    kq, vq = lq.pool.dequantize(lq.block_table)
    kf, vf = lf.pool.dequantize(lf.block_table)
    for a, b in ((kq, kf), (vq, vf)):
        err = np.abs(a - b).max()
        assert 0 < err < np.abs(b).max() * 4 / (1 << bits)
    # the unfinished block and the sinks stay float16, identical in both
    assert lq.n_tail == lf.n_tail == 8
    np.testing.assert_array_equal(lq.tail_k[:, :8], lf.tail_k[:, :8])
    np.testing.assert_array_equal(lq.tail_v[:, :8], lf.tail_v[:, :8])
    np.testing.assert_array_equal(lq.sink_k, lf.sink_k)
    np.testing.assert_array_equal(lq.sink_v, lf.sink_v)


# ---- block accounting ---------------------------------------------------------------------------------


def test_block_accounting_and_release(tiny):
    spec = "k4v4,bs=16"
    cache = tiny.new_cache(spec)
    ids = ids_for(tiny, 76)
    n = 0
    for size in (5, 11, 1, 16, 20, 1, 1, 21):  # crosses block ends in every way
        tiny.forward(ids[n : n + size], cache, "last")
        n += size
        check_accounting(tiny, cache, n)
    cache.release()
    assert cache.offset == 0
    assert all(p.n_used == 0 for p in cache.pools)
    assert all(layer.block_table == [] and layer.n_tail == 0 for layer in cache.layers)
    assert cache.capacity_bytes > cache.nbytes  # slabs stay allocated for reuse
    # the released cache is as good as new
    again = prefill(tiny, cache, ids[:40])
    np.testing.assert_allclose(again, prefill(tiny, tiny.new_cache(spec), ids[:40]), rtol=1e-5, atol=1e-5)
    check_accounting(tiny, cache, 40)


def test_gemma3_window_layers_release_blocks_global_layer_keeps_all(gemma6):
    m = gemma6
    cache = m.new_cache("k4v4,bs=4,sinks=4")
    ids = ids_for(m, 45)
    n = 0
    for size in (3, 1, 5, 9, 1, 1, 1, 1, 4, 19):
        m.forward(ids[n : n + size], cache, "last")
        n += size
        check_accounting(m, cache, n)
    assert n == 45
    local, glob = cache.layers[0], cache.layers[5]
    # local: the next query (45) sees 38..45, so blocks ending at or before 37 are gone
    assert local.first_position == 36 and len(local.block_table) == 2 and local.n_tail == 1
    assert glob.first_position == 0 and len(glob.block_table) == 11
    assert cache.pools[0].n_used == 2 and cache.pools[5].n_used == 11
    # released blocks went back to the pool's free queue and are reused
    assert cache.pools[0].n_blocks > cache.pools[0].n_used
    before = cache.pools[0].n_blocks
    m.forward(ids[:8], cache, "last")
    check_accounting(m, cache, 53)
    assert cache.pools[0].n_blocks == before
    windows = [m.layer_window(i) for i in range(6)]
    est = estimate_bytes(cache.config, 6, m.n_kv_heads, m.head_dim, 53, m.value_dim, windows=windows)
    assert [p["total"] for p in est["per_layer"]][:5] == [est["per_layer"][0]["total"]] * 5
    assert est["per_layer"][5]["total"] > est["per_layer"][0]["total"]
    cache.release()
    assert all(p.n_used == 0 for p in cache.pools) and cache.offset == 0


def test_window_layers_match_the_reference_after_releasing(gemma6):
    """Releasing blocks loses nothing a query can still see (f16: compare with the plain cache)."""
    ids = ids_for(gemma6, 45, seed=2)
    ref = prefill(gemma6, gemma6.new_cache(), ids)
    tol = dict(rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    cache = gemma6.new_cache("f16,bs=4")
    np.testing.assert_allclose(chunked(gemma6, cache, ids, 7), ref, **tol)
    assert cache.layers[0].first_position > 0
    np.testing.assert_allclose(decode(gemma6, gemma6.new_cache("f16,bs=4", use_kernels=False), ids), ref, **tol)


# ---- trim -----------------------------------------------------------------------------------------------


def _layer_state(cache):
    return [(layer.offset, len(layer.block_table), layer.n_tail, layer.first_position) for layer in cache.layers]


@pytest.mark.parametrize("spec", ["f16", "k4v4", "k2v2"])
def test_trim_to_a_block_boundary_or_into_the_sinks_refills_exactly(tiny_wide, spec):
    """Nothing of a reopened quantized block survives a trim to a block start or into the (exact)
    sinks, so re-feeding the same tokens reproduces the logits to float rounding."""
    spec += ",bs=16,sinks=4"
    ids = ids_for(tiny_wide, 40)
    cache = tiny_wide.new_cache(spec)
    first = prefill(tiny_wide, cache, ids)
    tol = dict(rtol=0, atol=1e-4 * np.abs(first).max())
    for n, (blocks, tail) in ((8, (2, 0)), (16, (1, 0)), (14, (0, 2)), (2, (0, 0))):
        offset = cache.offset - n
        cache.trim(n)
        assert cache.offset == offset
        assert all(s == (offset, blocks, tail, 0) for s in _layer_state(cache)), (n, _layer_state(cache))
        assert all(p.n_used == blocks for p in cache.pools)
    assert cache.offset == 0
    cache.trim(5)  # trimming an empty cache is a no-op
    assert cache.offset == 0
    np.testing.assert_allclose(prefill(tiny_wide, cache, ids), first, **tol)
    for target in (32, 16, 2):  # trim back, then re-feed the rest
        cache.trim(cache.offset - target)
        np.testing.assert_allclose(prefill(tiny_wide, cache, ids[target:]), first[target:], **tol, err_msg=str(target))
    check_accounting(tiny_wide, cache, 40)


def test_trim_keeps_sinks_exact_when_sinks_span_blocks(tiny_wide):
    """sinks=6 with bs=4: reopening block 1 (4..7) puts sinks 4, 5 back exactly."""
    ids = ids_for(tiny_wide, 24)
    cache = tiny_wide.new_cache("k2v2,bs=4,sinks=6")
    first = prefill(tiny_wide, cache, ids)
    tol = dict(rtol=0, atol=1e-4 * np.abs(first).max())
    for target in (12, 8, 6, 5, 3):  # block starts, or inside the sinks
        cache.trim(cache.offset - target)
        assert _layer_state(cache)[0] == (target, target // 4, target % 4, 0)
        np.testing.assert_allclose(prefill(tiny_wide, cache, ids[target:]), first[target:], **tol,
                                   err_msg=str(target))
    cache.trim(24 - 7)  # 7: token 6 of block 1 is not a sink: it comes back quantized
    assert maxdiff(prefill(tiny_wide, cache, ids[7:]), first[7:]) > 10 * tol["atol"]


@pytest.mark.parametrize("spec", ["f16", "k8v8", "k4v4"])
def test_trim_into_a_quantized_block_reopens_it(tiny_wide, spec):
    spec += ",bs=16"
    ids = ids_for(tiny_wide, 40)
    cache = tiny_wide.new_cache(spec)
    first = prefill(tiny_wide, cache, ids[:31])  # block 1 (16..31) is the tail, one row short
    before = [(layer.tail_k.copy(), layer.tail_v.copy()) for layer in cache.layers]
    first = np.concatenate([first, prefill(tiny_wide, cache, ids[31:])])
    block1 = [layer.block_table[1] for layer in cache.layers]
    cache.trim(15)  # 40 -> 25: block 1 (16..31) comes back as the tail, 9 tokens of it kept
    assert _layer_state(cache) == [(25, 1, 9, 0)] * tiny_wide.n_layers
    assert all(p.n_used == 1 for p in cache.pools)
    for layer, pool, b, (tail_k, tail_v) in zip(cache.layers, cache.pools, block1, before):
        assert pool.ref_cnt[b] == 0 and b in pool._free  # the reopened block went back to the pool
        # the block that filled last comes back exactly as it was before it was quantized
        np.testing.assert_array_equal(layer.tail_k[:, :9], tail_k[:, :9])
        np.testing.assert_array_equal(layer.tail_v[:, :9], tail_v[:, :9])
    again = prefill(tiny_wide, cache, ids[25:])
    check_accounting(tiny_wide, cache, 40)
    np.testing.assert_allclose(again, first[25:], rtol=0, atol=1e-4 * np.abs(first).max())


def test_trim_into_an_older_quantized_block_reopens_it_as_stored(tiny_wide):
    """Only the block that filled last has its float16 rows kept: trimming further back reopens
    older blocks as stored (dequantized), what later queries saw of them anyway."""
    ids = ids_for(tiny_wide, 40)
    cache = tiny_wide.new_cache("k4v4,bs=16")
    prefill(tiny_wide, cache, ids)
    block0 = [layer.block_table[0] for layer in cache.layers]
    cache.trim(30)  # 40 -> 10: block 1 reopened exactly, then block 0 as stored
    assert _layer_state(cache) == [(10, 0, 10, 0)] * tiny_wide.n_layers
    for layer, pool, b in zip(cache.layers, cache.pools, block0):
        kq, vq = pool.dequantize([b])
        n_sink = layer.n_sinks  # sink positions stay exact
        np.testing.assert_array_equal(layer.tail_k[:, n_sink:10], kq[0][:, n_sink:10])
        np.testing.assert_array_equal(layer.tail_v[:, n_sink:10], vq[0][:, n_sink:10])


@pytest.mark.parametrize("one_pass", [False, True], ids=["decoded", "one-pass"])
def test_trim_back_to_a_kept_position_restores_its_block_exactly(tiny1_wide, row_wise_linears, one_pass):
    """`keep_exact(20)`: however many blocks fill after block 1 (16..31), a trim back to 20
    leaves the layer as a cache that only ever held 20 tokens, bit for bit (one layer and
    row-wise linears: a token's k/v do not depend on the pass it is computed in); a trim into
    a block whose rows nobody kept can only go back exactly to that block's start."""
    model, spec = tiny1_wide, "k4v4,bs=16"
    ids = ids_for(model, 80)
    ref = model.new_cache(spec)
    prefill(model, ref, ids[:20])
    cache = model.new_cache(spec)
    cache.keep_exact(20)
    if one_pass:  # block 1 fills in the middle of the pass, blocks 2-4 after it
        prefill(model, cache, ids)
    else:
        prefill(model, cache, ids[:21])
        decode(model, cache, ids[21:])
    assert cache.exact_trim_point(20) == 20
    assert cache.exact_trim_point(70) == 70  # block 4 (64..79): the one that filled last
    assert cache.exact_trim_point(40) == 32  # block 2: neither kept nor the last
    assert cache.exact_trim_point(2) == 2  # block 0: only sinks would stay
    cache.trim(60)
    assert _layer_state(cache) == _layer_state(ref) == [(20, 1, 4, 0)]
    (layer,), (want,) = cache.layers, ref.layers
    np.testing.assert_array_equal(layer.tail_k[:, :4], want.tail_k[:, :4])
    np.testing.assert_array_equal(layer.tail_v[:, :4], want.tail_v[:, :4])
    for a, b in zip(layer.pool.dequantize(layer.block_table), want.pool.dequantize(want.block_table)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(decode(model, cache, ids[20:22]), decode(model, ref, ids[20:22]))
    # kept again when block 1 fills a second time, and forgotten with the blocks
    decode(model, cache, ids[22:60])  # blocks 1 and 2 fill: the last is 2
    assert cache.exact_trim_point(20) == 20
    cache.release()
    assert layer.keep_at is None and layer._kept is None and layer._closed is None


def test_trim_into_released_window_blocks_raises(gemma6):
    cache = gemma6.new_cache("f16,bs=4")
    prefill(gemma6, cache, ids_for(gemma6, 40))
    assert cache.layers[0].first_position == 32
    state = _layer_state(cache)
    with pytest.raises(ValueError, match="sliding window"):
        cache.trim(10)  # 40 -> 30: blocks 24..31 of the local layers are gone
    assert _layer_state(cache) == state  # layer 0 (local) refused first: nothing changed
    with pytest.raises(ValueError):
        cache.trim(40)
    assert _layer_state(cache) == state
    cache.trim(1)  # 39: the next query sees 32..39, all still held
    assert cache.offset == 39


def test_trim_never_silently_loses_keys_a_window_query_needs(gemma6):
    """A trim is either refused (a window query would need a released block) or re-feeding the
    trimmed tokens reproduces the logits. After 42 tokens the local layers (window 8) hold
    32..41, so trims of 1..3 tokens (the next query needs 33..40 at the lowest) are legal — trim(3)
    reopens block 36..39 — and longer ones are refused."""
    ids = ids_for(gemma6, 42)
    first = prefill(gemma6, gemma6.new_cache("f16,bs=4"), ids)
    tol = dict(rtol=0, atol=1e-4 * np.abs(first).max())
    legal = []
    for n in range(1, 8):
        cache = gemma6.new_cache("f16,bs=4")
        prefill(gemma6, cache, ids)
        assert cache.layers[0].first_position == 32
        target = 42 - n
        if target - 8 + 1 < 32:  # the next query's window reaches a released block
            state = _layer_state(cache)
            with pytest.raises(ValueError, match="sliding window"):
                cache.trim(n)
            assert _layer_state(cache) == state
            continue
        cache.trim(n)
        assert cache.offset == target
        again = prefill(gemma6, cache, ids[target:])
        np.testing.assert_allclose(again, first[target:], **tol, err_msg=str(n))
        legal.append(n)
    assert legal == [1, 2, 3]


# ---- sinks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sinks", [4, 8])
def test_sink_tokens_are_exact(tiny, sinks):
    """k2v2 with bs=4: a position that sees only sinks and its own block gets the float16 answer,
    in prefill and in kernel decode."""
    ids = ids_for(tiny, 24, seed=3)
    f16 = prefill(tiny, tiny.new_cache("f16,bs=4"), ids)
    tol = dict(rtol=0, atol=1e-4 * np.abs(f16).max())
    exact = 4 + sinks  # positions < exact see only sinks and their own block
    spec = f"k2v2,bs=4,sinks={sinks}"
    outs = {"prefill": prefill(tiny, tiny.new_cache(spec), ids), "chunked": chunked(tiny, tiny.new_cache(spec), ids, 5)}
    outs["decode"] = decode(tiny, tiny.new_cache(spec, use_kernels=False), ids)
    outs["decode+kernels"] = decode(tiny, tiny.new_cache(spec, use_kernels=True), ids)
    for name, out in outs.items():
        np.testing.assert_allclose(out[:exact], f16[:exact], **tol, err_msg=name)
        assert maxdiff(out[exact:], f16[exact:]) > 100 * tol["atol"], name
    no_sinks = prefill(tiny, tiny.new_cache("k2v2,bs=4,sinks=0"), ids)
    np.testing.assert_allclose(no_sinks[:4], f16[:4], **tol)  # own block only
    assert maxdiff(no_sinks[4:8], f16[4:8]) > 100 * tol["atol"]  # block 0 seen quantized
    assert maxdiff(no_sinks[4:], outs["prefill"][4:]) > 100 * tol["atol"]  # sinks change the output


def test_sinks_are_kept_float16_alongside_the_blocks(tiny_wide):
    ids = ids_for(tiny_wide, 24)
    cache = tiny_wide.new_cache("k2v2,bs=4,sinks=6")
    ref = tiny_wide.new_cache("f16,bs=4,sinks=6")
    prefill(tiny_wide, cache, ids)
    prefill(tiny_wide, ref, ids)
    for i, (layer, rlayer) in enumerate(zip(cache.layers, ref.layers)):
        assert layer.sink_k.shape == (2, 6, 64) and layer.sink_v.shape == (2, 6, 64)
        np.testing.assert_array_equal(layer.sink_k, layer.sink_k.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(layer.sink_v, layer.sink_v.astype(np.float16).astype(np.float32))
        # positions 0..5 see only sinks and their own block, so every layer's sinks match float16
        # (bit for bit in layer 0, which gets the same k/v)
        check = np.testing.assert_array_equal if i == 0 else np.testing.assert_allclose
        check(layer.sink_k, rlayer.sink_k)
        check(layer.sink_v, rlayer.sink_v)
    # sink tokens are also stored (quantized) in their blocks: the sinks are an extra copy
    layer, rlayer = cache.layers[0], ref.layers[0]
    kq, _ = layer.pool.dequantize(layer.block_table[:2])
    kf, _ = rlayer.pool.dequantize(rlayer.block_table[:2])
    assert np.abs(kq - kf).max() > 0
    np.testing.assert_array_equal(kf[0], rlayer.sink_k[:, :4])  # f16 block 0 == sinks 0..3


# ---- max_tokens ----------------------------------------------------------------------------------------


def test_max_tokens_raises_memory_error(tiny):
    """Current behaviour: max_tokens limits each layer's pool to ceil(max_tokens / bs) blocks. The
    unfinished tail is not counted, so up to bs - 1 tokens past max_tokens are still accepted; the
    token that needs one more block raises MemoryError."""
    ids = ids_for(tiny, 100)
    cache = tiny.new_cache("k4v4,bs=16", max_tokens=64)
    assert all(p.max_blocks == 4 for p in cache.pools)
    if tiny.layer_window(0) is not None:
        # tiny gemma3: every layer is local (window 8) and releases blocks as it goes, so
        # decode never runs out; a one-pass prefill stores all its blocks before releasing any
        decode(tiny, cache, ids)
        assert cache.offset == 100 and all(p.n_used <= 1 for p in cache.pools)
        with pytest.raises(KVPoolFull):
            prefill(tiny, tiny.new_cache("k4v4,bs=16", max_tokens=64), ids)
        chunked(tiny, tiny.new_cache("k4v4,bs=16", max_tokens=64), ids, 32)  # chunks fit
        return
    prefill(tiny, cache, ids[:64])
    decode(tiny, cache, ids[64:79])  # 79 tokens: 4 blocks + a 15-token tail
    assert cache.offset == 79
    state = _layer_state(cache)
    with pytest.raises(KVPoolFull):
        tiny.forward(ids[79:80], cache)  # the 80th token completes a fifth block
    assert _layer_state(cache) == state  # layer 0 refused first: nothing changed
    assert all(p.n_used == 4 for p in cache.pools)
    # a prompt that does not fit fails without keeping any block
    cache = tiny.new_cache("k4v4,bs=16", max_tokens=64)
    with pytest.raises(KVPoolFull):
        prefill(tiny, cache, ids)
    assert cache.offset == 0 and all(p.n_used == 0 for p in cache.pools)
    # after a trim the freed blocks can be used again
    cache = tiny.new_cache("k4v4,bs=16", max_tokens=64)
    prefill(tiny, cache, ids[:79])
    cache.trim(40)
    prefill(tiny, cache, ids[39:79])
    assert cache.offset == 79
    # max_tokens not a multiple of the block size rounds up to whole blocks
    assert all(p.max_blocks == 3 for p in tiny.new_cache("k4v4,bs=16", max_tokens=33).pools)


def test_memory_error_leaves_the_layers_consistent(gemma6):
    ids = ids_for(gemma6, 40)
    cache = gemma6.new_cache("k4v4,bs=4", max_tokens=16)
    with pytest.raises(KVPoolFull):
        decode(gemma6, cache, ids)
    offsets = {layer.offset for layer in cache.layers}
    assert len(offsets) == 1, [layer.offset for layer in cache.layers]


@pytest.mark.parametrize("use_kernels", [False, True])
def test_decode_into_a_full_pool_raises_before_changing_the_layer(use_kernels):
    """A decoded token that completes a block when the pool has no room: KVPoolFull, and the
    layer still holds exactly what it held (the next attempt, with room, gives the same answer)."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((8, n, 64)).astype(np.float32) for n in (4, 2, 2))
    cache = PagedKVCache(KVConfig.parse("k4v4,bs=4"), n_layers=1, n_kv_heads=2, head_dim=64, max_tokens=4,
                         use_kernels=use_kernels)
    layer = cache[0]
    layer.attend(q[:7], k[:7], v[:7], scale=0.125, window=None)  # one full block, 3 in the tail
    before = (layer.offset, layer.n_tail, list(layer.block_table), layer.tail_k.copy())
    with pytest.raises(KVPoolFull):
        layer.attend(q[7:], k[7:], v[7:], scale=0.125, window=None)
    assert (layer.offset, layer.n_tail, list(layer.block_table)) == before[:3]
    np.testing.assert_array_equal(layer.tail_k[:, :3], before[3][:, :3])
    layer.pool.max_blocks = 2
    out = layer.attend(q[7:], k[7:], v[7:], scale=0.125, window=None)
    ref = PagedKVCache(KVConfig.parse("k4v4,bs=4"), n_layers=1, n_kv_heads=2, head_dim=64, use_kernels=use_kernels)
    np.testing.assert_allclose(out, ref[0].attend(q, k, v, scale=0.125, window=None)[7:], atol=2e-5, rtol=0)


def _sequences_over_one_pool(spec: str, lengths, *, max_tokens=None, seed=5):
    """One layer of len(lengths) sequences over one shared pool (one attention backend, the
    compiled decode kernel ungated), each prefilled with its number of random tokens."""
    from engine.kv.paged_attention import choose_attention
    from engine.kv.pool import build_pools

    config = KVConfig.parse(spec)
    pool = build_pools(config, 1, 2, 64, 64, max_tokens=max_tokens)[0]
    attention = choose_attention(pool)
    attention.gated = False
    layers = [PagedLayerCache(pool, sinks=config.sinks, rotation=config.rotation, attention=attention)
              for _ in lengths]
    rng = np.random.default_rng(seed)
    for layer, n in zip(layers, lengths):
        if n:
            q, k, v = _qkv(T=n, seed=int(rng.integers(1 << 30)))
            layer.attend(q, k, v, scale=0.125, window=None)
    return layers


def _layer_bits(layer):
    """Everything a layer holds, its blocks by their stored bytes."""
    pool = layer.pool
    rows = [(pool.k_row(b).tobytes(), pool.v_row(b).tobytes()) for b in layer.block_table]
    exact = [None if rows is None else (rows[0], rows[1].tobytes(), rows[2].tobytes())
             for rows in (layer._closed, layer._kept)]
    return (layer.offset, layer.n_tail, list(layer.block_table), layer.first_position, rows,
            layer.tail_k[:, : layer.n_tail].tobytes(), layer.tail_v[:, : layer.n_tail].tobytes(),
            layer.sink_k.tobytes(), layer.sink_v.tobytes(), exact, layer.keep_at)


@pytest.mark.parametrize("spec", ["k6v4,bs=16", "k4v4,rot,bs=16", "f16,bs=8,sinks=6"])
def test_staging_a_batch_of_tokens_equals_staging_each_alone_bit_for_bit(spec):
    """`PagedLayerCache.stage_tokens` (one layer of several sequences, one call) gives each
    sequence the view and the stored state its own `stage_token` gives: sinks, blocks filling at
    different steps (quantized, rotated keys) and the tails."""
    lengths = [0, 3, 13, 30]  # sink positions, and each sequence fills a block at another step
    batch, alone = _sequences_over_one_pool(spec, lengths), _sequences_over_one_pool(spec, lengths)
    for layers in (batch, alone):
        layers[2].keep_exact(14)  # its block 0's rows kept when it fills (`keep_exact`)
    rng = np.random.default_rng(1)
    for _ in range(20):
        q = rng.standard_normal((4, 4, 64)).astype(np.float32)
        k = rng.standard_normal((4, 2, 64)).astype(np.float32) * 3
        v = rng.standard_normal((4, 2, 64)).astype(np.float32)
        views, queries = PagedLayerCache.stage_tokens(batch, q, k, v)
        assert queries.shape == (4, 2, 2, 64) and queries.flags.c_contiguous
        for i, (layer, view) in enumerate(zip(alone, views)):
            own = layer.stage_token(q[i : i + 1], k[i : i + 1], v[i : i + 1])
            for name in ("query", "position", "first_position", "n_sink_old", "n_recent", "filled", "mass"):
                assert np.array_equal(getattr(view, name), getattr(own, name)), name
            assert np.shares_memory(view.query, queries[i]) and view.query.flags.c_contiguous
            assert len(view.k_rows) == len(own.k_rows) == len(layer.block_table)
            layer.commit_token(own)
        for layer, view in zip(batch, views):
            layer.commit_token(view)
        assert [_layer_bits(a) for a in batch] == [_layer_bits(b) for b in alone]
    assert batch[2]._kept is not None


@pytest.mark.parametrize("together", [True, False])
def test_a_batch_of_tokens_attends_as_each_layer_alone(together, monkeypatch):
    """`PagedLayerCache.attend_tokens` over one pool, in one compiled call or one sequence after the
    other (below TOGETHER_MIN_TOKENS): each row bit for bit its layer's own `attend`."""
    from engine.kernels import HAVE_NUMBA
    from engine.kv import paged_attention

    if not HAVE_NUMBA:
        pytest.skip("the batch path needs the compiled decode kernel")
    monkeypatch.setattr(paged_attention, "TOGETHER_MIN_TOKENS", 0 if together else 1 << 30)
    many = []
    attend_many = paged_attention.DecodeKernel.attend_many
    monkeypatch.setattr(paged_attention.DecodeKernel, "attend_many",
                        lambda self, views, **kw: many.append(len(views)) or attend_many(self, views, **kw))
    lengths = [2, 17, 40]
    batch, alone = _sequences_over_one_pool("k6v4,bs=16", lengths), _sequences_over_one_pool("k6v4,bs=16", lengths)
    rng = np.random.default_rng(2)
    for _ in range(18):
        q = rng.standard_normal((3, 4, 64)).astype(np.float32)
        k = rng.standard_normal((3, 2, 64)).astype(np.float32)
        v = rng.standard_normal((3, 2, 64)).astype(np.float32)
        out = PagedLayerCache.attend_tokens(batch, q, k, v, scale=0.125, window=None)
        for i, layer in enumerate(alone):
            assert np.array_equal(out[i], layer.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1],
                                                       scale=0.125, window=None)[0])
    assert [_layer_bits(a) for a in batch] == [_layer_bits(b) for b in alone]
    assert many == ([3] * 18 if together else [])


def test_a_batch_of_tokens_into_a_full_pool_raises_before_any_change():
    """Two of three sequences complete a block and the shared pool has one free: KVPoolFull from
    `stage_tokens` (and through `attend_tokens`) with no block allocated and no layer changed."""
    layers = _sequences_over_one_pool("k4v4,bs=8", [7, 15, 3], max_tokens=3 * 8)  # 0 + 1 + 0 blocks used
    pool = layers[0].pool
    layers[2].attend(*_qkv(T=8, seed=3), scale=0.125, window=None)  # 11 tokens: one more block
    assert pool.n_free == 1
    before = [_layer_bits(layer) for layer in layers], pool.n_free, list(pool.ref_cnt)
    q, k, v = _qkv(T=3, seed=4)
    with pytest.raises(KVPoolFull):
        PagedLayerCache.stage_tokens(layers, q, k, v)
    with pytest.raises(KVPoolFull):
        PagedLayerCache.attend_tokens(layers, q, k, v, scale=0.125, window=None)
    assert ([_layer_bits(layer) for layer in layers], pool.n_free, list(pool.ref_cnt)) == before
    pool.max_blocks += 1
    assert PagedLayerCache.attend_tokens(layers, q, k, v, scale=0.125, window=None).shape == (3, 4, 64)
    assert [layer.offset for layer in layers] == [8, 16, 12] and pool.n_free == 0


def test_cached_row_addresses_follow_every_change_of_the_block_table():
    """The row addresses a decode step reads (`PagedLayerCache.row_addresses`, cached) are the
    pool's for the table as it is, after each kind of change: blocks filled by decode and by
    prefill, trims whose freed ids another sequence takes before the table regrows to its old
    length, window releases, attach, dropped blocks and release."""
    from engine.kv.paged_attention import choose_attention
    from engine.kv.pool import build_pools

    config = KVConfig.parse("k4v4,bs=4,sinks=2")
    pool = build_pools(config, 1, 2, 64, 64)[0]
    attention = choose_attention(pool)  # one-token steps by the decode kernel's stage_token, with numba
    attention.gated = False
    layer, other = (PagedLayerCache(pool, sinks=2, attention=attention) for _ in range(2))
    # window 5: the step that fills a block also releases the oldest (the table keeps its length)
    windowed = PagedLayerCache(pool, sinks=2, window=5, attention=attention)
    rng = np.random.default_rng(4)

    def check(cache):
        cached, fresh = cache.row_addresses(), pool.row_addresses(cache.block_table)
        assert np.array_equal(cached[0], fresh[0]) and np.array_equal(cached[1], fresh[1])

    def add(cache, T):
        q, k, v = _qkv(T=T, seed=int(rng.integers(1 << 30)))
        cache.attend(q, k, v, scale=0.125, window=cache.window)
        check(cache)

    add(layer, 10)
    for _ in range(12):
        add(layer, 1)
    before = list(layer.block_table)
    layer.trim(9)
    check(layer)
    add(other, 8)  # takes the ids the trim gave back
    for _ in range(9):
        add(layer, 1)
    assert len(layer.block_table) == len(before) and layer.block_table != before
    for _ in range(20):
        add(windowed, 1)
    assert windowed.first_position > 0
    fresh = PagedLayerCache(pool, sinks=2, attention=attention)
    check(fresh)
    fresh.attach(list(other.block_table), other.sink_k, other.sink_v)
    check(fresh)
    layer.drop_blocks(np.array([1, 2]), lambda k, by: k, pool.allocate)
    check(layer)
    add(layer, 1)
    layer.release()
    check(layer)


def test_a_full_pool_is_kv_pool_full_through_the_model_and_the_engine(tmp_path):
    """The whole forward path of a tiny model with a pool budget: decoding fills the pool and the
    forward pass raises KVPoolFull (not ContextFull, not a MemoryError); `generate` ends the
    answer with the finish reason "kv_pool_full", where a context limit gives "context_full"."""
    from engine.engine import Engine
    from engine.errors import ContextFull
    from engine.sampling import SamplingParams

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", **{**TINY, "n_layers": 2})
    engine = Engine.load(path, kv="k4v4,bs=16")
    model = engine.model
    ids = ids_for(model, 64, seed=5)
    cache = model.new_cache("k4v4,bs=16", max_tokens=48)  # 3 blocks per layer, plus the tail
    prefill(model, cache, ids[:40])
    decode(model, cache, ids[40:63])  # 63 tokens: 3 blocks and a 15-token tail
    assert cache.offset == 63
    with pytest.raises(KVPoolFull) as raised:
        model.forward(ids[63:64], cache, "last")  # the 64th token needs a fourth block
    assert not isinstance(raised.value, (ContextFull, MemoryError))
    assert raised.value.kind == "kv_pool_full"
    assert cache.offset == 63 and all(p.n_used == 3 for p in cache.pools)

    greedy = SamplingParams(temperature=0)
    prompt = ids[:20].tolist()
    cache = model.new_cache("k4v4,bs=16", max_tokens=48)
    full = engine.generate(prompt, max_tokens=100, sampling=greedy, cache=cache)
    assert full.finish_reason == "kv_pool_full"
    assert cache.offset == 63 and len(prompt) + len(full.ids) == 64  # the last token found no room
    limited = model.new_cache("k4v4,bs=16", limit=48)
    assert engine.generate(prompt, max_tokens=100, sampling=greedy, cache=limited).finish_reason == "context_full"


# ---- memory of the real models -----------------------------------------------------------------------

N_REAL = 1024
REAL_PRESETS = ("full", "high-precision", "balanced", "memory-saver")


class _TeeLayer:
    """Runs the model on `main` and stores the same k/v in `others` (their outputs are not needed).

    What a cache stores does not depend on the queries, so the others only `append` the k/v (the
    same storing path `attend` uses, without the attention). Without `append`, they attend with the
    keys as queries (one per KV head), in chunks of 64 tokens, to keep the extra work small."""

    CHUNK = 64

    def __init__(self, main, others):
        self.main, self.others = main, others

    @property
    def offset(self):
        return self.main.offset

    def attend(self, q, k, v, *, scale, window):
        out = self.main.attend(q, k, v, scale=scale, window=window)
        for other in self.others:
            if hasattr(other, "append"):
                other.append(k, v)
                continue
            for s in range(0, k.shape[0], self.CHUNK):
                kc, vc = k[s : s + self.CHUNK], v[s : s + self.CHUNK]
                other.attend(kc * np.float32(0.01), kc, vc, scale=scale, window=window)  # small q: no denormals
        return out


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real_caches(request):
    from engine.tokenizer import Tokenizer

    path = request.getfixturevalue(f"{request.param}_path")
    gguf = GGUFFile(path)
    model = load_model(gguf)
    text = (TEXTS / "gpl-3.txt").read_text(encoding="utf-8")
    ids = Tokenizer.from_metadata(gguf.metadata).encode(text, add_bos=True)[:N_REAL]
    assert len(ids) == N_REAL
    caches = {preset: model.new_cache(preset) for preset in REAL_PRESETS}
    main = model.new_cache()
    tee = KVCache([_TeeLayer(main[i], [c[i] for c in caches.values()]) for i in range(model.n_layers)])
    logits = model.forward(np.asarray(ids), tee, "last")
    assert np.isfinite(logits).all()
    return request.param, model, caches


@pytest.mark.slow
def test_real_model_cache_bytes_match_the_estimate(real_caches):
    name, model, caches = real_caches
    expected_layers = {"smollm2": 30, "gemma3": 18}[name]
    assert model.n_layers == expected_layers
    windows = [model.layer_window(i) for i in range(model.n_layers)]
    if name == "gemma3":
        assert windows.count(None) == 3 and set(windows) == {512, None}
    nbytes = {}
    for preset, cache in caches.items():
        config = KVConfig.parse(preset)
        assert cache.config == config
        assert cache.offset == N_REAL
        check_accounting(model, cache, N_REAL)  # blocks per layer, and nbytes == estimate exactly
        est = estimate_bytes(config, model.n_layers, model.n_kv_heads, model.head_dim, N_REAL,
                             model.value_dim, windows=windows)
        assert cache.nbytes == pytest.approx(est["total"], rel=0.01)
        assert cache.capacity_bytes >= cache.nbytes
        nbytes[preset] = cache.nbytes
        if name == "gemma3":  # local layers keep 16 of 32 blocks (the next query sees 513..1024)
            assert [len(layer.block_table) for layer in cache.layers] == [32 if w is None else 16 for w in windows]
    assert nbytes["memory-saver"] < nbytes["balanced"] < nbytes["high-precision"] < nbytes["full"]
    assert PRESETS["balanced"] == "k6v4" and PRESETS["memory-saver"] == "k4v4"
    # float16 blocks: 2 bytes per value plus the float32 tail/sink buffers
    full = estimate_bytes(KVConfig.parse("full"), model.n_layers, model.n_kv_heads, model.head_dim, N_REAL,
                          model.value_dim, windows=windows)
    blocks = sum(len(layer.block_table) for layer in caches["full"].layers)
    per_block = 32 * model.n_kv_heads * (model.head_dim + model.value_dim) * 2
    buffers = model.n_layers * (32 + 4) * model.n_kv_heads * (model.head_dim + model.value_dim) * 4
    assert full["total"] == blocks * per_block + buffers == nbytes["full"]


def test_attention_kernels_warm_up_once_and_log(caplog, monkeypatch):
    """Engine.load compiles or loads the attention kernels once per process, and says how long it
    took (the first start on a machine compiles them)."""
    import logging

    from engine import warmup

    warmup._compile_attention_kernels.cache_clear()  # as in a new process
    with caplog.at_level(logging.INFO, logger="omlx.kernels"):
        assert warmup.warm_up_attention() > 0
    assert any("attention kernels ready in" in r.getMessage() for r in caplog.records)
    assert warmup.warm_up_attention() == 0.0
