"""`omlx serve`: an OpenAI-compatible HTTP server over one Engine with continuous batching.

    app.py        the Starlette app (routes, validation, SSE), ServeConfig, run / ServerThread
    protocol.py   request bodies checked field by field; OpenAI's error object (ApiError)
    scheduler.py  the engine thread: admission by KV budget, chunked prefill, batched decode
    metrics.py    counters, gauges and histograms in the Prometheus text format
"""

from .app import DEFAULT_HOST, DEFAULT_PORT, OpenAIServer, ServeConfig, ServerThread, is_loopback, run
from .scheduler import Scheduler, ServeLimits

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "OpenAIServer", "Scheduler", "ServeConfig", "ServeLimits",
           "ServerThread", "is_loopback", "run"]
