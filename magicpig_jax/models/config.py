"""Llama-family architecture configuration, read from GGUF metadata or a Hugging Face ``config.json``.

One :class:`LlamaConfig` covers the decoders this package runs: Llama 1/2/3.x, Mistral,
Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm). Every field of a
``config.json`` is either implemented, known not to change the computation, or an
error naming it (:func:`LlamaConfig.from_hf_config`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from magicpig_jax.attention._common import SOFTCAP_RANGE, check_softcap
from magicpig_jax.models.limits import MAX_POSITIONS, UnsupportedConfigError
from magicpig_jax.models.rope import (  # the RoPE names this module had (re-exported for existing imports)
    complete_yarn,
    normalize_rope_scaling,
    rope_attention_factor,
    rope_inv_freq,
    yarn_context_length,
)

__all__ = ["LlamaConfig", "default_dense_layers", "HF_MODEL_TYPES", "UnsupportedConfigError", "MAX_POSITIONS",
           "SOFTCAP_RANGE", "normalize_rope_scaling", "rope_attention_factor", "rope_inv_freq", "yarn_context_length"]

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3_text")
HIDDEN_ACTS = ("silu", "gelu_tanh")  # SwiGLU (Llama) and GeGLU with the tanh GELU (Gemma)
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (hashable: usable as a static jit argument).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
      num_heads: Hq, query heads. num_kv_heads: Hkv, KV heads (GQA, Hq % Hkv == 0).
      head_dim: D.
      rope_theta: RoPE base. rope_scaling: ``None`` or a sorted tuple of
        ``(key, value)`` items of the Hugging Face ``rope_scaling``/``rope_parameters``
        dict (types "llama3", "linear", "yarn", "default").
      rms_norm_eps: RMSNorm epsilon.
      max_position_embeddings: the context length (tokens) the model is run to: the trained one,
        or under YaRN at least ``original_max_position_embeddings * factor``
        (:func:`magicpig_jax.models.rope.yarn_context_length`).
      tie_word_embeddings: the output projection reuses the token embedding.
      eos_token_ids: ids that end generation.
      qkv_bias: q/k/v projections have biases (Qwen2; Llama/Qwen3 ``attention_bias``).
      o_bias: the output projection has a bias (Llama/Qwen3 ``attention_bias``).
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3), weights ``[D]``.
      sliding_window: W, or None. The layers of ``sliding_layers`` attend only to the last W
        positions, their own included (Mistral ``sliding_window``, Qwen
        ``use_sliding_window``; transformers' ``sliding_window_overlay``: a query at position
        p sees keys ``p - W + 1 .. p``), in prefill and in decode (:meth:`layer_window`).
      sliding_layers: the layers that attend through the window, or None for every layer
        (Mistral's, and a GGUF's ``attention.sliding_window``); ignored without a window.
      nope_layers: layers whose q and k get no rotary embedding (SmolLM3's ``no_rope_layers``
        zeros, every 4th layer: "NoPE").
      rope_dim: the leading dimensions of each head that RoPE rotates (partial RoPE: Phi-3's
        ``partial_rotary_factor``, a GGUF's ``rope.dimension_count``); None for all D.
      hidden_act: the gated MLP's activation, one of :data:`HIDDEN_ACTS`: "silu" (SwiGLU) or
        "gelu_tanh" (GELU's tanh approximation, Gemma's ``gelu_pytorch_tanh``).
      sandwich_norms: the attention and MLP outputs are RMS-normed before their residual add
        (Gemma 2/3's ``post_attention_layernorm`` and ``post_feedforward_layernorm``).
      embedding_scale: the embeddings are multiplied by it (Gemma: ``sqrt(hidden_size)``), or None.
      query_scale: the attention's scale of ``q . k`` (Gemma: ``query_pre_attn_scalar ** -0.5``), or
        None for ``1 / sqrt(head_dim)``.
      local_rope_theta: the RoPE base of the sliding-window layers, unscaled (Gemma 3's local base,
        ``rope_local_base_freq``), or None: every layer uses ``rope_theta`` and ``rope_scaling``.
      attn_logit_softcap: c, or None: every attention logit s (the scaled ``q . k``) becomes
        ``c * tanh(s / c)`` before the softmax, in every layer, in prefill and in every decode
        backend (Gemma 2's ``attn_logit_softcapping``).
      final_logit_softcap: c, or None: the output logits become ``c * tanh(x / c)`` (Gemma 2's
        ``final_logit_softcapping``).

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
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    nope_layers: tuple[int, ...] = ()
    rope_dim: int | None = None
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    embedding_scale: float | None = None
    query_scale: float | None = None
    local_rope_theta: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm", "sandwich_norms"):
            if not isinstance(getattr(self, name), bool):  # a string "false" would read as true
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.eos_token_ids, tuple) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be a tuple of token ids (ints >= 0), got {self.eos_token_ids!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_dim is not None and (isinstance(self.rope_dim, bool) or not isinstance(self.rope_dim, int)
                                          or self.rope_dim % 2 or not 2 <= self.rope_dim <= self.head_dim):
            raise ValueError(f"rope_dim must be an even int in [2, head_dim = {self.head_dim}] or None, "
                             f"got {self.rope_dim!r}")
        for name in ("attn_logit_softcap", "final_logit_softcap"):
            check_softcap(getattr(self, name), name)
        for name in ("rope_theta", "rms_norm_eps", "embedding_scale", "query_scale", "local_rope_theta"):
            value = getattr(self, name)
            if value is None and name not in ("rope_theta", "rms_norm_eps"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                optional = "" if name in ("rope_theta", "rms_norm_eps") else " or None"
                raise ValueError(f"{name} must be a finite number > 0{optional}, got {value!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ValueError(f"max_position_embeddings must be at most {MAX_POSITIONS} (int32 positions), "
                             f"got {self.max_position_embeddings}")
        if self.rope_scaling is not None:
            # The canonical form of a valid scaling (normalize_rope_scaling), whatever built the config: a
            # hand-edited checkpoint's other type, unknown field or factor <= 0 is refused, not computed with.
            try:
                pairs = dict(self.rope_scaling)
            except (TypeError, ValueError):
                raise ValueError(f"rope_scaling must be (key, value) pairs or None, "
                                 f"got {self.rope_scaling!r}") from None
            canonical = normalize_rope_scaling(pairs)  # ValueError / UnsupportedConfigError naming the field
            if canonical != self.rope_scaling:
                raise ValueError(f"rope_scaling must be the sorted (key, value) pairs of normalize_rope_scaling, "
                                 f"got {self.rope_scaling!r} (canonical: {canonical!r})")
        scaling = dict(self.rope_scaling or {})
        if scaling.get("rope_type") == "yarn":
            missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
            if missing:
                raise ValueError(f"rope_scaling 'yarn' needs {' and '.join(map(repr, missing))} "
                                 "(LlamaConfig.from_hf_config fills them from max_position_embeddings)")
        if scaling.get("rope_type") == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(scaling.get(key) or ()) != self.rotary_dim // 2:
                    raise ValueError(f"rope_scaling 'longrope' {key!r} needs the rotated dims / 2 = "
                                     f"{self.rotary_dim // 2} values, got {len(scaling.get(key) or ())}")
            if scaling.get("original_max_position_embeddings") is None or \
                    not 2 <= int(scaling["original_max_position_embeddings"]) <= MAX_POSITIONS:
                raise ValueError(f"rope_scaling 'longrope' needs 'original_max_position_embeddings' in [2, "
                                 f"{MAX_POSITIONS}] (LlamaConfig.from_hf_config fills it as transformers does)")
            for long in (False, True):  # a tiny factor overflows float32's 1 / (factor * theta^...)
                with np.errstate(over="ignore"):
                    finite = np.isfinite(rope_inv_freq(self, long=long)).all()
                if not finite:
                    raise ValueError(f"rope_scaling 'longrope' {'long' if long else 'short'}_factor gives "
                                     "frequencies that overflow float32 (a factor too close to 0)")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or not isinstance(
                self.sliding_window, int) or not 1 <= self.sliding_window <= MAX_POSITIONS):
            raise ValueError(f"sliding_window must be an int in [1, {MAX_POSITIONS}] (int32 positions) or None, "
                             f"got {self.sliding_window!r}")
        for name in ("sliding_layers", "nope_layers"):
            layers = getattr(self, name)
            if layers is None:
                continue
            if not isinstance(layers, tuple) or any(
                    isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers for i in layers):
                raise ValueError(f"{name} must be a tuple of layer indices in [0, {self.num_layers}), "
                                 f"got {layers!r}")

    def model_shape(self) -> dict[str, int]:
        """The sizes a calibrated per-layer file records and checks
        (:attr:`~magicpig_jax.attention.LayerConfigs.model_shape`): layers, hidden size, Hq, Hkv,
        D and the vocabulary."""
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size}

    def layer_window(self, layer: int) -> int | None:
        """The attention window W of ``layer`` (it sees the last W positions), or None (every position)."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or layer in self.sliding_layers:
            return self.sliding_window
        return None

    def binding_windows(self, positions: int | None) -> tuple[int, ...]:
        """The layers whose sliding window is shorter than a run of ``positions`` (the cache's
        capacity; None: any length), i.e. where it excludes some key: a window at least as long
        as the run never does."""
        return tuple(i for i in self.windowed_layers if positions is None or self.sliding_window < positions)

    def window_start(self, layer: int, pos):
        """The first key the query at ``pos`` (int or int32 array) sees in ``layer``: ``pos - W + 1``
        clipped at 0 with a window W, else None (every key)."""
        window = self.layer_window(layer)
        return None if window is None else first_visible_key(pos, window)

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head RoPE rotates: :attr:`rope_dim`, else ``head_dim``."""
        return self.head_dim if self.rope_dim is None else self.rope_dim

    @property
    def longrope_switch(self) -> int | None:
        """Under LongRoPE, the pretrained context past which the long factors apply (positions
        ``>= original_max_position_embeddings``); None for every other RoPE."""
        scaling = dict(self.rope_scaling or {})
        if scaling.get("rope_type") != "longrope":
            return None
        return int(scaling["original_max_position_embeddings"])

    def layer_uses_local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates by the local RoPE base (:attr:`local_rope_theta`): Gemma 3's
        sliding-window layers."""
        return self.local_rope_theta is not None and self.layer_window(layer) is not None

    def layer_uses_rope(self, layer: int) -> bool:
        """Whether ``layer`` applies the rotary embedding to q and k (False for SmolLM3's NoPE layers)."""
        return layer not in self.nope_layers

    @property
    def windowed_layers(self) -> tuple[int, ...]:
        """The layers that attend through the sliding window (empty without one)."""
        return tuple(i for i in range(self.num_layers) if self.layer_window(i) is not None)

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (``model_type`` llama, mistral, qwen2, qwen3, smollm3, phi3,
        gemma2, gemma3_text).

        Gemma 3 (``gemma3_text``): :func:`_check_gemma3` reads its own fields (activation, query
        scale, RoPE per layer type); Gemma 2 (``gemma2``): :func:`_check_gemma2` (activation, query
        scale, attention and final logit soft-capping). Their layer patterns are
        :func:`_hf_sliding_window`'s.

        Phi-3 (``phi3``) is Llama with q/k/v and gate/up each fused in one matrix (split by the
        loader), Mistral's window rule, LongRoPE (:func:`_check_phi3`) and partial RoPE
        (:func:`_phi3_partial_rotary`). Reads the RoPE scaling from either ``rope_scaling`` or
        ``rope_parameters`` (transformers >= 5), with the type under ``rope_type`` or ``type``. Missing
        fields take transformers' defaults for the model type.

        Raises:
          UnsupportedConfigError (a ValueError): another ``model_type``, a field that
            changes the computation and is not implemented (the message names it), or a
            value that is not supported (``hidden_act`` other than silu, ``mlp_bias``...).
          ValueError: a required field is missing (named).
        """
        model_type = cfg.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(HF_MODEL_TYPES)}")
        unknown = sorted(k for k in cfg if k not in _HF_HANDLED_KEYS and k not in _HF_IGNORED_KEYS
                         and k not in _HF_TYPE_KEYS.get(model_type, ()))
        if unknown:
            raise UnsupportedConfigError(
                f"config.json field(s) {', '.join(map(repr, unknown))} of this {model_type} model are not "
                "implemented (they may change the computation)")
        defaults = _HF_DEFAULTS[model_type]
        null = [key for key in _HF_NOT_NULL if key in cfg and cfg[key] is None]
        nested_theta = any(isinstance(cfg.get(k), Mapping) and cfg[k].get("rope_theta") is not None
                           for k in ("rope_scaling", "rope_parameters"))
        if "rope_theta" in cfg and cfg["rope_theta"] is None and not nested_theta:
            null.append("rope_theta")
        if null:  # transformers' default fills an absent field, not a null one (its modules then fail)
            raise ValueError(f"config.json {null[0]!r} is null: give its value, or leave the field out for "
                             "transformers' default")

        def get(key):
            value = cfg.get(key, defaults.get(key))
            if value is None and key in _HF_REQUIRED:
                raise ValueError(f"config.json has no {key!r}")
            return value

        def require(key, allowed, what):
            value = cfg.get(key, defaults.get(key))
            if value not in allowed:
                raise UnsupportedConfigError(f"config.json {key!r} = {value!r} is not supported ({what})")

        extra = {}
        if model_type == "gemma3_text":  # Gemma 3: its own fields, RoPE per layer type and activation
            cfg, extra = _check_gemma3(cfg)
        elif model_type == "gemma2":  # Gemma 2: its own fields, activation and logit soft-capping
            cfg, extra = _check_gemma2(cfg)
        else:
            require("hidden_act", ("silu", "swish"), "only SwiGLU with silu (transformers' 'swish') is implemented")
        require("mlp_bias", (False, None), "MLP biases are not implemented")
        require("use_mrope", (False, None), "multimodal RoPE is not implemented")
        # nanotron's flag: transformers ignores it and rotates halves, which is what a true value says is wrong
        require("rope_interleaved", (False, None), "interleaved rotary pairs are not implemented; transformers "
                "ignores the field and rotates the halves of each head")
        rope_fraction = None
        if model_type == "phi3":  # Phi-4-mini: RoPE on the leading fraction of each head (transformers' Phi3)
            cfg, rope_fraction = _phi3_partial_rotary(cfg)
            cfg = _check_phi3(cfg)
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedConfigError(f"config.json 'partial_rotary_factor' = {cfg['partial_rotary_factor']!r}: "
                                         "partial RoPE is not implemented")
        if cfg.get("quantization_config") is not None:
            raise UnsupportedConfigError(
                "config.json 'quantization_config': quantized HF checkpoints are not supported")
        def positive_int(key):
            value = get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 \
                    or (isinstance(value, float) and not math.isfinite(value)) or value != int(value):
                raise ValueError(f"config.json {key!r} must be a positive integer, got {value!r}")
            return int(value)

        for key in ("vocab_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
                    "max_position_embeddings"):
            positive_int(key)
        for key in ("rope_theta", "rms_norm_eps"):
            value = cfg.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"config.json {key!r} must be a finite number > 0, got {value!r}")
        num_heads = positive_int("num_attention_heads")
        hidden = positive_int("hidden_size")
        scaling, theta = _hf_rope(cfg)
        max_positions = int(get("max_position_embeddings"))
        scaling, max_positions = complete_yarn(scaling, max_positions)
        scaling = _complete_longrope(scaling, cfg, model_type, max_positions)
        eos = cfg.get("eos_token_id", defaults.get("eos_token_id"))  # Gemma3TextConfig's default: 1
        eos_ids = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in eos_ids):
            raise ValueError(f"config.json 'eos_token_id' must be a token id (int >= 0), a list of them or null, "
                             f"got {eos!r}")
        for key in ("tie_word_embeddings", "attention_bias"):  # bool("false") would be True
            if get(key) is not None and not isinstance(get(key), bool):
                raise ValueError(f"config.json {key!r} must be true or false, got {get(key)!r}")
        # transformers' Qwen2 and Mistral attention ignore 'attention_bias' (Qwen2: q/k/v biases
        # always, no o bias; Mistral: none); Llama and Qwen3 put it on q, k, v and o.
        attention_bias = bool(cfg.get("attention_bias", False)) and model_type in ("llama", "qwen3", "smollm3",
                                                                                   "gemma2", "gemma3_text")
        num_layers = int(get("num_hidden_layers"))
        head_dim = int(get("head_dim") or hidden // num_heads)
        rope_dim = None
        if rope_fraction is not None and rope_fraction != 1.0:
            rope_dim = int(head_dim * rope_fraction)  # transformers: int(head_dim * partial_rotary_factor)
            if rope_dim < 2 or rope_dim % 2:
                raise UnsupportedConfigError(
                    f"config.json 'partial_rotary_factor' = {rope_fraction!r} rotates {rope_dim} of the {head_dim} "
                    "dimensions of a head: an even number of at least 2 is needed")
        nope = _hf_nope_layers(cfg, model_type, num_layers)
        window, window_layers = _hf_sliding_window(cfg, model_type, num_layers, nope)
        return cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            # the type's own default base where it has one (SmolLM3: 2e6), else transformers' 10000
            rope_theta=float(theta if theta is not None else defaults.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(get("rms_norm_eps")),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            eos_token_ids=eos_ids,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sliding_window=window,
            sliding_layers=window_layers,
            nope_layers=nope,
            rope_dim=rope_dim,
            **({**extra, "embedding_scale": math.sqrt(hidden)} if extra else {}),
        )


# Fields of config.json that from_hf_config reads (each one implemented or refused by value).
_HF_HANDLED_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "eos_token_id", "hidden_act", "attention_bias", "mlp_bias",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "partial_rotary_factor",
    "quantization_config", "use_mrope", "no_rope_layers", "no_rope_layer_interval", "rope_interleaved",
})
# Fields read for one model type only (refused as unknown elsewhere).
_HF_TYPE_KEYS = {"phi3": frozenset({"original_max_position_embeddings", "full_attn_mod", "interpolate_factor",
                                    "lm_head_bias"}),
                 "gemma3_text": frozenset({"hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping",
                                           "attn_logit_softcapping", "use_bidirectional_attention",
                                           "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern",
                                           "cache_implementation"}),
                 "gemma2": frozenset({"hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping",
                                      "attn_logit_softcapping", "use_bidirectional_attention",
                                      "cache_implementation", "sliding_window_size"})}
# Fields that do not change the forward pass: ids, dtypes, training and generation settings, bookkeeping.
# ``pretraining_tp`` only splits transformers' matmuls into slices (the same product).
_HF_IGNORED_KEYS = frozenset({
    "architectures", "bos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "torch_dtype",
    "dtype", "transformers_version", "use_cache", "initializer_range", "attention_dropout", "pretraining_tp",
    "_name_or_path", "name_or_path", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "pruned_heads", "tf_legacy_loss", "use_bfloat16", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "cross_attention_hidden_size",
    "_attn_implementation_autoset", "model_max_length", "resid_pdrop", "embd_pdrop",
    # the repository's own modeling code, which transformers runs only with trust_remote_code; its
    # built-in class (what this package matches) ignores the field
    "auto_map",
    # nanotron's export flag (SmolLM2), and transformers.js's settings for its own runtime
    "is_llama_config", "transformers.js_config",
})
_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Fields whose null transformers does not replace by a value (num_key_value_heads, head_dim, sliding_window and
# rope_scaling may be null: transformers derives them or reads "none"; rope_theta may be null where
# rope_parameters gives it, checked beside).
_HF_NOT_NULL = (*_HF_REQUIRED, "rms_norm_eps", "max_position_embeddings", "max_window_layers")
# transformers' defaults for fields missing from config.json (transformers 5 configuration classes).
_HF_DEFAULTS = {
    "llama": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "num_key_value_heads": None},
    "mistral": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32,
                "tie_word_embeddings": False, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "num_key_value_heads": 32, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen3": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096,
              "max_window_layers": 28},
    "smollm3": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                "tie_word_embeddings": True, "num_key_value_heads": 4, "rope_theta": 2000000.0,
                "no_rope_layer_interval": 4},
    "phi3": {"hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
             "tie_word_embeddings": False, "num_key_value_heads": None, "sliding_window": None},
    "gemma2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "tie_word_embeddings": True,
               "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096, "eos_token_id": 1},
    "gemma3_text": {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096, "eos_token_id": 1},
}


def _check_gemma3(cfg: Mapping) -> tuple[dict, dict]:
    """``(cfg, fields)`` of a Gemma 3 text config (transformers' ``Gemma3TextConfig``): ``cfg`` with its
    full-attention RoPE as a flat ``rope_parameters`` (what the other types carry), and the
    :class:`LlamaConfig` fields only Gemma sets (activation, sandwich norms, query scale, local RoPE base;
    ``from_hf_config`` adds the embedding scale ``sqrt(hidden_size)``).

    As transformers 5 reads it: ``rope_parameters`` maps ``full_attention`` and ``sliding_attention``
    to their RoPE; a legacy ``rope_scaling`` applies to the full-attention layers; their base is
    ``rope_theta`` (default 1e6), the sliding layers' ``rope_local_base_freq`` (default 1e4), unless
    ``rope_parameters`` gives its own. The attention scale is ``query_pre_attn_scalar ** -0.5``
    (default 256).

    Raises:
      UnsupportedConfigError: logit soft-capping, bidirectional attention, an activation other
        than ``gelu_pytorch_tanh``, a RoPE scaling on the sliding layers, or a full-attention one
        other than default and linear (each named).
      ValueError: ``query_pre_attn_scalar`` or a RoPE base is not a number > 0, or
        ``rope_parameters`` does not map the layer types.
    """
    cfg = dict(cfg)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        value = cfg.pop(key, None)
        if value is not None:
            raise UnsupportedConfigError(f"config.json {key!r} = {value!r} is not supported on a gemma3_text model "
                                         "(Gemma 3 has no logit soft-capping: null; Gemma 2's is model_type gemma2)")
    if cfg.pop("use_bidirectional_attention", False):
        raise UnsupportedConfigError("config.json 'use_bidirectional_attention' = true is not supported "
                                     "(a causal decoder only)")
    act = cfg.pop("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedConfigError(f"config.json 'hidden_activation' = {act!r} is not supported "
                                     "(only 'gelu_pytorch_tanh', Gemma 3's)")
    if "hidden_act" in cfg:  # transformers' Gemma3 reads hidden_activation only
        raise UnsupportedConfigError("config.json 'hidden_act' on a gemma3_text model is not supported "
                                     "(transformers ignores it there and uses 'hidden_activation')")

    def number(value, what):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"config.json {what} must be a finite number > 0, got {value!r}")
        return float(value)

    scalar = number(cfg.pop("query_pre_attn_scalar", 256), "'query_pre_attn_scalar'")
    params = cfg.pop("rope_parameters", None)
    if params is None:
        params = {}
    if not isinstance(params, Mapping) or not set(params) <= {"full_attention", "sliding_attention"} or any(
            v is not None and not isinstance(v, Mapping) for v in params.values()):
        raise ValueError("config.json 'rope_parameters' of a gemma3_text model must map 'full_attention' and "
                         f"'sliding_attention' to their RoPE parameters, got {params!r}")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    legacy = cfg.pop("rope_scaling", None)
    if legacy is not None:
        if not isinstance(legacy, Mapping):
            raise UnsupportedConfigError(f"config.json 'rope_scaling' must be an object, got {legacy!r}")

        def scaling(d):
            return {("rope_type" if k == "type" else k): v for k, v in d.items() if k != "rope_theta"}

        if params.get("full_attention") is not None and scaling(legacy) != scaling(full):
            raise UnsupportedConfigError(
                f"config.json 'rope_scaling' ({dict(legacy)!r}) and 'rope_parameters.full_attention' ({full!r}) "
                "describe different RoPE scalings; keep one")
        full.update(legacy)
    # a base given twice must agree (as the other types' rope_theta and rope_parameters.rope_theta)
    for nested, key, default in ((full, "rope_theta", 1_000_000.0), (local, "rope_local_base_freq", 10_000.0)):
        flat = cfg.pop(key, None)
        if flat is not None and nested.get("rope_theta") is not None and flat != nested["rope_theta"]:
            raise ValueError(f"config.json gives different RoPE bases: {key} = {flat!r}, rope_parameters."
                             f"{'full' if nested is full else 'sliding'}_attention.rope_theta = "
                             f"{nested['rope_theta']!r}; keep one")
        nested.setdefault("rope_theta", default if flat is None else flat)
    kind = full.get("rope_type") or full.get("type") or "default"
    if kind not in ("default", "linear"):
        raise UnsupportedConfigError(f"config.json RoPE type {kind!r} of the full-attention layers of a gemma3_text "
                                     "model is not supported ('default' and 'linear', Gemma 3's)")
    if (local.get("rope_type") or local.get("type") or "default") != "default" or set(local) - {
            "rope_type", "type", "rope_theta"}:
        raise UnsupportedConfigError(f"config.json RoPE of the sliding-window layers {local!r} is not supported "
                                     "(only the default RoPE with its base)")
    cfg["rope_parameters"] = full
    fields = dict(hidden_act="gelu_tanh", sandwich_norms=True, query_scale=scalar ** -0.5,
                  local_rope_theta=number(local["rope_theta"], "sliding-window RoPE base"))
    return cfg, fields


def _check_gemma2(cfg: Mapping) -> tuple[dict, dict]:
    """``(cfg, fields)`` of a Gemma 2 config (transformers' ``Gemma2Config``): ``cfg`` without Gemma's own
    fields, and the :class:`LlamaConfig` fields only Gemma sets (activation, sandwich norms, query
    scale, attention and final logit soft-capping; ``from_hf_config`` adds the embedding scale
    ``sqrt(hidden_size)``). Its RoPE is read as the other types' (one base for every layer, default
    10000).

    As transformers 5 reads it: ``attn_logit_softcapping`` (default 50) caps every attention logit,
    ``final_logit_softcapping`` (default 30) the output logits (null: none); the attention scale is
    ``query_pre_attn_scalar ** -0.5`` (default 256); the MLP's activation is ``hidden_activation``
    (``Gemma2MLP`` reads no other field: a ``hidden_act`` that names another one is refused).

    Raises:
      UnsupportedConfigError: bidirectional attention, or an activation other than
        ``gelu_pytorch_tanh`` (named).
      ValueError: ``query_pre_attn_scalar`` that is not a number > 0, or a soft-capping value outside
        :data:`~magicpig_jax.attention._common.SOFTCAP_RANGE` (named).
    """
    cfg = dict(cfg)
    if cfg.pop("use_bidirectional_attention", False):
        raise UnsupportedConfigError("config.json 'use_bidirectional_attention' = true is not supported "
                                     "(a causal decoder only)")
    for key in ("hidden_activation", "hidden_act"):
        act = cfg.pop(key, "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise UnsupportedConfigError(f"config.json {key!r} = {act!r} is not supported on a gemma2 model "
                                         "(only 'gelu_pytorch_tanh', Gemma 2's)")

    def number(key, default):
        value = cfg.pop(key, default)
        if value is None and key != "query_pre_attn_scalar":
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"config.json {key!r} must be a finite number > 0"
                             f"{'' if key == 'query_pre_attn_scalar' else ' or null'}, got {value!r}")
        if key != "query_pre_attn_scalar":
            check_softcap(value, f"config.json {key!r}")
        return float(value)

    fields = dict(hidden_act="gelu_tanh", sandwich_norms=True,
                  query_scale=number("query_pre_attn_scalar", 256) ** -0.5,
                  attn_logit_softcap=number("attn_logit_softcapping", 50.0),
                  final_logit_softcap=number("final_logit_softcapping", 30.0))
    cfg.pop("cache_implementation", None)
    # Gemma-2-9B's and -27B's config.json repeat the window as 'sliding_window_size' (transformers reads
    # 'sliding_window' only): accepted when the two agree
    size = cfg.pop("sliding_window_size", None)
    window = cfg.get("sliding_window", _HF_DEFAULTS["gemma2"]["sliding_window"])
    if size is not None and size != window:
        raise UnsupportedConfigError(f"config.json 'sliding_window_size' = {size!r} differs from 'sliding_window' = "
                                     f"{window!r}: not supported (transformers reads 'sliding_window' only)")
    return cfg, fields


def _check_phi3(cfg: Mapping) -> dict:
    """``cfg`` with Phi-3's RoPE type names as transformers reads them, Phi-4-mini's remote-code
    fields checked and dropped, or a refusal.

    transformers' ``Phi3Config`` renames the RoPE types "su" and "yarn" to "longrope" (LongRoPE,
    not YaRN) and accepts only "default" and "longrope"; its ``original_max_position_embeddings``
    (default 4096) is the pretrained context LongRoPE switches at.

    Raises:
      UnsupportedConfigError: a RoPE type other than default and longrope, or a remote-code field
        at another value than its neutral one (named).
      ValueError: ``original_max_position_embeddings`` is not a positive integer within int32.
    """
    cfg = dict(cfg)
    # Phi-4-mini's config.json fields for its remote modeling code; transformers' Phi3 reads none of
    # them, which is right only at these values (full attention in every layer, no extra
    # interpolation, no output bias)
    for key, neutral in (("full_attn_mod", 1), ("interpolate_factor", 1), ("lm_head_bias", False)):
        value = cfg.pop(key, neutral)
        if isinstance(value, bool) is not isinstance(neutral, bool) or value != neutral:
            raise UnsupportedConfigError(f"config.json {key!r} = {value!r} is not supported "
                                         f"(only {neutral!r}, which transformers' Phi3 computes)")
    for key in ("rope_scaling", "rope_parameters"):
        form = cfg.get(key)
        if isinstance(form, Mapping):
            kind = form.get("rope_type") or form.get("type") or "default"
            if kind in ("su", "yarn"):
                form = {k: v for k, v in form.items() if k != "type"}
                cfg[key] = form = {**form, "rope_type": "longrope"}
                kind = "longrope"
            if kind not in ("default", "longrope"):
                raise UnsupportedConfigError(
                    f"config.json {key!r} type {kind!r} of a phi3 model is not supported (transformers' Phi3 "
                    "takes 'default' and 'longrope')")
    orig = cfg.get("original_max_position_embeddings", 4096)
    if isinstance(orig, bool) or not isinstance(orig, int) or not 1 <= orig <= MAX_POSITIONS:
        raise ValueError(f"config.json 'original_max_position_embeddings' must be a positive integer at most "
                         f"{MAX_POSITIONS} (int32 positions), got {orig!r}")
    return cfg


def _phi3_partial_rotary(cfg: Mapping) -> tuple[dict, float]:
    """``(cfg without it, the fraction of each head RoPE rotates)`` as transformers' ``Phi3Config``
    reads ``partial_rotary_factor``: from the RoPE dict in use (``rope_scaling``, else
    ``rope_parameters``), else the top level, else 1.

    Raises:
      ValueError: a fraction that is not a number in (0, 1].
    """
    cfg = dict(cfg)
    fraction = cfg.pop("partial_rotary_factor", 1.0)
    used = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters" if cfg.get("rope_parameters") else None
    if used is not None and isinstance(cfg[used], Mapping):
        fraction = cfg[used].get("partial_rotary_factor", fraction)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), Mapping):
            cfg[key] = {k: v for k, v in cfg[key].items() if k != "partial_rotary_factor"}
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"config.json 'partial_rotary_factor' must be a number in (0, 1], got {fraction!r}")
    return cfg, float(fraction)


def _complete_longrope(scaling: tuple | None, cfg: Mapping, model_type: str, max_positions: int) -> tuple | None:
    """A LongRoPE scaling's pretrained context as transformers sets it (``standardize_rope_params``):
    a top-level ``original_max_position_embeddings`` wins (``Phi3Config`` always has one, 4096 by
    default), else the scaling's own, else ``max_position_embeddings``."""
    s = dict(scaling or {})
    if s.get("rope_type") != "longrope":
        return scaling
    top = cfg.get("original_max_position_embeddings", 4096 if model_type == "phi3" else None)
    if top is not None:
        s["original_max_position_embeddings"] = int(top)
    s.setdefault("original_max_position_embeddings", max_positions)
    return tuple(sorted(s.items()))


