"""A stand-in for the Hugging Face Hub's endpoints on 127.0.0.1, for tests (no network here).

It answers what huggingface_hub 2.x requests:
  GET  /api/models/OWNER/REPO[/revision/REV]?blobs=True   model info: id, sha, siblings with size,
                                                          blobId and lfs {size, sha256, pointerSize}
  HEAD /OWNER/REPO/resolve/REV/FILE                        X-Repo-Commit, X-Linked-Etag, X-Linked-Size,
  GET  /OWNER/REPO/resolve/REV/FILE                        ETag, Content-Length, Accept-Ranges;
                                                          GET honours "Range: bytes=N-" with 206
An unknown repo is 404 with X-Error-Code: RepoNotFound, an unknown file 404 EntryNotFound, as the
Hub answers. Faults for tests: `drop_after[file] = n` sends n bytes of the next GET then drops the
connection (once); `corrupt` serves files with one byte flipped (the listed sha256 stays the
original's); `throttle` sleeps between 1 MiB pieces. Every request is logged in `requests`.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

PIECE = 1 << 20
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Served:
    path: Path
    size: int
    sha256: str


@dataclass
class HubStandIn:
    repos: dict[str, dict[str, Served]] = field(default_factory=dict)
    drop_after: dict[str, int] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)
    throttle: float = 0.0
    requests: list[tuple[str, str, dict]] = field(default_factory=list)

    def add(self, repo: str, name: str, path: Path) -> None:
        self.repos.setdefault(repo, {})[name] = Served(Path(path), Path(path).stat().st_size, sha256_of(path))

    def add_repo(self, repo: str) -> None:
        self.repos.setdefault(repo, {})

    def start(self) -> str:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                standin._handle(self, body=True)

            def do_HEAD(self):
                standin._handle(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def serve_for_test(self, monkeypatch, tmp_path: Path):
        """Start, and point huggingface_hub and the app at this server for one test: HF_ENDPOINT,
        an empty HF cache and models dir under tmp_path, offline mode off. A generator for a
        pytest fixture to `yield from`; stops the server after the test."""
        from engine import catalog

        url = self.start()
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(tmp_path / "models"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        try:
            yield self
        finally:
            self.stop()

    def ranges(self, name: str) -> list[str]:
        """The Range headers of the GETs for file `name`."""
        return [h.get("Range") for method, path, h in self.requests
                if method == "GET" and path.endswith("/" + name) and h.get("Range")]

    # -- answers ------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, dict(h.headers)))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._model_info("/".join(parts[2:4]), h, body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), "/".join(parts[4:]), h, body)
        self._error(h, 404, None, "not a Hub endpoint")

    def _error(self, h, status: int, code: str | None, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _model_info(self, repo: str, h, body: bool) -> None:
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        siblings = [{"rfilename": "README.md", "size": 12, "blobId": "b" * 40}]
        for name, f in sorted(self.repos[repo].items()):
            siblings.append({"rfilename": name, "size": f.size, "blobId": "a" * 40,
                             "lfs": {"size": f.size, "sha256": f.sha256, "pointerSize": 134}})
        data = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                           "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _resolve(self, repo: str, name: str, h, body: bool) -> None:
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        f = self.repos[repo].get(name)
        if f is None:
            return self._error(h, 404, "EntryNotFound", "Entry not found")
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
            start = int(rng[6:].split("-")[0])
        status = 206 if start else 200
        h.send_response(status)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("X-Linked-Etag", f'"{f.sha256}"')
        h.send_header("X-Linked-Size", str(f.size))
        h.send_header("ETag", f'"{f.sha256}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(f.size - start))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{f.size - 1}/{f.size}")
        h.end_headers()
        if not body:
            return
        drop = self.drop_after.pop(name, None)
        sent = 0
        with open(f.path, "rb") as src:
            src.seek(start)
            pos = start
            while piece := src.read(PIECE):
                if name in self.corrupt and pos <= f.size // 2 < pos + len(piece):
                    flipped = bytearray(piece)
                    flipped[f.size // 2 - pos] ^= 0xFF
                    piece = bytes(flipped)
                if drop is not None and sent + len(piece) > drop:
                    h.wfile.write(piece[: drop - sent])
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(socket.SHUT_RDWR)
                    return
                try:
                    h.wfile.write(piece)
                except (BrokenPipeError, ConnectionResetError):
                    return
                sent += len(piece)
                pos += len(piece)
                if self.throttle:
                    time.sleep(self.throttle)


def main() -> None:
    """`python tests/hub_standin.py REPO=FILE...`: serve files until killed (prints the URL)."""
    import sys

    standin = HubStandIn()
    for arg in sys.argv[1:]:
        repo, _, file = arg.partition("=")
        standin.add(repo, Path(file).name, Path(file))
    print(standin.start(), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()


def leftovers(folder: Path) -> list[Path]:
    """Files a download left in ``folder``; the cross-process lock files under ``hf/.locks/`` are
    meant to stay (deleting a lock file another process waits on would break the lock)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and ".locks" not in p.parts) \
        if folder.exists() else []
