"""KVConfig: spec strings, presets, per-layer overrides, settings dicts/files, errors, estimates."""

from __future__ import annotations

import json
import sys
import types

import pytest

from engine.kv.config import (
    DEFAULT_PRESET,
    PRESET_LABELS,
    PRESETS,
    SELECTABLE_BITS,
    SUPPORTED_BITS,
    KVConfig,
    KVConfigError,
    LayerOverride,
    LayerPrecision,
    LayerRun,
    estimate_bytes,
    parse_kv,
)

GIB = 2**30


def P(k: int, v: int) -> LayerPrecision:
    return LayerPrecision(k, v)


def errmsg(fn, *args) -> str:
    with pytest.raises(KVConfigError) as info:
        fn(*args)
    assert isinstance(info.value, ValueError)
    return str(info.value)


# ---- spec strings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, k, v",
    [
        ("k6v4", 6, 4),
        ("k8v8", 8, 8),
        ("k4v4", 4, 4),
        ("k8v16", 8, 16),
        ("f16", 16, 16),
        ("fp16", 16, 16),
        ("k16v16", 16, 16),
        ("k5v3", 5, 3),
        ("k2v2", 2, 2),
        ("K8V8", 8, 8),
        ("  k4v4  ", 4, 4),
    ],
)
def test_base_precisions(spec, k, v):
    c = KVConfig.parse(spec)
    assert (c.k_bits, c.v_bits) == (k, v)
    assert c.overrides == () and c.block_size == 32 and c.sinks == 4 and c.rotation is False


def test_every_bit_combination_parses():
    for k in SUPPORTED_BITS:
        for v in SUPPORTED_BITS:
            c = KVConfig.parse(f"k{k}v{v}")
            assert (c.k_bits, c.v_bits) == (k, v)
            assert str(c) == f"k{k}v{v}"


def test_presets():
    assert PRESETS == {"high-precision": "k8v8", "balanced": "k6v4", "memory-saver": "k4v4", "full": "k16v16"}
    assert DEFAULT_PRESET == "balanced"
    assert KVConfig.parse("high-precision") == KVConfig(8, 8)
    assert KVConfig.parse("balanced") == KVConfig(6, 4) == KVConfig()
    assert KVConfig.parse("memory-saver") == KVConfig(4, 4)
    assert KVConfig.parse("full") == KVConfig.parse("f16") == KVConfig(16, 16)
    assert KVConfig.parse("Memory_Saver") == KVConfig(4, 4)


def test_parse_kv():
    assert parse_kv(None) == KVConfig.parse("balanced") == KVConfig()
    assert parse_kv("memory-saver") == KVConfig(4, 4)
    assert parse_kv("k8v8,rot") == KVConfig(8, 8, rotation=True)
    c = KVConfig(4, 4)
    assert parse_kv(c) is c


def test_preset_with_overrides():
    c = KVConfig.parse("balanced,0-3:k8v8")
    assert (c.k_bits, c.v_bits) == (6, 4)
    assert c.overrides == (LayerOverride(0, 3, P(8, 8)),)
    assert str(c) == "k6v4,0-3:k8v8"
    assert KVConfig.parse("k4v4,0-1:high-precision").per_layer(3) == [P(8, 8), P(8, 8), P(4, 4)]


def test_overrides_parse():
    c = KVConfig.parse("k4v4,0-3:k8v8,28-29:k8v8")
    assert c.overrides == (LayerOverride(0, 3, P(8, 8)), LayerOverride(28, 29, P(8, 8)))
    assert KVConfig.parse("k4v4,5:k8v8").overrides == (LayerOverride(5, 5, P(8, 8)),)
    assert KVConfig.parse("k4v4,-1:f16").overrides == (LayerOverride(-1, -1, P(16, 16)),)
    assert KVConfig.parse("k4v4,-2..-1:k8v8").overrides == (LayerOverride(-2, -1, P(8, 8)),)
    assert KVConfig.parse("k4v4,2..-3:k8v8").overrides == (LayerOverride(2, -3, P(8, 8)),)
    assert KVConfig.parse("k4v4,3..5:k8v8").overrides == (LayerOverride(3, 5, P(8, 8)),)
    assert KVConfig.parse("k4v4,first4:k8v8").overrides == (LayerOverride(0, 3, P(8, 8)),)
    assert KVConfig.parse("k4v4,last2:k8v8").overrides == (LayerOverride(-2, -1, P(8, 8)),)
    assert KVConfig.parse("k4v4, 0 - 3 : K8V8").overrides == (LayerOverride(0, 3, P(8, 8)),)


def test_spec_without_base_uses_default_preset():
    c = KVConfig.parse("0-3:k8v8")
    assert (c.k_bits, c.v_bits) == (6, 4) and c.overrides == (LayerOverride(0, 3, P(8, 8)),)
    assert KVConfig.parse("rot") == KVConfig(rotation=True)
    assert KVConfig.parse("sinks=0") == KVConfig(sinks=0)


def test_options():
    c = KVConfig.parse("k4v4,rot,bs=16")
    assert c == KVConfig(4, 4, block_size=16, rotation=True)
    assert KVConfig.parse("k4v4,rot=1") == KVConfig(4, 4, rotation=True)
    assert KVConfig.parse("k4v4,rot=0") == KVConfig(4, 4)
    assert KVConfig.parse("k4v4,rotation=on") == KVConfig(4, 4, rotation=True)
    assert KVConfig.parse("k4v4,bs=64") == KVConfig(4, 4, block_size=64)
    assert KVConfig.parse("k4v4,block_size=64") == KVConfig(4, 4, block_size=64)
    assert KVConfig.parse("k4v4,sinks=0") == KVConfig(4, 4, sinks=0)
    assert KVConfig.parse("k4v4,0-3:k8v8,sinks=8,bs=16").overrides == (LayerOverride(0, 3, P(8, 8)),)


@pytest.mark.parametrize(
    "spec",
    [
        "k6v4",
        "k8v8",
        "k4v4",
        "k8v16",
        "f16",
        "k5v3",
        "k4v4,0-3:k8v8,28-29:k8v8",
        "k4v4,5:k8v8",
        "k4v4,-2..-1:k8v8",
        "k4v4,28-29:k8v8",
        "k4v4,first4:k8v8,last2:k8v8",
        "k4v4,2..-3:k16v8",
        "high-precision",
        "balanced",
        "memory-saver",
        "full",
        "balanced,0-3:k8v8",
        "k4v4,rot,bs=16",
        "k4v4,rot=0,sinks=0",
        "k2v3,bs=64,sinks=8,rot,-1:f16,0:k8v8",
        "0-3:k8v8",
    ],
)
def test_round_trip(spec):
    c = KVConfig.parse(spec)
    text = str(c)
    assert KVConfig.parse(text) == c
    assert str(KVConfig.parse(text)) == text


