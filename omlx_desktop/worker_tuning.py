"""The engine worker's requests for the KV panel's tuning: the Auto preset's sensitivity profile
(engine.kvtune) and the weight arithmetic (the wanted one, :attr:`TuningRequests.arith`, applied
to the loaded model and every model loaded after it; fast's cost against exact measured). The
measurements stop when their request's cancel or the window's abort is set.
"""

from __future__ import annotations

import logging
import threading
import time

from .protocol import ArithApplied, ArithCost, Failure, KVProfileReady, MeasureArithCost, MeasureKVProfile, SetArith
from .worker_host import WorkerHost, failure_of

log = logging.getLogger("omlx.desktop.worker")


class _Cancelled(Exception):
    """Raised from a progress callback to stop an engine call that takes no cancel Event."""


class _EitherEvent:
    """Set when either of two Events is (a request's cancel, the window's abort)."""

    def __init__(self, a: threading.Event, b: threading.Event):
        self.a, self.b = a, b

    def is_set(self) -> bool:
        return self.a.is_set() or self.b.is_set()


class TuningRequests:
    def __init__(self, host: WorkerHost):
        self.w = host
        self.arith = "exact"        # wanted weight arithmetic (SetArith)

    # -- KV sensitivity (Auto preset) -----------------------------------------------------
    def measure_kv_profile(self, request: MeasureKVProfile) -> None:
        """The loaded model's KV sensitivity profile: from the store (per model file sha256), or
        measured with progress."""
        from engine import kvtune
        from engine.errors import EngineError

        w = self.w
        t0 = time.perf_counter()
        try:
            if w.engine is None:
                raise EngineError("no local model is loaded: load one before measuring its KV sensitivity")
            cancel = _EitherEvent(request.cancel, w.abort)
            kwargs = {"n_tokens": request.n_tokens} if request.n_tokens else {}
            profile, from_store = kvtune.default_profile(
                w.engine, progress=lambda s, f: w.kvProfileProgress.emit(s, float(f)), cancel=cancel,
                **kwargs)
        except Exception as exc:
            w.kvProfileFailed.emit(failure_of(exc, "KV sensitivity profile failed"))
            return
        w.kvProfileReady.emit(KVProfileReady(str(w.engine.path), profile, from_store,
                                             time.perf_counter() - t0))

    # -- weight arithmetic ----------------------------------------------------------------
    def use_arith(self, engine) -> str:
        """Switches ``engine`` to the wanted arithmetic; returns why it cannot ('' when it runs it,
        or when exact is wanted of a model that has only float: nothing the user can change)."""
        from engine.errors import SettingsError

        if engine.arith == self.arith or (engine.arith == "float" and self.arith == "exact"):
            return ""
        try:
            engine.set_arith(self.arith)
        except SettingsError as exc:
            log.info("%s arithmetic refused for %s: %s", self.arith, engine.name, exc.user_message)
            return exc.user_message
        return ""

    def set_arith(self, request: SetArith) -> None:
        """The wanted arithmetic, applied at once to the loaded model (a setting error is reported,
        the model keeps the arithmetic it had) and to every model loaded later. Pinned documents
        are read again in it, as after a KV format switch: KV blocks depend on the arithmetic."""
        from engine.errors import SettingsError
        from engine.weights import check_arith

        w = self.w
        self.arith = check_arith(request.mode)
        e = w.engine
        if e is None:
            w.arithApplied.emit(ArithApplied(""))
            return
        before = e.arith
        error = self.use_arith(e)
        failure = Failure(SettingsError.kind, error) if error else None
        w.arithApplied.emit(ArithApplied(e.arith, failure))
        if e.arith != before and w.session is not None and any(d.pinned for d in w.session.documents):
            w.prepare_pinned(w.conv)

    def measure_arith_cost(self, request: MeasureArithCost) -> None:
        """The fast arithmetic's mean KL against exact on the loaded model, over the start of the
        shipped calibration text; a cancel stops it between its two passes."""
        from engine import kvtune
        from engine.errors import EngineError
        from engine.evaluate import evaluate_kv

        w = self.w
        cancel = _EitherEvent(request.cancel, w.abort)

        def check(_stage: str, _fraction: float) -> None:
            if cancel.is_set():
                raise _Cancelled

        t0 = time.perf_counter()
        try:
            e = w.engine
            if e is None:
                raise EngineError("no local model is loaded: load one before measuring its arithmetic")
            check("", 0.0)
            tokens = kvtune.default_calibration_tokens(e, request.n_tokens)
            quality = evaluate_kv(e, tokens, ["full"], progress=check, arith="fast")[0]
        except _Cancelled:
            w.arithCostFailed.emit(Failure("cancelled", "the measurement was cancelled"))
            return
        except Exception as exc:
            w.arithCostFailed.emit(failure_of(exc, "measuring the fast arithmetic failed"))
            return
        w.arithCostReady.emit(ArithCost(e.model_id, float(quality.mean_kl), float(quality.top1_agreement),
                                        len(tokens) - 1, time.perf_counter() - t0))
