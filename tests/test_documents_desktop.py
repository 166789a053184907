"""Documents longer than the context in the desktop window, on the real SmolLM2: a document
larger than the context is pinned for retrieval and the answer lists the sections it was shown
(clickable to a preview); a document that fits after raising the context is offered that, in
its row, and the refusal's error goes once it is pinned."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import QUrl  # noqa: E402

from omlx_desktop.window import MainWindow  # noqa: E402

from .qt_wait import wait_until  # noqa: E402
from .test_desktop_chat import ask as chat_ask  # noqa: E402
from .test_desktop_chat import drop, open_window  # noqa: E402

pytestmark = pytest.mark.slow  # a window on a real model, generating answers

GPL = (Path(__file__).parents[1] / "resources" / "bench" / "gpl-3.txt").read_text()
FACT = "The access code for the north gate is 4471."


@pytest.fixture(scope="module")
def window(qapp, tmp_path_factory, smollm2_path):
    yield from open_window(tmp_path_factory.mktemp("documents-data"), smollm2_path)


def ask(window: MainWindow, text: str, max_tokens: int) -> dict:
    return chat_ask(window, text, max_tokens, timeout=900)  # a whole context's prompt: minutes when busy


def added(window: MainWindow, key: str) -> None:
    wait_until(lambda: key in window.docs.doc_ids or window.documents.rows[key].failed,
               timeout=1200, what="the document")


def dropped_and_indexed(window: MainWindow, doc):
    """Drop `doc` on the window and wait until it is added and its index is built: (key, row)."""
    drop(window, doc)
    key = window.documents.keys()[-1]
    added(window, key)
    assert key in window.docs.doc_ids, window.errors[-1:]
    row = window.documents.rows[key]
    wait_until(lambda: row.badge.isVisibleTo(row), what="the index")
    return key, row


def test_a_document_longer_than_the_context_is_read_by_retrieval_and_its_sections_listed(window, tmp_path):
    window.new_conversation()
    window.kv_panel.ctx_spin.setValue(1024)
    assert window.documents.doc_mode() == "auto"
    paragraphs = GPL.split("\n\n")
    paragraphs.insert(len(paragraphs) // 2, FACT)
    doc = tmp_path / "manual.txt"
    doc.write_text("\n\n".join(paragraphs))
    key, row = dropped_and_indexed(window, doc)
    assert "retrieval" in row.info_label.text() and "sections" in row.info_label.text()
    assert row.badge.text() == "indexed"
    n_tokens = window.store.document(window.docs.doc_ids[key]).n_tokens
    assert n_tokens > 6 * 1024
    if row.offer.isVisibleTo(row):  # the model's 8,192 context would hold it, if memory allows
        assert row.raise_ctx > 1024 and "Raise context" in row.raise_button.text()

    answer = ask(window, "What is the access code for the north gate?", 16)
    sections = answer["stats"]["retrieved"]
    assert sections and all(s["document"] == "manual.txt" for s in sections)
    fact_line = doc.read_text().split("\n").index(FACT) + 1
    assert any(s["start"] <= fact_line <= s["end"] for s in sections)
    assert answer["stats"]["prompt_tokens"] <= 1024
    shown = window.transcript.toPlainText()
    assert "Sections used:" in shown and f"manual.txt {sections[0]['label']}" in shown
    # stored with the answer: the list comes back when the conversation is shown again
    assert window.store.messages(window.conv_id)[-1].stats["retrieved"] == sections
    window.open_conversation(window.conv_id)
    links = window.transcript.section_links()
    assert len(links) == len(sections)
    hit = next(j for j, s in enumerate(sections) if s["start"] <= fact_line <= s["end"])
    window.transcript.setSource(QUrl(links[hit]))  # what a click on the link does
    preview = window.docs.preview
    assert preview is not None and preview.isVisible()
    assert FACT in preview.view.toPlainText() and sections[hit]["label"] in preview.windowTitle()
    preview.close()


def test_a_document_that_fits_a_larger_context_is_offered_it_and_the_error_clears(window, tmp_path):
    window.new_conversation()
    window.documents.mode_box.setCurrentIndex(window.documents.mode_box.findData("whole"))
    assert window.store.get_setting(f"doc_mode:{window.conv_id}") == "whole"
    window.kv_panel.ctx_spin.setValue(512)
    doc = tmp_path / "part.txt"
    doc.write_text("\n".join(GPL.split("\n")[:60]))  # about 650 tokens
    n_errors = len(window.errors)
    drop(window, doc)
    key = window.documents.keys()[-1]
    added(window, key)
    row = window.documents.rows[key]
    assert row.failed and key not in window.docs.doc_ids
    assert len(window.errors) > n_errors and window.banner.isVisible()
    assert row.offer.isVisibleTo(row) and row.raise_button.isVisibleTo(row)
    assert row.retrieval_button.isVisibleTo(row)  # the other way out: retrieval
    assert 512 < row.raise_ctx <= window.model_info["context_length"] and row.raise_ctx % 256 == 0
    assert f"{row.raise_ctx:,}" in row.raise_button.text()

    row.raise_button.click()
    assert window.kv_panel.ctx_spin.value() == row.raise_ctx
    wait_until(lambda: key in window.docs.doc_ids or len(window.errors) > n_errors + 1,
               timeout=1200, what="the document pinned at the larger context")
    assert key in window.docs.doc_ids, window.errors[-1]
    wait_until(lambda: row.badge.isVisibleTo(row), what="the cached badge")
    assert row.badge.text() == "cached" and not row.offer.isVisibleTo(row)
    assert not window.banner.isVisible()  # the refusal no longer applies
    answer = ask(window, "What is this document about?", 8)
    assert answer["stats"]["retrieved"] == []  # read whole
    window.kv_panel.ctx_spin.setValue(4096)


def test_the_retrieval_budget_is_set_per_conversation_and_bounds_the_sections(window, tmp_path):
    from engine.retrieval import RETRIEVAL_TOKENS, SECTION_OVERHEAD_TOKENS
    from omlx_desktop.documents_panel import FILL_CONTEXT

    window.new_conversation()
    window.kv_panel.ctx_spin.setValue(2048)
    panel = window.documents
    assert panel.retrieval_tokens() == RETRIEVAL_TOKENS and panel.budget_spin.isEnabled()
    paragraphs = GPL.split("\n\n")
    paragraphs.insert(len(paragraphs) // 3, FACT)
    doc = tmp_path / "budget.txt"
    doc.write_text("\n\n".join(paragraphs))
    drop(window, doc)
    key = window.documents.keys()[-1]
    added(window, key)
    assert key in window.docs.doc_ids, window.errors[-1:]
    panel.budget_spin.setValue(800)  # what typing 800 and leaving the box does
    conv = window.conv_id
    assert window.store.get_setting(f"retrieval_tokens:{conv}") == 800
    answer = ask(window, "What is the access code for the north gate?", 8)
    sections = answer["stats"]["retrieved"]
    assert sections and sum(s["tokens"] + SECTION_OVERHEAD_TOKENS for s in sections) <= 800
    assert answer["stats"]["prompt_tokens"] < 1100
    fact_line = doc.read_text().split("\n").index(FACT) + 1
    assert any(s["start"] <= fact_line <= s["end"] for s in sections)
    assert "Sections used:" in window.transcript.toPlainText()
    # another conversation has its own (the default); the first keeps 800
    window.new_conversation()
    assert panel.retrieval_tokens() == RETRIEVAL_TOKENS
    panel.budget_spin.setValue(FILL_CONTEXT)
    assert panel.budget_spin.text() == "fill the context" and panel.retrieval_tokens() == 0
    assert window.store.get_setting(f"retrieval_tokens:{window.conv_id}") == 0
    window.open_conversation(conv)
    assert panel.retrieval_tokens() == 800


def test_a_file_too_large_to_hold_is_read_from_the_file_by_retrieval(window, tmp_path, monkeypatch):
    from engine import documents

    from .test_file_index import FACTS, write_planted

    monkeypatch.setattr(documents, "STREAM_BYTES", 1 << 20)  # as a file over 64 MB is, at 3 MB
    window.new_conversation()
    window.kv_panel.ctx_spin.setValue(2048)
    doc = tmp_path / "archive.txt"
    fact_lines = write_planted(doc, 3 << 20)
    key, row = dropped_and_indexed(window, doc)
    assert "retrieval" in row.info_label.text() and row.badge.text() == "indexed"
    stored = window.store.document(window.docs.doc_ids[key])
    assert stored.text == "" and stored.path == str(doc) and stored.n_tokens > 500_000
    assert len(stored.sha256) == 64

    answer = ask(window, FACTS[1][1], 16)
    sections = answer["stats"]["retrieved"]
    hit = next(j for j, s in enumerate(sections) if s["start"] <= fact_lines[1] <= s["end"])
    window.transcript.setSource(QUrl(window.transcript.section_links()[hit]))
    preview = window.docs.preview
    assert preview is not None and FACTS[1][0] in preview.view.toPlainText()  # read from the file
    preview.close()

    # the same file again is the same document; the conversation opened again reads the file
    n_errors = len(window.errors)
    drop(window, doc)
    again = window.documents.keys()[-1]
    wait_until(lambda: len(window.errors) > n_errors, what="the refusal")
    assert again not in window.docs.doc_ids and "already in this conversation" in window.errors[-1]
    conv, stored_key = window.conv_id, f"d{window.docs.doc_ids[key]}"
    window.open_conversation(conv)
    row = window.documents.rows[stored_key]
    wait_until(lambda: row.badge.isVisibleTo(row), what="the index loaded")
    assert ask(window, FACTS[2][1], 8)["stats"]["retrieved"]
    # gone: said when the conversation opens, and the rest of it opens
    n_errors = len(window.errors)
    doc.unlink()
    window.open_conversation(conv)
    wait_until(lambda: len(window.errors) > n_errors, what="the error")
    assert any("archive.txt cannot be read" in e for e in window.errors[n_errors:]), window.errors[n_errors:]
    assert window.conv_id == conv and window.store.messages(conv)
