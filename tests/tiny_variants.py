"""Variants of the tiny models of tiny_gguf.py: other architectures (qwen2, qwen3, llama with
rope_freqs or rope.scaling keys) and matrices stored in any GGUF tensor type.

A variant is written by copying a tiny llama file with gguf's reader and writer: metadata renamed
to the new architecture (plus extra keys), tensors re-typed, extra tensors added.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from .tiny_gguf import write_tiny_model

# Shapes whose every matrix row (dim, n_heads * head_dim, ffn_dim) is 256 values: one block of
# the 256-value super-block types, eight of the 32-value ones.
BLOCK_FRIENDLY = dict(dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256)

# Byte offsets of the float16 scale fields (d, and dmin where the type has one) in one block of
# the types gguf cannot quantize; every value of a block is linear in them.
_F16_SCALE_OFFSETS = {
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
    QT.IQ4_NL: (0,), QT.IQ4_XS: (0,), QT.IQ2_XXS: (0,), QT.IQ2_XS: (0,), QT.IQ2_S: (0,),
    QT.IQ3_XXS: (0,), QT.IQ3_S: (0,), QT.IQ1_S: (0,),
}


def _set_f16_scales(blocks: np.ndarray, qtype: QT, d: np.ndarray) -> None:
    """Write per-block scales d (n_blocks,) into blocks (n_blocks, type_size) uint8 in place."""
    bits = d.astype(np.float16).view(np.uint16)
    if qtype == QT.IQ1_M:
        # IQ1_M keeps its f16 d in the top nibbles of its four uint16 sub-block scales (the last
        # 8 bytes of the block): nibble k of d's bits is the top nibble of scales[k].
        scales = blocks[:, -8:].copy().view(np.uint16)  # (n_blocks, 4)
        for k in range(4):
            scales[:, k] = (scales[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[:, -8:] = scales.view(np.uint8)
        return
    for off in _F16_SCALE_OFFSETS[qtype]:
        blocks[:, off : off + 2] = bits.view(np.uint8).reshape(-1, 2)


def random_blocks(values: np.ndarray, qtype: QT, rng: np.random.Generator, rms: float = 0.05) -> np.ndarray:
    """Blocks of `qtype` for a (rows, cols) matrix: gguf's quantization of `values` where gguf
    has a quantizer, else random codes with sane per-block scales (dequantized rms ≈ `rms`)."""
    rows, cols = values.shape
    try:
        return quantize(values.astype(np.float32), qtype)
    except NotImplementedError:
        pass
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    if qtype == QT.NVFP4:
        # four unsigned E4M3 sub-block scales lead the block: small exponents (values ~1e-2)
        raw[:, :4] = rng.integers(0x08, 0x18, size=(raw.shape[0], 4), dtype=np.uint8)
    else:
        _set_f16_scales(raw, qtype, np.ones(raw.shape[0], np.float32))
        unit = dequantize(raw.reshape(rows, -1), qtype)
        spread = rng.uniform(0.5, 1.5, raw.shape[0])
        _set_f16_scales(raw, qtype, spread * rms / max(float(np.sqrt(np.mean(unit**2))), 1e-6))
    raw = raw.reshape(rows, -1)
    out = dequantize(raw, qtype)
    assert np.isfinite(out).all() and 0 < np.abs(out).max() < 10, (qtype.name, np.abs(out).max())
    return raw


def rewrite(src: Path, dst: Path, *, arch: str | None = None, matrix_type: QT | None = None,
            extra_tensors: dict[str, np.ndarray] | None = None, extra_metadata: dict | None = None,
            seed: int = 0) -> Path:
    """Copy the GGUF `src` to `dst`: metadata keys moved to `arch`, every 2-D tensor stored as
    `matrix_type` (blocks from random_blocks), `extra_tensors` (float32) and `extra_metadata`
    (key → value; str/int/float/bool) added."""
    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(str(src))
    src_arch = reader.fields["general.architecture"].contents()
    arch = arch or src_arch
    w = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name.startswith(src_arch + "."):
            name = arch + name[len(src_arch):]
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for key, value in (extra_metadata or {}).items():
        key = key.replace("{arch}", arch)
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        values = dequantize(t.data, t.tensor_type).reshape(shape)
        if matrix_type is not None and len(shape) == 2 and matrix_type != QT.F32:
            w.add_tensor(t.name, random_blocks(values, matrix_type, rng), raw_dtype=matrix_type)
        else:
            w.add_tensor(t.name, np.ascontiguousarray(values, dtype=np.float32))
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def write_variant(path: Path, variant: str, *, seed: int = 0, **tiny_options) -> Path:
    """A tiny random model of `variant`: "llama", "qwen2" (q/k/v biases), "qwen3" (q/k norms),
    "llama3rope" (llama with a rope_freqs tensor of Llama 3's shape of divisors)."""
    path = Path(path)
    src = write_tiny_model(path.with_suffix(".src.gguf"), "llama", seed=seed, **tiny_options)
    g = gguf.GGUFReader(str(src))
    n_heads = int(g.fields["llama.attention.head_count"].contents())
    n_kv = int(g.fields["llama.attention.head_count_kv"].contents())
    head_dim = int(g.fields["llama.attention.key_length"].contents())
    rng = np.random.default_rng(seed + 100)
    extra: dict[str, np.ndarray] = {}
    n_layers = int(g.fields["llama.block_count"].contents())
    arch = {"llama3rope": "llama"}.get(variant, variant)
    if variant == "qwen2":
        for i in range(n_layers):
            extra[f"blk.{i}.attn_q.bias"] = rng.normal(0, 0.1, n_heads * head_dim)
            extra[f"blk.{i}.attn_k.bias"] = rng.normal(0, 0.1, n_kv * head_dim)
            extra[f"blk.{i}.attn_v.bias"] = rng.normal(0, 0.1, n_kv * head_dim)
    elif variant == "qwen3":
        for i in range(n_layers):
            extra[f"blk.{i}.attn_q_norm.weight"] = 1.0 + rng.normal(0, 0.1, head_dim)
            extra[f"blk.{i}.attn_k_norm.weight"] = 1.0 + rng.normal(0, 0.1, head_dim)
    elif variant == "llama3rope":
        # divisors 1 (high frequencies) .. 8 (low), as Llama 3's scaling gives
        extra["rope_freqs.weight"] = np.geomspace(1.0, 8.0, head_dim // 2)
    elif variant != "llama":
        raise ValueError(f"unknown tiny variant {variant!r}")
    out = rewrite(src, path, arch=arch, extra_tensors=extra, seed=seed)
    src.unlink()
    return out
