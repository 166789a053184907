"""Models from the Hugging Face Hub: list a repo's GGUF files, download one with progress, cancel
and resume, verify it against the Hub's LFS sha256, join a split set into one file.

Everything on the wire goes through ``huggingface_hub``: ``HfApi.model_info(files_metadata=True)``
for the file list with sizes and LFS sha256, ``hf_hub_url`` + ``file_download.http_get`` for the
bytes (the library's auth headers, redirects, retries and Range resume). ``hf_hub_download`` is not
the download path: in huggingface_hub 2.x it writes into a per-process temporary file that it
deletes on any failure, so a cancelled or killed download starts over from byte 0. Here the partial
file is kept under a name carrying the expected sha256, and the next fetch resumes it with a Range
request. The library's shared cache (``HF_HUB_CACHE``) is still read: a GGUF file another tool has
downloaded there is used where it is (``try_to_load_from_cache``), not downloaded again.

Layout: ``models_dir() / "hf" / OWNER / REPO / FILE.gguf`` (a split set ``X-00001-of-0000N.gguf``
is joined into ``X.gguf``), beside the catalog's models, so ``omlx models list`` finds both.
The endpoint is ``$HF_ENDPOINT`` read at call time (the library reads it once at import).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .model_files import CHUNK_SIZE, MODEL_FILE_MODE, Progress, Reporter, models_dir
from .errors import HubError

HF_PREFIX = "hf:"
SPLIT_KEYS_PREFIX = "split."
# llama.cpp's gguf-split names: NAME-00001-of-00003.gguf (5 digits each)
_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# the quantization in a file name: Q4_K_M, Q8_0, IQ4_XS, BF16, F16, ... between separators
_QUANT_NAME = re.compile(r"(?:^|[-_.])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=[-_.])", re.IGNORECASE)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


# -- names -------------------------------------------------------------------------------------
def is_hub_spec(spec: object) -> bool:
    """Whether ``spec`` names a Hugging Face source (``hf:OWNER/REPO[/FILE.gguf]``)."""
    return isinstance(spec, str) and spec.startswith(HF_PREFIX)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``hf:OWNER/REPO`` → (repo id, None); ``hf:OWNER/REPO/PATH/FILE.gguf`` → (repo id, file)."""
    body = spec[len(HF_PREFIX):] if is_hub_spec(spec) else spec
    parts = [p for p in body.strip().strip("/").split("/")]
    if len(parts) < 2 or not _REPO_ID.match("/".join(parts[:2])):
        raise HubError(
            f"'{spec}' is not a Hugging Face source; write hf:OWNER/REPO to list its GGUF files "
            "or hf:OWNER/REPO/FILE.gguf to download one"
        )
    repo = "/".join(parts[:2])
    if len(parts) == 2:
        return repo, None
    filename = "/".join(parts[2:])
    if not filename.lower().endswith(".gguf"):
        raise HubError(
            f"'{filename}' is not a .gguf file; the engine runs GGUF models "
            f"(`omlx models fetch hf:{repo}` lists the repo's GGUF files)"
        )
    return repo, filename


def quant_type(filename: str) -> str:
    """The quantization a GGUF file name announces (``Q4_K_M``, ``IQ4_XS``, ``F16``...), or
    ``"?"`` if the name says none."""
    name = Path(filename).name
    stem = name[:-5] if name.lower().endswith(".gguf") else name
    matches = _QUANT_NAME.findall(stem + ".")
    return matches[-1].upper() if matches else "?"


def endpoint() -> str:
    """The Hub's URL: ``$HF_ENDPOINT`` if set, else the library's default."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    """huggingface_hub's shared cache, following its environment variables at call time."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_models_dir() -> Path:
    """Where downloaded Hub models live: ``models_dir() / "hf"``."""
    return models_dir() / "hf"


# -- listing -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HubPart:
    """One file on the Hub: its path in the repo, size and checksum (LFS sha256, else the git
    blob id, which is sha1 over ``b"blob SIZE\\0" + content``)."""

    name: str
    size: int
    sha256: str | None
    git_sha1: str | None


