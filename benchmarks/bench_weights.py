"""Dense float32 weights vs quantized weights (fused kernels): speed and memory, same run.

    .venv/bin/python benchmarks/bench_weights.py [--models NAME ...] [--context 512] [--decode 32]
                                                  [--rounds 3]
    .venv/bin/python benchmarks/bench_weights.py --kernels [--mib 64] [--rounds 5]
    .venv/bin/python benchmarks/bench_weights.py --products [--rounds 5]

For each model and backend (OMLX_WEIGHTS=dense / quant) a fresh worker process loads the engine
(kv="full", llama.cpp's figures are with its f16 cache), prefills `context` tokens, then decodes
`decode` tokens one at a time. Rounds alternate the backends (dense, quant, dense, quant, ...) so
that load from other processes on this shared 2-core machine hits both alike; the table gives the
median over rounds and quant/dense ratios. RSS is the worker's resident memory (psutil) right after
loading the model and after the run (quantized weights are file pages of the memory map, resident
once read). Decode time is also split into the linear layers (matvecs, incl. the output
projection) and the rest (attention, norms, sampling), and the average CPU use of other processes
during the run is printed (this machine is shared; their load changes the figures a lot).

--kernels instead times the quantized-weight kernels per GGUF type on one (rows, 4096) matrix of
about `mib` MiB of blocks each (random codes, scales ~0.01): one row of x through
`engine.weights.QuantLinear`, the call a model's decode step makes (the integer kernels,
`engine.kernels.int_matvec.IntMatvec`, where this CPU and the type have them, the "kernels"
column says int; else the float ones, `quant_matvec.Matvec`), in a process on one kernel thread
(OMLX_KERNEL_THREADS=1) and in one sharing the rows with the pool (OMLX_KERNEL_THREADS, default
the CPUs), as GB/s of blocks read; and the prefill tile dequantizer over GGUF-order blocks
(`quant_matvec.dequantize_rows`, one thread) as G values/s. Types interleaved per round, medians
over rounds.

--products instead times the two layouts of the prefill product of one float32 tile W (out, in)
with x (rows, in) (`engine.weights._product`): y = x @ W.T (direct) and y = (W @ x.T).T
(transposed, the result copied back), for the matrix shapes of SmolLM2 135M, Gemma3 270M and a
1B Llama, over numbers of rows. It prints the direct time and the transposed/direct ratio (the two
interleaved, min over rounds) and which layout `weights.TRANSPOSED_PRODUCT_MAX_ROWS` picks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench_common import prompt_ids  # benchmarks/, the script's folder

ROOT = Path(__file__).resolve().parents[1]
# (model, context) → (prefill tok/s, decode tok/s) of llama.cpp, f16 KV, recorded on this machine.
LLAMA_CPP_RECORDED = {
    ("smollm2-135m-instruct", 512): (266.0, 113.0),
}


def worker(model: str, context: int, n_decode: int) -> dict:
    import psutil

    from engine.catalog import resolve_model
    from engine.engine import Engine

    from engine import weights

    linear_s = [0.0]  # time spent in the linear layers (both backends), to split decode time

    def timed(call):
        def wrapper(self, x, *rest):  # QuantLinear's xw: x's quantized activations
            t0 = time.perf_counter()
            y = call(self, x, *rest)
            linear_s[0] += time.perf_counter() - t0
            return y
        return wrapper

    for cls in (weights.DenseLinear, weights.QuantLinear):
        cls.__call__ = timed(cls.__call__)

    proc = psutil.Process()
    path = resolve_model(model, fetch_missing=True)
    t0 = time.perf_counter()
    engine = Engine.load(path, kv="full")
    load_s = time.perf_counter() - t0
    rss_load = proc.memory_info().rss
    ids = prompt_ids(engine, context)
    cache = engine.new_cache()
    t0 = time.perf_counter()
    logits = engine.prefill(ids, cache)
    prefill = context / (time.perf_counter() - t0)
    token = int(np.argmax(logits))
    steps = []
    linear_s[0] = 0.0
    for _ in range(n_decode):
        t0 = time.perf_counter()
        token = int(np.argmax(engine.model.forward([token], cache, "last")[0]))
        steps.append(time.perf_counter() - t0)
    decode_linear_ms = 1e3 * linear_s[0] / n_decode
    return {
        "load_s": load_s,
        "rss_load": rss_load,
        "rss_run": proc.memory_info().rss,
        "prefill": prefill,
        "decode": n_decode / sum(steps),
        "decode_median_step": 1.0 / float(np.median(steps)),
        "decode_ms": 1e3 * sum(steps) / n_decode,
        "decode_linear_ms": decode_linear_ms,
        "weights": engine.model.token_embd.__class__.__name__,
    }


def _busy_seconds() -> float | None:
    """CPU seconds all processes spent busy so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def run_worker(model: str, backend: str, context: int, n_decode: int) -> dict:
    env = {**os.environ, "OMLX_WEIGHTS": backend}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", model, "--context", str(context), "--decode", str(n_decode)],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# types timed by --kernels, and the byte offsets of the float16 scale fields in one block of each
