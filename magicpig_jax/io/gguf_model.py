"""Read a Llama-family GGUF file with ``gguf``: config, dequantized weights, tokenizer metadata.

Architectures (``general.architecture``): ``llama`` (Llama 1/2/3.x, Mistral, TinyLlama,
SmolLM...), ``qwen2`` (Qwen2/2.5: q/k/v biases), ``qwen3`` (per-head q/k RMSNorm) and
``smollm3`` (Llama's tensors; every 4th layer without RoPE, llama.cpp's fixed
``n_no_rope_layer_step``) and ``phi3`` (q/k/v fused in ``attn_qkv``, gate/up in ``ffn_up``:
split here by rows; NEOX RoPE; LongRoPE from ``rope_factors_short/long``; partial RoPE from
``rope.dimension_count``) and ``gemma3`` (Gemma 3 text: sandwich norms ``post_attention_norm`` /
``post_ffw_norm``, GeGLU, q/k norms; as llama.cpp hard-codes it, every 6th layer attends to every
position and the others through ``attention.sliding_window`` with the local RoPE base
``rope.freq_base_swa`` (10000 without it) unscaled, embeddings times sqrt(hidden), and the query
scale 1/sqrt(head dim) but for the 62-layer 27B's 1/sqrt(hidden // heads); the converter stores
the norms' ``1 + w``) and ``gemma2`` (Gemma 2: gemma3's layout without q/k norms, every other layer
sliding from the first, ``attn_logit_softcapping`` and ``final_logit_softcapping``, the 27B's query
scale at 46 layers). llama.cpp's converter
permutes the q/k rows of ``llama`` and ``smollm3`` models for its pairwise RoPE (undone here);
``qwen2``/``qwen3``/``phi3`` use NEOX-style RoPE and are stored unpermuted.

Every ``<arch>.*`` metadata key and every tensor is either used or an error naming it
(a key this reader does not know may change the computation); a missing required key
is an error naming the key (:class:`GGUFMetadataError`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import MutableMapping
from pathlib import Path

import numpy as np

from magicpig_jax.io import gguf_tokenizer
from magicpig_jax.io.gguf_blocks import QUANT_TYPES
from magicpig_jax.models.config import MAX_POSITIONS, SOFTCAP_RANGE, LlamaConfig, UnsupportedConfigError
from magicpig_jax.models.rope import normalize_rope_scaling, yarn_context_length

__all__ = ["read_gguf", "SUPPORTED_ARCHITECTURES", "unpermute_rope_rows", "packed_key", "split_packed_key",
           "GGUFWeights", "GGUFMetadataError"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3")
# architectures whose q/k rows llama.cpp's converter permutes (LlamaModel.permute; SmolLM3Model is one)
_PERMUTED_ARCHITECTURES = ("llama", "smollm3")
# llama.cpp's smollm3 skips RoPE where (layer + 1) % 4 == 0 (a constant there, no metadata key)
_SMOLLM3_NOPE_STEP = 4
# llama.cpp's gemma3 (constants there, no metadata key): every 6th layer full attention, the others
# sliding with no scaling and this RoPE base unless rope.freq_base_swa gives one (its converter writes
# it); the query scale 1/sqrt(hidden // heads) at 62 layers (27B)
_GEMMA3_FULL_EVERY, _GEMMA3_LOCAL_BASE, _GEMMA3_27B_LAYERS = 6, 10000.0, 62
# llama.cpp's gemma2: every other layer sliding (the first one), a window of 4096 and soft-capping of
# the attention logits at 50 and of the output logits at 30 unless the file gives them; the query
# scale 1/sqrt(hidden // heads) at 46 layers (27B)
_GEMMA2_WINDOW, _GEMMA2_ATTN_SOFTCAP, _GEMMA2_FINAL_SOFTCAP, _GEMMA2_27B_LAYERS = 4096, 50.0, 30.0, 46


class GGUFMetadataError(ValueError):
    """A GGUF file lacks a required metadata key or holds a malformed one (the message names it)."""


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BIAS_NAMES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
}
_QK_NORM_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# per-layer tensors each architecture may hold (llama.cpp's llama loads optional q/k/v/o biases)
_ARCH_LAYER_NAMES = {
    "llama": {**_LAYER_NAMES, **_BIAS_NAMES},
    # llama.cpp's qwen2 has q/k/v biases but no output bias (nor has transformers' Qwen2)
    "qwen2": {**_LAYER_NAMES, **{k: v for k, v in _BIAS_NAMES.items() if k != "attn_output.bias"}},
    "qwen3": {**_LAYER_NAMES, **_QK_NORM_NAMES},
    "smollm3": dict(_LAYER_NAMES),
    # fused: q/k/v rows in attn_qkv, gate then up rows in ffn_up (llama.cpp's swiglu splits it so)
    "phi3": {**{k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                                    "ffn_gate.weight", "ffn_up.weight")},
             "attn_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
             "ffn_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")},
    # ffn_norm is the pre-MLP norm; the sandwich norms normalise the attention's and the MLP's outputs
    "gemma2": {**_LAYER_NAMES, "post_attention_norm.weight": "attn_output_norm.weight",
               "post_ffw_norm.weight": "mlp_output_norm.weight"},
    "gemma3": {**_LAYER_NAMES, **_QK_NORM_NAMES, "post_attention_norm.weight": "attn_output_norm.weight",
               "post_ffw_norm.weight": "mlp_output_norm.weight"},
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# ``<arch>.`` keys read below; anything else under the architecture's prefix is refused.
_ARCH_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.sliding_window",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "rope.scale_linear",
    "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_attn_factor", "rope.scaling.attn_factor",
    "expert_count", "expert_used_count", "tensor_data_layout",
}
# keys read for one architecture only (refused as unknown elsewhere): gemma3's sliding layers' RoPE base
_ARCH_ONLY_KEYS = {"gemma3": {"rope.freq_base_swa"},
                   "gemma2": {"attn_logit_softcapping", "final_logit_softcapping"}}
# tokenizer keys Tokenizer.from_gguf_metadata reads, or that do not change the token ids
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.seperator_token_id", "tokenizer.ggml.mask_token_id",
    "tokenizer.ggml.cls_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_sep_token", "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.remove_extra_whitespaces",
    "tokenizer.ggml.prefix_token_id", "tokenizer.ggml.suffix_token_id", "tokenizer.ggml.middle_token_id",
    "tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.fim_mid_token_id",
    "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id", "tokenizer.ggml.fim_sep_token_id",
    "tokenizer.chat_template", "tokenizer.chat_templates", "tokenizer.huggingface.json",
}

# The JSON-like type each key read here must have (llama.cpp checks a key's GGUF type the same way):
# int() of 4.7 heads or bool() of the string "false" would load a different model, silently.
_INT, _NUMBER, _BOOL, _STR = "an integer", "a number", "a bool", "a string"
_ARCH_KEY_KINDS = {
    **dict.fromkeys(("context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
                     "attention.head_count", "attention.head_count_kv", "attention.key_length",
                     "attention.value_length", "attention.sliding_window", "rope.dimension_count",
                     "rope.scaling.original_context_length", "expert_count", "expert_used_count"), _INT),
    **dict.fromkeys(("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa", "rope.scaling.factor",
                     "rope.scale_linear", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_beta_fast",
                     "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_attn_factor",
                     "rope.scaling.attn_factor", "attn_logit_softcapping", "final_logit_softcapping"), _NUMBER),
    "rope.scaling.finetuned": _BOOL,
    **dict.fromkeys(("rope.scaling.type", "tensor_data_layout"), _STR),
}
_OTHER_KEY_KINDS = {
    **{key: _INT for key in _TOKENIZER_KEYS if key.endswith("_token_id")},
    **dict.fromkeys(("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_sep_token",
                     "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.remove_extra_whitespaces"), _BOOL),
    **dict.fromkeys(("general.architecture", "general.type", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                     "tokenizer.chat_template", "tokenizer.huggingface.json"), _STR),
    "split.count": _INT,
}
_PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length",  # read by _scalar
                   "attention.sliding_window")  # an array: refused later, naming what is supported
_IS_KIND = {_INT: lambda v: isinstance(v, int) and not isinstance(v, bool),
            _NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            _BOOL: lambda v: isinstance(v, bool), _STR: lambda v: isinstance(v, str)}


def _check_key_types(reader, arch: str, path) -> None:
    """Refuse a metadata value of the wrong type, naming the key (per-layer arrays of the numeric keys pass)."""
    for key, field in reader.fields.items():
        kind = _OTHER_KEY_KINDS.get(key)
        if kind is None and key.startswith(f"{arch}."):
            kind = _ARCH_KEY_KINDS.get(key[len(arch) + 1:])
        if kind is None:
            continue
        value = field.contents()
        per_layer = key[len(arch) + 1:] in _PER_LAYER_KEYS and key.startswith(f"{arch}.")
        values = value if isinstance(value, list) and per_layer else [value]
        if not values or not all(map(_IS_KIND[kind], values)):
            raise GGUFMetadataError(f"{path}: {key} = {value!r} must be {kind}"
                                    + (" (or a per-layer array of them)" if per_layer else ""))


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q/k projections (``[n_head*D, ...]``: weights or biases).

    llama.cpp's converter interleaves the two rotary halves of each head for its
    pairwise RoPE; the Hugging Face layout (rotate-half) is restored with
    ``n_head`` = query heads for q and KV heads for k.
    """
    out_dim = w.shape[0]
    head_dim = out_dim // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def packed_key(name: str, qtype: str) -> str:
    """Key of a weight's raw GGUF rows in the weights dict: ``"<name>_<qtype>"``, lower case.

    E.g. ``model.layers.0.self_attn.q_proj.weight_q4_1`` (uint8 ``[Out, In/32*20]``).
    """
    return f"{name}_{qtype.lower()}"