@dataclass(frozen=True)
class HubFile:
    """A downloadable model: one GGUF file, or a split set of parts (``-0000k-of-0000n``)."""

    repo: str
    name: str  # the file name a user gives: the first part's for a split set
    parts: tuple[HubPart, ...]
    quant: str

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def is_split(self) -> bool:
        return len(self.parts) > 1 or bool(_SPLIT_NAME.match(Path(self.name).name))

    @property
    def local_name(self) -> str:
        """The file name on disk: a split set's joined file drops the part numbering."""
        match = _SPLIT_NAME.match(self.name)
        return f"{match['stem']}.gguf" if match else self.name

    @property
    def spec(self) -> str:
        return f"{HF_PREFIX}{self.repo}/{self.name}"


@dataclass(frozen=True)
class RepoListing:
    repo: str
    commit: str | None
    files: tuple[HubFile, ...]

    def find(self, filename: str) -> HubFile:
        """The model ``filename`` names (any part of a split set names the set)."""
        for f in self.files:
            if filename == f.name or filename in (p.name for p in f.parts):
                return f
        lowered = filename.lower()
        for f in self.files:  # Hub paths are case-sensitive, but a user's typing may not be
            if lowered == f.name.lower():
                return f
        known = "\n  ".join(f.name for f in self.files)
        raise HubError(f"{self.repo} has no GGUF file '{filename}'; its GGUF files are:\n  {known}")


def _hub_error(exc: BaseException, what: str, repo: str) -> HubError:
    """A specific message for huggingface_hub's and the transport's exceptions."""
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return HubError(
            f"{repo} is a gated repo: accept its terms on https://huggingface.co/{repo} and log in "
            "(`hf auth login`), then try again"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(
            f"no Hugging Face repo '{repo}' at {endpoint()}: check the OWNER/REPO spelling "
            "(a private repo needs `hf auth login`)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{repo} has no such revision: {exc}")
    if isinstance(exc, EntryNotFoundError):
        return HubError(f"{what}: the Hub has no such file in {repo}")
    if isinstance(exc, OfflineModeIsEnabled):
        return HubError(f"{what}: HF_HUB_OFFLINE is set, so the Hub cannot be reached")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "an error")
        return HubError(f"{what}: the Hub at {endpoint()} answered {status}: {str(exc).splitlines()[0]}")
    return HubError(
        f"{what}: cannot reach the Hugging Face Hub at {endpoint()} ({type(exc).__name__}: {exc}); "
        "check the network connection (or HF_ENDPOINT)"
    )


def _transport_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub.utils import HfHubHTTPError

    try:  # the HTTP client huggingface_hub 2.x uses
        from httpx2 import HTTPError
    except ImportError:
        from httpx import HTTPError
    return (HfHubHTTPError, HTTPError, OSError, ValueError)


def list_files(repo: str, revision: str | None = None) -> RepoListing:
    """The GGUF files of ``repo`` with sizes, checksums and quant types (split sets grouped).

    Raises HubError: unknown or gated repo, no network, or a repo without GGUF files."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint()).model_info(repo, revision=revision, files_metadata=True)
    except _transport_errors() as exc:
        raise _hub_error(exc, f"cannot list {repo}", repo) from exc
    singles: list[HubPart] = []
    sets: dict[tuple[str, int], list[tuple[int, HubPart]]] = {}
    for sibling in info.siblings or []:
        if not sibling.rfilename.lower().endswith(".gguf"):
            continue
        lfs = sibling.lfs
        part = HubPart(
            name=sibling.rfilename,
            size=int(lfs.size if lfs is not None else sibling.size or 0),
            sha256=lfs.sha256 if lfs is not None else None,
            git_sha1=sibling.blob_id if lfs is None else None,
        )
        match = _SPLIT_NAME.match(sibling.rfilename)
        if match:
            sets.setdefault((match["stem"], int(match["count"])), []).append((int(match["index"]), part))
        else:
            singles.append(part)
    files = [HubFile(repo, p.name, (p,), quant_type(p.name)) for p in singles]
    for (stem, count), numbered in sets.items():
        numbered.sort(key=lambda item: item[0])
        parts = tuple(p for _, p in numbered)
        files.append(HubFile(repo, parts[0].name, parts, quant_type(stem + ".gguf")))
    if not files:
        others = [s.rfilename for s in info.siblings or []]
        shown = ", ".join(others[:8]) + (", ..." if len(others) > 8 else "") if others else "no files"
        raise HubError(
            f"{repo} has no GGUF files (it holds {shown}); the engine runs GGUF models: look for a "
            f"repo named like '{repo.split('/')[1]}-GGUF'"
        )
    files.sort(key=lambda f: f.name)
    return RepoListing(repo, info.sha, tuple(files))


# -- where a downloaded model is ---------------------------------------------------------------
def local_path(repo: str, hub_file: HubFile | str) -> Path:
    """Where the model lives in the app's models folder once downloaded."""
    name = hub_file.local_name if isinstance(hub_file, HubFile) else hub_file
    return hub_models_dir() / repo / name