KERNEL_TYPES = {
    "F16": (), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}
KERNEL_COLS, KERNEL_TILE_ROWS = 4096, 256


def kernel_worker(mib: int, rounds: int) -> dict:
    """The --kernels figures of this process (its OMLX_KERNEL_THREADS): per type, the seconds of
    one row of x through QuantLinear (the model's call: the integer kernels where this CPU and the
    type have them, else the float ones) and of dequantizing the matrix in tiles, every round."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as QT

    from engine.kernels import int_dot
    from engine.kernels import quant_matvec as qm
    from engine.kernels.pool import kernel_threads
    from engine.weights import QuantLinear

    cols, tile_rows = KERNEL_COLS, KERNEL_TILE_ROWS
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    cases = {}
    for name, scale_offsets in KERNEL_TYPES.items():
        qtype = QT[name]
        block, size = GGML_QUANT_SIZES[qtype]
        row_bytes = cols // block * size
        rows = max(tile_rows, (mib << 20) // row_bytes // 16 * 16)
        raw = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
        if qtype == QT.F16:
            raw[:] = rng.normal(0, 0.02, (rows, cols)).astype(np.float16).view(np.uint8)
        blocks = raw.reshape(rows, -1, size)
        for off in scale_offsets:
            blocks[..., off : off + 2] = np.array([0.01], np.float16).view(np.uint8)
        linear = QuantLinear(raw, qtype, rows, cols)  # the integer kernels repack a copy
        linear(x)  # compiled or loaded from numba's cache, and the pool started, before timing
        qm.dequantize_rows(qtype, raw, np.arange(tile_rows), np.empty((tile_rows, cols), np.float32))
        cases[name] = (qtype, raw, linear)
    tile = np.empty((tile_rows, cols), np.float32)
    ids = np.arange(tile_rows)
    times = {name: {"matvec": [], "tile": []} for name in cases}
    for _ in range(rounds):
        for name, (qtype, raw, linear) in cases.items():
            t0 = time.perf_counter()
            linear(x)
            times[name]["matvec"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for start in range(0, raw.shape[0] - tile_rows + 1, tile_rows):
                qm.dequantize_rows(qtype, raw, ids + start, tile)
            times[name]["tile"].append(time.perf_counter() - t0)
    return {"threads": kernel_threads(), "kernels": int_dot.describe(int_dot.kernel_isa()),
            "types": {name: {"arith": linear.arith, "bytes": raw.nbytes, "rows": raw.shape[0], **times[name]}
                      for name, (_, raw, linear) in cases.items()}}


def run_kernel_worker(mib: int, rounds: int, threads: int | None) -> dict:
    """kernel_worker in a fresh process with OMLX_KERNEL_THREADS=threads (None: as this one has
    it): the matvec thread pool is made once per process with its thread count."""
    env = dict(os.environ)
    if threads is not None:
        env["OMLX_KERNEL_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, __file__, "--kernel-worker", "--mib", str(mib), "--rounds", str(rounds)],
                         env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the --kernels worker failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def kernel_table(mib: int, rounds: int) -> None:
    """Prints the --kernels table: one process on one kernel thread, then one with the pool."""
    one = run_kernel_worker(mib, rounds, 1)
    pool = run_kernel_worker(mib, rounds, None)
    cols, tile_rows = KERNEL_COLS, KERNEL_TILE_ROWS
    print(f"QuantLinear, one row of x, (rows, {cols}) matrices of ~{mib} MiB of blocks, median of {rounds} "
          f"rounds; {pool['threads']} kernel threads in the pool; {pool['kernels']} where the type has them")
    print(f"{'type':7s} {'kernels':7s} {'B/value':>7s} {'matvec 1 thread GB/s':>20s} {'matvec pool GB/s':>16s} "
          f"{'tile dequantize Gvalues/s':>25s}")
    for name, p in pool["types"].items():
        o = one["types"][name]
        n_tiled = p["rows"] // tile_rows * tile_rows
        print(f"{name:7s} {p['arith']:7s} {p['bytes'] / p['rows'] / cols:7.4f} "
              f"{o['bytes'] / float(np.median(o['matvec'])) / 1e9:20.2f} "
              f"{p['bytes'] / float(np.median(p['matvec'])) / 1e9:16.2f} "
              f"{n_tiled * cols / float(np.median(p['tile'])) / 1e9:25.2f}", flush=True)


# (out, in) of the matrices: SmolLM2 135M (K/V, Q/O, gate/up, down), Gemma3 270M (K/V, Q, O,
# gate/up, down), a 1B Llama (K/V, Q/O, gate/up, down)
PRODUCT_SHAPES = [(192, 576), (576, 576), (1536, 576), (576, 1536),
                  (256, 640), (1024, 640), (640, 1024), (2048, 640), (640, 2048),
                  (512, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]
PRODUCT_ROWS = [12, 16, 32, 46, 64, 96, 128, 256, 512]


def product_table(rounds: int) -> None:
    from engine import weights

    rng = np.random.default_rng(0)

    def direct(x, w):
        return x @ w.T

    def transposed(x, w):
        return np.ascontiguousarray((w @ x.T).T)

    def best_of(f, x, w, reps):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            f(x, w)
            best = min(best, time.perf_counter() - t0)
        return best

    limit = weights.TRANSPOSED_PRODUCT_MAX_ROWS
    print(f"x (rows, in) @ W.T, W (out, in) float32: direct ms and transposed/direct, min of {rounds} "
          f"interleaved rounds; * = the layout weights._product takes (transposed up to {limit} rows)")
    print(f"{'out':>5s} {'in':>5s} " + " ".join(f"{m:>14d}" for m in PRODUCT_ROWS))
    for out, inn in PRODUCT_SHAPES:
        w = rng.standard_normal((out, inn)).astype(np.float32)
        cells = []
        for m in PRODUCT_ROWS:
            x = rng.standard_normal((m, inn)).astype(np.float32)
            reps = max(3, min(50, int(0.05 / max(1e-5, best_of(direct, x, w, 1)))))
            t = {direct: float("inf"), transposed: float("inf")}
            for _ in range(rounds):
                for f in t:
                    t[f] = min(t[f], best_of(f, x, w, reps))
            ratio = t[transposed] / t[direct]
            cells.append(f"{t[direct] * 1e3:7.3f} {ratio:4.2f}{'*' if m <= limit else ' '}")
        print(f"{out:5d} {inn:5d} " + " ".join(f"{c:>14s}" for c in cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens prefilled")
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded after the prompt")
    parser.add_argument("--rounds", type=int, default=3, help="runs per backend, interleaved")
    parser.add_argument("--kernels", action="store_true", help="time the kernels per tensor type instead")
    parser.add_argument("--mib", type=int, default=64, help="MiB of blocks per matrix (--kernels)")
    parser.add_argument("--products", action="store_true",
                        help="time the two layouts of the prefill product per matrix shape instead")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--kernel-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.kernel_worker:
        print(json.dumps(kernel_worker(args.mib, args.rounds)))
        return

    if args.kernels:
        kernel_table(args.mib, args.rounds)
        return
    if args.products:
        product_table(args.rounds)
        return

    if args.worker:
        print(json.dumps(worker(args.worker, args.context, args.decode)))
        return

    print(f"context {args.context} tokens, {args.decode} decoded; median of {args.rounds} interleaved runs "
          f"per backend ({os.cpu_count()} CPUs; NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'default')}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')})")
    header = (f"{'model':24s} {'weights':7s} {'prefill tok/s':>13s} {'decode tok/s':>12s} "
              f"{'RSS load MB':>11s} {'RSS run MB':>10s} {'load s':>6s}")
    print(header)
    busy0, t0, ours0 = _busy_seconds(), time.time(), sum(os.times()[:4])
    for model in args.models:
        runs: dict[str, list[dict]] = {"dense": [], "quant": []}
        for _ in range(args.rounds):
            for backend in ("dense", "quant"):
                runs[backend].append(run_worker(model, backend, args.context, args.decode))
        keys = ("prefill", "decode", "rss_load", "rss_run", "load_s", "decode_ms", "decode_linear_ms")
        med = {b: {k: float(np.median([r[k] for r in rs])) for k in keys} for b, rs in runs.items()}
        for b in ("dense", "quant"):
            m = med[b]
            print(f"{model:24s} {b:7s} {m['prefill']:13.1f} {m['decode']:12.1f} {m['rss_load'] / 2**20:11.0f} "
                  f"{m['rss_run'] / 2**20:10.0f} {m['load_s']:6.2f}")
        d, q = med["dense"], med["quant"]
        line = (f"{model:24s} quant/dense: prefill {q['prefill'] / d['prefill']:.2f}x, decode "
                f"{q['decode'] / d['decode']:.2f}x, RSS after load {q['rss_load'] / d['rss_load']:.2f}x, "
                f"after run {q['rss_run'] / d['rss_run']:.2f}x")
        ref = LLAMA_CPP_RECORDED.get((model, args.context))
        if ref:
            line += f"; vs llama.cpp (recorded): prefill {q['prefill'] / ref[0]:.2f}x, decode {q['decode'] / ref[1]:.2f}x"
        print(line, flush=True)
        print(f"{'':24s} decode tok/s per run: dense {[round(r['decode'], 1) for r in runs['dense']]}, "
              f"quant {[round(r['decode'], 1) for r in runs['quant']]}")
        print(f"{'':24s} decode ms/token in linear layers / rest: " + ", ".join(
            f"{b} {m['decode_linear_ms']:.1f} / {m['decode_ms'] - m['decode_linear_ms']:.1f}" for b, m in med.items()),
            flush=True)
    busy1 = _busy_seconds()
    if busy0 is not None and busy1 is not None:  # this machine is shared: say how busy it was
        other = (busy1 - busy0 - (sum(os.times()[:4]) - ours0)) / (time.time() - t0)
        print(f"other processes used {max(0.0, other):.2f} CPUs on average during the run")


if __name__ == "__main__":
    main()
