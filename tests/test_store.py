"""omlx_desktop.store: the app's SQLite file (conversations, messages, documents, settings)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from omlx_desktop import store as store_mod  # noqa: E402
from omlx_desktop.store import NotFound, Store, StoreError  # noqa: E402


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "data" / "omlx.db"


@pytest.fixture
def store(db_path):
    s = Store(db_path)
    yield s
    s.close()


def test_creates_file_in_wal_mode_with_foreign_keys(store, db_path):
    assert db_path.is_file()
    assert store.journal_mode == "wal"
    assert store._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert store.schema_version() == store_mod.SCHEMA_VERSION


def test_default_path_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_DATA_DIR", str(tmp_path / "elsewhere"))
    with Store() as s:
        assert s.path == tmp_path / "elsewhere" / "omlx.db"
        assert s.path.is_file()
    monkeypatch.delenv("OMLX_DATA_DIR")
    assert store_mod.default_db_path().name == "omlx.db"
    assert "omlx-desktop" in str(store_mod.default_db_path())


def test_conversation_round_trip(store, db_path):
    c = store.create_conversation("First", model="smollm2-135m-instruct", kv_spec="k6v4")
    assert (c.title, c.model, c.kv_spec, c.system_prompt) == ("First", "smollm2-135m-instruct", "k6v4", None)
    store.rename_conversation(c.id, "Renamed")
    store.update_conversation(c.id, kv_spec=None, system_prompt="Be brief.")
    store.close()
    with Store(db_path) as again:
        got = again.conversation(c.id)
        assert (got.title, got.model, got.kv_spec, got.system_prompt) == (
            "Renamed", "smollm2-135m-instruct", None, "Be brief.")
        assert got.created == c.created and got.updated >= c.updated


def test_list_conversations_most_recent_first(store):
    a = store.create_conversation("a")
    b = store.create_conversation("b")
    c = store.create_conversation("c")
    assert [x.title for x in store.list_conversations()] == ["c", "b", "a"]
    store.add_message(a.id, "user", "hi")  # activity moves it to the top
    assert [x.title for x in store.list_conversations()] == ["a", "c", "b"]
    assert {x.id for x in store.list_conversations()} == {a.id, b.id, c.id}


def test_messages_in_order_with_stats(store):
    c = store.create_conversation()
    store.add_message(c.id, "system", "You are helpful.")
    store.add_message(c.id, "user", "Hello")
    m = store.add_message(c.id, "assistant", "Hi!", stats={"ttft_s": 0.5, "decode_tok_s": 7.1})
    msgs = store.messages(c.id)
    assert [(x.position, x.role, x.content, x.state) for x in msgs] == [
        (0, "system", "You are helpful.", "complete"),
        (1, "user", "Hello", "complete"),
        (2, "assistant", "Hi!", "complete"),
    ]
    assert msgs[2].stats == {"ttft_s": 0.5, "decode_tok_s": 7.1}
    assert msgs[0].stats is None
    assert store.message(m.id) == msgs[2]


def test_streaming_append_and_finish(store):
    c = store.create_conversation()
    store.add_message(c.id, "user", "Count")
    m = store.add_message(c.id, "assistant", state="streaming")
    for piece in ("one", ", two", "", ", three"):
        store.append_to_message(m.id, piece)
    assert store.message(m.id).content == "one, two, three"
    assert store.message(m.id).state == "streaming"
    done = store.finish_message(m.id, "complete", stats={"kv_bytes": 123})
    assert (done.state, done.content, done.stats) == ("complete", "one, two, three", {"kv_bytes": 123})
    with pytest.raises(StoreError, match="not streaming"):
        store.append_to_message(m.id, "late")
    with pytest.raises(NotFound):
        store.append_to_message(9999, "x")
    with pytest.raises(ValueError):
        store.finish_message(m.id, "streaming")


def test_many_small_appends(store):
    c = store.create_conversation()
    m = store.add_message(c.id, "assistant", state="streaming")
    for i in range(200):  # one transaction each, as streaming does every ~0.25 s
        store.append_to_message(m.id, f"tok{i} ")
    assert store.message(m.id).content.split() == [f"tok{i}" for i in range(200)]


def test_edit_and_delete_after(store):
    c = store.create_conversation()
    u1 = store.add_message(c.id, "user", "q1")
    store.add_message(c.id, "assistant", "a1")
    u2 = store.add_message(c.id, "user", "q2")
    store.add_message(c.id, "assistant", "a2")
    # regenerate the last answer: drop what follows the last user message
    assert store.delete_messages_after(c.id, u2.position) == 1
    assert [m.content for m in store.messages(c.id)] == ["q1", "a1", "q2"]
    again = store.add_message(c.id, "assistant", "a2'")
    assert again.position == 3
    # edit the first question: its text changes, everything after it goes
    store.edit_message(u1.id, "q1 edited")
    assert store.delete_messages_after(c.id, u1.position) == 3
    assert [(m.position, m.content) for m in store.messages(c.id)] == [(0, "q1 edited")]
    assert store.delete_messages_after(c.id, -1) == 1
    assert store.messages(c.id) == []


def test_delete_conversation_cascades(store):
    c = store.create_conversation()
    keep = store.create_conversation()
    store.add_message(c.id, "user", "x")
    store.add_message(c.id, "assistant", "y")
    store.add_document(c.id, "notes.txt", "some notes")
    store.add_message(keep.id, "user", "kept")
    store.delete_conversation(c.id)
    with pytest.raises(NotFound):
        store.conversation(c.id)
    assert store._db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (c.id,)).fetchone()[0] == 0
    assert store._db.execute("SELECT COUNT(*) FROM documents WHERE conversation_id = ?", (c.id,)).fetchone()[0] == 0
    assert [m.content for m in store.messages(keep.id)] == ["kept"]
    with pytest.raises(NotFound):
        store.delete_conversation(c.id)


def test_missing_ids_raise_not_found(store):
    with pytest.raises(NotFound, match="no conversation 42"):
        store.conversation(42)
    with pytest.raises(NotFound):
        store.add_message(42, "user", "x")
    with pytest.raises(NotFound):
        store.add_document(42, "d", "t")
    with pytest.raises(KeyError):  # NotFound is also a KeyError
        store.message(42)
    with pytest.raises(ValueError):
        store.add_message(store.create_conversation().id, "robot", "x")


def test_documents_per_conversation(store, db_path):
    c = store.create_conversation()
    other = store.create_conversation()
    d1 = store.add_document(c.id, "a.md", "alpha text", path="/tmp/a.md")
    d2 = store.add_document(c.id, "b.md", "beta text", pinned=False, n_tokens=3)
    assert store.add_document(c.id, "a copy.md", "alpha text").id == d1.id  # same text: once
    d3 = store.add_document(other.id, "a.md", "alpha text")  # another conversation: its own
    assert d3.id != d1.id
    import hashlib
    assert d1.sha256 == hashlib.sha256(b"alpha text").hexdigest()
    assert (d1.pinned, d1.path, d1.n_tokens) == (True, "/tmp/a.md", None)
    assert [d.name for d in store.documents(c.id)] == ["a.md", "b.md"]
    assert [d.name for d in store.documents(c.id, pinned_only=True)] == ["a.md"]
    store.set_document_pinned(d2.id, True)
    store.set_document_pinned(d1.id, False)
    store.set_document_tokens(d1.id, 17)
    assert [d.name for d in store.documents(c.id, pinned_only=True)] == ["b.md"]
    store.remove_document(d2.id)
    store.close()
    with Store(db_path) as again:
        (only,) = again.documents(c.id)
        assert (only.name, only.text, only.pinned, only.n_tokens) == ("a.md", "alpha text", False, 17)
        assert len(again.documents(other.id)) == 1
        with pytest.raises(NotFound):
            again.remove_document(d2.id)


def test_settings_defaults_and_json_values(store, db_path):
    assert store.get_setting("kv_spec") is None
    assert store.get_setting("kv_spec", "balanced") == "balanced"
    store.set_setting("kv_spec", "k4v4")
    store.set_setting("window", {"w": 900, "h": 700, "splitter": [1, 3]})
    store.set_setting("temperature", 0.7)
    store.set_setting("show_chart", False)
    store.set_setting("kv_spec", "k8v8")  # overwrite
    store.close()
    with Store(db_path) as again:
        assert again.get_setting("kv_spec", "balanced") == "k8v8"
        assert again.get_setting("window") == {"w": 900, "h": 700, "splitter": [1, 3]}
        assert again.get_setting("temperature") == 0.7
        assert again.get_setting("show_chart", True) is False
        again.delete_setting("kv_spec")
        assert again.get_setting("kv_spec", "balanced") == "balanced"
        with pytest.raises(TypeError):
            again.set_setting("bad", object())


def test_recover_interrupted_in_process(store):
    c = store.create_conversation()
    m = store.add_message(c.id, "assistant", "partial", state="streaming")
    done = store.add_message(c.id, "assistant", "whole")
    assert store.recover_interrupted() == [m.id]
    assert store.message(m.id).state == "interrupted"
    assert store.message(m.id).content == "partial"
    assert store.message(done.id).state == "complete"
    assert store.recover_interrupted() == []


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from omlx_desktop.store import Store
    s = Store(sys.argv[1])
    c = s.create_conversation("killed")
    s.add_message(c.id, "user", "tell me a story")
    m = s.add_message(c.id, "assistant", state="streaming")
    print(c.id, m.id, flush=True)
    i = 0
    while True:
        s.append_to_message(m.id, f"w{i} ")
        print(i, flush=True)
        i += 1
        time.sleep(0.01)
""")


