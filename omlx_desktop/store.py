"""What the desktop app keeps between runs: conversations, their messages and documents, and
settings, in one SQLite file.

The file is ``omlx.db`` in the per-user data folder (``~/.local/share/omlx-desktop`` on Linux),
in ``$OMLX_DATA_DIR`` if that is set, or at the path given to :class:`Store`.

Decisions:

* **Documents belong to a conversation.** A conversation's prompt prefix is its system prompt
  followed by its *pinned* documents in the order they were added (``id`` order), so pinning is
  per conversation and so is ``n_tokens`` (it depends on the conversation's model; the app sets
  it after tokenizing and clears it with :meth:`Store.set_document_tokens` when the model
  changes). Deleting a conversation deletes its documents and messages (foreign keys, cascade).
  The same text added twice to one conversation is stored once (``sha256`` of the text).
  A plain-text file too large to hold (engine.documents.DocumentFile) is stored with an empty
  ``text``, its ``path`` and the file's ``sha256``: it is read again from the file.
* **Streaming answers are written as they arrive.** :meth:`Store.add_message` with
  ``state="streaming"``, then :meth:`Store.append_to_message` every ~0.25 s (one small
  transaction each), then :meth:`Store.finish_message`. A process killed mid-answer leaves the
  message in ``'streaming'``; :meth:`Store.recover_interrupted`, called once at start, marks
  such messages ``'interrupted'`` and keeps the text they had.
* **Durability:** WAL journal with ``synchronous=NORMAL``: a commit survives the process being
  killed at any point (the WAL is in the OS's page cache); only a power loss can lose the last
  commits, never corrupt the file.
* **Threads:** the UI thread owns the Store and its one connection. Other threads (the engine's
  worker) must not call it: they send their tokens to the UI thread by Qt signals, and the UI
  thread appends them. :mod:`sqlite3` enforces this (``check_same_thread``): a call from another
  thread raises :class:`sqlite3.ProgrammingError`.
* **Schema versions:** ``schema_version`` holds one row. :data:`MIGRATIONS` maps each version to
  the function that brings a database from the previous version to it; opening a database runs
  the missing ones in order, each in its own transaction. A database from a newer app is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

APP_NAME = "omlx-desktop"
DATA_DIR_ENV = "OMLX_DATA_DIR"
DB_FILENAME = "omlx.db"

MESSAGE_STATES = ("complete", "streaming", "interrupted")
ROLES = ("system", "user", "assistant")
BUSY_TIMEOUT_S = 5.0
_UNCHANGED: Any = object()


class StoreError(Exception):
    """The database cannot be opened or used; the message names the file."""


class NotFound(StoreError, KeyError):
    """No conversation, message or document with that id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float          # seconds since the epoch
    updated: float          # last change to it or its messages
    model: str | None       # catalog name or .gguf path
    kv_spec: str | None     # KV spec string (engine/kv/config.py); None: the app's default
    system_prompt: str | None  # None: the app's default system prompt


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    position: int           # 0, 1, 2 ... within the conversation
    role: str               # 'system' | 'user' | 'assistant'
    content: str
    state: str              # 'complete' | 'streaming' | 'interrupted'
    stats: dict | None      # generation stats (engine's stats as a dict), assistant messages
    created: float


@dataclass(frozen=True)
class Document:
    id: int
    conversation_id: int
    name: str
    path: str | None        # where it was read from, if from a file
    text: str
    n_tokens: int | None    # tokens under the conversation's model; None: not counted yet
    pinned: bool            # part of the conversation's prompt prefix
    added: float
    sha256: str             # of the UTF-8 text


def default_db_path() -> Path:
    """``$OMLX_DATA_DIR/omlx.db`` if the variable is set, else ``omlx.db`` in the per-user data
    folder."""
    override = os.environ.get(DATA_DIR_ENV)
    base = Path(override).expanduser() if override else Path(platformdirs.user_data_dir(APP_NAME))
    return base / DB_FILENAME