def _cached_copy(repo: str, part: HubPart, commit: str | None) -> Path | None:
    """The part in huggingface_hub's shared cache (put there by any tool), if it has the right size."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo, part.name, cache_dir=hub_cache_dir(), revision=commit)
    except (OSError, ValueError):
        return None
    if isinstance(found, str) and os.path.isfile(found) and os.path.getsize(found) == part.size:
        return Path(found)
    return None


def find_downloaded(repo: str, filename: str) -> Path | None:
    """The downloaded file ``hf:repo/filename`` (the app's folder first, then the shared cache),
    offline; None if neither holds it."""
    match = _SPLIT_NAME.match(filename)
    own = local_path(repo, f"{match['stem']}.gguf" if match else filename)
    if own.is_file():
        return own
    if match:
        return None  # a split set is only usable joined
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo, filename, cache_dir=hub_cache_dir())
    except (OSError, ValueError):
        return None
    return Path(found) if isinstance(found, str) and os.path.isfile(found) else None


@dataclass(frozen=True)
class DownloadedModel:
    spec: str  # hf:OWNER/REPO/FILE.gguf
    path: Path
    size: int
    where: str  # "models folder" or "HF cache"


def downloaded_models() -> list[DownloadedModel]:
    """Every Hub GGUF model on disk: in the app's models folder and in the shared HF cache."""
    found: dict[str, DownloadedModel] = {}
    root = hub_models_dir()
    if root.is_dir():
        for path in sorted(root.glob("*/*/**/*.gguf")):
            rel = path.relative_to(root).parts
            spec = f"{HF_PREFIX}{rel[0]}/{rel[1]}/{'/'.join(rel[2:])}"
            found[spec] = DownloadedModel(spec, path, path.stat().st_size, "models folder")
    cache = hub_cache_dir()
    if cache.is_dir():
        from huggingface_hub import scan_cache_dir
        from huggingface_hub.utils import CacheNotFound

        try:
            scanned = scan_cache_dir(cache)
        except (CacheNotFound, OSError, ValueError):
            scanned = None
        for repo in scanned.repos if scanned else ():
            if repo.repo_type != "model":
                continue
            for revision in repo.revisions:
                for f in revision.files:
                    if f.file_name.lower().endswith(".gguf") and not _SPLIT_NAME.match(f.file_name):
                        rel = f.file_path.relative_to(revision.snapshot_path).as_posix()
                        spec = f"{HF_PREFIX}{repo.repo_id}/{rel}"
                        found.setdefault(spec, DownloadedModel(spec, f.file_path, f.size_on_disk, "HF cache"))
    return sorted(found.values(), key=lambda m: m.spec)


def resolve(spec: str) -> Path:
    """The downloaded file that ``hf:OWNER/REPO/FILE.gguf`` names, or a HubError saying how to get it."""
    repo, filename = parse_spec(spec)
    if filename is None:
        raise HubError(
            f"'{spec}' names a repo, not a file: `omlx models fetch {spec}` lists its GGUF files"
        )
    path = find_downloaded(repo, filename)
    if path is None:
        raise HubError(f"'{spec}' is not downloaded yet; run `omlx models fetch {spec}` to download it")
    return path


# -- downloading -------------------------------------------------------------------------------
def _progress_bar_class(name: str, total: int, on_fraction: Callable[[float], None],
                        cancel: threading.Event | None):
    """A stand-in for tqdm that ``http_get`` drives: forwards bytes to ``on_fraction`` and raises
    "cancelled" once ``cancel`` is set. ``http_get`` calls ``update`` before writing the chunk,
    so raising there keeps the partial file a clean prefix."""

    class _Bar:
        def __init__(self, *args, initial: int = 0, **kwargs):
            self.n = initial
            on_fraction(self.n / max(total, 1))

        def update(self, n: int = 1) -> None:
            if cancel is not None and cancel.is_set():
                raise HubError(f"cancelled; the partial download of {name} is kept and the next fetch resumes it")
            self.n += n
            on_fraction(self.n / max(total, 1))

        def close(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> bool:
            return False

    return _Bar


def partial_path(folder: Path, part: HubPart) -> Path:
    """The resumable partial file of ``part`` in ``folder`` (``local_path(...).parent``): named by the expected checksum, so a file that
    changed on the Hub never resumes from the old version's bytes."""
    tag = (part.sha256 or part.git_sha1 or f"size{part.size}")[:16]
    return folder / f".{Path(part.name).name}.{tag}.partial"


def _checksum(path: Path, part: HubPart, on_fraction: Callable[[float], None],
              cancel: threading.Event | None) -> tuple[str, str]:
    """(kind, hex digest) of the file as the Hub states it: sha256 for LFS, else git's blob sha1."""
    if part.sha256 is not None:
        digest, kind = hashlib.sha256(), "sha256"
    else:
        digest, kind = hashlib.sha1(), "git blob sha1"
        digest.update(b"blob %d\0" % path.stat().st_size)
    done = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK_SIZE):
            if cancel is not None and cancel.is_set():
                raise HubError("cancelled")
            digest.update(chunk)
            done += len(chunk)
            on_fraction(done / max(part.size, 1))
    return kind, digest.hexdigest()


def _download_part(repo: str, commit: str | None, part: HubPart, folder: Path, report: Reporter,
                   start: float, width: float, cancel: threading.Event | None) -> Path:
    """Download ``part`` into its partial file (resuming what is there), verify it, and return the
    partial file's path. A mismatched file is deleted."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    partial = partial_path(folder, part)
    have = partial.stat().st_size if partial.exists() else 0
    if have > part.size:  # longer than the file: not a prefix of it
        partial.unlink()
        have = 0
    stage = f"downloading {part.name}" + (f" (resuming at {have / 2**20:,.1f} MiB)" if have else "")
    if have < part.size:
        url = hf_hub_url(repo, part.name, revision=commit, endpoint=endpoint())
        bar = _progress_bar_class(part.name, part.size, report.span(stage, start, 0.9 * width), cancel)
        try:
            with open(partial, "ab") as out:
                http_get(url, out, resume_size=have, headers=build_hf_headers(), expected_size=part.size,
                         displayed_filename=Path(part.name).name, tqdm_class=bar)
        except HubError:
            raise
        except _transport_errors() as exc:
            got = partial.stat().st_size if partial.exists() else 0
            if got > part.size:
                partial.unlink(missing_ok=True)
            reason = _hub_error(exc, f"downloading {part.name} stopped at {got:,} of {part.size:,} bytes", repo)
            raise HubError(f"{reason}; run the same command again to resume") from exc
    got = partial.stat().st_size
    if got != part.size:
        partial.unlink(missing_ok=True)
        raise HubError(
            f"{part.name}: downloaded {got:,} bytes, the Hub lists {part.size:,}; the partial file was "
            "deleted, run the command again"
        )
    verify = f"verifying {Path(part.name).name}"
    kind, actual = _checksum(partial, part, report.span(verify, start + 0.9 * width, 0.1 * width), cancel)
    expected = part.sha256 or part.git_sha1
    if expected is not None and actual != expected:
        partial.unlink(missing_ok=True)
        raise HubError(
            f"{part.name}: {kind} mismatch: the Hub lists {expected}, the download has {actual}; the "
            "corrupted file was deleted, run the command again to download it afresh"
        )
    return partial


def download(
    spec_or_repo: str,
    filename: str | None = None,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    revision: str | None = None,
    force: bool = False,
) -> Path:
    """Download ``hf:OWNER/REPO/FILE.gguf`` (or ``repo``, ``filename``) and return its path.

    ``progress(stage, fraction)`` as in :func:`engine.catalog.fetch`. Setting ``cancel`` stops
    between chunks with HubError("cancelled ..."), keeping the partial file for the next call to
    resume. A file the shared HF cache already holds is returned where it is. Only a complete,
    verified file ever appears at the returned path; a split set is joined into one file.
    """
    if filename is None:
        repo, filename = parse_spec(spec_or_repo)
        if filename is None:
            raise HubError(f"name a file: hf:{repo}/FILE.gguf (`omlx models fetch hf:{repo}` lists them)")
    else:
        repo = spec_or_repo
    report = Reporter(progress)
    report("asking the Hub", 0.0)
    listing = list_files(repo, revision)
    hub_file = listing.find(filename)
    target = local_path(repo, hub_file)
    if not force and target.is_file() and (hub_file.is_split or target.stat().st_size == hub_file.size):
        report("already downloaded", 1.0)
        return target
    if not hub_file.is_split and not force:
        cached = _cached_copy(repo, hub_file.parts[0], listing.commit)
        if cached is not None:
            report("already in the Hugging Face cache", 1.0)
            return cached
    match = _SPLIT_NAME.match(hub_file.name)
    if match and len(hub_file.parts) != int(match["count"]):
        raise HubError(
            f"{repo}: the split set {hub_file.name} lists {len(hub_file.parts)} of its "
            f"{int(match['count'])} parts on the Hub; it cannot be assembled"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HubError(f"cannot create the models folder {target.parent}: {exc}") from exc
    with _download_lock(repo, target, report, cancel):
        # Another process (a second window, `omlx models fetch`) may have finished it meanwhile.
        if not force and target.is_file() and (hub_file.is_split or target.stat().st_size == hub_file.size):
            report("already downloaded", 1.0)
            return target
        return _download_locked(repo, listing, hub_file, target, report, cancel)


@contextlib.contextmanager
def _download_lock(repo: str, target: Path, report: "Reporter", cancel: threading.Event | None):
    """One download of ``target`` at a time across processes: two writers appending to the same
    partial file would interleave their bytes. A second fetch waits (cancellable) for the first.
    Lock files live under ``hf/.locks/`` (as in huggingface_hub's cache), not beside the models."""
    import filelock   # huggingface_hub's own cross-process lock library

    lock_path = hub_models_dir() / ".locks" / repo / f"{target.name}.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HubError(f"cannot create the download lock folder {lock_path.parent}: {exc}") from exc
    lock = filelock.FileLock(str(lock_path))
    waited = False
    while True:
        try:
            lock.acquire(timeout=0.25)
            break
        except filelock.Timeout:
            if cancel is not None and cancel.is_set():
                raise HubError(f"cancelled while another download of {target.name} was running")
            if not waited:
                report(f"waiting for another download of {target.name}", 0.0)
                waited = True
    try:
        yield
    finally:
        lock.release()


def _download_locked(repo: str, listing, hub_file: HubFile, target: Path, report: "Reporter",
                     cancel: threading.Event | None) -> Path:
    total = max(hub_file.size, 1)
    done = 0
    downloaded: list[Path] = []
    share = 0.95 if hub_file.is_split else 1.0
    for part in hub_file.parts:
        width = share * part.size / total
        downloaded.append(_download_part(repo, listing.commit, part, target.parent, report,
                                         share * done / total, width, cancel))
        done += part.size
    if hub_file.is_split:
        tmp = target.with_name(f".{target.name}.joining")
        try:
            join_split(downloaded, tmp, on_fraction=report.span(f"joining {len(downloaded)} parts", 0.95, 0.05),
                       cancel=cancel)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        for path in downloaded:
            path.unlink(missing_ok=True)
    else:
        os.chmod(downloaded[0], MODEL_FILE_MODE)
        os.replace(downloaded[0], target)
    report("done", 1.0)
    return target


# -- split sets --------------------------------------------------------------------------------
def _raw_metadata(path: Path) -> tuple[int, list[tuple[str, bytes]]]:
    """(GGUF version, [(key, the key-value pair's bytes as stored)]) of a file's header, so a
    join copies values with their exact types."""
    from .gguf_file import GGUFError, _Cursor, _read_value

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            cur = _Cursor(buf, path)
            cur.pos = 4
            version = cur.scalar("<I")
            cur.scalar("<Q")  # tensor count: the tensor table is read by GGUFFile
            n_kv = cur.scalar("<Q")
            pairs = []
            for _ in range(n_kv):
                start = cur.pos
                key = cur.string()
                _read_value(cur, cur.scalar("<I"))
                pairs.append((key, bytes(buf[start:cur.pos])))
        finally:
            buf.release()
    if version not in (2, 3):
        raise GGUFError(f"{path.name}: GGUF version {version} is not supported (2 or 3)")
    return version, pairs


def join_split(parts: list[Path], out: Path, *, on_fraction: Callable[[float], None] | None = None,
               cancel: threading.Event | None = None) -> Path:
    """Write the split set ``parts`` (in order) as one GGUF file at ``out``.

    Header: the first part's metadata without the ``split.*`` keys, then every part's tensor
    table in order with offsets recomputed for the one data section (each tensor aligned to
    ``general.alignment``, default 32), then the tensor bytes copied from each part.
    """
    from .gguf_file import DEFAULT_ALIGNMENT, GGUFError, GGUFFile

    files = [GGUFFile(p) for p in parts]
    try:
        version, pairs = _raw_metadata(parts[0])
        kept = [(k, raw) for k, raw in pairs if not k.startswith(SPLIT_KEYS_PREFIX)]
        expected_tensors = files[0].get("split.tensors.count")
        tensors = [(f, t) for f in files for t in f.tensors.values()]
        if expected_tensors is not None and int(expected_tensors) != len(tensors):
            raise GGUFError(
                f"{parts[0].name}: the split set should hold {int(expected_tensors)} tensors, its "
                f"{len(parts)} parts hold {len(tensors)}"
            )
        alignment = int(files[0].get("general.alignment", DEFAULT_ALIGNMENT))

        def align(n: int) -> int:
            return (n + alignment - 1) // alignment * alignment

        header = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kept)))
        for _, raw in kept:
            header += raw
        offsets, offset = [], 0
        for _, t in tensors:
            offset = align(offset)
            offsets.append(offset)
            offset += t.nbytes
        for (_, t), rel in zip(tensors, offsets):
            name = t.name.encode("utf-8")
            dims = tuple(reversed(t.shape))
            header += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
            header += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", int(t.ggml_type), rel)
        header += b"\0" * (align(len(header)) - len(header))
        total = max(offset, 1)
        written = 0
        with open(out, "wb") as dst:
            dst.write(header)
            for (src_file, t), rel in zip(tensors, offsets):
                dst.write(b"\0" * (len(header) + rel - dst.tell()))
                with open(src_file.path, "rb") as src:
                    src.seek(t.offset)
                    left = t.nbytes
                    while left:
                        if cancel is not None and cancel.is_set():
                            raise HubError("cancelled")
                        chunk = src.read(min(CHUNK_SIZE, left))
                        if not chunk:
                            raise GGUFError(f"{src_file.path.name}: ends inside tensor {t.name!r}")
                        dst.write(chunk)
                        left -= len(chunk)
                        written += len(chunk)
                        if on_fraction:
                            on_fraction(written / total)
            dst.flush()
            os.fsync(dst.fileno())
    finally:
        for f in files:
            f.close()
    os.chmod(out, MODEL_FILE_MODE)
    GGUFFile(out).close()  # the joined header parses and every tensor lies inside the file
    return out
