"""The KV panel's setting as data, without widgets: base precision and options, the preset it
came from, per-layer precision, high-precision mode and the setting it replaced; and the texts
the panel shows of a setting (the estimate at full context, the cost of switching to it).

A layer keeps its override while it equals the base, so moving the sliders reveals it again;
:meth:`KVSetting.config` leaves out the layers the model does not have.
"""

from __future__ import annotations

from engine.kv.config import DEFAULT_PRESET, SELECTABLE_BITS, KVConfig, KVConfigError, estimate_bytes

from .chart import format_bytes

CUSTOM = "custom"   # the preset box's entry for anything that is not a preset
AUTO = "auto"       # the preset box's entry for widths chosen from the model's sensitivity profile


def _within(overrides: dict[int, tuple[int, int]], n_layers: int | None) -> dict[int, tuple[int, int]]:
    """The overrides of layers the model has (all of them while no model is known)."""
    return {i: kv for i, kv in overrides.items() if n_layers is None or i < n_layers}


def layer_spec(k: int, v: int, overrides: dict[int, tuple[int, int]], n_layers: int | None) -> str:
    """The spec string for base ``kKvV`` and per-layer ``overrides`` (layer -> (k, v)): runs of
    consecutive layers with the same precision become one ``a-b:kXvY`` item."""
    return str(KVConfig(k, v).with_overrides(_within(overrides, n_layers)))


class KVSetting:
    """What the KV panel describes. ``base`` has no overrides; ``overrides`` maps a layer to its
    (k, v) bits; ``before_hp`` is the :meth:`core` that high-precision mode replaced."""

    def __init__(self) -> None:
        self.base = KVConfig.preset(DEFAULT_PRESET)
        self.preset = DEFAULT_PRESET
        self.overrides: dict[int, tuple[int, int]] = {}
        self.hp = False
        self.before_hp: dict | None = None
        self.n_layers: int | None = None

    def config(self) -> KVConfig:
        if self.hp:
            return self.base.with_high_precision()
        return self.base.with_overrides(_within(self.overrides, self.n_layers))

    def preset_shown(self) -> str:
        """The preset box's entry: in high-precision mode the preset K8V8 is, if any."""
        return (self.config().preset_name() or CUSTOM) if self.hp else self.preset

    def set_layers(self, n_layers: int | None) -> None:
        """The loaded model's layer count (None: no model); overrides past its last layer go."""
        self.n_layers = n_layers
        if n_layers:
            self.overrides = {i: kv for i, kv in self.overrides.items() if i < n_layers}

    # -- saved form ---------------------------------------------------------------------------
    def core(self) -> dict:
        b = self.base
        return {"k": b.k_bits, "v": b.v_bits, "preset": self.preset,
                "overrides": {str(i): list(kv) for i, kv in sorted(self.overrides.items())},
                "block_size": b.block_size, "sinks": b.sinks, "rotation": b.rotation}

    def set_core(self, core: dict) -> None:
        """Restores a saved setting; a value no longer valid falls back to the default's."""
        default = KVConfig.preset(DEFAULT_PRESET)
        k, v = int(core.get("k", default.k_bits)), int(core.get("v", default.v_bits))
        k = k if k in SELECTABLE_BITS else default.k_bits
        v = v if v in SELECTABLE_BITS else default.v_bits
        try:
            self.base = KVConfig(k, v, block_size=core.get("block_size", default.block_size),
                                 sinks=core.get("sinks", default.sinks),
                                 rotation=core.get("rotation", default.rotation))
        except KVConfigError:
            self.base = default.with_bits(k, v)
        known = {*dict(KVConfig.presets()), AUTO}
        self.preset = core.get("preset") if core.get("preset") in known else CUSTOM
        self.overrides = {int(i): (int(kv[0]), int(kv[1]))
                          for i, kv in (core.get("overrides") or {}).items()
                          if int(i) >= 0 and int(kv[0]) in SELECTABLE_BITS and int(kv[1]) in SELECTABLE_BITS}

    def restore(self, state: dict) -> None:
        """The setting part of the panel's saved state (its core and high-precision mode)."""
        self.set_core(state)
        self.hp = bool(state.get("high_precision"))
        self.before_hp = state.get("before_high_precision") if self.hp else None

    # -- changes --------------------------------------------------------------------------------
    def choose_preset(self, name: str) -> None:
        """A preset sets the base to it and clears per-layer precision; Custom and Auto keep what
        is set (Auto's widths come from its choice, :meth:`use_choice`)."""
        self.preset = name
        if name not in (AUTO, CUSTOM):
            self.base = KVConfig.preset(name)
            self.overrides = {}

    def set_bits(self, k: int, v: int) -> None:
        self.base = self.base.with_bits(k, v)
        self.preset = CUSTOM

    def set_high_precision(self, on: bool) -> bool:
        """On: K8V8 in every layer, remembering what was set; off: exactly that again. False
        when the mode already was ``on``."""
        if on == self.hp:
            return False
        if on:
            self.before_hp = self.core()
            self.hp = True
        else:
            self.hp = False
            if self.before_hp:
                self.set_core(self.before_hp)
            self.before_hp = None
        return True

    def first_last(self, first: int, last: int, bits: tuple[int, int] | None) -> dict[int, tuple[int, int]]:
        """Overrides for the first ``first`` and last ``last`` layers at ``bits`` (default: high
        precision)."""
        n = self.n_layers or 0
        if bits is None:
            high = self.base.with_high_precision().base
            bits = (high.k_bits, high.v_bits)
        overrides = {i: bits for i in range(min(first, n))}
        overrides.update({i: bits for i in range(max(0, n - last), n)})
        return overrides

    def set_overrides(self, overrides: dict[int, tuple[int, int]]) -> None:
        self.overrides = {int(i): (int(k), int(v)) for i, (k, v) in overrides.items()}
        if self.overrides:
            self.preset = CUSTOM

    def set_layer(self, layer: int, k: int, v: int) -> None:
        if (k, v) == (self.base.k_bits, self.base.v_bits):
            self.overrides.pop(layer, None)
        else:
            self.overrides[layer] = (k, v)
            self.preset = CUSTOM

    def use_choice(self, config: KVConfig, widths) -> None:
        """The Auto preset's choice: ``config``'s base, each layer's (k, v) in ``widths``."""
        self.base = config.with_overrides(())
        self.overrides = {i: (int(k), int(v)) for i, (k, v) in enumerate(widths)
                          if (int(k), int(v)) != (config.k_bits, config.v_bits)}

    def import_file(self, path) -> None:
        """A KV settings file (KVConfig.from_file: this app's keys or llama.cpp's cache_type_k /
        cache_type_v) as the setting, out of high-precision mode. Raises KVConfigError, changing
        nothing, for a file that cannot be used."""
        config = KVConfig.from_file(path)
        try:
            layers = config.overrides_by_layer(self.n_layers)
        except KVConfigError as exc:
            hint = "; load a model first" if self.n_layers is None else ""
            raise KVConfigError(f"{path}: {exc}{hint}") from None
        self.hp = False
        self.before_hp = None
        self.base = config.with_overrides(())
        self.overrides = {i: (p.k_bits, p.v_bits) for i, p in layers.items()}
        self.preset = config.preset_name() or CUSTOM


