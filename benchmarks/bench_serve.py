"""`omlx serve` under concurrent streaming clients, beside llama.cpp's server in the same run.

    .venv/bin/python benchmarks/bench_serve.py [--model smollm2-135m-instruct] [--model PATH.gguf ...]
        [--clients 1 2 4 8] [--max-tokens 64] [--rounds 2] [--llama-python /tmp/llvenv/bin/python]
        [--ctx 1024] [--document-words N [--shared-document]] [--json out.json]

For each model and each number of clients N, a fresh server process (`omlx serve`, 16-bit KV,
--max-batch 8) is started and N client threads each send `rounds` streaming chat requests one
after another (greedy; every request its own prompt, so the prefix cache saves no prefill beyond
the chat template's shared start; with --document-words, each prompt starts with its own excerpt
of a document, a long context per request; with --shared-document they all ask about one
document, read once before they start, so their prompts come from the prefix cache). Reported
per N:

    agg decode tok/s   tokens after each request's first, summed over all requests, divided by
                       the time from the first request's first token to the last request's last
    TTFT p50 / p95     request sent → first content chunk, over all requests
    speed-up           agg decode tok/s over the 1-client figure

    vs llama.cpp       omlx's agg decode tok/s over llama.cpp's server's at the same N
    failed             requests that ended in an HTTP error (left out of the figures)

llama.cpp's server (`llama_cpp.server` of llama-cpp-python, 2 threads; `--n_parallel` when its
version has it, else its requests are served one at a time: 0.3.36 has no batching, and it is
started with `--interrupt_requests False`, without which each new request cuts off the one
streaming) is measured the same way when the given interpreter can import it; it is never a
dependency. The machine is shared: figures vary from run to run, compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package is built on

ROOT = Path(__file__).resolve().parents[1]

from engine.catalog import resolve_model  # noqa: E402

from bench_common import story_prompt  # noqa: E402  (benchmarks/, the script's folder)



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"the server exited with {proc.returncode}: {err[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def start_omlx(model: Path, port: int, ctx: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "engine.cli", "-q", "serve", str(model), "--port", str(port),
                             "--kv", "full", "--ctx", str(ctx), "--max-batch", "8"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def llama_server_args(python: str) -> list[str] | None:
    """The options of those `start_llama` uses that the llama_cpp.server of `python` has, or None
    when it cannot import it."""
    # the server's own imports (uvicorn, fastapi, ...): llama_cpp.server imports without them
    probe = subprocess.run([python, "-c", "import uvicorn, llama_cpp.server.app"], capture_output=True)
    if probe.returncode != 0:
        return None
    help_text = subprocess.run([python, "-m", "llama_cpp.server", "--help"], capture_output=True, text=True).stdout
    return [option for option in ("--n_parallel", "--interrupt_requests") if option in help_text]


def start_llama(python: str, extra: list[str], model: Path, port: int, ctx: int, clients: int) -> subprocess.Popen:
    args = [python, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port), "--host", "127.0.0.1",
            "--n_threads", "2", "--n_ctx", str(ctx * max(1, clients) if "--n_parallel" in extra else ctx),
            "--verbose", "False"]
    if "--n_parallel" in extra:
        args += ["--n_parallel", str(clients)]
    if "--interrupt_requests" in extra:  # by default a new request cuts off the one streaming
        args += ["--interrupt_requests", "False"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def one_request(url: str, model_id: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model_id, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    t_first = t_last = None
    n = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            if chunk["choices"][0].get("delta", {}).get("content"):
                now = time.perf_counter()
                t_first = t_first or now
                t_last = now
                n += 1  # one content chunk per token (both servers stream token by token)
    return {"ttft": (t_first or time.perf_counter()) - t0, "t_first": t_first, "t_last": t_last, "chunks": n}


DOCUMENT = ROOT / "tests" / "data" / "texts" / "gpl-3.txt"


def document_excerpt(n_words: int, index: int) -> str:
    """n_words words of gpl-3 (repeated as needed), starting at a different place for each
    request index (so that no two requests share a prefix beyond the chat template), or at the
    start for index None (one document every request asks about)."""
    index = 0 if index is None else index + 1
    words = DOCUMENT.read_text(encoding="utf-8").split()
    start = (index * 997) % len(words)
    return " ".join((words * (2 + n_words // len(words)))[start : start + n_words])


def run_clients(url: str, model_id: str, clients: int, rounds: int, max_tokens: int,
                document_words: int = 0, shared_document: bool = False) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(rounds):
            prompt = story_prompt(c, r, rounds)
            if document_words:  # a long context of its own: a question about a document
                prompt = (document_excerpt(document_words, None if shared_document else c * rounds + r) +
                          f"\n\nRequest {c}-{r}. Explain the text above in detail.")
            try:
                res = one_request(url, model_id, prompt, max_tokens)
            except httpx.HTTPError as exc:  # counted, not fatal: the table says how many failed
                res = {"ttft": None, "t_first": None, "t_last": None, "chunks": 0, "error": f"{type(exc).__name__}: {exc}"}
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in results if r["t_first"] is not None]
    failed = [r for r in results if r.get("error")]
    if failed:
        print(f"    {len(failed)} of {len(results)} requests failed, e.g. {failed[0]['error']}", file=sys.stderr)
    if not done:
        raise RuntimeError(f"no request of {len(results)} streamed a token")
    span = max(r["t_last"] for r in done) - min(r["t_first"] for r in done)
    decoded = sum(r["chunks"] - 1 for r in done)
    ttfts = sorted(r["ttft"] for r in done)
    return {"clients": clients, "requests": len(results), "failed": len(failed), "decoded_tokens": decoded,
            "agg_decode_tok_s": decoded / span if span > 0 else 0.0,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))]}


def bench_server(name: str, start, model_id: str, clients_list, rounds, max_tokens, document_words=0,
                 shared_document=False) -> list[dict]:
    rows = []
    for clients in clients_list:
        port = free_port()
        proc = start(port, clients)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc)
            one_request(url, model_id, "Say hello.", 4)  # warm-up (kernels, first allocations)
            if shared_document:  # read once before: the requests find it in the prefix cache
                one_request(url, model_id, document_excerpt(document_words, None), 1)
            row = run_clients(url, model_id, clients, rounds, max_tokens, document_words, shared_document)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        row["server"] = name
        rows.append(row)
        print(f"  {name:10s} {clients} clients: {row['agg_decode_tok_s']:7.1f} tok/s decode, "
              f"TTFT p50 {row['ttft_p50_s']:.2f} s p95 {row['ttft_p95_s']:.2f} s", file=sys.stderr, flush=True)
    base = rows[0]["agg_decode_tok_s"] if rows and rows[0]["clients"] == 1 else None
    for row in rows:
        row["speedup"] = row["agg_decode_tok_s"] / base if base else None
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="catalog name or .gguf path (repeatable; "
                    "default smollm2-135m-instruct)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--document-words", type=int, default=0,
                    help="start every request with its own excerpt of this many words of a document "
                         "(long contexts; raise --ctx to fit)")
    ap.add_argument("--shared-document", action="store_true",
                    help="with --document-words: the same document in every request, read once before "
                         "the clients start (questions about a document already in the prefix cache)")
    ap.add_argument("--llama-python", default="/tmp/llvenv/bin/python",
                    help="an interpreter with llama-cpp-python[server] (skipped when it cannot import it)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    llama_extra = llama_server_args(args.llama_python) if Path(args.llama_python).exists() else None
    if llama_extra is None:
        print(f"llama.cpp's server: not importable with {args.llama_python}; skipped", file=sys.stderr)
    all_rows = []
    for spec in args.model or ["smollm2-135m-instruct"]:
        path = resolve_model(spec)
        print(f"{path.name}:", file=sys.stderr)
        rows = bench_server("omlx", lambda port, n: start_omlx(path, port, args.ctx), path.stem,
                            args.clients, args.rounds, args.max_tokens, args.document_words,
                            args.shared_document)
        if llama_extra is not None:
            rows += bench_server("llama.cpp", lambda port, n: start_llama(args.llama_python, llama_extra, path,
                                                                          port, args.ctx, n),
                                 path.stem, args.clients, args.rounds, args.max_tokens, args.document_words,
                            args.shared_document)
        for row in rows:
            row["model"] = path.stem
        all_rows += rows
    llama = {(r["model"], r["clients"]): r["agg_decode_tok_s"] for r in all_rows if r["server"] == "llama.cpp"}
    for r in all_rows:  # omlx over llama.cpp's server at the same number of clients, same run
        other = llama.get((r["model"], r["clients"])) if r["server"] == "omlx" else None
        r["vs_llama_cpp"] = r["agg_decode_tok_s"] / other if other else None
    print("| model | server | clients | agg decode tok/s | × 1 client | vs llama.cpp | TTFT p50 s | TTFT p95 s "
          "| failed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in all_rows:
        speedup = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        versus = f"{r['vs_llama_cpp']:.2f}" if r["vs_llama_cpp"] else "-"
        print(f"| {r['model']} | {r['server']} | {r['clients']} | {r['agg_decode_tok_s']:.1f} | {speedup} | "
              f"{versus} | {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | {r['failed']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(all_rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
