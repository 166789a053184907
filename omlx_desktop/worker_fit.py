"""The engine worker's memory check before a load and before a draft model is chosen: engine.fit's
estimate (with the chosen draft model counted as `omlx --draft` counts it) and the FitCheck the
window asks the user with when it does not fit; and the default context, the draft model counted
the same way.
"""

from __future__ import annotations

from engine.fit import DOES_NOT_FIT

from .protocol import FitCheck
from .worker_host import log


def fit_estimate(path, ctx: int | None, kv, draft=None):
    """engine.fit's estimate for ``path`` at context ``ctx`` and KVConfig ``kv`` (None: the default
    preset), with the draft model at the path ``draft`` if given; None if the estimate itself
    fails (the load then reports what is wrong with the file)."""
    from engine import fit
    from engine.errors import SettingsError

    try:
        try:
            return fit.estimate_file(path, ctx, kv, draft=draft)
        except SettingsError:  # a KV setting for another model's layers: the default's estimate
            return fit.estimate_file(path, ctx, None, draft=draft)
    except Exception as exc:
        log.info("no memory estimate for %s%s: %s", path, f" with {draft}" if draft else "", exc)
        return None


def default_context(gguf, kv, draft=None) -> int:
    """engine.fit's default context for the open GGUFFile ``gguf`` at KVConfig ``kv`` (None: the
    default preset; one for another model's layers: the default's), beside the draft model at the
    path ``draft`` if given. A draft model that cannot be read is not counted: drafting with it
    says why."""
    from engine.errors import ModelError
    from engine.gguf_file import GGUFFile

    if draft is None:
        return _default_context(gguf, kv, None)
    try:
        draft_gguf = GGUFFile(draft)
        try:
            return _default_context(gguf, kv, draft_gguf)
        finally:
            draft_gguf.close()
    except ModelError as exc:
        log.info("the default context without the draft model %s: %s", draft, exc)
        return _default_context(gguf, kv, None)


def _default_context(gguf, kv, draft_gguf) -> int:
    from engine import fit
    from engine.errors import SettingsError

    try:
        return fit.default_context(gguf, kv, draft=draft_gguf)
    except SettingsError as exc:  # a setting for another model's layers: the default's estimate
        log.info("no context estimate at %s: %s", kv, exc)
        return fit.default_context(gguf, None, draft=draft_gguf)


def draft_path(spec: str) -> str | None:
    """The file of the draft model ``spec`` ("" or one that cannot be found: None; choosing
    it says why)."""
    from engine.catalog import resolve_model

    if not spec:
        return None
    try:
        return str(resolve_model(spec, fetch_missing=False))
    except Exception as exc:
        log.info("no file for the draft model %s: %s", spec, exc)
        return None


def does_not_fit(spec: str, path, estimate, draft=None) -> FitCheck | None:
    """The FitCheck to ask with when ``estimate`` (of the model at ``path``, with the draft model
    at ``draft``) does not fit; ``spec`` is the request's, to send again with ``force``. None when
    it fits or there is no estimate."""
    if estimate is None or estimate.verdict != DOES_NOT_FIT:
        return None
    log.info("%s%s does not fit: %s", path, f" with the draft model {draft}" if draft else "",
             estimate.summary())
    return FitCheck(spec, str(path), estimate.verdict, estimate.summary(), estimate.total_bytes,
                    estimate.available_bytes, str(draft) if draft else "")


