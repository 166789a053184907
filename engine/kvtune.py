"""`omlx kv-tune`: per-layer K and V widths chosen from measured sensitivity, for a byte budget.

Sensitivity (`measure_profile`) is the KL divergence from the 16-bit cache's next-token
distributions that quantizing one layer's keys, or one layer's values, to each candidate width
(2, 3, 4, 5, 6, 8 bits) would cost on its own, over a calibration text. Measuring that directly is
one forward pass per (layer, role, width), 360 for a 30-layer model; instead:

1. One 16-bit pass records, per layer, the input of the block, the query/key/value rows handed to
   the cache and the attention output.
2. Local error, exact and cheap: for every (layer, role, width) the recorded rows go through a
   one-layer paged cache at that width (the storage and visibility rule decode uses: quantized
   full blocks, float16 tail and sinks), giving that layer's attention output as it would be.
   E(layer, role, width) is the mean squared change of the attention output.
3. Propagation, one partial pass per layer (over the first `gain_tokens` tokens if given): the layer's
   attention output with K and V both at `CALIBRATION_BITS` is injected in place of the 16-bit one
   and only the layers from there on are run again (the earlier layers' outputs are the recorded
   ones); the KL of the resulting logits against the 16-bit logits divided by that perturbation's E
   (over the same tokens) is the layer's gain.
4. KL(layer, role, width) = gain(layer) x E(layer, role, width): a small perturbation moves the
   logits linearly, so the KL is quadratic in it and scales with its energy; the layer's gain
   carries how much the rest of the network amplifies or damps it.

The choice (`choose_widths`) then assumes the KL of a mixed spec is the sum of the per-(layer,
role) KLs and solves the multiple-choice knapsack exactly by dynamic programming over byte costs
(rounded up to a grid fixed by the model, so the budget always holds and a larger budget never
gives a worse prediction). `tune` verifies the chosen spec with a real evaluation
(engine.evaluate) on the calibration text, which measures how well the additivity held; with a
spec as the budget, that spec is measured too and kept instead when the choice is no better.

Profiles are stored per model file (sha256), calibration text (sha256), token count and KV
options (block size, sinks, rotation) in the user cache folder (engine.kv.prefix.cache_dir), so a
second run only solves the knapsack.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .errors import OmlxError, SettingsError
from .kv.config import DEFAULT_BLOCK_SIZE, KVConfig, estimate_bytes, parse_kv
from .kv.formats import get_format
from .sampling import log_softmax

CANDIDATE_BITS = (2, 3, 4, 5, 6, 8)
ROLES = ("k", "v")
CALIBRATION_BITS = 4  # K and V width of each layer's propagated perturbation (step 3)
PROFILE_VERSION = 2
RESOURCES = Path(__file__).resolve().parents[1] / "resources"
DEFAULT_CALIBRATION_TEXT = RESOURCES / "kvtune" / "calibration.txt"
DEFAULT_N_TOKENS = 512
_GRID = 100_000  # cost units of the knapsack over the most expensive choice


class KVTuneError(SettingsError):
    """A budget or calibration input kv-tune cannot work with."""


class KVTuneCancelled(OmlxError):
    """The sensitivity measurement was cancelled (nothing is stored)."""

    kind = "cancelled"


def _check_cancel(cancel) -> None:
    if cancel is not None and cancel.is_set():
        raise KVTuneCancelled("the KV sensitivity measurement was cancelled")


# -- profile ------------------------------------------------------------------------------------


@dataclass
class Profile:
    """Predicted KL of each (layer, role, width) on its own, with how it was measured."""

    model_sha256: str
    text_sha256: str
    n_tokens: int
    block_size: int
    sinks: int
    rotation: bool
    bits: tuple[int, ...]
    kl: np.ndarray  # (n_layers, 2, len(bits)) nats; role 0 = K, 1 = V
    energy: np.ndarray  # (n_layers, 2, len(bits)) mean squared attention-output change
    gain: np.ndarray  # (n_layers,) KL per unit of energy
    seconds: float = 0.0
    gain_tokens: int = 0  # tokens the gains were measured over (step 3)

    @property
    def n_layers(self) -> int:
        return int(self.kl.shape[0])

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, "model_sha256": self.model_sha256, "text_sha256": self.text_sha256,
                "n_tokens": self.n_tokens, "block_size": self.block_size, "sinks": self.sinks,
                "rotation": self.rotation, "bits": list(self.bits), "kl": self.kl.tolist(),
                "energy": self.energy.tolist(), "gain": self.gain.tolist(), "seconds": self.seconds,
                "gain_tokens": self.gain_tokens}

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}")
        return cls(data["model_sha256"], data["text_sha256"], int(data["n_tokens"]), int(data["block_size"]),
                   int(data["sinks"]), bool(data["rotation"]), tuple(int(b) for b in data["bits"]),
                   np.asarray(data["kl"], np.float64), np.asarray(data["energy"], np.float64),
                   np.asarray(data["gain"], np.float64), float(data.get("seconds", 0.0)),
                   int(data.get("gain_tokens", 0)))


def profile_path(model_sha256: str, text_sha256: str, n_tokens: int, options: KVConfig,
                 directory: Path | None = None) -> Path:
    """Where the profile for this model file, text, length and KV options is stored."""
    if directory is None:
        from .kv.prefix import cache_dir

        directory = cache_dir() / "kv-profiles"
    name = (f"{model_sha256[:32]}-{text_sha256[:16]}-n{n_tokens}-bs{options.block_size}-s{options.sinks}"
            f"-r{int(options.rotation)}-v{PROFILE_VERSION}.json")
    return Path(directory) / name


def load_profile(path: Path) -> Profile | None:
    try:
        return Profile.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_profile(profile: Profile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json()))
    tmp.replace(path)


def text_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()


# -- measuring ----------------------------------------------------------------------------------


class _RecordingLayer:
    """Stands in for one layer's cache during the 16-bit pass: records what the model hands the
    cache (q (T, H, D), k (T, Hkv, D), v (T, Hkv, Dv), scale, window) and the output."""

    def __init__(self, inner, record: dict):
        self.inner, self.record = inner, record

    def attend(self, q, k, v, *, scale, window):
        out = self.inner.attend(q, k, v, scale=scale, window=window)
        self.record.update(q=q.copy(), k=k.copy(), v=v.copy(), scale=scale, window=window, out=out.copy())
        return out


class _InjectingLayer:
    """Stands in for one layer's cache in a partial pass: returns a given attention output."""

    def __init__(self, out: np.ndarray):
        self.out = out

    def attend(self, q, k, v, *, scale, window):
        return self.out


