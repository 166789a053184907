"""omlx_desktop.window_surface describes the window as its controllers use it: the members the
controllers' source touches are exactly the Protocols' members, and a real window has them all,
of the declared types."""

from __future__ import annotations

import ast
import os
import typing
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from engine import catalog  # noqa: E402
from omlx_desktop.window import MainWindow  # noqa: E402
from omlx_desktop.window_surface import (  # noqa: E402
    ChatSurface, ConversationsSurface, DocsSurface, ModelsSurface, WindowSurface,
)

PACKAGE = Path(__file__).resolve().parents[1] / "omlx_desktop"
CONTROLLERS = ("arith", "autotune", "chat", "conversations", "documents", "model_controller",
               "remote_dialog", "smoke", "draft_menu")
SIBLINGS = {"models": ModelsSurface, "conversations": ConversationsSurface, "chat": ChatSurface,
            "docs": DocsSurface}


def members(protocol: type) -> set[str]:
    names = set(vars(protocol).get("__annotations__", {}))
    return names | {name for name, value in vars(protocol).items()
                    if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def is_window(node: ast.expr) -> bool:
    """`window` (the constructor's argument), `self.w`, or `w` (the controllers' `w = self.w`)."""
    if isinstance(node, ast.Name):
        return node.id in ("window", "w")
    return (isinstance(node, ast.Attribute) and node.attr == "w"
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def used_members() -> dict[str, set[str]]:
    """What the controllers touch: {"": members of the window, "models": members of
    window.models, ...}."""
    used: dict[str, set[str]] = {"": set(), **{name: set() for name in SIBLINGS}}
    for module in CONTROLLERS:
        tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if is_window(node.value):
                used[""].add(node.attr)
            elif (isinstance(node.value, ast.Attribute) and is_window(node.value.value)
                  and node.value.attr in SIBLINGS):
                used[node.value.attr].add(node.attr)
    return used


def test_the_protocols_list_what_the_controllers_use_and_nothing_else():
    used = used_members()
    assert used[""] == members(WindowSurface), (
        f"used, not in WindowSurface: {sorted(used[''] - members(WindowSurface))}; "
        f"in WindowSurface, not used: {sorted(members(WindowSurface) - used[''])}")
    for name, protocol in SIBLINGS.items():
        assert used[name] == members(protocol), (name, sorted(used[name] ^ members(protocol)))


def declared_types(protocol: type) -> dict[str, object]:
    hints = typing.get_type_hints(protocol)
    for name, value in vars(protocol).items():
        if isinstance(value, property):
            hints[name] = typing.get_type_hints(value.fget)["return"]
    return hints


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_MODELS_DIR", str(tmp_path / "no-models"))   # the welcome page
    assert not catalog.is_fetched(catalog.DEFAULT_MODEL)
    w = MainWindow(data_dir=tmp_path / "data")
    qtbot.addWidget(w)
    yield w
    w.close()


def test_the_window_has_the_surface_its_controllers_use(window):
    assert isinstance(window, WindowSurface)
    for name, protocol in SIBLINGS.items():
        assert isinstance(getattr(window, name), protocol), name
    for protocol, target in [(WindowSurface, window)] + [
            (protocol, getattr(window, name)) for name, protocol in SIBLINGS.items()]:
        for name, hint in declared_types(protocol).items():
            assert isinstance(getattr(target, name), hint), (protocol.__name__, name, hint)


def test_the_worker_is_the_host_its_request_groups_use(qapp):
    """worker_documents, worker_tuning and worker_draft touch exactly WorkerHost's members of the worker they
    are given (``self.w`` or ``w = self.w``), and a real EngineWorker has them all."""
    from omlx_desktop.worker import EngineWorker
    from omlx_desktop.worker_host import WorkerHost

    used = set()
    for module in ("worker_documents", "worker_tuning", "worker_draft"):
        tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
        used |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_window(node.value)}
    assert used == members(WorkerHost), sorted(used ^ members(WorkerHost))
    worker = EngineWorker()
    missing = [name for name in members(WorkerHost) if not hasattr(worker, name)]
    assert not missing, missing


def test_the_worker_parses_the_kv_spec_once_and_a_bad_one_fails_its_configure(qapp):
    """Configure's spec becomes the worker's wanted KVConfig when it arrives (what load, the fit
    estimates and the switch before a turn use); a bad spec is said on ``error`` and leaves the
    wanted settings as they were."""
    from engine.kv.config import KVConfig
    from omlx_desktop.protocol import Configure
    from omlx_desktop.worker import EngineWorker

    worker = EngineWorker()
    errors = []
    worker.error.connect(errors.append)
    worker.handle(Configure(spec="k6v4,bs=16", ctx=512))
    wanted = worker.kv_wanted
    assert isinstance(wanted, KVConfig) and str(wanted) == "k6v4,bs=16" and not errors
    worker.handle(Configure(spec="k9v9", ctx=1024))
    assert worker.kv_wanted is wanted and worker.ctx == 512
    assert len(errors) == 1 and "9 bits is not a supported K precision" in errors[0].message
    worker.handle(Configure(spec=None))
    assert worker.kv_wanted is None  # the default preset
