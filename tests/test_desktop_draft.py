"""The desktop window's draft-model picker (Chat → Draft model) on the real SmolLM2, offscreen:
SmolLM2 drafting for itself reaches the engine through the worker, the answer is the same token
for token with every drafted token accepted and the stats line counting them; Gemma3 (another
vocabulary) is refused with the reason in the banner while SmolLM2 goes on drafting; the choice
is kept for the next start."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from omlx_desktop.window import MainWindow  # noqa: E402

from .qt_wait import wait_until  # noqa: E402
from .test_desktop_chat import ask, open_window  # noqa: E402
from .test_desktop_speculate import QUESTION  # noqa: E402

pytestmark = pytest.mark.slow  # a window on two real models, generating answers

SMOLLM2 = "smollm2-135m-instruct"  # the catalog's name: an entry of the picker


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("desktop-draft")


@pytest.fixture(scope="module")
def window(qapp, data_dir, smollm2_path):
    yield from open_window(data_dir, smollm2_path)


def choose(window: MainWindow, spec: str):
    """Picks `spec` in the draft-model menu and waits for the worker's answer (DraftApplied)."""
    got: list = []
    window.draft_menu.applied.connect(got.append)
    try:
        window.draft_menu.choose(spec)
        wait_until(lambda: got, what=f"the draft model {spec}")
    finally:
        window.draft_menu.applied.disconnect(got.append)
    return got[0]


def assert_all_accepted(window: MainWindow, answer: dict) -> None:
    stats = answer["stats"]
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] == stats["drafted_tokens"]
    assert f"drafted {stats['drafted_tokens']}, accepted {stats['accepted_tokens']}" in window.stats_summary()


def test_the_draft_model_picker_drafts_refuses_another_vocabulary_and_is_kept(window, data_dir, gemma3_path):
    menu = window.draft_menu
    assert menu.checked() == "None" and SMOLLM2 in [label for _, label in menu.choices()]
    window.new_conversation()
    plain = ask(window, QUESTION, 40)
    assert not plain["stats"].get("drafted_tokens")

    applied = choose(window, SMOLLM2)
    assert applied.failure is None and applied.spec == SMOLLM2 and applied.name
    assert menu.checked() == SMOLLM2 and window.store.get_setting("draft_model") == SMOLLM2
    window.new_conversation()
    drafted = ask(window, QUESTION, 40)
    assert drafted["text"] == plain["text"]
    assert_all_accepted(window, drafted)

    # another vocabulary: refused, said why, and SmolLM2 goes on drafting
    refused = choose(window, str(gemma3_path))
    assert refused.failure is not None and "vocabulary" in refused.failure.message
    assert refused.spec == SMOLLM2 and menu.checked() == SMOLLM2
    assert "vocabulary" in window.errors[-1]
    assert window.store.get_setting("draft_model") == SMOLLM2
    window.new_conversation()
    still = ask(window, QUESTION, 40)
    assert still["text"] == plain["text"]
    assert_all_accepted(window, still)
    window.close()

    again = MainWindow(data_dir=data_dir)  # the last model, the draft model restored
    try:
        applied: list = []
        again.draft_menu.applied.connect(applied.append)
        again.show()
        wait_until(lambda: (again.model_info is not None and applied) or again.errors, what="the models")
        assert applied[-1].spec == SMOLLM2 and applied[-1].failure is None
        assert again.draft_menu.checked() == SMOLLM2
        again.new_conversation()
        answer = ask(again, QUESTION, 40)
        assert answer["text"] == plain["text"]
        assert_all_accepted(again, answer)
        assert choose(again, "").spec == "" and again.draft_menu.checked() == "None"
        assert again.store.get_setting("draft_model") == ""
        again.new_conversation()
        assert not ask(again, QUESTION, 40)["stats"].get("drafted_tokens")
    finally:
        again.close()


def test_the_serve_switch_drafts_with_the_chats_draft_model(qapp, tmp_path, smollm2_path):
    """Serving on localhost with a draft model chosen in Chat → Draft model: the server drafts
    with it too (SmolLM2 drafting for itself: every drafted token of a served answer accepted,
    counted in /metrics and the answer's usage); choosing None restarts the server on the same
    URL without drafts, and the served answer is the same."""
    from .test_serve_desktop import _ask_served, _metric

    windows = open_window(tmp_path, smollm2_path)
    window = next(windows)
    try:
        assert choose(window, SMOLLM2).failure is None
        panel = window.serve_panel
        assert panel.draft_spec == SMOLLM2 and panel.draft_label.text() == f"draft {SMOLLM2}"
        panel.port.setValue(0)
        panel.switch.setChecked(True)
        wait_until(lambda: panel.url or panel.error, what="the server")
        assert panel.error is None and panel.served_draft == SMOLLM2 and panel.draft_error is None
        url = panel.url
        served = _ask_served(url, QUESTION, 40)
        drafted = _metric(url, "omlx_drafted_tokens_total")
        assert drafted > 0 and _metric(url, "omlx_accepted_tokens_total") == drafted
        details = served.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
        assert _metric(url, "omlx_draft_kv_bytes_capacity") > 0

        assert choose(window, "").spec == ""
        wait_until(lambda: panel.served_draft == "" and panel.url, what="the server without a draft")
        assert panel.url == url and panel.draft_label.text() == ""
        plain = _ask_served(url, QUESTION, 40)
        assert plain.choices[0].message.content == served.choices[0].message.content
        assert _metric(url, "omlx_drafted_tokens_total") == 0
    finally:
        window.close()
    assert window.serve_panel._thread is None
