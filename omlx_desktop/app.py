"""`omlx-desktop`: the desktop application's entry point.

    omlx-desktop [MODEL_OR_PATH] [--data-dir DIR] [--max-tokens N] [--smoke-test]

MODEL_OR_PATH is a catalog name or a .gguf file (default: the last model, else the default
model, offered for download on the first run). ``--data-dir`` is where the app keeps its
database (default: ``$OMLX_DATA_DIR`` or the per-user data folder). ``--smoke-test`` shows the
window, loads the model, answers a 4-token prompt and exits 0 (1 on any error); without
``--data-dir`` it uses a temporary folder, so it leaves no conversation behind.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile

from .window import DEFAULT_MAX_TOKENS, MainWindow, app_icon

__all__ = ["main", "MainWindow", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omlx-desktop",
        description="oMLX Desktop: chat with GGUF models on the CPU, with a low-bit, prefix-reusing KV cache.")
    parser.add_argument("model", nargs="?", metavar="MODEL_OR_PATH",
                        help="a catalog name (omlx models list) or a path to a .gguf file")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="where conversations and settings are kept (default: $OMLX_DATA_DIR "
                             "or the per-user data folder)")
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help=f"the longest answer in tokens (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--smoke-test", action="store_true",
                        help="load the model, answer a 4-token prompt, exit 0 (1 on an error)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log to stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    args, qt_args = build_parser().parse_known_args(argv[1:])
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:    # the log file takes INFO (applog), stderr not
        handler.setLevel(logging.INFO if args.verbose else logging.WARNING)

    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([argv[0], *qt_args])
    app.setApplicationName("oMLX Desktop")
    app.setOrganizationName("omlx")
    app.setDesktopFileName("omlx-desktop")
    app.setWindowIcon(app_icon())

    scratch = None
    data_dir = args.data_dir
    if args.smoke_test and data_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="omlx-smoke-")
        data_dir = scratch.name
    try:
        window = MainWindow(data_dir=data_dir, model=args.model, smoke_test=args.smoke_test,
                            max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS)
    except Exception as exc:  # e.g. a database that cannot be opened
        print(f"omlx-desktop: {exc}", file=sys.stderr)
        return 1
    window.show()
    rc = app.exec()
    if window.isVisible():
        window.close()
    window.wait_for_engine()    # a model load still running after the close: let it end
    if scratch is not None:
        scratch.cleanup()
    return window.exit_code if window.exit_code is not None else rc


if __name__ == "__main__":
    sys.exit(main())
