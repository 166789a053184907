"""Write tiny random-weight GGUF models (llama or gemma3) for shape, equivalence and error tests.

The vocabulary is byte-level BPE over the 256 byte symbols plus a few merges and the control
tokens a chat model has, so the real tokenizer code path builds from it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as QT

_BYTE_SYMBOLS = None


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    global _BYTE_SYMBOLS
    if _BYTE_SYMBOLS is None:
        keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
        mapping, extra = {}, 0
        for b in range(256):
            if b in keep:
                mapping[b] = chr(b)
            else:
                mapping[b] = chr(256 + extra)
                extra += 1
        _BYTE_SYMBOLS = [mapping[b] for b in range(256)]
    return _BYTE_SYMBOLS


def _store(writer: gguf.GGUFWriter, name: str, value: np.ndarray, qtype: QT) -> None:
    if qtype == QT.F32:
        writer.add_tensor(name, value.astype(np.float32))
    elif qtype == QT.F16:
        writer.add_tensor(name, value.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), qtype), raw_dtype=qtype)


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    *,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 32,
    ffn_dim: int = 128,
    context_length: int = 256,
    sliding_window: int = 8,
    weight_type: QT = QT.F32,
    seed: int = 0,
    skip_tensors: tuple[str, ...] = (),
    chat_template: str | None = None,
    extra_tokens: tuple[str, ...] = (),
    embedding_scale: float = 0.5,
) -> Path:
    """A random-weight model of `arch` written to `path`. Matrices in `weight_type`
    (rows of `dim`/`ffn_dim` values must be multiples of the type's block size); `extra_tokens`
    appended to the vocabulary (another vocabulary, for the draft model's check). With the default
    `embedding_scale` the residual stream is mostly the token's own embedding, so greedy decoding
    mostly repeats the last token; a small one lets the layers decide."""
    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_symbols() + ["Ġt", "he", "Ġthe", *extra_tokens]
    token_types = [3, 3, 3] + [1] * (len(tokens) - 3)
    merges = ["Ġ t", "h e", "Ġt he"]
    vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)
    else:
        w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)

    def mat(rows, cols, scale=0.08):
        return rng.standard_normal((rows, cols)).astype(np.float32) * scale

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors: dict[str, tuple[np.ndarray, QT]] = {
        "token_embd.weight": (mat(vocab, dim, embedding_scale), QT.F32),
        "output_norm.weight": (norm(dim), QT.F32),
    }
    for i in range(n_layers):
        p = f"blk.{i}"
        tensors.update({
            f"{p}.attn_norm.weight": (norm(dim), QT.F32),
            f"{p}.attn_q.weight": (mat(n_heads * head_dim, dim), weight_type),
            f"{p}.attn_k.weight": (mat(n_kv_heads * head_dim, dim), weight_type),
            f"{p}.attn_v.weight": (mat(n_kv_heads * head_dim, dim), weight_type),
            f"{p}.attn_output.weight": (mat(dim, n_heads * head_dim), weight_type),
            f"{p}.ffn_norm.weight": (norm(dim), QT.F32),
            f"{p}.ffn_gate.weight": (mat(ffn_dim, dim), weight_type),
            f"{p}.ffn_up.weight": (mat(ffn_dim, dim), weight_type),
            f"{p}.ffn_down.weight": (mat(dim, ffn_dim), weight_type),
        })
        if arch == "gemma3":
            tensors.update({
                f"{p}.attn_q_norm.weight": (norm(head_dim), QT.F32),
                f"{p}.attn_k_norm.weight": (norm(head_dim), QT.F32),
                f"{p}.post_attention_norm.weight": (norm(dim), QT.F32),
                f"{p}.post_ffw_norm.weight": (norm(dim), QT.F32),
            })
    for name, (value, qtype) in tensors.items():
        if name not in skip_tensors:
            _store(w, name, value, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