def test_canonical_form():
    assert str(KVConfig()) == "k6v4"
    assert str(KVConfig.parse("f16")) == "k16v16"
    assert str(KVConfig.parse("memory-saver,first4:k8v8,last2:k8v8")) == "k4v4,0-3:k8v8,-2..-1:k8v8"
    assert str(KVConfig.parse("rot=1,sinks=0,bs=64")) == "k6v4,bs=64,sinks=0,rot"
    assert str(KVConfig.parse("k4v4,7..7:k8v8,-3..-3:k8v8")) == "k4v4,7:k8v8,-3:k8v8"


def test_constructor_normalizes_overrides():
    c = KVConfig(4, 4, overrides=["0-3:k8v8", ("-1", "f16"), (5, P(8, 8)), ("last2", (8, 4))])
    assert c.overrides == (
        LayerOverride(0, 3, P(8, 8)),
        LayerOverride(-1, -1, P(16, 16)),
        LayerOverride(5, 5, P(8, 8)),
        LayerOverride(-2, -1, P(8, 4)),
    )
    assert hash(c) == hash(KVConfig.parse(str(c)))


# ---- resolving against a model ------------------------------------------------------------------


def test_per_layer_30_layers():
    c = KVConfig.parse("k4v4,0-3:k8v8,28-29:k8v8")
    layers = c.per_layer(30)
    assert len(layers) == 30
    assert layers[:4] == [P(8, 8)] * 4
    assert layers[4:28] == [P(4, 4)] * 24
    assert layers[28:] == [P(8, 8)] * 2
    assert c.layer(0, 30) == P(8, 8) and c.layer(27, 30) == P(4, 4) and c.layer(-1, 30) == P(8, 8)


def test_negatives_and_shorthands_18_and_30_layers():
    c = KVConfig.parse("k4v4,first4:k8v8,last2:k8v8")
    for n in (18, 30):
        layers = c.per_layer(n)
        high = [i for i, p in enumerate(layers) if p == P(8, 8)]
        assert high == [0, 1, 2, 3, n - 2, n - 1]
    assert KVConfig.parse("k4v4,-2..-1:k8v8").per_layer(18) == KVConfig.parse("k4v4,16-17:k8v8").per_layer(18)
    assert KVConfig.parse("k4v4,-2..-1:k8v8").per_layer(30) == KVConfig.parse("k4v4,28-29:k8v8").per_layer(30)
    mixed = KVConfig.parse("k2v2,2..-3:k4v4")
    assert [i for i, p in enumerate(mixed.per_layer(18)) if p == P(4, 4)] == list(range(2, 16))
    assert [i for i, p in enumerate(mixed.per_layer(30)) if p == P(4, 4)] == list(range(2, 28))


def test_later_overrides_win():
    c = KVConfig.parse("k4v4,0-9:k8v8,5:f16,3-6:k6v4")
    layers = c.per_layer(18)
    assert layers[:3] == [P(8, 8)] * 3
    assert layers[3:7] == [P(6, 4)] * 4
    assert layers[7:10] == [P(8, 8)] * 3
    assert layers[10:] == [P(4, 4)] * 8
    assert KVConfig.parse("k4v4,-1:k8v8,17:k2v2").layer(17, 18) == P(2, 2)
    assert KVConfig.parse("k4v4,17:k2v2,-1:k8v8").layer(17, 18) == P(8, 8)


def test_layer_matches_per_layer():
    c = KVConfig.parse("k5v3,first2:k8v8,-5..-3:k6v4,last1:f16")
    for n in (18, 30):
        table = c.per_layer(n)
        assert [c.layer(i, n) for i in range(n)] == table
        assert [c.layer(i - n, n) for i in range(n)] == table


def test_out_of_range_against_model():
    c = KVConfig.parse("k4v4,0-3:k8v8,28-29:k8v8")
    c.per_layer(30)
    msg = errmsg(c.per_layer, 18)
    assert "28-29" in msg and "18 layers" in msg
    msg = errmsg(c.layer, 0, 18)
    assert "28-29" in msg and "18 layers" in msg
    assert "18 layers" in errmsg(KVConfig.parse("k4v4,-19:k8v8").per_layer, 18)
    assert "18 layers" in errmsg(KVConfig.parse("k4v4,last20:k8v8").per_layer, 18)
    assert "18 layers" in errmsg(KVConfig.parse("k4v4,first20:k8v8").per_layer, 18)
    assert "selects no layers" in errmsg(KVConfig.parse("k4v4,10..-10:k8v8").per_layer, 18)
    assert "18 layers" in errmsg(KVConfig().layer, 18, 18)
    assert "18 layers" in errmsg(KVConfig().layer, -19, 18)
    errmsg(KVConfig().per_layer, 0)


def test_with_high_precision():
    c = KVConfig.parse("k4v4,0-3:k6v4,bs=16,sinks=0,rot")
    h = c.with_high_precision()
    assert h == KVConfig(8, 8, block_size=16, sinks=0, rotation=True)
    assert h.per_layer(18) == [P(8, 8)] * 18
    assert str(h) == "k8v8,bs=16,sinks=0,rot"


def test_preset_lookup_labels_and_reverse():
    assert [name for name, _ in KVConfig.presets()] == ["balanced", "memory-saver", "high-precision", "full"]
    assert set(PRESET_LABELS) == set(PRESETS)
    for name, label in KVConfig.presets():
        config = KVConfig.preset(name)
        assert config == KVConfig.parse(PRESETS[name]) and config.preset_name() == name
        assert name == "full" or str(config).upper() in label
    assert KVConfig.preset("Memory_Saver") == KVConfig(4, 4)
    assert "did you mean 'balanced'" in errmsg(KVConfig.preset, "balancd")
    assert KVConfig(5, 4).preset_name() is None
    assert KVConfig(6, 4, rotation=True).preset_name() is None        # options count
    assert KVConfig.parse("k6v4,0:k8v8").preset_name() is None


def test_selectable_bits_ascending():
    assert SELECTABLE_BITS == (2, 3, 4, 5, 6, 8, 16) and set(SELECTABLE_BITS) == set(SUPPORTED_BITS)


def test_with_bits_keeps_overrides_and_options():
    c = KVConfig.parse("k4v4,0-3:k8v8,bs=16,rot").with_bits(6, 2)
    assert c == KVConfig.parse("k6v2,0-3:k8v8,bs=16,rot")
    errmsg(KVConfig().with_bits, 7, 4)


