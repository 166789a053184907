"""llama family: GQA, RoPE on adjacent pairs, RMSNorm, SwiGLU, tied or separate output."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gguf_file import GGUFFile
from ..kv.cache import KVCache, LayerKVCache
from ..weights import WeightStore
from .base import BaseModel, KVGeometry, apply_rope, rms_norm, rope_tables, silu


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
        scaling = g.get(f"{arch}.rope.scaling.type", "none")
        factor = float(g.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
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
            rope_freq_scale=1.0 / factor if scaling == "linear" else 1.0,
            context_length=int(g.get(f"{arch}.context_length", 2048)),
        )


    def kv_geometry(self) -> KVGeometry:
        return KVGeometry(self.n_layers, self.n_kv_heads, self.head_dim, self.head_dim,
                          (None,) * self.n_layers, self.context_length)


class Attention:
    def __init__(self, args: ModelArgs, w: WeightStore, prefix: str):
        self.args = args
        d, hd = args.dim, args.head_dim
        self.attn_q = w.linear(f"{prefix}.attn_q.weight", args.n_heads * hd, d)
        self.attn_k = w.linear(f"{prefix}.attn_k.weight", args.n_kv_heads * hd, d)
        self.attn_v = w.linear(f"{prefix}.attn_v.weight", args.n_kv_heads * hd, d)
        self.attn_output = w.linear(f"{prefix}.attn_output.weight", d, args.n_heads * hd)
        self.scale = 1.0 / np.sqrt(hd)

    def __call__(self, x: np.ndarray, rope: tuple[np.ndarray, np.ndarray], cache: LayerKVCache) -> np.ndarray:
        a = self.args
        T = x.shape[0]
        q = self.attn_q(x).reshape(T, a.n_heads, a.head_dim)  # (T, H, D)
        k = self.attn_k(x).reshape(T, a.n_kv_heads, a.head_dim)  # (T, Hkv, D)
        v = self.attn_v(x).reshape(T, a.n_kv_heads, a.head_dim)
        cos, sin = rope
        r = a.rope_dim
        if r == a.head_dim:
            q, k = apply_rope(q, cos, sin, neox=False), apply_rope(k, cos, sin, neox=False)
        else:  # partial rotary: only the first rope_dim channels rotate
            q = np.concatenate([apply_rope(q[..., :r], cos, sin, False), q[..., r:]], axis=-1)
            k = np.concatenate([apply_rope(k[..., :r], cos, sin, False), k[..., r:]], axis=-1)
        o = cache.attend(q, k, v, scale=self.scale, window=None)  # (T, H, D)
        return self.attn_output(o.reshape(T, a.n_heads * a.head_dim))


class MLP:
    def __init__(self, args: ModelArgs, w: WeightStore, prefix: str):
        self.ffn_gate = w.linear(f"{prefix}.ffn_gate.weight", args.ffn_dim, args.dim)
        self.ffn_up = w.linear(f"{prefix}.ffn_up.weight", args.ffn_dim, args.dim)
        self.ffn_down = w.linear(f"{prefix}.ffn_down.weight", args.dim, args.ffn_dim)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.ffn_down(silu(self.ffn_gate(x)) * self.ffn_up(x))


class TransformerBlock:
    def __init__(self, args: ModelArgs, w: WeightStore, layer: int):
        prefix = f"blk.{layer}"
        self.eps = args.norm_eps
        self.attn_norm = w.vector(f"{prefix}.attn_norm.weight", args.dim)
        self.ffn_norm = w.vector(f"{prefix}.ffn_norm.weight", args.dim)
        self.attention = Attention(args, w, prefix)
        self.mlp = MLP(args, w, prefix)

    def __call__(self, x, rope, cache: LayerKVCache) -> np.ndarray:
        x = x + self.attention(rms_norm(x, self.attn_norm, self.eps), rope, cache)
        return x + self.mlp(rms_norm(x, self.ffn_norm, self.eps))


class Model(BaseModel):
    architecture = "llama"

    def __init__(self, args: ModelArgs, w: WeightStore):
        self.args = args
        self.dim, self.n_layers = args.dim, args.n_layers
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = self.value_dim = args.head_dim
        self.vocab_size, self.context_length = args.vocab_size, args.context_length
        self.token_embd = w.embedding("token_embd.weight", args.vocab_size, args.dim)
        self.layers = [TransformerBlock(args, w, i) for i in range(args.n_layers)]
        self.output_norm = w.vector("output_norm.weight", args.dim)
        if w.has("output.weight"):
            self.lm_head = w.linear("output.weight", args.vocab_size, args.dim)
        else:
            self.lm_head = self.token_embd.as_linear()

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Model":
        return cls(ModelArgs.from_gguf(g), WeightStore(g))

    def hidden(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        a = self.args
        positions = cache.offset + np.arange(tokens.shape[0])
        rope = rope_tables(positions, a.rope_dim, a.rope_base, a.rope_freq_scale)
        x = self.token_embd.lookup(tokens)
        for layer, block in enumerate(self.layers):
            x = block(x, rope, cache[layer])
        return rms_norm(x, self.output_norm, a.norm_eps)

    def output(self, h: np.ndarray) -> np.ndarray:
        return self.lm_head(h)

    def rerotate_keys(self, layer: int, keys: np.ndarray, by: np.ndarray) -> np.ndarray:
        a = self.args
        cos, sin = rope_tables(np.asarray(by), a.rope_dim, a.rope_base, a.rope_freq_scale)
        r = a.rope_dim
        if r == a.head_dim:
            return apply_rope(keys, cos, sin, neox=False)
        return np.concatenate([apply_rope(keys[..., :r], cos, sin, False), keys[..., r:]], axis=-1)
