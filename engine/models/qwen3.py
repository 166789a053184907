"""qwen3: the llama decoder with a per-head RMS norm of q and k (`attn_q_norm`, `attn_k_norm`,
over the head dimension, before rotation), RoPE on halves (NEOX layout), no q/k/v biases."""

from __future__ import annotations

from . import llama

ARCH = "qwen3"


class Model(llama.Model):
    architecture = ARCH
    rope_neox = True
    attention_biases = False
    qk_norm = True