def test_with_overrides_from_a_layer_mapping_groups_runs():
    over = {0: (8, 8), 1: (8, 8), 2: (8, 8), 5: "k4v2", 28: P(8, 8), 29: (8, 8), 7: (6, 4)}
    c = KVConfig.parse("k6v4,3:k2v2,rot").with_overrides(over)
    assert str(c) == "k6v4,0-2:k8v8,5:k4v2,28-29:k8v8,rot"    # layer 7 equals the base: left out
    assert c.overrides == (LayerOverride(0, 2, P(8, 8)), LayerOverride(5, 5, P(4, 2)),
                           LayerOverride(28, 29, P(8, 8)))
    assert KVConfig.parse(str(c)) == c
    layers = c.per_layer(30)
    assert layers[:3] == [P(8, 8)] * 3 and layers[5] == P(4, 2) and layers[7] == P(6, 4)
    assert KVConfig(4, 4).with_overrides({}) == KVConfig(4, 4)
    assert KVConfig(6, 4).with_overrides({1: (8, 8), 2: (8, 4), 3: (8, 4)}).overrides == (
        LayerOverride(1, 1, P(8, 8)), LayerOverride(2, 3, P(8, 4)))


def test_with_overrides_from_a_list_keeps_order():
    c = KVConfig(4, 4).with_overrides(["0-3:k8v8", ("-1", "f16"), LayerOverride(2, 2, P(6, 4))])
    assert str(c) == "k4v4,0-3:k8v8,-1:k16v16,2:k6v4"
    assert c.per_layer(6)[2] == P(6, 4)
    assert KVConfig.parse("k4v4,0:k8v8").with_overrides(()) == KVConfig(4, 4)


@pytest.mark.parametrize(
    "overrides, needles",
    [
        ({-1: (8, 8)}, ["-1", "non-negative", "-2..-1:k8v8"]),
        ({"3": (8, 8)}, ["'3'", "non-negative"]),
        ({True: (8, 8)}, ["True"]),
        ({2: (7, 8)}, ["layer 2", "7 bits", "did you mean 8"]),
        ({2: "k8v9"}, ["layer 2", "9 bits"]),
        ({2: 8}, ["layer 2", "8 is not a precision"]),
        ("0-3:k8v8", ["tuple of overrides"]),
    ],
)
def test_with_overrides_errors(overrides, needles):
    msg = errmsg(KVConfig().with_overrides, overrides)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_overrides_by_layer_is_the_inverse_of_with_overrides():
    c = KVConfig.parse("k6v4,first3:k8v8,1:k6v4,last2:f16,10-11:k4v4,11:k6v4")
    by_layer = c.overrides_by_layer(18)
    assert by_layer == {0: P(8, 8), 2: P(8, 8), 10: P(4, 4), 16: P(16, 16), 17: P(16, 16)}
    again = c.with_overrides(by_layer)
    assert again.per_layer(18) == c.per_layer(18)
    assert str(again) == "k6v4,0:k8v8,2:k8v8,10:k4v4,16-17:k16v16"
    assert again.overrides_by_layer() == by_layer               # non-negative: no layer count needed
    msg = errmsg(c.overrides_by_layer)
    assert "'-2..-1:k16v16' counts layers from the end" in msg and "number of layers" in msg
    assert "out of range" in errmsg(KVConfig.parse("k6v4,20:k8v8").overrides_by_layer, 18)


def test_layer_runs_cover_every_layer():
    c = KVConfig.parse("k6v4,0-2:k8v8,5:k4v2,-2..-1:k8v8")
    runs = c.layer_runs(30)
    assert [(r.selector, str(r.precision)) for r in runs] == [
        ("0-2", "k8v8"), ("3-4", "k6v4"), ("5", "k4v2"), ("6-27", "k6v4"), ("28-29", "k8v8")]
    assert [(r.first, r.last) for r in runs][:2] == [(0, 2), (3, 4)]
    assert KVConfig(4, 4).layer_runs(1) == [LayerRun(0, 0, P(4, 4))]
    assert KVConfig.parse("k4v4,0-1:k8v8,2-3:k8v8").layer_runs(4) == [LayerRun(0, 3, P(8, 8))]
    errmsg(c.layer_runs, 0)


def test_engine_kv_scheme_groups_layers_by_format():
    from types import SimpleNamespace

    from engine.engine import Engine
    from engine.kv.formats import get_format

    fake = SimpleNamespace(kv_config=KVConfig.parse("k6v4,0-1:k8v8,-1:k8v8"), model=SimpleNamespace(n_layers=5))
    k8, v8 = get_format(8, "k").name, get_format(8, "v").name
    k6, v4 = get_format(6, "k").name, get_format(4, "v").name
    assert Engine.kv_scheme(fake) == [
        ("0-1", f"K8 ({k8})", f"V8 ({v8})"), ("2-3", f"K6 ({k6})", f"V4 ({v4})"), ("4", f"K8 ({k8})", f"V8 ({v8})")]


# ---- spec errors ---------------------------------------------------------------------------------


def test_unsupported_bits_message():
    msg = errmsg(KVConfig.parse, "k7v4")
    assert "7 bits is not a supported K precision (16, 8, 6, 5, 4, 3, 2)" in msg
    assert "k7v4" in msg and "'k8v4'" in msg
    msg = errmsg(KVConfig.parse, "k4v1")
    assert "1 bits is not a supported V precision (16, 8, 6, 5, 4, 3, 2)" in msg and "'k4v2'" in msg
    msg = errmsg(KVConfig.parse, "k4v4,0-3:k8v32")
    assert "0-3:k8v32" in msg and "32 bits is not a supported V precision" in msg and "'k8v16'" in msg


