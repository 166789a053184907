"""engine.memory's huge-page arena: where a model's repacked weight matrices live."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from engine.engine import Engine
from engine.kernels import int_dot
from engine.memory import HUGE_PAGE, HugePageArena
from engine.weights import linear_layers

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages here")


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arrays_are_aligned_apart_and_fall_back_to_numpy_when_the_arena_is_full():
    arena = HugePageArena.for_bytes(3 * 1000 + 24, arrays=3)
    a = arena.empty((10, 100))
    b = arena.empty((250,), np.float32)
    c = arena.empty((7, 3))
    assert a.ctypes.data % HUGE_PAGE == 0  # the first array starts a 2 MiB page
    assert b.ctypes.data % 64 == 0 and c.ctypes.data % 64 == 0
    assert a.ctypes.data + a.nbytes <= b.ctypes.data and b.ctypes.data + b.nbytes <= c.ctypes.data
    assert all(arena.holds(x) for x in (a, b, c)) and a.flags.c_contiguous and b.dtype == np.float32
    a[:] = 1
    b[:] = 2.5
    c[:] = 3
    assert a.sum() == 1000 and b.sum() == 625 and c.sum() == 63  # written apart
    spill = arena.empty((2000,))  # past the capacity: numpy's memory, not an overlap
    assert spill.shape == (2000,) and not arena.holds(spill)
    assert HugePageArena.for_bytes(0) is None


def test_the_arena_is_advised_for_huge_pages_and_outlives_its_owner():
    arena = HugePageArena.for_bytes(4 * HUGE_PAGE)
    x = arena.empty((4 * HUGE_PAGE,))
    assert "hg" in _mapping_flags(x.ctypes.data)  # MADV_HUGEPAGE on the mapping
    del arena  # a view keeps the mapping
    x[:] = 9
    assert int(x[::4096].sum()) == 9 * (4 * HUGE_PAGE // 4096)


@pytest.mark.skipif(not int_dot.ISA_LANES or int_dot.kernel_isa() not in int_dot.ISA_LANES,
                    reason="no integer kernels on this CPU")
def test_a_models_repacked_matrices_share_one_huge_page_mapping(smollm2_path):
    eng = Engine.load(smollm2_path)
    packed = [lin._int.packed for lin in linear_layers(eng.model) if getattr(lin, "_int", None) is not None]
    assert len(packed) >= 7 * 30  # every layer's matrices
    starts = sorted(p.ctypes.data for p in packed)
    first, last = starts[0], starts[-1]
    assert first % HUGE_PAGE == 0 and all(s % 64 == 0 for s in starts)
    assert _mapping_flags(first) == _mapping_flags(last) and "hg" in _mapping_flags(last)
    # one mapping: no other mapping starts between the first matrix and the last
    spans = [tuple(int(a, 16) for a in line.split()[0].split("-")) for line in open("/proc/self/maps")]
    assert [s for s in spans if s[0] <= first < s[1]] == [s for s in spans if s[0] <= last < s[1]]
