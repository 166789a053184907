"""gemma3: QK-norm, pre/post norms around attention and MLP, GELU-tanh, embedding scaling,
sliding-window local layers with their own RoPE base, every 6th layer global."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gguf_file import GGUFFile
from ..kernels.norms import apply_rope, rms_norm
from ..kv.cache import KVCache, LayerKVCache
from ..weights import LinearGroup, WeightStore
from .base import BaseModel, GatedMLP, KVGeometry, gelu_tanh, rope_freq_scale, rope_tables

ARCH = "gemma3"
LOCAL_ROPE_BASE = 10_000.0
GLOBAL_LAYER_PERIOD = 6  # layers 5, 11, 17, ... attend globally (llama.cpp's gemma3 pattern)


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    value_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    rope_base_global: float
    rope_base_local: float
    rope_freq_scale_global: float
    sliding_window: int
    context_length: int

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "ModelArgs":
        dim = int(g.require(f"{ARCH}.embedding_length"))
        n_heads = int(g.require(f"{ARCH}.attention.head_count"))
        head_dim = int(g.get(f"{ARCH}.attention.key_length", dim // n_heads))
        return cls(
            dim=dim,
            n_layers=int(g.require(f"{ARCH}.block_count")),
            n_heads=n_heads,
            n_kv_heads=int(g.get(f"{ARCH}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            value_dim=int(g.get(f"{ARCH}.attention.value_length", head_dim)),
            ffn_dim=int(g.require(f"{ARCH}.feed_forward_length")),
            vocab_size=int(g.tensor_info("token_embd.weight").shape[0]),
            norm_eps=float(g.get(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base_global=float(g.get(f"{ARCH}.rope.freq_base", 1_000_000.0)),
            rope_base_local=LOCAL_ROPE_BASE,
            rope_freq_scale_global=rope_freq_scale(g, ARCH),  # global layers only (llama.cpp)
            sliding_window=int(g.get(f"{ARCH}.attention.sliding_window", 512)),
            context_length=int(g.get(f"{ARCH}.context_length", 32768)),
        )

    def is_global(self, layer: int) -> bool:
        return layer % GLOBAL_LAYER_PERIOD == GLOBAL_LAYER_PERIOD - 1

    def kv_geometry(self) -> KVGeometry:
        windows = tuple(None if self.is_global(i) else self.sliding_window for i in range(self.n_layers))
        return KVGeometry(self.n_layers, self.n_kv_heads, self.head_dim, self.value_dim, windows,
                          self.context_length)


class Attention:
    def __init__(self, args: ModelArgs, w: WeightStore, prefix: str, is_global: bool):
        self.args = args
        d, hd = args.dim, args.head_dim
        self.attn_q = w.linear(f"{prefix}.attn_q.weight", args.n_heads * hd, d)
        self.attn_k = w.linear(f"{prefix}.attn_k.weight", args.n_kv_heads * hd, d)
        self.attn_v = w.linear(f"{prefix}.attn_v.weight", args.n_kv_heads * args.value_dim, d)
        self.attn_output = w.linear(f"{prefix}.attn_output.weight", d, args.n_heads * args.value_dim)
        self.qkv = LinearGroup((self.attn_q, self.attn_k, self.attn_v))
        self.attn_q_norm = w.vector(f"{prefix}.attn_q_norm.weight", hd)
        self.attn_k_norm = w.vector(f"{prefix}.attn_k_norm.weight", hd)
        self.window = None if is_global else args.sliding_window
        self.scale = 1.0 / np.sqrt(hd)

    def __call__(self, x: np.ndarray, rope, cache: LayerKVCache) -> np.ndarray:
        a = self.args
        T = x.shape[0]
        q, k, v = self.qkv(x)  # x quantized once
        q = q.reshape(T, a.n_heads, a.head_dim)  # (T, H, D)
        k = k.reshape(T, a.n_kv_heads, a.head_dim)  # (T, Hkv, D)
        v = v.reshape(T, a.n_kv_heads, a.value_dim)
        q = rms_norm(q, self.attn_q_norm, a.norm_eps)  # per-head norm over D
        k = rms_norm(k, self.attn_k_norm, a.norm_eps)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin, neox=True), apply_rope(k, cos, sin, neox=True)
        o = cache.attend(q, k, v, scale=self.scale, window=self.window)  # (T, H, Dv)
        return self.attn_output(o.reshape(T, a.n_heads * a.value_dim))


class TransformerBlock:
    def __init__(self, args: ModelArgs, w: WeightStore, layer: int):
        prefix = f"blk.{layer}"
        self.eps = args.norm_eps
        self.is_global = args.is_global(layer)
        # Norm weights in the GGUF already include Gemma's "+1": used as stored.
        self.attn_norm = w.vector(f"{prefix}.attn_norm.weight", args.dim)
        self.post_attention_norm = w.vector(f"{prefix}.post_attention_norm.weight", args.dim)
        self.ffn_norm = w.vector(f"{prefix}.ffn_norm.weight", args.dim)
        self.post_ffw_norm = w.vector(f"{prefix}.post_ffw_norm.weight", args.dim)
        self.attention = Attention(args, w, prefix, self.is_global)
        self.mlp = GatedMLP(args, w, prefix, gelu_tanh)

    def __call__(self, x, rope_local, rope_global, cache: LayerKVCache) -> np.ndarray:
        rope = rope_global if self.is_global else rope_local
        h = self.attention(rms_norm(x, self.attn_norm, self.eps), rope, cache)
        x = x + rms_norm(h, self.post_attention_norm, self.eps)
        h = self.mlp(rms_norm(x, self.ffn_norm, self.eps))
        return x + rms_norm(h, self.post_ffw_norm, self.eps)


class Model(BaseModel):
    architecture = ARCH

    def __init__(self, args: ModelArgs, w: WeightStore):
        self.args = args
        self.dim, self.n_layers = args.dim, args.n_layers
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim, self.value_dim = args.head_dim, args.value_dim
        self.vocab_size, self.context_length = args.vocab_size, args.context_length
        self.token_embd = w.embedding("token_embd.weight", args.vocab_size, args.dim)
        self.embed_scale = np.float32(np.sqrt(args.dim))
        self.layers = [TransformerBlock(args, w, i) for i in range(args.n_layers)]
        self.output_norm = w.vector("output_norm.weight", args.dim)
        if w.has("output.weight"):
            self.lm_head = w.linear("output.weight", args.vocab_size, args.dim)
        else:
            self.lm_head = self.token_embd.as_linear()

    @classmethod
    def args_from_gguf(cls, g: GGUFFile) -> ModelArgs:
        return ModelArgs.from_gguf(g)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Model":
        return cls(cls.args_from_gguf(g), WeightStore(g))

    def layer_window(self, layer: int) -> int | None:
        return None if self.args.is_global(layer) else self.args.sliding_window

    def hidden(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        a = self.args
        positions = cache.positions(tokens.shape[0])
        rope_local = rope_tables(positions, a.head_dim, a.rope_base_local)
        rope_global = rope_tables(positions, a.head_dim, a.rope_base_global, a.rope_freq_scale_global)
        x = self.token_embd.lookup(tokens) * self.embed_scale
        for layer, block in enumerate(self.layers):
            x = block(x, rope_local, rope_global, cache[layer])
        return rms_norm(x, self.output_norm, a.norm_eps)

    def output(self, h: np.ndarray) -> np.ndarray:
        return self.lm_head(h)

    def rerotate_keys(self, layer: int, keys: np.ndarray, by: np.ndarray) -> np.ndarray:
        a = self.args
        if a.is_global(layer):
            cos, sin = rope_tables(np.asarray(by), a.head_dim, a.rope_base_global, a.rope_freq_scale_global)
        else:
            cos, sin = rope_tables(np.asarray(by), a.head_dim, a.rope_base_local)
        return apply_rope(keys, cos, sin, neox=True)