def test_misspelled_preset():
    assert "did you mean 'balanced'?" in errmsg(KVConfig.parse, "balancd")
    assert "'balancd'" in errmsg(KVConfig.parse, "balancd")
    assert "did you mean 'memory-saver'?" in errmsg(KVConfig.parse, "memory-saving")
    assert "did you mean 'high-precision'?" in errmsg(KVConfig.parse, "high-precison,0-3:k8v8")
    assert "did you mean 'full'?" in errmsg(parse_kv, "ful")
    msg = errmsg(KVConfig.parse, "banana")
    assert "'banana'" in msg and "balanced" in msg and "k<bits>v<bits>" in msg


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("k4v4,-2--1:k8v8", ["-2--1", "'-2..-1'"]),
        ("k4v4,-2-1:k8v8", ["-2-1", "'-2..-1'", "'-2..1'"]),
        ("k4v4,frist4:k8v8", ["frist4", "'first4'"]),
        ("k4v4,lats2:k8v8", ["lats2", "'last2'"]),
        ("k4v4,first0:k8v8", ["first0", "selects no layers"]),
        ("k4v4,5-3:k8v8", ["5-3", "reversed", "'3-5'"]),
        ("k4v4,-1..-3:k8v8", ["-1..-3", "reversed", "'-3..-1'"]),
        ("k4v4,abc:k8v8", ["'abc' is not a layer selector", "-2..-1"]),
        ("k4v4,0-3:", ["0-3:", "no precision"]),
        ("k4v4,:k8v8", [":k8v8", "no layer selector"]),
        ("k4v4,0-3:balancd", ["0-3:balancd", "'balanced'"]),
        ("k4v4,bz=64", ["bz=64", "'bs'"]),
        ("k4v4,snks=0", ["snks=0", "'sinks'"]),
        ("k4v4,bs", ["'bs'", "needs a value", "bs=64"]),
        ("k4v4,bs=0", ["bs=0", "minimum is 1"]),
        ("k4v4,bs=abc", ["bs=abc", "not a whole number"]),
        ("k4v4,sinks=-1", ["sinks=-1", "minimum is 0"]),
        ("k4v4,rot=maybe", ["rot=maybe", "on/off"]),
        ("k4v4,bs=16,bs=32", ["twice", "bs=16", "bs=32"]),
        ("k4v4,k8v8", ["two base precisions", "'k4v4'", "'k8v8'"]),
        ("0-3:k8v8,k4v4", ["'k4v4'", "must be the first item"]),
        ("k4v4,", ["empty item"]),
        ("", ["empty KV cache spec"]),
        ("kv4", ["'kv4'", "k<bits>v<bits>"]),
    ],
)
def test_spec_errors(spec, needles):
    msg = errmsg(KVConfig.parse, spec)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_non_string_spec():
    assert "string" in errmsg(KVConfig.parse, 44)


def test_constructor_validates():
    assert "7 bits" in errmsg(KVConfig, 7, 4)
    assert "V precision" in errmsg(KVConfig, 4, 9)
    errmsg(KVConfig, True, 4)
    errmsg(lambda: KVConfig(block_size=0))
    errmsg(lambda: KVConfig(sinks=-1))
    errmsg(lambda: KVConfig(rotation="yes"))
    errmsg(lambda: KVConfig(overrides="0-3:k8v8"))
    errmsg(lambda: KVConfig(overrides=5))
    errmsg(lambda: KVConfig(overrides=(("0-3", 5),)))
    errmsg(LayerPrecision, 8, 7)


# ---- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, "k6v4"),
        ({"k_bits": 8, "v_bits": 4}, "k8v4"),
        ({"k_bits": "8", "v_bits": "16"}, "k8v16"),
        ({"k_bits": 8}, "k8v4"),
        ({"v_bits": 8}, "k6v8"),
        ({"preset": "memory-saver"}, "k4v4"),
        ({"preset": "High-Precision"}, "k8v8"),
        ({"spec": "k4v4,rot,bs=16"}, "k4v4,bs=16,rot"),
        ({"spec": "balanced,0-3:k8v8"}, "k6v4,0-3:k8v8"),
        ({"block_size": 64, "sinks": 0, "rotation": True}, "k6v4,bs=64,sinks=0,rot"),
        ({"rotation": "on"}, "k6v4,rot"),
        ({"rotation": 0}, "k6v4"),
        ({"k_bits": 4, "v_bits": 4, "layers": {"0-3": "k8v8", "28-29": "k8v8"}}, "k4v4,0-3:k8v8,28-29:k8v8"),
        (
            {"k_bits": 4, "v_bits": 4, "layers": {"-2..-1": "f16", "first2": "high-precision"}},
            "k4v4,-2..-1:k16v16,0-1:k8v8",
        ),
        ({"k_bits": 4, "v_bits": 4, "layers": {5: "k8v8"}}, "k4v4,5:k8v8"),
        ({"k_bits": 4, "v_bits": 4, "layers": {"0-3": {"k_bits": 8}}}, "k4v4,0-3:k8v4"),
        (
            {"k_bits": 4, "v_bits": 4, "layers": {"-1": {"cache_type_k": "q8_0", "cache_type_v": "f16"}}},
            "k4v4,-1:k8v16",
        ),
        ({"k_bits": 4, "v_bits": 4, "layers": ["0-3:k8v8", "last2:k8v8"]}, "k4v4,0-3:k8v8,-2..-1:k8v8"),
        ({"k_bits": 4, "v_bits": 4, "layers": [{"layers": "0-3", "k_bits": 8, "v_bits": 8}]}, "k4v4,0-3:k8v8"),
        ({"k_bits": 4, "v_bits": 4, "layers": [["0-3", "k8v8"]]}, "k4v4,0-3:k8v8"),
        ({"k_bits": 4, "v_bits": 4, "layers": "0-3:k8v8,-1:f16"}, "k4v4,0-3:k8v8,-1:k16v16"),
        ({"spec": "k4v4,0-3:k8v8", "layers": {"2": "f16"}}, "k4v4,0-3:k8v8,2:k16v16"),
        ({"spec": "k4v4", "k_bits": 4}, "k4v4"),
        ({"preset": "balanced", "k_bits": 6, "cache_type_v": "q4_0"}, "k6v4"),
        ({"spec": "k4v4,bs=16", "block_size": 16}, "k4v4,bs=16"),
        ({"spec": "rot", "k_bits": 8}, "k8v4,rot"),
        ({"K_BITS": 8, "v-bits": 8}, "k8v8"),
        ({"k_bits": 8, "cache_type_k": "q8_0", "type_k": "Q8_0"}, "k8v4"),
    ],
)
def test_from_settings(settings, expected):
    c = KVConfig.from_settings(settings)
    assert str(c) == expected
    assert c == KVConfig.parse(expected)


@pytest.mark.parametrize(
    "name, bits",
    [
        ("f16", 16),
        ("bf16", 16),
        ("q8_0", 8),
        ("q6_0", 6),
        ("q6_K", 6),
        ("q5_0", 5),
        ("q5_1", 5),
        ("q4_0", 4),
        ("q4_1", 4),
        ("iq4_nl", 4),
        ("IQ4_NL", 4),
        ("q3_K", 3),
        ("q2_K", 2),
    ],
)
def test_llama_cpp_aliases(name, bits):
    for k_key, v_key in (("cache_type_k", "cache_type_v"), ("type_k", "type_v"), ("cache-type-k", "cache-type-v")):
        c = KVConfig.from_settings({k_key: name, v_key: name})
        assert (c.k_bits, c.v_bits) == (bits, bits)


