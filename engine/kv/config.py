"""KVConfig: the precision of the KV cache, per layer, and the spec strings that describe it.

The cache stores keys (K) and values (V) separately, each at 16 (float16), 8, 6, 5, 4, 3 or 2
bits, in blocks of ``block_size`` tokens. The first ``sinks`` tokens are also kept in float16, and
keys can optionally be Hadamard-rotated before quantization (``rotation``).

Spec grammar (case-insensitive, items separated by commas, spaces around items ignored)::

    spec       := [base] ("," item)*          no base: the default preset ("balanced")
    base       := precision                   if present, it must be the first item
    item       := override | option
    precision  := "k" BITS "v" BITS           e.g. k6v4, k8v16 (BITS in 16, 8, 6, 5, 4, 3, 2)
                | "f16" | "fp16"              = k16v16
                | PRESET                      high-precision, balanced, memory-saver, full
    override   := selector ":" precision
    selector   := N                           one layer: 5, or -1 (the last layer)
                | N "-" N                     inclusive range of non-negative indices: 28-29
                | N ".." N                    inclusive range, either end may be negative: -2..-1, 4..-1
                | "first" N                   the first N layers (= 0..N-1)
                | "last" N                    the last N layers (= -N..-1)
    option     := "bs=" N | "block_size=" N   block size in tokens (default 32)
                | "sinks=" N                  full-precision sink tokens (default 4)
                | "rot" | "rot=" BOOL         Hadamard rotation of keys (default off)
                | "rotation" | "rotation=" BOOL
    BOOL       := 1 | 0 | true | false | on | off | yes | no

Negative indices count from the end (-1 is the last layer). A range whose ends are both negative
or both non-negative must not be reversed. ``-2-1`` and ``-2--1`` are rejected as ambiguous: write
``-2..-1``. Overrides are applied in order, so a later override wins where two overlap. Selectors
are checked against the model when resolved (``layer``/``per_layer``): one that reaches past the
model's layers is an error, never clipped.

``str(config)`` is the canonical spec: ``kKvV``, then each override as ``selector:kKvV`` in order
(``first4`` is written ``0-3``, ``last2`` is written ``-2..-1``), then the options that differ from
their defaults (``bs=``, ``sinks=``, ``rot``). It parses back to an equal config.

Everyone builds and reads a config through its methods rather than by writing spec strings: the
presets (``KVConfig.preset(name)``, ``KVConfig.presets()`` with their menu labels, ``preset_name``),
``with_bits``, ``with_overrides`` (a {layer: precision} mapping, grouped into ranges, or a list of
overrides), ``with_high_precision``, ``overrides_by_layer`` and ``layer_runs`` (the model's layers
as runs at one precision). The CLI's ``--kv SPEC`` parses a spec; its ``--kv-config FILE`` and the
desktop KV panel's import read a settings file.

Settings (``KVConfig.from_settings`` / ``KVConfig.from_file``) take the keys ``k_bits``,
``v_bits``, ``layers``, ``block_size``, ``sinks``, ``rotation``, ``preset`` and ``spec``, plus
llama.cpp's ``cache_type_k``/``cache_type_v`` (and ``type_k``/``type_v``) with llama.cpp type names
(see ``LLAMA_CPP_TYPES``). ``f32`` is rejected: this cache stores at most 16 bits per value, and
quietly turning a requested f32 cache into f16 is the kind of surprise this module exists to avoid.
Every setting is checked: an unknown key, a bad value, or two settings that disagree (``k_bits=8``
with ``cache_type_k="q4_0"``, or ``k_bits=8`` with ``preset="balanced"``) is a ``KVConfigError``.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from ..errors import SettingsError

SUPPORTED_BITS = (16, 8, 6, 5, 4, 3, 2)
PRESETS: dict[str, str] = {
    "high-precision": "k8v8",
    "balanced": "k6v4",
    "memory-saver": "k4v4",
    "full": "k16v16",
}
PRESET_LABELS: dict[str, str] = {  # the presets in menu order, with what a menu shows
    "balanced": "Balanced (K6V4)",
    "memory-saver": "Memory saver (K4V4)",
    "high-precision": "High precision (K8V8)",
    "full": "Full 16-bit",
}
SELECTABLE_BITS = tuple(sorted(SUPPORTED_BITS))
"""The supported bit widths in ascending order, as a slider or a menu offers them."""
DEFAULT_PRESET = "balanced"
DEFAULT_BLOCK_SIZE = 32
DEFAULT_SINKS = 4

_PRECISION_ALIASES = {"f16": (16, 16), "fp16": (16, 16)}
_OPTION_NAMES = ("bs", "block_size", "sinks", "rot", "rotation")
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")

_KV_RE = re.compile(r"k(\d+)v(\d+)")
_INT_RE = re.compile(r"-?\d+")
_DASH_RANGE_RE = re.compile(r"(\d+)-(\d+)")
_DOT_RANGE_RE = re.compile(r"(-?\d+)\.\.(-?\d+)")
_FIRST_LAST_RE = re.compile(r"(first|last)(\d+)")
_AMBIGUOUS_RANGE_RE = re.compile(r"(-?\d+)-(-?\d+)")


# -- spec grammar: precisions, layer selectors, options ----------------------------------------


class KVConfigError(SettingsError):
    """A KV cache spec or setting that cannot be used as written."""


def _closest(word: str, candidates, cutoff: float = 0.6) -> str | None:
    """The candidate most similar to `word` (difflib ratio >= cutoff; ties go to the earlier one)."""
    best, best_score = None, cutoff
    for candidate in candidates:
        score = difflib.SequenceMatcher(None, word, candidate).ratio()
        if score > best_score or (best is None and score >= cutoff):
            best, best_score = candidate, score
    return best


def _suggest(word: str, candidates, cutoff: float = 0.6) -> str:
    """' — did you mean 'x'?' for the closest candidate, or '' if nothing is close."""
    match = _closest(word, candidates, cutoff)
    return f" — did you mean '{match}'?" if match else ""


def _nearest_bits(bits: int) -> int:
    """The supported bit width closest to `bits` (the higher one on a tie)."""
    return min(SUPPORTED_BITS, key=lambda b: (abs(b - bits), -b))


def _bits_list() -> str:
    return ", ".join(str(b) for b in SUPPORTED_BITS)


def _check_bits(bits, role: str) -> int:
    """`bits` as an int if it is a supported width for `role` ('K' or 'V'), else KVConfigError."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise KVConfigError(f"{bits!r} is not a number of bits for {role} ({_bits_list()})")
    if bits not in SUPPORTED_BITS:
        raise KVConfigError(
            f"{bits} bits is not a supported {role} precision ({_bits_list()}) — did you mean {_nearest_bits(bits)}?"
        )
    return bits


