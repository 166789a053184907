"""File → Download from Hugging Face…: list a Hub repo's GGUF files with size, quant type and a fit
badge, download one with progress and Cancel, then hand the file to the window to load.

The Hub work (listing is network I/O too) runs in a daemon thread per task, never in the UI
thread and never in the engine's worker: a download may take minutes and the worker must stay free
for chatting. Results come back through :class:`_Relay`'s signals, which Qt queues to the UI
thread. Each task carries a number; a result of a task that is no longer the current one (the
user listed another repo meanwhile) is dropped. The downloading itself is
:func:`engine.hub.download` (resume, sha256 check, split sets); a cancelled download keeps its
partial file and the next Download of the same file resumes it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView, QDialog, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QProgressBar,
    QPushButton, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget,
)

from engine import fit, hub
from engine.errors import HubError

from .chart import format_bytes
from .protocol import Failure

log = logging.getLogger("omlx.desktop.hub")

HUB_HOSTS = ("huggingface.co", "www.huggingface.co", "hf.co")
COLUMNS = ("File", "Size", "Quant", "Fit", "On disk")
FIT_COLOURS = {fit.FITS: ("#dcfce7", "#166534"), fit.TIGHT: ("#fef3c7", "#92400e"),
               fit.DOES_NOT_FIT: ("#fee2e2", "#991b1b")}
ERROR_STYLE = "color: #991b1b;"
NOTE_STYLE = "color: #4b5563;"


def parse_repo_text(text: str) -> tuple[str, str | None]:
    """What the repo box holds → (OWNER/REPO, file or None). Accepts ``OWNER/REPO``,
    ``hf:OWNER/REPO[/FILE.gguf]`` and the Hub's page URLs (``https://huggingface.co/OWNER/REPO``,
    ``.../blob/REV/FILE.gguf``, ``.../resolve/REV/FILE.gguf``, ``.../tree/REV``)."""
    text = text.strip()
    if not text:
        raise HubError("type a Hugging Face repo: OWNER/REPO (for example Qwen/Qwen3-0.6B-GGUF)")
    if "://" in text:
        url = urlsplit(text)
        known = HUB_HOSTS + (urlsplit(hub.endpoint()).netloc,)
        if url.netloc.lower() not in known:
            raise HubError(f"{text} is not a Hugging Face address (https://huggingface.co/OWNER/REPO)")
        parts = [p for p in url.path.split("/") if p]
        if len(parts) >= 2 and parts[0] in ("models", "api"):
            parts = parts[1:] if parts[0] == "models" else parts
        if len(parts) >= 4 and parts[2] in ("blob", "resolve"):
            parts = parts[:2] + parts[4:]       # drop "blob/REV"
        elif len(parts) >= 3 and parts[2] == "tree":
            parts = parts[:2]
        text = "/".join(parts)
    repo, filename = hub.parse_spec(text if hub.is_hub_spec(text) else hub.HF_PREFIX + text)
    return repo, filename


@dataclass(frozen=True)
class FileRow:
    """One downloadable model of the listing, with what the disk holds of it."""

    file: hub.HubFile
    verdict: str                # fit.download_verdict of its size
    estimate_bytes: int         # what that verdict weighed against ``available``
    available: int
    downloaded: str | None      # the path of the complete file, if downloaded
    partial_bytes: int          # bytes of a cancelled or broken download the next one resumes


def _partial_bytes(f: hub.HubFile) -> int:
    folder = hub.local_path(f.repo, f).parent
    total = 0
    for part in f.parts:
        path = hub.partial_path(folder, part)
        if path.is_file():
            total += path.stat().st_size
    return total


def list_rows(repo: str) -> list[FileRow]:
    """The repo's GGUF files with their fit verdicts and local state (network: run off the UI thread)."""
    listing = hub.list_files(repo)
    available = fit.available_bytes()
    rows = []
    for f in listing.files:
        found = hub.find_downloaded(repo, f.name)
        rows.append(FileRow(f, fit.download_verdict(f.size, available), fit.download_estimate(f.size), available,
                            str(found) if found else None, 0 if found else _partial_bytes(f)))
    return rows


class _Relay(QObject):
    """Signals the task threads emit; the dialog (UI thread) receives them queued."""

    progress = Signal(int, str, float)      # task, stage, fraction
    succeeded = Signal(int, object)         # task, result
    failed = Signal(int, object)            # task, Failure


