"""KV-cache quality and speed, the paged-cache issue's figures.

    .venv/bin/python benchmarks/bench_kv.py [quality] [speed] [--n-tokens 2048] [--ctx 4096]

quality: mean KL / top-1 / perplexity vs our own 16-bit KV on the first 2,048 tokens of gpl-3,
         both models, beside llama.cpp's own figures for its nearest cache types (same text).
speed:   SmolLM2 prefill of --ctx tokens and decode after it, 16-bit KV vs K4V4 (ratios).
"""

from __future__ import annotations

import argparse

import numpy as np

from engine.catalog import resolve_model
from engine.engine import Engine
from engine.evaluate import evaluate_kv

from bench_common import TEXT, prefill_and_decode, prompt_ids  # benchmarks/, the script's folder

# ../shared/reference/README.md: llama.cpp's mean KL vs its f16 KV, same text and length.
LLAMA_CPP = {
    "smollm2-135m-instruct": {"k8v8": ("q8_0/q8_0", 0.0047), "k6v4": ("q8_0/q4_0", 0.0119), "k4v4": ("q4_0/q4_0", 0.0749)},
    "gemma3-270m": {"k8v8": ("q8_0/q8_0", 0.0077), "k6v4": ("q8_0/q4_0", 0.0139), "k4v4": ("q4_0/q4_0", 0.1296)},
}
BARS = {
    "smollm2-135m-instruct": {"k8v8": 0.001, "k6v4": 0.006, "k4v4": 0.025},
    "gemma3-270m": {"k8v8": 0.002, "k6v4": 0.010, "k4v4": 0.045},
}


def quality(n_tokens: int, specs: list[str]) -> None:
    print(f"== quality: first {n_tokens:,} tokens of gpl-3, mean KL vs our 16-bit KV")
    print(f"{'model':22s} {'spec':10s} {'mean KL':>9s} {'bar':>7s} {'top-1':>7s} {'ppl':>8s} {'KV MiB':>7s}   llama.cpp nearest (KL, ours/theirs)")
    for name in LLAMA_CPP:
        engine = Engine.load(resolve_model(name, fetch_missing=True), kv="full")
        ids = engine.tokenizer.encode(TEXT.read_text(), add_bos=True)[: n_tokens + 1]
        for r in evaluate_kv(engine, ids, specs):
            peer = LLAMA_CPP[name].get(r.spec)
            bar = BARS[name].get(r.spec)
            peer_text = f"{peer[0]} {peer[1]:.4f}, {r.mean_kl / peer[1]:.2f}x" if peer else ""
            bar_text = f"{bar:.3f}" if bar else ""
            print(f"{name:22s} {r.spec:10s} {r.mean_kl:9.5f} {bar_text:>7s} {r.top1_agreement:7.2%} "
                  f"{r.perplexity:8.3f} {r.kv_bytes / 2**20:7.2f}   {peer_text}", flush=True)


def speed(ctx: int, n_decode: int, specs: list[str], rounds: int = 4) -> None:
    """Prefill once per spec, then decode in interleaved rounds (every spec once per round), so
    load from other processes hits all specs alike; medians are printed."""
    name = "smollm2-135m-instruct"
    engine = Engine.load(resolve_model(name, fetch_missing=True))
    print(f"== speed: {name}, {ctx:,}-token prompt, then {rounds} interleaved rounds of {n_decode} decoded tokens")
    prefill, decode, caches = prefill_and_decode(engine, prompt_ids(engine, ctx), specs, n_decode, rounds)
    base = specs[0]
    d0 = float(np.median(decode[base]))
    for spec in specs:
        d = float(np.median(decode[spec]))
        print(f"{spec:8s} prefill {prefill[spec]:7.1f} tok/s (time {prefill[base] / prefill[spec]:.2f}x of {base})   "
              f"decode {d:6.2f} tok/s ({d / d0:.2f}x)   KV {caches[spec].nbytes / 2**20:.1f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", default=["quality", "speed"])
    parser.add_argument("--n-tokens", type=int, default=2048)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=24)
    parser.add_argument("--specs", nargs="+", default=["k8v8", "k6v4", "k4v4", "k8v4", "k4v4,rot"])
    args = parser.parse_args()
    if "quality" in args.parts:
        quality(args.n_tokens, args.specs)
    if "speed" in args.parts:
        speed(args.ctx, args.decode, ["full", "k4v4", "k6v4", "k8v8"])


if __name__ == "__main__":
    main()