class _RecordingBlock:
    """Wraps a transformer block for the 16-bit pass: records its input and its other arguments
    (RoPE tables), so a partial pass can start at this block."""

    def __init__(self, block, record: dict):
        self.block, self.record = block, record

    def __call__(self, x, *args):
        self.record.update(x=x.copy(), args=args)
        return self.block(x, *args)


class _LayerCaches:
    """A cache whose layer i is `layers[i]` (the model only indexes it and reads `offset`)."""

    def __init__(self, layers, offset: int = 0):
        self.layers, self.offset = layers, offset

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)

    def positions(self, n_tokens: int) -> np.ndarray:
        """As KVCache.positions: the models take each new token's position from the cache."""
        return self.offset + np.arange(n_tokens)


def _final_norm(model, x: np.ndarray) -> np.ndarray | None:
    from .kernels.norms import rms_norm

    norm, args = getattr(model, "output_norm", None), getattr(model, "args", None)
    if norm is None or not hasattr(args, "norm_eps"):
        return None
    return rms_norm(x, norm, args.norm_eps)


class _Network:
    """The 16-bit pass of one text, recorded, and passes with one layer's attention output replaced."""

    def __init__(self, model, inputs: np.ndarray, options: KVConfig):
        self.model, self.inputs = model, inputs
        self.full = KVConfig(16, 16, block_size=options.block_size, sinks=options.sinks, rotation=options.rotation)
        n = model.n_layers
        self.attn = [dict() for _ in range(n)]
        self.blocks = [dict() for _ in range(n)]
        base = model.new_cache(None)  # float16 values, as the 16-bit paged cache holds them
        cache = _LayerCaches([_RecordingLayer(base[i], self.attn[i]) for i in range(n)])
        layers = getattr(model, "layers", None)
        wrap = isinstance(layers, list) and len(layers) == n
        if wrap:
            model.layers = [_RecordingBlock(b, r) for b, r in zip(layers, self.blocks)]
        try:
            self.h_ref = model.hidden(inputs, cache)
        finally:
            if wrap:
                model.layers = layers
        self.lp_ref = _log_probs(model, self.h_ref)
        # Partial passes replay blocks from a recorded input; they need the blocks' calling
        # convention (x, *tables, layer cache) and the final norm, checked on the last block.
        self.partial = False
        if wrap and all("x" in r for r in self.blocks):
            last = self.blocks[-1]
            y = layers[-1](last["x"], *last["args"][:-1], _InjectingLayer(self.attn[-1]["out"]))
            h = _final_norm(model, y)
            self.partial = h is not None and np.allclose(h, self.h_ref, rtol=1e-4, atol=1e-4)

    def attention_output(self, layer: int, k_bits: int, v_bits: int) -> np.ndarray:
        """Layer `layer`'s attention output over the recorded rows with its cache at kKvV."""
        r = self.attn[layer]
        config = KVConfig(k_bits, v_bits, block_size=self.full.block_size, sinks=self.full.sinks,
                          rotation=self.full.rotation)
        from .kv.paged import PagedKVCache

        m = self.model
        one = PagedKVCache(config, n_layers=1, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                           value_dim=m.value_dim, windows=[m.layer_window(layer)])
        return one[0].attend(r["q"], r["k"], r["v"], scale=r["scale"], window=r["window"])

    def kl_with(self, layer: int, out: np.ndarray) -> float:
        """Mean KL(16-bit ‖ perturbed) when layer `layer`'s attention output is `out`."""
        m, n = self.model, self.model.n_layers
        if self.partial:
            layers = self.model.layers
            fresh = m.new_cache(None)
            x = self.blocks[layer]["x"]
            for j in range(layer, n):
                args = self.blocks[j]["args"][:-1]
                x = layers[j](x, *args, _InjectingLayer(out) if j == layer else fresh[j])
            h = _final_norm(m, x)
        else:
            fresh = m.new_cache(None)
            caches = [_InjectingLayer(out) if j == layer else fresh[j] for j in range(n)]
            h = m.hidden(self.inputs, _LayerCaches(caches))
        return float(_kl(self.lp_ref, _log_probs(m, h)).mean())


