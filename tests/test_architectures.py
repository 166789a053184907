"""Architectures beside SmolLM2's llama and Gemma3: qwen2, qwen3, llama with Llama 3 frequency
scaling (`rope_freqs`), llama with rope.scaling keys, Mistral-style llama.

Fast tests use tiny random models (tests/tiny_variants.py) and check the rotation against an
independent formula. Slow tests hold the four synthetic models built from SmolLM2's real weights
(tests/synth_arch.py) to llama.cpp's f32 reference (tests/data/synthetic/): the same bars as the
real models in test_reference.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ModelError, UnsupportedModel, describe
from engine.gguf_file import GGUFFile
from engine.models import kv_geometry, load_model, supported_architectures
from engine.kernels.norms import rms_norm

from .conftest import DATA
from .tiny_gguf import write_tiny_model
from .tiny_variants import rewrite, write_variant

VARIANTS = ["llama", "qwen2", "qwen3", "llama3rope"]


def test_qwen_architectures_are_listed():
    assert {"llama", "gemma3", "qwen2", "qwen3"} <= set(supported_architectures())


# -- RoPE: the forward pass and re-rotation against the formula ------------------------------
def reference_rotation(x, positions, *, base, neox, scale=1.0, factors=None):
    """x (T, H, D) rotated as llama.cpp's ggml_rope_ext (no YaRN) does, in float64: pair i turns
    by position * scale * base^(-2i/D) / factors[i]; pairs (2i, 2i+1), or (i, i + D/2) for NEOX."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    i = np.arange(d // 2)
    theta = np.asarray(positions, dtype=np.float64)[:, None] * scale * base ** (-2.0 * i / d)
    if factors is not None:
        theta = theta / np.asarray(factors, dtype=np.float64)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    ia, ib = (i, i + d // 2) if neox else (2 * i, 2 * i + 1)
    out = x.copy()
    out[..., ia] = x[..., ia] * cos - x[..., ib] * sin
    out[..., ib] = x[..., ia] * sin + x[..., ib] * cos
    return out


def _rotation_of(model):
    """The rotation a file asks for, read from the file itself (not from the model's own view of
    it): base from metadata, layout by architecture, divisors from a rope_freqs tensor."""
    g = model.gguf_file
    arch = g.architecture
    factors = g.raw("rope_freqs.weight").view(np.float32).ravel() if "rope_freqs.weight" in g.tensors else None
    return dict(base=float(g.get(f"{arch}.rope.freq_base")), neox=arch in ("qwen2", "qwen3"), factors=factors)


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request, tmp_path_factory):
    path = write_variant(tmp_path_factory.mktemp("variant") / f"{request.param}.gguf", request.param)
    g = GGUFFile(path)
    model = load_model(g)
    model.gguf_file = g
    return request.param, model


def test_each_variant_is_its_architecture(variant):
    name, model = variant
    assert model.architecture == {"llama3rope": "llama"}.get(name, name)
    assert model.rope_neox == (name in ("qwen2", "qwen3"))
    assert (model.rope.freq_factors is not None) == (name == "llama3rope")
    attention = model.layers[0].attention
    assert (attention.bias_q is not None) == (name == "qwen2")
    assert (attention.attn_q_norm is not None) == (name == "qwen3")


def test_forward_pass_keys_are_the_formulas_rotation(variant):
    """Layer 0's keys as the cache receives them: projection (+ bias), per-head norm (qwen3),
    rotation by the formula with the file's base, layout and frequency divisors."""
    name, model = variant
    captured = []
    cache = model.new_cache()
    layer = cache[0]
    original = layer.attend
    layer.attend = lambda q, k, v, **kw: (captured.append(k.copy()), original(q, k, v, **kw))[1]
    ids = np.arange(3, 40)
    model.forward(ids[:30], cache, "last")
    model.forward(ids[30:31], cache, "last")  # a decode step: the one-token rotation path
    a, block = model.args, model.layers[0]
    att = block.attention
    h = rms_norm(model.token_embd.lookup(ids[:31]), block.attn_norm, a.norm_eps)
    k = att.attn_k(h) + (att.bias_k if att.bias_k is not None else 0)
    k = k.reshape(31, a.n_kv_heads, a.head_dim)
    if att.attn_k_norm is not None:
        k = rms_norm(k, att.attn_k_norm, a.norm_eps)
    expected = reference_rotation(k, np.arange(31), **_rotation_of(model))
    got = np.concatenate(captured)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_rerotated_keys_equal_keys_rotated_at_the_new_position(variant):
    """The paged cache's overflow moves kept keys down by s positions through `rerotate_keys`:
    it must turn them with the forward pass's frequencies (divisors, layout) or they land
    somewhere else."""
    _, model = variant
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((6, model.n_kv_heads, model.head_dim)).astype(np.float32)
    pos = np.array([40, 41, 57, 90, 100, 255])
    rotation = _rotation_of(model)
    at = lambda p: reference_rotation(raw, p, **rotation)
    for shift in (1, 24, 40):
        moved = model.rerotate_keys(0, at(pos).astype(np.float32), -np.full(6, shift))
        np.testing.assert_allclose(moved, at(pos - shift), atol=2e-4)


