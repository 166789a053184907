"""Intel AMX tiles (AMX-INT8) for the integer weight kernels: whether this process may use them,
and the LLVM IR of the tile instructions.

A tile register holds up to 16 rows of 64 bytes. `tdpb[su][su]d C, A, B` adds to each int32
C[m][n] the products of A's row m (K bytes) and B's column n, B laid out "VNNI-style": B row
k // 4 holds, at bytes 4n + k % 4, the value k of column n (so a 512-bit vector whose lane n holds
four consecutive codes of weight row n is one B row). One instruction is 16 x 16 x 64
multiply-adds, 16 times `vpdpbusd`'s; the sums are exact int32, so a kernel that forms the same
integer sums as the VNNI kernels gives the same bits after them.

Linux hands the tile state out on request only (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`, once
per process, for all its threads); without the grant the first tile instruction raises SIGILL.
`available()` asks for it and is the only gate. Each kernel call loads its tile shapes
(`ldtilecfg`) and releases the tiles at its end, so no thread keeps tile state between calls.
"""

from __future__ import annotations

import ctypes
import logging
import platform

from llvmlite import ir
from numba.core import cgutils

from .vector_ir import I8, I64

log = logging.getLogger("omlx.kernels")

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

_granted: bool | None = None


def _request_permission() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def available() -> bool:
    """Whether numba targets a CPU with AMX-INT8 and the kernel lets this process use the tiles
    (asked once; the grant lasts for the process)."""
    global _granted
    if _granted is None:
        from .vector_ir import _target_has

        _granted = (platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
                    and _target_has("amx-tile") and _target_has("amx-int8") and _request_permission())
        if not _granted and _target_has("amx-int8"):
            log.info("AMX-INT8 listed by the CPU but not granted to this process: not used")
    return _granted


# The 64-byte tile configuration (palette 1): byte 0 the palette, bytes 16 + 2t the bytes per row
# of tile t (uint16), byte 48 + t its rows.
def tile_config(shapes: dict[int, tuple[int, int]]) -> bytes:
    """{tile: (rows, bytes per row)} -> the configuration `ldtilecfg` reads (unlisted tiles unused)."""
    cfg = bytearray(64)
    cfg[0] = 1
    for tile, (rows, colsb) in shapes.items():
        cfg[16 + 2 * tile : 18 + 2 * tile] = colsb.to_bytes(2, "little")
        cfg[48 + tile] = rows
    return bytes(cfg)


class AmxIR:
    """The tile instructions over an llvmlite builder; tiles are numbers 0..7 (immediates)."""

    # (A signed?, B signed?) -> the instruction
    _DOTS = {(True, True): "llvm.x86.tdpbssd", (True, False): "llvm.x86.tdpbsud",
             (False, True): "llvm.x86.tdpbusd", (False, False): "llvm.x86.tdpbuud"}

    def __init__(self, builder):
        self.b = builder
        self._i8p = I8.as_pointer()

    def _call(self, name, args, types_):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ir.VoidType(), types_), name)
        return self.b.call(fn, args)

    def _ptr(self, p):
        return self.b.bitcast(p, self._i8p)

    def configure(self, shapes: dict[int, tuple[int, int]]):
        """ldtilecfg from a stack copy of `tile_config(shapes)`."""
        raw = tile_config(shapes)
        arr_t = ir.ArrayType(I8, 64)
        slot = cgutils.alloca_once(self.b, arr_t)
        slot.align = 64
        self.b.store(ir.Constant(arr_t, bytearray(raw)), slot)
        self._call("llvm.x86.ldtilecfg", [self._ptr(slot)], [self._i8p])

    def release(self):
        self._call("llvm.x86.tilerelease", [], [])

    def zero(self, tile: int):
        self._call("llvm.x86.tilezero", [ir.Constant(I8, tile)], [I8])

    def load(self, tile: int, ptr, stride):
        """Tile rows from ptr, ptr + stride, ... (stride an i64 IR value or int, bytes)."""
        stride = stride if isinstance(stride, ir.Value) else ir.Constant(I64, stride)
        self._call("llvm.x86.tileloadd64", [ir.Constant(I8, tile), self._ptr(ptr), stride], [I8, self._i8p, I64])

    def store(self, tile: int, ptr, stride):
        stride = stride if isinstance(stride, ir.Value) else ir.Constant(I64, stride)
        self._call("llvm.x86.tilestored64", [ir.Constant(I8, tile), self._ptr(ptr), stride], [I8, self._i8p, I64])

    def dot(self, c: int, a: int, b: int, a_signed: bool, b_signed: bool):
        """C[m][n] += sum over k of A[m][k] * B[k][n], bytes signed or unsigned as given."""
        self._call(self._DOTS[a_signed, b_signed], [ir.Constant(I8, c), ir.Constant(I8, a), ir.Constant(I8, b)],
                   [I8, I8, I8])
