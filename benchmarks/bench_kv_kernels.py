"""Speed of the packed-code attention kernels against numpy dequantize + matmul.

    .venv/bin/python benchmarks/bench_kv_kernels.py [--tokens 4096] [--repeat 100] [--threads 1 2]

For each KV format pair and model geometry, times one decode step's worth of attention over the
quantized blocks of one layer: scores q·k (`attention_scores`) plus Σ p·v (`weighted_values`),
against the numpy path (`fmt.dequantize` of the same blocks, then two matmuls). The kernels are
timed as one call over all blocks and as engine.kv.paged_attention calls them: one call per pool slab of 16
blocks. Each kernel time is given per numba thread count (numba.set_num_threads); with more than
one thread, kv_codes.PARALLEL_MIN_VALUES is set to --parallel-min (default: split every slab call),
since the kernels use one thread by default. Times are the
best of --repeat calls (the least disturbed by other processes on a small shared machine); the
ratio is numpy time / kernel time. The first-call time shows compilation or the cache load.
Nothing is asserted.

Environment worth noting with the result: NUMBA_NUM_THREADS, OMP_WAIT_POLICY (numba's OpenMP
threading layer spins its workers after each parallel region unless it is PASSIVE).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from engine.kv.formats import FORMATS, get_format

BLOCK = 32
SLAB = 16  # blocks per pool slab (engine.kv.pool.SLAB_BLOCKS)
GEOMETRIES = {  # name -> (Hkv, D, M = query heads per KV head x new tokens)
    "SmolLM2": (3, 64, 3),
    "Gemma3": (1, 256, 4),
}
# (label, key format, value format): the default formats of these bit widths
PAIRS = [(f"K{k}V{v}" if k < 16 else "f16", get_format(k, "k").name, get_format(v, "v").name)
         for k, v in ((4, 4), (6, 4), (8, 8), (16, 16))]


def best_time(fn, repeat: int) -> float:
    """Seconds per call of fn: the best of `repeat` calls after one warm-up call."""
    fn()
    best = np.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return float(best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="numba thread counts (default: 1 and all)")
    ap.add_argument("--parallel-min", type=int, default=32768,
                    help="kv_codes.PARALLEL_MIN_VALUES for the runs with more than one thread")
    ap.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    ap.add_argument("--pairs", nargs="+", default=[p[0] for p in PAIRS], choices=[p[0] for p in PAIRS])
    args = ap.parse_args()

    t0 = time.perf_counter()
    import numba

    from engine.kernels import kv_codes

    print(f"import kv_codes: {1e3 * (time.perf_counter() - t0):.0f} ms")
    all_threads = numba.get_num_threads()
    threads = args.threads or sorted({1, all_threads})
    print(f"numba {numba.__version__}: {all_threads} threads, layer {numba.config.THREADING_LAYER}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; "
          f"kv_codes.PARALLEL_MIN_VALUES {kv_codes.PARALLEL_MIN_VALUES} (1T), {args.parallel_min} (more)")

    rng = np.random.default_rng(0)
    for geo in args.geometries:
        Hkv, D, M = GEOMETRIES[geo]
        for n_tokens in args.tokens:
            nb = n_tokens // BLOCK
            print(f"\n{geo}: Hkv={Hkv} D={D} M={M}, {n_tokens} tokens = {nb} blocks of {BLOCK}; "
                  f"ms per scores + values call pair (numpy / kernel)")
            cols = "".join(f"{f'1 call {t}T':>15s}{f'slabs {t}T':>15s}" for t in threads)
            print(f"{'pair':6s} {'K':7s} {'V':7s} {'numpy':>8s}{cols}   first call")
            k = rng.standard_normal((nb, Hkv, BLOCK, D)).astype(np.float32)
            v = rng.standard_normal((nb, Hkv, BLOCK, D)).astype(np.float32)
            q = rng.standard_normal((Hkv, M, D)).astype(np.float32)
            p = rng.random((Hkv, M, nb * BLOCK)).astype(np.float32)
            p /= p.sum(axis=-1, keepdims=True)
            ids = rng.permutation(nb).astype(np.int64)  # scattered rows, as a real block table
            for label, kname, vname in PAIRS:
                if label not in args.pairs:
                    continue
                kf, vf = FORMATS[kname], FORMATS[vname]
                kpool, vpool = kf.quantize(k), vf.quantize(v)
                # the pools split into slabs of SLAB rows, as engine.kv.pool holds them
                kslabs = [kpool[i : i + SLAB] for i in range(0, nb, SLAB)]
                vslabs = [vpool[i : i + SLAB] for i in range(0, nb, SLAB)]
                slab_runs = []
                for s in range(len(kslabs)):
                    where = np.nonzero(ids // SLAB == s)[0]
                    cols_s = (where[:, None] * BLOCK + np.arange(BLOCK)).ravel()
                    slab_runs.append((s, ids[where] - s * SLAB, p[:, :, cols_s]))

                def kernel_one_call():
                    s = kv_codes.attention_scores(kf, kpool, ids, q, BLOCK)
                    return s, kv_codes.weighted_values(vf, vpool, ids, p, BLOCK, D)

                def kernel_slabs():
                    out = None
                    for s, rows, p_s in slab_runs:
                        kv_codes.attention_scores(kf, kslabs[s], rows, q, BLOCK)
                        part = kv_codes.weighted_values(vf, vslabs[s], rows, p_s, BLOCK, D)
                        out = part if out is None else out + part
                    return out

                def numpy_path():
                    kd = kf.dequantize(kpool[ids], Hkv, BLOCK, D).transpose(1, 0, 2, 3).reshape(Hkv, -1, D)
                    vd = vf.dequantize(vpool[ids], Hkv, BLOCK, D).transpose(1, 0, 2, 3).reshape(Hkv, -1, D)
                    return q @ kd.transpose(0, 2, 1), p @ vd

                t0 = time.perf_counter()
                try:
                    s_k, o_k = kernel_one_call()
                except ValueError as exc:
                    print(f"{label:6s} {kname:7s} {vname:7s} kernel refused: {exc}")
                    continue
                first = time.perf_counter() - t0
                s_n, o_n = numpy_path()
                err = max(float(np.max(np.abs(s_k - s_n))), float(np.max(np.abs(o_k - o_n))))
                t_np = best_time(numpy_path, args.repeat)
                line = f"{label:6s} {kname:7s} {vname:7s} {1e3 * t_np:8.3f}"
                default_min = kv_codes.PARALLEL_MIN_VALUES
                for n_threads in threads:
                    numba.set_num_threads(n_threads)
                    if n_threads > 1:
                        kv_codes.PARALLEL_MIN_VALUES = args.parallel_min
                    try:
                        t_one = best_time(kernel_one_call, args.repeat)
                        t_slabs = best_time(kernel_slabs, args.repeat)
                    finally:
                        numba.set_num_threads(all_threads)
                        kv_codes.PARALLEL_MIN_VALUES = default_min
                    line += f"{1e3 * t_one:7.3f} {t_np / t_one:5.1f}x"
                    line += f"{1e3 * t_slabs:7.3f} {t_np / t_slabs:5.1f}x"
                print(f"{line}   {1e3 * first:.0f} ms (max |diff| {err:.1e})", flush=True)


if __name__ == "__main__":
    main()
