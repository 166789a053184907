"""The transcript: a QTextBrowser showing the conversation, the assistant's answers rendered
from markdown (``QTextCursor.insertMarkdown``, GitHub dialect), the user's messages as plain text.

While an answer streams only that answer is re-rendered: the view remembers where the answer's
text starts and replaces everything after it with the new markdown on each update (the window
calls :meth:`TranscriptView.update_streaming` at most every ~50 ms).
"""

from __future__ import annotations

import html

from PySide6.QtGui import QTextBlockFormat, QTextCharFormat, QTextCursor, QTextDocument
from PySide6.QtWidgets import QTextBrowser, QWidget

USER_COLOR = "#2563eb"
ASSISTANT_COLOR = "#7c3aed"
MARKDOWN = QTextDocument.MarkdownFeature.MarkdownDialectGitHub


def markdown_to_plain(text: str) -> str:
    """What the markdown renders to, as plain text (tests, copying)."""
    doc = QTextDocument()
    doc.setMarkdown(text, MARKDOWN)
    return doc.toPlainText()


class TranscriptView(QTextBrowser):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.setAcceptDrops(False)  # files dropped here go to the window
        self.document().setDocumentMargin(12)
        self._stream_start: int | None = None
        self.messages: list[dict] = []  # what is shown: {"role", "content", "state"}
        self.placeholder = "Ask something below. Enter sends, Shift+Enter starts a new line."
        self._show_placeholder()

    # -- building -------------------------------------------------------------------------
    def _show_placeholder(self) -> None:
        self.setHtml(f"<p style='color:#888; margin-top:24px' align='center'>"
                     f"{html.escape(self.placeholder)}</p>")
        self._empty = True

    def _cursor_at_end(self) -> QTextCursor:
        if getattr(self, "_empty", False):
            self.clear()
            self._empty = False
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def _header(self, cursor: QTextCursor, role: str, note: str = "") -> None:
        if not cursor.atStart():
            cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
        block = QTextBlockFormat()
        block.setTopMargin(10 if not cursor.atStart() else 0)
        block.setBottomMargin(2)
        cursor.setBlockFormat(block)
        who, color = ("You", USER_COLOR) if role == "user" else ("Assistant", ASSISTANT_COLOR)
        extra = f" <span style='color:#999; font-weight:normal'>{html.escape(note)}</span>" if note else ""
        cursor.insertHtml(f"<span style='color:{color}; font-weight:600'>{who}</span>{extra}")
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())

    def _body(self, cursor: QTextCursor, role: str, content: str) -> None:
        cursor.setCharFormat(QTextCharFormat())
        if role == "user":
            cursor.insertText(content)
        elif content:
            cursor.insertMarkdown(content, MARKDOWN)

    def _state_note(self, cursor: QTextCursor, state: str, stopped: bool = False) -> None:
        """Under an unfinished answer: "(stopped)" if the user stopped it, else "(interrupted)"
        (a crash, a kill or the window closing cut it off)."""
        if state == "interrupted":
            fmt = QTextCharFormat()
            fmt.setForeground(self.palette().placeholderText())
            fmt.setFontItalic(True)
            cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
            cursor.insertText("(stopped)" if stopped else "(interrupted)", fmt)

    def set_messages(self, messages: list[dict]) -> None:
        """Shows a whole conversation: [{"role", "content", "state"}, optionally "stopped":
        True on an interrupted answer the user stopped] (system messages are not shown)."""
        self.clear()
        self._empty = False
        self._stream_start = None
        self.messages = []
        shown = [m for m in messages if m.get("role") in ("user", "assistant")]
        if not shown:
            self._show_placeholder()
            return
        cursor = self._cursor_at_end()
        cursor.beginEditBlock()
        for m in shown:
            self._header(cursor, m["role"])
            self._body(cursor, m["role"], m.get("content", ""))
            self._state_note(cursor, m.get("state", "complete"), bool(m.get("stopped")))
            self.messages.append(dict(m))
        cursor.endEditBlock()
        self.scroll_to_end()

    def add_message(self, role: str, content: str, state: str = "complete") -> None:
        cursor = self._cursor_at_end()
        self._header(cursor, role)
        self._body(cursor, role, content)
        self._state_note(cursor, state)
        self.messages.append({"role": role, "content": content, "state": state})
        self.scroll_to_end()

    # -- streaming ------------------------------------------------------------------------
    def begin_streaming(self) -> None:
        """Starts an assistant answer at the end (empty until the first update)."""
        cursor = self._cursor_at_end()
        self._header(cursor, "assistant", "…")
        self._stream_start = cursor.position()
        self.messages.append({"role": "assistant", "content": "", "state": "streaming"})
        self.scroll_to_end()

    def is_streaming(self) -> bool:
        return self._stream_start is not None

    def update_streaming(self, text: str) -> None:
        """Re-renders the streaming answer with all its text so far."""
        if self._stream_start is None:
            return
        bar = self.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.document())
        cursor.setPosition(self._stream_start)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.beginEditBlock()
        cursor.removeSelectedText()
        cursor.setCharFormat(QTextCharFormat())
        if text:
            cursor.insertMarkdown(text, MARKDOWN)
        cursor.endEditBlock()
        self.messages[-1]["content"] = text
        if at_end:
            self.scroll_to_end()

    def finish_streaming(self, text: str, state: str = "complete") -> None:
        """Ends the streaming answer; rebuilding its header drops the "…" note. An answer that
        ends 'interrupted' while it is shown was stopped by the user."""
        if self._stream_start is None:
            return
        self.messages[-1].update(content=text, state=state)
        if state == "interrupted":
            self.messages[-1]["stopped"] = True
        messages = self.messages
        self._stream_start = None
        bar = self.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 4
        self.set_messages(messages)
        if not at_end:
            bar.setValue(min(bar.value(), bar.maximum()))

    def scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def last_answer(self) -> str | None:
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m["content"]
        return None
