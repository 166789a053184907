"""KV settings mappings and files (JSON or TOML), with llama.cpp's cache type names.

The keys ``k_bits``, ``v_bits``, ``layers``, ``block_size``, ``sinks``, ``rotation``, ``preset`` and
``spec``, plus llama.cpp's ``cache_type_k``/``cache_type_v`` (and ``type_k``/``type_v``) with
llama.cpp type names (see ``LLAMA_CPP_TYPES``). ``f32`` is rejected: this cache stores at most 16
bits per value, and quietly turning a requested f32 cache into f16 is the kind of surprise this
module exists to avoid. Every setting is checked: an unknown key, a bad value, or two settings that
disagree (``k_bits=8`` with ``cache_type_k="q4_0"``, or ``k_bits=8`` with ``preset="balanced"``) is
a ``KVConfigError``. ``KVConfig.from_settings`` and ``KVConfig.from_file`` (config.py) build the
config from what this module reads.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path

from .spec import (
    DEFAULT_PRESET,
    PRESETS,
    KVConfigError,
    LayerOverride,
    LayerPrecision,
    _bits_list,
    _check_bits,
    _parse_bool,
    _parse_int,
    _parse_override,
    _parse_precision,
    _parse_selector,
    _parse_spec,
    _Partial,
    _suggest,
)

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


def partial_from_settings(settings: Mapping) -> _Partial:
    """What a settings mapping sets (see the module docstring for the keys), checked.

    `spec` and `preset` give a starting point; every other key must agree with whatever they
    set explicitly. `layers` overrides are applied after the spec's own overrides.
    """
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
    return result


def read_settings_file(path) -> tuple[Path, Mapping]:
    """The path and the KV settings of a JSON or TOML settings file.

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
    return path, data
