"""Small widgets of the main window: the message box, the error banner, the header's progress
bar; and where the app's resources (icon) are."""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import (
    QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QProgressBar, QToolButton, QVBoxLayout, QWidget,
)


def resource_path(name: str) -> Path:
    """A file of resources/: under sys._MEIPASS in a PyInstaller build, else in the repo."""
    base = getattr(sys, "_MEIPASS", None)
    root = Path(base) if base else Path(__file__).resolve().parent.parent
    return root / "resources" / name


def app_icon() -> QIcon:
    icon = QIcon()
    for name in ("omlx-desktop.svg", "omlx-desktop.png"):
        path = resource_path(name)
        if path.is_file():
            icon.addFile(str(path))
    return icon


def plain_text(text: str) -> str:
    """A label's rich text as plain text (non-breaking spaces as spaces)."""
    from PySide6.QtGui import QTextDocumentFragment

    if "<" in text or "&" in text:
        text = QTextDocumentFragment.fromHtml(text).toPlainText()
    return text.replace("\u00a0", " ")


class ChatInput(QPlainTextEdit):
    """The message box: Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setAcceptDrops(False)  # files dropped here go to the window
        self.setPlaceholderText("Ask something… (Enter sends, Shift+Enter for a new line)")
        self.setTabChangesFocus(True)

    def keyPressEvent(self, event) -> None:  # noqa: N802
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                event.modifiers() & (Qt.KeyboardModifier.ShiftModifier | Qt.KeyboardModifier.ControlModifier
                                     | Qt.KeyboardModifier.AltModifier)):
            self.submitted.emit()
            event.accept()
            return
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            self.insertPlainText("\n")
            event.accept()
            return
        super().keyPressEvent(event)

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(400, self.fontMetrics().lineSpacing() * 3 + 16)


class ErrorBanner(QFrame):
    """A dismissible error line at the top of the chat.

    Each message has a topic ("model", "turn", "document", "conversation"): a later success
    of the same topic clears it (:meth:`clear`), so a problem the user has solved does not stay
    on screen. A message may have details (where the traceback of an unexpected error is), shown
    under it by the Details button."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.topic: str | None = None
        self.setObjectName("errorBanner")
        self.setStyleSheet("#errorBanner { background: #fee2e2; border: 1px solid #fca5a5;"
                           " border-radius: 4px; } #errorBanner QLabel { color: #991b1b; }")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details_label = QLabel()
        self.details_label.setWordWrap(True)
        self.details_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details_label.hide()
        self.details_button = QToolButton()
        self.details_button.setText("Details")
        self.details_button.setAutoRaise(True)
        self.details_button.setCheckable(True)
        self.details_button.toggled.connect(self.details_label.setVisible)
        self.details_button.hide()
        self.close_button = QToolButton()
        self.close_button.setText("✕")
        self.close_button.setAutoRaise(True)
        self.close_button.setToolTip("Dismiss")
        text = QVBoxLayout()
        text.setContentsMargins(0, 0, 0, 0)
        text.addWidget(self.label)
        text.addWidget(self.details_label)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 4, 4, 4)
        layout.addLayout(text, 1)
        layout.addWidget(self.details_button, 0, Qt.AlignmentFlag.AlignTop)
        layout.addWidget(self.close_button, 0, Qt.AlignmentFlag.AlignTop)
        self.close_button.clicked.connect(lambda: self.clear())
        self.hide()

    def show_message(self, text: str, topic: str = "", details: str = "") -> None:
        self.topic = topic
        self.label.setText(text)
        self.details_label.setText(details)
        self.details_button.setChecked(False)
        self.details_button.setVisible(bool(details))
        self.show()

    def clear(self, topic: str | None = None) -> None:
        """Hides the message (only if it is about ``topic``, when one is given)."""
        if topic is None or topic == self.topic:
            self.topic = None
            self.hide()

    def text(self) -> str:
        return self.label.text()

    def details(self) -> str:
        return self.details_label.text()


class StageProgressBar(QProgressBar):
    """A small progress bar whose text names the stage ("loading weights 30%") and that widens
    to hold that text (a fixed narrow bar drew the text past its edge)."""

    MAX_WIDTH = 320
    PADDING = 24            # the frame and the text's margins

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setRange(0, 100)
        self.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.setMaximumWidth(self.MAX_WIDTH)
        self.setFormat("%p%")

    def set_stage(self, stage: str, fraction: float) -> None:
        self.setValue(int(fraction * 100))
        self.setFormat(f"{stage} %p%")
        needed = self.fontMetrics().horizontalAdvance(self.text()) + self.PADDING
        self.setMinimumWidth(min(needed, self.MAX_WIDTH))
        if needed > self.MAX_WIDTH:     # a very long stage name: shorten it, not the bar
            elided = self.fontMetrics().elidedText(stage, Qt.TextElideMode.ElideRight,
                                                   self.MAX_WIDTH - self.PADDING
                                                   - self.fontMetrics().horizontalAdvance(" 100%"))
            self.setFormat(f"{elided} %p%")