def test_llama_cpp_mixed():
    assert KVConfig.from_settings({"cache_type_k": "q8_0", "cache_type_v": "q4_0"}) == KVConfig(8, 4)
    assert KVConfig.from_settings({"type_k": "q5_1", "type_v": "iq4_nl"}) == KVConfig(5, 4)
    assert KVConfig.from_settings({"cache_type_k": "f16"}) == KVConfig(16, 4)
    assert KVConfig.from_settings({"cache_type_k": 8}) == KVConfig(8, 4)


def test_f32_is_rejected():
    msg = errmsg(KVConfig.from_settings, {"cache_type_k": "f32"})
    assert "cache_type_k" in msg and "f32" in msg and "'f16'" in msg
    msg = errmsg(KVConfig.from_settings, {"type_v": "F32"})
    assert "type_v" in msg and "'f16'" in msg


@pytest.mark.parametrize(
    "key, suggestion",
    [
        ("cache_typ_v", "cache_type_v"),
        ("cache_type_kk", "cache_type_k"),
        ("k_bit", "k_bits"),
        ("v_bitz", "v_bits"),
        ("kbits", "k_bits"),
        ("blocksize", "block_size"),
        ("sink", "sinks"),
        ("rotaton", "rotation"),
        ("presets", "preset"),
        ("specs", "spec"),
        ("layer", "layers"),
        ("typ_k", "type_k"),
    ],
)
def test_misspelled_setting(key, suggestion):
    msg = errmsg(KVConfig.from_settings, {key: 4})
    assert f"unknown setting '{key}'" in msg
    assert f"did you mean '{suggestion}'?" in msg


def test_misspelled_setting_among_valid_ones():
    msg = errmsg(KVConfig.from_settings, {"cache_type_k": "q4_0", "cache_typ_v": "q4_0"})
    assert msg.startswith("unknown setting 'cache_typ_v' — did you mean 'cache_type_v'?")
    msg = errmsg(KVConfig.from_settings, {"k_bit": 4, "v_bitz": 4})
    assert "'k_bit' — did you mean 'k_bits'?" in msg and "'v_bitz' — did you mean 'v_bits'?" in msg


def test_unknown_setting_without_close_match_lists_valid_keys():
    msg = errmsg(KVConfig.from_settings, {"colour": "blue"})
    assert "unknown setting 'colour'" in msg and "did you mean" not in msg
    assert "k_bits" in msg and "cache_type_v" in msg


@pytest.mark.parametrize(
    "settings, needles",
    [
        ({"cache_type_v": "q4_2"}, ["cache_type_v", "'q4_2'", "did you mean 'q4_0'?"]),
        ({"cache_type_k": "q7_0"}, ["cache_type_k", "'q7_0'", "did you mean 'q8_0'?"]),
        ({"type_k": "iq4_xs"}, ["type_k", "'iq4_xs'", "did you mean 'iq4_nl'?"]),
        ({"cache_type_k": "q8"}, ["cache_type_k", "'q8'", "did you mean 'q8_0'?"]),
        ({"cache_type_k": 7}, ["cache_type_k", "7 bits", "did you mean 8?"]),
        ({"cache_type_k": 1.5}, ["cache_type_k", "1.5"]),
        ({"k_bits": 7}, ["k_bits", "7 bits is not a supported K precision (16, 8, 6, 5, 4, 3, 2)", "did you mean 8?"]),
        ({"v_bits": 1}, ["v_bits", "1 bits is not a supported V precision", "did you mean 2?"]),
        ({"v_bits": 12}, ["v_bits", "12 bits", "did you mean 16?"]),
        ({"k_bits": "q8_0"}, ["k_bits", "cache_type_k = 'q8_0'"]),
        ({"k_bits": "eight"}, ["k_bits", "'eight'"]),
        ({"k_bits": True}, ["k_bits", "True"]),
        ({"k_bits": 4.0}, ["k_bits", "4.0"]),
        ({"preset": "balancd"}, ["preset", "'balancd'", "did you mean 'balanced'?"]),
        ({"preset": "k4v4"}, ["preset", "'k4v4'", "presets: high-precision"]),
        ({"preset": 3}, ["preset", "3"]),
        ({"spec": "k7v4"}, ["spec", "7 bits is not a supported K precision"]),
        ({"spec": "balancd"}, ["spec", "did you mean 'balanced'?"]),
        ({"spec": 5}, ["spec", "string"]),
        ({"block_size": 0}, ["block_size", "minimum is 1"]),
        ({"block_size": "big"}, ["block_size", "'big'"]),
        ({"sinks": -2}, ["sinks", "minimum is 0"]),
        ({"rotation": "maybe"}, ["rotation", "'maybe'"]),
        ({"rotation": 2}, ["rotation", "2"]),
        ({"layers": {"0-3": "k7v8"}}, ["layers['0-3']", "7 bits", "'k8v8'"]),
        ({"layers": {"0-3": "balancd"}}, ["layers['0-3']", "'balanced'"]),
        ({"layers": {"-2--1": "k8v8"}}, ["layers", "-2--1", "'-2..-1'"]),
        ({"layers": {"0-3": {"k_bit": 8}}}, ["layers['0-3']", "unknown setting 'k_bit'", "did you mean 'k_bits'?"]),
        ({"layers": {"0-3": {"cache_type_v": "q4_2"}}}, ["layers['0-3']", "cache_type_v", "did you mean 'q4_0'?"]),
        (
            {"layers": {"0-3": {"k_bits": 8, "cache_type_k": "q4_0"}}},
            ["layers['0-3']", "conflicting K", "k_bits=8", "'q4_0'"],
        ),
        ({"layers": {"0-3": {}}}, ["layers['0-3']", "empty"]),
        ({"layers": {"0-3": 8}}, ["layers['0-3']", "8"]),
        (
            {"layers": [{"layer": "0-3", "k_bits": 8}]},
            ["layers[0]", "unknown setting 'layer'", "did you mean 'layers'?"],
        ),
        ({"layers": [{"k_bits": 8}]}, ["layers[0]", "missing 'layers'"]),
        ({"layers": ["0-3:k8v8", 7]}, ["layers[1]", "7"]),
        ({"layers": ["0-3=k8v8"]}, ["layers[0]", "0-3=k8v8"]),
        ({"layers": 5}, ["layers", "5"]),
        ({"layers": "0-3:k8v8,frist2:k8v8"}, ["layers:", "frist2", "'first2'"]),
    ],
)
def test_bad_setting_values(settings, needles):
    msg = errmsg(KVConfig.from_settings, settings)
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize(
    "settings, needles",
    [
        ({"k_bits": 8, "cache_type_k": "q4_0"}, ["conflicting K", "k_bits=8", "cache_type_k='q4_0' (4 bits)"]),
        ({"v_bits": 4, "type_v": "q8_0"}, ["conflicting V", "v_bits=4", "type_v='q8_0' (8 bits)"]),
        ({"cache_type_k": "q8_0", "type_k": "q4_1"}, ["conflicting K", "cache_type_k='q8_0'", "type_k='q4_1'"]),
        ({"preset": "balanced", "k_bits": 8}, ["conflicting K", "k_bits=8", "preset='balanced' (6 bits)"]),
        (
            {"preset": "memory-saver", "cache_type_v": "f16"},
            ["conflicting V", "preset='memory-saver'", "cache_type_v='f16'"],
        ),
        ({"spec": "k4v4", "k_bits": 8}, ["conflicting K", "spec 'k4v4'", "k_bits=8"]),
        ({"spec": "k4v4", "preset": "balanced"}, ["conflicting K", "spec 'k4v4'", "preset='balanced'"]),
        ({"spec": "k4v4,bs=16", "block_size": 64}, ["conflicting", "block_size=64", "spec 'k4v4,bs=16'"]),
        ({"spec": "sinks=0", "sinks": 4}, ["conflicting", "sinks=4", "spec 'sinks=0'"]),
        ({"spec": "rot", "rotation": False}, ["conflicting", "rotation=False", "spec 'rot'"]),
        ({"k_bits": 8, "K_BITS": 4}, ["k_bits", "twice"]),
    ],
)
def test_conflicting_settings(settings, needles):
    msg = errmsg(KVConfig.from_settings, settings)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_settings_must_be_a_mapping():
    assert "mapping" in errmsg(KVConfig.from_settings, ["k4v4"])
    assert "not a string" in errmsg(KVConfig.from_settings, {4: "k4v4"})