_ROWS = 64


def _log_probs(model, h: np.ndarray) -> np.ndarray:
    """(N, vocab) float32 log-probabilities of hidden states (N, dim), in row blocks."""
    return np.concatenate([log_softmax(model.output(h[r : r + _ROWS])) for r in range(0, len(h), _ROWS)])


def _kl(lp_ref: np.ndarray, lp: np.ndarray) -> np.ndarray:
    return np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1)


def measure_profile(engine, tokens: Sequence[int], *, options: KVConfig | None = None,
                    bits: Sequence[int] = CANDIDATE_BITS, model_sha256: str | None = None,
                    progress: Callable[[str, float], None] | None = None, cancel=None,
                    gain_tokens: int | None = None) -> Profile:
    """The sensitivity profile of `engine`'s model on `tokens` (N+1 ids; positions 0..N-1 are run
    and predict 1..N), with the block size, sinks and rotation of `options`. `gain_tokens`: run
    the propagation passes (most of the time) over only the first tokens (None: all).

    `cancel` (anything with ``is_set()``, e.g. a threading.Event) is checked between steps of at
    most one layer's work; once set, KVTuneCancelled is raised."""
    t0 = time.perf_counter()
    options = parse_kv(options) if options is not None else KVConfig(block_size=DEFAULT_BLOCK_SIZE)
    model = engine.model
    tokens = np.asarray(tokens, np.int64)
    if len(tokens) < options.block_size + 2:
        raise KVTuneError(f"the calibration text has {len(tokens)} tokens; at least {options.block_size + 2} "
                          f"are needed for one quantized block")
    n_layers = model.n_layers
    if progress:
        progress("16-bit pass", 0.0)
    _check_cancel(cancel)
    net = _Network(model, tokens[:-1], options)
    # the propagation passes' own 16-bit pass over the first tokens (the whole text if shorter)
    short = gain_tokens is not None and len(tokens) - 1 > gain_tokens >= options.block_size + 1
    gain_net = _Network(model, tokens[:gain_tokens], options) if short else net
    energy = np.zeros((n_layers, 2, len(bits)))
    gain = np.zeros(n_layers)
    for layer in range(n_layers):
        if progress:
            progress("sensitivity", layer / n_layers)
        ref = net.attn[layer]["out"]
        for bi, b in enumerate(bits):
            _check_cancel(cancel)
            for ri, (kb, vb) in enumerate(((b, 16), (16, b))):
                energy[layer, ri, bi] = float(np.mean(np.square(net.attention_output(layer, kb, vb) - ref)))
        _check_cancel(cancel)
        cal = gain_net.attention_output(layer, CALIBRATION_BITS, CALIBRATION_BITS)
        e_cal = float(np.mean(np.square(cal - gain_net.attn[layer]["out"])))
        gain[layer] = gain_net.kl_with(layer, cal) / e_cal if e_cal > 0 else 0.0
    gain = np.maximum(gain, 0.0)  # a KL estimate below zero is rounding noise
    if progress:
        progress("sensitivity", 1.0)
    return Profile(model_sha256 or "", text_sha256(tokens), len(tokens) - 1, options.block_size, options.sinks,
                   options.rotation, tuple(int(b) for b in bits), gain[:, None, None] * energy, energy, gain,
                   time.perf_counter() - t0, len(gain_net.inputs))