def estimate_html(config: KVConfig, geometry: dict | None, ctx: int) -> str:
    """The estimate line: ``config``'s KV bytes at ``ctx`` tokens beside the 16-bit figure."""
    g = geometry
    if not g:
        return "KV at full context: load a model to estimate"
    try:
        args = dict(n_layers=g["n_layers"], n_kv_heads=g["n_kv_heads"], head_dim=g["head_dim"],
                    n_tokens=ctx, value_dim=g["value_dim"], windows=list(g["windows"]))
        est = estimate_bytes(config, **args)
        full = estimate_bytes(KVConfig.preset("full"), **args)
    except KVConfigError as exc:
        return f"<span style='color:#dc2626'>{exc}</span>"
    return (f"KV at full context ({ctx:,} tokens): <b>{format_bytes(est['total'])}</b> "
            f"(16-bit would be {format_bytes(full['total'])}), "
            f"{est['bits_per_value']:.1f} bits/value")


def switch_cost_text(cost: dict, spec: str) -> str:
    """The note for Session.switch_cost's ``cost`` ({"spec", "reread", "documents", "source"})
    when the panel asks for ``spec``; '' for another spec (an older request) or the format in use."""
    if cost.get("spec") != spec:
        return ""
    name = spec.upper()
    if cost.get("reread"):
        n = cost.get("documents", 0)
        return f"Switching to {name} re-reads {n} document{'s' if n != 1 else ''} ({cost['reread']:,} tokens)."
    if cost.get("source") == "master":
        return f"Switching to {name}: pinned documents are derived from their 8-bit master copy, no re-read."
    if cost.get("source") in ("memory", "disk"):
        return f"Switching to {name}: pinned documents are already cached in it, no re-read."
    return ""
