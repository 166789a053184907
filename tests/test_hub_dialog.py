"""File → Download from Hugging Face… against the stand-in Hub (tests/hub_standin.py) on 127.0.0.1:
the dialog lists a repo's GGUF files with size, quant type and fit badge, downloads with progress,
resumes a cancelled download with a Range request, rejects a corrupted file, says what is wrong
with an unknown repo; the downloaded model loads in the window. And every load path asks before
loading a model that does not fit (OMLX_MEMORY_LIMIT makes the small models "not fit").

The code under test is the real download path (engine.hub over huggingface_hub); only the Hub is
a stand-in.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import gguf  # noqa: E402
import pytest  # noqa: E402

from engine import catalog, fit  # noqa: E402
from engine.errors import HubError  # noqa: E402
from omlx_desktop.hub_dialog import parse_repo_text  # noqa: E402
from omlx_desktop.window import MainWindow  # noqa: E402

from .hub_standin import HubStandIn, leftovers, sha256_of  # noqa: E402
from .qt_wait import wait_until  # noqa: E402
from .tiny_gguf import write_tiny_model  # noqa: E402

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = "test-org/SmolLM2-135M-Instruct-GGUF"
TINY_REPO = "test-org/tiny-GGUF"
TINY_FILE = "tiny-Q8_0.gguf"
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_path) -> dict:
    folder = tmp_path_factory.mktemp("hub-files")
    tiny = write_tiny_model(folder / TINY_FILE, weight_type=gguf.GGMLQuantizationType.Q8_0)
    return {"smol": smollm2_path, "tiny": tiny}


@pytest.fixture
def standin(files, tmp_path, monkeypatch):
    server = HubStandIn()
    server.add(REPO, SMOL_FILE, files["smol"])
    server.add(REPO, TINY_FILE, files["tiny"])
    server.add(TINY_REPO, TINY_FILE, files["tiny"])
    server.add_repo("test-org/safetensors-only")
    monkeypatch.delenv(fit.MEMORY_LIMIT_ENV, raising=False)
    yield from server.serve_for_test(monkeypatch, tmp_path)


@pytest.fixture
def window(standin, qtbot, tmp_path):
    w = MainWindow(data_dir=tmp_path / "data")
    qtbot.addWidget(w)
    w.show()
    yield w
    w.close()


def models_dir() -> Path:
    return Path(os.environ[catalog.MODELS_DIR_ENV])


def list_in_dialog(window: MainWindow, text: str):
    dialog = window.open_hub_dialog()
    dialog.repo_edit.setText(text)
    dialog.list_button.click()
    wait_until(lambda: not dialog.busy(), TIMEOUT, "the listing")
    return dialog


def select(dialog, name: str) -> None:
    (row,) = [i for i, r in enumerate(dialog.rows) if r.file.name == name]
    dialog.table.selectRow(row)
    assert dialog.selected_row().file.name == name


def table_text(dialog) -> list[list[str]]:
    t = dialog.table
    return [[t.item(r, c).text() for c in range(t.columnCount())] for r in range(t.rowCount())]


# ------------------------------------------------------------------------------- repo box
def test_repo_box_takes_names_specs_and_hub_urls():
    for text in ("test-org/tiny-GGUF", " hf:test-org/tiny-GGUF ", "https://huggingface.co/test-org/tiny-GGUF",
                 "https://huggingface.co/test-org/tiny-GGUF/tree/main", "https://hf.co/test-org/tiny-GGUF/"):
        assert parse_repo_text(text) == ("test-org/tiny-GGUF", None), text
    assert parse_repo_text("https://huggingface.co/test-org/tiny-GGUF/blob/main/tiny-Q8_0.gguf") == \
        ("test-org/tiny-GGUF", "tiny-Q8_0.gguf")
    assert parse_repo_text("hf:test-org/tiny-GGUF/sub/x-Q4_K_M.gguf") == ("test-org/tiny-GGUF", "sub/x-Q4_K_M.gguf")
    with pytest.raises(HubError, match="type a Hugging Face repo"):
        parse_repo_text("  ")
    with pytest.raises(HubError, match="not a Hugging Face address"):
        parse_repo_text("https://example.com/test-org/tiny-GGUF")
    with pytest.raises(HubError, match="not a Hugging Face source"):
        parse_repo_text("just-a-name")


# -------------------------------------------------------------------------------- listing
def test_dialog_lists_files_with_sizes_quant_and_fit(window, files, monkeypatch):
    # a budget between the two files' needs: the tiny model fits, SmolLM2 does not
    smol_size, tiny_size = files["smol"].stat().st_size, files["tiny"].stat().st_size
    limit = fit.RUNTIME_BYTES + int(smol_size * 1.1)
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, str(limit))
    assert fit.download_verdict(smol_size) == fit.DOES_NOT_FIT and fit.download_verdict(tiny_size) == fit.FITS

    assert window.hub_action.text() == "Download from &Hugging Face…"
    window.hub_action.trigger()
    dialog = window.hub_dialog
    assert dialog is not None and dialog.isVisible()
    listed = []
    dialog.listed.connect(listed.append)
    dialog.repo_edit.setText(f"https://huggingface.co/{REPO}")
    dialog.list_button.click()
    assert dialog.busy()  # the listing runs off the UI thread
    wait_until(lambda: not dialog.busy(), TIMEOUT, "the listing")
    assert len(listed) == 1
    rows = {r[0]: r for r in table_text(dialog)}
    assert set(rows) == {SMOL_FILE, TINY_FILE}
    from omlx_desktop.chart import format_bytes

    assert rows[SMOL_FILE][1:4] == [format_bytes(smol_size), "Q4_1", "does not fit"]
    assert rows[TINY_FILE][1:4] == [format_bytes(tiny_size), "Q8_0", "fits"]
    assert rows[SMOL_FILE][4] == rows[TINY_FILE][4] == ""  # nothing on disk yet
    smol_row = [r[0] for r in table_text(dialog)].index(SMOL_FILE)
    tooltip = dialog.table.item(smol_row, 3).toolTip()
    assert tooltip.startswith("does not fit: about") and format_bytes(limit) in tooltip
    assert "2 GGUF files" in dialog.message_text()
    assert dialog.download_button.isEnabled()  # the first row is selected
    assert not leftovers(models_dir())  # listing downloads nothing


def test_unknown_repo_and_a_repo_without_gguf_files_are_messages(window):
    dialog = list_in_dialog(window, "test-org/nope")
    assert "No Hugging Face repo 'test-org/nope'" in dialog.message_text()
    assert dialog.table.rowCount() == 0 and not dialog.download_button.isEnabled()
    dialog = list_in_dialog(window, "hf:test-org/safetensors-only")
    assert "has no GGUF files" in dialog.message_text() and "README.md" in dialog.message_text()
    dialog = list_in_dialog(window, "not a repo")
    assert "not a Hugging Face source" in dialog.message_text()
    assert window.isVisible() and not window.errors  # the app goes on


# ------------------------------------------------------------------------------- download
def test_cancel_then_resume_with_progress_and_the_model_loads(window, standin, files):
    standin.throttle = 0.02  # 1 MiB per 20 ms: the cancel lands mid-file
    dialog = list_in_dialog(window, REPO)
    select(dialog, SMOL_FILE)
    dialog.download_button.click()
    assert dialog.busy() and dialog.cancel_button.isVisible() and not dialog.download_button.isEnabled()
    wait_until(lambda: any(s.startswith("downloading") and f > 0.2 for s, f in dialog.progress_seen),
               TIMEOUT, "a fifth of the download")
    assert 200 < dialog.progress_bar.value() < 1000
    dialog.cancel_button.click()
    wait_until(lambda: not dialog.busy(), TIMEOUT, "the cancel")
    assert "cancelled" in dialog.message_text() and "resume" in dialog.message_text()
    folder = models_dir() / "hf" / REPO
    (partial,) = leftovers(folder)
    have = partial.stat().st_size
    assert partial.name.endswith(".partial") and 0 < have < files["smol"].stat().st_size
    assert dialog.selected_row().partial_bytes == have
    assert table_text(dialog)[[r.file.name for r in dialog.rows].index(SMOL_FILE)][4].startswith("partial")
    assert window.model_info is None and window.models.loading is None  # nothing loaded

    standin.throttle = 0.0
    loaded = []
    window.modelLoaded.connect(loaded.append)
    dialog.download_button.click()
    wait_until(lambda: not dialog.busy(), TIMEOUT, "the resumed download")
    assert standin.ranges(SMOL_FILE) == [f"bytes={have}-"]
    path = folder / SMOL_FILE
    assert leftovers(folder) == [path] and sha256_of(path) == sha256_of(files["smol"])
    stages = [s for s, _ in dialog.progress_seen]
    assert any("resuming at" in s for s in stages) and any(s.startswith("verifying") for s in stages)
    fractions = [f for _, f in dialog.progress_seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert f"Downloaded {SMOL_FILE}" in dialog.message_text()
    assert dialog.download_button.text() == "Load"  # on disk now
    wait_until(lambda: loaded or window.errors, TIMEOUT, "the downloaded model to load")
    assert loaded and loaded[0]["path"] == str(path), window.errors
    assert window.model_info["fit_verdict"] == fit.FITS


def test_closing_the_window_stops_a_download_and_keeps_its_partial_file(window, standin, files):
    standin.throttle = 0.02
    dialog = list_in_dialog(window, REPO)
    select(dialog, SMOL_FILE)
    dialog.close()  # closing the dialog hides it; the download goes on
    dialog.download_button.click()
    wait_until(lambda: any(f > 0.1 for _, f in dialog.progress_seen), TIMEOUT, "the download")
    window.close()
    dialog.thread.join(30)
    assert not dialog.thread.is_alive()
    (partial,) = leftovers(models_dir() / "hf" / REPO)
    assert partial.name.endswith(".partial") and 0 < partial.stat().st_size < files["smol"].stat().st_size


def test_corrupted_download_is_rejected_and_nothing_is_left(window, standin, files):
    standin.corrupt.add(TINY_FILE)
    dialog = list_in_dialog(window, TINY_REPO)
    dialog.download_button.click()
    wait_until(lambda: not dialog.busy(), TIMEOUT, "the download")
    message = dialog.message_text()
    assert f"Cannot download {TINY_FILE}" in message and "sha256 mismatch" in message
    assert "corrupted file was deleted" in message and "command" not in message
    assert leftovers(models_dir()) == []
    assert dialog.progress_bar.isHidden() and dialog.table.item(0, 4).text() == ""
    assert window.model_info is None and window.models.loading is None  # nothing was loaded

    standin.corrupt.clear()  # the next try downloads it afresh
    dialog.download_button.click()
    wait_until(lambda: not dialog.busy(), TIMEOUT, "the download")
    path = models_dir() / "hf" / TINY_REPO / TINY_FILE
    assert sha256_of(path) == sha256_of(files["tiny"])
    wait_until(lambda: window.model_info is not None or window.errors, TIMEOUT, "the tiny model to load")
    assert window.model_info["path"] == str(path), window.errors


# --------------------------------------------------------------------------- will it fit
def test_a_model_that_does_not_fit_asks_before_loading(window, files, monkeypatch):
    asked = []
    answer = {"load": False}

    def ask(check):
        asked.append(check)
        return answer["load"]

    monkeypatch.setattr(window.models, "ask_load_anyway", ask)
    settings = window.kv_panel.settings()
    needed = fit.estimate_file(files["smol"], settings["ctx"], settings["spec"], available=1).total_bytes
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, str(needed // 2))

    window.load_model(str(files["smol"]))  # as File → Open and a drop do
    wait_until(lambda: asked and window.models.loading is None, TIMEOUT, "the question")
    (check,) = asked
    assert check.verdict == fit.DOES_NOT_FIT and check.path == str(files["smol"])
    assert check.total_bytes == needed and check.available_bytes == needed // 2
    assert check.summary.startswith("does not fit: needs about")
    assert window.model_info is None and window.stack.currentWidget() is window.welcome  # declined
    assert "does not fit" in window.welcome_status.text()

    answer["load"] = True
    window.load_model(str(files["smol"]))
    wait_until(lambda: window.model_info is not None or window.errors, TIMEOUT, "the forced load")
    assert len(asked) == 2 and window.model_info["path"] == str(files["smol"]), window.errors
    assert window.model_info["fit_verdict"] == fit.DOES_NOT_FIT

    # "tight": loads without asking, with a warning in the banner (at the panel's context now:
    # a loaded model sets it to the model's default, capped by the memory there was)
    settings = window.kv_panel.settings()
    needed = fit.estimate_file(files["smol"], settings["ctx"], settings["spec"], available=1).total_bytes
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, str(int(needed / 0.9)))
    loaded = []
    window.modelLoaded.connect(loaded.append)
    window.load_model(str(files["smol"]))
    wait_until(lambda: loaded or window.errors, TIMEOUT, "the tight load")
    assert len(asked) == 2 and loaded[0]["fit_verdict"] == fit.TIGHT
    assert window.banner.isVisible() and "Memory is tight" in window.banner.text()
    assert "needs about" in window.banner.text()

    # fits: no question, and the warning goes
    monkeypatch.delenv(fit.MEMORY_LIMIT_ENV)
    window.load_model(str(files["smol"]))
    wait_until(lambda: len(loaded) == 2, TIMEOUT, "the load")
    assert len(asked) == 2 and loaded[1]["fit_verdict"] == fit.FITS and not window.banner.isVisible()