def get_profile(engine, tokens: Sequence[int], *, options: KVConfig | None = None,
                directory: Path | None = None, progress=None, cancel=None) -> tuple[Profile, bool]:
    """The stored profile for this model file, text and options, or a new one (then stored).
    Returns (profile, whether it came from the store)."""
    options = parse_kv(options) if options is not None else KVConfig()
    sha = engine.model_id
    path = profile_path(sha, text_sha256(tokens), len(tokens) - 1, options, directory)
    stored = load_profile(path)
    if stored is not None and stored.n_layers == engine.model.n_layers:
        return stored, True
    profile = measure_profile(engine, tokens, options=options, model_sha256=sha, progress=progress, cancel=cancel)
    save_profile(profile, path)
    return profile, False


# -- costs and budgets --------------------------------------------------------------------------


@dataclass
class Costs:
    """Bytes of each (layer, role, width) choice, and the bytes every spec holds regardless.

    per_token: True when `choice` is bytes per token of full blocks (the budget is then per
    token); False when it is bytes held at `ctx` tokens (sliding-window layers hold fewer)."""

    choice: np.ndarray  # (n_layers, 2, len(bits)) bytes
    fixed: float  # bytes held whatever the widths (tail and sink buffers)
    ctx: int | None
    bits: tuple[int, ...]

    def total(self, widths: np.ndarray) -> float:
        """Bytes of a (n_layers, 2) array of widths (each in `bits`)."""
        idx = np.vectorize(self.bits.index)(widths)
        n = widths.shape[0]
        return float(self.choice[np.arange(n)[:, None], np.arange(2)[None, :], idx].sum() + self.fixed)


def kv_shape(model) -> tuple[int, int, int, int, list]:
    """(n_layers, n_kv_heads, head_dim, value_dim, windows) of a model, or of a geometry: an
    object or dict with those fields (engine.models.base.KVGeometry, the app's ModelInfo.geometry)."""
    if isinstance(model, dict):
        g = model
        return (int(g["n_layers"]), int(g["n_kv_heads"]), int(g["head_dim"]), int(g["value_dim"]),
                list(g.get("windows") or [None] * int(g["n_layers"])))
    if hasattr(model, "layer_window"):
        n = model.n_layers
        return n, model.n_kv_heads, model.head_dim, model.value_dim, [model.layer_window(i) for i in range(n)]
    return model.n_layers, model.n_kv_heads, model.head_dim, model.value_dim, list(model.windows)


def model_costs(model, options: KVConfig, bits: Sequence[int] = CANDIDATE_BITS, ctx: int | None = None) -> Costs:
    """Costs for `model`'s layers (a model or its geometry, see kv_shape): bytes per token of
    stored blocks (ctx None), or bytes held at `ctx` tokens as engine.kv.config.estimate_bytes
    counts them."""
    n, hkv, d, dv, windows = kv_shape(model)
    bs = options.block_size
    choice = np.zeros((n, 2, len(bits)))
    if ctx is None:
        for bi, b in enumerate(bits):
            for ri, (role, dim) in enumerate((("k", d), ("v", dv))):
                choice[:, ri, bi] = get_format(b, role).bytes_per_block(hkv, bs, dim) / bs
        return Costs(choice, 0.0, None, tuple(bits))
    fixed = None
    for bi, b in enumerate(bits):
        est = estimate_bytes(KVConfig(b, b, block_size=bs, sinks=options.sinks), n, hkv, d, ctx, dv, windows=windows)
        for layer in est["per_layer"]:
            choice[layer["layer"], 0, bi] = layer["k_blocks"]
            choice[layer["layer"], 1, bi] = layer["v_blocks"]
        fixed = sum(layer["total"] - layer["k_blocks"] - layer["v_blocks"] for layer in est["per_layer"])
    return Costs(choice, float(fixed), ctx, tuple(bits))