def split_packed_key(key: str) -> tuple[str, str | None]:
    """``(name, qtype)`` of a :func:`packed_key`, or ``(key, None)`` for a float weight's key."""
    for qtype in QUANT_TYPES:
        suffix = f"_{qtype.lower()}"
        if key.endswith(suffix):
            return key[: -len(suffix)], qtype
    return key, None


@dataclasses.dataclass(frozen=True)
class _Entry:
    offset: int            # of the tensor's data in the file
    n_bytes: int
    qtype: str             # the GGUF type name
    shape: tuple[int, ...]  # (out, in) or (n,)
    heads: int | None      # undo llama.cpp's q/k row permutation with this many heads
    blocks: bool           # keep the raw rows (else dequantize to float32)


class GGUFWeights(MutableMapping):
    """The weights of a GGUF file by Hugging Face name, each read from the file when accessed.

    A value is a float32 array, or for keys made by :func:`packed_key` the uint8 raw rows
    ``[out, row bytes]``; llama.cpp's q/k row permutation is undone on both. Reading uses
    plain file reads (no memory map), so a tensor takes memory only while the caller holds
    it. Deleting a key forgets it (the loader deletes what it has placed in the model).
    """

    def __init__(self, path: Path, entries: dict[str, _Entry]):
        self.path = Path(path)
        self._entries = dict(entries)

    def __getitem__(self, key: str) -> np.ndarray:
        import gguf

        e = self._entries[key]
        raw = np.fromfile(self.path, dtype=np.uint8, count=e.n_bytes, offset=e.offset)
        if raw.size != e.n_bytes:
            raise ValueError(f"{self.path} is truncated: tensor {key} needs {e.n_bytes} bytes at offset {e.offset}")
        if e.blocks:
            w = raw.reshape(e.shape[0], -1)
        else:
            rows = raw.reshape(e.shape[0], -1) if len(e.shape) == 2 else raw
            w = np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[e.qtype]), np.float32)
            w = w.reshape(e.shape)
        return w if e.heads is None else unpermute_rope_rows(w, e.heads)

    def __setitem__(self, key, value):
        raise TypeError("GGUFWeights is read-only (keys can only be deleted)")

    def __delitem__(self, key: str) -> None:
        del self._entries[key]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def qtype(self, key: str) -> str:
        """The GGUF type name of a key's tensor."""
        return self._entries[key].qtype


