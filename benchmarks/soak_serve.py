"""`omlx serve` held under a mixed load: N clients for M minutes, each request one of chat
(streamed or not), completions, tool calls (required), structured output (json_schema),
Anthropic messages (streamed or not), a stream the client drops after a few chunks, and an
oversized body (must get a 413, not a reset connection).

    .venv/bin/python benchmarks/soak_serve.py [--model smollm2-135m-instruct] [--clients 8]
        [--minutes 10] [--fill-minutes 0] [--max-tokens 48] [--seed 0]

Prints requests by kind, errors by kind (an "unintended" error is anything but the oversized
body's 413 and the dropped streams), TTFT p50 / p95 of the streamed requests, the server's RSS at
the start (after a warm-up round) and at the end, and KV in use (`omlx_kv_bytes_in_use`, prefix
cache included) after the warm-up and at the end, with the prefix cache's share. --fill-minutes F
runs the same load for F minutes before the baseline is taken, so that the prefix cache is at its
capacity in it (the RSS bar is about leaks, not about the cache filling); the server's RSS is
also sampled every 10 s of the measured minutes (min / max printed). Not yet: killing
and restarting the server on its cache dir, a full disk during a prefix save (issue 28, item 5).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import anthropic
import httpx2 as httpx
import openai
import psutil

from engine import catalog

KINDS = ("chat", "chat_stream", "completion", "tools", "json_schema", "anthropic", "anthropic_stream",
         "dropped_stream", "oversized")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}}}
TOPICS = ["cats", "the sea", "Paris", "trains", "music", "winter", "bread", "rivers", "chess", "bees"]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class Soak:
    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        self.an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300)
        self.model = self.oa.models.list().data[0].id
        self.lock = threading.Lock()
        self.requests, self.errors, self.cut, self.ttft = Counter(), Counter(), Counter(), []

    def one(self, kind: str, rng: random.Random) -> None:
        prompt = f"Tell me something about {rng.choice(TOPICS)} ({rng.randint(0, 10 ** 6)})."
        msgs = [{"role": "user", "content": prompt}]
        n = self.max_tokens
        t0 = time.perf_counter()
        if kind == "chat":
            self.oa.chat.completions.create(model=self.model, messages=msgs, max_tokens=n, temperature=0.7)
        elif kind in ("chat_stream", "dropped_stream"):
            stream = self.oa.chat.completions.create(model=self.model, messages=msgs, max_tokens=n, stream=True)
            for i, chunk in enumerate(stream):
                if chunk.choices and chunk.choices[0].delta.content and len(self.ttft) < 10 ** 6 and i <= 1:
                    with self.lock:
                        self.ttft.append(time.perf_counter() - t0)
                if kind == "dropped_stream" and i >= 3:
                    stream.close()
                    break
        elif kind == "completion":
            self.oa.completions.create(model=self.model, prompt=prompt, max_tokens=n)
        elif kind == "tools":
            r = self.oa.chat.completions.create(model=self.model, messages=msgs, tools=[WEATHER], tool_choice="required",
                                                max_tokens=n)
            if not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "length":
                raise RuntimeError(f"no tool call with tool_choice required ({r.choices[0].finish_reason})")
            if not r.choices[0].message.tool_calls:
                with self.lock:
                    self.cut[kind] += 1  # max_tokens reached inside the call (sampled arguments run long)
        elif kind == "json_schema":
            r = self.oa.chat.completions.create(model=self.model, messages=msgs, max_tokens=96, response_format={
                "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
            if r.choices[0].finish_reason == "stop":
                json.loads(r.choices[0].message.content)
        elif kind == "anthropic":
            self.an.messages.create(model=self.model, max_tokens=n, messages=msgs)
        elif kind == "anthropic_stream":
            with self.an.messages.stream(model=self.model, max_tokens=n, messages=msgs) as s:
                s.get_final_message()
        elif kind == "oversized":
            r = httpx.post(self.url + "/v1/chat/completions", content=b'{"model": "m", "pad": "' + b"x" * (5 << 20) + b'"}',
                           headers={"content-type": "application/json"}, timeout=120)
            if r.status_code != 413 or "bytes" not in r.json()["error"]["message"]:
                raise RuntimeError(f"oversized body: {r.status_code}")

    def client(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            kind = rng.choice(KINDS)
            try:
                self.one(kind, rng)
            except Exception as exc:  # counted by kind
                with self.lock:
                    self.errors[f"{kind}: {type(exc).__name__}: {str(exc)[:80]}"] += 1
            with self.lock:
                self.requests[kind] += 1


def run_clients(soak: Soak, clients: int, seed: int, minutes: float) -> float:
    """`clients` threads of the mixed load for `minutes`; returns the seconds they took."""
    until = time.monotonic() + 60 * minutes
    threads = [threading.Thread(target=soak.client, args=(seed + i, until)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def idle(url: str, seconds: float = 30) -> None:
    """Wait (at most `seconds`) until the server runs no sequence."""
    wait = time.monotonic() + seconds
    while metric(url, "omlx_running_sequences") and time.monotonic() < wait:
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--fill-minutes", type=float, default=0.0,
                    help="minutes of the same load before the baseline (the prefix cache fills)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = Path(args.model) if Path(args.model).exists() else catalog.model_path(args.model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cache = tempfile.mkdtemp(prefix="omlx-soak-")
    env = dict(os.environ, OMLX_CACHE_DIR=cache)
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", str(path), "--port", str(port),
                             "--max-batch", "8", "--ctx", "2048"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print(proc.stderr.read() if proc.stderr else "", file=sys.stderr)
                return 1
            time.sleep(0.2)
        server = psutil.Process(proc.pid)
        soak = Soak(url, args.max_tokens)
        for kind in KINDS:  # warm-up: every kind once, so that the baseline has compiled everything
            soak.one(kind, random.Random(args.seed))
        if args.fill_minutes > 0:
            kv_before = metric(url, "omlx_kv_bytes_in_use")
            run_clients(soak, args.clients, args.seed + 1000, args.fill_minutes)
            idle(url)
            print(f"fill: {sum(soak.requests.values())} requests in {args.fill_minutes:.1f} min, KV in use "
                  f"{kv_before / 2**20:.1f} -> {metric(url, 'omlx_kv_bytes_in_use') / 2**20:.1f} MiB "
                  f"(capacity {metric(url, 'omlx_kv_bytes_capacity') / 2**20:.1f})", flush=True)
            soak.requests.clear()
            soak.ttft.clear()
            soak.cut.clear()
        time.sleep(1)
        rss0, kv0 = server.memory_info().rss, metric(url, "omlx_kv_bytes_in_use")
        samples = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(10):
                samples.append(server.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        elapsed = run_clients(soak, args.clients, args.seed, args.minutes)
        stop.set()
        idle(url)
        rss1, kv1 = server.memory_info().rss, metric(url, "omlx_kv_bytes_in_use")
        total = sum(soak.requests.values())
        print(f"{path.name}: {args.clients} clients, {elapsed / 60:.1f} min, {total} requests")
        print("  by kind: " + ", ".join(f"{k} {soak.requests[k]}" for k in KINDS))
        if soak.cut:
            print("  cut at max_tokens before a whole call: " + ", ".join(f"{k} {n}" for k, n in soak.cut.items()))
        print(f"  errors{' (the fill included)' if args.fill_minutes > 0 else ''}: {sum(soak.errors.values())}" + "".join(f"\n    {n} x {e}" for e, n in soak.errors.most_common()))
        if soak.ttft:
            q = statistics.quantiles(soak.ttft, n=20)
            print(f"  TTFT (streams) p50 {statistics.median(soak.ttft):.2f} s, p95 {q[18]:.2f} s")
        print(f"  server RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB ({100 * (rss1 / rss0 - 1):+.1f}%)"
              + (f", sampled every 10 s: {min(samples) / 2**20:.0f} .. {max(samples) / 2**20:.0f} MiB" if samples else ""))
        print(f"  KV in use (prefix cache included) {kv0 / 2**20:.1f} -> {kv1 / 2**20:.1f} MiB")
        return 0 if not soak.errors else 2
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