def spec_widths(config: KVConfig, n_layers: int) -> np.ndarray:
    """(n_layers, 2) K and V widths of a config."""
    return np.array([[p.k_bits, p.v_bits] for p in config.per_layer(n_layers)])


def budget_like(config: KVConfig, model, costs: Costs) -> float:
    """The bytes `config` holds under `costs` (a spec's width outside the candidates is refused)."""
    widths = spec_widths(config, kv_shape(model)[0])
    bad = sorted(set(widths.ravel()) - set(costs.bits))
    if bad:
        raise KVTuneError(f"--budget-like {config}: {bad[0]} bits is not a candidate width "
                          f"({', '.join(map(str, costs.bits))}); give a spec within them or --budget-bytes")
    return costs.total(widths)


def budget_for_bits(bits_per_value: float, model, options: KVConfig, ctx: int | None = None) -> float:
    """Bytes of `bits_per_value` stored bits per K/V element on average (scales included): per token
    over all layers (ctx None), or at `ctx` tokens with the tail and sink buffers added."""
    n, hkv, d, dv, _ = kv_shape(model)
    if ctx is None:
        return bits_per_value / 8 * n * hkv * (d + dv)
    costs = model_costs(model, options, (16,), ctx)
    held = costs.choice[:, :, 0] / 2 / np.array([hkv * d, hkv * dv])  # tokens each layer holds in blocks
    return float(bits_per_value / 8 * (held * np.array([hkv * d, hkv * dv])).sum() + costs.fixed)


# -- choosing -----------------------------------------------------------------------------------


@dataclass
class Choice:
    widths: np.ndarray  # (n_layers, 2) K and V bits
    predicted_kl: float
    bytes: float  # under the costs used (per token, or at ctx)
    budget: float
    config: KVConfig = field(default=None)

    @property
    def spec(self) -> str:
        return str(self.config)


def choose_widths(kl: np.ndarray, costs: Costs, budget: float, options: KVConfig | None = None) -> Choice:
    """Per layer K and V widths minimising the summed predicted KL with total bytes ≤ budget.

    Exact multiple-choice knapsack by dynamic programming; costs are rounded up to a grid of
    1/_GRID of the model's most expensive spec (all layers at the widest width), so the budget
    always holds and the grid, fixed per model, makes the optimum monotone in the budget.

    Args:
        kl: (n_layers, 2, len(costs.bits)) predicted KL per choice.
    Raises:
        KVTuneError: the budget is below the cheapest spec (every layer at the narrowest width).
    """
    options = options if options is not None else KVConfig()
    n = kl.shape[0]
    items = [(layer, role) for layer in range(n) for role in range(2)]
    # Each choice's bytes above its item's narrowest width: the narrowest spec costs 0 units, so
    # it fits exactly when the budget reaches it.
    floor = costs.choice.min(axis=2)
    extra = costs.choice - floor[:, :, None]
    top = float(extra.max(axis=2).sum())
    unit = top / _GRID if top > 0 else 1.0
    units = np.ceil(extra / unit - 1e-9).astype(np.int64)
    room = budget - costs.fixed - float(floor.sum())
    if room < -1e-6:
        cheapest = float(floor.sum()) + costs.fixed
        raise KVTuneError(f"a budget of {budget:,.0f} bytes is below the smallest spec ({cheapest:,.0f} bytes, "
                          f"every layer at {min(costs.bits)} bits)")
    cap = min(int(math.floor(max(room, 0.0) / unit + 1e-9)), int(units.max(axis=2).sum()))
    if room >= top * (1 - 1e-12):
        cap = int(units.max(axis=2).sum())  # every combination fits (rounded-up units would miss some)
    inf = np.inf
    dp = np.full(cap + 1, inf)
    dp[0] = 0.0
    picks = np.zeros((len(items), cap + 1), np.int8)
    for i, (layer, role) in enumerate(items):
        best = np.full(cap + 1, inf)
        pick = np.zeros(cap + 1, np.int8)
        for w in range(len(costs.bits)):
            c = units[layer, role, w]
            if c > cap:
                continue
            cand = np.full(cap + 1, inf)
            cand[c:] = dp[: cap + 1 - c] + kl[layer, role, w]
            better = cand < best
            best[better] = cand[better]
            pick[better] = w
        dp, picks[i] = best, pick
    end = int(np.argmin(dp))
    if not np.isfinite(dp[end]):
        raise KVTuneError(f"no spec fits in {budget:,.0f} bytes")
    widths = np.zeros((n, 2), np.int64)
    c = end
    for i in range(len(items) - 1, -1, -1):
        layer, role = items[i]
        w = int(picks[i, c])
        widths[layer, role] = costs.bits[w]
        c -= units[layer, role, w]
    predicted = float(sum(kl[layer, role, costs.bits.index(widths[layer, role])] for layer, role in items))
    return Choice(widths, predicted, costs.total(widths), budget, widths_config(widths, options))


