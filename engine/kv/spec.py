"""The KV spec grammar: bit widths, layer precisions and overrides, and the spec strings.

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

``KVConfig`` (config.py) is built from what ``_parse_spec`` reads; settings.py reads settings
mappings and files into the same partial form.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
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