def _hf_rope(cfg: Mapping) -> tuple[tuple | None, float | None]:
    """``(normalized RoPE scaling, rope_theta)`` of a config.json, refusing contradictions.

    transformers 4 reads ``rope_theta`` at the top level and the scaling under ``rope_scaling``;
    transformers 5 writes both under ``rope_parameters`` but, when ``rope_scaling`` is present,
    reads that one instead (and takes its ``rope_theta``, else the top-level one). A file may
    carry both forms (saved by one version, edited by hand), so they must agree, and a base that
    only the ignored ``rope_parameters`` gives is refused rather than guessed.

    Raises:
      UnsupportedConfigError: ``rope_scaling`` and ``rope_parameters`` describe different
        scalings, two ``rope_theta`` values differ, or only an ignored ``rope_parameters``
        holds the base (each named).
    """
    forms = {key: cfg[key] for key in ("rope_scaling", "rope_parameters") if cfg.get(key)}
    for key, value in forms.items():
        if not isinstance(value, Mapping):
            raise UnsupportedConfigError(f"config.json {key!r} must be an object, got {value!r}")
    normalized = {key: normalize_rope_scaling(value) for key, value in forms.items()}
    if len(set(normalized.values())) > 1:
        raise UnsupportedConfigError(
            "config.json 'rope_scaling' and 'rope_parameters' describe different RoPE scalings "
            f"({forms['rope_scaling']!r} and {forms['rope_parameters']!r}); transformers reads 'rope_scaling' "
            "when both are present: keep one")
    thetas = {key: float(value) for key, value in [("rope_theta", cfg.get("rope_theta"))]
              + [(f"{k}.rope_theta", v.get("rope_theta")) for k, v in forms.items()] if value is not None}
    if len(set(thetas.values())) > 1:
        shown = ", ".join(f"{k} = {v!r}" for k, v in thetas.items())
        raise UnsupportedConfigError(f"config.json gives different RoPE bases: {shown}; keep one")
    if list(thetas) == ["rope_parameters.rope_theta"] and "rope_scaling" in forms:
        raise UnsupportedConfigError(
            "config.json gives the RoPE base only in 'rope_parameters', which transformers ignores when "
            "'rope_scaling' is present (it then uses its default base): set 'rope_theta'")
    scaling = next(iter(normalized.values()), None)
    return scaling, next(iter(thetas.values()), None)