def test_prefill_in_chunks_and_decode_agree_with_one_pass(variant):
    _, model = variant
    ids = np.random.default_rng(1).integers(3, model.vocab_size, size=30)
    whole = model.forward(ids, model.new_cache(), "all")
    cache = model.new_cache()
    parts = [model.forward(ids[s : s + 7], cache, "all") for s in range(0, 30, 7)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-3, atol=2e-3)
    cache = model.new_cache()
    steps = [model.forward(ids[i : i + 1], cache, "last") for i in range(30)]
    np.testing.assert_allclose(np.concatenate(steps), whole, rtol=1e-3, atol=2e-3)


def test_rope_freqs_change_the_model(tmp_path):
    """A rope_freqs tensor is honoured, not ignored: the same weights without it give other
    logits from the second position on (position 0 is unrotated either way)."""
    plain = load_model(GGUFFile(write_variant(tmp_path / "plain.gguf", "llama")))
    scaled = load_model(GGUFFile(write_variant(tmp_path / "scaled.gguf", "llama3rope")))
    ids = np.arange(3, 30)
    a = plain.forward(ids, plain.new_cache(), "all")
    b = scaled.forward(ids, scaled.new_cache(), "all")
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
    assert np.abs(a[5:] - b[5:]).max() > 1e-2


# -- rope.scaling keys ------------------------------------------------------------------------
def _scaled_file(tmp_path, **keys) -> Path:
    src = write_tiny_model(tmp_path / "src.gguf", "llama")
    meta = {f"{{arch}}.rope.scaling.{k}": v for k, v in keys.items()}
    return rewrite(src, tmp_path / "scaled.gguf", extra_metadata=meta)


@pytest.mark.parametrize("keys,freq_scale", [
    ({"type": "linear", "factor": 4.0}, 0.25),
    ({"factor": 2.0}, 0.5),  # llama.cpp reads a factor without a type as linear
    ({"type": "none", "factor": 4.0}, 1.0),  # and never scales under "none"
    ({"type": "linear"}, 1.0),
])
def test_linear_scaling_divides_positions(tmp_path, keys, freq_scale):
    model = load_model(GGUFFile(_scaled_file(tmp_path, **keys)))
    assert model.rope.freq_scale == freq_scale
    raw = np.random.default_rng(0).standard_normal((3, model.n_kv_heads, model.head_dim)).astype(np.float32)
    got = model.rope.rotate(raw, model.rope.tables(np.array([5, 17, 200])))
    np.testing.assert_allclose(got, reference_rotation(raw, np.array([5, 17, 200]) * freq_scale,
                                                       base=10000.0, neox=False), atol=1e-5)


@pytest.mark.parametrize("kind", ["yarn", "longrope", "dynamic-ntk"])
def test_unimplemented_scaling_types_are_refused(tmp_path, kind):
    path = _scaled_file(tmp_path, type=kind, factor=4.0)
    for load in (lambda: load_model(GGUFFile(path)), lambda: kv_geometry(GGUFFile(path))):
        with pytest.raises(UnsupportedModel, match=f"RoPE scaling type '{kind}'") as err:
            load()
        assert describe(err.value)[0] == "unsupported_model"


def test_qwen2_without_its_biases_is_an_error_naming_the_tensor(tmp_path):
    src = write_tiny_model(tmp_path / "src.gguf", "llama")
    path = rewrite(src, tmp_path / "qwen2.gguf", arch="qwen2")
    with pytest.raises(ModelError, match=r"blk\.0\.attn_q\.bias"):
        load_model(GGUFFile(path))


def test_qwen3_without_its_norms_is_an_error_naming_the_tensor(tmp_path):
    src = write_tiny_model(tmp_path / "src.gguf", "llama")
    path = rewrite(src, tmp_path / "qwen3.gguf", arch="qwen3")
    with pytest.raises(ModelError, match=r"blk\.0\.attn_q_norm\.weight"):
        load_model(GGUFFile(path))


# -- the synthetic models against llama.cpp (slow) ----------------------------------------------
SYNTHETIC = DATA / "synthetic"
SYNTHETIC_NAMES = ["qwen2-s0", "qwen3-s0", "llama3rope-s0", "mistral-s0"]
SYNTH_SCRIPT = Path(__file__).parent / "synth_arch.py"


