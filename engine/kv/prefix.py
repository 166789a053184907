"""Prefix reuse: full KV blocks shared between sequences by chained block hash, kept in memory
(LRU) and, for pinned prefixes, on disk.

A full block's key is

    key_i = sha256(key_{i-1} | token ids of block i as int32)      key_{-1} = root
    root  = sha256("omlx-kv-prefix" | format version | model file sha256 | layout)

where `layout` names everything that changes the stored bytes: every layer's K and V format,
block size, sink count and key rotation. Two prompts that start with the same tokens therefore
share the keys of their common full blocks, and a different model or KV format shares none.

Memory: the cache holds one reference on each block it knows (per layer), sequences hold theirs.
An entry no sequence uses and nobody pinned is evictable; `entries` is ordered least recently
used first, and a finished sequence touches its chain tail-first so that its tail blocks are
evicted before its head. Lookup walks the chain and stops at the first miss.

Sliding-window layers release blocks no query can see again, so an entry may hold None for such
a layer; a lookup of n blocks only needs each window layer's blocks inside its window.

Master copies (see `requantize`): a cache whose layout is derivable from the 8-bit master layout
has `master`, the PrefixCache of that layout (None when the layout is the master's own or has a
layer above 8 bits). A lookup that misses in memory and on disk under its own layout derives
the blocks from the master's chain (same token ids, the master layout's keys): from the
master's memory, else from its saved file, re-quantized into this cache's pools as ordinary
entries (source "master"), so `adopt_prefix` takes them like directly computed ones.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import psutil

from ..errors import KVPoolFull
from .config import KVConfig
from .formats import get_format, hadamard
from .paged import PagedKVCache
from .paged_attention import choose_attention
from .pool import build_pools
from .requantize import derivable, master_config, requantize_rows

log = logging.getLogger("omlx.kv.prefix")

FORMAT_VERSION = 1
CACHE_DIR_ENV = "OMLX_CACHE_DIR"
DEFAULT_DISK_BUDGET = 2 << 30  # bytes of saved prefixes before the least recently used go
_MAGIC = b"OMLXKVP\0"
_SUFFIX = ".kvprefix"


def common_prefix(a, b) -> int:
    """How many leading tokens two token sequences share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def cache_dir() -> Path:
    """``$OMLX_CACHE_DIR`` if set, else the per-user cache folder."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("omlx-desktop"))


def model_fingerprint(gguf) -> str:
    """The model file's sha256, remembered per (path, size, mtime) in the cache folder: hashing
    a multi-GB file on every start would cost seconds."""
    path = Path(gguf.path).resolve()
    st = path.stat()
    memo_key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = cache_dir() / "model-sha256.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(memo_key), str):
        return memo[memo_key]
    digest = gguf.sha256()
    memo = memo if isinstance(memo, dict) else {}
    memo[memo_key] = digest
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    except OSError as exc:
        log.warning("cannot remember the model's sha256 in %s: %s", memo_path, exc)
    return digest


def chain_root(model_id: str, signature: str) -> bytes:
    """key_{-1} of every chain of a (model, layout)."""
    return hashlib.sha256(f"omlx-kv-prefix|{FORMAT_VERSION}|{model_id}|{signature}".encode()).digest()


def chain_keys_from(root: bytes, block_size: int, token_ids, n_blocks: int) -> list[bytes]:
    """Keys of the first n_blocks full blocks of `token_ids` under `root`."""
    ids = np.asarray(token_ids, dtype=np.int32)
    keys, key = [], root
    for i in range(n_blocks):
        key = hashlib.sha256(key + ids[i * block_size : (i + 1) * block_size].tobytes()).digest()
        keys.append(key)
    return keys


def layout_signature(config: KVConfig, n_layers: int) -> str:
    """Everything about the KV layout that changes the bytes of a stored block."""
    formats = [(get_format(p.k_bits, "k").name, get_format(p.v_bits, "v").name)
               for p in config.per_layer(n_layers)]
    return json.dumps({"formats": formats, "block_size": config.block_size, "sinks": config.sinks,
                       "rotation": bool(config.rotation)}, separators=(",", ":"))


@dataclass
class Entry:
    key: bytes
    index: int  # block index in its chain: positions index*B .. (index+1)*B - 1
    blocks: list[int | None]  # per layer pool block id (None: a window layer released it)
    sinks: list[tuple[np.ndarray, np.ndarray]] | None = None  # block 0 only: per layer sink K, V
    pins: int = 0
    source: str = "memory"  # where it came from: "memory" (prefilled here), "disk" or "master"


@dataclass
class Reuse:
    """What a lookup found: `tokens` reused, `disk_tokens` of them read from disk under this
    layout, `derived_tokens` of them derived from the master copy."""

    tokens: int = 0
    disk_tokens: int = 0
    keys: list[bytes] = field(default_factory=list)
    derived_tokens: int = 0

    @property
    def source(self) -> str:
        if not self.tokens:
            return "none"
        if self.derived_tokens:
            return "master"
        return "disk" if self.disk_tokens else "memory"


class PrefixCache:
    """Shared per-layer block pools of one (model, KV config) with a hash → blocks map.

    Args:
        model: the BaseModel (geometry, windows, key re-rotation).
        config: the KV config every sequence made here uses.
        model_id: the model file's sha256 (see model_fingerprint).
        capacity_tokens: pool size per layer in tokens; sequences and cached blocks share it and
            unused cached blocks are evicted when a sequence needs room.
        disk: where pinned prefixes are saved (None: memory only).
    """

    def __init__(self, model, config: KVConfig, *, model_id: str, capacity_tokens: int,
                 disk: "PrefixDiskStore | None" = None, use_kernels: bool | None = None):
        self.model = model
        self.config = config
        self.model_id = model_id
        self.B = config.block_size
        self.n_layers = model.n_layers
        self.signature = layout_signature(config, model.n_layers)
        self.root = chain_root(model_id, self.signature)
        self.master_config = master_config(config)
        self.master_signature = layout_signature(self.master_config, model.n_layers)
        self.master_root = chain_root(model_id, self.master_signature)
        # the master layout's cache this one derives from (set by the engine; see the module doc)
        self.master: PrefixCache | None = None
        self.pools = build_pools(config, model.n_layers, model.n_kv_heads, model.head_dim, model.value_dim,
                                 max_tokens=capacity_tokens)
        self.attentions = [choose_attention(pool, use_kernels) for pool in self.pools]  # shared by sequences
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.disk = disk
        self.windows = [model.layer_window(i) for i in range(model.n_layers)]

    # -- keys --------------------------------------------------------------------------------
    def chain_keys(self, token_ids, n_blocks: int | None = None, parent: bytes | None = None,
                   start: int = 0) -> list[bytes]:
        """Keys of full blocks start .. start+n-1 of `token_ids` (parent: key of block start-1)."""
        ids = np.asarray(token_ids, dtype=np.int32)
        n = len(ids) // self.B - start if n_blocks is None else n_blocks
        keys, key = [], self.root if parent is None else parent
        for i in range(start, start + n):
            key = hashlib.sha256(key + ids[i * self.B : (i + 1) * self.B].tobytes()).digest()
            keys.append(key)
        return keys

    # -- sequences ---------------------------------------------------------------------------
    def new_sequence(self, *, limit: int | None = None, overflow: str = "stop",
                     protected_tokens: int = 0) -> PagedKVCache:
        return self.model.new_cache(self.config, pools=self.pools, prefix_cache=self, limit=limit,
                                    overflow=overflow, protected_tokens=protected_tokens,
                                    attentions=self.attentions)

    def usable_blocks(self, keys: list[bytes]) -> int:
        """How many leading blocks of `keys` a new sequence can attach: all in memory, and every
        window layer has the blocks its window needs at that point."""
        n = 0
        while n < len(keys) and keys[n] in self.entries:
            n += 1
        while n > 0:
            entries = [self.entries[k] for k in keys[:n]]
            ok = True
            for layer, window in enumerate(self.windows):
                if window is None:
                    continue
                first = max(0, (n * self.B - window + 1) // self.B)
                if any(e.blocks[layer] is None for e in entries[first:]):
                    ok = False
                    break
            if ok and all(e.blocks[layer] is not None for e in entries
                          for layer, w in enumerate(self.windows) if w is None):
                return n
            n -= 1
        return 0

    def cached_keys(self, token_ids) -> list[bytes]:
        """Keys of the leading full blocks of `token_ids` that are really cached: those a new
        sequence could attach now (`usable_blocks` of their chain)."""
        keys = self.chain_keys(token_ids)
        return keys[: self.usable_blocks(keys)]

    def attach(self, seq: PagedKVCache, token_ids) -> Reuse:
        """Start the empty sequence `seq` on the longest cached prefix of `token_ids` (from
        memory, else from disk); at least the last token is left to prefill, for its logits."""
        if seq.offset:
            raise ValueError("attach needs an empty sequence")
        max_blocks = (len(token_ids) - 1) // self.B
        keys = self.chain_keys(token_ids, max_blocks)
        n = self.usable_blocks(keys)
        disk_tokens = derived_tokens = 0
        if self.disk is not None and n < len(keys):
            loaded = self.disk.load_longest(self, keys, token_ids, start=n)
            if loaded:
                n_after = self.usable_blocks(keys)
                disk_tokens = (n_after - n) * self.B
                n = n_after
        if n < len(keys) and self.derives_from_master:
            if self.derive_from_master(token_ids, keys, start=n):
                n_after = self.usable_blocks(keys)
                derived_tokens = (n_after - n) * self.B
                n = n_after
        if n == 0:
            return Reuse()
        entries = [self.entries[k] for k in keys[:n]]
        seq.adopt_prefix(token_ids[: n * self.B], keys[:n],
                         [[e.blocks[layer] for e in entries] for layer in range(self.n_layers)],
                         entries[0].sinks)
        self.touch(keys[:n])
        return Reuse(tokens=n * self.B, disk_tokens=disk_tokens, keys=list(keys[:n]),
                     derived_tokens=derived_tokens)

    # -- master copies -----------------------------------------------------------------------
    @property
    def is_master(self) -> bool:
        """This cache's layout is the master layout: its own blocks are the master copy."""
        return self.signature == self.master_signature

    def can_derive(self, config: KVConfig | None = None) -> bool:
        """Whether blocks of `config` (default: this cache's) can be derived from a master copy
        of this cache's model, block size and sinks (no layer above the master's bits)."""
        config = self.config if config is None else config
        return (config.block_size == self.B and config.sinks == self.config.sinks
                and derivable(config, self.n_layers))

    @property
    def derives_from_master(self) -> bool:
        return self.master is not None and not self.is_master and self.can_derive()

    def master_keys(self, token_ids, n_blocks: int) -> list[bytes]:
        """The master layout's keys of the first n_blocks full blocks of `token_ids`."""
        return chain_keys_from(self.master_root, self.B, token_ids, n_blocks)

    def derive_from_master(self, token_ids, keys: list[bytes], start: int = 0) -> int:
        """Derive blocks start .. of the chain `keys` (of `token_ids`) from the master copy: the
        master's memory, else its saved file. Returns the number of blocks now usable from the
        chain's start (0: the master has nothing beyond `start`)."""
        master = self.master
        mkeys = chain_keys_from(master.root, self.B, token_ids, len(keys))
        m = master.usable_blocks(mkeys)
        if m > start:
            entries = [master.entries[k] for k in mkeys[:m]]
            rows = []
            for layer, pool in enumerate(master.pools):
                present = [e.blocks[layer] is not None for e in entries]
                ids = [e.blocks[layer] for e in entries if e.blocks[layer] is not None]
                rows.append((present, [pool.k_row(b) for b in ids], [pool.v_row(b) for b in ids]))
            try:
                _install(self, keys[:m], rows, entries[0].sinks, source="master", from_pools=master.pools)
            except KVPoolFull as exc:
                log.info("cannot derive the cached prefix from the master copy: %s", exc)
                return 0
            log.info("derived %d cached tokens for %s from the 8-bit master copy in memory",
                     m * self.B, self.config)
            master.touch(mkeys[:m])
            if master.disk is not None and master.disk.path_for(mkeys[m - 1]).exists():
                master.clear()  # saved: the master's memory is not needed until the next prefill
            return m
        if master.disk is not None:
            return master.disk.load_longest(self, mkeys, token_ids, start=start, into_keys=keys,
                                            as_master=master)
        return 0

    def publish(self, seq: PagedKVCache, start: int, stop: int) -> None:
        """Register the sequence's full blocks start .. stop-1 (called as they fill up)."""
        parent = seq.chain_keys[start - 1] if start else None
        keys = self.chain_keys(seq.token_ids, stop - start, parent=parent, start=start)
        for i, key in zip(range(start, stop), keys):
            if key not in self.entries:
                blocks = [layer.block_at(i) for layer in seq.layers]
                for pool, b in zip(self.pools, blocks):
                    if b is not None:
                        pool.incref(b)
                sinks = None
                if i == 0:
                    sinks = [(layer.sink_k.copy(), layer.sink_v.copy()) for layer in seq.layers]
                self.entries[key] = Entry(key, i, blocks, sinks)
            else:
                self.entries.move_to_end(key)
        seq.mark_published(start, keys)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark entries as just used, in the given order (the last is the most recent)."""
        for key in keys:
            if key in self.entries:
                self.entries.move_to_end(key)

    # -- pinning -----------------------------------------------------------------------------
    def pin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.entries[key].pins += 1

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Release pins; the blocks stay cached (most recently used) until memory is needed."""
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def pinned_blocks(self) -> int:
        """Blocks per layer held by pinned entries (an entry holds one block in each layer): what
        no eviction frees, so what a budget of pool blocks cannot lend to sequences."""
        return sum(1 for e in self.entries.values() if e.pins)

    def pinned_tokens(self) -> int:
        return self.pinned_blocks() * self.B

    # -- eviction ----------------------------------------------------------------------------
    def _evictable(self, entry: Entry) -> bool:
        if entry.pins:
            return False
        return all(b is None or pool.ref_cnt[b] == 1 for pool, b in zip(self.pools, entry.blocks))

    def _drop_entry(self, entry: Entry) -> None:
        for pool, b in zip(self.pools, entry.blocks):
            if b is not None:
                pool.decref(b)
        del self.entries[entry.key]

    def evict(self, layer_needs: dict[int, int]) -> int:
        """Evict least recently used unpinned entries no sequence uses until each layer in
        `layer_needs` has at least that many free blocks (or nothing more can go). Returns the
        number of entries evicted."""
        def short() -> bool:
            return any(self.pools[i].n_free < n for i, n in layer_needs.items())

        evicted = 0
        for entry in list(self.entries.values()):
            if not short():
                break
            if self._evictable(entry):
                self._drop_entry(entry)
                evicted += 1
        if evicted:
            log.debug("evicted %d cached blocks", evicted)
        return evicted

    def clear(self) -> None:
        """Forget every unpinned entry no sequence uses."""
        for entry in list(self.entries.values()):
            if self._evictable(entry):
                self._drop_entry(entry)

    # -- accounting --------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Rows of every block in use by sequences or held by the cache."""
        return sum(p.used_bytes for p in self.pools)

    @property
    def capacity_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in every layer's pool (K and V rows): a budget of n blocks per layer
        holds n * block_bytes."""
        return sum(p.k_row_bytes + p.v_row_bytes for p in self.pools)

    def sequence_blocks(self) -> int:
        """Pool block references (all layers) held by sequences, i.e. by anything but this cache's
        own entries: 0 when no sequence is open, whatever the cache keeps."""
        total = 0
        for layer, pool in enumerate(self.pools):
            cached = sum(1 for e in self.entries.values() if e.blocks[layer] is not None)
            total += sum(pool.ref_cnt) - cached
        return total

    def save(self, keys: list[bytes]) -> Path | None:
        """Write the chain ending at keys[-1] to disk (no-op without a disk store)."""
        if self.disk is None or not keys:
            return None
        return self.disk.save(self, keys)


class PrefixFileError(Exception):
    """A saved prefix that cannot be trusted."""


_SAVE_NUMBERS = itertools.count()  # makes each save's temporary file name unique in this process


@dataclass
class PendingSave:
    """A chain's blocks copied out of the pools (PrefixDiskStore.snapshot), to be written."""

    path: Path
    header: dict  # without the payload's size and checksum, which `write` adds
    parts: list[bytes]  # the payload, in file order
    tokens: int

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