# --- schema ---------------------------------------------------------------------------------

def _execute_script(db: sqlite3.Connection, script: str) -> None:
    """Runs ``;``-separated statements inside the caller's transaction (``executescript`` would
    commit first). The statements must not contain ``;`` inside literals."""
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _migrate_to_1(db: sqlite3.Connection) -> None:
    _execute_script(db, """
        CREATE TABLE conversations (
            id            INTEGER PRIMARY KEY,
            title         TEXT    NOT NULL,
            created       REAL    NOT NULL,
            updated       REAL    NOT NULL,
            model         TEXT,
            kv_spec       TEXT,
            system_prompt TEXT
        );
        CREATE INDEX conversations_updated ON conversations(updated);

        CREATE TABLE messages (
            id              INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            position        INTEGER NOT NULL,
            role            TEXT    NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content         TEXT    NOT NULL DEFAULT '',
            state           TEXT    NOT NULL DEFAULT 'complete'
                                    CHECK (state IN ('complete', 'streaming', 'interrupted')),
            stats           TEXT,
            created         REAL    NOT NULL,
            UNIQUE (conversation_id, position)
        );
        CREATE INDEX messages_state ON messages(state) WHERE state = 'streaming';

        CREATE TABLE documents (
            id              INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            name            TEXT    NOT NULL,
            path            TEXT,
            text            TEXT    NOT NULL,
            n_tokens        INTEGER,
            pinned          INTEGER NOT NULL DEFAULT 1 CHECK (pinned IN (0, 1)),
            added           REAL    NOT NULL,
            sha256          TEXT    NOT NULL,
            UNIQUE (conversation_id, sha256)
        );

        CREATE TABLE settings (
            key   TEXT PRIMARY KEY,
            value TEXT NOT NULL
        );
    """)


#: version -> function taking the database from version - 1 to version (run inside a
#: transaction; must not commit, so no ``executescript``: use ``_execute_script``). Append new versions; never edit a released one.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _migrate_to_1,
}
SCHEMA_VERSION = max(MIGRATIONS)


# --- the store ------------------------------------------------------------------------------

