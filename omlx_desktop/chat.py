"""A chat turn of the main window: send (or regenerate), stream the answer into the transcript
and the Store, stop, and finish with the stats.

Streaming: the worker coalesces text into one signal per ~50 ms; the transcript re-renders the
answer on each, and the new text reaches the Store every 250 ms (``flush``). The answer's
message is created in state 'streaming' and finished 'complete' (with the stats) or
'interrupted' (stopped: with the stats, whose finish_reason is "cancelled"; failed with some
text, or the window closed: without).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtGui import QGuiApplication

from .chart import format_bytes
from .protocol import SendMessage, TurnFailed, TurnFinished
from .store import NotFound
from .window_surface import WindowSurface
from .worker import StopEvent

STORE_FLUSH_MS = 250            # streamed text reaches the Store ~4 times a second


@dataclass
class Turn:
    """An answer being generated."""

    id: int
    conv: int
    message_id: int
    cancel: threading.Event
    started: float
    regenerate: bool = False
    text: str = ""
    unsaved: str = ""
    updates: int = 0
    stop_requested: float | None = None
    first_text_at: float | None = None


def stats_text(stats: dict) -> str:
    """The stats bar under the transcript (wrapping only between the parts)."""
    prompt = stats.get("prompt_tokens", 0)
    cached = stats.get("cached_tokens", 0)
    source = stats.get("cache_source", "none")
    if stats.get("kv_spec") == "remote":   # the server's KV and memory are not seen from here
        parts = [f"TTFT {stats.get('ttft_s', 0):.2f} s (with the network)",
                 f"{stats.get('decode_tok_s', 0):.1f} tok/s",
                 f"{stats.get('generated_tokens', 0)} tokens",
                 f"server cache: {cached:,} of {prompt:,} prompt tokens reused"]
        if stats.get("finish_reason") == "length":
            parts.append("max tokens reached")
        elif stats.get("finish_reason") == "cancelled":
            parts.append("stopped")
        return "  ·  ".join(p.replace(" ", "\u00a0") for p in parts)
    parts = [
        f"TTFT {stats.get('ttft_s', 0):.2f} s",
        f"{stats.get('decode_tok_s', 0):.1f} tok/s"
        + (" (fast arithmetic)" if stats.get("arith") == "fast" else ""),
        f"{stats.get('generated_tokens', 0)} tokens",
        f"cache: {cached:,} of {prompt:,} prompt tokens reused" + (f" ({source})" if cached else ""),
        f"dropped {stats.get('dropped_tokens', 0):,}",
        f"KV {format_bytes(stats.get('kv_bytes', 0))}"
        + (f" ({stats['kv_spec'].upper()})" if stats.get("kv_spec") else ""),
        f"peak RSS {format_bytes(stats.get('peak_rss_bytes', 0))}",
    ]
    if stats.get("drafted_tokens"):  # prompt lookup drafted: how much of it the model kept
        parts.insert(2, f"drafted {stats['drafted_tokens']}, accepted {stats.get('accepted_tokens', 0)}")
    reason = stats.get("finish_reason")
    if reason == "cancelled":
        parts.append("stopped")
    elif reason == "context_full":
        parts.append("context full")
    elif reason == "kv_pool_full":
        parts.append("KV memory full")
    elif reason == "length":
        parts.append("max tokens reached")
    return "  ·  ".join(p.replace(" ", "\u00a0") for p in parts)


class ChatController(QObject):
    # {"conv", "message_id", "text", "state" ('complete' | 'interrupted' | 'failed'), "stats",
    #  "updates"; on failure "kind" and "error"}
    answerFinished = Signal(object)

    def __init__(self, window: WindowSurface):
        super().__init__(window)
        self.w = window
        self.turn: Turn | None = None
        self.last_stats: dict | None = None
        self._request_ids = itertools.count(1)
        self._flush_timer = QTimer(self)
        self._flush_timer.setInterval(STORE_FLUSH_MS)
        self._flush_timer.timeout.connect(self.flush)

    # -- starting -------------------------------------------------------------------------
    def send(self, text: str | None = None, *, max_tokens: int | None = None) -> bool:
        """Sends the input's text (or ``text``); False if nothing was sent."""
        w = self.w
        from_input = text is None
        text = (w.input.toPlainText() if from_input else text).strip()
        if not text:
            return False
        if not w.models.ready:
            w.statusBar().showMessage("No model is loaded yet" if w.models.model_info is None
                                      else "Wait for the model to load", 5000)
            return False
        if self.turn is not None:
            w.statusBar().showMessage("Wait for the answer, or press Esc to stop it", 5000)
            return False
        if w.conversations.conv_id is None:
            w.conversations.new()
        conv_id = w.conversations.conv_id
        if from_input:
            w.input.clear()
        w.store.add_message(conv_id, "user", text)
        w.conversations.title_from_first_message(conv_id, text)
        w.transcript.add_message("user", text)
        self._start(conv_id, text, regenerate=False, max_tokens=max_tokens)
        return True

    def regenerate(self) -> bool:
        """Answers the last user message again (its previous answer is deleted)."""
        w = self.w
        conv_id = w.conversations.conv_id
        if w.models.model_info is None or self.turn is not None or conv_id is None:
            return False
        messages = w.store.messages(conv_id)
        last_user = next((m for m in reversed(messages) if m.role == "user"), None)
        if last_user is None:
            return False
        w.store.delete_messages_after(conv_id, last_user.position)
        w.conversations.show_messages(conv_id)
        self._start(conv_id, last_user.content, regenerate=True, max_tokens=None)
        return True

    def _start(self, conv_id: int, text: str, *, regenerate: bool, max_tokens: int | None) -> None:
        w = self.w
        message = w.store.add_message(conv_id, "assistant", "", state="streaming")
        w.transcript.begin_streaming()
        turn = Turn(next(self._request_ids), conv_id, message.id, StopEvent(), time.monotonic(),
                    regenerate=regenerate)
        self.turn = turn
        self._flush_timer.start()
        w.statusBar().showMessage("Generating…")
        w.update_buttons()
        w.request(SendMessage(turn.id, conv_id, text, int(max_tokens or w.max_tokens_spin.value()),
                              turn.cancel, regenerate))

    # -- stopping -------------------------------------------------------------------------
    def stop(self) -> None:
        """Esc / Stop: the worker stops at the next token (it checks the Event between tokens)."""
        if self.turn is not None and not self.turn.cancel.is_set():
            self.turn.cancel.set()
            self.turn.stop_requested = time.monotonic()
            self.w.statusBar().showMessage("Stopping…")
            self.w.stop_button.setEnabled(False)

    def stop_if_in(self, conv_id: int) -> None:
        if self.turn is not None and self.turn.conv == conv_id:
            self.stop()

    def stop_unless_in(self, conv_id: int) -> None:
        if self.turn is not None and self.turn.conv != conv_id:
            self.stop()

    def abandon(self) -> None:
        """The window closes: the answer so far is kept, marked interrupted."""
        turn = self.turn
        self._flush_timer.stop()
        if turn is None:
            return
        turn.cancel.set()
        self.flush()
        try:
            self.w.store.finish_message(turn.message_id, "interrupted")
        except NotFound:
            pass
        self.turn = None

    # -- streaming ------------------------------------------------------------------------
    def on_prefill_progress(self, rid: int, done: int, total: int) -> None:
        if self.w.closed:
            return
        if self.turn is None or self.turn.id != rid:
            return
        if total > 64 and done < total:
            self.w.statusBar().showMessage(f"Reading the prompt… {done:,} / {total:,} tokens")

    def on_tokens(self, rid: int, text: str) -> None:
        if self.w.closed:
            return
        turn = self.turn
        if turn is None or turn.id != rid:
            return
        if turn.first_text_at is None:
            turn.first_text_at = time.monotonic()
            self.w.statusBar().showMessage("Generating…")
        turn.text += text
        turn.unsaved += text
        turn.updates += 1
        if turn.conv == self.w.conversations.conv_id:
            self.w.transcript.update_streaming(turn.text)

    def flush(self) -> None:
        turn = self.turn
        if turn is None:
            self._flush_timer.stop()
            return
        if turn.unsaved:
            try:
                self.w.store.append_to_message(turn.message_id, turn.unsaved)
            except NotFound:  # its conversation was deleted meanwhile
                pass
            turn.unsaved = ""

    def _end(self, rid: int) -> Turn | None:
        """The running turn `rid`, ended (its text flushed to the Store); None when it is not the
        running turn or the window is closing (its results no longer go anywhere)."""
        turn = self.turn
        if self.w.closed or turn is None or turn.id != rid:
            return None
        self.flush()
        self.turn = None
        self._flush_timer.stop()
        return turn

    # -- results --------------------------------------------------------------------------
    def on_finished(self, result: TurnFinished) -> None:
        w = self.w
        turn = self._end(result.id)
        if turn is None:
            return
        text, stats = result.text, dict(result.stats)
        state = "interrupted" if result.finish_reason == "cancelled" else "complete"
        if turn.stop_requested is not None:
            stats["stop_latency_s"] = time.monotonic() - turn.stop_requested
        try:
            if w.store.message(turn.message_id).content != text:
                w.store.edit_message(turn.message_id, text)
            w.store.finish_message(turn.message_id, state, stats)
        except NotFound:
            pass
        if turn.conv == w.conversations.conv_id:
            w.transcript.finish_streaming(text, state, stats.get("retrieved"))
            self.last_stats = stats
            w.stats_label.setText(stats_text(stats))
        w.clear_error("turn")
        done = "Stopped" if state == "interrupted" else "Done"
        w.statusBar().showMessage(f"{done}: {stats.get('generated_tokens', 0)} tokens", 5000)
        w.update_buttons()
        self.answerFinished.emit({"conv": turn.conv, "message_id": turn.message_id, "text": text,
                                  "state": state, "stats": stats, "updates": turn.updates})

    def on_failed(self, result: TurnFailed) -> None:
        w = self.w
        turn = self._end(result.id)
        if turn is None:
            return
        try:
            msg = w.store.message(turn.message_id)
            if msg.content:
                w.store.finish_message(turn.message_id, "interrupted")
            else:
                w.store.delete_messages_after(turn.conv, msg.position - 1)
        except NotFound:
            pass
        w.conversations.show_messages(turn.conv)
        failure = result.failure
        w.show_error(f"The answer failed: {failure.message}", "turn", failure)
        w.update_buttons()
        self.answerFinished.emit({"conv": turn.conv, "message_id": turn.message_id, "text": turn.text,
                                  "state": "failed", "kind": failure.kind, "error": failure.message,
                                  "stats": None, "updates": turn.updates})

    def show_last_stats(self, messages) -> None:
        """The stats bar for a conversation just opened: its last answer's stats."""
        last = next((m for m in reversed(messages) if m.role == "assistant" and m.stats), None)
        self.last_stats = last.stats if last else None
        self.w.stats_label.setText(stats_text(last.stats) if last else "")

    def copy_last_answer(self) -> str | None:
        w = self.w
        text = w.transcript.last_answer()
        conv_id = w.conversations.conv_id
        if text is None and conv_id is not None:
            text = next((m.content for m in reversed(w.store.messages(conv_id))
                         if m.role == "assistant"), None)
        if text is None:
            return None
        QGuiApplication.clipboard().setText(text)
        w.statusBar().showMessage("Copied the last answer", 3000)
        return text