def test_streaming_message_survives_sigkill(db_path):
    db_path.parent.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(db_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        cid, mid = map(int, proc.stdout.readline().split())
        last = -1
        while last < 20:  # at least 21 appends committed, then kill it mid-stream
            line = proc.stdout.readline()
            assert line, "the writer died on its own"
            last = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    with Store(db_path) as s:
        before = s.message(mid)
        assert before.state == "streaming"  # opening does not change anything by itself
        assert s.recover_interrupted() == [mid]
        m = s.message(mid)
        assert m.state == "interrupted"
        words = m.content.split()
        assert len(words) >= last + 1
        assert words == [f"w{i}" for i in range(len(words))]  # every committed append, in order
        assert [x.role for x in s.messages(cid)] == ["user", "assistant"]


def test_non_sqlite_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "omlx.db"
    bad.write_bytes(b"this is not a database, just some text\n" * 200)
    with pytest.raises(StoreError) as info:
        Store(bad)
    assert str(bad) in str(info.value)
    assert "not a usable oMLX Desktop database" in str(info.value)
    assert bad.read_bytes().startswith(b"this is not a database")  # left as it was


def test_foreign_sqlite_file_is_refused(tmp_path):
    other = tmp_path / "other.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE stuff (x)")
    con.commit()
    con.close()
    with pytest.raises(StoreError, match="not an oMLX Desktop one"):
        Store(other)


