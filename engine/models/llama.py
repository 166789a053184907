"""llama family: GQA, RoPE, RMSNorm, SwiGLU, tied or separate output.

The same decoder serves the llama-like architectures beside it (qwen2, qwen3): a subclass says
how its attention differs (rotation layout, q/k/v biases, per-head q/k norms) through the class
attributes of `Model`.

RoPE follows llama.cpp: base `rope.freq_base`, `rope.dimension_count` channels rotated, linear
scaling from `rope.scaling.*` (other scaling types are refused, see base.rope_freq_scale), and a
`rope_freqs` tensor (Llama 3.1/3.2) divides each pair's frequency.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gguf_file import GGUFFile
from ..kernels.norms import rms_norm
from ..kv.cache import KVCache, LayerKVCache
from ..weights import LinearGroup, WeightStore
from .base import BaseModel, GatedMLP, KVGeometry, Rope, rope_freq_scale, silu

ROPE_FREQS = "rope_freqs.weight"


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    rope_base: float
    rope_dim: int
    rope_freq_scale: float
    context_length: int

    @classmethod
    def from_gguf(cls, g: GGUFFile, arch: str = "llama") -> "ModelArgs":
        dim = int(g.require(f"{arch}.embedding_length"))
        n_heads = int(g.require(f"{arch}.attention.head_count"))
        head_dim = int(g.get(f"{arch}.attention.key_length", dim // n_heads))
        vocab = g.get(f"{arch}.vocab_size") or g.tensor_info("token_embd.weight").shape[0]
        return cls(
            dim=dim,
            n_layers=int(g.require(f"{arch}.block_count")),
            n_heads=n_heads,
            n_kv_heads=int(g.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn_dim=int(g.require(f"{arch}.feed_forward_length")),
            vocab_size=int(vocab),
            norm_eps=float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(g.get(f"{arch}.rope.dimension_count", head_dim)),
            rope_freq_scale=rope_freq_scale(g, arch),
            context_length=int(g.get(f"{arch}.context_length", 2048)),
        )

    def kv_geometry(self) -> KVGeometry:
        return KVGeometry(self.n_layers, self.n_kv_heads, self.head_dim, self.head_dim,
                          (None,) * self.n_layers, self.context_length)


class Attention:
    """q, k, v projections (+ biases where the file has them or the architecture requires them),
    optional per-head RMS norm of q and k before rotation, RoPE, attention, output projection."""

    def __init__(self, args: ModelArgs, w: WeightStore, prefix: str, rope: Rope, *,
                 biases: bool | None, qk_norm: bool):
        self.args = args
        self.rope = rope
        d, hd = args.dim, args.head_dim
        self.attn_q = w.linear(f"{prefix}.attn_q.weight", args.n_heads * hd, d)
        self.attn_k = w.linear(f"{prefix}.attn_k.weight", args.n_kv_heads * hd, d)
        self.attn_v = w.linear(f"{prefix}.attn_v.weight", args.n_kv_heads * hd, d)
        self.attn_output = w.linear(f"{prefix}.attn_output.weight", d, args.n_heads * hd)
        self.qkv = LinearGroup((self.attn_q, self.attn_k, self.attn_v))
        # biases=True: required (missing is an error); None: used when present; False: never read.
        self.bias_q = self.bias_k = self.bias_v = None
        if biases or (biases is None and w.has(f"{prefix}.attn_q.bias")):
            self.bias_q = w.vector(f"{prefix}.attn_q.bias", args.n_heads * hd)
            self.bias_k = w.vector(f"{prefix}.attn_k.bias", args.n_kv_heads * hd)
            self.bias_v = w.vector(f"{prefix}.attn_v.bias", args.n_kv_heads * hd)
        self.attn_q_norm = self.attn_k_norm = None
        if qk_norm:
            self.attn_q_norm = w.vector(f"{prefix}.attn_q_norm.weight", hd)
            self.attn_k_norm = w.vector(f"{prefix}.attn_k_norm.weight", hd)
        self.scale = 1.0 / np.sqrt(hd)

    def __call__(self, x: np.ndarray, rope_tables, cache: LayerKVCache) -> np.ndarray:
        a = self.args
        T = x.shape[0]
        q, k, v = self.qkv(x)  # x quantized once
        if self.bias_q is not None:
            q, k, v = q + self.bias_q, k + self.bias_k, v + self.bias_v
        q = q.reshape(T, a.n_heads, a.head_dim)  # (T, H, D)
        k = k.reshape(T, a.n_kv_heads, a.head_dim)  # (T, Hkv, D)
        v = v.reshape(T, a.n_kv_heads, a.head_dim)
        if self.attn_q_norm is not None:  # per head, over D
            q = rms_norm(q, self.attn_q_norm, a.norm_eps)
            k = rms_norm(k, self.attn_k_norm, a.norm_eps)
        q, k = self.rope.rotate(q, rope_tables), self.rope.rotate(k, rope_tables)
        o = cache.attend(q, k, v, scale=self.scale, window=None)  # (T, H, D)
        return self.attn_output(o.reshape(T, a.n_heads * a.head_dim))


class TransformerBlock:
    def __init__(self, args: ModelArgs, w: WeightStore, layer: int, rope: Rope, *,
                 biases: bool | None, qk_norm: bool):
        prefix = f"blk.{layer}"
        self.eps = args.norm_eps
        self.attn_norm = w.vector(f"{prefix}.attn_norm.weight", args.dim)
        self.ffn_norm = w.vector(f"{prefix}.ffn_norm.weight", args.dim)
        self.attention = Attention(args, w, prefix, rope, biases=biases, qk_norm=qk_norm)
        self.mlp = GatedMLP(args, w, prefix, silu)

    def __call__(self, x, rope_tables, cache: LayerKVCache) -> np.ndarray:
        x = x + self.attention(rms_norm(x, self.attn_norm, self.eps), rope_tables, cache)
        return x + self.mlp(rms_norm(x, self.ffn_norm, self.eps))


class Model(BaseModel):
    architecture = "llama"
    # How a llama-like architecture's attention differs; subclasses override.
    rope_neox = False  # llama GGUFs: the converter permuted Q/K rows for adjacent pairs
    attention_biases: bool | None = None  # None: q/k/v biases used when the file has them
    qk_norm = False

    def __init__(self, args: ModelArgs, w: WeightStore):
        self.args = args
        self.dim, self.n_layers = args.dim, args.n_layers
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = self.value_dim = args.head_dim
        self.vocab_size, self.context_length = args.vocab_size, args.context_length
        freq_factors = w.vector(ROPE_FREQS, args.rope_dim // 2) if w.has(ROPE_FREQS) else None
        self.rope = Rope(args.rope_dim, args.rope_base, args.rope_freq_scale, freq_factors, self.rope_neox)
        self.token_embd = w.embedding("token_embd.weight", args.vocab_size, args.dim)
        self.layers = [
            TransformerBlock(args, w, i, self.rope, biases=self.attention_biases, qk_norm=self.qk_norm)
            for i in range(args.n_layers)
        ]
        self.output_norm = w.vector("output_norm.weight", args.dim)
        if w.has("output.weight"):
            self.lm_head = w.linear("output.weight", args.vocab_size, args.dim)
        else:
            self.lm_head = self.token_embd.as_linear()

    @classmethod
    def args_from_gguf(cls, g: GGUFFile) -> ModelArgs:
        return ModelArgs.from_gguf(g, cls.architecture)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Model":
        return cls(cls.args_from_gguf(g), WeightStore(g))

    def hidden(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        a = self.args
        positions = cache.positions(tokens.shape[0])
        rope_tables = self.rope.tables(positions)
        x = self.token_embd.lookup(tokens)
        for layer, block in enumerate(self.layers):
            x = block(x, rope_tables, cache[layer])
        return rms_norm(x, self.output_norm, a.norm_eps)

    def output(self, h: np.ndarray) -> np.ndarray:
        return self.lm_head(h)

    def rerotate_keys(self, layer: int, keys: np.ndarray, by: np.ndarray) -> np.ndarray:
        return self.rope.rerotate(keys, by)
