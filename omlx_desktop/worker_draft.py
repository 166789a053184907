"""The engine worker's draft model (Chat → Draft model): the wanted one, :attr:`DraftRequests.spec`,
loaded for the loaded model and every model loaded after it (engine.speculate.load_draft, its
vocabulary checked) and set on the engine (Engine.set_draft). A draft model that cannot draft
for the loaded model (another vocabulary, a bad file) is refused and the one before it stays;
at a model load it is dropped (the window shows why). Its caches follow the loaded model's KV
setting at every answer (speculate.drafter_for). One picked while a model is loaded that does
not fit in memory beside it (engine.fit, as `omlx --draft` counts it) is asked about first
(``draftNeedsConfirmation``), unless the SetDraft is forced. Every answer while a model is loaded
carries its default context beside the draft model in use (the worker's ``max_ctx``).
"""

from __future__ import annotations

from .protocol import DraftApplied, SetDraft
from .worker_fit import does_not_fit, draft_path, fit_estimate
from .worker_host import WorkerHost, failure_of, log


class DraftRequests:
    def __init__(self, host: WorkerHost):
        self.w = host
        self.spec = ""              # wanted draft model ("": none)
        self._loaded: tuple[str, object] | None = None  # (path, Engine) of the draft model loaded last

    def set_draft(self, request: SetDraft) -> None:
        engine = self.w.engine
        if engine is None:          # applied when a model loads
            self.spec = request.spec
            self.w.draftApplied.emit(DraftApplied(self.spec))
            return
        if request.spec and not request.force:
            draft = draft_path(request.spec)
            estimate = fit_estimate(engine.path, self.w.ctx, self.w.kv_wanted or engine.kv_config, draft)
            check = does_not_fit(request.spec, engine.path, estimate, draft)
            if check is not None:   # the window asks; the draft model before it stays meanwhile
                self.w.draftNeedsConfirmation.emit(check)
                return
        try:
            draft = self._load(engine, request.spec)
        except Exception as exc:    # the draft model before it stays
            self._applied(engine, failure_of(exc, f"drafting with {request.spec} failed"))
            return
        engine.set_draft(draft)
        self.spec = request.spec
        self._applied(engine)

    def use(self, engine) -> None:
        """At a model load: the wanted draft model set on `engine`, or dropped if it cannot draft
        for it."""
        if not self.spec:
            return
        try:
            engine.set_draft(self._load(engine, self.spec))
        except Exception as exc:
            spec, self.spec = self.spec, ""
            self._applied(engine, failure_of(exc, f"drafting with {spec} failed"))
            return
        self._applied(engine)

    def _load(self, engine, spec: str):
        """The draft Engine of `spec` for `engine` (None for ""), the file loaded once."""
        from engine.catalog import resolve_model
        from engine.speculate import check_draft, load_draft

        if not spec:
            return None
        path = str(resolve_model(spec, fetch_missing=False))
        if self._loaded is not None and self._loaded[0] == path:
            check_draft(engine, self._loaded[1])
            return self._loaded[1]
        draft = load_draft(engine, path)
        self._loaded = (path, draft)
        log.info("drafting with %s", draft.name)
        return draft

    def _applied(self, engine, failure=None) -> None:
        draft = engine.draft_engine
        self.w.draftApplied.emit(DraftApplied(self.spec, "" if draft is None else draft.name, failure,
                                              self.w.max_ctx(engine)))
