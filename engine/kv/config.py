"""KVConfig: the precision of the KV cache, per layer, and the spec strings that describe it.

The cache stores keys (K) and values (V) separately, each at 16 (float16), 8, 6, 5, 4, 3 or 2
bits, in blocks of ``block_size`` tokens. The first ``sinks`` tokens are also kept in float16, and
keys can optionally be Hadamard-rotated before quantization (``rotation``).

The spec grammar, and the canonical spec ``str(config)`` writes, are in spec.py's docstring.

Everyone builds and reads a config through its methods rather than by writing spec strings: the
presets (``KVConfig.preset(name)``, ``KVConfig.presets()`` with their menu labels, ``preset_name``),
``with_bits``, ``with_overrides`` (a {layer: precision} mapping, grouped into ranges, or a list of
overrides), ``with_high_precision``, ``overrides_by_layer`` and ``layer_runs`` (the model's layers
as runs at one precision). The CLI's ``--kv SPEC`` parses a spec; its ``--kv-config FILE`` and the
desktop KV panel's import read a settings file.

Settings (``KVConfig.from_settings`` / ``KVConfig.from_file``) are read by settings.py, whose
docstring lists the keys (llama.cpp's cache type names included); the byte estimate
(``estimate_bytes``) is estimate.py's formula.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from .estimate import kv_bytes
from .settings import LLAMA_CPP_TYPES, SETTING_KEYS, partial_from_settings, read_settings_file
from .spec import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_PRESET,
    DEFAULT_SINKS,
    PRESET_LABELS,
    PRESETS,
    SELECTABLE_BITS,
    SUPPORTED_BITS,
    KVConfigError,
    LayerOverride,
    LayerPrecision,
    LayerRun,
    _check_bits,
    _coerce_override,
    _coerce_precision,
    _parse_precision,
    _parse_spec,
    _Partial,
    _runs,
    _suggest,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE", "DEFAULT_PRESET", "DEFAULT_SINKS", "LLAMA_CPP_TYPES", "PRESET_LABELS", "PRESETS",
    "SELECTABLE_BITS", "SETTING_KEYS", "SUPPORTED_BITS", "KVConfig", "KVConfigError", "LayerOverride",
    "LayerPrecision", "LayerRun", "estimate_bytes", "parse_kv",
]


@dataclass(frozen=True)
class KVConfig:
    """The KV cache's precision per layer, block size, sink tokens and key rotation.

    `overrides` is a tuple of LayerOverride applied in order over the base (k_bits, v_bits); the
    constructor also accepts 'sel:prec' strings or (selector, precision) pairs and normalizes them.
    """

    k_bits: int = 6
    v_bits: int = 4
    overrides: tuple = ()
    block_size: int = DEFAULT_BLOCK_SIZE
    sinks: int = DEFAULT_SINKS
    rotation: bool = False

    def __post_init__(self) -> None:
        _check_bits(self.k_bits, "K")
        _check_bits(self.v_bits, "V")
        if isinstance(self.overrides, (str, LayerOverride)) or not hasattr(self.overrides, "__iter__"):
            raise KVConfigError(f"overrides must be a tuple of overrides like ('0-3:k8v8',), not {self.overrides!r}")
        object.__setattr__(self, "overrides", tuple(_coerce_override(o) for o in self.overrides))
        for name, minimum in (("block_size", 1), ("sinks", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise KVConfigError(f"{name}: {value!r} is not a whole number >= {minimum}")
        if not isinstance(self.rotation, bool):
            raise KVConfigError(f"rotation: {self.rotation!r} is not True or False")

    @classmethod
    def parse(cls, spec: str) -> "KVConfig":
        """A config from a spec string such as 'k6v4', 'balanced,0-3:k8v8' or 'k4v4,rot,bs=16'."""
        return cls._from_partial(_parse_spec(spec))

    @classmethod
    def preset(cls, name: str) -> "KVConfig":
        """The preset called `name` (see PRESETS; any case, '_' for '-')."""
        token = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
        if token not in PRESETS:
            hint = _suggest(token, PRESETS) if isinstance(token, str) else ""
            raise KVConfigError(f"unknown preset {name!r}{hint} (presets: {', '.join(PRESETS)})")
        return cls.parse(PRESETS[token])

    @staticmethod
    def presets() -> list[tuple[str, str]]:
        """(name, label) of every preset, in menu order."""
        return list(PRESET_LABELS.items())

    def preset_name(self) -> str | None:
        """The name of the preset equal to this config (options included), or None."""
        return next((name for name in PRESETS if KVConfig.preset(name) == self), None)

    @classmethod
    def _from_partial(cls, p: _Partial) -> "KVConfig":
        default = _parse_precision(PRESETS[DEFAULT_PRESET])
        return cls(
            k_bits=default.k_bits if p.k_bits is None else p.k_bits,
            v_bits=default.v_bits if p.v_bits is None else p.v_bits,
            overrides=tuple(p.overrides),
            block_size=DEFAULT_BLOCK_SIZE if p.block_size is None else p.block_size,
            sinks=DEFAULT_SINKS if p.sinks is None else p.sinks,
            rotation=False if p.rotation is None else p.rotation,
        )

    @classmethod
    def from_settings(cls, settings: Mapping) -> "KVConfig":
        """A config from a settings mapping (see settings.py for the keys).

        `spec` and `preset` give a starting point; every other key must agree with whatever they
        set explicitly. `layers` overrides are applied after the spec's own overrides.
        """
        if isinstance(settings, KVConfig):
            return settings
        return cls._from_partial(partial_from_settings(settings))

    @classmethod
    def from_file(cls, path) -> "KVConfig":
        """A config from a JSON or TOML settings file.

        The file holds the settings at its top level, or in a `kv` table (other top-level keys are
        then left to the rest of the app); `kv` may also be a spec string. The format is chosen by
        the suffix (.json / .toml), otherwise by trying JSON then TOML.
        """
        path, data = read_settings_file(path)
        try:
            return cls.from_settings(data)
        except KVConfigError as e:
            raise KVConfigError(f"{path}: {e}") from None

    def _check_n_layers(self, n_layers: int) -> None:
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise KVConfigError(f"n_layers must be a positive int, not {n_layers!r}")

    def per_layer(self, n_layers: int) -> list[LayerPrecision]:
        """Every layer's precision in a model with `n_layers` layers (later overrides win)."""
        self._check_n_layers(n_layers)
        layers = [LayerPrecision(self.k_bits, self.v_bits)] * n_layers
        for override in self.overrides:
            for i in override.resolve(n_layers):
                layers[i] = override.precision
        return layers

    def layer(self, i: int, n_layers: int) -> LayerPrecision:
        """Layer i's precision (i may be negative) in a model with `n_layers` layers.

        Every override is checked against `n_layers`, not only the ones covering layer i.
        """
        self._check_n_layers(n_layers)
        if isinstance(i, bool) or not isinstance(i, int) or not -n_layers <= i < n_layers:
            raise KVConfigError(
                f"layer {i!r} is out of range: the model has {n_layers} layers (indices 0..{n_layers - 1})"
            )
        return self.per_layer(n_layers)[i]

    def with_high_precision(self) -> "KVConfig":
        """The same config with K8V8 in every layer (overrides dropped; block size, sinks, rotation kept)."""
        return replace(self, k_bits=8, v_bits=8, overrides=())

    @property
    def base(self) -> LayerPrecision:
        """The precision of every layer no override covers."""
        return LayerPrecision(self.k_bits, self.v_bits)

    def with_bits(self, k_bits: int, v_bits: int) -> "KVConfig":
        """The same config with base precision kK_BITSvV_BITS (overrides and options kept)."""
        return replace(self, k_bits=k_bits, v_bits=v_bits)

    def with_overrides(self, overrides) -> "KVConfig":
        """The same config with its layer overrides replaced by `overrides`, which is either

        * {layer: precision}: a non-negative layer index to a LayerPrecision, (k, v) or 'k8v8'.
          Consecutive layers at the same precision become one range and layers at the base
          precision are left out, so str() is the shortest spec for that per-layer setting; or
        * an iterable of overrides (LayerOverride, 'sel:prec', or (selector, precision)), kept in
          order (a later one wins where two overlap).
        """
        if not isinstance(overrides, Mapping):
            return replace(self, overrides=overrides)
        layers = {}
        for layer, precision in overrides.items():
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise KVConfigError(
                    f"layer {layer!r} is not a non-negative layer index (for ranges or layers counted "
                    f"from the end, give overrides like '-2..-1:k8v8')"
                )
            layers[layer] = _coerce_precision(precision, f"layer {layer}")
        base = self.base
        runs = _runs({i: p for i, p in layers.items() if p != base})
        return replace(self, overrides=tuple(LayerOverride(r.first, r.last, r.precision) for r in runs))

    def overrides_by_layer(self, n_layers: int | None = None) -> dict[int, LayerPrecision]:
        """{layer: precision} for every layer whose precision differs from the base (the inverse
        of `with_overrides` with a mapping). Without `n_layers` every override must use
        non-negative indices, since a layer counted from the end needs the model's layer count."""
        base = self.base
        if n_layers is not None:
            return {i: p for i, p in enumerate(self.per_layer(n_layers)) if p != base}
        layers: dict[int, LayerPrecision] = {}
        for override in self.overrides:
            if override.first < 0 or override.last < 0:
                raise KVConfigError(
                    f"layer override '{override}' counts layers from the end: "
                    "it needs the model's number of layers"
                )
            for i in range(override.first, override.last + 1):
                layers[i] = override.precision
        return {i: layers[i] for i in sorted(layers) if layers[i] != base}

    def layer_runs(self, n_layers: int) -> list[LayerRun]:
        """The model's layers 0..n_layers-1 as runs of consecutive layers at the same precision."""
        return _runs(dict(enumerate(self.per_layer(n_layers))))

    def __str__(self) -> str:
        parts = [str(LayerPrecision(self.k_bits, self.v_bits))]
        parts += [str(o) for o in self.overrides]
        if self.block_size != DEFAULT_BLOCK_SIZE:
            parts.append(f"bs={self.block_size}")
        if self.sinks != DEFAULT_SINKS:
            parts.append(f"sinks={self.sinks}")
        if self.rotation:
            parts.append("rot")
        return ",".join(parts)


def parse_kv(spec_or_preset: "str | KVConfig | None") -> KVConfig:
    """A KVConfig from a spec or preset name; None gives the default preset ('balanced')."""
    if spec_or_preset is None:
        return KVConfig.parse(DEFAULT_PRESET)
    if isinstance(spec_or_preset, KVConfig):
        return spec_or_preset
    return KVConfig.parse(spec_or_preset)


def estimate_bytes(
    config: "KVConfig | str",
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    n_tokens: int,
    value_dim: int | None = None,
    windows: list[int | None] | None = None,
) -> dict:
    """Bytes the paged cache holds for `n_tokens` tokens of one sequence at `config` (a KVConfig,
    a spec or a preset name): estimate.kv_bytes, which describes the storage model and the result."""
    return kv_bytes(parse_kv(config), n_layers, n_kv_heads, head_dim, n_tokens, value_dim, windows)
