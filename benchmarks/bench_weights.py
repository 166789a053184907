"""Dense float32 weights vs quantized weights (fused kernels): speed and memory, same run.

    .venv/bin/python benchmarks/bench_weights.py [--models NAME ...] [--context 512] [--decode 32]
                                                  [--rounds 3]

For each model and backend (OMLX_WEIGHTS=dense / quant) a fresh worker process loads the engine
(kv="full", llama.cpp's figures are with its f16 cache), prefills `context` tokens, then decodes
`decode` tokens one at a time. Rounds alternate the backends (dense, quant, dense, quant, ...) so
that load from other processes on this shared 2-core machine hits both alike; the table gives the
median over rounds and quant/dense ratios. RSS is the worker's resident memory (psutil) right after
loading the model and after the run (quantized weights are file pages of the memory map, resident
once read). Decode time is also split into the linear layers (matvecs, incl. the output
projection) and the rest (attention, norms, sampling), and the average CPU use of other processes
during the run is printed (this machine is shared; their load changes the figures a lot).
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
        def wrapper(self, x):
            t0 = time.perf_counter()
            y = call(self, x)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens prefilled")
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded after the prompt")
    parser.add_argument("--rounds", type=int, default=3, help="runs per backend, interleaved")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

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
