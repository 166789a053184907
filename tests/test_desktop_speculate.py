"""The desktop window's prompt-lookup setting (Chat → Draft from the context) on the real SmolLM2,
offscreen: it reaches the engine through the worker, the answer is the same token for token, the
stats line counts drafted and accepted tokens, and the choice is kept for the next start."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from omlx_desktop.window import MainWindow  # noqa: E402

from .qt_wait import wait_until  # noqa: E402
from .test_desktop_chat import ask, open_window  # noqa: E402

pytestmark = pytest.mark.slow  # a window on a real model, generating answers

# an answer that repeats the question's words: prompt lookup has something to draft
QUESTION = ("Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape, "
            "apple, banana, cherry, date, elderberry, fig, grape.")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("desktop-speculate")


@pytest.fixture(scope="module")
def window(qapp, data_dir, smollm2_path):
    yield from open_window(data_dir, smollm2_path)


def test_prompt_lookup_answers_the_same_counts_drafts_and_is_kept(window, data_dir, smollm2_path):
    assert not window.speculate_action.isChecked()  # off until chosen
    window.new_conversation()
    plain = ask(window, QUESTION, 40)
    assert not plain["stats"].get("drafted_tokens")
    assert "drafted" not in window.stats_summary()

    window.speculate_action.trigger()
    assert window.speculate_action.isChecked() and window.store.get_setting("speculate") == "lookup"
    window.new_conversation()
    drafted = ask(window, QUESTION, 40)
    assert drafted["text"] == plain["text"]
    stats = drafted["stats"]
    assert stats["drafted_tokens"] > 0 and 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert f"drafted {stats['drafted_tokens']}, accepted {stats['accepted_tokens']}" in window.stats_summary()
    window.close()

    again = MainWindow(data_dir=data_dir)  # the last model, the setting restored
    try:
        again.show()
        wait_until(lambda: again.model_info is not None or again.errors, what="the model")
        assert again.speculate_action.isChecked()
        again.new_conversation()
        answer = ask(again, QUESTION, 40)
        assert answer["text"] == plain["text"] and answer["stats"]["drafted_tokens"] > 0
        again.speculate_action.trigger()  # and off again
        assert again.store.get_setting("speculate") == "off"
        again.new_conversation()
        assert not ask(again, QUESTION, 40)["stats"].get("drafted_tokens")
    finally:
        again.close()