def _expected_sha256() -> dict[str, str]:
    out = {}
    for line in (SYNTHETIC / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        out[name] = digest
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: Path, digest: str) -> bool:
    """Whether `path` has the sha256 `digest`. A verified file gets a stamp beside it (digest,
    size, mtime) so later sessions skip re-hashing 650 MB while the file is unchanged."""
    if not path.is_file():
        return False
    stamp = path.with_name(path.name + ".sha256")
    st = path.stat()
    key = f"{digest} {st.st_size} {st.st_mtime_ns}"
    if stamp.is_file() and stamp.read_text().strip() == key:
        return True
    if _sha256(path) != digest:
        return False
    stamp.write_text(key + "\n")
    return True


def synthetic_model(name: str, smollm2_path: Path) -> Path:
    """The synthetic model `name`, built once per machine into the models directory's
    `synthetic/` folder (~650 MB, F32) and checked against the reference's sha256."""
    from engine import catalog

    folder = catalog.models_dir() / "synthetic"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.gguf"
    digest = _expected_sha256()[path.name]
    if _verified(path, digest):
        return path
    arch = name.rsplit("-s", 1)[0]
    partial = path.with_name(path.name + ".partial")
    proc = subprocess.run(
        [sys.executable, str(SYNTH_SCRIPT), str(smollm2_path), str(partial), arch, "--seed", "0"],
        capture_output=True, text=True, timeout=3600,
    )
    assert proc.returncode == 0, f"building {name} failed:\n{proc.stderr[-2000:]}"
    os.replace(partial, path)
    if not _verified(path, digest):
        pytest.fail(f"{path} does not have the reference's sha256 {digest}: the build differs "
                    "(numpy or gguf version?), so the llama.cpp reference does not apply to it")
    return path


@pytest.fixture(scope="module", params=SYNTHETIC_NAMES)
def synthetic(request, smollm2_path):
    from engine.engine import Engine

    name = request.param
    path = synthetic_model(name, smollm2_path)
    # 16-bit KV, as llama.cpp's default f16 cache that made the reference
    engine = Engine.load(path, kv="full")
    yield name, engine
    del engine


def _reference(name: str) -> dict:
    return json.loads((SYNTHETIC / f"{name}.json").read_text())


@pytest.mark.slow
def test_synthetic_teacher_forced_matches_llama_cpp_f32(synthetic):
    name, engine = synthetic
    ref = np.load(SYNTHETIC / f"{name}-gpl-3.npz")
    ours = engine.teacher_forced(ref["tokens"])
    assert ours.top_ids.shape == ref["top_ids"].shape == (512, 32)
    top1 = float(np.mean(ours.top_ids[:, 0] == ref["top_ids"][:, 0]))
    delta = float(np.mean(np.abs(ours.next_logprob - ref["next_logprob"])))
    assert top1 >= 0.99, f"{name}: top-1 agreement {top1:.4f}"
    assert delta <= 0.01, f"{name}: mean |Δ next logprob| {delta:.4f} nats"
    assert np.mean(np.abs(ours.top_logprobs[:, :8] - ref["top_logprobs"][:, :8])) < 0.02
    at = ref["full_logits_at"]
    logits = engine.model.forward(ref["tokens"][: int(at.max()) + 1], engine.new_cache(), at)
    assert np.max(np.abs(logits - ref["full_logits"])) < 0.25
    assert np.mean(np.abs(logits - ref["full_logits"])) < 0.02


@pytest.mark.slow
def test_synthetic_tokenizer_cases_exact(synthetic):
    name, engine = synthetic
    ref = _reference(name)
    cases = json.loads((DATA / "tokenizer_cases.json").read_text())
    assert len(ref["tokenize"]) == len(cases)
    tok = engine.tokenizer
    for case, text in zip(ref["tokenize"], cases):
        assert case["text"] == text
        assert tok.encode(text) == case["ids_plain"]
        assert tok.encode(text, parse_special=True) == case["ids_special"]
        assert tok.encode(text, add_bos=True, parse_special=True) == case["ids_bos_special"]
    for case in ref["greedy_raw"]:
        assert engine.encode_prompt(case["prompt"]) == case["prompt_ids"]
    for case in ref["greedy_chat"]:
        assert engine.encode_chat([{"role": "user", "content": case["user"]}]) == case["prompt_ids"]


@pytest.mark.slow
def test_synthetic_greedy_continuations_match(synthetic):
    """The first 16 greedy tokens of each reference prompt, as test_reference.py checks SmolLM2
    (5 of its 6 must match: a near-tie between two tokens may go either way in float32)."""
    from engine.sampling import SamplingParams

    name, engine = synthetic
    ref = _reference(name)
    cases = ref["greedy_raw"] + ref["greedy_chat"]
    assert len(cases) == 6
    matches = []
    for case in cases:
        result = engine.generate(case["prompt_ids"], max_tokens=16, sampling=SamplingParams())
        expected = case["ids"][:16]
        matches.append(result.ids[: len(expected)] == expected)
    assert sum(matches) >= 5, f"{name}: {sum(matches)} of {len(cases)} greedy prefixes match: {matches}"