def _without_llama_cpp_exceptions(reader, eos_ids: list[int]) -> list[int]:
    """``eos_ids`` without those llama.cpp does not end generation at although declared (a declared
    ``<|end|>`` beside ``<|return|>`` and ``<|call|>``: :func:`gguf_tokenizer.not_end_of_generation`),
    so that the config's stop ids agree with the tokenizer's. The vocabulary is read only when a
    declared id is one of those texts."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None or not eos_ids:
        return eos_ids
    n = len(field.data)
    if not any(0 <= i < n and str(field.contents(i)) in ("<|end|>", "</s>") for i in eos_ids):
        return eos_ids
    tokens = [str(t) for t in field.contents()]
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    keys = {k: _field(reader, k) for k in reader.fields if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")}
    if len(types) != len(tokens):  # the tokenizer names this malformation
        return eos_ids
    dropped = gguf_tokenizer.not_end_of_generation(keys, tokens, [int(t) for t in types])
    return [i for i in eos_ids if i not in dropped]


def _field(reader, name, default=None):
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def _required(reader, name, path):
    value = _field(reader, name)
    if value is None:
        raise GGUFMetadataError(f"{path} has no {name!r} metadata key, which a {_field(reader, 'general.architecture')}"
                                " model needs")
    return value


def _scalar(reader, key: str, arch: str, path, default=None, required: bool = False):
    """``<arch>.<key>``: a number, or a per-layer array whose entries are all equal (llama.cpp writes both)."""
    name = f"{arch}.{key}"
    value = _required(reader, name, path) if required else _field(reader, name, default)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise UnsupportedConfigError(
                f"{path}: {name} = {value} differs between layers; per-layer values are not implemented")
        value = value[0]
    return value


def _check_keys(reader, arch: str, path) -> None:
    """Refuse metadata this reader does not implement (a key could change the computation), or of the wrong type."""
    _check_key_types(reader, arch, path)
    general_type = _field(reader, "general.type")
    if general_type not in (None, "model"):
        raise UnsupportedConfigError(f"{path} is a GGUF {general_type!r} (general.type), not a model")
    split_count = _field(reader, "split.count")
    if split_count is not None and int(split_count) > 1:
        raise UnsupportedConfigError(
            f"{path} is one part of a split GGUF (split.count = {split_count}); merge the parts first "
            "(llama-gguf-split --merge)")
    unknown = []
    for key in reader.fields:
        if key.startswith("GGUF."):
            continue
        if key.startswith(f"{arch}."):
            if key[len(arch) + 1:] not in _ARCH_KEYS and key[len(arch) + 1:] not in _ARCH_ONLY_KEYS.get(arch, ()):
                unknown.append(key)
        elif key.startswith("tokenizer."):
            if key not in _TOKENIZER_KEYS and not key.startswith("tokenizer.chat_template."):
                unknown.append(key)
    if unknown:
        raise UnsupportedConfigError(
            f"{path}: metadata key(s) {', '.join(map(repr, sorted(unknown)))} are not implemented "
            "(they may change the computation)")
    for key in ("expert_count", "expert_used_count"):
        value = _field(reader, f"{arch}.{key}")
        if value is not None and int(value) != 0:
            raise UnsupportedConfigError(f"{path}: {arch}.{key} = {value}: mixture-of-experts models are not supported")


def read_gguf(path: str | Path) -> tuple[LlamaConfig, GGUFWeights, dict, np.ndarray | None]:
    """Parse a GGUF file of a Llama-family model (``llama``, ``qwen2``, ``qwen3``, ``smollm3``, ``phi3``,
    ``gemma2``, ``gemma3``).

    The weights come in the Hugging Face ``(out, in)`` layout and naming
    (``model.layers.{i}.self_attn.q_proj.weight``...), as a :class:`GGUFWeights` mapping
    that reads each tensor from the file when it is accessed (nothing is held twice).
    Matrices stored in a type of :data:`magicpig_jax.io.gguf_blocks.QUANT_TYPES` (F16,
    BF16, Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K) come as their raw rows, uint8 ``[out, in /
    block_weights * block_bytes]`` under :func:`packed_key` (no float32 copy: the model
    reads them as they are); every other tensor is dequantized to float32 by
    ``gguf.quants.dequantize`` under its own name.

    Returns:
      ``(config, weights, tokenizer_metadata, rope_freq_factors)``.

    Raises:
      FileNotFoundError: no such file.
      GGUFMetadataError (a ValueError): a required metadata key is missing (named).
      UnsupportedConfigError (a ValueError): ``general.architecture`` is not supported
        (the message lists the supported ones), or a metadata key, value or tensor is
        not implemented (named).
      ValueError: not a GGUF file.
    """

    path = Path(path)
    reader = _open_reader(path, take=True)
    arch = _architecture(reader, path)
    config, tensors = _config(reader, arch, path)
    _check_layout(reader, path)
    entries, freq_factors = _entries(tensors, arch, config, path)
    # the tokenizer's fields, and the model's name: llama.cpp sets some token attributes by it
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.") or k == "general.name"}
    return config, GGUFWeights(path, entries), meta, freq_factors


def read_gguf_config(path: str | Path) -> LlamaConfig:
    """The :class:`LlamaConfig` of a GGUF file from its header alone (no tensor is read).

    Raises:
      as :func:`read_gguf`, for the metadata.
    """
    path = Path(path)
    reader = _open_reader(path)
    config, _ = _config(reader, _architecture(reader, path), path)
    # the load that usually follows (the CLI checks a model's config before loading it) takes this
    # parse instead of parsing the header again
    _PARSED.clear()
    _PARSED[_file_key(path)] = reader
    return config


def _reader_class():
    """``gguf.GGUFReader`` whose field parser slices a plain ndarray view of the file's memory map.

    The reader parses every metadata value (a tokenizer's vocabulary and merges: about 100,000
    strings) by slicing its ``np.memmap``, whose ``__getitem__`` and ``__array_finalize__`` run
    Python code on each slice; most of a model's load went there. Here ``_get`` (the reader's one
    primitive read, reimplemented with the same arguments and results) slices the same bytes as a
    plain ndarray: the fields and the tensors' data are the same zero-copy views of the mapped
    file. llama.cpp's gguf-py has the same change proposed upstream (ggml-org/llama.cpp#13378).
    """
    global _READER
    if _READER is None:
        import gguf

        class _PlainViewReader(gguf.GGUFReader):
            def _get(self, offset, dtype, count=1, override_order=None):
                plain = self.__dict__.get("_plain")
                if plain is None:  # self.data, the np.memmap, is set before the first read
                    plain = self._plain = self.data.view(np.ndarray)
                count, dt = int(count), np.dtype(dtype)
                arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
                return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        _READER = _PlainViewReader
    return _READER


_READER = None
# The reader of the last read_gguf_config, for the read_gguf of the same unchanged file: at most one,
# handed over (not kept) by the load, since a parsed vocabulary holds tens of MB of small arrays.
_PARSED: dict[tuple, object] = {}


def _file_key(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _open_reader(path: Path, take: bool = False):
    """The ``gguf.GGUFReader`` of ``path``, with errors that say what is wrong with the file.

    ``take``: reuse (and drop) the parse of read_gguf_config's for the same unchanged file.
    """
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist" if not path.exists()
                                else f"model file {path} is not a regular file (a .gguf file was expected)")
    if take and _PARSED:
        parsed = _PARSED.pop(_file_key(path), None)
        _PARSED.clear()
        if parsed is not None:
            return parsed
    try:
        reader = _reader_class()(str(path))
    except Exception as err:  # gguf raises ValueError/struct errors on bad magic
        with open(path, "rb") as f:
            head = f.read(24)
        size = path.stat().st_size
        if not (head[:4] == b"GGUF" or (len(head) < 4 and b"GGUF".startswith(head))):
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)") from err
        if len(head) < 24:
            raise ValueError(f"{path} is a truncated GGUF file ({size} bytes; its header alone needs 24)") from err
        version = int.from_bytes(head[4:8], "little")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)") from err
        counts = {"tensor_count": int.from_bytes(head[8:16], "little"), "kv_count": int.from_bytes(head[16:24],
                                                                                                   "little")}
        bad = [f"{k} = {v}" for k, v in counts.items() if v > size]  # each entry takes more than a byte
        if bad:
            raise ValueError(f"{path} has a corrupt GGUF header ({', '.join(bad)} in a file of {size} bytes)") from err
        # a valid start whose header or tensor data runs past the end: a partial download or copy
        raise ValueError(f"{path} is a truncated GGUF file ({size} bytes; its header and tensors need more), or its "
                         f"header is corrupt: {err}") from err
    if getattr(reader, "byte_order", "I") != "I":
        # gguf-py swaps the metadata but the tensors are read as raw bytes of this machine's order:
        # finite, silently wrong weights. llama.cpp refuses such a file too.
        raise UnsupportedConfigError(
            f"{path} is a GGUF file of the other byte order (big-endian on this little-endian machine, or the "
            "reverse); its tensors would be read wrong. Use the file made for this byte order")
    return reader


def _architecture(reader, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise GGUFMetadataError(f"{path} has no 'general.architecture' metadata key")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedConfigError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _config(reader, arch: str, path: Path) -> tuple[LlamaConfig, dict]:
    """The :class:`LlamaConfig` of the metadata and the tensors by name; refuses what is not implemented."""
    _check_keys(reader, arch, path)
    n_head = int(_scalar(reader, "attention.head_count", arch, path, required=True))
    n_kv = int(_scalar(reader, "attention.head_count_kv", arch, path, default=n_head))
    hidden = int(_required(reader, f"{arch}.embedding_length", path))
    n_layers = int(_required(reader, f"{arch}.block_count", path))
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise UnsupportedConfigError(f"{path} has no token_embd.weight tensor")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # gguf shapes are (in, out): (hidden, vocab)
    declared_vocab = _field(reader, f"{arch}.vocab_size")
    if declared_vocab is not None and int(declared_vocab) != vocab:
        raise GGUFMetadataError(f"{path}: {arch}.vocab_size = {declared_vocab} but token_embd.weight has {vocab} rows")
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is None and "blk.0.attn_q.weight" in tensors:
        key_length = int(tensors["blk.0.attn_q.weight"].shape[-1]) // n_head
    head_dim = int(key_length if key_length is not None else hidden // n_head)
    value_length = _field(reader, f"{arch}.attention.value_length")
    if value_length is not None and int(value_length) != head_dim:
        raise UnsupportedConfigError(
            f"{path}: {arch}.attention.value_length = {value_length} differs from the key length {head_dim}")
    rope_dims = _field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) < head_dim and (arch != "phi3" or int(rope_dims) % 2
                                                                or int(rope_dims) < 2):
        # llama.cpp's phi3 rotates the leading rope.dimension_count dims (NEOX), as transformers' Phi3
        raise UnsupportedConfigError(
            f"{path}: {arch}.rope.dimension_count = {rope_dims} < head dim {head_dim}: partial RoPE is not implemented"
            + (" (an even count of at least 2 is)" if arch == "phi3" else f" for {arch}"))
    if rope_dims is not None and int(rope_dims) > head_dim:
        raise GGUFMetadataError(
            f"{path}: {arch}.rope.dimension_count = {rope_dims} exceeds the head dim {head_dim}")
    rope_dim = int(rope_dims) if rope_dims is not None and int(rope_dims) < head_dim else None
    scaling = _longrope(reader, tensors, arch, path, rope_dim or head_dim)
    if scaling is None:
        scaling = _rope_scaling(reader, arch, path)
    if "rope_freqs.weight" in tensors and arch == "llama" and scaling is not None and \
            dict(scaling)["rope_type"] != "linear":
        # llama.cpp divides by the factors inside its YaRN; models.rope takes them with a linear scaling only
        raise UnsupportedConfigError(f"{path}: the rope_freqs.weight tensor with a {dict(scaling)['rope_type']!r} "
                                     f"RoPE scaling ({arch}.rope.scaling.type) is not implemented (only with none "
                                     "or linear)")
    context = int(_required(reader, f"{arch}.context_length", path))
    if not 1 <= context <= MAX_POSITIONS:
        raise GGUFMetadataError(f"{path}: {arch}.context_length = {context} must be in [1, {MAX_POSITIONS}]")
    if scaling is not None and dict(scaling)["rope_type"] == "yarn":
        context = yarn_context_length(dict(scaling), context)
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _field(reader, key)
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    eos_ids = _without_llama_cpp_exceptions(reader, eos_ids)
    window = _field(reader, f"{arch}.attention.sliding_window")
    nope = tuple(i for i in range(n_layers) if (i + 1) % _SMOLLM3_NOPE_STEP == 0) if arch == "smollm3" else ()
    if window is not None and (isinstance(window, (bool, str, list)) or int(window) != window):
        raise UnsupportedConfigError(f"{path}: {arch}.attention.sliding_window = {window!r}: only one integer "
                                     "window for the model is supported (not one per layer)")
    if window is not None and not 0 <= int(window) <= MAX_POSITIONS:
        raise GGUFMetadataError(f"{path}: {arch}.attention.sliding_window = {int(window)} must be in "
                                f"[0, {MAX_POSITIONS}] (0: no window)")
    if arch in ("qwen2", "qwen3") and window is not None and 0 < int(window) < context:
        # transformers slides only the layers from max_window_layers on, and only with use_sliding_window,
        # neither of which a GGUF records; llama.cpp ignores the key: any choice of layers would be a guess
        raise UnsupportedConfigError(
            f"{path}: {arch}.attention.sliding_window = {int(window)} (shorter than the context, {context}): a "
            f"{arch} GGUF does not say which layers slide (transformers: use_sliding_window and max_window_layers) "
            "and llama.cpp ignores the key; load the Hugging Face directory, or remove the key for full attention")
    has = {name.split(".", 2)[2] for name in tensors if name.startswith("blk.0.")}
    if arch == "qwen2" and "attn_q.bias" not in has:
        raise UnsupportedConfigError(f"{path}: a qwen2 model needs q/k/v biases; blk.0.attn_q.bias is missing")
    if arch == "qwen3" and "attn_q_norm.weight" not in has:
        raise UnsupportedConfigError(f"{path}: a qwen3 model needs q/k norms; blk.0.attn_q_norm.weight is missing")
    gemma = {}
    if arch == "gemma3":
        if window is None or int(window) == 0:
            # every Gemma 3 checkpoint has a window; llama.cpp would run such a file with full attention
            # in every layer, which is no Gemma 3 that transformers computes: refused
            raise GGUFMetadataError(f"{path}: a gemma3 model needs {arch}.attention.sliding_window > 0")
        kind = dict(scaling or {}).get("rope_type", "default")
        if kind not in ("default", "linear"):  # what Gemma 3 ships; transformers' Gemma 3 takes no other here
            raise UnsupportedConfigError(f"{path}: {arch}.rope.scaling.type {kind!r} is not supported for gemma3 "
                                         "(none or linear, on the full-attention layers)")
        # llama.cpp: 1/sqrt(float(n_embd / n_head)) with integer division at 62 layers (Gemma-3-27B:
        # 5376 / 32 = 168, its query_pre_attn_scalar), else 1/sqrt(head dim)
        gemma = dict(hidden_act="gelu_tanh", sandwich_norms=True, embedding_scale=math.sqrt(hidden),
                     query_scale=(hidden // n_head if n_layers == _GEMMA3_27B_LAYERS else head_dim) ** -0.5,
                     local_rope_theta=float(_number(reader, f"{arch}.rope.freq_base_swa", path)
                                            if _field(reader, f"{arch}.rope.freq_base_swa") is not None
                                            else _GEMMA3_LOCAL_BASE),
                     sliding_layers=tuple(i for i in range(n_layers) if (i + 1) % _GEMMA3_FULL_EVERY))
    if arch == "gemma2":
        window, gemma = _gemma2_fields(reader, path, window, scaling, hidden, n_head, n_layers, head_dim)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_scalar(reader, "feed_forward_length", arch, path, required=True)),
        num_layers=n_layers,
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensors,
        eos_token_ids=tuple(eos_ids),
        qkv_bias="attn_q.bias" in has,
        o_bias="attn_output.bias" in has,
        qk_norm="attn_q_norm.weight" in has,
        sliding_window=None if window is None or int(window) == 0 else int(window),
        # a window covers every layer of a llama file (Mistral's rule: the key names no layer; a qwen2/qwen3
        # file with a window that binds is refused above) and
        # SmolLM3's NoPE layers (transformers' default layer_types); llama.cpp ignores the key there;
        # gemma3: the layers llama.cpp slides
        sliding_layers=nope if arch == "smollm3" else gemma.pop("sliding_layers", None),
        nope_layers=nope,
        rope_dim=rope_dim,
        **gemma,
    ), tensors


def _gemma2_fields(reader, path: Path, window, scaling, hidden: int, n_head: int, n_layers: int,
                   head_dim: int) -> tuple[int, dict]:
    """``(window, LlamaConfig fields)`` of a gemma2 file, as llama.cpp reads it: the window (4096 without
    the key), every other layer sliding from the first, the attention and output logits soft-capped
    (50 and 30 without the keys), norms stored as ``1 + w`` by the converter, embeddings times
    sqrt(hidden), and the query scale 1/sqrt(head dim) but 1/sqrt(hidden // heads) at 46 layers (27B).

    Raises:
      GGUFMetadataError: a window of 0 (llama.cpp would mask every key of the sliding layers) or a
        soft-capping value outside :data:`~magicpig_jax.attention._common.SOFTCAP_RANGE`.
      UnsupportedConfigError: a RoPE scaling other than none and linear.
    """
    arch = "gemma2"
    window = _GEMMA2_WINDOW if window is None else int(window)
    if window == 0:
        raise GGUFMetadataError(f"{path}: a gemma2 model needs {arch}.attention.sliding_window > 0")
    kind = dict(scaling or {}).get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise UnsupportedConfigError(f"{path}: {arch}.rope.scaling.type {kind!r} is not supported for gemma2 "
                                     "(none or linear)")
    caps = {}
    for key, default in (("attn_logit_softcapping", _GEMMA2_ATTN_SOFTCAP),
                         ("final_logit_softcapping", _GEMMA2_FINAL_SOFTCAP)):
        value = _field(reader, f"{arch}.{key}")
        value = default if value is None else _number(reader, f"{arch}.{key}", path)
        lo, hi = SOFTCAP_RANGE
        if not lo <= value <= hi:  # NaN included
            raise GGUFMetadataError(f"{path}: {arch}.{key} = {value!r} must be a number in [{lo:g}, {hi:g}]")
        caps[key] = float(value)
    return window, dict(hidden_act="gelu_tanh", sandwich_norms=True, embedding_scale=math.sqrt(hidden),
                        query_scale=(hidden // n_head if n_layers == _GEMMA2_27B_LAYERS else head_dim) ** -0.5,
                        attn_logit_softcap=caps["attn_logit_softcapping"],
                        final_logit_softcap=caps["final_logit_softcapping"],
                        sliding_layers=tuple(range(0, n_layers, 2)))


_LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def _longrope(reader, tensors: dict, arch: str, path: Path, head_dim: int) -> tuple | None:
    # head_dim: the dimensions RoPE rotates (rope.dimension_count under partial RoPE)
    """A phi3 file's LongRoPE (Phi-3 128K, Phi-3.5) as a normalized "longrope" scaling, or None.

    llama.cpp's converter writes the short and long factors as the tensors
    ``rope_factors_short``/``rope_factors_long`` (float ``[D/2]``), the pretrained context as
    ``rope.scaling.original_context_length`` and transformers' attention factor as
    ``rope.scaling.attn_factor`` (absent: 1, as llama.cpp reads such a file). Which factors a
    token uses follows transformers (by the prompt's length, then each decode step's position:
    :func:`magicpig_jax.models.llama.rope_frequencies`); llama.cpp picks one set for a whole run
    by its context size.

    Raises:
      UnsupportedConfigError: only one of the two tensors, or LongRoPE tensors in another
        architecture, or together with another ``rope.scaling.type``.
      GGUFMetadataError: factors that are not ``[D/2]`` finite values > 0, or no original context.
    """
    import gguf

    present = [n for n in _LONGROPE_TENSORS if n in tensors]
    if not present:
        return None
    if arch != "phi3" or len(present) != 2:
        raise UnsupportedConfigError(f"{path}: LongRoPE tensor(s) {', '.join(present)} are supported as the pair "
                                     "rope_factors_short/long of a phi3 model only")
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise UnsupportedConfigError(f"{path}: {arch}.rope.scaling.type = {kind!r} together with LongRoPE's factors")
    key, linear = _first_number(reader, (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"), path)
    if linear is not None and float(linear) not in (0.0, 1.0):  # llama.cpp would scale on top: not read here
        raise UnsupportedConfigError(f"{path}: {key} = {linear!r} together with LongRoPE's factors is not supported")
    factors = {}
    for name in _LONGROPE_TENSORS:
        t = tensors[name]
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
        if values.shape != (head_dim // 2,) or not (np.isfinite(values).all() and (values > 0).all()):
            raise GGUFMetadataError(
                f"{path}: {name} must hold the rotated dims / 2 = {head_dim // 2} finite values > 0")
        factors[name.split("_")[2].split(".")[0] + "_factor"] = values.tolist()
    orig = _number(reader, f"{arch}.rope.scaling.original_context_length", path)
    if orig is None:
        _required(reader, f"{arch}.rope.scaling.original_context_length", path)
    attn = _number(reader, f"{arch}.rope.scaling.attn_factor", path)
    if attn is None:  # llama.cpp then scales by 1 (transformers would derive one: the file says none)
        attn = 1.0
    try:
        return normalize_rope_scaling({"rope_type": "longrope", **factors, "original_max_position_embeddings": orig,
                                       "attention_factor": attn})
    except ValueError as err:
        raise GGUFMetadataError(f"{path}: {err}") from None


# llama.cpp's YaRN constants for these architectures (``llama_cparams`` defaults): it reads
# the ``rope.scaling.yarn_*`` keys only for other architectures, so a file that sets them
# to other values would run differently there and under transformers.
_YARN_DEFAULTS = {"yarn_ext_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_log_multiplier": 0.0}


def _number(reader, key: str, path: Path):
    """A numeric metadata value or None; a string, bool or array is refused naming the key."""
    value = _field(reader, key)
    if value is not None and (isinstance(value, (bool, str, list)) or not isinstance(value, (int, float))):
        raise GGUFMetadataError(f"{path}: {key} = {value!r} must be a number")
    return value


def _first_number(reader, keys: tuple[str, ...], path: Path):
    """``(key, value)`` of the first of ``keys`` present (a newer name, then an older one), or ``(None, None)``."""
    for key in keys:
        value = _number(reader, key, path)
        if value is not None:
            return key, value
    return None, None


def _rope_scaling(reader, arch: str, path: Path) -> tuple | None:
    """The RoPE scaling as llama.cpp reads it: ``None``, linear or YaRN (a normalized tuple).

    llama.cpp takes an absent ``rope.scaling.type`` as "linear" and divides the
    frequencies by ``rope.scaling.factor`` (or the older ``rope.scale_linear``)
    whenever one is given; a factor of 0 means no scaling, and type "none" never
    scales (``llama_model::load_hparams``, ``llama_context``). Type "yarn" (Qwen2.5/Qwen3
    converted with their long-context ``rope_scaling``) takes the same factor and
    ``rope.scaling.original_context_length`` (default: ``context_length``), with the ramp
    bounds 32 and 1 and the attention factor ``1 + 0.1 ln(factor)`` of llama.cpp's
    ``rope_yarn``, which equal transformers' defaults.

    Raises:
      UnsupportedConfigError: another scaling type; ``rope.scaling.yarn_*`` values other
        than llama.cpp's constants, or a ``rope.scaling.attn_factor`` other than 1 (named).
      GGUFMetadataError: a factor or original length that is not a finite number >= 0 / a
        positive integer, or an extended context past int32 positions.
    """
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none", "linear", "yarn"):
        raise UnsupportedConfigError(
            f"{path}: {arch}.rope.scaling.type = {scaling_type!r} is not implemented (supported: none, linear, "
            "yarn; Llama 3.1 scaling comes as the rope_freqs.weight tensor)")
    attn_factor = _number(reader, f"{arch}.rope.scaling.attn_factor", path)
    if attn_factor is not None and float(attn_factor) != 1.0:
        raise UnsupportedConfigError(
            f"{path}: {arch}.rope.scaling.attn_factor = {attn_factor!r} is not implemented (only 1)")
    key, factor = _first_number(reader, (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"), path)
    if scaling_type in ("linear", "yarn") and factor is None:
        _required(reader, f"{arch}.rope.scaling.factor", path)
    if factor is None or scaling_type == "none":
        return None
    if not math.isfinite(float(factor)) or float(factor) < 0:
        raise GGUFMetadataError(f"{path}: {key} = {factor!r} must be a finite number >= 0 (0: no scaling)")
    if float(factor) == 0:
        return None
    if scaling_type != "yarn":
        return (("factor", float(factor)), ("rope_type", "linear"))
    for name, default in _YARN_DEFAULTS.items():
        value = _number(reader, f"{arch}.rope.scaling.{name}", path)
        if value is not None and float(value) != default:
            raise UnsupportedConfigError(
                f"{path}: {arch}.rope.scaling.{name} = {value!r} is not supported (llama.cpp does not read it for "
                f"{arch} models and uses {default})")
    mscale = 1.0 + 0.1 * math.log(float(factor)) if float(factor) > 1 else 1.0
    value = _number(reader, f"{arch}.rope.scaling.yarn_attn_factor", path)
    if value is not None and not math.isclose(float(value), mscale, rel_tol=1e-6):
        # llama.cpp's converter writes transformers' attention_factor here; llama.cpp does not read it
        raise UnsupportedConfigError(
            f"{path}: {arch}.rope.scaling.yarn_attn_factor = {value!r} is not supported (llama.cpp does not read "
            f"it for {arch} models and uses 1 + 0.1 ln(factor) = {mscale:.6g})")
    orig_key, orig = _first_number(
        reader, (f"{arch}.rope.scaling.original_context_length", f"{arch}.context_length"), path)
    if orig is None:
        _required(reader, f"{arch}.context_length", path)
    if not 1 <= orig <= MAX_POSITIONS or float(orig) != int(orig):
        raise GGUFMetadataError(f"{path}: {orig_key} = {orig!r} must be a positive integer <= {MAX_POSITIONS}")
    try:
        scaling = normalize_rope_scaling({"rope_type": "yarn", "factor": float(factor),
                                          "original_max_position_embeddings": int(orig)})
        yarn_context_length(dict(scaling), 1)
    except ValueError as err:
        raise GGUFMetadataError(f"{path}: {err}") from None
    return scaling


def _check_layout(reader, path: Path) -> None:
    """Refuse a header whose tensors' data do not follow each other (llama.cpp's rule, ``gguf.cpp``).

    Each tensor's data starts where the previous one's (in the header's order) ends, padded to
    ``general.alignment``. A tensor whose type or shape was changed in the header without its data
    (a corrupt or hand-edited file) breaks the chain, unless it is the last tensor or its size
    changed within the alignment padding (llama.cpp's check has the same reach); without this
    check it would be read from the wrong bytes, finite and silently wrong.

    Raises:
      GGUFMetadataError: the first tensor that does not start where it should (named).
    """
    def described(t) -> str:
        return f"{t.name} ({t.tensor_type.name}, shape {tuple(int(n) for n in reversed(t.shape))})"

    align, base, expected, before = int(reader.alignment), int(reader.data_offset), 0, None
    for t in reader.tensors:
        start = int(t.data_offset) - base
        if start != expected and before is None:
            raise GGUFMetadataError(f"{path}: the first tensor, {described(t)}, starts at byte {start} of the data, "
                                    "not at 0 (a corrupt file; llama.cpp refuses it too)")
        if start != expected:
            raise GGUFMetadataError(
                f"{path}: tensor {described(t)} starts at byte {start} of the data, but the tensors before it end "
                f"at {expected}: the header's type or shape of {described(before)} does not match the data, or "
                "this tensor's offset is wrong (a corrupt file; llama.cpp refuses it too)")
        expected, before = start + -(-int(t.n_bytes) // align) * align, t


_DEQUANTIZABLE: dict[str, bool] = {}


def _check_dequantizable(t, path: Path) -> None:
    """Refuse a tensor of a type neither our kernels nor ``gguf.quants.dequantize`` read (named)."""
    import gguf

    qtype = t.tensor_type.name
    if qtype in QUANT_TYPES or qtype == "F32":
        return
    if qtype not in _DEQUANTIZABLE:
        _, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        try:  # one zero block: gguf-py raises NotImplementedError for a type it cannot dequantize
            gguf.quants.dequantize(np.zeros(block_bytes, np.uint8), t.tensor_type)
            _DEQUANTIZABLE[qtype] = True
        except NotImplementedError:
            _DEQUANTIZABLE[qtype] = False
    if not _DEQUANTIZABLE[qtype]:
        raise UnsupportedConfigError(
            f"{path}: tensor {t.name} is of type {qtype}, which cannot be read (supported: F32, "
            f"{', '.join(QUANT_TYPES)}, and the types gguf-py dequantizes, e.g. Q2_K, Q3_K, IQ4_NL)")


def _entries(tensors: dict, arch: str, config: LlamaConfig, path: Path) -> tuple[dict, np.ndarray | None]:
    """Where each tensor lies in the file, under its Hugging Face name; Llama 3.1's RoPE factors."""
    import gguf

    n_layers, n_head, n_kv = config.num_layers, config.num_heads, config.num_kv_heads
    layer_names = _ARCH_LAYER_NAMES[arch]
    entries: dict[str, _Entry] = {}
    freq_factors = None
    for name, t in tensors.items():
        _check_dequantizable(t, path)
        if name in _LONGROPE_TENSORS and config.longrope_switch is not None:
            continue  # in the config's LongRoPE scaling (_longrope)
        if name == "rope_freqs.weight" and arch == "llama":
            freq_factors = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(-1)
            if freq_factors.shape != (config.head_dim // 2,):
                raise UnsupportedConfigError(
                    f"{path}: rope_freqs.weight has {freq_factors.size} entries; RoPE needs head dim / 2 = "
                    f"{config.head_dim // 2}")
            if not (np.isfinite(freq_factors).all() and (freq_factors > 0).all()):
                raise GGUFMetadataError(f"{path}: rope_freqs.weight holds a factor that is not finite and > 0")
            continue
        if name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in layer_names or not idx.isdigit() or int(idx) >= n_layers:
                raise UnsupportedConfigError(f"unexpected tensor {name} in {path} for a {arch} model")
            if isinstance(layer_names[rest], tuple):  # fused: one entry per part, by rows
                entries.update(_fused_entries(t, [f"model.layers.{int(idx)}.{part}" for part in layer_names[rest]],
                                              config, path))
                continue
            key = f"model.layers.{int(idx)}.{layer_names[rest]}"
        elif name in _GLOBAL_NAMES:
            key = _GLOBAL_NAMES[name]
        else:
            raise UnsupportedConfigError(f"unexpected tensor {name} in {path} for a {arch} model")
        qtype = t.tensor_type.name
        shape = tuple(int(n) for n in reversed(t.shape))  # gguf shapes are (in, out): rows last
        heads = None
        if arch in _PERMUTED_ARCHITECTURES and name.startswith("blk."):
            rest = name.split(".", 2)[2]
            if rest.startswith(("attn_q.", "attn_k.")):
                heads = n_head if rest.startswith("attn_q.") else n_kv
                if shape[0] != heads * config.head_dim:  # before undoing llama.cpp's row permutation by heads
                    raise UnsupportedConfigError(
                        f"{path}: tensor {name} has {shape[0]} rows; {heads} heads of dim {config.head_dim} = "
                        f"{heads * config.head_dim} expected")
        blocks = qtype in QUANT_TYPES and len(shape) == 2
        entry = _Entry(int(t.data_offset), int(t.n_bytes), qtype, shape, heads, blocks)
        entries[packed_key(key, qtype) if blocks else key] = entry
    _check_tensors_present(tensors, arch, config, path)
    return entries, freq_factors


def _fused_entries(t, keys: list[str], config: LlamaConfig, path: Path) -> dict[str, _Entry]:
    """The parts of a fused matrix (phi3's ``attn_qkv``, ``ffn_up``) as entries of consecutive rows.

    Raises:
      UnsupportedConfigError: the tensor is not a matrix of the rows its parts need (named).
    """
    D = config.head_dim
    rows_of = {"q_proj": config.num_heads * D, "k_proj": config.num_kv_heads * D, "v_proj": config.num_kv_heads * D,
               "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    sizes = [rows_of[key.rsplit(".", 2)[-2]] for key in keys]
    shape = tuple(int(n) for n in reversed(t.shape))
    if len(shape) != 2 or shape[0] != sum(sizes) or int(t.n_bytes) % shape[0]:
        raise UnsupportedConfigError(f"{path}: tensor {t.name} has shape {shape}; {sum(sizes)} rows "
                                     f"({' + '.join(map(str, sizes))}) of {config.hidden_size} expected")
    qtype = t.tensor_type.name
    blocks = qtype in QUANT_TYPES
    row_bytes = int(t.n_bytes) // shape[0]
    out, start = {}, 0
    for key, rows in zip(keys, sizes, strict=True):
        entry = _Entry(int(t.data_offset) + start * row_bytes, rows * row_bytes, qtype, (rows, shape[1]), None, blocks)
        out[packed_key(key, qtype) if blocks else key] = entry
        start += rows
    return out


def _check_tensors_present(tensors: dict, arch: str, config: LlamaConfig, path: Path) -> None:
    """Refuse, from the header alone, a GGUF that lacks a tensor every layer of ``arch`` needs."""
    per_layer = list(_ARCH_LAYER_NAMES[arch]) if arch in ("phi3", "gemma2", "gemma3") else list(_LAYER_NAMES)
    per_layer += list(_QK_NORM_NAMES) if arch == "qwen3" else []
    needed = ["token_embd.weight", "output_norm.weight"]  # output.weight absent = tied embeddings
    needed += [f"blk.{i}.{rest}" for i in range(config.num_layers) for rest in per_layer]
    missing = [name for name in needed if name not in tensors]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise GGUFMetadataError(
            f"{path} lacks tensor(s) a {config.num_layers}-layer {arch} model needs: {shown} (it lists "
            f"{len(tensors)} tensors; a truncated or corrupt header lists fewer)")
