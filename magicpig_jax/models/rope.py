"""Rotary position embeddings: the scalings a checkpoint may declare (``default``, ``linear``,
``llama3``, ``yarn``, ``longrope``), in a canonical hashable form, and the inverse frequencies and
attention factor they give.

Sources: RoFormer (Su et al., arXiv 2104.09864) for RoPE; transformers' ``modeling_rope_utils``
for the scalings' parameters and defaults (YaRN: Peng et al., arXiv 2309.00071; LongRoPE: Ding et
al., arXiv 2402.13753; Llama 3.1's ``llama3``), which these functions match.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from magicpig_jax.models.limits import MAX_POSITIONS, UnsupportedConfigError

if TYPE_CHECKING:
    from magicpig_jax.models.config import LlamaConfig

__all__ = ["normalize_rope_scaling", "complete_yarn", "yarn_context_length", "rope_inv_freq", "rope_attention_factor"]


_YARN_OPTIONAL = ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
                  "mscale_all_dim", "truncate")


def normalize_rope_scaling(scaling: Mapping | None) -> tuple | None:
    """A hashable, canonical form of a RoPE scaling dict (``type`` folded into ``rope_type``).

    Keys of a "yarn" scaling whose value is ``None`` are dropped (transformers reads them as
    absent), except ``truncate``, whose null transformers reads as false. A "yarn" scaling
    may lack ``original_max_position_embeddings`` and have a null ``factor``, which
    :meth:`LlamaConfig.from_hf_config` fills from ``max_position_embeddings`` as
    transformers does (:func:`complete_yarn`).

    Raises:
      UnsupportedConfigError: a scaling type other than default, linear, llama3 and yarn, or a
        field the type does not have (named).
      ValueError: a required field is missing, or a value is out of range (a factor that is not
        a finite number > 0, a llama3 ``high_freq_factor`` not above ``low_freq_factor``; named).
    """
    if not scaling:
        return None
    items = dict(scaling)
    kind = items.pop("rope_type", None) or items.pop("type", None) or "default"
    items.pop("type", None)
    items.pop("rope_theta", None)
    if items.pop("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError("RoPE 'partial_rotary_factor' other than 1 (partial RoPE) is not implemented")
    if kind == "default":
        extra = sorted(items)
        if extra:
            raise UnsupportedConfigError(f"RoPE parameters {extra} with rope_type 'default' are not supported")
        return None
    if kind not in ("llama3", "linear", "yarn", "longrope"):
        raise UnsupportedConfigError(
            f"unsupported RoPE scaling type {kind!r}; supported: default, linear, llama3, yarn, longrope")
    if kind == "longrope":
        items = {k: v for k, v in items.items() if v is not None or k in ("short_factor", "long_factor")}
        for key in ("short_factor", "long_factor"):
            value = items.get(key)
            if not isinstance(value, (list, tuple)) or not value or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                    for x in value):
                raise ValueError(f"RoPE scaling 'longrope' {key!r} must be a list of finite numbers > 0, got {value!r}")
            items[key] = tuple(float(x) for x in value)
    if kind == "yarn":
        if "factor" not in items:  # transformers requires the key; null derives it (complete_yarn)
            raise ValueError("RoPE scaling 'yarn' has no 'factor'")
        if "original_max_position_embeddings" in items and items["original_max_position_embeddings"] is None:
            # transformers fills only a missing key, and then fails on the null
            raise ValueError("RoPE scaling 'yarn' 'original_max_position_embeddings' must be a positive integer, "
                             "got None")
        if "truncate" in items and items["truncate"] is None:
            items["truncate"] = False  # transformers tests ``if truncate:``, and save_pretrained writes the null
        items = {k: v for k, v in items.items() if v is not None}
    known = {"linear": {"factor"},
             "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
             "yarn": {"factor", *_YARN_OPTIONAL},
             "longrope": {"short_factor", "long_factor", "original_max_position_embeddings", "factor",
                          "attention_factor"}}[kind]
    extra = sorted(k for k in items if k not in known)
    if extra:
        raise UnsupportedConfigError(f"RoPE scaling {kind!r}: field(s) {extra} are not supported")
    required = {"linear": {"factor"}, "llama3": known, "yarn": set(), "longrope": {"short_factor", "long_factor"}}[kind]
    missing = sorted(k for k in required if k not in items)
    if missing:
        # transformers 4 fails on a llama3 scaling without them and 5 fills some from other
        # fields: no default here can be right for every file.
        raise ValueError(f"RoPE scaling {kind!r} has no {', '.join(map(repr, missing))}")
    if kind == "yarn":
        _check_yarn(items)
    if kind in ("linear", "llama3"):
        _check_linear_llama3(kind, items)
    if kind == "longrope":
        for key, low in (("factor", 0.0), ("attention_factor", 0.0)):
            value = items.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= low):
                raise ValueError(f"RoPE scaling 'longrope' {key!r} must be a finite number > 0, got {value!r}")
        orig = items.get("original_max_position_embeddings")
        if orig is not None and (isinstance(orig, bool) or not isinstance(orig, (int, float))
                                 or not 1 <= orig <= MAX_POSITIONS or orig != int(orig)):
            raise ValueError("RoPE scaling 'longrope' 'original_max_position_embeddings' must be a positive integer, "
                             f"got {orig!r}")
    return tuple(sorted({**items, "rope_type": kind}.items()))


def _check_linear_llama3(kind: str, items: Mapping) -> None:
    """Refuse values that make the inverse frequencies inf, NaN or garbage, naming the field.

    transformers' ``rope_config_validation`` only warns on these (a factor that is not a number
    > 0, ``high_freq_factor <= low_freq_factor``, which divides by zero or flips the smoothing), and
    then computes with them: a factor of 0 gives infinite frequencies and finite, wrong logits.
    """
    keys = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    for key in keys:
        value = items[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"RoPE scaling {kind!r} {key!r} must be a finite number > 0, got {value!r}")
    if kind == "llama3":
        if items["high_freq_factor"] <= items["low_freq_factor"]:
            raise ValueError(f"RoPE scaling 'llama3' 'high_freq_factor' ({items['high_freq_factor']!r}) must be "
                             f"greater than 'low_freq_factor' ({items['low_freq_factor']!r})")
        orig = items["original_max_position_embeddings"]
        if isinstance(orig, bool) or not isinstance(orig, (int, float)) or not 1 <= orig <= MAX_POSITIONS \
                or orig != int(orig):
            raise ValueError(f"RoPE scaling 'llama3' 'original_max_position_embeddings' must be a positive integer "
                             f"<= {MAX_POSITIONS}, got {orig!r}")


def _check_yarn(items: Mapping) -> None:
    """Refuse YaRN values transformers would compute garbage (or NaN) from, naming the field."""
    def number(key, low, strict):
        value = items.get(key)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (value <= low if strict else value < low):
            bound = f"> {low}" if strict else f">= {low}"
            raise ValueError(f"RoPE scaling 'yarn' {key!r} must be a finite number {bound}, got {value!r}")

    number("factor", 0, True)
    number("attention_factor", 0, True)
    number("beta_fast", 0, False)
    number("beta_slow", 0, False)
    number("mscale", 0, False)
    number("mscale_all_dim", 0, False)
    orig = items.get("original_max_position_embeddings")
    if orig is not None and (isinstance(orig, bool) or not isinstance(orig, (int, float))
                             or not 1 <= orig <= MAX_POSITIONS or orig != int(orig)):
        raise ValueError(f"RoPE scaling 'yarn' 'original_max_position_embeddings' must be a positive integer "
                         f"<= {MAX_POSITIONS}, got {orig!r}")
    if "truncate" in items and not isinstance(items["truncate"], bool):
        raise ValueError(f"RoPE scaling 'yarn' 'truncate' must be true or false, got {items['truncate']!r}")


def complete_yarn(scaling: tuple | None, max_positions: int) -> tuple[tuple | None, int]:
    """Fill a YaRN scaling's defaults from the context length, and that length from the scaling.

    As transformers (``standardize_rope_params``, ``_compute_yarn_parameters``): a missing
    ``original_max_position_embeddings`` is ``max_position_embeddings``, and a missing
    ``factor`` is ``max_position_embeddings / original_max_position_embeddings``. The context
    the model is then run to is :func:`yarn_context_length`.
    """
    s = dict(scaling or {})
    if s.get("rope_type") != "yarn":
        return scaling, max_positions
    s.setdefault("original_max_position_embeddings", max_positions)
    s["original_max_position_embeddings"] = int(s["original_max_position_embeddings"])
    s.setdefault("factor", max_positions / s["original_max_position_embeddings"])
    s["factor"] = float(s["factor"])
    return tuple(sorted(s.items())), yarn_context_length(s, max_positions)


def yarn_context_length(scaling: Mapping, max_positions: int) -> int:
    """The context a YaRN-scaled model runs to: ``max(max_positions, original * factor)`` tokens.

    Qwen2.5's and Qwen3's instructions add a YaRN ``rope_scaling`` (factor 4 over 32,768
    positions) to a ``config.json`` whose ``max_position_embeddings`` stays 32,768; the
    scaling is what extends the context. This follows vLLM's derived maximum length
    (``original_max_position_embeddings * factor`` for YaRN); llama.cpp only warns past
    its trained context.

    Raises:
      ValueError: ``original * factor`` is not finite or exceeds int32 positions (both named).
    """
    orig, factor = scaling["original_max_position_embeddings"], float(scaling["factor"])
    extended = orig * factor
    if not math.isfinite(extended) or extended > MAX_POSITIONS:
        raise ValueError(f"RoPE scaling 'yarn': original_max_position_embeddings ({orig!r}) x factor ({factor!r}) "
                         f"must be at most {MAX_POSITIONS} positions")
    return max(int(max_positions), int(extended))


def rope_inv_freq(config: LlamaConfig, freq_factors: np.ndarray | None = None, long: bool = False,
                  local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies, float32 ``[D/2]`` (radians per position).

    With ``local``: the sliding-window layers' ``local_rope_theta^(-2i/D)``, unscaled (Gemma 3's local
    RoPE, transformers' default RoPE of the ``sliding_attention`` layer type).

    Under "longrope" (LongRoPE, Ding et al. 2024, arXiv 2402.13753; transformers'
    ``_compute_longrope_parameters``): ``theta^(-2i/D) / short_factor[i]``, or ``/ long_factor[i]``
    with ``long``; which applies where is :attr:`LlamaConfig.longrope_switch`'s rule
    (:func:`magicpig_jax.models.llama.rope_frequencies`).

    ``theta^(-2i/D)``, then the configured scaling: "linear" divides by ``factor``;
    "llama3" applies Llama 3.1's wavelength-dependent scaling (as transformers'
    ``_compute_llama3_parameters``); "yarn" blends the divided and the original
    frequencies by YaRN's linear ramp over the dimensions that turn between ``beta_fast``
    and ``beta_slow`` times in the original context (Peng et al. 2023, arXiv 2309.00071,
    Section 3.2; as transformers' ``_compute_yarn_parameters`` and llama.cpp's
    ``rope_yarn``). Its attention factor is :func:`rope_attention_factor`. ``freq_factors`` (llama.cpp's
    ``rope_freqs.weight``, float ``[D/2]``) divide the frequencies too, when a GGUF
    ships them; a linear factor then applies on top, as llama.cpp's ``ggml_rope_ext``
    applies ``freq_scale`` and the factors together.

    Raises:
      ValueError: ``freq_factors`` is not ``[D/2]`` of finite values > 0, or comes
        with a "llama3" scaling (the factors are that scaling, precomputed); a
        "llama3" scaling lacks one of its keys; ``local`` for a config without
        ``local_rope_theta``.
    """
    D = config.rotary_dim  # partial RoPE: the frequencies of the rotated dimensions only
    if local:
        if config.local_rope_theta is None:
            raise ValueError("local=True needs a config with local_rope_theta")
        return (1.0 / (config.local_rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))).astype(np.float32)
    inv = 1.0 / (config.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    s = dict(config.rope_scaling or {})
    if freq_factors is not None:
        ff = np.asarray(freq_factors, np.float64)
        if ff.shape != (D // 2,) or not (np.isfinite(ff).all() and (ff > 0).all()):
            raise ValueError(f"freq_factors must be [D/2] = [{D // 2}] finite values > 0, got shape {ff.shape}")
        if s.get("rope_type", "linear") != "linear":
            raise ValueError(f"freq_factors cannot be combined with a {s['rope_type']!r} RoPE scaling")
        inv = inv / ff
    if not s:
        return inv.astype(np.float32)
    if s["rope_type"] == "longrope":
        return (inv / np.asarray(s["long_factor" if long else "short_factor"], np.float64)).astype(np.float32)
    factor = float(s["factor"])
    if s["rope_type"] == "linear":
        return (inv / factor).astype(np.float32)
    if s["rope_type"] == "yarn":
        return _yarn_inv_freq(inv, config, s).astype(np.float32)
    missing = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings") if k not in s]
    if missing:
        raise ValueError(f"rope_scaling 'llama3' has no {', '.join(map(repr, missing))}")
    low = float(s["low_freq_factor"])
    high = float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, config: LlamaConfig, s: Mapping) -> np.ndarray:
    """YaRN's frequencies ``[D/2]`` (float64) from the unscaled ones ``inv``."""
    D, base = config.rotary_dim, config.rope_theta
    orig = float(s.get("original_max_position_embeddings", config.max_position_embeddings))
    # transformers reads a beta of 0 or None as its default (``or``)
    beta_fast = float(s.get("beta_fast") or 32.0)
    beta_slow = float(s.get("beta_slow") or 1.0)

    def dimension(rotations):  # the dimension index that turns ``rotations`` times in ``orig`` positions
        return D * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(D // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: the original frequency (fast dimensions), 0: divided by factor (slow ones)
    return inv / float(s["factor"]) * (1.0 - keep) + inv * keep


def rope_attention_factor(config: LlamaConfig) -> float:
    """The factor RoPE's cos and sin are multiplied by (so q.k by its square): 1 but under YaRN
    and LongRoPE (LongRoPE's ``attention_factor``, else ``sqrt(1 + ln(s) / ln(original))`` with
    ``s`` its ``factor`` or ``max_position_embeddings / original``: transformers'
    ``_compute_longrope_parameters``).

    YaRN's ``attention_factor`` when given, else ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` when both are set, else ``mscale(factor) = 0.1 ln(factor)
    + 1`` (1 for a factor <= 1): transformers' ``_compute_yarn_parameters`` (Peng et al. 2023,
    Eq. 22 and its DeepSeek variant); llama.cpp applies the same ``1 + 0.1 ln(factor)``.
    """
    s = dict(config.rope_scaling or {})
    if s.get("rope_type") == "longrope":
        # transformers: the given factor, else sqrt(1 + ln(s) / ln(original)) with s = the given
        # 'factor' or max_position_embeddings / original (1 for s <= 1); for both factor sets
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        orig = float(s["original_max_position_embeddings"])
        scale = float(s["factor"]) if s.get("factor") is not None else config.max_position_embeddings / orig
        return 1.0 if scale <= 1.0 else float(math.sqrt(1.0 + math.log(scale) / math.log(orig)))
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"])))
    return float(mscale(factor))
