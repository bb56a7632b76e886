"""A MagicPIG configuration per layer: ``(K, L)`` for each sparse layer, or ``"dense"``.

The paper picks one ``(K, L)`` for every layer and keeps two layers dense by hand (arXiv
2410.16179, Section 5). :class:`LayerConfigs` lets each layer have its own tables, or stay
dense; ``magicpig-jax calibrate`` (:mod:`magicpig_jax.eval.calibrate`) chooses one that meets
a KL budget at the least measured cost and saves it as a small JSON file
(:meth:`LayerConfigs.save`, :meth:`LayerConfigs.load`), which ``generate``/``eval`` accept
(``--magicpig-config FILE``) and :func:`magicpig_jax.generate` takes as ``config=``.

The object is frozen and hashable (a tuple of ``(layer, MagicPIGConfig | "dense")``), so a
:class:`~magicpig_jax.models.backends.DecodeSpec` holding it stays a valid jit static argument.
Every sparse layer must share the static set (``num_sink``, ``num_local``) and the projection
seed, so that the methods stay comparable like for like.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from magicpig_jax.attention.config import MagicPIGConfig

__all__ = ["LayerConfigs", "DENSE", "FORMAT", "MODEL_SHAPE_KEYS", "check_layer_indices"]

DENSE = "dense"
FORMAT = "magicpig-jax layer configs v1"
# The fields of the file's object; other top-level keys are the calibration's report (not read).
_COMMON = ("num_sink", "num_local", "seed", "layers_per_projection")
_FIELDS = ("format", *_COMMON, "layers", "info", "model_shape")
# What `magicpig-jax calibrate` adds beside the fields (its report; not read back). Any other
# top-level key is refused: it would read as a setting and be ignored.
REPORT_KEYS = ("assignments", "attention_bytes_per_step", "attention_ms_per_step", "calibration", "cost",
               "dense_attention_bytes_per_step", "dense_attention_ms_per_step", "kl_budget", "measured_kl",
               "model", "per_layer", "search_complete", "seconds", "tried")
# The model sizes a calibrated file records (``LlamaConfig.model_shape()``), checked where it is applied.
MODEL_SHAPE_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
_LAYER_FIELDS = ("K", "L", "heavy")
# a layer's fields, or the flags' form of the dense layers (compared lower-cased, '-' as '_')
_NOT_TOP_LEVEL = ("k", "l", "heavy", "dense_layers", "dense", "sparse_layers")


def _is_index(i: object) -> bool:
    return isinstance(i, int | np.integer) and not isinstance(i, bool | np.bool_)


def check_layer_indices(name: str, layers, num_layers: int) -> tuple[int, ...]:
    """``layers`` as sorted distinct Python ints, each in ``[0, num_layers)``.

    Raises:
      TypeError: ``layers`` is a string, or an entry is not an integer (a bool, a float such
        as 0.5, which no layer equals: it would be ignored).
      ValueError: an index outside ``[0, num_layers)`` (named).
    """
    if isinstance(layers, str | bytes) or not hasattr(layers, "__iter__"):
        raise TypeError(f"{name} must be a sequence of layer indices, got {layers!r}")
    values = list(layers)
    bad = [i for i in values if not _is_index(i)]
    if bad:
        raise TypeError(f"{name} must hold integer layer indices, got {bad[0]!r}")
    out = tuple(sorted({int(i) for i in values}))
    if any(not 0 <= i < num_layers for i in out):
        raise ValueError(f"{name} must be in [0, {num_layers}), got {out}")
    return out


@dataclasses.dataclass(frozen=True)
class LayerConfigs:
    """Per-layer MagicPIG configurations.

    Attributes:
      layers: ``((layer, config), ...)`` sorted by layer, one entry per layer ``0 .. n-1``;
        ``config`` is a :class:`MagicPIGConfig` or ``"dense"``.
      info: optional provenance (``(key, value)`` string pairs kept in the JSON file; not
        used by decoding); a mapping of strings is accepted and stored as such pairs.
      model_shape: optional sizes of the model the configs were calibrated for (keys of
        ``MODEL_SHAPE_KEYS``: layers, hidden size, Hq, Hkv, D, vocabulary), as ``(key, size)`` pairs
        or a mapping; :meth:`check_model` refuses a model of other sizes. Not compared or hashed:
        it does not change the computation.
      static: optional config whose ``num_sink``, ``num_local``, ``seed`` and
        ``layers_per_projection`` are the file's static set and seed (:meth:`base`), which a
        configuration with every layer dense has no sparse layer to carry; it must agree with the
        sparse layers'. Not compared or hashed (dense layers do not read it).

    Raises:
      TypeError: ``layers`` not a sequence of pairs; an entry is neither a MagicPIGConfig nor
        ``"dense"``; a layer index that is not an integer; ``info`` not string pairs.
      ValueError: layers not exactly ``0 .. n-1``, no layer at all, sparse layers that
        disagree on ``num_sink``, ``num_local``, ``seed`` or ``layers_per_projection`` (with each
        other or with ``static``), or a ``model_shape`` with an unknown key, a size below 1, or
        another number of layers.
    """

    layers: tuple[tuple[int, MagicPIGConfig | str], ...]
    info: tuple[tuple[str, str], ...] | Mapping[str, str] = ()
    model_shape: Sequence | Mapping[str, int] = dataclasses.field(default=(), compare=False)
    static: MagicPIGConfig | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layers, Sequence) or isinstance(self.layers, str) or not all(
                isinstance(e, Sequence) and not isinstance(e, str) and len(e) == 2 for e in self.layers):
            raise TypeError("layers must be a sequence of (layer index, MagicPIGConfig or 'dense') pairs, got "
                            f"{self.layers!r}"[:300])
        bad = [i for i, _ in self.layers if not _is_index(i)]
        if bad:
            raise TypeError(f"LayerConfigs layer indices must be integers, got {bad[0]!r}")
        entries = tuple(sorted(((int(i), c) for i, c in self.layers), key=lambda x: x[0]))
        object.__setattr__(self, "layers", entries)
        info = tuple(self.info.items()) if isinstance(self.info, Mapping) else self.info
        if not (isinstance(info, tuple) and all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in info)):
            raise TypeError(f"info must be (key, value) string pairs or a mapping of strings, got {self.info!r}")
        object.__setattr__(self, "info", info)
        if not entries:
            raise ValueError("LayerConfigs needs at least one layer")
        idx = [i for i, _ in entries]
        if idx != list(range(len(idx))):
            raise ValueError(f"LayerConfigs must give every layer 0..n-1 exactly once, got layers {idx}")
        for i, c in entries:
            if c != DENSE and not isinstance(c, MagicPIGConfig):
                raise TypeError(f"layer {i}: expected a MagicPIGConfig or 'dense', got {c!r}")
        sparse = [c for _, c in entries if c != DENSE]
        shared = {(c.num_sink, c.num_local, c.seed, c.layers_per_projection) for c in sparse}
        if len(shared) > 1:
            raise ValueError("every sparse layer must share num_sink, num_local, seed and layers_per_projection, "
                             f"got {sorted(shared)}")
        if self.static is not None:
            if not isinstance(self.static, MagicPIGConfig):
                raise TypeError(f"static must be a MagicPIGConfig or None, got {self.static!r}")
            own = (self.static.num_sink, self.static.num_local, self.static.seed, self.static.layers_per_projection)
            if shared and shared != {own}:
                raise ValueError(f"static gives num_sink, num_local, seed, layers_per_projection {own}, the sparse "
                                 f"layers {next(iter(shared))}")
        raw = self.model_shape
        if not isinstance(raw, Mapping) and not (isinstance(raw, tuple | list) and all(
                isinstance(p, tuple | list) and len(p) == 2 for p in raw)):
            raise TypeError(f"model_shape must be (key, size) pairs or a mapping, got {raw!r}")
        shape = dict(raw)
        unknown = sorted(str(k) for k in shape if k not in MODEL_SHAPE_KEYS)
        if unknown:
            raise ValueError(f"model_shape has unknown keys {unknown} (known: {', '.join(MODEL_SHAPE_KEYS)})")
        missing = [k for k in MODEL_SHAPE_KEYS if k not in shape]
        if shape and missing:  # a partial shape would check only some sizes
            raise ValueError(f"model_shape lacks {', '.join(missing)} (it gives every one of "
                             f"{', '.join(MODEL_SHAPE_KEYS)}, or is left out)")
        bad = {k: v for k, v in shape.items() if not _is_index(v) or v < 1}
        if bad:
            raise ValueError(f"model_shape sizes must be integers >= 1, got {bad}")
        if shape.get("num_layers", len(entries)) != len(entries):
            raise ValueError(f"model_shape gives {shape['num_layers']} layers, the configs {len(entries)}")
        object.__setattr__(self, "model_shape", tuple((k, int(shape[k])) for k in MODEL_SHAPE_KEYS if k in shape))

    @classmethod
    def uniform(cls, config: MagicPIGConfig, num_layers: int, dense_layers=()) -> LayerConfigs:
        """One config for every layer except ``dense_layers`` (the paper's setting).

        Raises:
          TypeError, ValueError: as :func:`check_layer_indices` for ``dense_layers``; TypeError:
            ``config`` is not a MagicPIGConfig.
        """
        if not isinstance(config, MagicPIGConfig):  # 'dense' here was blamed on 'static'
            raise TypeError(f"config must be a MagicPIGConfig (for all-dense layers, dense_layers=range(n)), "
                            f"got {config!r}")
        dense = set(check_layer_indices("dense_layers", dense_layers, num_layers))
        return cls(tuple((i, DENSE if i in dense else config) for i in range(num_layers)), static=config)

    @property
    def num_layers(self) -> int:
        """The model's layer count (one entry per layer)."""
        return len(self.layers)

    def config(self, layer: int) -> MagicPIGConfig | str:
        """The entry of ``layer`` (a config or ``"dense"``).

        Raises:
          IndexError: ``layer`` outside ``[0, num_layers)`` (a negative index does not count from the end).
        """
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return self.layers[layer][1]

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers kept dense, ascending."""
        return tuple(i for i, c in self.layers if c == DENSE)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers with a (K, L) config, ascending."""
        return tuple(i for i, c in self.layers if c != DENSE)

    def base(self) -> MagicPIGConfig:
        """A config carrying the shared static set and seed: the first sparse layer's; when every
        layer is dense, :attr:`static` (default :class:`MagicPIGConfig` without it)."""
        sparse = [c for _, c in self.layers if c != DENSE]
        return sparse[0] if sparse else (self.static or MagicPIGConfig())

    def check_num_layers(self, num_layers: int) -> None:
        """Raises ValueError unless this gives exactly ``num_layers`` layers."""
        if self.num_layers != num_layers:
            raise ValueError(f"the layer configs give {self.num_layers} layers, the model has {num_layers}")

    def check_model(self, shape: Mapping[str, int]) -> None:
        """Refuse a model these configs were not made for: another number of layers, or (when the
        file recorded the calibrated model's sizes, :attr:`model_shape`) another size of those.

        Args:
          shape: the model's sizes by the keys of ``MODEL_SHAPE_KEYS`` (``LlamaConfig.model_shape()``).

        Raises:
          ValueError: naming the sizes that differ, or a ``shape`` lacking some of ``MODEL_SHAPE_KEYS``.
        """
        missing = [k for k in MODEL_SHAPE_KEYS if k not in shape]
        if missing:  # a size left out would pass unchecked
            raise ValueError(f"check_model: shape lacks {missing} (give LlamaConfig.model_shape())")
        self.check_num_layers(shape["num_layers"])
        differ = [f"{k} {v} (this model: {shape[k]})" for k, v in self.model_shape if k in shape and shape[k] != v]
        if differ:
            raise ValueError("the layer configs were calibrated for a model of other sizes: " + ", ".join(differ))

    # --- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """The JSON object of :meth:`save` (``format``, the static set, ``layers``, ``info``)."""
        base = self.base()
        return {"format": FORMAT, "num_sink": base.num_sink, "num_local": base.num_local, "seed": base.seed,
                "layers_per_projection": base.layers_per_projection,
                "layers": {str(i): DENSE if c == DENSE else _kl_json(c) for i, c in self.layers},
                "info": dict(self.info), **({"model_shape": dict(self.model_shape)} if self.model_shape else {})}

    @classmethod
    def from_json(cls, obj: Mapping) -> LayerConfigs:
        """Parse :meth:`to_json`'s object.

        Integers must be JSON integers (``10``, not ``10.5``, ``"10"`` or ``true``); a layer entry
        has only ``K``, ``L`` and optionally ``heavy``. The calibration's report (``REPORT_KEYS``)
        is not read; any other top-level key is refused (a misspelled field is named as such).

        Raises:
          ValueError: a wrong ``format``, missing fields, unknown layer fields, or invalid values
            (naming them).
        """
        if not isinstance(obj, Mapping) or obj.get("format") != FORMAT:
            raise ValueError(f"not a layer-configs file: 'format' must be {FORMAT!r}")
        for key in obj:
            norm = str(key).lower().replace("-", "_")
            if norm in _NOT_TOP_LEVEL or difflib.get_close_matches(norm, _NOT_TOP_LEVEL[3:], n=1, cutoff=0.8):
                # would read as a setting of the file, and be ignored
                raise ValueError(f"layer-configs: a top-level {key!r} is not read: each layer gives its K, L (and "
                                 "heavy) under 'layers', where a dense layer is 'dense'")
            near = difflib.get_close_matches(norm, _FIELDS, n=1, cutoff=0.8)
            if key not in _FIELDS and near:
                raise ValueError(f"layer-configs: unknown field {key!r} (did you mean {near[0]!r}?)")
            if key not in _FIELDS and key not in REPORT_KEYS:
                raise ValueError(f"layer-configs: unknown top-level key {key!r}: a file gives "
                                 f"{', '.join(_FIELDS)} (and calibrate's report); per-layer K and L go "
                                 "under 'layers', notes under 'info'")
        missing = [k for k in ("num_sink", "num_local", "seed", "layers") if k not in obj]
        if missing:
            raise ValueError(f"layer-configs file lacks {', '.join(missing)}")
        # files written before layers_per_projection existed: every layer had its own projections
        common = {k: _json_int(f"'{k}'", obj.get(k, 1)) for k in _COMMON}
        try:  # the file's own fields, named before any layer entry is read
            MagicPIGConfig(**common)
        except ValueError as err:
            raise ValueError(f"layer-configs file: {err}") from None
        raw = obj["layers"]
        if not isinstance(raw, Mapping):
            raise ValueError("layer-configs 'layers' must map layer -> {'K', 'L'} or 'dense'")
        layers = []
        for key, val in raw.items():
            # decimal digits as json.dumps writes an int key ("1_0", " 5 ", "01", "-0" are not layers)
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and key == str(int(key))):
                raise ValueError(f"layer-configs: layer key {key!r} is not a layer index (decimal digits, as "
                                 "'0', '12')")
            i = int(key)
            if val == DENSE:
                layers.append((i, DENSE))
            elif isinstance(val, Mapping) and {"K", "L"} <= set(val):
                unknown = sorted(set(val) - set(_LAYER_FIELDS))
                if unknown:
                    raise ValueError(f"layer-configs: layer {i} has unknown fields {unknown} (a layer gives "
                                     f"{', '.join(_LAYER_FIELDS[:2])} and optionally heavy; the static set and "
                                     "seed are the file's)")
                cfg = _config_from_json(i, val, common)
                layers.append((i, cfg))
            else:
                raise ValueError(f"layer-configs: layer {i} must be 'dense' or {{'K': .., 'L': ..}}, got {val!r}")
        info = obj.get("info", {})
        if not isinstance(info, Mapping) or not all(isinstance(v, str) for v in info.values()):
            # null, [] or 0 read as no notes, and 1 or null values as the strings "1" and "None"
            raise ValueError(f"layer-configs 'info' must be an object of strings, got {info!r}")
        shape = obj.get("model_shape", {})
        if not isinstance(shape, Mapping):  # null, [] or 0 would switch the model check off
            raise ValueError(f"layer-configs 'model_shape' must be an object, got {shape!r}")
        shape = {str(k): _json_int(f"model_shape {k!r}", v) for k, v in shape.items()}
        return cls(tuple(layers), tuple(info.items()), shape,
                   static=MagicPIGConfig(**common))

    def save(self, path: str | Path, extra: Mapping | None = None) -> Path:
        """Write the JSON file (``extra`` keys, e.g. the calibration's measurements, are added).

        Returns:
          the path written.

        Raises:
          ValueError: an ``extra`` key that is not one of ``REPORT_KEYS`` (:meth:`load` would refuse
            the file), or one of the configs' own fields (it would be dropped).
          TypeError: an ``extra`` value JSON cannot hold (e.g. a NumPy scalar).
          OSError: the file cannot be written.
        """
        path = Path(path)
        obj = self.to_json()
        clash = sorted(set(extra or {}) & set(obj))
        if clash:
            raise ValueError(f"save: extra keys {clash} are the configs' own fields, not report keys")
        unknown = sorted(set(extra or {}) - set(REPORT_KEYS))
        if unknown:  # load() would refuse the file
            raise ValueError(f"save: extra keys {unknown} are not report keys (REPORT_KEYS)")
        if extra:
            obj.update(extra)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LayerConfigs:
        """Read a file written by :meth:`save`.

        Raises:
          FileNotFoundError: no such file.
          ValueError: a directory, not JSON (or nested too deeply to read), a key given twice in
            one object (JSON would keep the last silently), or not a valid layer-configs object.
        """
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"layer-configs file {path} is a directory")
        if not path.is_file():
            raise FileNotFoundError(f"layer-configs file {path} does not exist")
        try:
            obj = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_keys)
        except _DuplicateKey as err:
            raise ValueError(f"layer-configs file {path} gives {err} twice in one object") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"layer-configs file {path} is not JSON: {err}") from None
        except ValueError as err:  # e.g. an integer of more digits than Python converts
            raise ValueError(f"layer-configs file {path} cannot be read as JSON: {err}") from None
        except RecursionError:
            raise ValueError(f"layer-configs file {path} is not a layer-configs object: JSON nested too deeply "
                             "to read") from None
        try:
            return cls.from_json(obj)
        except ValueError as err:  # name the file: the CLI may read several
            reason = ": " + str(err)
            for prefix in ("layer-configs file: ", "layer-configs: ", "layer-configs file "):
                if str(err).startswith(prefix):
                    reason = (": " if prefix.endswith(": ") else " ") + str(err).removeprefix(prefix)
                    break
            raise ValueError(f"layer-configs file {path}{reason}") from None


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads``' object hook: a dict, refusing a key given twice (JSON keeps the last)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key {key!r}")
        out[key] = value
    return out


def _kl_json(c: MagicPIGConfig) -> dict:
    out = {"K": c.K, "L": c.L}
    heavy = getattr(c, "heavy", None)
    if heavy is not None:
        out["heavy"] = heavy
    return out


def _json_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"layer-configs: {name} must be an integer, got {value!r}")
    return value


def _config_from_json(layer: int, val: Mapping, common: dict) -> MagicPIGConfig:
    fields = {k: _json_int(f"layer {layer} {k!r}", val[k]) for k in _LAYER_FIELDS if k in val}
    try:
        if "heavy" in fields:
            from magicpig_jax.attention.hybrid import HybridConfig

            return HybridConfig(**fields, **common)
        return MagicPIGConfig(**fields, **common)
    except (TypeError, ValueError) as err:
        raise ValueError(f"layer-configs: invalid entry {dict(val)}: {err}") from None
