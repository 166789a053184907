"""Takes docs/screenshot.png: the desktop app on the default model, an earlier conversation in
the list, a pinned document (the first 60 lines of the Apache License 2.0) and two questions
about it answered (streamed, the second reusing the cached prefix), the live memory chart running.

    QT_QPA_PLATFORM=offscreen .venv/bin/python tools/screenshot.py [--out docs/screenshot.png]
                                                                         [--size 1440x900]

Runs under the current display (QT_QPA_PLATFORM=offscreen when there is none; the window is
captured with QWidget.grab, which works offscreen too). Conversations go to a temporary data
folder; the model must be fetched (``omlx models fetch smollm2-135m-instruct``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

WARMUP = "What is the capital of France?"            # an earlier conversation in the list
QUESTIONS = (("What is this document?", 40),       # (question, max tokens): the second one
             ("Summarize the definitions in three bullet points.", 90))  # answers with a list


def wait_until(app, condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"screenshot: timed out waiting for {what}")
        app.processEvents()
        time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshot.png"))
    parser.add_argument("--size", default="1440x900", help="window size WxH")
    args = parser.parse_args()

    from PySide6.QtWidgets import QApplication

    from engine import catalog
    from omlx_desktop.window import MainWindow, app_icon

    if not catalog.is_fetched(catalog.DEFAULT_MODEL):
        raise SystemExit(f"fetch the model first: omlx models fetch {catalog.DEFAULT_MODEL}")
    app = QApplication([sys.argv[0]])
    app.setApplicationName("oMLX Desktop")
    app.setDesktopFileName("omlx-desktop")
    app.setWindowIcon(app_icon())
    width, height = (int(x) for x in args.size.lower().split("x"))

    with tempfile.TemporaryDirectory(prefix="omlx-screenshot-") as tmp:
        os.environ.setdefault("OMLX_CACHE_DIR", str(Path(tmp) / "cache"))
        doc = Path(tmp) / "apache-2.0.txt"
        lines = (ROOT / "tests" / "data" / "texts" / "apache-2.0.txt").read_text().splitlines()[:60]
        doc.write_text("\n".join(lines).strip("\n") + "\n")

        window = MainWindow(data_dir=Path(tmp) / "data", model=catalog.DEFAULT_MODEL)
        window.resize(width, height)
        window.show()
        wait_until(app, lambda: window.model_info is not None, 120, "the model")
        window.kv_panel.advanced_button.setChecked(False)
        answers = []
        window.answerFinished.connect(answers.append)

        def ask(text: str, max_tokens: int) -> None:
            n = len(answers)
            window.max_tokens_spin.setValue(max_tokens)
            window.input.setPlainText(text)
            window.send_message()
            wait_until(app, lambda: len(answers) > n, 600, f"the answer to {text!r}")

        ask(WARMUP, 12)
        window.new_conversation()
        keys = window.add_documents([str(doc)])
        wait_until(app, lambda: keys[0] in window.docs.doc_ids, 300, "the document")
        for question, max_tokens in QUESTIONS:
            ask(question, max_tokens)
        # a few more chart samples after the answer, then the picture
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.02)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if not window.grab().save(str(out)):
            raise SystemExit(f"screenshot: cannot write {out}")
        print(f"wrote {out} ({width}x{height}); last answer: {answers[-1]['text']!r}")
        print(window.stats_label.text())
        window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