def test_newer_schema_is_refused(db_path):
    Store(db_path).close()
    con = sqlite3.connect(db_path)
    con.execute("UPDATE schema_version SET version = 99")
    con.commit()
    con.close()
    with pytest.raises(StoreError, match="newer oMLX Desktop"):
        Store(db_path)


def test_directory_at_db_path_is_a_clear_error(tmp_path):
    (tmp_path / "omlx.db").mkdir()
    with pytest.raises(StoreError, match="is a folder"):
        Store(tmp_path / "omlx.db")


def test_migration_hook_runs_new_versions(db_path, monkeypatch):
    Store(db_path).close()

    def to_2(db):
        db.execute("ALTER TABLE conversations ADD COLUMN pinned_top INTEGER NOT NULL DEFAULT 0")

    monkeypatch.setitem(store_mod.MIGRATIONS, 2, to_2)
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", 2)
    with Store(db_path) as s:
        assert s.schema_version() == 2
        cols = [r[1] for r in s._db.execute("PRAGMA table_info(conversations)")]
        assert "pinned_top" in cols


def test_failed_migration_rolls_back(db_path, monkeypatch):
    Store(db_path).close()

    def broken(db):
        db.execute("ALTER TABLE conversations ADD COLUMN half_done INTEGER")
        raise RuntimeError("boom")

    monkeypatch.setitem(store_mod.MIGRATIONS, 2, broken)
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", 2)
    with pytest.raises(RuntimeError, match="boom"):
        Store(db_path)
    monkeypatch.undo()
    with Store(db_path) as s:
        assert s.schema_version() == 1
        assert "half_done" not in [r[1] for r in s._db.execute("PRAGMA table_info(conversations)")]


def test_other_threads_are_refused(store):
    errors = []

    def worker():
        try:
            store.create_conversation()
        except sqlite3.ProgrammingError as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(errors) == 1
