"""`omlx-desktop`: the desktop application's entry point.

Placeholder until the desktop issue lands: a window that loads the default model (fetching it
first if needed) in a worker thread and runs one-shot prompts, so the README's first command
starts something real.
"""

from __future__ import annotations

import sys
import threading

from PySide6.QtCore import QObject, QThread, Signal, Slot
from PySide6.QtWidgets import (
    QApplication, QLabel, QLineEdit, QMainWindow, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget,
)


class Worker(QObject):
    status = Signal(str)
    token = Signal(str)
    finished = Signal(str)
    error = Signal(str)

    def __init__(self, model_spec: str):
        super().__init__()
        self.model_spec = model_spec
        self.engine = None
        self.cancel = threading.Event()

    @Slot()
    def load(self) -> None:
        from engine.engine import load_engine

        try:
            self.engine = load_engine(
                self.model_spec, fetch_missing=True,
                progress=lambda stage, f: self.status.emit(f"{stage} {int(f * 100)}%"),
            )
            self.status.emit(f"{self.engine.name} ready")
        except Exception as exc:  # shown in the window; the app stays usable
            self.error.emit(str(exc))

    @Slot(str)
    def ask(self, text: str) -> None:
        if self.engine is None:
            self.error.emit("the model is not loaded yet")
            return
        try:
            e = self.engine
            ids = e.encode_chat([{"role": "user", "content": text}]) if e.has_chat_template else e.encode_prompt(text)
            gen = e.stream(ids, max_tokens=256, cancel=self.cancel)
            for chunk in gen:
                self.token.emit(chunk.text)
            s = gen.result.stats
            self.finished.emit(f"TTFT {s.ttft_s:.2f} s · {s.decode_tok_s:.1f} tok/s · KV {s.kv_bytes / 2**20:.1f} MiB")
        except Exception as exc:
            self.error.emit(str(exc))


class MainWindow(QMainWindow):
    ask = Signal(str)

    def __init__(self, model_spec: str):
        super().__init__()
        self.setWindowTitle("oMLX Desktop")
        self.setMinimumSize(640, 480)
        central = QWidget()
        layout = QVBoxLayout(central)
        self.status = QLabel("loading model…")
        self.transcript = QPlainTextEdit(readOnly=True)
        self.input = QLineEdit(placeholderText="Ask something and press Enter")
        self.send = QPushButton("Send")
        for w in (self.status, self.transcript, self.input, self.send):
            layout.addWidget(w)
        self.setCentralWidget(central)

        self.thread = QThread(self)
        self.worker = Worker(model_spec)
        self.worker.moveToThread(self.thread)
        self.thread.started.connect(self.worker.load)
        self.worker.status.connect(self.status.setText)
        self.worker.token.connect(self._append)
        self.worker.finished.connect(self.status.setText)
        self.worker.error.connect(self._show_error)  # a bound slot: queued into the UI thread
        self.ask.connect(self.worker.ask)
        self.input.returnPressed.connect(self._send)
        self.send.clicked.connect(self._send)
        self.thread.start()

    def _show_error(self, message: str) -> None:
        self.status.setText(f"error: {message}")

    def _append(self, text: str) -> None:
        cursor = self.transcript.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        cursor.insertText(text)
        self.transcript.setTextCursor(cursor)

    def _send(self) -> None:
        text = self.input.text().strip()
        if not text:
            return
        self.input.clear()
        self._append(f"\n\nYou: {text}\n\nAssistant: ")
        self.ask.emit(text)

    def closeEvent(self, event) -> None:
        self.worker.cancel.set()
        self.thread.quit()
        self.thread.wait(3000)
        super().closeEvent(event)


def main(argv: list[str] | None = None) -> int:
    from engine.catalog import DEFAULT_MODEL

    argv = sys.argv if argv is None else argv
    app = QApplication(argv)
    spec = argv[1] if len(argv) > 1 else DEFAULT_MODEL
    window = MainWindow(spec)
    window.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
