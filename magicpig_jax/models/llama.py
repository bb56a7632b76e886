"""Flax NNX Llama decoder blocks: RMSNorm, RoPE, GQA projections, SwiGLU.

The attention itself is pluggable: :meth:`Llama.forward` takes a ``write_kv``
and an ``attend`` callable, so the same module runs chunked dense prefill and
any decode backend (see :mod:`magicpig_jax.models.decoding`).

Shapes: B batch, T tokens in the call, Hq query heads, Hkv KV heads, D head dim,
H hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from magicpig_jax.models import linear as linear_settings
from magicpig_jax.models.config import LlamaConfig
from magicpig_jax.models.dequant import dequantize
from magicpig_jax.models.linear import Linear, PackedWeight, dense_matmul, make_packed, packed_matmul
from magicpig_jax.models.rope import rope_attention_factor, rope_inv_freq

__all__ = ["Llama", "RopeFrequencies", "apply_rope", "rope_frequencies", "rope_tables"]


class RopeFrequencies(nnx.Variable):
    """Non-trainable inverse RoPE frequencies ``[D/2]``."""


def apply_rope(
    x: Float[Array, "B T Hx D"], positions: Int[Array, "B T"], inv_freq: Float[Array, " R2"],
    scale: float = 1.0,
) -> Float[Array, "B T Hx D"]:
    """Rotary position embedding in the Hugging Face (rotate-half) layout, of queries (``Hx = Hq``)
    or keys (``Hx = Hkv``) ``[B, T, Hx, D]`` at int ``positions [B, T]``, in ``x``'s dtype.

    ``x * cos + rotate_half(x) * sin`` with angles ``positions * inv_freq`` (Su et al.,
    RoFormer; matches transformers' ``apply_rotary_pos_emb``). ``scale`` multiplies cos and
    sin, as transformers' ``attention_scaling`` does: YaRN's attention factor
    (:func:`magicpig_jax.models.rope.rope_attention_factor`), 1 otherwise. With fewer
    frequencies than ``D / 2`` (partial RoPE, ``inv_freq`` ``[R/2]``) the leading R dimensions
    are rotated and the rest pass through, as transformers' Phi3 does.
    """
    rotated_dims = 2 * inv_freq.shape[-1]
    if rotated_dims < x.shape[-1]:
        head = apply_rope(x[..., :rotated_dims], positions, inv_freq, scale)
        return jnp.concatenate([head, x[..., rotated_dims:]], axis=-1)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def rope_frequencies(config: LlamaConfig, short: Float[Array, " D2"], long: Float[Array, " D2"] | None,
                     positions: Int[Array, "B T"], lengths: Int[Array, " B"] | None = None):
    """The inverse RoPE frequencies each token rotates by: ``short`` ``[D/2]`` for every token, but
    under LongRoPE ``[B, T, D/2]``: ``long`` where ``max(position, length - 1) >= switch``
    (:attr:`LlamaConfig.longrope_switch`), else ``short``.

    ``lengths`` are the rows' lengths of a prefill (its prompt), None in a decode step: as
    transformers (``longrope_frequency_update``) picks the factors of a forward call by its
    longest position, a prompt longer than the pretrained context is rotated with the long
    factors throughout, a shorter one with the short ones, and each decode step by its own
    position, so a cached key keeps the factors of the call that wrote it (one sequence per
    call; transformers takes the longest row of a padded batch for every row).
    """
    switch = config.longrope_switch
    if switch is None or long is None:
        return short
    reach = positions if lengths is None else jnp.maximum(positions, lengths[:, None] - 1)
    return jnp.where((reach >= switch)[..., None], long, short)


def rope_tables(config: LlamaConfig, short: Float[Array, " D2"], long: Float[Array, " D2"] | None,
                local: Float[Array, " D2"] | None, positions: Int[Array, "B T"],
                lengths: Int[Array, " B"] | None = None) -> tuple[jax.Array, jax.Array | None]:
    """``(global, local)``: the frequencies of the layers with the model's RoPE
    (:func:`rope_frequencies` of ``short``/``long``: float32 ``[D/2]``, or ``[B, T, D/2]`` under
    LongRoPE) and of its sliding-window layers with their own base (Gemma 3's ``local`` float32
    ``[D/2]``, else None). Each layer picks one (:meth:`Attention.qkv`), as transformers'
    ``Gemma3RotaryEmbedding`` keeps a table per layer type."""
    return rope_frequencies(config, short, long, positions, lengths), local


class RMSNorm(nnx.Module):
    """RMSNorm in float32: ``x / sqrt(mean(x^2) + eps) * weight`` (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... H"]) -> Float[Array, "... H"]:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def _linear(din: int, dout: int, rngs: nnx.Rngs, dtype) -> Linear:
    return Linear(din, dout, rngs=rngs, dtype=dtype)


class Attention(nnx.Module):
    """GQA projections of one layer; the attention itself is supplied by the caller.

    Optional parts, per :class:`LlamaConfig`: biases of q/k/v (``qkv_bias``, Qwen2) and of
    the output projection (``o_bias``), per-head RMSNorm of q and k before RoPE
    (``qk_norm``, Qwen3 and Gemma 3: ``q_norm``/``k_norm`` with weights ``[D]``), the local RoPE
    base on a sliding-window layer (Gemma 3) and a query scale other than ``1 / sqrt(D)``
    (Gemma's ``query_pre_attn_scalar``: q is multiplied by ``query_scale * sqrt(D)`` after RoPE, so
    that every attention backend's ``1 / sqrt(D)`` gives the model's scale; SimHash codes, which
    depend on q's direction only, are unchanged).
    """

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs, dtype=jnp.float32, layer: int = 0):
        H, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, D
        self.use_rope = config.layer_uses_rope(layer)  # False on SmolLM3's NoPE layers (static)
        self.local_rope = config.layer_uses_local_rope(layer)  # Gemma 3's sliding layers (static)
        # a Python float (static under jit); 1 on a layer with the local base (unscaled, as llama.cpp's
        # sliding layers rotate with freq_scale 1)
        self.rope_scale = 1.0 if self.local_rope else rope_attention_factor(config)
        # a Python float (static): 1 unless the model's attention scale is not 1 / sqrt(D)
        rescale = 1.0 if config.query_scale is None else float(config.query_scale * np.sqrt(D))
        self.q_rescale = 1.0 if abs(rescale - 1.0) < 1e-12 else rescale  # 1/sqrt(D) given explicitly
        self.q_proj = _linear(H, config.num_heads * D, rngs, dtype)
        self.k_proj = _linear(H, config.num_kv_heads * D, rngs, dtype)
        self.v_proj = _linear(H, config.num_kv_heads * D, rngs, dtype)
        self.o_proj = _linear(config.num_heads * D, H, rngs, dtype)
        if config.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((config.num_heads * D,), dtype))
            self.k_bias = nnx.Param(jnp.zeros((config.num_kv_heads * D,), dtype))
            self.v_bias = nnx.Param(jnp.zeros((config.num_kv_heads * D,), dtype))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = nnx.Param(jnp.zeros((H,), dtype)) if config.o_bias else None
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(D, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_packed: PackedWeight | None = nnx.data(None)  # q, k, v rows stacked (one product)
        self.qkv_qtype: str | None = None

    def set_qkv_packed(self, blocks, qtype: str) -> None:
        """Hold q, k and v as one matrix of GGUF rows ``[(Hq + 2 Hkv) D, RB]`` (q rows, then k, then v).

        One product then replaces three (one pass over the activations instead of three);
        ``q_proj``/``k_proj``/``v_proj`` hold nothing from now on.

        Raises:
          ValueError, TypeError: as :func:`magicpig_jax.models.linear.make_packed`.
        """
        out = self.q_proj.out_features + self.k_proj.out_features + self.v_proj.out_features
        self.qkv_packed = nnx.data(make_packed(blocks, qtype, out, self.q_proj.in_features))
        self.qkv_qtype = qtype
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            proj.set_packed(None, None)

    def qkv(self, x: Float[Array, "B T H"], positions: Int[Array, "B T"], inv_freq):
        """Return q ``[B, T, Hq, D]`` and k, v ``[B, T, Hkv, D]``, RoPE applied to q and k (not on a NoPE layer).

        ``inv_freq``: the frequencies, or :func:`rope_tables`' ``(global, local)`` pair, of which the
        layer takes its own.
        """
        if isinstance(inv_freq, tuple):
            inv_freq = inv_freq[1] if self.local_rope else inv_freq[0]
        B, T, _ = x.shape
        if self.qkv_packed is not None:
            nq, nk = self.q_proj.out_features, self.k_proj.out_features
            y = packed_matmul(x, self.qkv_packed[...], self.qkv_qtype)
            q, k, v = y[..., :nq], y[..., nq:nq + nk], y[..., nq + nk:]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_bias is not None:
            q = q + self.q_bias[...].astype(q.dtype)
            k = k + self.k_bias[...].astype(k.dtype)
            v = v + self.v_bias[...].astype(v.dtype)
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q = apply_rope(q, positions, inv_freq, self.rope_scale)
            k = apply_rope(k, positions, inv_freq, self.rope_scale)
        if self.q_rescale != 1.0:
            q = (q * self.q_rescale).astype(q.dtype)
        return q, k, v

    def output(self, o: Float[Array, "B T HqD"]) -> Float[Array, "B T H"]:
        """The output projection of the attention result (``o_proj``, plus its bias if any)."""
        y = self.o_proj(o)
        return y if self.o_bias is None else y + self.o_bias[...].astype(y.dtype)


class MLP(nnx.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``, ``act`` SiLU (SwiGLU, Llama) or GELU's tanh
    approximation (GeGLU, Gemma's ``gelu_pytorch_tanh``) per :attr:`LlamaConfig.hidden_act`."""

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gelu = config.hidden_act == "gelu_tanh"
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, rngs, dtype)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, rngs, dtype)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, rngs, dtype)
        self.gate_up_packed: PackedWeight | None = nnx.data(None)  # gate and up rows stacked (one product)
        self.gate_up_qtype: str | None = None

    def set_gate_up_packed(self, blocks, qtype: str) -> None:
        """Hold gate and up as one matrix of GGUF rows ``[2 F, RB]`` (gate rows, then up);
        ``gate_proj``/``up_proj`` hold nothing from now on.

        Raises:
          ValueError, TypeError: as :func:`magicpig_jax.models.linear.make_packed`.
        """
        out = self.gate_proj.out_features + self.up_proj.out_features
        self.gate_up_packed = nnx.data(make_packed(blocks, qtype, out, self.gate_proj.in_features))
        self.gate_up_qtype = qtype
        for proj in (self.gate_proj, self.up_proj):
            proj.set_packed(None, None)

    def __call__(self, x):
        if self.gate_up_packed is not None:
            y = packed_matmul(x, self.gate_up_packed[...], self.gate_up_qtype)
            gate, up = y[..., :self.gate_proj.out_features], y[..., self.gate_proj.out_features:]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nnx.Module):
    """Pre-norm Llama block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    With :attr:`LlamaConfig.sandwich_norms` (Gemma 3), the attention and MLP outputs are normed
    too before each add: ``x + norm(attn(norm(x)))``, ``x + norm(mlp(norm(x)))``.
    ``post_attention_layernorm`` is the norm before the MLP, as Llama names it (Gemma's
    ``pre_feedforward_layernorm``); ``attn_output_norm`` and ``mlp_output_norm`` are Gemma's
    ``post_attention_layernorm`` and ``post_feedforward_layernorm``.
    """

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs, dtype=jnp.float32, layer: int = 0):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, rngs, dtype, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, rngs, dtype)
        if config.sandwich_norms:
            self.attn_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        else:
            self.attn_output_norm = self.mlp_output_norm = None

    def add_attention(self, x: Float[Array, "B T H"], o: Float[Array, "B T HqD"]) -> Float[Array, "B T H"]:
        """The residual stream after the attention: ``x`` plus the output projection of ``o`` (normed
        first with sandwich norms)."""
        y = self.self_attn.output(o.astype(x.dtype))
        return x + (y if self.attn_output_norm is None else self.attn_output_norm(y))

    def add_mlp(self, x: Float[Array, "B T H"]) -> Float[Array, "B T H"]:
        """The residual stream after the MLP: ``x + mlp(norm(x))`` (its output normed with sandwich norms)."""
        y = self.mlp(self.post_attention_layernorm(x))
        return x + (y if self.mlp_output_norm is None else self.mlp_output_norm(y))

    def attention_inputs(self, x: Float[Array, "B T H"], positions: Int[Array, "B T"], inv_freq):
        """q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]`` of the residual stream ``x``:
        ``self_attn.qkv(input_layernorm(x), positions, inv_freq)``, as one jitted call shared by
        every layer of this structure (see ``_block_qkv``)."""
        graphdef, state = nnx.split(self)
        return _block_qkv(graphdef, _trace_settings(), state, x, positions, inv_freq)

    def after_attention(self, x: Float[Array, "B T H"], o: Float[Array, "B T HqD"]) -> Float[Array, "B T H"]:
        """The block's output ``add_mlp(add_attention(x, o))`` for the attention result ``o``, as one
        jitted call shared by every layer of this structure."""
        graphdef, state = nnx.split(self)
        return _block_residual(graphdef, _trace_settings(), state, x, o)


