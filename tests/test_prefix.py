"""Prefix cache, eviction, disk persistence and the overflow policies, on tiny random models."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from engine.gguf_file import GGUFFile
from engine.kernels.norms import apply_rope
from engine.kv.config import parse_kv
from engine.errors import ContextFull, KVPoolFull
from engine.kv.prefix import PrefixCache, PrefixDiskStore, layout_signature
from engine.models import load_model
from engine.models.base import rope_tables

from .tiny_gguf import write_tiny_model

SPEC = "k8v8,bs=8"


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    # gemma3 with 6 layers: five sliding-window layers and one global one.
    n_layers = 6 if request.param == "gemma3" else 2
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf", request.param,
                            n_layers=n_layers)
    return load_model(GGUFFile(path))


def make_cache(model, spec=SPEC, *, capacity=512, disk=None, model_id="model-a"):
    return PrefixCache(model, parse_kv(spec), model_id=model_id, capacity_tokens=capacity, disk=disk)


def tokens(n, seed=0, vocab=200):
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def prefill(model, seq, ids, chunk=16):
    out = []
    for s in range(0, len(ids), chunk):
        out.append(model.forward(np.asarray(ids[s : s + chunk]), seq, "all"))
    return np.concatenate(out)


# -- hash chain ------------------------------------------------------------------------------
def test_chain_keys_depend_on_prefix_model_and_layout(tiny):
    a = make_cache(tiny)
    ids = tokens(40)
    keys = a.chain_keys(ids)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert a.chain_keys(ids + tokens(7, seed=9)) == keys  # a longer prompt shares every full block
    changed = list(ids)
    changed[20] += 1  # block 2
    other = a.chain_keys(changed)
    assert other[:2] == keys[:2] and all(x != y for x, y in zip(other[2:], keys[2:]))
    for variant in (make_cache(tiny, model_id="model-b"), make_cache(tiny, "k6v4,bs=8"),
                    make_cache(tiny, "k8v8,bs=8,rot"), make_cache(tiny, "k8v8,0:k4v4,bs=8")):
        assert not set(variant.chain_keys(ids)) & set(keys)
    assert make_cache(tiny, "k8v8,bs=16").chain_keys(ids)[0] not in keys
    assert layout_signature(parse_kv(SPEC), tiny.n_layers) == a.signature


# -- reuse -----------------------------------------------------------------------------------
def test_attached_prefix_gives_the_same_logits(tiny):
    cache = make_cache(tiny)
    ids = tokens(70, seed=1)
    first = cache.new_sequence()
    expected = prefill(tiny, first, ids)
    assert first.n_published == 8 and len(cache.entries) == 8
    second = cache.new_sequence()
    reuse = cache.attach(second, ids)
    assert reuse.tokens == 64 and reuse.source == "memory"
    got = prefill(tiny, second, ids[64:])
    np.testing.assert_allclose(got, expected[64:], rtol=1e-4, atol=1e-4)
    # Shared blocks exist once: both sequences hold the same pool rows for the full layers.
    for layer0, layer1 in zip(first.layers, second.layers):
        if layer0.window is None:
            assert layer1.block_table[:8] == layer0.block_table[:8]


def test_whole_prompt_cached_still_leaves_one_token(tiny):
    cache = make_cache(tiny)
    ids = tokens(48, seed=2)
    # Chunks of one block: a sliding-window layer releases a block only after it was published.
    prefill(tiny, cache.new_sequence(), ids, chunk=8)
    seq = cache.new_sequence()
    assert cache.attach(seq, ids).tokens == 40  # block 5 would leave nothing to compute logits from


# -- LRU, pins -------------------------------------------------------------------------------
def test_lru_evicts_unused_tails_first_and_never_pinned_or_in_use(tiny):
    cache = make_cache(tiny, capacity=8 * 12)  # 12 blocks per layer
    a, b = tokens(33, seed=3), tokens(33, seed=4)  # 4 full blocks each
    seq_a = cache.new_sequence()
    prefill(tiny, seq_a, a)
    keys_a = list(seq_a.chain_keys)
    seq_a.release()
    seq_b = cache.new_sequence()
    prefill(tiny, seq_b, b)
    keys_b = list(seq_b.chain_keys)
    seq_b.release()
    # a was released first, tail first: a's tail is the least recently used entry.
    order = list(cache.entries)
    assert order.index(keys_a[3]) < order.index(keys_a[0]) < order.index(keys_b[3])
    cache.evict({0: cache.pools[0].n_free + 2})
    assert keys_a[3] not in cache.entries and keys_a[2] not in cache.entries
    assert keys_a[0] in cache.entries and all(k in cache.entries for k in keys_b)
    # Pinned and in-use entries survive any demand.
    cache.pin(keys_b[:2])
    user = cache.new_sequence()
    assert cache.attach(user, a[:17]).tokens == 16  # a's blocks 0-1, now in use
    cache.evict({0: 10**6})
    # A sliding-window layer at position 16 no longer needs block 0; with no full-attention
    # layer (the tiny gemma3) nobody uses block 0 and it may go.
    in_use = set(keys_a[:2]) if any(layer.window is None for layer in user.layers) else {keys_a[1]}
    assert set(cache.entries) == set(keys_b[:2]) | in_use
    user.release()
    cache.unpin(keys_b[:2])
    cache.evict({0: 10**6})
    assert not cache.entries
    assert cache.pools[0].n_used == 0


def test_a_full_pool_evicts_cached_blocks_for_a_new_sequence(tiny):
    cache = make_cache(tiny, capacity=8 * 6)
    seq = cache.new_sequence()
    prefill(tiny, seq, tokens(40, seed=5))
    seq.release()
    assert len(cache.entries) == 5
    other = cache.new_sequence()
    prefill(tiny, other, tokens(40, seed=6))  # needs 5 blocks: 4 of the old 5 must go
    assert other.offset == 40
    cache.pin(list(other.chain_keys))
    other.release()
    third = cache.new_sequence()
    with pytest.raises(KVPoolFull):
        prefill(tiny, third, tokens(40, seed=7))


# -- budget questions ------------------------------------------------------------------------
def test_pinned_blocks_and_sequence_references_are_what_a_budget_can_lend(tiny):
    from engine.serve.budget import KVBudget

    cache = make_cache(tiny, capacity=8 * 12)  # 12 blocks per layer
    ids = tokens(33, seed=12)  # 4 full blocks
    seq = cache.new_sequence()
    prefill(tiny, seq, ids, chunk=8)  # blocks published before a window layer lets them go
    keys = list(seq.chain_keys)
    assert cache.cached_keys(ids) == keys and cache.cached_keys(ids[:20]) == keys[:2]
    held = sum(len(layer.block_table) for layer in seq.layers)
    assert held > 0 and cache.sequence_blocks() == held  # the cache's own references not counted
    budget = KVBudget(8 * 12, 8)
    assert budget.max_blocks == 12 and budget.capacity_bytes(cache) == 12 * cache.block_bytes
    assert budget.fits(90, 6) and not budget.fits(90, 14)  # 96 tokens: 12 blocks; 104: 13
    assert budget.admits(8, 4, cache) and not budget.admits(9, 4, cache)
    cache.pin(keys[:3])
    assert cache.pinned_blocks() == 3 and cache.pinned_tokens() == 24
    assert budget.admits(5, 4, cache) and not budget.admits(6, 4, cache)  # 12 - 3 pinned
    seq.release()
    assert cache.sequence_blocks() == 0 and len(cache.entries) == 4  # cached, held by no sequence
    if all(w is None for w in cache.windows):  # every entry holds a block in every layer
        assert cache.nbytes == len(cache.entries) * cache.block_bytes
    cache.evict({0: 10**6})
    assert cache.cached_keys(ids) == keys[:3] and cache.pinned_blocks() == 3
    cache.unpin(keys[:3])
    assert cache.pinned_blocks() == 0 and budget.admits(8, 4, cache)


def test_the_scheduler_sizes_the_engines_prefix_pools_to_its_kv_budget(tmp_path):
    from engine.engine import Engine
    from engine.serve.scheduler import Scheduler, ServeLimits

    engine = Engine.load(write_tiny_model(tmp_path / "m.gguf", "llama", context_length=256), kv=SPEC)
    engine.disk_cache = False
    assert engine.prefixes.capacity_tokens == 512  # twice the model's context by default
    scheduler = Scheduler(engine, ServeLimits(ctx=64, max_batch=3))
    assert scheduler.budget.kv_tokens == 192 and scheduler.budget.max_blocks == 24
    pools = engine.prefix_cache().pools
    assert all(p.max_blocks == 24 for p in pools)
    with pytest.raises(ValueError, match="at least one token"):
        engine.prefixes.set_capacity_tokens(0)


# -- disk ------------------------------------------------------------------------------------
def test_disk_round_trip_and_damaged_files_are_ignored(tiny, tmp_path, caplog):
    disk = PrefixDiskStore(tmp_path / "prefixes")
    ids = tokens(70, seed=8)
    cache = make_cache(tiny, disk=disk)
    seq = cache.new_sequence()
    expected = prefill(tiny, seq, ids)
    path = cache.save(list(seq.chain_keys))
    assert path is not None and path.exists()

    fresh = make_cache(tiny, disk=disk)
    seq2 = fresh.new_sequence()
    reuse = fresh.attach(seq2, ids)
    assert (reuse.tokens, reuse.disk_tokens, reuse.source) == (64, 64, "disk")
    np.testing.assert_allclose(prefill(tiny, seq2, ids[64:]), expected[64:], rtol=1e-4, atol=1e-4)
    for layer, (p0, p1) in enumerate(zip(cache.pools, fresh.pools)):
        e0, e1 = cache.entries[seq.chain_keys[7]], fresh.entries[seq.chain_keys[7]]
        if e0.blocks[layer] is not None:
            assert np.array_equal(p0.k_row(e0.blocks[layer]), p1.k_row(e1.blocks[layer]))

    good = path.read_bytes()
    for damage in (good[:-100], good[:-50] + bytes([good[-50] ^ 0xFF]) + good[-49:], b"not a prefix file"):
        path.write_bytes(damage)
        other = make_cache(tiny, disk=disk)
        with caplog.at_level(logging.WARNING, logger="omlx.kv.prefix"):
            caplog.clear()
            assert other.attach(other.new_sequence(), ids).tokens == 0
        assert "ignoring cached prefix" in caplog.text
        assert not path.exists()  # never trusted again


def test_a_saved_file_with_a_foreign_header_is_skipped_not_raised(tiny, tmp_path, caplog):
    """Right magic and version, a header that is not what this build writes (a list; the right
    model, layout and keys but fields missing or of the wrong type): ignored with a warning and
    removed, like any damaged file; the prompt is prefilled instead."""
    import json as json_module
    import struct

    from engine.kv.prefix import FORMAT_VERSION

    disk = PrefixDiskStore(tmp_path / "prefixes")
    ids = tokens(40, seed=14)
    cache = make_cache(tiny, disk=disk)
    seq = cache.new_sequence()
    prefill(tiny, seq, ids)
    path = cache.save(list(seq.chain_keys))
    good = path.read_bytes()
    header_len = struct.unpack("<II", good[8:16])[1]
    header = json_module.loads(good[16 : 16 + header_len])
    for foreign in ([1, 2], dict(header, layers=None), {k: v for k, v in header.items() if k != "sink_shape"},
                    dict(header, layers=[{"k_row": "x"}] * len(header["layers"]))):
        body = json_module.dumps(foreign).encode()
        path.write_bytes(b"OMLXKVP\0" + struct.pack("<II", FORMAT_VERSION, len(body)) + body
                         + good[16 + header_len :])
        fresh = make_cache(tiny, disk=disk)
        with caplog.at_level(logging.WARNING, logger="omlx.kv.prefix"):
            caplog.clear()
            assert fresh.attach(fresh.new_sequence(), ids + [5]).tokens == 0  # the whole saved chain asked
        assert "ignoring cached prefix" in caplog.text
        assert not path.exists()


def test_disk_budget_removes_least_recently_used(tiny, tmp_path):
    disk = PrefixDiskStore(tmp_path / "p", budget_bytes=1)
    cache = make_cache(tiny, disk=disk)
    paths = []
    for seed in (10, 11):
        seq = cache.new_sequence()
        prefill(tiny, seq, tokens(24, seed=seed))
        paths.append(cache.save(list(seq.chain_keys)))
        seq.release()
    assert not paths[0].exists() and paths[1].exists()  # the newest stays even over budget


FULL_DISK_SCRIPT = """
import logging, os, resource, signal, sys
import numpy as np
from pathlib import Path
from engine.gguf_file import GGUFFile
from engine.kv.config import parse_kv
from engine.kv.prefix import PrefixCache, PrefixDiskStore
from engine.models import load_model
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
model = load_model(GGUFFile(sys.argv[1]))
folder = Path(sys.argv[2])
ids = np.random.default_rng(8).integers(3, 200, size=70).tolist()
cache = PrefixCache(model, parse_kv("k8v8,bs=8"), model_id="m", capacity_tokens=512, disk=PrefixDiskStore(folder))
seq = cache.new_sequence()
for s in range(0, len(ids), 16):
    model.forward(np.asarray(ids[s : s + 16]), seq, "all")
