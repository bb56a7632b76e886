"""Llama architecture configuration, read from GGUF metadata or a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

__all__ = ["LlamaConfig", "rope_inv_freq", "default_dense_layers"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (hashable: usable as a static jit argument).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
      num_heads: Hq, query heads. num_kv_heads: Hkv, KV heads (GQA, Hq % Hkv == 0).
      head_dim: D.
      rope_theta: RoPE base. rope_scaling: ``None`` or a sorted tuple of
        ``(key, value)`` items of the Hugging Face ``rope_scaling``/``rope_parameters``
        dict (types "llama3", "linear", "default").
      rms_norm_eps: RMSNorm epsilon.
      max_position_embeddings: the trained context length (tokens).
      tie_word_embeddings: the output projection reuses the token embedding.
      eos_token_ids: ids that end generation.

    Raises:
      ValueError: inconsistent sizes (e.g. Hq not a multiple of Hkv).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict of a Llama-family model.

        Reads the RoPE scaling from either ``rope_scaling`` or ``rope_parameters``
        (transformers >= 5), with the type under ``rope_type`` or ``type``.

        Raises:
          ValueError: ``model_type``/``architectures`` is not Llama-family, or a field is missing.
        """
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r}: only Llama-family ('llama') models are supported")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(scaling, Mapping):
            theta = scaling.get("rope_theta")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=normalize_rope_scaling(scaling),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )


def normalize_rope_scaling(scaling: Mapping | None) -> tuple | None:
    """A hashable, canonical form of a RoPE scaling dict (``type`` folded into ``rope_type``)."""
    if not scaling:
        return None
    items = dict(scaling)
    kind = items.pop("rope_type", None) or items.pop("type", None) or "default"
    items.pop("type", None)
    items.pop("rope_theta", None)
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"unsupported RoPE scaling type {kind!r}; supported: default, linear, llama3")
    return tuple(sorted({**items, "rope_type": kind}.items()))


def rope_inv_freq(config: LlamaConfig, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """Inverse RoPE frequencies, float32 ``[D/2]`` (radians per position).

    ``theta^(-2i/D)``, then the configured scaling: "linear" divides by ``factor``;
    "llama3" applies Llama 3.1's wavelength-dependent scaling (as transformers'
    ``_compute_llama3_parameters``). ``freq_factors`` (llama.cpp's
    ``rope_freqs.weight``) divide the frequencies instead, when a GGUF ships them.
    """
    D = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    if freq_factors is not None:
        return (inv / np.asarray(freq_factors, np.float64)).astype(np.float32)
    if config.rope_scaling is None:
        return inv.astype(np.float32)
    s = dict(config.rope_scaling)
    factor = float(s["factor"])
    if s["rope_type"] == "linear":
        return (inv / factor).astype(np.float32)
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def default_dense_layers(num_layers: int) -> tuple[int, ...]:
    """Layers kept dense under MagicPIG by default: the first and the middle one.

    The reference keeps layers {0, 16} of 32-layer Llamas dense (arXiv
    2410.16179, Section 5); scaled to ``num_layers`` this is ``{0, num_layers // 2}``
    ({0, 15} for SmolLM2's 30 layers).
    """
    return tuple(sorted({0, num_layers // 2}))
