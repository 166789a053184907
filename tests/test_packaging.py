"""packaging/: the freedesktop entry, its install script, the icon, the PyInstaller files."""

from __future__ import annotations

import configparser
import os
import shutil
import stat
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
DESKTOP = PACKAGING / "omlx-desktop.desktop"
INSTALL = PACKAGING / "install-desktop-entry.sh"
PNG = ROOT / "resources" / "omlx-desktop.png"
SVG = ROOT / "resources" / "omlx-desktop.svg"
VALIDATOR = shutil.which("desktop-file-validate")


def read_entry(path: Path) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(path.read_text(encoding="utf-8"))
    assert parser.sections() == ["Desktop Entry"]
    return dict(parser["Desktop Entry"])


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_desktop_entry_has_the_required_keys():
    entry = read_entry(DESKTOP)
    assert entry["Type"] == "Application"
    assert entry["Name"] == "oMLX Desktop"
    assert entry["Comment"]
    assert entry["Exec"].split()[0] == "omlx-desktop"
    assert entry["Icon"] == "omlx-desktop"
    assert entry["Terminal"] == "false"
    assert entry["Categories"].endswith(";") and "Utility" in entry["Categories"].split(";")
    assert "MimeType" not in entry  # no registered media type for .gguf files


@pytest.mark.skipif(VALIDATOR is None, reason="desktop-file-validate not installed (apt: desktop-file-utils)")
def test_desktop_entry_validates():
    result = subprocess.run([VALIDATOR, str(DESKTOP)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "error" not in result.stdout + result.stderr


def test_icon_png_is_256_square_and_svg_parses():
    assert png_size(PNG) == (256, 256)
    root = ET.parse(SVG).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.get("viewBox") == "0 0 256 256"


def test_render_icon_script(tmp_path):
    out = tmp_path / "icon.png"
    result = subprocess.run(
        [sys.executable, str(PACKAGING / "render_icon.py"), "--size", "64", "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert png_size(out) == (64, 64)


def fake_launcher(folder: Path, name: str = "omlx-desktop") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / name
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


def run_install(xdg: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_DATA_HOME": str(xdg), "HOME": str(xdg.parent / "home")}
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True,
                          env=env, timeout=60)


def installed_files(xdg: Path) -> dict[str, Path]:
    return {
        "desktop": xdg / "applications" / "omlx-desktop.desktop",
        "png": xdg / "icons" / "hicolor" / "256x256" / "apps" / "omlx-desktop.png",
        "svg": xdg / "icons" / "hicolor" / "scalable" / "apps" / "omlx-desktop.svg",
    }


def test_install_and_uninstall_in_xdg_data_home(tmp_path):
    xdg = tmp_path / "xdg data"
    exe = fake_launcher(tmp_path / "bin")
    result = run_install(xdg, "--exec", str(exe))
    assert result.returncode == 0, result.stdout + result.stderr
    files = installed_files(xdg)
    assert all(p.is_file() for p in files.values())
    entry = read_entry(files["desktop"])
    assert entry["Exec"] == f"{exe} %f"
    assert entry["TryExec"] == str(exe)
    assert entry["Icon"] == "omlx-desktop"
    assert files["png"].read_bytes() == PNG.read_bytes()
    assert files["svg"].read_bytes() == SVG.read_bytes()
    assert not (tmp_path / "home").exists()  # XDG_DATA_HOME honoured: nothing under $HOME

    first = files["desktop"].read_bytes()
    again = run_install(xdg, "--exec", str(exe))  # idempotent
    assert again.returncode == 0, again.stderr
    assert files["desktop"].read_bytes() == first
    assert sorted(p.name for p in (xdg / "applications").iterdir()) == ["omlx-desktop.desktop"]

    gone = run_install(xdg, "--uninstall")
    assert gone.returncode == 0, gone.stderr
    assert not any(p.exists() for p in files.values())
    assert run_install(xdg, "--uninstall").returncode == 0  # nothing to remove: still fine


def test_install_defaults_to_home_local_share(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XDG_DATA_HOME"}
    env["HOME"] = str(tmp_path)
    exe = fake_launcher(tmp_path / "bin")
    result = subprocess.run(["bash", str(INSTALL), "--exec", str(exe)], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / ".local" / "share" / "applications" / "omlx-desktop.desktop").is_file()


def test_install_quotes_an_awkward_exec_path(tmp_path):
    xdg = tmp_path / "xdg"
    exe = fake_launcher(tmp_path / "my apps $HOME", "omlx desktop")
    result = run_install(xdg, "--exec", str(exe))
    assert result.returncode == 0, result.stdout + result.stderr
    desktop = installed_files(xdg)["desktop"]
    line = next(x for x in desktop.read_text().splitlines() if x.startswith("Exec="))
    # the spec's quoting: double quotes, $ escaped by \ (itself written \\ in a string value)
    assert line == 'Exec="' + str(exe).replace("$", "\\\\$") + '" %f'
    if VALIDATOR:
        check = subprocess.run([VALIDATOR, str(desktop)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_install_default_exec_is_the_repo_venv(tmp_path):
    venv_exe = ROOT / ".venv" / "bin" / "omlx-desktop"
    xdg = tmp_path / "xdg"
    result = run_install(xdg)
    if not os.access(venv_exe, os.X_OK):
        assert result.returncode == 1 and str(venv_exe) in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert read_entry(installed_files(xdg)["desktop"])["Exec"] == f"{venv_exe} %f"


def test_install_refuses_a_missing_launcher(tmp_path):
    xdg = tmp_path / "xdg"
    result = run_install(xdg, "--exec", str(tmp_path / "nope"))
    assert result.returncode == 1
    assert "nope is not an executable file" in result.stderr
    assert not installed_files(xdg)["desktop"].exists()
    assert run_install(xdg, "--bogus").returncode == 2


def test_pyinstaller_files_are_well_formed():
    spec = (PACKAGING / "omlx-desktop.spec").read_text()
    compile(spec, "omlx-desktop.spec", "exec")
    assert "omlx_desktop.app import main" in spec and '"resources"' in spec
    for script in ("build-pyinstaller.sh", "install-desktop-entry.sh"):
        path = PACKAGING / script
        assert os.access(path, os.X_OK), f"{script} is not executable"
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