# the disk "fills up": writes past 4 KiB fail with EFBIG (the signal would kill the process)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
print("saved:", cache.save(list(seq.chain_keys)))
print("left:", sorted(p.name for p in folder.glob("*")))
again = cache.new_sequence()
print("reused:", cache.attach(again, ids).tokens)  # the blocks are still in memory
again.release()
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space again: the same save goes through
print("saved again:", cache.save(list(seq.chain_keys)) is not None)
"""


@pytest.mark.skipif(not hasattr(__import__("resource"), "RLIMIT_FSIZE"), reason="no file size limit here")
def test_a_full_disk_during_a_prefix_save_loses_nothing_and_leaves_no_partial_file(tiny, tmp_path):
    """The save fails with a warning (EFBIG under RLIMIT_FSIZE: a real write error, in a process of
    its own), no temporary file is left behind, the prefix is still reused from memory, and the
    next save succeeds once there is room."""
    import subprocess
    import sys

    arch = "gemma3" if len(tiny.layers) == 6 else "llama"
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_layers=len(tiny.layers))
    folder = tmp_path / "prefixes"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(path), str(folder)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "saved: None" in out and "cannot save the cached prefix" in out, out
    assert "left: []" in out, out  # no partial .tmp file
    assert "reused: 64" in out and "saved again: True" in out, out
    assert len(list(folder.glob("*.tmp"))) == 0 and len(list(folder.glob("*"))) == 1


def test_a_killed_saves_partial_file_is_swept_and_a_live_ones_kept(tiny, tmp_path):
    import subprocess
    import sys

    disk = PrefixDiskStore(tmp_path / "prefixes")
    disk.directory.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that has exited
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_tmp = disk.directory / f"{'ab' * 32}.kvprefix.{gone}.tmp"
        live_tmp = disk.directory / f"{'cd' * 32}.kvprefix.{live.pid}.tmp"
        dead_tmp.write_bytes(b"partial")
        live_tmp.write_bytes(b"being written")
        cache = make_cache(tiny, disk=disk)
        seq = cache.new_sequence()
        prefill(tiny, seq, tokens(24, seed=12))
        assert cache.save(list(seq.chain_keys)) is not None  # the first save sweeps
        assert not dead_tmp.exists() and live_tmp.exists()
    finally:
        live.kill()
        live.wait()


# -- dropping tokens -------------------------------------------------------------------------
def test_rerotation_moves_keys_to_their_new_position(tiny):
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((5, tiny.n_kv_heads, tiny.head_dim)).astype(np.float32)
    pos = np.array([40, 41, 57, 90, 100])
    a = tiny.args
    if tiny.architecture == "gemma3":
        cases = [(i, (a.rope_base_global, a.rope_freq_scale_global) if a.is_global(i) else (a.rope_base_local, 1.0))
                 for i in range(tiny.n_layers)]
        neox = True
    else:
        cases, neox = [(0, (a.rope_base, a.rope_freq_scale))], False
    for layer, (base, scale) in cases:
        at = lambda p: apply_rope(raw, *rope_tables(p, tiny.head_dim, base, scale), neox=neox)
        moved = tiny.rerotate_keys(layer, at(pos), -np.full(5, 24))
        np.testing.assert_allclose(moved, at(pos - 24), atol=1e-4)


@pytest.mark.parametrize("policy", ["rolling", "attention"])
def test_overflow_keeps_the_protected_prefix_and_positions_bounded(tiny, policy):
    cache = make_cache(tiny, "k8v4,bs=8", capacity=4096)
    seq = cache.new_sequence(limit=64, overflow=policy, protected_tokens=16)
    ids = tokens(16, seed=12)
    prefill(tiny, seq, ids)
    protected = [list(layer.block_table[:2]) for layer in seq.layers if layer.window is None]
    rng = np.random.default_rng(1)
    for step in range(150):
        logits = tiny.forward(np.asarray([int(rng.integers(3, 200))]), seq, "last")
        assert np.isfinite(logits).all()
        assert seq.offset <= 64
    assert seq.dropped_tokens >= 100
    assert [list(layer.block_table[:2]) for layer in seq.layers if layer.window is None] == protected
    assert seq.token_ids[:16] == ids
    assert len(seq.history) == seq.offset + seq.dropped_tokens


def test_stop_policy_raises_context_full(tiny):
    seq = make_cache(tiny).new_sequence(limit=32, overflow="stop")
    prefill(tiny, seq, tokens(32, seed=13))
    with pytest.raises(ContextFull):
        tiny.forward(np.asarray([5]), seq, "last")
    roll = make_cache(tiny).new_sequence(limit=32, overflow="rolling", protected_tokens=30)
    prefill(tiny, roll, tokens(32, seed=13), chunk=8)
    with pytest.raises(ContextFull, match="pinned"):
        tiny.forward(np.asarray([5]), roll, "last")


def test_dropping_with_16_bit_kv_matches_rotating_by_hand(tiny):
    cache = make_cache(tiny, "f16,bs=8", capacity=4096)
    seq = cache.new_sequence()
    prefill(tiny, seq, tokens(44, seed=14))
    layer = next(i for i, c in enumerate(seq.layers) if c.window is None)
    lc = seq.layers[layer]
    k_before, _ = lc.pool.dequantize(lc.block_table)  # (5, Hkv, 8, D)
    tail_before = lc.tail_k[:, : lc.n_tail].copy()
    seq.drop_blocks(np.array([1, 2]))
    assert seq.offset == 28 and lc.n_tail == 4 and len(lc.block_table) == 3
    k_after, _ = lc.pool.dequantize(lc.block_table)
    np.testing.assert_array_equal(k_after[0], k_before[0])  # block 0 did not move
    for new, old in ((1, 3), (2, 4)):
        toks = k_before[old].transpose(1, 0, 2)  # (8, Hkv, D)
        want = tiny.rerotate_keys(layer, toks, -np.full(8, 16)).transpose(1, 0, 2)
        np.testing.assert_allclose(k_after[new], want, atol=2e-3, rtol=2e-3)
    want_tail = tiny.rerotate_keys(layer, tail_before.transpose(1, 0, 2), -np.full(4, 16)).transpose(1, 0, 2)
    np.testing.assert_allclose(lc.tail_k[:, :4], want_tail, atol=2e-3, rtol=2e-3)