# A model's layers of one structure (the same parameter shapes, GGUF types and static attributes: an
# equal nnx graph definition) share one traced and lowered program for each half of the block: Python
# tracing and MLIR lowering were most of a process's time before its first token, done once per layer
# for every prefill and decode program. XLA inlines the calls, so the compiled program is unchanged.
# The module-level settings that packed_matmul reads while tracing are a static argument too
# (_trace_settings), so that changing one traces again instead of reusing a trace made under the old value.
@partial(jax.jit, static_argnums=(0, 1))
def _block_qkv(graphdef, settings, state, x, positions, inv_freq):
    layer = nnx.merge(graphdef, state)
    return layer.self_attn.qkv(layer.input_layernorm(x), positions, inv_freq)


@partial(jax.jit, static_argnums=(0, 1))
def _block_residual(graphdef, settings, state, x, o):
    layer = nnx.merge(graphdef, state)
    return layer.add_mlp(layer.add_attention(x, o))


def _trace_settings() -> tuple:
    """What the blocks' tracing reads besides their arguments: :mod:`magicpig_jax.models.linear`'s
    ``MATVEC_MAX_TOKENS``, ``PREFILL_MODE``, ``PREFILL_TILE_BYTES`` and whether the host op is built."""
    return (linear_settings.MATVEC_MAX_TOKENS, linear_settings.PREFILL_MODE, linear_settings.PREFILL_TILE_BYTES,
            linear_settings._host_available())


AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]
WriteFn = Callable[[int, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


class Llama(nnx.Module):
    """A Llama-family decoder (Flax NNX): embeddings, ``num_layers`` blocks, final norm, LM head.

    Supports GQA, tied or untied output embeddings, RoPE with "linear" or Llama 3.1
    "llama3" scaling (or llama.cpp ``rope_freqs`` factors), attention biases (Qwen2),
    per-head q/k RMSNorm (Qwen3), and Gemma 3's sandwich norms, GeGLU, embedding and query
    scales and local RoPE base.

    Args:
      config: the :class:`LlamaConfig`.
      rngs: parameter initialisation (real weights are loaded over it).
      dtype: parameter dtype (float32 default).
      freq_factors: optional llama.cpp RoPE frequency factors ``[D/2]``.

    Source: Touvron et al. 2023 (Llama), Dubey et al. 2024 (Llama 3 RoPE scaling);
    numerics match transformers' ``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and ``Gemma3ForCausalLM``, sliding-window layers included
    (:meth:`LlamaConfig.layer_window`).
    """

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs, dtype=jnp.float32,
                 freq_factors: np.ndarray | None = None):
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, rngs, dtype, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else _linear(
            config.hidden_size, config.vocab_size, rngs, dtype)
        self.inv_freq = RopeFrequencies(jnp.asarray(rope_inv_freq(config, freq_factors)))
        # LongRoPE's long factors (None otherwise): rope_frequencies picks them per token
        self.inv_freq_long = RopeFrequencies(jnp.asarray(rope_inv_freq(config, freq_factors, long=True))) \
            if config.longrope_switch is not None else nnx.data(None)
        # Gemma 3's sliding-window layers: their own RoPE base (None otherwise)
        self.inv_freq_local = RopeFrequencies(jnp.asarray(rope_inv_freq(config, local=True))) \
            if config.local_rope_theta is not None else nnx.data(None)
        # The embedding table as GGUF rows [V, RB] (then embed_tokens is None); also the
        # output projection when it is tied.
        self.embed_packed: PackedWeight | None = nnx.data(None)
        self.embed_qtype: str | None = None

    def set_embedding_packed(self, blocks, qtype: str) -> None:
        """Hold the embedding table ``[V, H]`` as its GGUF rows (``embed_tokens`` is dropped).

        Tokens gather their rows and dequantize them (:func:`magicpig_jax.models.dequant.dequantize`);
        a tied output projection reads the same rows (:func:`magicpig_jax.models.linear.packed_matmul`).

        Raises:
          ValueError: the rows' shape or ``qtype`` is wrong.
          TypeError: ``blocks`` is not uint8.
        """
        self.embed_packed = nnx.data(make_packed(blocks, qtype, self.config.vocab_size, self.config.hidden_size))
        self.embed_qtype = qtype
        self.embed_tokens = nnx.data(None)

    @property
    def tied_packed(self) -> PackedWeight | None:
        """The GGUF rows of the tied output projection (the embedding's), or None."""
        return self.embed_packed if self.lm_head is None else None

    @property
    def tied_qtype(self) -> str | None:
        """The GGUF type of :attr:`tied_packed`, or None."""
        return self.embed_qtype if self.lm_head is None else None

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T H"]:
        """Embeddings of ``tokens`` (gathered rows of the table, dequantized if held as GGUF rows), times
        :attr:`LlamaConfig.embedding_scale` if set (Gemma: ``sqrt(H)`` in the embeddings' dtype, as
        transformers' ``Gemma3TextScaledWordEmbedding``)."""
        if self.embed_packed is not None:
            x = dequantize(jnp.take(self.embed_packed[...], tokens, axis=0), self.embed_qtype)
        else:
            x = self.embed_tokens(tokens)
        scale = self.config.embedding_scale
        return x if scale is None else x * jnp.asarray(scale, x.dtype)

    def rope(self, positions: Int[Array, "B T"], lengths: Int[Array, " B"] | None = None):
        """:func:`rope_tables` of this model's frequencies for ``positions`` (``lengths``: a prefill's)."""
        long = None if self.inv_freq_long is None else self.inv_freq_long[...]
        local = None if self.inv_freq_local is None else self.inv_freq_local[...]
        return rope_tables(self.config, self.inv_freq[...], long, local, positions, lengths)

    def forward(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        write_kv: WriteFn,
        attend: AttendFn,
        lengths: Int[Array, " B"] | None = None,
    ) -> Float[Array, "B T H"]:
        """Run every block; return the final-normed hidden states ``[B, T, H]``.

        ``lengths``: the rows' prompt lengths in a prefill (None in a decode step); only LongRoPE
        reads them (:func:`rope_frequencies`).

        For each layer ``i``: ``k_cache, v_cache = write_kv(i, k, v)`` stores the
        new keys/values (``[B, T, Hkv, D]``) and returns the layer's cache, then
        ``attend(i, q, k_cache, v_cache)`` returns the attention output
        ``[B, T, Hq, D]`` for the queries ``q`` ``[B, T, Hq, D]``.
        """
        x = self.embed(tokens)
        inv_freq = self.rope(positions, lengths)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attention_inputs(x, positions, inv_freq)
            k_cache, v_cache = write_kv(i, k, v)
            o = attend(i, q, k_cache, v_cache)
            B, T = o.shape[:2]
            x = layer.after_attention(x, o.reshape(B, T, -1))
        return self.norm(x)

    def logits(self, h: Float[Array, "... H"]) -> Float[Array, "... V"]:
        """Next-token logits (float32) from final hidden states, soft-capped to ``c * tanh(x / c)`` with
        ``config.final_logit_softcap`` c (Gemma 2's ``final_logit_softcapping``, as transformers)."""
        if self.lm_head is None:
            if self.embed_packed is not None:
                logits = packed_matmul(h.astype(jnp.float32), self.embed_packed[...], self.embed_qtype)
            else:
                logits = dense_matmul(h.astype(jnp.float32), self.embed_tokens.embedding[...].astype(jnp.float32),
                                      transposed=False)
        else:
            logits = self.lm_head(h).astype(jnp.float32)
        cap = self.config.final_logit_softcap
        return logits if cap is None else jnp.float32(cap) * jnp.tanh(logits / jnp.float32(cap))
