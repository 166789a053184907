"""`omlx serve`: an OpenAI- and Anthropic-compatible HTTP server over one Engine with continuous
batching.

    app.py        the Starlette app (routes, validation, SSE), ServeConfig, run / ServerThread
    protocol.py   OpenAI request bodies checked field by field; its answers and error object (ApiError)
    anthropic.py  the Messages API: requests, answers, streamed events, error object
    scheduler.py  the engine thread: admission by KV budget, chunked prefill, batched decode
    metrics.py    counters, gauges and histograms in the Prometheus text format
"""

from .app import DEFAULT_HOST, DEFAULT_PORT, OpenAIServer, ServeConfig, ServerThread, is_loopback, run
from .scheduler import Scheduler, ServeLimits

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "OpenAIServer", "Scheduler", "ServeConfig", "ServeLimits",
           "ServerThread", "is_loopback", "run"]