def widths_config(widths: np.ndarray, options: KVConfig | None = None) -> KVConfig:
    """A KVConfig with the given (n_layers, 2) widths: the most common (K, V) pair as the base and
    the other layers as overrides; block size, sinks and rotation from `options`."""
    options = options if options is not None else KVConfig()
    pairs = [(int(k), int(v)) for k, v in widths]
    counts: dict = {}
    for p in pairs:
        counts[p] = counts.get(p, 0) + 1
    base = max(counts, key=lambda p: (counts[p], p))
    config = KVConfig(base[0], base[1], block_size=options.block_size, sinks=options.sinks, rotation=options.rotation)
    return config.with_overrides({i: p for i, p in enumerate(pairs)})


def predicted_kl(profile: Profile, config: KVConfig) -> float:
    """The profile's additive prediction for a config whose widths are all candidates (16 bits: 0)."""
    total = 0.0
    for layer, (k, v) in enumerate(spec_widths(config, profile.n_layers)):
        for role, b in enumerate((k, v)):
            if b != 16:
                total += float(profile.kl[layer, role, profile.bits.index(int(b))])
    return total


# -- the command's work -------------------------------------------------------------------------


@dataclass
class TuneResult:
    choice: Choice
    profile: Profile
    from_store: bool
    kv_bytes_per_token: float
    measured_kl: float | None
    measured_kv_bytes: int | None
    seconds: float
    uniform_kl: float | None = None  # the budget's own spec, measured beside it (--budget-like)
    fell_back: bool = False  # the choice measured no better than the budget's spec: that spec is the result

    def as_dict(self) -> dict:
        return {"spec": self.choice.spec, "kv_bytes_per_token": self.kv_bytes_per_token,
                "predicted_kl": self.choice.predicted_kl, "measured_kl": self.measured_kl,
                "budget_bytes": self.choice.budget, "bytes": self.choice.bytes, "ctx": None,
                "measured_kv_bytes": self.measured_kv_bytes, "profile_from_store": self.from_store,
                "seconds": self.seconds, "budget_spec_kl": self.uniform_kl, "fell_back": self.fell_back,
                "layers": [{"layer": i, "k_bits": int(k), "v_bits": int(v)} for i, (k, v) in enumerate(self.choice.widths)]}


def calibration_tokens(engine, text: str, n_tokens: int = DEFAULT_N_TOKENS) -> list[int]:
    """At most n_tokens + 1 ids of `text` (BOS added where the model wants one)."""
    ids = engine.tokenizer.encode(text, add_bos=True)
    return ids[: n_tokens + 1]


def default_calibration_tokens(engine, n_tokens: int = DEFAULT_N_TOKENS) -> list[int]:
    """The first n_tokens + 1 ids of the shipped calibration text (resources/kvtune)."""
    return calibration_tokens(engine, DEFAULT_CALIBRATION_TEXT.read_text(encoding="utf-8"), n_tokens)


def default_profile(engine, *, n_tokens: int = DEFAULT_N_TOKENS, directory: Path | None = None, progress=None,
                    cancel=None) -> tuple[Profile, bool]:
    """The profile behind the app's Auto preset, `omlx kv-tune` without --text-file and `omlx bench
    --tuned`: the shipped calibration text, the default KV options (block size, sinks, no rotation).
    Returns (profile, from store)."""
    tokens = default_calibration_tokens(engine, n_tokens)
    return get_profile(engine, tokens, options=KVConfig(), directory=directory, progress=progress, cancel=cancel)


