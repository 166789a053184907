"""qwen2 (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen): the llama decoder with q/k/v biases and
RoPE on halves (NEOX layout: the converter keeps Hugging Face's Q/K row order)."""

from __future__ import annotations

from ..gguf_file import GGUFFile
from . import llama

ARCH = "qwen2"


class ModelArgs(llama.ModelArgs):
    @classmethod
    def from_gguf(cls, g: GGUFFile, arch: str = ARCH) -> "ModelArgs":
        return super().from_gguf(g, arch)


class Model(llama.Model):
    architecture = ARCH
    args_class = ModelArgs
    rope_neox = True
    attention_biases = True  # attn_q/k/v.bias are part of the architecture: missing is an error
    qk_norm = False