@dataclass(frozen=True)
class LayerPrecision:
    """Bits per stored key and per stored value in one layer (16 = float16)."""

    k_bits: int
    v_bits: int

    def __post_init__(self) -> None:
        _check_bits(self.k_bits, "K")
        _check_bits(self.v_bits, "V")

    def __str__(self) -> str:
        return f"k{self.k_bits}v{self.v_bits}"


@dataclass(frozen=True)
class LayerOverride:
    """A precision for the inclusive layer range first..last (negative = counted from the end)."""

    first: int
    last: int
    precision: LayerPrecision

    def __post_init__(self) -> None:
        for name in ("first", "last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise KVConfigError(f"layer index {value!r} is not an integer")
        if not isinstance(self.precision, LayerPrecision):
            raise KVConfigError(f"{self.precision!r} is not a LayerPrecision")
        if (self.first < 0) == (self.last < 0) and self.first > self.last:
            raise KVConfigError(
                f"layer range '{self.selector}' is reversed — did you mean '{_selector(self.last, self.first)}'?"
            )

    @property
    def selector(self) -> str:
        """The canonical selector: '5', '-1', '28-29' or '-2..-1'."""
        return _selector(self.first, self.last)

    def resolve(self, n_layers: int) -> range:
        """The layer indices this override covers in a model with `n_layers` layers."""
        first = self.first + n_layers if self.first < 0 else self.first
        last = self.last + n_layers if self.last < 0 else self.last
        if not (0 <= first < n_layers and 0 <= last < n_layers):
            raise KVConfigError(
                f"layer override '{self}' is out of range: the model has {n_layers} layers "
                f"(indices 0..{n_layers - 1}, or -{n_layers}..-1 from the end)"
            )
        if first > last:
            raise KVConfigError(
                f"layer override '{self}' selects no layers in a model with {n_layers} layers "
                f"(it resolves to {first}..{last})"
            )
        return range(first, last + 1)

    def __str__(self) -> str:
        return f"{self.selector}:{self.precision}"


def _selector(first: int, last: int) -> str:
    if first == last:
        return str(first)
    if first >= 0 and last >= 0:
        return f"{first}-{last}"
    return f"{first}..{last}"


def _parse_precision(text: str, where: str = "") -> LayerPrecision:
    """'k6v4', 'f16' or a preset name → LayerPrecision; `where` prefixes error messages."""
    token = text.strip().lower()
    prefix = f"{where}: " if where else ""
    m = _KV_RE.fullmatch(token)
    if m:
        k, v = int(m.group(1)), int(m.group(2))
        for bits, role in ((k, "K"), (v, "V")):
            if bits not in SUPPORTED_BITS:
                fixed = f"k{_nearest_bits(k)}v{v}" if role == "K" else f"k{k}v{_nearest_bits(v)}"
                raise KVConfigError(
                    f"{prefix}in '{text.strip()}': {bits} bits is not a supported {role} precision "
                    f"({_bits_list()}) — did you mean '{fixed}'?"
                )
        return LayerPrecision(k, v)
    if token in _PRECISION_ALIASES:
        return LayerPrecision(*_PRECISION_ALIASES[token])
    preset = token.replace("_", "-")
    if preset in PRESETS:
        return _parse_precision(PRESETS[preset])
    hint = _suggest(token, list(PRESETS) + list(_PRECISION_ALIASES) + list(_OPTION_NAMES))
    if not hint and re.fullmatch(r"k\d*v?\d*|v\d+k\d+", token):
        hint = " — write it as k<bits>v<bits>, e.g. 'k6v4'"
    if not hint:
        hint = f" — use k<bits>v<bits> (bits in {_bits_list()}), 'f16', or a preset ({', '.join(PRESETS)})"
    raise KVConfigError(f"{prefix}'{text.strip()}' is not a KV cache precision or preset{hint}")


def _parse_selector(text: str) -> tuple[int, int]:
    """A layer selector → (first, last), inclusive, possibly negative."""
    sel = text.strip().lower().replace(" ", "")
    if _INT_RE.fullmatch(sel):
        return int(sel), int(sel)
    m = _DASH_RANGE_RE.fullmatch(sel)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = _DOT_RANGE_RE.fullmatch(sel)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = _FIRST_LAST_RE.fullmatch(sel)
    if m:
        n = int(m.group(2))
        if n < 1:
            raise KVConfigError(f"layer selector '{text.strip()}' selects no layers — use {m.group(1)}1 or more")
        return (0, n - 1) if m.group(1) == "first" else (-n, -1)
    m = _AMBIGUOUS_RANGE_RE.fullmatch(sel)
    if m:
        raise KVConfigError(
            f"layer selector '{text.strip()}' is ambiguous with negative indices — "
            f"did you mean {_ambiguous_alternatives(m.group(1), m.group(2))}? "
            f"('a-b' is for non-negative indices, 'a..b' allows negatives)"
        )
    word = re.sub(r"[\d.-]+", "", sel)
    count = "".join(re.findall(r"\d+", sel)[:1]) or "4"
    close = _closest(word, ["first", "last"], cutoff=0.5) if word else None
    if close:
        hint = f" — did you mean '{close}{count}'?"
    else:
        hint = " — use N, A-B, A..B (negatives allowed, e.g. -2..-1), firstN or lastN"
    raise KVConfigError(f"'{text.strip()}' is not a layer selector{hint}")


def _ambiguous_alternatives(first: str, second: str) -> str:
    options = [f"'{first}..{second}'"]
    if not second.startswith("-") and first.startswith("-"):
        options.insert(0, f"'{first}..-{second}'")
    return " or ".join(options)


def _parse_override(text: str) -> LayerOverride:
    selector, _, precision = text.partition(":")
    if not selector.strip():
        raise KVConfigError(f"override '{text.strip()}' has no layer selector — e.g. '0-3:k8v8'")
    if not precision.strip():
        raise KVConfigError(f"override '{text.strip()}' has no precision — e.g. '{selector.strip()}:k8v8'")
    first, last = _parse_selector(selector)
    prec = _parse_precision(precision, where=f"override '{text.strip()}'")
    return LayerOverride(first, last, prec)


def _parse_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool):
        raise KVConfigError(f"{name}: {value!r} is not a whole number")
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    if not isinstance(value, int):
        raise KVConfigError(f"{name}: {value!r} is not a whole number")
    if value < minimum:
        raise KVConfigError(f"{name}: {value} is too small (the minimum is {minimum})")
    return value