def memory_range(geometry, ctx: int, options: KVConfig | None = None,
                 bits: Sequence[int] = CANDIDATE_BITS) -> tuple[float, float]:
    """Bytes held at `ctx` tokens with every layer at the narrowest and at the widest candidate
    width: the range a memory budget for `choose_for_memory` can take."""
    costs = model_costs(geometry, options if options is not None else KVConfig(), bits, ctx)
    return (float(costs.choice.min(axis=2).sum() + costs.fixed), float(costs.choice.max(axis=2).sum() + costs.fixed))


def choose_for_memory(profile: Profile, geometry, ctx: int, budget_bytes: float,
                      options: KVConfig | None = None) -> Choice:
    """The widths with the least predicted KL whose KV at `ctx` tokens fits in `budget_bytes`
    (`geometry`: a model or its geometry, see kv_shape). Options default to the profile's."""
    if options is None:
        options = KVConfig(block_size=profile.block_size, sinks=profile.sinks, rotation=profile.rotation)
    n = kv_shape(geometry)[0]
    if n != profile.n_layers:
        raise KVTuneError(f"the profile is for {profile.n_layers} layers, the model has {n}")
    costs = model_costs(geometry, options, profile.bits, ctx)
    return choose_widths(profile.kl, costs, budget_bytes, options)


def tune(engine, tokens: Sequence[int], *, budget_like_spec: str | KVConfig | None = None,
         bits_per_value: float | None = None, budget_bytes: float | None = None, ctx: int | None = None,
         verify: bool = True, directory: Path | None = None, progress=None) -> TuneResult:
    """Profile (or reuse the stored profile), choose widths for the budget, verify.

    Exactly one of `budget_like_spec`, `bits_per_value`, `budget_bytes` (which needs `ctx`). With
    `ctx`, bytes are those held at ctx tokens (sliding-window layers hold fewer); without, bytes per
    token of stored blocks. The options (block size, sinks, rotation) come from the spec given
    as budget, else the defaults.

    Verifying evaluates the choice on `tokens`; with a spec as the budget that spec is evaluated
    beside it, and when the choice does not measure better, the result is that spec (fell_back):
    a tuned spec is never knowingly worse than what it replaces."""
    t0 = time.perf_counter()
    given = [x is not None for x in (budget_like_spec, bits_per_value, budget_bytes)]
    if sum(given) != 1:
        raise KVTuneError("give exactly one budget: a spec to match, bits per value, or bytes at a context")
    if budget_bytes is not None and not ctx:
        raise KVTuneError("a budget in bytes needs the context it is for (ctx)")
    model = engine.model
    like = parse_kv(budget_like_spec) if budget_like_spec is not None else None
    options = like if like is not None else KVConfig()
    profile, from_store = get_profile(engine, tokens, options=options, directory=directory, progress=progress)
    costs = model_costs(model, options, profile.bits, ctx)
    if like is not None:
        budget = budget_like(like, model, costs)
    elif bits_per_value is not None:
        if not 0 < bits_per_value <= 16:
            raise KVTuneError(f"{bits_per_value} bits per value is outside 0..16")
        budget = budget_for_bits(bits_per_value, model, options, ctx)
    else:
        budget = float(budget_bytes)
    choice = choose_widths(profile.kl, costs, budget, options)
    per_token = model_costs(model, options, profile.bits).total(choice.widths)
    measured = measured_bytes = uniform = None
    fell_back = False
    if verify:
        from .evaluate import evaluate_kv

        if progress:
            progress("verifying", 0.0)
        specs = [choice.config] + ([like] if like is not None and str(like) != choice.spec else [])
        results = evaluate_kv(engine, tokens, specs)
        measured, measured_bytes = results[0].mean_kl, results[0].kv_bytes
        if len(results) > 1:
            uniform = results[1].mean_kl
            if uniform <= measured:
                fell_back = True
                widths = spec_widths(like, model.n_layers)
                choice = Choice(widths, predicted_kl(profile, like), costs.total(widths), budget, like)
                per_token = model_costs(model, options, profile.bits).total(widths)
                measured, measured_bytes = uniform, results[1].kv_bytes
    return TuneResult(choice, profile, from_store, per_token, measured, measured_bytes, time.perf_counter() - t0,
                      uniform, fell_back)
