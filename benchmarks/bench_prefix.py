"""Prefix reuse and the context limit, the prefix issue's figures.

    .venv/bin/python benchmarks/bench_prefix.py [ask] [overflow] [rolling] [--kv k6v4]

ask:      SmolLM2, gpl-3 pinned (~7.6K tokens), six questions in turn: TTFT of question 1 (cold,
          pays for reading the document) vs questions 2-6 (ratio), cached share; then a fresh
          process (`omlx ask`) answers its first question from the prefix saved on disk.
overflow: SmolLM2, --ctx 2048, a 1,000-token pinned document, 20 question/answer rounds that
          overflow several times: dropped tokens, decode tok/s of the last round vs the first.
rolling:  perplexity of the first 6,000 gpl-3 tokens with a 1,024-token context under `rolling`
          (sinks kept) vs an 8,192-token context, beside dropping the oldest tokens without
          sinks (window only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "texts" / "gpl-3.txt"
QUESTIONS = [
    "What is the purpose of this license?",
    "Can I charge money for distributing copies?",
    "What must I provide when I convey object code?",
    "What happens if I violate the license?",
    "Does the license grant patent rights?",
    "How should I apply these terms to a new program?",
]


def _engine(kv: str):
    from engine.catalog import resolve_model
    from engine.engine import Engine

    return Engine.load(resolve_model("smollm2-135m-instruct", fetch_missing=True), kv=kv)


def ask(kv: str, max_tokens: int) -> None:
    from engine.session import Session

    print(f"== ask: SmolLM2, gpl-3 pinned, {len(QUESTIONS)} questions, kv {kv}")
    engine = _engine(kv)
    session = Session(engine)
    doc = session.add_document(TEXT, prefill=False)
    rows = []
    for q in QUESTIONS:
        r = session.ask(q, max_tokens=max_tokens).result
        s = r.stats
        rows.append(s)
        print(f"  TTFT {s.ttft_s:7.2f} s  cached {s.cached_tokens:5d}/{s.prompt_tokens:5d} ({s.cache_source:6s})  "
              f"decode {s.decode_tok_s:5.1f} tok/s  {q}")
    cold = rows[0].ttft_s
    later = float(np.mean([s.ttft_s for s in rows[1:]]))
    share = min(s.cached_tokens for s in rows[1:]) / doc.n_tokens
    print(f"document {doc.n_tokens:,} tokens; questions 2-6 mean TTFT {later:.2f} s = {later / cold:.1%} of "
          f"question 1 ({cold:.1f} s; bar 5%); least cached share {share:.1%} of the document (bar 99%)")
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "-q", "ask", "smollm2-135m-instruct", "--doc", str(TEXT),
         "--question", QUESTIONS[0], "--max-tokens", str(max_tokens), "--json", "--kv", kv],
        capture_output=True, text=True, env=os.environ.copy(), cwd=ROOT,
    )
    if out.returncode != 0:
        print("fresh process failed:", out.stderr)
        return
    s = json.loads(out.stdout)["answers"][0]["stats"]
    print(f"fresh process: TTFT {s['ttft_s']:.2f} s = {s['ttft_s'] / cold:.1%} of a cold one (bar 10%), "
          f"{s['cached_tokens']:,} tokens from {s['cache_source']}")


def overflow(kv: str, rounds: int = 20) -> None:
    from engine.session import Session

    print(f"== overflow: SmolLM2, ctx 2048, 1,000-token pinned document, {rounds} rounds, rolling, kv {kv}")
    engine = _engine(kv)
    ids = engine.tokenizer.encode(TEXT.read_text(), add_bos=False)
    doc = engine.tokenizer.decode(ids[:1000])
    filler = engine.tokenizer.decode(ids[3000:3080]).replace("\n", " ")
    session = Session(engine, ctx=2048, overflow="rolling")
    session.add_document(text=doc, name="gpl-3 (first 1,000 tokens)")
    speeds, dropped = [], 0
    for i in range(rounds):
        r = session.send(f"Round {i}: what does this passage say? {filler}", max_tokens=48).result
        s = r.stats
        speeds.append(s.decode_tok_s)
        dropped += s.dropped_tokens
        print(f"  round {i + 1:2d}: prompt {s.prompt_tokens:5d} cached {s.cached_tokens:5d} dropped {s.dropped_tokens:4d} "
              f"context {session._live.offset:4d}  decode {s.decode_tok_s:5.1f} tok/s")
    print(f"dropped {dropped:,} tokens in all; last round decode {speeds[-1]:.1f} tok/s = "
          f"{speeds[-1] / speeds[0]:.2f}x the first (bar: within 20%)")


def rolling(kv: str, n_tokens: int = 6000) -> None:
    from engine.kv.config import parse_kv

    print(f"== rolling: perplexity of the first {n_tokens:,} gpl-3 tokens, kv {kv}")
    engine = _engine(kv)
    ids = engine.tokenizer.encode(TEXT.read_text(), add_bos=True)[: n_tokens + 1]
    results = {}
    for label, ctx, sinks in (("8,192 context", 8192, True), ("1,024 rolling (sinks)", 1024, True),
                              ("1,024 window only", 1024, False)):
        config = parse_kv(kv if sinks else f"{kv},sinks=0")
        cache = engine.model.new_cache(config, limit=ctx, overflow="rolling")
        if not sinks:
            cache.keep_sink_blocks = 0
        t0 = time.perf_counter()
        tf = engine.teacher_forced(ids, cache=cache)
        ppl = float(np.exp(-np.mean(tf.next_logprob)))
        results[label] = ppl
        print(f"  {label:24s} perplexity {ppl:9.3f}  dropped {cache.dropped_tokens:6,d}  ({time.perf_counter() - t0:.0f} s)")
    base = results["8,192 context"]
    print(f"rolling/full = {results['1,024 rolling (sinks)'] / base:.3f}x (bar 1.5x); "
          f"window-only/full = {results['1,024 window only'] / base:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", nargs="*", default=["ask", "overflow", "rolling"])
    ap.add_argument("--kv", default="k6v4")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("OMLX_CACHE_DIR", tempfile.mkdtemp(prefix="omlx-bench-"))  # cold start
    if "ask" in args.parts:
        ask(args.kv, args.max_tokens)
    if "overflow" in args.parts:
        overflow(args.kv)
    if "rolling" in args.parts:
        rolling(args.kv)


if __name__ == "__main__":
    main()
