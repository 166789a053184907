"""`omlx serve` as a real process for tests: started on a free port, waited for until /health
answers, stopped with Ctrl-C (SIGINT) as a user stops it (or killed: `kill`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package is built on

ROOT = Path(__file__).resolve().parents[1]


class ServeProcess:
    """`with ServeProcess(model, *args) as server:` → server.url while it runs; after the block,
    server.returncode and server.stderr. Kernels compile in the background as on a user's first
    start (a cold numba cache on a loaded machine takes minutes to compile everything first)."""

    def __init__(self, model: Path, *args: str, timeout: float = 300.0, env: dict | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "engine.cli", "serve", str(model), "--port", str(self.port), *args]
        self.timeout = timeout
        self.extra_env = env or {}  # e.g. OMLX_CACHE_DIR
        self.returncode: int | None = None
        self.stderr = ""

    def __enter__(self) -> "ServeProcess":
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMLX_KERNEL_WARMUP="background", **self.extra_env)
        self.proc = subprocess.Popen(self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(self.proc.communicate()[1])
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise AssertionError("omlx serve did not start")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.returncode is not None:  # killed
            return
        self.proc.send_signal(signal.SIGINT)
        _, self.stderr = self.proc.communicate(timeout=60)
        self.returncode = self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer ends it: no shutdown code runs."""
        os.kill(self.proc.pid, signal.SIGKILL)
        _, self.stderr = self.proc.communicate(timeout=60)
        self.returncode = self.proc.returncode