# ---- files --------------------------------------------------------------------------------------


def test_json_file(tmp_path):
    path = tmp_path / "kv.json"
    settings = {"k_bits": 4, "v_bits": 4, "layers": {"0-3": "k8v8", "-2..-1": "k8v8"}, "rotation": True}
    path.write_text(json.dumps(settings))
    c = KVConfig.from_file(path)
    assert str(c) == "k4v4,0-3:k8v8,-2..-1:k8v8,rot"
    assert KVConfig.from_file(str(path)) == c


def test_json_llama_cpp_file(tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"cache_type_k": "q8_0", "cache_type_v": "q4_0"}))
    assert KVConfig.from_file(path) == KVConfig(8, 4)


def test_toml_file(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text(
        'k_bits = 4\nv_bits = 4\nblock_size = 64\nsinks = 0\nrotation = true\n\n'
        '[layers]\n0-3 = "k8v8"\n"-2..-1" = "f16"\nlast1 = { k_bits = 8 }\n'
    )
    c = KVConfig.from_file(path)
    assert str(c) == "k4v4,0-3:k8v8,-2..-1:k16v16,-1:k8v4,bs=64,sinks=0,rot"
    assert c.per_layer(18)[-1] == P(8, 4) and c.per_layer(18)[-2] == P(16, 16)


def test_toml_file_with_layer_list_and_preset(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text(
        'preset = "memory-saver"\n\n[[layers]]\nlayers = "first4"\ncache_type_k = "q8_0"\ncache_type_v = "q8_0"\n'
    )
    assert str(KVConfig.from_file(path)) == "k4v4,0-3:k8v8"


def test_kv_section_of_an_app_settings_file(tmp_path):
    toml = tmp_path / "settings.toml"
    toml.write_text('theme = "dark"\n\n[kv]\nspec = "k4v4,rot"\nblock_size = 16\n\n[kv.layers]\n"0-3" = "k8v8"\n')
    assert str(KVConfig.from_file(toml)) == "k4v4,0-3:k8v8,bs=16,rot"
    js = tmp_path / "settings.json"
    js.write_text(json.dumps({"window": {"width": 800}, "kv": "memory-saver,last2:k8v8"}))
    assert str(KVConfig.from_file(js)) == "k4v4,-2..-1:k8v8"
    stray = tmp_path / "stray.toml"
    stray.write_text('k_bits = 8\n\n[kv]\nv_bits = 4\n')
    msg = errmsg(KVConfig.from_file, stray)
    assert "'k_bits'" in msg and "inside the 'kv' table" in msg


def test_file_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('cache_type_k = "q4_0"\ncache_typ_v = "q4_0"\n')
    msg = errmsg(KVConfig.from_file, path)
    assert str(path) in msg and "unknown setting 'cache_typ_v' — did you mean 'cache_type_v'?" in msg

    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"kv": {"k_bits": 8, "cache_type_k": "q4_0"}}))
    msg = errmsg(KVConfig.from_file, path)
    assert str(path) in msg and "conflicting K" in msg

    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"k_bits": 4,}')
    assert "invalid JSON" in errmsg(KVConfig.from_file, bad_json)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("k_bits = = 4\n")
    assert "invalid TOML" in errmsg(KVConfig.from_file, bad_toml)
    top = tmp_path / "list.json"
    top.write_text("[1, 2]")
    assert "top level" in errmsg(KVConfig.from_file, top)
    assert "no such settings file" in errmsg(KVConfig.from_file, tmp_path / "missing.toml")


def test_file_format_detected_without_suffix(tmp_path):
    js = tmp_path / "kvsettings"
    js.write_text('{"preset": "high-precision"}')
    assert KVConfig.from_file(js) == KVConfig(8, 8)
    toml = tmp_path / "kvsettings.conf"
    toml.write_text('preset = "full"\n')
    assert KVConfig.from_file(toml) == KVConfig(16, 16)
    junk = tmp_path / "junk.cfg"
    junk.write_text("this is = = not anything\n")
    assert "neither valid JSON nor valid TOML" in errmsg(KVConfig.from_file, junk)


# ---- size estimate --------------------------------------------------------------------------------
#
# Storage model (engine.kv.paged), per layer and per role (K, V):
#     held full blocks × row bytes  +  float32 tail buffer (block_size tokens)
#                                   +  float32 sink buffer (sinks tokens)
# A sliding-window layer (window W) releases blocks that end before position n_tokens - W + 1.