def first_visible_key(pos, window: int):
    """``max(pos - window + 1, 0)``: the first key position a query at ``pos`` sees through a sliding
    window of ``window`` positions, its own included (transformers' ``sliding_window_overlay``)."""
    return jnp.maximum(pos - (window - 1), 0)


def _hf_nope_layers(cfg: Mapping, model_type: str, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: the zeros of ``no_rope_layers`` (one 0/1 per layer, at least
    ``num_layers`` of them, as transformers indexes it), else every ``no_rope_layer_interval``-th
    layer (transformers' default: layers 3, 7, 11, ...). Other model types have none."""
    if model_type != "smollm3":
        given = [k for k in ("no_rope_layers", "no_rope_layer_interval") if k in cfg]
        if given:  # transformers reads them for SmolLM3 only: on another type, what was meant is unclear
            raise UnsupportedConfigError(f"config.json {', '.join(map(repr, given))} on a {model_type} model "
                                         "is not supported (NoPE layers are SmolLM3's)")
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", _HF_DEFAULTS["smollm3"]["no_rope_layer_interval"])
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config.json 'no_rope_layer_interval' must be a positive integer, got {interval!r}")
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) < num_layers or any(
            isinstance(f, bool) or f not in (0, 1) for f in flags):
        raise ValueError(f"config.json 'no_rope_layers' must be a list of at least {num_layers} values 0 or 1 "
                         f"(1: the layer uses RoPE), got {flags!r}")
    return tuple(i for i in range(num_layers) if flags[i] == 0)


def _hf_sliding_window(cfg: Mapping, model_type: str, num_layers: int,
                       nope: tuple[int, ...] = ()) -> tuple[int | None, tuple[int, ...] | None]:
    """``(W, layers)``: the attention window and the layers it applies to (None: every layer),
    or ``(None, None)`` when every layer attends to all positions.

    Mistral and Phi-3 apply ``sliding_window`` to every layer when it is set (Mistral:
    transformers' default 4096 when the field is absent; Phi-3: none; a ``layer_types`` with
    full-attention layers is refused: ``MistralForCausalLM`` and ``Phi3ForCausalLM`` ignore it).
    Qwen2/Qwen3 apply it only with ``use_sliding_window``, to the layers marked
    ``sliding_attention`` in ``layer_types`` (default: layers from ``max_window_layers`` on), as
    transformers 5's configs do. SmolLM3 likewise, its default ``layer_types`` windowing the NoPE
    layers (``nope``).
    """
    defaults = _HF_DEFAULTS[model_type]
    window = cfg.get("sliding_window", defaults.get("sliding_window"))
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ValueError(f"config.json 'layer_types' must be a list, got {layer_types!r}")
        bad = sorted({str(t) for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if bad:
            raise UnsupportedConfigError(f"config.json 'layer_types' has unsupported type(s) {bad}")
        if len(layer_types) != num_layers:
            raise ValueError(f"config.json 'layer_types' has {len(layer_types)} entries for {num_layers} layers")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 1 <= window <= MAX_POSITIONS):
        raise ValueError(f"config.json 'sliding_window' must be a positive integer (at most {MAX_POSITIONS}, "
                         f"int32 positions) or null, got {window!r}")
    if model_type in ("gemma2", "gemma3_text"):
        if layer_types is None:  # transformers: every sliding_window_pattern-th layer is full (Gemma 3: 6,
            # Gemma 2: every other layer, the first one sliding)
            pattern = cfg.get("sliding_window_pattern", 6) if model_type == "gemma3_text" else 2
            if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
                raise ValueError(f"config.json 'sliding_window_pattern' must be a positive integer, got {pattern!r}")
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        if layers and window is None:
            raise UnsupportedConfigError("config.json 'sliding_window' is null while 'layer_types' has "
                                         "'sliding_attention' layers: not supported")
        return (window, layers) if layers else (None, None)
    if model_type in ("llama",):
        if window is not None or (layer_types and "sliding_attention" in layer_types):
            raise UnsupportedConfigError("config.json 'sliding_window' on a llama model is not supported")
        return None, None
    if model_type in ("mistral", "phi3"):
        if layer_types is not None and "full_attention" in layer_types:
            # transformers' MistralForCausalLM ignores layer_types (a warning): every layer slides;
            # its Ministral classes alternate. Which one the checkpoint means is not ours to guess.
            raise UnsupportedConfigError(
                f"config.json 'layer_types' with 'full_attention' layers on a {model_type} model is not supported "
                "(transformers ignores it there and windows every layer)")
        return (None, None) if window is None else (window, None)
    use = cfg.get("use_sliding_window", False)
    if use is not None and not isinstance(use, bool):  # "false" would read as true
        raise ValueError(f"config.json 'use_sliding_window' must be true or false, got {use!r}")
    if (not cfg.get("use_sliding_window", False) or window is None) and layer_types \
            and "sliding_attention" in layer_types:
        # Qwen: transformers 5.24 raises (no window for a sliding layer's mask); SmolLM3 masks such
        # layers by the window while its attention module reads use_sliding_window. Refused.
        raise UnsupportedConfigError("config.json 'layer_types' has 'sliding_attention' layers while "
                                     "'use_sliding_window' is false or 'sliding_window' is null: not supported")
    if not cfg.get("use_sliding_window", False) or window is None:
        # transformers' Qwen configs set no window when 'sliding_window' is null, even with
        # 'use_sliding_window': every layer attends to every position.
        return None, None
    if layer_types is None and model_type == "smollm3":
        layer_types = ["sliding_attention" if i in nope else "full_attention" for i in range(num_layers)]
    elif layer_types is None:
        start = cfg.get("max_window_layers", defaults["max_window_layers"])
        if isinstance(start, bool) or not isinstance(start, int):  # transformers compares i >= max_window_layers
            raise ValueError(f"config.json 'max_window_layers' must be an integer, got {start!r}")
        layer_types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    return (window, layers) if layers else (None, None)


def default_dense_layers(num_layers: int) -> tuple[int, ...]:
    """Layers kept dense under MagicPIG by default: the first and the middle one.

    The reference keeps layers {0, 16} of 32-layer Llamas dense (arXiv
    2410.16179, Section 5); scaled to ``num_layers`` this is ``{0, num_layers // 2}``
    ({0, 15} for SmolLM2's 30 layers).
    """
    return tuple(sorted({0, num_layers // 2}))