class Store:
    """The app's SQLite database. Owned by the UI thread (see the module's docstring).

    ``Store(path)`` opens or creates the file (and its folder); ``path=None`` means
    :func:`default_db_path`. A file that is not a SQLite database, or not this app's, raises
    :class:`StoreError` naming it.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.path = Path(path).expanduser() if path is not None else default_db_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the folder for the database {self.path}: "
                             f"{exc.strerror or exc}") from None
        if self.path.is_dir():
            raise StoreError(f"the database path {self.path} is a folder, not a file")
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the database {self.path}: {exc}") from None
        try:
            self._db.execute("PRAGMA foreign_keys = ON")
            mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            self._db.execute("PRAGMA synchronous = NORMAL")
            self.journal_mode = str(mode).lower()
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreError(
                f"{self.path} is not a usable oMLX Desktop database ({exc}); "
                f"move it away or delete it to start afresh"
            ) from None
        except StoreError:
            self._db.close()
            raise

    # -- lifetime

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        else:
            self._db.execute("COMMIT")

    def schema_version(self) -> int:
        return self._db.execute("SELECT version FROM schema_version").fetchone()[0]

    def _migrate(self) -> None:
        db = self._db
        with self._tx():
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "schema_version" not in tables:
                if tables:
                    raise StoreError(
                        f"{self.path} is a SQLite database but not an oMLX Desktop one "
                        f"(it has tables {', '.join(sorted(tables))} and no schema_version)"
                    )
                db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
                db.execute("INSERT INTO schema_version (version) VALUES (0)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            current = row[0] if row else 0
        if current > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} was written by a newer oMLX Desktop (schema {current}, "
                f"this version knows up to {SCHEMA_VERSION})"
            )
        for version in range(current + 1, SCHEMA_VERSION + 1):
            with self._tx():
                MIGRATIONS[version](db)
                db.execute("UPDATE schema_version SET version = ?", (version,))

    # -- conversations

    def create_conversation(self, title: str = "New chat", *, model: str | None = None,
                            kv_spec: str | None = None,
                            system_prompt: str | None = None) -> Conversation:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO conversations (title, created, updated, model, kv_spec, system_prompt)"
                " VALUES (?, ?, ?, ?, ?, ?)", (title, now, now, model, kv_spec, system_prompt))
        return self.conversation(cur.lastrowid)

    def conversation(self, conversation_id: int) -> Conversation:
        row = self._db.execute(
            "SELECT id, title, created, updated, model, kv_spec, system_prompt"
            " FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise NotFound(f"no conversation {conversation_id} in {self.path}")
        return Conversation(*row)

    def list_conversations(self) -> list[Conversation]:
        """All conversations, most recently updated first."""
        rows = self._db.execute(
            "SELECT id, title, created, updated, model, kv_spec, system_prompt"
            " FROM conversations ORDER BY updated DESC, id DESC").fetchall()
        return [Conversation(*r) for r in rows]

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.update_conversation(conversation_id, title=title)

    def update_conversation(self, conversation_id: int, *, title: str = _UNCHANGED,
                            model: str | None = _UNCHANGED, kv_spec: str | None = _UNCHANGED,
                            system_prompt: str | None = _UNCHANGED) -> Conversation:
        """Changes the given fields (pass ``None`` to clear model/kv_spec/system_prompt)."""
        fields = {k: v for k, v in (("title", title), ("model", model), ("kv_spec", kv_spec),
                                    ("system_prompt", system_prompt)) if v is not _UNCHANGED}
        with self._tx() as db:
            sets = "".join(f"{k} = ?, " for k in fields)
            cur = db.execute(f"UPDATE conversations SET {sets}updated = ? WHERE id = ?",
                             (*fields.values(), time.time(), conversation_id))
            if cur.rowcount == 0:
                raise NotFound(f"no conversation {conversation_id} in {self.path}")
        return self.conversation(conversation_id)

    def delete_conversation(self, conversation_id: int) -> None:
        """Deletes it with its messages and documents."""
        with self._tx() as db:
            cur = db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            if cur.rowcount == 0:
                raise NotFound(f"no conversation {conversation_id} in {self.path}")

    def _touch(self, db: sqlite3.Connection, conversation_id: int) -> None:
        db.execute("UPDATE conversations SET updated = ? WHERE id = ?",
                   (time.time(), conversation_id))

    # -- messages

    _MESSAGE_COLS = "id, conversation_id, position, role, content, state, stats, created"

    @staticmethod
    def _message(row: tuple) -> Message:
        mid, cid, pos, role, content, state, stats, created = row
        return Message(mid, cid, pos, role, content, state,
                       json.loads(stats) if stats is not None else None, created)

    def add_message(self, conversation_id: int, role: str, content: str = "", *,
                    state: str = "complete", stats: dict | None = None) -> Message:
        """Appends a message at the end of the conversation (position = last + 1). For an answer
        being generated: ``add_message(cid, "assistant", state="streaming")``."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        if state not in MESSAGE_STATES:
            raise ValueError(f"state must be one of {MESSAGE_STATES}, not {state!r}")
        try:
            with self._tx() as db:
                pos = db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM messages"
                                 " WHERE conversation_id = ?", (conversation_id,)).fetchone()[0]
                cur = db.execute(
                    "INSERT INTO messages (conversation_id, position, role, content, state,"
                    " stats, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (conversation_id, pos, role, content, state,
                     json.dumps(stats) if stats is not None else None, time.time()))
                self._touch(db, conversation_id)
        except sqlite3.IntegrityError:
            raise NotFound(f"no conversation {conversation_id} in {self.path}") from None
        return self.message(cur.lastrowid)

    def message(self, message_id: int) -> Message:
        row = self._db.execute(f"SELECT {self._MESSAGE_COLS} FROM messages WHERE id = ?",
                               (message_id,)).fetchone()
        if row is None:
            raise NotFound(f"no message {message_id} in {self.path}")
        return self._message(row)

    def messages(self, conversation_id: int) -> list[Message]:
        """The conversation's messages in order."""
        rows = self._db.execute(
            f"SELECT {self._MESSAGE_COLS} FROM messages WHERE conversation_id = ?"
            " ORDER BY position", (conversation_id,)).fetchall()
        return [self._message(r) for r in rows]

    def append_to_message(self, message_id: int, text: str) -> None:
        """Appends streamed text to a message in state 'streaming' (one small transaction)."""
        if not text:
            return
        with self._tx() as db:
            cur = db.execute("UPDATE messages SET content = content || ?"
                             " WHERE id = ? AND state = 'streaming'", (text, message_id))
            if cur.rowcount == 0:
                self._raise_not_streaming(db, message_id)

    def _raise_not_streaming(self, db: sqlite3.Connection, message_id: int) -> None:
        row = db.execute("SELECT state FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise NotFound(f"no message {message_id} in {self.path}")
        raise StoreError(f"message {message_id} is {row[0]}, not streaming")

    def finish_message(self, message_id: int, state: str = "complete",
                       stats: dict | None = None) -> Message:
        """Ends a streaming message: ``state`` 'complete' (done or stopped by the user) or
        'interrupted'; ``stats`` replaces the stored stats when given."""
        if state not in ("complete", "interrupted"):
            raise ValueError(f"a message finishes as 'complete' or 'interrupted', not {state!r}")
        with self._tx() as db:
            if stats is None:
                cur = db.execute("UPDATE messages SET state = ? WHERE id = ?", (state, message_id))
            else:
                cur = db.execute("UPDATE messages SET state = ?, stats = ? WHERE id = ?",
                                 (state, json.dumps(stats), message_id))
            if cur.rowcount == 0:
                raise NotFound(f"no message {message_id} in {self.path}")
            self._touch_for_message(db, message_id)
        return self.message(message_id)

    def edit_message(self, message_id: int, content: str) -> Message:
        """Replaces a message's text (its state and stats stay)."""
        with self._tx() as db:
            cur = db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, message_id))
            if cur.rowcount == 0:
                raise NotFound(f"no message {message_id} in {self.path}")
            self._touch_for_message(db, message_id)
        return self.message(message_id)

    def _touch_for_message(self, db: sqlite3.Connection, message_id: int) -> None:
        db.execute("UPDATE conversations SET updated = ? WHERE id ="
                   " (SELECT conversation_id FROM messages WHERE id = ?)", (time.time(), message_id))

    def delete_messages_after(self, conversation_id: int, position: int) -> int:
        """Deletes the messages after ``position`` (regenerate: the last user message's position;
        edit: the edited message's). ``position=-1`` empties the conversation. Returns how many
        were deleted."""
        with self._tx() as db:
            cur = db.execute("DELETE FROM messages WHERE conversation_id = ? AND position > ?",
                             (conversation_id, position))
            self._touch(db, conversation_id)
        return cur.rowcount

    def recover_interrupted(self) -> list[int]:
        """Call once at start: messages left 'streaming' by a killed process become
        'interrupted', keeping their text. Returns their ids."""
        with self._tx() as db:
            ids = [r[0] for r in db.execute("SELECT id FROM messages WHERE state = 'streaming'"
                                            " ORDER BY id")]
            db.execute("UPDATE messages SET state = 'interrupted' WHERE state = 'streaming'")
        return ids

    # -- documents

    _DOCUMENT_COLS = "id, conversation_id, name, path, text, n_tokens, pinned, added, sha256"

    @staticmethod
    def _document(row: tuple) -> Document:
        did, cid, name, path, text, n_tokens, pinned, added, sha = row
        return Document(did, cid, name, path, text, n_tokens, bool(pinned), added, sha)

    def add_document(self, conversation_id: int, name: str, text: str, *,
                     path: str | os.PathLike[str] | None = None, pinned: bool = True,
                     n_tokens: int | None = None, sha256: str | None = None) -> Document:
        """Adds a document to the conversation (pinned by default: part of its prompt prefix).
        The same text already in the conversation is not added again: its document is returned.
        ``sha256`` (of a file stored without its text) stands for the text's."""
        sha = sha256 or hashlib.sha256(text.encode("utf-8")).hexdigest()
        try:
            with self._tx() as db:
                row = db.execute("SELECT id FROM documents WHERE conversation_id = ? AND sha256 = ?",
                                 (conversation_id, sha)).fetchone()
                if row is not None:
                    doc_id = row[0]
                else:
                    doc_id = db.execute(
                        "INSERT INTO documents (conversation_id, name, path, text, n_tokens,"
                        " pinned, added, sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (conversation_id, name, os.fspath(path) if path is not None else None,
                         text, n_tokens, int(bool(pinned)), time.time(), sha)).lastrowid
                    self._touch(db, conversation_id)
        except sqlite3.IntegrityError:
            raise NotFound(f"no conversation {conversation_id} in {self.path}") from None
        return self.document(doc_id)

    def document(self, document_id: int) -> Document:
        row = self._db.execute(f"SELECT {self._DOCUMENT_COLS} FROM documents WHERE id = ?",
                               (document_id,)).fetchone()
        if row is None:
            raise NotFound(f"no document {document_id} in {self.path}")
        return self._document(row)

    def documents(self, conversation_id: int, *, pinned_only: bool = False) -> list[Document]:
        """The conversation's documents in the order they were added (the prompt-prefix order)."""
        where = " AND pinned = 1" if pinned_only else ""
        rows = self._db.execute(
            f"SELECT {self._DOCUMENT_COLS} FROM documents WHERE conversation_id = ?{where}"
            " ORDER BY id", (conversation_id,)).fetchall()
        return [self._document(r) for r in rows]

    def _update_document(self, document_id: int, sql: str, args: tuple) -> None:
        with self._tx() as db:
            cur = db.execute(f"UPDATE documents SET {sql} WHERE id = ?", (*args, document_id))
            if cur.rowcount == 0:
                raise NotFound(f"no document {document_id} in {self.path}")
            db.execute("UPDATE conversations SET updated = ? WHERE id ="
                       " (SELECT conversation_id FROM documents WHERE id = ?)",
                       (time.time(), document_id))

    def set_document_pinned(self, document_id: int, pinned: bool) -> None:
        self._update_document(document_id, "pinned = ?", (int(bool(pinned)),))

    def set_document_tokens(self, document_id: int, n_tokens: int | None) -> None:
        """Records the document's token count under its conversation's model (None: unknown)."""
        self._update_document(document_id, "n_tokens = ?", (n_tokens,))

    def remove_document(self, document_id: int) -> None:
        with self._tx() as db:
            row = db.execute("SELECT conversation_id FROM documents WHERE id = ?",
                             (document_id,)).fetchone()
            if row is None:
                raise NotFound(f"no document {document_id} in {self.path}")
            db.execute("DELETE FROM documents WHERE id = ?", (document_id,))
            self._touch(db, row[0])

    # -- settings

    def get_setting(self, key: str, default: Any = None) -> Any:
        """The setting's value (any JSON value), or ``default`` when it was never set."""
        row = self._db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set_setting(self, key: str, value: Any) -> None:
        """Stores a JSON-serialisable value (TypeError otherwise)."""
        encoded = json.dumps(value)
        with self._tx() as db:
            db.execute("INSERT INTO settings (key, value) VALUES (?, ?)"
                       " ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, encoded))

    def delete_setting(self, key: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM settings WHERE key = ?", (key,))

    def settings(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self._db.execute("SELECT key, value FROM settings")}