class _FakeFormat:
    """bits per value exactly, plus one 2-byte scale per (head, block); 16 bits = float16 rows."""

    def __init__(self, bits: int, role: str):
        self.bits, self.role = bits, role

    def bytes_per_block(self, n_kv_heads: int, block_tokens: int, head_dim: int) -> int:
        if self.bits == 16:
            return n_kv_heads * block_tokens * head_dim * 2
        return n_kv_heads * block_tokens * head_dim * self.bits // 8 + 2 * n_kv_heads


@pytest.fixture
def fake_formats(monkeypatch):
    calls = []

    def get_format(bits, role):
        assert role in ("k", "v") and bits in SUPPORTED_BITS
        calls.append((bits, role))
        return _FakeFormat(bits, role)

    module = types.ModuleType("engine.kv.formats")
    module.get_format = get_format
    monkeypatch.setitem(sys.modules, "engine.kv.formats", module)
    return calls


def _buffers(config: KVConfig, n_kv_heads: int, dim: int) -> int:
    """One role's float32 tail + sink buffers of one layer."""
    return (config.block_size + config.sinks) * n_kv_heads * dim * 4


def test_estimate_with_fake_format(fake_formats):
    c = KVConfig.parse("k8v4,bs=32,sinks=4")
    heads, dim = 2, 64
    n_tokens = 100  # 3 full blocks + a 4-token tail (the tail lives in the preallocated buffer)
    r = estimate_bytes(c, 3, heads, dim, n_tokens)
    full_blocks = 3
    buffers = (32 + 4) * heads * dim * 4
    assert buffers == _buffers(c, heads, dim)
    k_layer = full_blocks * (heads * 32 * dim * 8 // 8 + 2 * heads) + buffers
    v_layer = full_blocks * (heads * 32 * dim * 4 // 8 + 2 * heads) + buffers
    assert r["k"] == 3 * k_layer and r["v"] == 3 * v_layer
    assert r["total"] == r["k"] + r["v"]
    assert [p["total"] for p in r["per_layer"]] == [k_layer + v_layer] * 3
    first = {"layer": 0, "k_bits": 8, "v_bits": 4, "k": k_layer, "v": v_layer, "total": k_layer + v_layer,
             "k_blocks": k_layer - buffers, "v_blocks": v_layer - buffers}
    assert r["per_layer"][0] == first
    assert r["bits_per_value"] == pytest.approx(r["total"] * 8 / (3 * n_tokens * heads * dim * 2))
    assert set(fake_formats) == {(8, "k"), (4, "v")}


def test_estimate_fp16_layers_and_overrides(fake_formats):
    c = KVConfig.parse("k4v4,-1:f16,0:k8v8,sinks=0")
    r = estimate_bytes(c, 3, 1, 64, 64)  # 2 full blocks of 32 tokens per layer
    tail = 32 * 64 * 4  # float32 tail buffer, no sinks
    assert [(p["k_bits"], p["v_bits"]) for p in r["per_layer"]] == [(8, 8), (4, 4), (16, 16)]
    assert r["per_layer"][2]["k"] == r["per_layer"][2]["v"] == 64 * 64 * 2 + tail  # float16 rows
    assert r["per_layer"][0]["k"] == r["per_layer"][0]["v"] == 2 * (32 * 64 + 2) + tail
    assert r["per_layer"][1]["k"] == r["per_layer"][1]["v"] == 2 * (32 * 64 // 2 + 2) + tail
    assert r["per_layer"][0]["total"] > r["per_layer"][1]["total"]
    assert r["per_layer"][2]["total"] > r["per_layer"][0]["total"]
    # 16-bit layers use the float16 format's rows too
    assert (16, "k") in fake_formats and (16, "v") in fake_formats
    # later override wins: 0:k8v8 then 0-2:k2v2 leaves every layer at 2 bits
    r2 = estimate_bytes(KVConfig.parse("k4v4,0:k8v8,0-2:k2v2,sinks=0"), 3, 1, 64, 64)
    assert [p["k"] for p in r2["per_layer"]] == [2 * (32 * 64 // 4 + 2) + tail] * 3


def test_estimate_buffers_and_partial_blocks(fake_formats):
    base = dict(n_layers=1, n_kv_heads=1, head_dim=8)
    c = KVConfig(4, 4)  # bs=32, sinks=4
    quant_block = 32 * 8 * 4 // 8 + 2
    buffers = (32 + 4) * 8 * 4
    cases = [  # the tail never costs more than its preallocated buffer: only full blocks add bytes
        (0, buffers),
        (3, buffers),
        (31, buffers),
        (32, quant_block + buffers),
        (33, quant_block + buffers),
        (63, quant_block + buffers),
        (64, 2 * quant_block + buffers),
        (1000, 31 * quant_block + buffers),
    ]
    for n_tokens, expected in cases:
        r = estimate_bytes(c, n_tokens=n_tokens, **base)
        assert r["k"] == r["v"] == expected, n_tokens
    assert estimate_bytes(KVConfig(4, 4, sinks=0), n_tokens=32, **base)["k"] == quant_block + 32 * 8 * 4
    # sinks are an extra float32 copy: they do not replace block storage
    many_sinks = estimate_bytes(KVConfig(4, 4, sinks=100), n_tokens=70, **base)
    assert many_sinks["k"] == 2 * quant_block + (32 + 100) * 8 * 4
    small_blocks = estimate_bytes(KVConfig(4, 4, block_size=8, sinks=0), n_tokens=70, **base)
    assert small_blocks["k"] == 8 * (8 * 8 * 4 // 8 + 2) + 8 * 8 * 4
    assert estimate_bytes(c, n_tokens=0, **base)["bits_per_value"] == 0.0
    assert estimate_bytes(c, n_tokens=0, **base)["total"] == 2 * buffers


def _released(n_tokens: int, window: int, bs: int) -> int:
    """Full blocks a window layer has released after n_tokens, replayed block by block."""
    first_visible = n_tokens - window + 1  # the next query's oldest visible key
    return sum(1 for b in range(n_tokens // bs) if (b + 1) * bs <= first_visible)


def test_estimate_windows(fake_formats):
    c = KVConfig.parse("k4v4,bs=8,sinks=2")
    heads, dim = 2, 16
    row = heads * 8 * dim * 4 // 8 + 2 * heads
    buffers = (8 + 2) * heads * dim * 4
    windows = [40, 40, None, 8]
    for n_tokens in (0, 7, 8, 39, 40, 47, 48, 49, 55, 56, 100, 1000):
        r = estimate_bytes(c, 4, heads, dim, n_tokens, windows=windows)
        n_full = n_tokens // 8
        for i, w in enumerate(windows):
            held = n_full - (0 if w is None else _released(n_tokens, w, 8))
            assert r["per_layer"][i]["k"] == r["per_layer"][i]["v"] == held * row + buffers, (n_tokens, i)
        # the global layer keeps every block; no windows = every layer global
        plain = estimate_bytes(c, 4, heads, dim, n_tokens)
        assert plain["per_layer"][2] == r["per_layer"][2]
        assert r["total"] <= plain["total"]
    # a window-40 layer after 100 tokens keeps blocks from position 56 on (61 = 100 - 40 + 1 is
    # the next query's oldest key; block [56, 64) holds it): 12 full blocks, 7 released
    r = estimate_bytes(c, 4, heads, dim, 100, windows=windows)
    assert r["per_layer"][0]["k"] == 5 * row + buffers
    # window 8 keeps at most one full block (the one holding the oldest visible key)
    assert r["per_layer"][3]["k"] in (buffers, row + buffers)
    # a window at least as long as the sequence releases nothing
    wide = estimate_bytes(c, 4, heads, dim, 100, windows=[1000] * 4)
    assert wide["total"] == estimate_bytes(c, 4, heads, dim, 100)["total"]
    # window 1 (each query sees itself only): every full block is released
    assert estimate_bytes(c, 1, heads, dim, 100, windows=[1])["k"] == buffers


def test_estimate_value_dim(fake_formats):
    heads, kd, vd = 4, 192, 128
    r = estimate_bytes(KVConfig(16, 16), 2, heads, kd, 70, value_dim=vd)  # 2 full blocks + tail
    assert r["k"] == 2 * (2 * heads * 32 * kd * 2 + (32 + 4) * heads * kd * 4)
    assert r["v"] == 2 * (2 * heads * 32 * vd * 2 + (32 + 4) * heads * vd * 4)
    assert r["bits_per_value"] == pytest.approx(r["total"] * 8 / (2 * 70 * heads * (kd + vd)))
    # without the buffers, a float16 block is exactly 16 bits per value
    blocks_only = r["total"] - 2 * (32 + 4) * heads * (kd + vd) * 4
    assert blocks_only * 8 / (2 * 64 * heads * (kd + vd)) == 16.0
    q = estimate_bytes(KVConfig(8, 4, sinks=0), 1, heads, kd, 64, value_dim=vd)
    assert q["k"] == 2 * (heads * 32 * kd + 2 * heads) + 32 * heads * kd * 4
    assert q["v"] == 2 * (heads * 32 * vd // 2 + 2 * heads) + 32 * heads * vd * 4
    same = estimate_bytes(KVConfig(8, 4, sinks=0), 1, heads, kd, 64)
    assert same["k"] == q["k"] and same["v"] > q["v"]


def test_estimate_accepts_spec_and_checks_layers(fake_formats):
    assert estimate_bytes("k4v4", 2, 1, 8, 40)["total"] == estimate_bytes(KVConfig(4, 4), 2, 1, 8, 40)["total"]
    assert "18 layers" in errmsg(estimate_bytes, KVConfig.parse("k4v4,28-29:k8v8"), 18, 8, 128, 100)
    errmsg(estimate_bytes, KVConfig(), 2, 1, 8, -1)


def test_estimate_7b_geometry_with_real_formats(capsys):
    from engine.kv.formats import get_format

    n_layers, heads, dim, n_tokens = 32, 32, 128, 32_768
    geometry = dict(n_layers=n_layers, n_kv_heads=heads, head_dim=dim, n_tokens=n_tokens)
    f16 = estimate_bytes(KVConfig.parse("f16"), **geometry)
    buffers = n_layers * (32 + 4) * heads * dim * 4  # per role: float32 tail + sinks, all layers
    assert buffers == 18 * 2**20
    assert f16["k"] == f16["v"] == 8 * GIB + buffers
    assert f16["total"] == 16 * GIB + 2 * buffers
    assert f16["total"] == pytest.approx(16 * GIB, rel=0.003)  # the buffers are small
    assert 16.0 < f16["bits_per_value"] < 16.05

    results = {}
    for spec in ("k8v8", "k6v4", "k4v4"):
        c = KVConfig.parse(spec)
        r = estimate_bytes(c, **geometry)
        results[spec] = r
        blocks = n_tokens // c.block_size
        for role, bits in (("k", c.k_bits), ("v", c.v_bits)):
            row = get_format(bits, role).bytes_per_block(heads, c.block_size, dim)
            assert r[role] == n_layers * (blocks * row + _buffers(c, heads, dim))
        assert r["bits_per_value"] == pytest.approx(r["total"] * 8 / (n_layers * n_tokens * heads * 2 * dim))
    assert f16["total"] > results["k8v8"]["total"] > results["k6v4"]["total"] > results["k4v4"]["total"]
    assert results["k6v4"]["total"] <= 5.6 * GIB
    assert results["k8v8"]["bits_per_value"] < 9
    assert results["k4v4"]["bits_per_value"] < 5

    # rotation costs nothing; the sliding window caps a layer's blocks
    assert estimate_bytes(KVConfig.parse("k6v4,rot"), **geometry)["total"] == results["k6v4"]["total"]
    windowed = estimate_bytes(KVConfig.parse("f16"), **geometry, windows=[4096] * n_layers)
    assert windowed["total"] == pytest.approx(f16["total"] / 8, rel=0.02)

    with capsys.disabled():
        print()
        for spec, r in [("f16", f16), *results.items()]:
            print(f"  7B @32k {spec:>5}: {r['total'] / GIB:7.3f} GiB  {r['bits_per_value']:.3f} bits/value")


def test_formats_bits_per_value_at_the_default_block():
    from engine.kv.formats import get_format

    for bits in SUPPORTED_BITS[1:]:
        for role in ("k", "v"):
            assert bits < get_format(bits, role).bits_per_value(32, 128) < bits + 1.5


def test_per_layer_specs_one_quantized_layer_each():
    """eval-kv --per-layer's specs: layer i at `bits`, every other layer 16-bit, block size kept."""
    from engine.evaluate import per_layer_specs

    specs = per_layer_specs(KVConfig.parse("k4v4,bs=16"), 3, bits=4)
    assert len(specs) == 3
    for i, spec in enumerate(specs):
        config = KVConfig.parse(spec)
        assert config.block_size == 16
        assert [(p.k_bits, p.v_bits) for p in config.per_layer(3)] == [
            (4, 4) if j == i else (16, 16) for j in range(3)]