class HubDialog(QDialog):
    """Non-modal: closing it hides it, a running download goes on and still loads when done."""

    downloaded = Signal(str)                # the path of a downloaded (verified) model file
    listed = Signal(object)                 # the FileRows shown (for whoever drives the dialog)
    failed = Signal(str)                    # a message shown as an error
    cancelled = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Download from Hugging Face")
        self.setModal(False)
        self.resize(780, 460)
        self.rows: list[FileRow] = []
        self.repo: str | None = None
        self.wanted_file: str | None = None  # a file the repo box named: selected once listed
        self.task = 0                       # the number of the current task
        self.task_kind: str | None = None   # "list" / "download" while one runs
        self.cancel_event: threading.Event | None = None
        self.thread: threading.Thread | None = None     # the latest task's thread
        self.downloading: FileRow | None = None
        self.progress_seen: list[tuple[str, float]] = []
        self._relay = _Relay(self)
        self._relay.progress.connect(self._on_progress)
        self._relay.succeeded.connect(self._on_succeeded)
        self._relay.failed.connect(self._on_failed)

        self.repo_edit = QLineEdit()
        self.repo_edit.setPlaceholderText("OWNER/REPO, hf:OWNER/REPO or https://huggingface.co/OWNER/REPO")
        self.repo_edit.setClearButtonEnabled(True)
        self.list_button = QPushButton("List files")
        self.list_button.setDefault(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.setWordWrap(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for c in range(1, len(COLUMNS)):
            header.setSectionResizeMode(c, QHeaderView.ResizeMode.ResizeToContents)
        # the fit badge's column holds its widest verdict whatever the rows say
        header.setSectionResizeMode(3, QHeaderView.ResizeMode.Fixed)
        header.resizeSection(3, self.fontMetrics().horizontalAdvance(fit.DOES_NOT_FIT) + 24)
        self.fit_note = QLabel("")
        self.fit_note.setStyleSheet(NOTE_STYLE)
        self.fit_note.setWordWrap(True)
        self.fit_note.hide()
        self.progress_bar = QProgressBar()
        self.progress_bar.setRange(0, 1000)
        self.progress_bar.setTextVisible(True)
        self.progress_bar.hide()
        self.message = QLabel("Type a repo and press List files. Only .gguf files are listed.")
        self.message.setWordWrap(True)
        self.message.setStyleSheet(NOTE_STYLE)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.download_button = QPushButton("Download")
        self.cancel_button = QPushButton("Cancel download")
        self.cancel_button.hide()
        self.close_button = QPushButton("Close")

        top = QHBoxLayout()
        top.addWidget(QLabel("Repo:"))
        top.addWidget(self.repo_edit, 1)
        top.addWidget(self.list_button)
        bottom = QHBoxLayout()
        bottom.addWidget(self.progress_bar, 1)
        bottom.addStretch(0)
        bottom.addWidget(self.download_button)
        bottom.addWidget(self.cancel_button)
        bottom.addWidget(self.close_button)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.fit_note)
        layout.addWidget(self.message)
        layout.addLayout(bottom)

        self.repo_edit.returnPressed.connect(lambda: self.list_repo())
        self.list_button.clicked.connect(lambda: self.list_repo())
        self.download_button.clicked.connect(lambda: self.download_selected())
        self.cancel_button.clicked.connect(lambda: self.cancel_download())
        self.close_button.clicked.connect(self.close)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.cellDoubleClicked.connect(lambda row, _col: self.download_selected())
        self._update_buttons()

    # -- tasks ----------------------------------------------------------------------------
    def _run(self, kind: str, work, *args) -> int:
        """Runs ``work(*args, progress)`` in a daemon thread as the current task."""
        self.task += 1
        task, relay = self.task, self._relay
        self.task_kind = kind

        def progress(stage: str, fraction: float) -> None:
            relay.progress.emit(task, stage, float(fraction))

        def body() -> None:
            try:
                result = work(*args, progress)
            except Exception as exc:  # every failure becomes a message, never a dead dialog
                if not isinstance(exc, HubError):
                    log.exception("%s failed", kind)
                outcome, signal = Failure.of(exc), relay.failed
            else:
                outcome, signal = result, relay.succeeded
            try:
                signal.emit(task, outcome)
            except RuntimeError:  # the dialog is gone (the app closed meanwhile)
                pass

        self.thread = threading.Thread(target=body, name=f"omlx-hub-{kind}", daemon=True)
        self.thread.start()
        self._update_buttons()
        return task

    def busy(self) -> bool:
        return self.task_kind is not None

    # -- listing --------------------------------------------------------------------------
    def list_repo(self, text: str | None = None) -> None:
        """Lists the repo in the box (or ``text``, put into the box)."""
        if self.task_kind == "download":
            return
        if text is not None:
            self.repo_edit.setText(text)
        try:
            repo, filename = parse_repo_text(self.repo_edit.text())
        except HubError as exc:
            self._show_error(exc.user_message)
            return
        self.repo = repo
        self.wanted_file = filename
        self.rows = []
        self.table.setRowCount(0)
        self.fit_note.hide()
        self._show_note(f"Asking the Hub for {repo}…")
        self._run("list", lambda repo, _progress: list_rows(repo), repo)

    def _show_rows(self, rows: list[FileRow]) -> None:
        self.rows = rows
        self.table.setRowCount(len(rows))
        for i, row in enumerate(rows):
            f = row.file
            name = f.name + (f"  ({len(f.parts)} parts, joined on download)" if f.is_split else "")
            items = [QTableWidgetItem(name), QTableWidgetItem(format_bytes(f.size)),
                     QTableWidgetItem(f.quant), QTableWidgetItem(row.verdict),
                     QTableWidgetItem(self._disk_text(row))]
            items[0].setToolTip(f.spec)
            items[1].setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            items[1].setToolTip(f"{f.size:,} bytes")
            background, foreground = FIT_COLOURS[row.verdict]
            items[3].setBackground(QColor(background))
            items[3].setForeground(QColor(foreground))
            items[3].setTextAlignment(Qt.AlignmentFlag.AlignCenter)
            items[3].setToolTip(
                f"{row.verdict}: about {format_bytes(row.estimate_bytes)} of {format_bytes(row.available)} "
                f"available (the file, the app's runtime and room for the KV cache at a modest context; "
                f"the exact figure for your context and KV setting is checked when it loads)")
            if row.downloaded:
                items[4].setToolTip(row.downloaded)
            for c, item in enumerate(items):
                self.table.setItem(i, c, item)
        if rows:
            self.fit_note.setText(
                f"Fit: the file with room to run it, against the {format_bytes(rows[0].available)} of "
                "memory available now. A cancelled download keeps its partial file; the next Download "
                "resumes it.")
            self.fit_note.show()
        wanted = self.wanted_file
        select = next((i for i, r in enumerate(rows) if wanted and wanted in
                       (r.file.name, *(p.name for p in r.file.parts))), 0 if rows else None)
        if select is not None:
            self.table.selectRow(select)
        self._update_buttons()

    @staticmethod
    def _disk_text(row: FileRow) -> str:
        if row.downloaded:
            return "downloaded"
        if row.partial_bytes:
            return f"partial, {format_bytes(row.partial_bytes)}"
        return ""

    # -- downloading ----------------------------------------------------------------------
    def selected_row(self) -> FileRow | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        return self.rows[rows[0].row()] if rows and rows[0].row() < len(self.rows) else None

    def download_selected(self) -> None:
        """Downloads the selected file (resuming a partial one), or loads it if it is on disk."""
        row = self.selected_row()
        if row is None or self.busy():
            return
        if row.downloaded:
            self._show_note(f"{row.file.name} is already downloaded; loading it.")
            self.downloaded.emit(row.downloaded)
            return
        self.downloading = row
        self.cancel_event = threading.Event()
        self.progress_seen = []
        self.progress_bar.setValue(0)
        self.progress_bar.show()
        resume = f" (resuming at {format_bytes(row.partial_bytes)})" if row.partial_bytes else ""
        self._show_note(f"Downloading {row.file.name}{resume}…")
        cancel = self.cancel_event

        def work(spec: str, progress) -> str:
            return str(hub.download(spec, progress=progress, cancel=cancel))

        self._run("download", work, row.file.spec)

    def cancel_download(self) -> None:
        if self.task_kind == "download" and self.cancel_event is not None:
            self.cancel_event.set()
            self.cancel_button.setEnabled(False)
            self._show_note("Cancelling…")

    def shutdown(self) -> None:
        """The app is closing: a running download stops at its next chunk (its partial file stays)."""
        if self.cancel_event is not None:
            self.cancel_event.set()

    # -- results (UI thread) --------------------------------------------------------------
    def _on_progress(self, task: int, stage: str, fraction: float) -> None:
        if task != self.task or self.task_kind != "download":
            return
        self.progress_seen.append((stage, fraction))
        self.progress_bar.setValue(int(fraction * 1000))
        row = self.downloading
        done = ""
        if row is not None and stage.startswith("downloading"):
            done = f" — {format_bytes(fraction * row.file.size)} of {format_bytes(row.file.size)}"
        self.message.setText(f"{stage[:1].upper()}{stage[1:]}{done}")

    def _on_succeeded(self, task: int, result) -> None:
        if task != self.task:
            return
        kind, self.task_kind = self.task_kind, None
        if kind == "list":
            self._show_rows(result)
            n = len(result)
            self._show_note(f"{self.repo}: {n} GGUF file{'s' if n != 1 else ''}. "
                            "Select one and press Download.")
            self.listed.emit(result)
        else:
            row, self.downloading, self.cancel_event = self.downloading, None, None
            self.progress_bar.hide()
            self._mark(row, downloaded=result)
            self._show_note(f"Downloaded {row.file.name} ({format_bytes(row.file.size)}) to {result}; "
                            "loading it.")
            self.downloaded.emit(result)
        self._update_buttons()

    def _on_failed(self, task: int, failure: Failure) -> None:
        if task != self.task:
            return
        kind, self.task_kind = self.task_kind, None
        if kind == "download":
            row, cancelled = self.downloading, bool(self.cancel_event and self.cancel_event.is_set())
            self.downloading, self.cancel_event = None, None
            self.progress_bar.hide()
            partial = _partial_bytes(row.file) if row else 0
            self._mark(row, partial=partial)
            if cancelled:
                kept = (f"the {format_bytes(partial)} downloaded so far are kept" if partial
                        else "nothing was kept")
                self._show_note(f"Download of {row.file.name} cancelled: {kept}; "
                                "press Download again to resume it.")
                self.cancelled.emit()
            else:
                resume = " The partial file is kept: Download resumes it." if partial else ""
                reason = self._gui_wording(failure.message)
                self._show_error(f"Cannot download {row.file.name}: {reason}{resume}")
        else:
            self._show_error(self._gui_wording(failure.message))
        self._update_buttons()

    @staticmethod
    def _gui_wording(message: str) -> str:
        """The engine's messages name the command line's next step; here it is the Download button."""
        return (message.replace("; run the same command again to resume", "")
                .replace(", run the command again to download it afresh",
                         "; press Download to fetch it afresh")
                .replace(", run the command again", "; press Download to try again"))

    def _mark(self, row: FileRow | None, *, downloaded: str | None = None, partial: int = 0) -> None:
        if row is None or row not in self.rows:
            return
        i = self.rows.index(row)
        updated = FileRow(row.file, row.verdict, row.estimate_bytes, row.available, downloaded, partial)
        self.rows[i] = updated
        item = self.table.item(i, 4)
        item.setText(self._disk_text(updated))
        item.setToolTip(downloaded or "")
        self._update_buttons()

    # -- state ----------------------------------------------------------------------------
    def _show_note(self, text: str) -> None:
        self.message.setStyleSheet(NOTE_STYLE)
        self.message.setText(text)

    def _show_error(self, text: str) -> None:
        text = text[:1].upper() + text[1:]
        self.message.setStyleSheet(ERROR_STYLE)
        self.message.setText(text)
        self.failed.emit(text)

    def message_text(self) -> str:
        return self.message.text()

    def _update_buttons(self) -> None:
        downloading = self.task_kind == "download"
        row = self.selected_row()
        self.list_button.setEnabled(not downloading)
        self.repo_edit.setEnabled(not downloading)
        self.download_button.setEnabled(row is not None and not self.busy())
        if row is not None and row.downloaded:
            self.download_button.setText("Load")
        elif row is not None and row.partial_bytes:
            self.download_button.setText("Resume download")
        else:
            self.download_button.setText("Download")
        self.cancel_button.setVisible(downloading)
        self.cancel_button.setEnabled(downloading and not (self.cancel_event and self.cancel_event.is_set()))

