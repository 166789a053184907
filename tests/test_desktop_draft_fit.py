"""The window's memory check with a draft model chosen (Chat → Draft model), on the real SmolLM2
offscreen, drafting for it with a copy of itself: a budget (OMLX_MEMORY_LIMIT) the model fits in
alone but not with the draft model asks before drafting with one picked while the model is
loaded, and before loading the model with one chosen, naming both; the estimate is engine.fit's
with the draft model counted, as `omlx --draft` counts it. Declined, the draft model (or the
model) before it stays; said yes to, it drafts (or loads) anyway. With no context chosen, the
default context counts the draft model too."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine import fit  # noqa: E402
from omlx_desktop.fit_question import fit_question  # noqa: E402

from .qt_wait import wait_until  # noqa: E402
from .test_desktop_chat import open_window  # noqa: E402


@pytest.fixture
def draft(tmp_path, smollm2_path) -> Path:
    path = tmp_path / "smollm2-draft.gguf"  # SmolLM2 drafting for itself, under another name
    try:
        os.link(smollm2_path, path)
    except OSError:  # another file system
        shutil.copyfile(smollm2_path, path)
    return path


@pytest.fixture
def window(qapp, tmp_path, smollm2_path, monkeypatch):
    monkeypatch.delenv(fit.MEMORY_LIMIT_ENV, raising=False)
    yield from open_window(tmp_path / "data", smollm2_path)


def test_a_draft_model_that_does_not_fit_beside_the_model_is_asked_about(window, draft, smollm2_path,
                                                                         monkeypatch):
    asked = {"load": [], "draft": []}
    answer = {"load": False, "draft": False}

    def asker(kind):
        def ask(check):
            asked[kind].append(check)
            return answer[kind]
        return ask

    monkeypatch.setattr(window.models, "ask_load_anyway", asker("load"))
    monkeypatch.setattr(window.draft_menu, "ask_draft_anyway", asker("draft"), raising=False)
    applied: list = []
    window.draft_menu.applied.connect(applied.append)
    # a context the user chose: picking the draft model does not lower it to one where both fit
    window.kv_panel.ctx_spin.setValue(window.kv_panel.ctx_spin.value() - fit.CONTEXT_STEP)
    settings = window.kv_panel.settings()
    alone = fit.estimate_file(smollm2_path, settings["ctx"], settings["spec"], available=1)
    pair = fit.estimate_file(smollm2_path, settings["ctx"], settings["spec"], available=1, draft=draft)
    assert pair.draft_bytes > 0 and pair.total_bytes == alone.total_bytes + pair.draft_bytes
    limit = (alone.total_bytes + pair.total_bytes) // 2  # the model alone fits, the pair does not
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, str(limit))

    # picked while the model is loaded: asked first, naming both; declined, no draft model
    window.draft_menu.choose(str(draft))
    wait_until(lambda: asked["draft"] or applied, what="the question")
    (check,) = asked["draft"]
    assert not applied and not asked["load"]
    assert check.spec == str(draft) and Path(check.draft).name == draft.name
    assert check.path == str(smollm2_path) and check.verdict == fit.DOES_NOT_FIT
    assert check.total_bytes == pair.total_bytes and check.available_bytes == limit
    assert "draft model" in check.summary
    box = fit_question(window, check, drafting=True)
    assert f"{smollm2_path.name} with the draft model {draft.name} probably does not fit" in box.text()
    assert "Together they need about" in box.informativeText()
    assert box.button(box.StandardButton.Yes).text() == "Draft anyway"
    assert window.draft_menu.checked() == "None" and window.store.get_setting("draft_model", "") == ""
    assert draft.name in window.statusBar().currentMessage()

    # said yes to: it drafts
    answer["draft"] = True
    window.draft_menu.choose(str(draft))
    wait_until(lambda: applied, what="the draft model")
    assert len(asked["draft"]) == 2 and applied[0].failure is None and applied[0].name
    assert window.draft_menu.spec == str(draft)

    # a load with the draft model chosen counts it: asked, naming both; declined, nothing loads
    loaded: list = []
    window.modelLoaded.connect(loaded.append)
    window.load_model(str(smollm2_path))
    wait_until(lambda: asked["load"] and window.models.loading is None, what="the load's question")
    (check,) = asked["load"]
    assert Path(check.draft).name == draft.name and check.total_bytes == pair.total_bytes
    box = window.models.fit_question(check)
    assert f"{smollm2_path.name} with the draft model {draft.name} probably does not fit" in box.text()
    assert box.button(box.StandardButton.Yes).text() == "Load anyway"
    assert not loaded and window.model_info is not None  # the model before it stays
    assert draft.name in window.statusBar().currentMessage()

    # with no draft model the same budget loads it without asking
    window.draft_menu.choose("")
    wait_until(lambda: len(applied) == 2, what="no draft model")
    window.load_model(str(smollm2_path))
    wait_until(lambda: loaded or window.errors, what="the load")
    assert len(asked["load"]) == 1 and loaded[0]["fit_verdict"] != fit.DOES_NOT_FIT


def test_the_default_context_counts_the_draft_model(window, draft, smollm2_path, monkeypatch):
    """No context chosen: with a budget the model fits in alone at its whole context but the pair
    only at less, picking the draft model lowers the context (the panel's, the worker's and the
    model info's default) to engine.fit's default for the pair, a load with it chosen starts
    there, and dropping it gives the whole context back; a context the user chose stays."""
    asked: list = []
    monkeypatch.setattr(window.models, "ask_load_anyway", lambda check: asked.append(check))
    monkeypatch.setattr(window.draft_menu, "ask_draft_anyway", lambda check: asked.append(check),
                        raising=False)
    applied: list = []
    window.draft_menu.applied.connect(applied.append)
    panel = window.kv_panel
    spec = panel.settings()["spec"]
    alone = fit.estimate_file(smollm2_path, None, spec, available=1)
    pair = fit.estimate_file(smollm2_path, None, spec, available=1, draft=draft)
    limit = int((alone.total_bytes + pair.total_bytes) / 2 / fit.TIGHT_FRACTION)
    whole = window.model_info["context_length"]
    with_draft = fit.default_context_file(smollm2_path, spec, limit, draft=draft)
    assert fit.default_context_file(smollm2_path, spec, limit) == whole > with_draft
    assert window.model_info["default_ctx"] == panel.settings()["ctx"] == whole
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, str(limit))

    def choose(spec: str) -> None:
        applied.clear()
        window.draft_menu.choose(spec)
        wait_until(lambda: applied, what=f"the draft model {spec!r}")
        assert applied[0].failure is None

    def assert_ctx(ctx: int) -> None:
        assert panel.settings()["ctx"] == window.model_info["default_ctx"] == ctx
        wait_until(lambda: window.worker.ctx == ctx, timeout=30, what=f"the worker at {ctx} tokens")

    choose(str(draft))
    assert_ctx(with_draft)

    # a load with the draft model chosen
    loaded: list = []
    window.modelLoaded.connect(loaded.append)
    window.load_model(str(smollm2_path))
    wait_until(lambda: len(applied) == 2 or window.errors, what="the load and its draft model")
    assert loaded[0]["default_ctx"] == with_draft and applied[1].name
    assert_ctx(with_draft)

    choose("")
    assert_ctx(whole)

    # chosen by the user: it stays
    panel.ctx_spin.setValue(whole - 512)
    choose(str(draft))
    assert panel.settings()["ctx"] == whole - 512 and window.model_info["default_ctx"] == with_draft
    assert not asked


def test_a_draft_model_that_cannot_be_read_is_left_out_of_the_default_context(draft, smollm2_path, tmp_path,
                                                                             monkeypatch):
    """The worker's default context counts a draft model it can read; a damaged one is left out
    (the load goes on, and drafting with it says why) rather than failing the load."""
    from engine.gguf_file import GGUFFile
    from omlx_desktop.worker_fit import default_context

    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + bytes(60))
    alone = fit.estimate_file(smollm2_path, None, None, available=1)
    pair = fit.estimate_file(smollm2_path, None, None, available=1, draft=draft)
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, str(int((alone.total_bytes + pair.total_bytes) / 2 / fit.TIGHT_FRACTION)))
    gguf = GGUFFile(smollm2_path)
    try:
        assert default_context(gguf, None) == default_context(gguf, None, str(damaged)) == alone.ctx
        assert default_context(gguf, None, str(draft)) == fit.default_context_file(smollm2_path, draft=draft) < alone.ctx
    finally:
        gguf.close()
