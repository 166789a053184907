"""Chat → Draft model: the draft-model picker beside prompt lookup. A small model of the loaded
model's vocabulary drafts each answer's next tokens and the loaded model verifies them in one
pass (engine.speculate; greedy answers are the same token for token, the stats line counts
drafted and accepted tokens).

The choice is kept in the Store ("draft_model": a catalog name or a .gguf path, "" for none),
sent to the worker at start and on every change. The worker answers with what is in use
(DraftApplied); the menu shows that, and a refused model (another vocabulary, a bad file) puts
its reason in the error banner while the draft model before it goes on drafting. One that does
not fit in memory beside the loaded model (the worker's fit check) is asked about first
(:meth:`DraftMenu.ask_draft_anyway`): drafting with it anyway, or keeping the one before it.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction, QActionGroup
from PySide6.QtWidgets import QFileDialog, QMenu, QMessageBox

from .fit_question import fit_question, what_does_not_fit
from .protocol import DraftApplied, FitCheck, SetDraft
from .window_surface import WindowSurface

SETTING = "draft_model"


class DraftMenu(QObject):
    applied = Signal(object)            # the DraftApplied the menu now shows

    def __init__(self, window: WindowSurface, chat_menu: QMenu):
        super().__init__(window)
        self.w = window
        self.spec = window.store.get_setting(SETTING, "") or ""   # the draft model in use (or wanted)
        self.menu = chat_menu.addMenu("Draft &model")
        self.menu.aboutToShow.connect(self.rebuild)
        self.rebuild()

    def start(self) -> None:
        """The kept choice to the worker (before the model loads: applied when it has)."""
        if self.spec:
            self.w.request(SetDraft(self.spec))

    def choices(self) -> list[tuple[str, str]]:
        """(spec, label): none, the catalog's fetched models, and the one in use if it is a file."""
        from engine import catalog

        out = [("", "None")]
        out += [(name, name) for name in catalog.CATALOG if catalog.is_fetched(name)]
        if self.spec and all(spec != self.spec for spec, _ in out):
            out.append((self.spec, Path(self.spec).name))
        return out

    def rebuild(self) -> None:
        self.menu.clear()
        group = QActionGroup(self.menu)
        for spec, label in self.choices():
            action = QAction(label, self.menu, checkable=True, checked=spec == self.spec)
            action.triggered.connect(lambda _=False, s=spec: self.choose(s))
            group.addAction(action)
            self.menu.addAction(action)
        self.menu.addSeparator()
        self.menu.addAction("Other GGUF file…").triggered.connect(self.choose_file)

    def checked(self) -> str:
        """The label of the entry the menu shows as in use."""
        return next(a.text() for a in self.menu.actions() if a.isChecked())

    def choose(self, spec: str) -> None:
        self.w.request(SetDraft(spec))
        self.rebuild()                  # the entry in use stays checked until the worker answers

    def choose_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.w, "Draft with a GGUF model", "", "GGUF models (*.gguf)")
        if path:
            self.choose(path)

    def on_needs_confirmation(self, check: FitCheck) -> None:
        """The picked draft model and the loaded model do not fit together: ask; draft anyway
        (the SetDraft again, forced) or keep the draft model in use."""
        if self.w.closed:
            return
        if self.ask_draft_anyway(check):
            self.w.request(SetDraft(check.spec, force=True))
            return
        self.w.statusBar().showMessage(f"Not drafting: {what_does_not_fit(check)} does not fit in memory",
                                       10_000)
        self.rebuild()

    def ask_draft_anyway(self, check: FitCheck) -> bool:
        """Asks whether to draft with a draft model that does not fit (tests replace this method)."""
        return fit_question(self.w, check, drafting=True).exec() == QMessageBox.StandardButton.Yes

    def on_applied(self, applied: DraftApplied) -> None:
        if applied.failure is not None:
            self.w.show_error(f"Cannot draft with that model: {applied.failure.message}", "settings",
                              applied.failure)
        self.spec = applied.spec
        self.w.store.set_setting(SETTING, applied.spec)
        self.rebuild()
        self.applied.emit(applied)
