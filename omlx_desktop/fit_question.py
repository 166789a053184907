"""The question the window asks when the worker's fit check says a model does not fit
(a FitCheck): before loading a model (with the chosen draft model counted) and before drafting
with a draft model picked while a model is loaded. No is the default; the user may go on.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QMessageBox, QWidget

from .protocol import FitCheck


def estimate_detail(summary: str) -> str:
    """FitEstimate.summary() without its leading verdict: "needs about … available (…)"."""
    return summary.split(": ", 1)[-1]


def what_does_not_fit(check: FitCheck) -> str:
    """The model's file name, and the draft model's when it was counted."""
    name = Path(check.path).name
    return f"{name} with the draft model {Path(check.draft).name}" if check.draft else name


def fit_question(parent: QWidget, check: FitCheck, *, drafting: bool = False) -> QMessageBox:
    """Go on (Yes: "Load anyway", or "Draft anyway" when ``drafting``: the draft model was just
    picked) or not (No, the default)."""
    box = QMessageBox(QMessageBox.Icon.Warning, "Model does not fit in memory",
                      f"{what_does_not_fit(check)} probably does not fit in this computer's memory.",
                      parent=parent)
    pair = bool(check.draft)
    smaller = ("A smaller context or a lower-bit KV setting (KV cache panel), a smaller quant of the "
               "model" + (", or no draft model (Chat → Draft model)" if pair else "") + ", needs less.")
    question = "Draft with it anyway?" if drafting else "Load it anyway?"
    detail = estimate_detail(check.summary)
    box.setInformativeText(
        f"{'Together they ' + detail.replace('needs', 'need', 1) if pair else 'It ' + detail}.\n\n"
        f"{'Drafting' if drafting else 'Loading it'} anyway may make the computer swap heavily or the "
        f"app be stopped by the system. {smaller}\n\n{question}")
    box.setStandardButtons(QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No)
    box.setDefaultButton(QMessageBox.StandardButton.No)
    box.button(QMessageBox.StandardButton.Yes).setText("Draft anyway" if drafting else "Load anyway")
    box.button(QMessageBox.StandardButton.No).setText("Don't draft" if drafting else "Don't load")
    return box