class PrefixDiskStore:
    """Saved prefixes, one file per chain, named by the chain's last key.

    File layout (little-endian):
        8 bytes   magic "OMLXKVP\\0"
        u32       format version
        u32       header length h
        h bytes   header, JSON: model sha256, layout signature, chain keys (hex), per layer the
                  K/V row sizes and which blocks are present, sink shape, payload size and sha256
        payload   per layer: K rows of its present blocks, then their V rows (as stored in the
                  pool); then per layer the sink keys and values (float32)
    Anything that does not match (magic, version, model, layout, keys, sizes, checksum) makes
    the file ignored with a warning and removed: it is never trusted.
    """

    def __init__(self, directory: str | os.PathLike | None = None, budget_bytes: int = DEFAULT_DISK_BUDGET):
        self.directory = Path(directory) if directory is not None else cache_dir() / "prefixes"
        self.budget_bytes = budget_bytes
        self._sweep_taken = False

    def take_sweep(self) -> bool:
        """True the first time it is asked: the caller then sweeps this store's stale temporaries
        (`sweep_stale`), once per store, on whichever thread saves first."""
        first, self._sweep_taken = not self._sweep_taken, True
        return first

    def sweep_stale(self) -> int:
        """Remove the temporary files of saves whose process is gone (killed mid-write: the name
        carries its pid); returns how many. A live process's file is left alone."""
        removed = 0
        try:
            stale = list(self.directory.glob("*" + _SUFFIX + ".*.tmp"))
        except OSError:
            return 0
        for p in stale:
            try:  # KEY.kvprefix.PID.N.tmp (an older build wrote KEY.kvprefix.PID.tmp)
                pid = int(p.name[: -len(".tmp")].split(_SUFFIX + ".", 1)[1].split(".")[0])
            except (ValueError, IndexError):
                continue
            if pid != os.getpid() and not psutil.pid_exists(pid):
                p.unlink(missing_ok=True)
                removed += 1
                log.info("removed %s, the partial save of a process that is gone", p.name)
        return removed

    def path_for(self, key: bytes) -> Path:
        return self.directory / (key.hex() + _SUFFIX)

    # -- writing -----------------------------------------------------------------------------
    def save(self, cache: PrefixCache, keys: list[bytes]) -> Path | None:
        """Write the chain ending at keys[-1] (its blocks in `cache`) to disk, atomically: a
        temporary file renamed into place. Returns the file, None when it could not be written
        (logged; the prefix stays in memory)."""
        pending = self.snapshot(cache, keys)
        return pending if isinstance(pending, Path) else self.write(pending)

    def snapshot(self, cache: PrefixCache, keys: list[bytes]) -> "Path | PendingSave":
        """What `write` needs to save the chain, copied out of the pools now (the caller's
        thread, which owns them), so that the write can run on another thread while the pools
        change. The saved file's path instead when it exists already (touched: recently used)."""
        if self.take_sweep():  # what a killed process left behind
            self.sweep_stale()
        path = self.path_for(keys[-1])
        if path.exists():
            try:
                os.utime(path)
                return path
            except OSError:  # removed meanwhile (another process's budget): write it again
                pass
        entries = [cache.entries[k] for k in keys]
        layers, parts = [], []
        for layer, pool in enumerate(cache.pools):
            present = [e.blocks[layer] is not None for e in entries]
            ids = [e.blocks[layer] for e in entries if e.blocks[layer] is not None]
            parts.extend(pool.k_row(b).tobytes() for b in ids)
            parts.extend(pool.v_row(b).tobytes() for b in ids)
            layers.append({"k_row": pool.k_row_bytes, "v_row": pool.v_row_bytes,
                           "present": "".join("1" if p else "0" for p in present)})
        sinks = entries[0].sinks
        sink_shape = list(sinks[0][0].shape) if sinks else []
        if sinks:
            for sk, sv in sinks:
                parts.append(np.ascontiguousarray(sk, np.float32).tobytes())
                parts.append(np.ascontiguousarray(sv, np.float32).tobytes())
        header = {
            "version": FORMAT_VERSION, "model": cache.model_id, "layout": cache.signature,
            "keys": [k.hex() for k in keys], "layers": layers, "sink_shape": sink_shape,
            "sink_v_dim": int(sinks[0][1].shape[-1]) if sinks else 0,
        }
        return PendingSave(path, header, parts, len(keys) * cache.B)

    def write(self, pending: "PendingSave") -> Path | None:
        """Write a snapshot: checksum, a temporary file named by this process and save, renamed
        into place (a reader sees the whole file or none; a killed writer leaves only the
        temporary file, which `sweep_stale` removes later). Any thread; an OSError (a full disk,
        a size limit, no permission) is logged and None returned."""
        path, parts = pending.path, pending.parts
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part)
        header = json.dumps(dict(pending.header, payload_bytes=pending.nbytes,
                                 payload_sha256=digest.hexdigest())).encode()
        tmp = path.with_name(path.name + f".{os.getpid()}.{next(_SAVE_NUMBERS)}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_MAGIC + struct.pack("<II", FORMAT_VERSION, len(header)) + header)
                f.writelines(parts)
            tmp.replace(path)
        except OSError as exc:  # a full disk, a size limit, no permission: the prefix stays in memory
            log.warning("cannot save the cached prefix to %s: %s", path, exc)
            try:  # a partial file would hold the space a full disk needs
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return None
        try:
            size = path.stat().st_size
        except OSError:  # removed at once by another process's budget
            return None
        log.info("saved %d cached tokens to %s (%.1f MiB)", pending.tokens, path, size / 2**20)
        self.enforce_budget(keep=path)
        return path

    def enforce_budget(self, keep: Path | None = None) -> None:
        """Remove the least recently used files until the total fits the budget."""
        files = []
        try:
            for p in self.directory.glob("*" + _SUFFIX):
                try:
                    st = p.stat()
                except OSError:  # removed meanwhile (another process sharing the folder)
                    continue
                files.append((st.st_mtime, st.st_size, p))
        except OSError:
            return
        files.sort(key=lambda f: f[0])
        total = sum(size for _, size, _ in files)
        for _, size, p in files:
            if total <= self.budget_bytes:
                break
            if keep is not None and p == keep:
                continue
            try:
                p.unlink(missing_ok=True)
            except OSError:
                continue
            total -= size
            log.info("removed cached prefix %s (disk budget %.0f MiB)", p.name, self.budget_bytes / 2**20)

    # -- reading -----------------------------------------------------------------------------
    def load_longest(self, cache: PrefixCache, keys: list[bytes], token_ids, start: int = 0, *,
                     into_keys: list[bytes] | None = None, as_master: PrefixCache | None = None) -> int:
        """Load the longest saved chain that is a prefix of `keys` and longer than `start`
        blocks; returns the number of blocks it covers (0: none usable).

        With `as_master`, `keys` are the master layout's keys: the file is checked against
        `as_master` (the master layout's cache) and its blocks are re-quantized into `cache`
        under `into_keys` (the same blocks' keys in cache's layout)."""
        source = cache if as_master is None else as_master
        for n in range(len(keys), start, -1):
            path = self.path_for(keys[n - 1])
            if not path.exists():
                continue
            try:
                rows, sinks = self._read(source, path, keys[:n])
                if as_master is None:
                    _install(cache, keys[:n], rows, sinks, source="disk")
                else:
                    _install(cache, into_keys[:n], rows, sinks, source="master", from_pools=as_master.pools)
            except PrefixFileError as exc:
                log.warning("ignoring cached prefix %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            except KVPoolFull as exc:
                log.info("cached prefix %s not loaded: %s", path, exc)
                continue
            except OSError as exc:
                log.warning("cannot read cached prefix %s: %s", path, exc)
                continue
            os.utime(path)
            if as_master is None:
                log.info("loaded %d cached tokens from %s", n * cache.B, path)
            else:
                log.info("derived %d cached tokens for %s from the 8-bit master copy %s", n * cache.B,
                         cache.config, path)
            return n
        return 0

    def saved_blocks(self, keys: list[bytes]) -> int:
        """Blocks of the longest chain prefix of `keys` that has a saved file (not validated)."""
        for n in range(len(keys), 0, -1):
            if self.path_for(keys[n - 1]).exists():
                return n
        return 0

    def _read(self, cache: PrefixCache, path: Path, keys: list[bytes]):
        """The checked blocks of a saved chain: (per layer (present flags, K rows, V rows), sinks).
        PrefixFileError for anything but a whole file this cache can take (OSError when it
        cannot be read)."""
        data = path.read_bytes()
        try:
            return self._parse(cache, data, keys)
        except PrefixFileError:
            raise
        except Exception as exc:  # a header of the right shape whose fields are not (foreign, damaged)
            raise PrefixFileError(f"unreadable ({type(exc).__name__}: {exc})") from None

    def _parse(self, cache: PrefixCache, data: bytes, keys: list[bytes]):
        if len(data) < 16 or data[:8] != _MAGIC:
            raise PrefixFileError("not a saved KV prefix")
        version, header_len = struct.unpack("<II", data[8:16])
        if version != FORMAT_VERSION:
            raise PrefixFileError(f"format version {version}, this build reads {FORMAT_VERSION}")
        try:
            header = json.loads(data[16 : 16 + header_len])
        except ValueError as exc:
            raise PrefixFileError(f"damaged header ({exc})") from None
        if not isinstance(header, dict):
            raise PrefixFileError("damaged header")
        payload = data[16 + header_len :]
        if header.get("model") != cache.model_id:
            raise PrefixFileError("saved for another model file")
        if header.get("layout") != cache.signature:
            raise PrefixFileError("saved with another KV layout")
        if header.get("keys") != [k.hex() for k in keys]:
            raise PrefixFileError("its block chain does not match the prompt")
        if header.get("payload_bytes") != len(payload):
            raise PrefixFileError(f"truncated ({len(payload)} of {header.get('payload_bytes')} payload bytes)")
        if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
            raise PrefixFileError("checksum mismatch")
        layers = header["layers"]
        if len(layers) != len(cache.pools):
            raise PrefixFileError("layer count differs")
        n = len(keys)
        offset = 0
        rows: list[tuple[list[bool], list[bytes], list[bytes]]] = []
        for pool, meta in zip(cache.pools, layers):
            if meta["k_row"] != pool.k_row_bytes or meta["v_row"] != pool.v_row_bytes or len(meta["present"]) != n:
                raise PrefixFileError("block sizes differ")
            present = [c == "1" for c in meta["present"]]
            m = sum(present)
            k = [payload[offset + j * pool.k_row_bytes : offset + (j + 1) * pool.k_row_bytes] for j in range(m)]
            offset += m * pool.k_row_bytes
            v = [payload[offset + j * pool.v_row_bytes : offset + (j + 1) * pool.v_row_bytes] for j in range(m)]
            offset += m * pool.v_row_bytes
            rows.append((present, k, v))
        sinks = None
        if header["sink_shape"]:
            Hkv, S, D = header["sink_shape"]
            Dv = header["sink_v_dim"]
            sinks = []
            for _ in cache.pools:
                sk = np.frombuffer(payload, np.float32, Hkv * S * D, offset).reshape(Hkv, S, D).copy()
                offset += sk.nbytes
                sv = np.frombuffer(payload, np.float32, Hkv * S * Dv, offset).reshape(Hkv, S, Dv).copy()
                offset += sv.nbytes
                sinks.append((sk, sv))
        if offset != len(payload):
            raise PrefixFileError("payload size does not match its layout")
        return rows, sinks


def _install(cache: PrefixCache, keys: list[bytes], rows, sinks, *, source: str,
             from_pools=None) -> None:
    """Put the blocks of a chain into `cache` as entries under `keys` (those already there are
    kept). rows: per layer (present flags per block, K rows, V rows of the present blocks, in
    chain order). from_pools: the pools whose formats the rows are in, when they are not
    cache's own (a master copy): each layer's rows are re-quantized into cache's formats.

    Raises KVPoolFull before anything changes when the pools cannot take the new blocks."""
    new = [i for i, key in enumerate(keys) if key not in cache.entries]
    row_of = [np.cumsum(present) - 1 for present, _, _ in rows]  # block i → its index in the rows
    needs = {layer: sum(1 for i in new if present[i]) for layer, (present, _, _) in enumerate(rows)}
    # Make room for the blocks first, so a full pool fails before anything changes.
    cache.evict(layer_needs=needs)
    if any(cache.pools[i].n_free < need for i, need in needs.items()):
        raise KVPoolFull("not enough free KV blocks to load the cached prefix")
    converted = []
    for layer, (present, k, v) in enumerate(rows):
        wanted = [int(row_of[layer][i]) for i in new if present[i]]
        if not wanted:
            converted.append({})
            continue
        k_rows = np.stack([np.frombuffer(k[j], np.uint8) for j in wanted])
        v_rows = np.stack([np.frombuffer(v[j], np.uint8) for j in wanted])
        if from_pools is not None:
            k_rows, v_rows = requantize_rows(from_pools[layer], k_rows, v_rows, cache.pools[layer],
                                             rotation=bool(cache.config.rotation))
        converted.append({j: (k_rows[r], v_rows[r]) for r, j in enumerate(wanted)})
    for i in new:
        blocks: list[int | None] = []
        for layer, (present, _, _) in enumerate(rows):
            if not present[i]:
                blocks.append(None)
                continue
            k_row, v_row = converted[layer][int(row_of[layer][i])]
            pool = cache.pools[layer]
            b = pool.allocate()
            pool.write_rows(b, k_row, v_row)
            blocks.append(b)
        copied = None
        if i == 0 and sinks is not None:
            copied = [(sk.copy(), sv.copy()) for sk, sv in sinks]
            if from_pools is not None and cache.config.rotation:  # a rotated layout stores f16(k @ H)
                H = hadamard(sinks[0][0].shape[-1])
                copied = [((sk @ H).astype(np.float16).astype(np.float32), sv) for sk, sv in copied]
        cache.entries[keys[i]] = Entry(keys[i], i, blocks, copied, source=source)
