"""qwen2 (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen): the llama decoder with q/k/v biases and
RoPE on halves (NEOX layout: the converter keeps Hugging Face's Q/K row order)."""

from __future__ import annotations

from . import llama

ARCH = "qwen2"


class Model(llama.Model):
    architecture = ARCH
    rope_neox = True
    attention_biases = True  # attn_q/k/v.bias are part of the architecture: missing is an error
    qk_norm = False