def _parse_bool(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        token = value.strip().lower()
        if token in _TRUE:
            return True
        if token in _FALSE:
            return False
        hint = _suggest(token, _TRUE + _FALSE)
        raise KVConfigError(f"{name}: {value!r} is not on/off{hint} (use true/false, on/off or 1/0)")
    raise KVConfigError(f"{name}: {value!r} is not on/off (use true/false or 1/0)")


def _coerce_precision(value, where: str) -> LayerPrecision:
    """A LayerPrecision, (k, v) or a precision string such as 'k8v8' -> LayerPrecision."""
    if isinstance(value, LayerPrecision):
        return value
    if isinstance(value, str):
        return _parse_precision(value, where=where)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        try:
            return LayerPrecision(*value)
        except KVConfigError as e:
            raise KVConfigError(f"{where}: {e}") from None
    raise KVConfigError(f"{where}: {value!r} is not a precision like 'k8v8'")


def _coerce_override(item) -> LayerOverride:
    """LayerOverride, 'sel:prec', or (selector, precision) with precision a str, LayerPrecision or (k, v)."""
    if isinstance(item, LayerOverride):
        return item
    if isinstance(item, str):
        return _parse_override(item)
    if isinstance(item, (tuple, list)) and len(item) == 2:
        selector, precision = item
        first, last = _parse_selector(str(selector))
        return LayerOverride(first, last, _coerce_precision(precision, f"override for layers '{selector}'"))
    raise KVConfigError(f"{item!r} is not a layer override like '0-3:k8v8'")


class LayerRun(NamedTuple):
    """Consecutive layers first..last (inclusive, non-negative) at one precision."""

    first: int
    last: int
    precision: LayerPrecision

    @property
    def selector(self) -> str:
        """'5' for one layer, '0-3' for several."""
        return _selector(self.first, self.last)


def _runs(layers: Mapping[int, LayerPrecision]) -> list[LayerRun]:
    """{layer: precision} grouped into runs of consecutive layers at the same precision."""
    runs: list[LayerRun] = []
    for i in sorted(layers):
        precision = layers[i]
        if runs and runs[-1].last == i - 1 and runs[-1].precision == precision:
            runs[-1] = runs[-1]._replace(last=i)
        else:
            runs.append(LayerRun(i, i, precision))
    return runs


@dataclass
class _Partial:
    """What a spec or a settings source sets explicitly; None = not mentioned."""

    k_bits: int | None = None
    v_bits: int | None = None
    base: str | None = None
    overrides: list = field(default_factory=list)
    block_size: int | None = None
    sinks: int | None = None
    rotation: bool | None = None


def _parse_spec(spec: str) -> _Partial:
    if not isinstance(spec, str):
        raise KVConfigError(f"a KV cache spec must be a string, not {type(spec).__name__}")
    if not spec.strip():
        raise KVConfigError(
            f"empty KV cache spec — use a preset ({', '.join(PRESETS)}) or k<bits>v<bits>, e.g. 'k6v4'"
        )
    out = _Partial()
    seen_options: dict[str, str] = {}
    items = spec.split(",")
    for index, raw in enumerate(items):
        item = raw.strip()
        if not item:
            raise KVConfigError(f"empty item in KV cache spec '{spec}' (a stray comma?)")
        lower = item.lower()
        if ":" in item:
            out.overrides.append(_parse_override(item))
            continue
        name, eq, value = lower.partition("=")
        name, value = name.strip(), value.strip()
        if eq or name in ("rot", "rotation"):
            option = {"block_size": "bs", "rotation": "rot"}.get(name, name)
            if option not in ("bs", "sinks", "rot"):
                raise KVConfigError(
                    f"unknown option '{item}' in KV cache spec{_suggest(name, _OPTION_NAMES, cutoff=0.5)} "
                    f"(options: bs=N, sinks=N, rot)"
                )
            if option in seen_options:
                raise KVConfigError(
                    f"option '{option}' is given twice in KV cache spec ('{seen_options[option]}' and '{item}')"
                )
            seen_options[option] = item
            if option == "bs":
                out.block_size = _parse_int(value, f"option '{item}'", 1)
            elif option == "sinks":
                out.sinks = _parse_int(value, f"option '{item}'", 0)
            else:
                out.rotation = True if not eq else _parse_bool(value, f"option '{item}'")
            continue
        if name in _OPTION_NAMES:
            example = f"{name}={4 if name == 'sinks' else 64}"
            raise KVConfigError(f"option '{item}' in KV cache spec needs a value, e.g. '{example}'")
        precision = _parse_precision(item)
        if out.base is not None:
            raise KVConfigError(f"KV cache spec '{spec}' has two base precisions ('{out.base}' and '{item}')")
        if index != 0:
            raise KVConfigError(f"the base precision '{item}' must be the first item of the KV cache spec '{spec}'")
        out.k_bits, out.v_bits, out.base = precision.k_bits, precision.v_bits, item
    return out


# -- the config ---------------------------------------------------------------------------------


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
        """A config from a settings mapping (see the module docstring for the keys).

        `spec` and `preset` give a starting point; every other key must agree with whatever they
        set explicitly. `layers` overrides are applied after the spec's own overrides.
        """
        if isinstance(settings, KVConfig):
            return settings
        if not isinstance(settings, Mapping):
            raise KVConfigError(f"KV cache settings must be a mapping, not {type(settings).__name__}")
        _check_keys(settings, SETTING_KEYS, "")
        entries: dict = {}
        for key, value in settings.items():
            norm = _normalize_key(key)
            if norm in entries and entries[norm][1] != value:
                raise KVConfigError(
                    f"setting '{norm}' is given twice with different values ({entries[norm][1]!r} and {value!r})"
                )
            entries[norm] = (key, value)
        values = {k: v for k, (_, v) in entries.items()}

        spec = _Partial()
        if "spec" in values:
            try:
                spec = _parse_spec(values["spec"])
            except KVConfigError as e:
                raise KVConfigError(f"spec: {e}") from None
        preset = None
        if "preset" in values:
            name = values["preset"]
            if not isinstance(name, str):
                raise KVConfigError(f"preset: {name!r} is not a preset name ({', '.join(PRESETS)})")
            token = name.strip().lower().replace("_", "-")
            if token not in PRESETS:
                raise KVConfigError(
                    f"preset: unknown preset '{name}'{_suggest(token, PRESETS)} (presets: {', '.join(PRESETS)})"
                )
            preset = _parse_precision(PRESETS[token])

        k_sources = _role_sources(values, _K_KEYS, "K")
        v_sources = _role_sources(values, _V_KEYS, "V")
        if spec.base is not None:
            k_sources[f"spec {values['spec']!r}"] = spec.k_bits
            v_sources[f"spec {values['spec']!r}"] = spec.v_bits
        if preset is not None:
            k_sources[f"preset={values['preset']!r}"] = preset.k_bits
            v_sources[f"preset={values['preset']!r}"] = preset.v_bits
        k_bits = _precision_from(k_sources, "K")
        v_bits = _precision_from(v_sources, "V")

        result = _Partial(k_bits=k_bits, v_bits=v_bits, overrides=list(spec.overrides))
        for key, spec_value, parse in (
            ("block_size", spec.block_size, lambda v: _parse_int(v, "block_size", 1)),
            ("sinks", spec.sinks, lambda v: _parse_int(v, "sinks", 0)),
            ("rotation", spec.rotation, lambda v: _parse_bool(v, "rotation")),
        ):
            setting = parse(values[key]) if key in values else None
            if setting is not None and spec_value is not None and setting != spec_value:
                raise KVConfigError(
                    f"conflicting settings: {_value_label(key, values[key])} but spec {values['spec']!r} "
                    f"sets {key} to {spec_value} — give only one"
                )
            setattr(result, key, spec_value if setting is None else setting)

        if "layers" in values:
            default = _parse_precision(PRESETS[DEFAULT_PRESET])
            base = LayerPrecision(
                default.k_bits if k_bits is None else k_bits, default.v_bits if v_bits is None else v_bits
            )
            result.overrides.extend(_layer_overrides(values["layers"], base))
        return cls._from_partial(result)

    @classmethod
    def from_file(cls, path) -> "KVConfig":
        """A config from a JSON or TOML settings file.

        The file holds the settings at its top level, or in a `kv` table (other top-level keys are
        then left to the rest of the app); `kv` may also be a spec string. The format is chosen by
        the suffix (.json / .toml), otherwise by trying JSON then TOML.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise KVConfigError(f"{path}: no such settings file") from None
        except OSError as e:
            raise KVConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise KVConfigError(f"{path}: not a text file (expected JSON or TOML)") from None
        data = _load_settings_text(text, path)
        if not isinstance(data, Mapping):
            kind = type(data).__name__
            raise KVConfigError(f"{path}: the top level must be an object/table of settings, not {kind}")
        sections = [k for k in data if isinstance(k, str) and _normalize_key(k) in _FILE_SECTIONS]
        if sections:
            section = data[sections[0]]
            stray = [k for k in data if isinstance(k, str) and _normalize_key(k) in SETTING_KEYS]
            if stray:
                keys = ", ".join(repr(k) for k in stray)
                raise KVConfigError(
                    f"{path}: {keys} must go inside the '{sections[0]}' table with the other KV settings"
                )
            if isinstance(section, str):
                section = {"spec": section}
            data = section
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


# -- settings: mappings and files, with llama.cpp's names -------------------------------------


LLAMA_CPP_TYPES: dict[str, int] = {
    "f16": 16,
    "fp16": 16,
    "bf16": 16,
    "q8_0": 8,
    "q6_0": 6,
    "q6_k": 6,
    "q5_0": 5,
    "q5_1": 5,
    "q5_k": 5,
    "q4_0": 4,
    "q4_1": 4,
    "q4_k": 4,
    "iq4_nl": 4,
    "q3_k": 3,
    "q2_k": 2,
}
"""llama.cpp cache type names (case-insensitive) and the bit width they map to here."""

_REJECTED_TYPES = {
    "f32": "f32 is not supported: this cache stores at most 16 bits per value; use 'f16' for a full-precision cache",
    "fp32": "fp32 is not supported: this cache stores at most 16 bits per value; use 'f16' for a full-precision cache",
}

SETTING_KEYS = (
    "k_bits",
    "v_bits",
    "layers",
    "block_size",
    "sinks",
    "rotation",
    "preset",
    "spec",
    "cache_type_k",
    "cache_type_v",
    "type_k",
    "type_v",
)
_K_KEYS = ("k_bits", "cache_type_k", "type_k")
_V_KEYS = ("v_bits", "cache_type_v", "type_v")
_LAYER_PRECISION_KEYS = _K_KEYS + _V_KEYS
_LAYER_ITEM_KEYS = ("layers",) + _LAYER_PRECISION_KEYS
_FILE_SECTIONS = ("kv",)


def _normalize_key(key) -> str:
    if not isinstance(key, str):
        raise KVConfigError(f"setting name {key!r} is not a string")
    return key.strip().lower().replace("-", "_")


def _llama_type(value, key: str, role: str) -> int:
    """A llama.cpp cache type name (or a bit count) → bits."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return _check_bits(value, role)
        except KVConfigError as e:
            raise KVConfigError(f"{key}: {e}") from None
    if not isinstance(value, str):
        raise KVConfigError(f"{key}: {value!r} is not a cache type like 'q8_0' or 'f16'")
    token = value.strip().lower()
    if token in LLAMA_CPP_TYPES:
        return LLAMA_CPP_TYPES[token]
    if token in _REJECTED_TYPES:
        raise KVConfigError(f"{key}: {_REJECTED_TYPES[token]}")
    if token.isdigit():
        return _llama_type(int(token), key, role)
    raise KVConfigError(
        f"{key}: '{value}' is not a supported cache type{_suggest(token, LLAMA_CPP_TYPES, cutoff=0.5)} "
        f"(supported: {', '.join(LLAMA_CPP_TYPES)})"
    )


def _bits_setting(value, key: str, role: str) -> int:
    """k_bits / v_bits: a whole number of bits."""
    if isinstance(value, str):
        token = value.strip().lower()
        if token.isdigit():
            value = int(token)
        elif token in LLAMA_CPP_TYPES or token in _REJECTED_TYPES:
            other = "cache_type_k" if role == "K" else "cache_type_v"
            raise KVConfigError(
                f"{key}: takes a number of bits ({_bits_list()}); for llama.cpp type names use {other} = '{value}'"
            )
    try:
        return _check_bits(value, role)
    except KVConfigError as e:
        raise KVConfigError(f"{key}: {e}") from None


def _precision_from(sources: dict, role: str, where: str = "") -> int | None:
    """The bits `sources` ({label: bits}) agree on, or None; KVConfigError if they disagree."""
    if len(set(sources.values())) > 1:
        described = ", ".join(
            label if label.startswith(("k_bits", "v_bits")) else f"{label} ({bits} bits)"
            for label, bits in sources.items()
        )
        prefix = f"{where}: " if where else ""
        raise KVConfigError(f"{prefix}conflicting {role} precision settings: {described} — give only one")
    return next(iter(sources.values()), None)


def _value_label(key: str, value) -> str:
    return f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"


def _check_keys(keys, valid, where: str) -> None:
    unknown = [k for k in keys if _normalize_key(k) not in valid]
    if unknown:
        problems = "; ".join(f"unknown setting '{k}'{_suggest(_normalize_key(k), valid)}" for k in unknown)
        raise KVConfigError(f"{where}{problems} (valid settings: {', '.join(valid)})")


def _layer_entry(selector, value, base: LayerPrecision, where: str) -> LayerOverride:
    """One `layers` entry: selector → 'k8v8' | preset | {k_bits, v_bits, cache_type_k, ...}."""
    try:
        first, last = _parse_selector(str(selector))
    except KVConfigError as e:
        raise KVConfigError(f"{where}: {e}") from None
    label = f"{where}['{selector}']"
    if isinstance(value, LayerPrecision):
        prec = value
    elif isinstance(value, str):
        prec = _parse_precision(value, where=label)
    elif isinstance(value, Mapping):
        _check_keys(value, _LAYER_PRECISION_KEYS, f"{label}: ")
        entries = {_normalize_key(k): v for k, v in value.items()}
        if not entries:
            raise KVConfigError(f"{label}: empty — give k_bits and/or v_bits (or a precision like 'k8v8')")
        k = _precision_from(_role_sources(entries, _K_KEYS, "K", label), "K", label)
        v = _precision_from(_role_sources(entries, _V_KEYS, "V", label), "V", label)
        prec = LayerPrecision(base.k_bits if k is None else k, base.v_bits if v is None else v)
    else:
        raise KVConfigError(f"{label}: {value!r} is not a precision like 'k8v8'")
    return LayerOverride(first, last, prec)


def _role_sources(entries: dict, keys: tuple, role: str, where: str = "") -> dict:
    prefix = f"{where}: " if where else ""
    sources = {}
    for key in keys:
        if key in entries:
            value = entries[key]
            try:
                bits = _bits_setting(value, key, role) if key.endswith("_bits") else _llama_type(value, key, role)
            except KVConfigError as e:
                raise KVConfigError(f"{prefix}{e}") from None
            sources[_value_label(key, value)] = bits
    return sources


def _layer_overrides(value, base: LayerPrecision) -> list[LayerOverride]:
    """The `layers` setting: a mapping, a list of entries, or a comma-separated override string."""
    if isinstance(value, Mapping):
        return [_layer_entry(sel, prec, base, "layers") for sel, prec in value.items()]
    if isinstance(value, str):
        try:
            return [_parse_override(item) for item in value.split(",") if item.strip()]
        except KVConfigError as e:
            raise KVConfigError(f"layers: {e}") from None
    if isinstance(value, (list, tuple)):
        out = []
        for n, item in enumerate(value):
            where = f"layers[{n}]"
            if isinstance(item, str):
                try:
                    out.append(_parse_override(item))
                except KVConfigError as e:
                    raise KVConfigError(f"{where}: {e}") from None
            elif isinstance(item, Mapping):
                _check_keys(item, _LAYER_ITEM_KEYS, f"{where}: ")
                entries = {_normalize_key(k): v for k, v in item.items()}
                if "layers" not in entries:
                    raise KVConfigError(f"{where}: missing 'layers' (the layer selector, e.g. \"0-3\")")
                selector = entries.pop("layers")
                out.append(_layer_entry(selector, entries, base, where))
            elif isinstance(item, (list, tuple)) and len(item) == 2:
                out.append(_layer_entry(item[0], item[1], base, where))
            else:
                raise KVConfigError(f"{where}: {item!r} is not a layer override like '0-3:k8v8'")
        return out
    raise KVConfigError(f"layers: {value!r} is not a mapping like {{\"0-3\": \"k8v8\"}} or a list of overrides")


def _load_settings_text(text: str, path: Path):
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _load_json(text, path)
    if suffix == ".toml":
        return _load_toml(text, path)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise KVConfigError(f"{path}: neither valid JSON nor valid TOML") from None


def _load_json(text: str, path: Path):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise KVConfigError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def _load_toml(text: str, path: Path):
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise KVConfigError(f"{path}: invalid TOML: {e}") from None


# -- size estimate -----------------------------------------------------------------------------


def estimate_bytes(
    config: KVConfig,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    n_tokens: int,
    value_dim: int | None = None,
    windows: list[int | None] | None = None,
) -> dict:
    """Bytes the paged cache holds for `n_tokens` tokens of one sequence (the formula).

    Storage model (engine.kv.paged), per layer and for K and V separately:
      * the full blocks a layer still holds, each one row of
        `get_format(bits, role).bytes_per_block(n_kv_heads, block_size, dim)` bytes (16 bits:
        float16 rows). A sliding-window layer (windows[i] = W) releases blocks that the next
        query can no longer see: those ending before position n_tokens - W + 1;
      * the unfinished tail block and the sink tokens: float32 buffers of block_size and
        `sinks` tokens, allocated once per layer.

    Returns {"total", "k", "v": bytes; "per_layer": [{"layer", "k_bits", "v_bits", "k", "v",
    "total", "k_blocks", "v_blocks" (the quantized blocks alone, without the buffers)}];
    "bits_per_value": average stored bits per K/V element (0.0 for no tokens)}.
    """
    if not isinstance(config, KVConfig):
        config = parse_kv(config)
    n_kv_heads = _parse_int(n_kv_heads, "n_kv_heads", 1)
    head_dim = _parse_int(head_dim, "head_dim", 1)
    n_tokens = _parse_int(n_tokens, "n_tokens", 0)
    value_dim = head_dim if value_dim is None else _parse_int(value_dim, "value_dim", 1)
    windows = windows or [None] * n_layers
    layers = config.per_layer(n_layers)
    from .formats import get_format

    bs = config.block_size
    n_full = n_tokens // bs
    buffer_tokens = bs + config.sinks

    def block_bytes(bits: int, role: str, dim: int, blocks: int) -> int:
        return blocks * get_format(bits, role).bytes_per_block(n_kv_heads, bs, dim)

    def buffer_bytes(dim: int) -> int:
        return buffer_tokens * n_kv_heads * dim * 4

    per_layer = []
    for i, prec in enumerate(layers):
        blocks = n_full
        if windows[i] is not None:
            blocks -= min(n_full, max(0, (n_tokens - windows[i] + 1) // bs))
        k_blocks = block_bytes(prec.k_bits, "k", head_dim, blocks)
        v_blocks = block_bytes(prec.v_bits, "v", value_dim, blocks)
        k, v = k_blocks + buffer_bytes(head_dim), v_blocks + buffer_bytes(value_dim)
        per_layer.append({"layer": i, "k_bits": prec.k_bits, "v_bits": prec.v_bits, "k": k, "v": v,
                          "total": k + v, "k_blocks": k_blocks, "v_blocks": v_blocks})
    k_total = sum(p["k"] for p in per_layer)
    v_total = sum(p["v"] for p in per_layer)
    total = k_total + v_total
    n_values = n_layers * n_tokens * n_kv_heads * (head_dim + value_dim)
    return {
        "total": total,
        "k": k_total,
        "v": v_total,
        "per_layer": per_layer,
        "bits_per_value": total * 8 / n_values if n_values else 0.0,
    }
