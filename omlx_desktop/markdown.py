"""The transcript: a QTextBrowser showing the conversation, the assistant's answers rendered
from markdown (``QTextCursor.insertMarkdown``, GitHub dialect), the user's messages as plain text.

While an answer streams only that answer is re-rendered: the view remembers where the answer's
text starts and replaces everything after it with the new markdown on each update (the window
calls :meth:`TranscriptView.update_streaming` at most every ~50 ms).

Under an answer that was shown sections of a document (retrieval), a line lists them (line
ranges, or pages), each a link ``omlx-section:<message>:<section>``; activating one emits
``sectionRequested`` with the section (its dict as ``ask --json`` has it) instead of navigating.
"""

from __future__ import annotations

import html

from PySide6.QtCore import QUrl, Signal
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


SECTION_SCHEME = "omlx-section"


class TranscriptView(QTextBrowser):
    sectionRequested = Signal(object)   # a section dict: document, unit, start, end, label, ...

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

    def _sections_note(self, cursor: QTextCursor, message_index: int, sections: list[dict]) -> None:
        """Under an answer: the document sections it was shown, each a link to its preview."""
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
        links = ", ".join(
            f"<a href='{SECTION_SCHEME}:{message_index}:{j}'>"
            f"{html.escape(s.get('document', ''))} {html.escape(s.get('label', ''))}</a>"
            for j, s in enumerate(sections))
        cursor.insertHtml(f"<span style='color:#888; font-size:small'>Sections used: {links}</span>")
        cursor.setCharFormat(QTextCharFormat())

    def doSetSource(self, name: QUrl, type=QTextDocument.ResourceType.UnknownResource) -> None:
        if name.scheme() == SECTION_SCHEME:  # a section link: a preview, not a navigation
            try:
                i, j = (int(x) for x in name.path().split(":"))
                section = self.messages[i]["sections"][j]
            except (ValueError, IndexError, KeyError):
                return
            self.sectionRequested.emit(dict(section))
            return
        super().doSetSource(name, type)

    def section_links(self) -> list[str]:
        """The section links shown (``omlx-section:<message>:<section>``), in order."""
        return [f"{SECTION_SCHEME}:{i}:{j}" for i, m in enumerate(self.messages)
                for j in range(len(m.get("sections") or ()))]

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
            if m["role"] == "assistant" and m.get("sections"):
                self._sections_note(cursor, len(self.messages), m["sections"])
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

    def finish_streaming(self, text: str, state: str = "complete", sections: list | None = None) -> None:
        """Ends the streaming answer; rebuilding its header drops the "…" note. An answer that
        ends 'interrupted' while it is shown was stopped by the user. ``sections``: the document
        sections it was shown (listed under it)."""
        if self._stream_start is None:
            return
        self.messages[-1].update(content=text, state=state)
        if sections:
            self.messages[-1]["sections"] = list(sections)
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
